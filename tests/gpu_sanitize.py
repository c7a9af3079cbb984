"""Small CfC and reduce_axis0 kernel workload for compute-sanitizer (not a pytest module).

Usage on the GPU machine:

    compute-sanitizer --tool memcheck  python tests/gpu_sanitize.py
    compute-sanitizer --tool racecheck python tests/gpu_sanitize.py

Runs one small cfc_scan forward + backward per mode (backbone depths 0, 1 and 2, odd sizes; depth 1 at H = 64
and H = 128 too, where the register kernels run in clusters of 2 and 4 CTAs, and at the benchmark's and the main
job's sizes, whose geometries are compiled in; plus a vmapped call) and
reduce_axis0 on shapes that take the single-range and the multi-range (chunks > 1) paths, checks the values
against NumPy, and prints OK at the end. Exits non-zero when the kernels are not available (nothing would be
sanitized).
"""

from __future__ import annotations

import os
import sys

# Keep the sanitizer's view small: no 75% preallocation, no GEMM autotuning launches.
os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
# one cudaMalloc per buffer (not XLA's pool), so that memcheck sees a read or write just past a buffer's end
os.environ.setdefault("XLA_PYTHON_CLIENT_ALLOCATOR", "platform")
if "xla_gpu_autotune_level" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_gpu_autotune_level=0").strip()

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

import jaxfox  # noqa: E402
from jaxfox.reduce import reduce_chunks  # noqa: E402


def _cfc_case(mode, layers, B=3, T=5, I=7, H=9, U=13, seed=0):
    rng = np.random.default_rng(seed)
    params = jaxfox.cfc_init(jax.random.key(seed), I, H, backbone_units=U, backbone_layers=layers, mode=mode)
    xs = rng.standard_normal((B, T, I)).astype(np.float32)
    ts = rng.uniform(0.0, 2.0, (B, T)).astype(np.float32)
    h0 = rng.standard_normal((B, H)).astype(np.float32)
    cot = rng.standard_normal((B, T, H)).astype(np.float32)
    return params, xs, ts, h0, cot


def _fwd_bwd(mode):
    def f(params, xs, ts, h0, cot):
        hs, vjp = jax.vjp(lambda p, x, t, h: jaxfox.cfc_scan(p, x, t, h, mode=mode), params, xs, ts, h0)
        return hs, vjp(cot)
    return f


def main() -> int:
    if not jaxfox.kernels_available():
        print(f"jaxfox kernels unavailable: {jaxfox.kernels_unavailable_reason()}", file=sys.stderr)
        return 2

    # ... and the two geometries compiled with fixed trip counts (ffi/cfc.cu ByForwardGeometry / ByBackwardGeometry):
    # the benchmark's (C = 4) and the main job's (C = 1)
    sizes = [dict(), dict(B=2, T=4, I=16, H=64, U=40), dict(B=2, T=4, I=16, H=128, U=128),
             dict(B=2, T=3, I=48, H=128, U=128), dict(B=2, T=3, I=32, H=32, U=64)]
    for mode in ("default", "no_gate", "pure"):
        for layers, size in [(0, sizes[0]), (2, sizes[0])] + [(1, z) for z in sizes]:
            args = _cfc_case(mode, layers, **size)
            f = jax.jit(_fwd_bwd(mode))
            text = f.lower(*args).as_text()
            assert "jaxfox_cfc_fwd" in text and "jaxfox_cfc_bwd" in text, "kernel path not taken"
            hs, grads = jax.block_until_ready(f(*args))
            for leaf in [hs] + jax.tree.leaves(grads):
                assert np.isfinite(np.asarray(leaf)).all(), (mode, layers)
            print(f"cfc_scan fwd+bwd mode={mode} layers={layers} {size}: ok", flush=True)
    # vmapped (instances as leading dims) CfC call
    cases = [_cfc_case("default", 1, seed=s) for s in range(2)]
    stacked = [jax.tree.map(lambda *a: jnp.stack(a), *[c[k] for c in cases]) for k in range(5)]
    jax.block_until_ready(jax.jit(jax.vmap(_fwd_bwd("default")))(*stacked))
    print("vmapped cfc_scan fwd+bwd: ok", flush=True)

    for shape in ((5, 1027), (200, 50), (1, 3), (3, 2, 70)):
        x = np.random.default_rng(1).standard_normal(shape).astype(np.float32)
        if len(shape) == 3:
            got = np.asarray(jax.jit(jax.vmap(jaxfox.reduce_axis0))(x))
            chunks = reduce_chunks(shape[1], shape[2])
        else:
            got = np.asarray(jax.jit(jaxfox.reduce_axis0)(x))
            chunks = reduce_chunks(*shape)
        np.testing.assert_allclose(got, x.astype(np.float64).sum(axis=-2), rtol=1e-5, atol=1e-5)
        print(f"reduce_axis0 {shape} (chunks={chunks}): ok", flush=True)
    assert reduce_chunks(200, 50) > 1  # the multi-range path above really ran

    print("OK")
    return 0


if __name__ == "__main__":
    sys.exit(main())
