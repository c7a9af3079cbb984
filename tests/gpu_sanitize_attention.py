"""The attention_pool CUDA kernels (ffi/attention_pool.cu) alone, for compute-sanitizer.

Run on the GPU machine (tools/gpu_visit.sh phase ``sanitize:attention``), e.g.:
    compute-sanitizer --tool memcheck  python tests/gpu_sanitize_attention.py
    compute-sanitizer --tool racecheck python tests/gpu_sanitize_attention.py
The GPU programs here hold the two custom calls and nothing else that computes: the forward
(``jaxfox_attention_pool_fwd``: alpha, c from hs, mask, u) and the backward (``jaxfox_attention_pool_bwd``, through
``attention._stream_bwd`` at given cotangents). The weight products around them (u = W_k q, pv = c W_v, the output
layer) are XLA GEMMs in attention_pool's kernel path, and compute-sanitizer segfaulted at start-up on every script
whose programs had cuBLAS GEMMs (this one's earlier version, which compared attention_pool end to end with the
reference path on the GPU, and gpu_sanitize_vsn.py); tests/test_gpu_attention.py checks that composition.
The oracle is tests/test_attention.py's float64 NumPy transcription of the kernel file's equations (_emu_fwd,
_emu_bwd), run on the host.
Cases (B, T, H, n): (5, 13, 24, 3) odd sizes, with an all-masked and a single-valid sample; (2, 150, 128, 4) one
long sequence a block (100 KiB of shared memory, alone in its block), bfloat16 states; (70, 64, 8, 2) 70 one-sample blocks (more
partial rows than the d u sum's 32 thread rows); (4, 9, 10, 2) H % 4 != 0 (scalar paths), float32 and bfloat16;
(3, 20, 12, 3) H % 8 == 4;
(20, 4, 8, 2) two samples a warp; (3, 7, 264, 4) partial column chunks; (3, 16, 16, 16) more heads than a register
group; (37, 16, 64, 4) 4 samples a block, the last block partial; (3, 6, 16, 4) under vmap (leading instance
axis); and the backward without d hs (hs not differentiated: a [0] output).
Prints OK at the end; exits non-zero when the kernels are not available (nothing would be sanitized).
"""

from __future__ import annotations

import os
import sys

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
# one cudaMalloc per buffer (not XLA's pool), so that memcheck sees a read or write just past a buffer's end
os.environ.setdefault("XLA_PYTHON_CLIENT_ALLOCATOR", "platform")
if "xla_gpu_autotune_level" not in os.environ.get("XLA_FLAGS", ""):  # no GEMM autotuning launches
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_gpu_autotune_level=0").strip()

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

import jaxfox  # noqa: E402
from jaxfox import attention as attn  # noqa: E402


def _close(name, got, want, tol):
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    assert got.shape == want.shape, (name, got.shape, want.shape)
    assert np.isfinite(got).all(), name
    scale = max(float(np.abs(want).max()), 1e-30)
    err = float(np.abs(got - want).max())
    assert err <= tol * scale, f"{name}: max abs err {err:.3g} > {tol} x {scale:.3g}"


def case(B, T, H, n, dtype=jnp.float32, seed=0, vmap=0, want_dhs=True):
    from test_attention import _emu_bwd, _emu_fwd  # the float64 oracle (imported once the kernels are available)

    rng = np.random.default_rng(seed)
    lead = (vmap,) if vmap else ()
    hs = np.asarray(jnp.asarray(rng.standard_normal(lead + (B, T, H)), dtype))   # rounded to dtype on the host
    m = rng.uniform(size=lead + (B, T)) < 0.7
    m[..., 0] = True
    if B >= 3:
        m[..., 1, :] = False          # every step masked
        m[..., 2, :] = False
        m[..., 2, T // 2] = True      # one valid step
    u = (0.5 * rng.standard_normal(lead + (H, n))).astype(np.float32)
    dalpha = rng.standard_normal(lead + (B, n, T)).astype(np.float32)
    dc = rng.standard_normal(lead + (B, n, H)).astype(np.float32)
    G = attn._samples_per_block(T, H, n)
    assert G >= 1, (T, H, n)
    cfg = attn._Config(H, n, G)

    def fwd(hs, m, u):
        return attn._stream_fwd_call(cfg, hs, m, u)

    def bwd(hs, u, alpha, dalpha, dc):
        dhs, _, du_t = attn._stream_bwd(cfg, (hs, u, alpha, want_dhs), (dalpha, dc))
        return (dhs if want_dhs else jnp.zeros((0,), hs.dtype)), du_t

    if vmap:
        fwd, bwd = jax.vmap(fwd), jax.vmap(bwd)
    gpu = jax.devices("gpu")[0]
    args = jax.device_put((hs, m, u), gpu)
    fwd_c = jax.jit(fwd).lower(*args).compile()
    assert "jaxfox_attention_pool_fwd" in fwd_c.as_text(), "forward kernel not in the program"
    alpha, c = jax.device_get(jax.block_until_ready(fwd_c(*args)))
    want_alpha, want_c = _emu_fwd(hs, m, u, samples_per_block=G, _shapes=None)
    _close("alpha", alpha, want_alpha, 1e-5)
    _close("c", c, want_c, 1e-5)

    bargs = jax.device_put((hs, u, want_alpha, dalpha, dc), gpu)   # the oracle's alpha: the backward alone is tested
    bwd_c = jax.jit(bwd).lower(*bargs).compile()
    assert "jaxfox_attention_pool_bwd" in bwd_c.as_text(), "backward kernel not in the program"
    dhs, du_t = jax.device_get(jax.block_until_ready(bwd_c(*bargs)))
    shapes = (jax.ShapeDtypeStruct(lead + ((B, T, H) if want_dhs else (0,)), hs.dtype),)
    want_dhs_v, want_du, _ = _emu_bwd(hs, u, want_alpha, dalpha, dc, samples_per_block=G, _shapes=shapes)
    tol = 1e-2 if dtype == jnp.bfloat16 else 1e-4
    if want_dhs:
        _close("d hs", dhs, want_dhs_v, tol)
    else:
        assert dhs.shape == (0,), dhs.shape
    _close("d u", du_t, np.swapaxes(want_du.reshape(lead + (n, H)), -1, -2), 1e-4)
    print(f"attention_pool kernels B={B} T={T} H={H} n={n} {jnp.dtype(dtype).name} vmap={vmap} "
          f"d_hs={want_dhs} G={G} blocks={-(-B // G)}: ok", flush=True)


def main():
    if not jaxfox.kernels_available():
        print("kernels not available:", jaxfox.kernels_unavailable_reason())
        sys.exit(1)
    case(5, 13, 24, 3)                          # odd sizes, masked samples
    case(2, 150, 128, 4, dtype=jnp.bfloat16)    # one long sequence a block, bf16 states
    case(70, 64, 8, 2)                          # 70 blocks: more partial rows than the d u sum's 32 thread rows
    case(4, 9, 10, 2)                           # H % 4 != 0: scalar staging and d hs, odd row stride
    case(4, 9, 10, 2, dtype=jnp.bfloat16)       # the same with bfloat16 states
    case(3, 20, 12, 3)                          # H % 8 == 4: rows of H floats, float4 paths
    case(37, 16, 64, 4)                         # 4 samples a block, the last block partial
    case(37, 16, 64, 4, want_dhs=False)         # d hs not formed
    case(3, 6, 16, 4, vmap=2)                   # vmap: leading instance axis
    case(20, 4, 8, 2)                           # 16 samples a block: a warp walks two samples
    case(3, 7, 264, 4)                          # 3 of 4 column chunks a lane, the third partial
    case(3, 16, 16, 16)                         # 16 heads: four head groups, d hs from shared memory
    print("OK")


if __name__ == "__main__":
    main()
