"""Small forward + backward passes through the attention_pool CUDA kernels, for compute-sanitizer.

Run on the GPU machine, e.g.:
    compute-sanitizer --tool memcheck  python tests/gpu_sanitize_attention.py
    compute-sanitizer --tool racecheck python tests/gpu_sanitize_attention.py
    compute-sanitizer --tool initcheck python tests/gpu_sanitize_attention.py
Prints OK when every case ran on the kernel path and agreed with the reference path.
Cases: odd sizes with an all-masked and a single-valid sample; a 150-step sequence (85 KiB of shared memory)
with bfloat16 states; 70 one-sample blocks (a chunked d u sum); 37 samples of 16 steps (4 a block, the last
block partial); vmap.
"""

from __future__ import annotations

import os
import sys

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
# one cudaMalloc per buffer (not XLA's pool), so that memcheck sees a read or write just past a buffer's end
os.environ.setdefault("XLA_PYTHON_CLIENT_ALLOCATOR", "platform")
os.environ.setdefault("JAXFOX_OPT_IN_KERNELS", "attention_pool")  # the kernel is opt-in (jaxfox._ffi.OPT_IN)
if "xla_gpu_autotune_level" not in os.environ.get("XLA_FLAGS", ""):  # no GEMM autotuning launches
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_gpu_autotune_level=0").strip()

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

import jaxfox  # noqa: E402


def case(B, T, H, n, dtype=jnp.float32, seed=0, vmap=0):
    rng = np.random.default_rng(seed)
    p = jaxfox.attention_pool_init(jax.random.key(seed), H, num_heads=n)
    p = {k: v + jnp.asarray(0.3 * rng.standard_normal(v.shape), jnp.float32) for k, v in p.items()}
    lead = (vmap,) if vmap else ()
    hs = jnp.asarray(rng.standard_normal(lead + (B, T, H)), dtype)
    m = rng.uniform(size=lead + (B, T)) < 0.7
    m[..., 0] = True
    if B >= 3:
        m[..., 1, :] = False
        m[..., 2, :] = False
        m[..., 2, T // 2] = True
    mask = jnp.asarray(m)
    r1 = jnp.asarray(rng.standard_normal((B, H)), jnp.float32)
    r2 = jnp.asarray(rng.standard_normal((B, n, T)), jnp.float32)

    def loss(p, h, m):
        pooled, alpha = jaxfox.attention_pool(p, h, m, num_heads=n)
        return jnp.sum(pooled * r1) + jnp.sum(alpha * r2)

    def step(p, h, m):
        f = jax.value_and_grad(loss, argnums=(0, 1))
        return jax.vmap(f, in_axes=(None, 0, 0))(p, h, m) if vmap else f(p, h, m)

    with jax.default_matmul_precision("highest"):
        fn = jax.jit(lambda *a: step(*a))
        assert "jaxfox_attention_pool_bwd" in fn.lower(p, hs, mask).as_text()
        got = jax.block_until_ready(fn(p, hs, mask))
        with jaxfox.use_reference():
            want = jax.jit(lambda *a: step(*a))(p, hs, mask)
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
        assert np.isfinite(a).all()
        scale = max(float(np.abs(b).max()), 1e-30)
        tol = 1e-2 if dtype == jnp.bfloat16 else 1e-4
        assert float(np.abs(a - b).max()) <= tol * scale, (B, T, H, n, float(np.abs(a - b).max()), scale)


def main():
    if not jaxfox.kernels_available():
        print("kernels not available:", jaxfox.kernels_unavailable_reason())
        sys.exit(1)
    case(5, 13, 24, 3)                          # odd sizes, masked samples
    case(2, 150, 128, 4, dtype=jnp.bfloat16)    # one long sequence a block, bf16 states
    case(70, 64, 8, 2)                          # 70 blocks: 2 chunks in the d u sum
    case(37, 16, 64, 4)                         # 4 samples a block, the last block partial
    case(3, 6, 16, 4, vmap=2)                   # vmap: leading instance axis
    print("OK")


if __name__ == "__main__":
    main()
