"""Small forward + backward passes through the GRN CUDA kernels (ffi/grn.cu), for compute-sanitizer.

Run on the GPU machine, e.g.:
    compute-sanitizer --tool memcheck  python tests/gpu_sanitize_grn.py
    compute-sanitizer --tool racecheck python tests/gpu_sanitize_grn.py
    compute-sanitizer --tool racecheck python tests/gpu_sanitize_grn.py selection head   # some cases only
Cases (all without context): the VSN's selection GRN (2048 rows, I = 192, Hd = 32, O = 48), the head GRN (32 rows,
I = 64, Hd = O = 32), the identity skip (I = O = 32, Hd = 17), odd tiny widths (I = 5, Hd = 3, O = 7), one row,
100 rows (a partial row tile), a jax.vmap over 2 instances of params and a, and jaxfox.vsn at a small shape
(m = 3, d = 5, Hd = 17, O = 9: the selection GRN with its softmax fused, input 15, output 3, plus the vsn kernels).
Then the tensor-core (TF32) kernels (jaxfox_grn_tc_fwd / jaxfox_grn_tc_bwd, default matmul precision, Hd or O > 64):
tc128 (2048 rows, I = Hd = O = 128, identity skip), tc_r1 (one row of it), tc_dense (100 rows, a ragged last 32-row
tile, I = 16, Hd = O = 128: the Dense skip), tc_vmap (a jax.vmap over 3 instances, 65 rows each, I = 32, Hd = 128,
O = 64) and vsn_tc (the VSN's per-variable GRNs at m = 8, d = 16, Hd = O = 128 on 100 rows through
jaxfox.vsn._grn_combined, one tensor-core call pair over the 8 variables; the selection GRN, an XLA GEMM at this
width, is left out, as in gpu_sanitize_vsn.py).
Command-line arguments name the cases to run (default: all), so that one sanitizer process runs fewer programs
(the tool has segfaulted part-way through long scripts, CONTEXT.md).

The GPU programs are the kernel path alone: the loss is sum(y * r) (elementwise and a reduction), so no XLA
matmul (cuBLAS / Triton GEMM) runs under the sanitizer, except the tensor-core cases' weight gradients (XLA GEMMs
by design, jaxfox.grn._grn_tc_bwd; tools/gpu_visit.sh instruments only jaxfox's kernels); a program with an XLA
matmul is reported on a NOTE line.
The reference (jaxfox.use_reference(), XLA matmuls) runs on the host CPU device instead, outside the sanitizer's
view. Each case checks that the compiled GPU program calls the FFI targets, that every output and gradient is
finite and within 1e-4 (relative norm) of the CPU reference (1e-2 for the tensor-core cases, whose products are
TF32: a float64 model of their rounding gives ~1e-3 at these inputs, perturbed by 0.1), and prints one line
"<case>: ok (...)"; "DONE" at the end.
"""

from __future__ import annotations

import importlib
import os
import re
import sys

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
# one cudaMalloc per buffer (not XLA's pool), so that memcheck sees a read or write just past a buffer's end
os.environ.setdefault("XLA_PYTHON_CLIENT_ALLOCATOR", "platform")
if "xla_gpu_autotune_level" not in os.environ.get("XLA_FLAGS", ""):  # no GEMM autotuning launches
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_gpu_autotune_level=0").strip()

# the GRN kernels are opt-in (slower than XLA so far, jaxfox._ffi.OPT_IN)
os.environ["JAXFOX_OPT_IN_KERNELS"] = ",".join(
    [n for n in os.environ.get("JAXFOX_OPT_IN_KERNELS", "").split(",") if n] + ["grn"])

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

import jaxfox  # noqa: E402

GRN_TARGETS = ("jaxfox_grn_fwd", "jaxfox_grn_bwd")
TC_TARGETS = ("jaxfox_grn_tc_fwd", "jaxfox_grn_tc_bwd")
TC_TOL, TC_SCALE = 1e-2, 0.1  # TF32 products; a perturbation that keeps the width-128 gates unsaturated
VSN_TARGETS = GRN_TARGETS + ("jaxfox_vsn_grn_fwd", "jaxfox_vsn_grn_bwd")
_GEMM = re.compile(r"__cublas\w*|__cudnn\w*|triton_gemm|\bdot\(")


def _rel(a, b):
    a, b = np.asarray(a, np.float64).ravel(), np.asarray(b, np.float64).ravel()
    den = np.linalg.norm(b)
    return float(np.linalg.norm(a - b) / den) if den > 0 else float(np.linalg.norm(a))


def _perturbed(p, rng, scale=0.3):
    return jax.tree.map(lambda v: v + jnp.asarray(scale * rng.standard_normal(v.shape), jnp.float32), p)


def _grn_step(p, a, r):
    """(y, grads of sum(y * r) w.r.t. (p, a))."""
    y, vjp = jax.vjp(lambda p, a: jaxfox.grn(p, a), p, a)
    return y, vjp(r)


def _vsn_step(p, xs, r1, r2):
    """((out, weights), grads of sum(out * r1) + sum(weights * r2) w.r.t. (p, xs))."""
    (out, w), vjp = jax.vjp(lambda p, x: jaxfox.vsn(p, x), p, xs)
    return (out, w), vjp((r1, r2))


def _check(name, step, args, targets, tol=1e-4):
    gpu, cpu = jax.devices("gpu")[0], jax.devices("cpu")[0]
    g_args = jax.device_put(args, gpu)
    compiled = jax.jit(step).lower(*g_args).compile()
    text = compiled.as_text()
    missing = [t for t in targets if t not in text]
    assert not missing, f"{name}: kernel path not taken, missing {missing}"
    gemms = sorted(set(_GEMM.findall(text)))
    if gemms:
        print(f"NOTE {name}: XLA matmul in the GPU program: {gemms}", flush=True)
    got = jax.block_until_ready(compiled(*g_args))
    with jax.default_matmul_precision("highest"), jaxfox.use_reference():
        want = jax.jit(step)(*jax.device_put(args, cpu))   # CPU inputs: the reference, on the host
    errs = []
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
        assert a.shape == b.shape and np.isfinite(a).all(), (name, a.shape, b.shape)
        errs.append(_rel(a, b))
    assert max(errs) <= tol, (name, errs)
    print(f"{name}: ok (max rel err {max(errs):.2e} over {len(errs)} leaves)", flush=True)


def grn_case(name, lead, I, H, O, seed=0, vmap=0, tc=False):
    """tc: the tensor-core kernels (their targets, TC_TOL, TC_SCALE); else the CUDA-core ones."""
    rng = np.random.default_rng(seed)
    inst = (vmap,) if vmap else ()
    keys = jax.random.split(jax.random.key(seed), max(vmap, 1))
    ps = [_perturbed(jaxfox.grn_init(k, I, H, O), rng, TC_SCALE if tc else 0.3) for k in keys]
    p = jax.tree.map(lambda *v: jnp.stack(v), *ps) if vmap else ps[0]
    a = jnp.asarray(rng.standard_normal(inst + lead + (I,)), jnp.float32)
    r = jnp.asarray(rng.standard_normal(inst + lead + (O,)), jnp.float32)
    targets, tol = (TC_TARGETS, TC_TOL) if tc else (GRN_TARGETS, 1e-4)
    _check(name, jax.vmap(_grn_step) if vmap else _grn_step, (p, a, r), targets, tol)


def vsn_case(name, lead, m, d, H, O, seed=0):
    rng = np.random.default_rng(seed)
    p = _perturbed(jaxfox.vsn_init(jax.random.key(seed), m, d, H, O), rng)
    xs = jnp.asarray(rng.standard_normal(lead + (m, d)), jnp.float32)
    r1 = jnp.asarray(rng.standard_normal(lead + (O,)), jnp.float32)
    r2 = jnp.asarray(rng.standard_normal(lead + (m,)), jnp.float32)
    _check(name, _vsn_step, (p, xs, r1, r2), VSN_TARGETS)


def vsn_tc_case(name, R, m, d, H, O, seed=0):
    """The per-variable GRNs combined by selection weights (jaxfox.vsn._grn_combined: with d = 16, Hd = O = 128 the
    tensor-core kernels, one call pair over the m variables, and XLA's weighted sum), forward and VJP on the GPU,
    against the same function on the host (its reference branch: jaxfox.vsn._grn_stacked_reference and the weighted
    sum)."""
    vsn_mod = importlib.import_module("jaxfox.vsn")  # the module (jaxfox.vsn, the attribute, is the function)
    rng = np.random.default_rng(seed)
    p = _perturbed(jaxfox.vsn_init(jax.random.key(seed), m, d, H, O)["variables"], rng, TC_SCALE)
    x = jnp.asarray(rng.standard_normal((R, m, d)), jnp.float32)
    v = jax.nn.softmax(jnp.asarray(rng.standard_normal((R, m)), jnp.float32), axis=-1)
    dout = jnp.asarray(rng.standard_normal((R, O)), jnp.float32)

    def step(p, x, v, dout):  # on the host inside use_reference() (_check): the reference branch of the same code
        out, vjp = jax.vjp(lambda p, x, v: vsn_mod._grn_combined(p, x, v, 1e-5), p, x, v)
        return out, vjp(dout)

    _check(name, step, (p, x, v, dout), TC_TARGETS, TC_TOL)


CASES = {
    "selection": lambda: grn_case("selection R=2048 I=192 H=32 O=48", (2048,), 192, 32, 48, seed=1),
    "head": lambda: grn_case("head R=32 I=64 H=32 O=32", (32,), 64, 32, 32, seed=2),
    "identity": lambda: grn_case("identity skip R=37 I=O=32 H=17", (37,), 32, 17, 32, seed=3),
    "tiny": lambda: grn_case("odd tiny R=37 I=5 H=3 O=7", (37,), 5, 3, 7, seed=4),
    "r1": lambda: grn_case("one row I=192 H=32 O=48", (1,), 192, 32, 48, seed=5),
    "r100": lambda: grn_case("R=100 I=192 H=32 O=48", (100,), 192, 32, 48, seed=6),
    "vmap": lambda: grn_case("vmap V=2 R=5x13 I=192 H=32 O=48", (5, 13), 192, 32, 48, seed=7, vmap=2),
    "vsn": lambda: vsn_case("vsn R=37 m=3 d=5 H=17 O=9", (37,), 3, 5, 17, 9, seed=8),
    "tc128": lambda: grn_case("tc128 R=2048 I=H=O=128", (2048,), 128, 128, 128, seed=9, tc=True),
    "tc_r1": lambda: grn_case("tc_r1 R=1 I=H=O=128", (1,), 128, 128, 128, seed=10, tc=True),
    "tc_dense": lambda: grn_case("tc_dense R=100 I=16 H=O=128", (100,), 16, 128, 128, seed=11, tc=True),
    "tc_vmap": lambda: grn_case("tc_vmap V=3 R=65 I=32 H=128 O=64", (65,), 32, 128, 64, seed=12, vmap=3, tc=True),
    "vsn_tc": lambda: vsn_tc_case("vsn_tc R=100 m=8 d=16 H=O=128", 100, 8, 16, 128, 128, seed=13),
}


def main():
    if not jaxfox.kernels_available():
        print("kernels not available:", jaxfox.kernels_unavailable_reason())
        sys.exit(1)
    names = sys.argv[1:] or list(CASES)
    unknown = [n for n in names if n not in CASES]
    if unknown:
        print(f"unknown cases {unknown}; choose from {list(CASES)}")
        sys.exit(2)
    for n in names:
        CASES[n]()
    print("DONE")


if __name__ == "__main__":
    main()
