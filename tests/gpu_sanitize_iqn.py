"""Small IQN head forward + backward passes through the CUDA kernels (ffi/iqn.cu), for compute-sanitizer.

Run on the GPU machine (tools/gpu_visit.sh phase ``sanitize:iqn``), e.g.:
    compute-sanitizer --tool memcheck  python tests/gpu_sanitize_iqn.py
    compute-sanitizer --tool racecheck python tests/gpu_sanitize_iqn.py
Cases (B, N, K, H): (5, 24, 32, 64): 2 samples per tile, 3 tiles, the last one partial (one sample);
(7, 17, 64, 128): 3 samples of 17 rows per tile (51 rows, not a multiple of 16), the last tile partial;
(150, 32, 64, 128): 75 backward blocks, a chunked parameter-gradient reduction (reduce_chunks > 1);
(600, 32, 32, 128) and (1201, 16, 64, 64): more tiles than the 132 blocks, so blocks walk several tiles.
Each runs the forward alone, forward + backward with and without d taus, and the fused loss
(jaxfox.iqn_quantile_huber_loss, kernel jaxfox_iqn_loss, the default path; N' = N + 3 targets a sample), blocks
until ready, and
checks the values against the float64 NumPy oracle of tests/test_iqn.py (norm-wise relative error <= 5e-3 for z and
every gradient, the TF32 tolerance). That tolerance holds only where TF32 rounding cannot move a pre-activation
across its ReLU kink (a flipped mask changes a gradient by a full-size term; at He init the gradients differ
from the oracle by ~1e-2 and more, XLA's too): the parameters and inputs are those of tests/test_gpu_iqn.py's
exact-math tests (imported from there: _exact_inputs, _assert_far_from_kinks), every layer-1 and layer-2 pre-activation has
|value| >= 0.2 (asserted with the oracle), and units are always on, always off, or on in some rows only.
The programs contain no XLA GEMM (the VJP is taken at a given cotangent and nothing is compared on the GPU's
reference path: the oracle is NumPy), so only jaxfox's kernels and XLA's elementwise fusions are instrumented.
Prints OK at the end; exits non-zero when the kernels are not available (nothing would be sanitized).
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

import jaxfox  # noqa: E402
from jaxfox.reduce import reduce_chunks  # noqa: E402


def case(B, N, K, H, seed=0):
    # the exact-math inputs, checks and float64 oracle of the tests (imported only once the kernels are known
    # to be available: test_gpu_iqn skips itself at import otherwise)
    from conftest import rel_err
    from test_gpu_iqn import (FWD, BWD, LOSS, TOL, _assert_close, _assert_far_from_kinks, _exact_inputs, _fused_grad,
                              assert_fused_grads_close)
    from test_iqn import make_targets, np_iqn_forward, np_iqn_loss, np_iqn_vjp

    p, psi, taus, dz = _exact_inputs(B, N, K, H, seed)
    _assert_far_from_kinks(p, psi, taus)
    wz = np_iqn_forward(p, psi, taus)
    wp, wpsi, wtaus = np_iqn_vjp(p, psi, taus, dz)

    def with_taus(p, s, t, d):
        z, vjp = jax.vjp(jaxfox.iqn_head, p, s, t)
        return z, vjp(d)

    def without_taus(p, s, t, d):
        z, vjp = jax.vjp(lambda p, s: jaxfox.iqn_head(p, s, t), p, s)
        return z, vjp(d)

    fwd = jax.jit(jaxfox.iqn_head).lower(p, psi, taus).compile()
    assert FWD in fwd.as_text(), "kernel path not taken"
    err = rel_err(jax.block_until_ready(fwd(p, psi, taus)), wz)
    assert err <= TOL, f"z (forward only): rel err {err:.3g} > {TOL}"
    for name, fn, want in (("with d taus", with_taus, (wz, (wp, wpsi, wtaus))),
                           ("without d taus", without_taus, (wz, (wp, wpsi)))):
        compiled = jax.jit(fn).lower(p, psi, taus, dz).compile()
        text = compiled.as_text()
        assert FWD in text and BWD in text, "kernel path not taken"
        got = jax.device_get(jax.block_until_ready(compiled(p, psi, taus, dz)))
        _assert_close(got, want, TOL, f"fwd+bwd {name}")
        print(f"iqn_head fwd+bwd {name} B={B} N={N} K={K} H={H}: ok", flush=True)

    y = jax.numpy.asarray(wz.mean(axis=1, keepdims=True) + make_targets(B, N + 3, seed=B), jax.numpy.float32)
    loss_want, _, _, _ = np_iqn_loss(p, psi, taus, y, 1.0)
    compiled = jax.jit(_fused_grad).lower(p, psi, taus, y).compile()
    assert LOSS in compiled.as_text(), "fused loss kernel not taken"
    loss, g = jax.device_get(jax.block_until_ready(compiled(p, psi, taus, y)))
    assert abs(float(loss) - loss_want) <= TOL * abs(loss_want), (float(loss), loss_want)
    assert_fused_grads_close(g, p, psi, taus, y, 1.0, "fused loss")
    print(f"iqn_quantile_huber_loss B={B} N={N} N'={N + 3} K={K} H={H}: ok", flush=True)


def main() -> int:
    if not jaxfox.kernels_available():
        print(f"jaxfox kernels unavailable: {jaxfox.kernels_unavailable_reason()}", file=sys.stderr)
        return 2
    case(5, 24, 32, 64)        # 3 tiles of 2 samples, the last partial
    case(7, 17, 64, 128)       # 51-row tiles of 3 samples, the last partial
    P = -(-(128 * 128 + 64 * 128 + 3 * 128 + 1) // 8) * 8
    assert reduce_chunks(min(-(-150 // 2), 132), P) > 1  # the next case takes the chunked reduction
    case(150, 32, 64, 128)     # 75 backward blocks, chunked parameter-gradient sum
    case(600, 32, 32, 128)     # 300 tiles over 132 blocks: the next-tile prefetch and buffer reuse across tiles
    case(1201, 16, 64, 64)     # 301 tiles over 132 blocks, K = 64 H = 64, partial last tile
    print("OK")
    return 0


if __name__ == "__main__":
    sys.exit(main())
