"""Small forward + backward passes through the VSN CUDA kernels (ffi/vsn.cu), for compute-sanitizer.

Run on the GPU machine, e.g.:
    compute-sanitizer --tool memcheck  python tests/gpu_sanitize_vsn.py
    compute-sanitizer --tool racecheck python tests/gpu_sanitize_vsn.py
    compute-sanitizer --tool initcheck python tests/gpu_sanitize_vsn.py
The GPU programs hold the per-variable GRN kernels (ffi/vsn.cu: ``jaxfox_vsn_grn_fwd``, ``jaxfox_vsn_grn_bwd``) and
XLA's elementwise work around them (the weighted sum, the parameter flattening), forward and VJP at a given
cotangent, and no XLA GEMM: compute-sanitizer segfaulted at start-up on every script whose programs had cuBLAS
GEMMs (this one's earlier version, which ran the whole vsn, whose selection GRN is XLA, and compared it with the
reference path on the GPU). The reference (the same combination through vsn._grn_stacked_reference, XLA at
"highest" precision) runs on the host CPU device, as in gpu_sanitize_grn.py; tests/test_gpu_vsn.py checks vsn
end to end. Prints OK when every case ran on the kernel path (both FFI calls in the compiled program), gave finite
outputs and gradients, and agreed with the reference within 1e-4 of each output's largest magnitude.
Cases: odd sizes (R = 37 rows, d = 5, Hd = 17, O = 9: partial row tile, widths not multiples of 4); the main
job's widths (m = 48, d = 4, Hd = O = 32) on 200 rows (4 row tiles, a partial one); the widest case with a
skip Dense (d = 31, Hd = O = 32: two dW tiles per thread, > 48 KB of shared memory); identity skip (d = O);
O = 1; vmap over an instance axis of params and xs; 4160 rows at m = 1 (65 backward
CTAs, a chunked parameter-gradient reduction); 1280 rows at the main job's widths (two row tiles per backward CTA).
``JAXFOX_SANITIZE_CASES=0,6`` runs a subset (indices into that list); each passing case prints a line.
"""

from __future__ import annotations

import importlib
import os
import sys
import time

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
# one cudaMalloc per buffer (not XLA's pool), so that memcheck sees a read or write just past a buffer's end
os.environ.setdefault("XLA_PYTHON_CLIENT_ALLOCATOR", "platform")
if "xla_gpu_autotune_level" not in os.environ.get("XLA_FLAGS", ""):  # no GEMM autotuning launches
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_gpu_autotune_level=0").strip()

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

import jaxfox  # noqa: E402
vsn_mod = importlib.import_module("jaxfox.vsn")  # the module (jaxfox.vsn, the attribute, is the function)


def case(lead, m, d, H, O, seed=0, vmap=0):
    """The per-variable GRNs combined by selection weights (vsn._combine_kernel: the two custom calls and XLA's
    elementwise work around them), forward and VJP on the GPU, against the same function's reference on the host.
    (The selection GRN is not in these programs: ffi/grn.cu, sanitized by gpu_sanitize_grn.py.)"""
    rng = np.random.default_rng(seed)
    p = vsn_mod.vsn_init(jax.random.key(seed), m, d, H, O)["variables"]
    p = jax.tree.map(lambda v: v + jnp.asarray(0.3 * rng.standard_normal(v.shape), jnp.float32), p)
    inst = (vmap,) if vmap else ()
    if vmap:
        p = jax.tree.map(lambda v: jnp.stack([v * (1.0 + 0.1 * i) for i in range(vmap)]), p)
    R = int(np.prod(lead))
    x = rng.standard_normal(inst + (R, m, d)).astype(np.float32)
    v = jax.nn.softmax(jnp.asarray(rng.standard_normal(inst + (R, m)), jnp.float32), axis=-1)
    dout = rng.standard_normal(inst + (R, O)).astype(np.float32)
    cfg = vsn_mod._StackCfg(H, O, 1e-5)

    def kernel(p, x, v, dout):
        out, vjp = jax.vjp(lambda p, x, v: vsn_mod._combine_kernel(cfg, vsn_mod._stack_flat(p), x, v), p, x, v)
        return out, vjp(dout)

    def reference(p, x, v, dout):
        out, vjp = jax.vjp(lambda p, x, v: vsn_mod._weighted_sum(v, vsn_mod._grn_stacked_reference(p, x, cfg.eps)),
                           p, x, v)
        return out, vjp(dout)

    if vmap:
        kernel, reference = jax.vmap(kernel), jax.vmap(reference)
    gpu, cpu = jax.devices("gpu")[0], jax.devices("cpu")[0]
    args = (p, x, v, dout)
    gpu_args = jax.device_put(args, gpu)
    compiled = jax.jit(kernel).lower(*gpu_args).compile()
    text = compiled.as_text()
    assert "jaxfox_vsn_grn_fwd" in text and "jaxfox_vsn_grn_bwd" in text, (lead, m, d, H, O)
    got = jax.device_get(jax.block_until_ready(compiled(*gpu_args)))
    with jax.default_matmul_precision("highest"):
        want = jax.device_get(jax.jit(reference)(*jax.device_put(args, cpu)))   # on the host: no GPU GEMM
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
        assert a.shape == b.shape, (a.shape, b.shape)
        assert np.isfinite(a).all(), (lead, m, d, H, O)
        scale = max(float(np.abs(b).max()), 1e-30)
        assert float(np.abs(a - b).max()) <= 1e-4 * scale, (lead, m, d, H, O, float(np.abs(a - b).max()), scale)


def main():
    if not jaxfox.kernels_available():
        print("kernels not available:", jaxfox.kernels_unavailable_reason())
        sys.exit(1)
    cases = [
        (((37,), 3, 5, 17, 9), {}),                # odd sizes, one partial row tile
        (((2, 100), 48, 4, 32, 32), {}),           # the main job's widths, 200 rows
        (((70,), 3, 31, 32, 32), {}),              # widest with a skip Dense
        (((3, 13), 2, 8, 7, 8), {}),               # identity skip (d = O)
        (((37,), 4, 3, 16, 1), {}),                # O = 1
        (((5, 13), 3, 5, 17, 9), dict(vmap=2)),    # vmap: leading instance axis of params and xs
        (((4160,), 1, 4, 32, 32), {}),             # 65 backward CTAs: a chunked parameter-gradient reduction
        (((20, 64), 48, 4, 32, 32), {}),           # the main job's widths, 2 tiles per backward CTA
    ]
    # JAXFOX_SANITIZE_CASES="0,6": run only those cases (a sanitizer run of all of them may outlast a device
    # command); each case prints a line when it passes, so a run cut short still says how far it got
    pick = os.environ.get("JAXFOX_SANITIZE_CASES", "")
    chosen = [int(i) for i in pick.split(",") if i.strip()] if pick.strip() else range(len(cases))
    for i in chosen:
        args, kw = cases[i]
        t0 = time.perf_counter()
        case(*args, **kw)
        print(f"case {i} {args} {kw}: ok ({time.perf_counter() - t0:.1f} s)", flush=True)
    print("OK")


if __name__ == "__main__":
    main()
