"""Small forward + backward passes through the VSN CUDA kernels (ffi/vsn.cu), for compute-sanitizer.

Run on the GPU machine, e.g.:
    compute-sanitizer --tool memcheck  python tests/gpu_sanitize_vsn.py
    compute-sanitizer --tool racecheck python tests/gpu_sanitize_vsn.py
    compute-sanitizer --tool initcheck python tests/gpu_sanitize_vsn.py
Prints OK when every case ran on the kernel path (both FFI calls in the compiled program), gave finite
outputs and gradients, and agreed with the reference path.
Cases: odd sizes (R = 37 rows, d = 5, Hd = 17, O = 9: partial row tile, widths not multiples of 4); the main
job's widths (m = 48, d = 4, Hd = O = 32) on 200 rows (4 row tiles, a partial one); the widest case with a
skip Dense (d = 31, Hd = O = 32: two dW tiles per thread, > 48 KB of shared memory); identity skip (d = O);
a selection context with O = 1; vmap over an instance axis of params and xs; 4160 rows at m = 1 (65 backward
CTAs, a chunked parameter-gradient reduction); 1280 rows at the main job's widths (two row tiles per backward CTA).
``JAXFOX_SANITIZE_CASES=0,6`` runs a subset (indices into that list); each passing case prints a line.
"""

from __future__ import annotations

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


def case(lead, m, d, H, O, C=None, seed=0, vmap=0):
    rng = np.random.default_rng(seed)
    p = jaxfox.vsn_init(jax.random.key(seed), m, d, H, O, context_size=C)
    p = jax.tree.map(lambda v: v + jnp.asarray(0.3 * rng.standard_normal(v.shape), jnp.float32), p)
    inst = (vmap,) if vmap else ()
    if vmap:
        p = jax.tree.map(lambda v: jnp.stack([v * (1.0 + 0.1 * i) for i in range(vmap)]), p)
    xs = jnp.asarray(rng.standard_normal(inst + lead + (m, d)), jnp.float32)
    c = None if C is None else jnp.asarray(rng.standard_normal(inst + lead + (C,)), jnp.float32)
    r1 = jnp.asarray(rng.standard_normal(lead + (O,)), jnp.float32)
    r2 = jnp.asarray(rng.standard_normal(lead + (m,)), jnp.float32)

    def loss(p, x, c):
        out, w = jaxfox.vsn(p, x, c)
        return jnp.sum(out * r1) + jnp.sum(w * r2)

    def step(p, x, c):
        f = jax.value_and_grad(loss, argnums=(0, 1))
        return jax.vmap(f)(p, x, c) if vmap else f(p, x, c)

    with jax.default_matmul_precision("highest"):
        compiled = jax.jit(lambda *a: step(*a)).lower(p, xs, c).compile()
        text = compiled.as_text()
        assert "jaxfox_vsn_grn_fwd" in text and "jaxfox_vsn_grn_bwd" in text, (lead, m, d, H, O)
        got = jax.block_until_ready(compiled(p, xs, c))
        with jaxfox.use_reference():
            want = jax.jit(lambda *a: step(*a))(p, xs, c)
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
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
        (((37,), 4, 3, 16, 1), dict(C=5)),         # O = 1, a selection context
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
