"""Small C51-loss and PER-sampler kernel workload for compute-sanitizer (not a pytest module).

Usage on the GPU machine:

    compute-sanitizer --tool memcheck  python tests/gpu_sanitize_dqn.py
    compute-sanitizer --tool racecheck python tests/gpu_sanitize_dqn.py

Runs categorical_double_q_loss forward + backward at odd sizes (including the tile edge of the atom loop),
prefix_sum across tile boundaries and per.sample with zero priorities, a partly filled buffer and an
all-zero buffer, compares with the reference path, and prints OK. Exits non-zero when the kernels are
not available (nothing would be sanitized).
"""

from __future__ import annotations

import os
import sys

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
# one cudaMalloc per buffer (not XLA's pool), so that memcheck sees a read or write just past a buffer's end
os.environ.setdefault("XLA_PYTHON_CLIENT_ALLOCATOR", "platform")
if "xla_gpu_autotune_level" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_gpu_autotune_level=0").strip()

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

import jaxfox  # noqa: E402
from jaxfox import per  # noqa: E402


def c51_case(B, D, A, N, seed):
    rng = np.random.default_rng(seed)
    f = lambda: jnp.asarray(rng.standard_normal((B, D, A, N)), jnp.float32)  # noqa: E731
    args = (f(), jnp.asarray(rng.integers(0, A, (B, D)), jnp.int32), jnp.asarray(rng.uniform(-3, 3, B), jnp.float32),
            jnp.asarray(0.99 * (rng.uniform(size=B) > 0.2), jnp.float32), f(), f(), jnp.linspace(-10.0, 10.0, N))
    fn = jax.jit(jax.value_and_grad(lambda x, *rest: jnp.sum(jaxfox.categorical_double_q_loss(x, *rest))))
    out = jax.block_until_ready(fn(*args))
    with jaxfox.use_reference():
        ref = jax.jit(jax.value_and_grad(lambda x, *rest: jnp.sum(jaxfox.categorical_double_q_loss(x, *rest))))(*args)
    np.testing.assert_allclose(np.asarray(out[1]), np.asarray(ref[1]), rtol=1e-4, atol=1e-5)


def per_case(C, size, B, seed):
    rng = np.random.default_rng(seed)
    p = np.zeros(C, np.float32)
    p[:size] = rng.lognormal(0, 1, size)
    p[:size][rng.random(size) < 0.2] = 0.0
    s = per.init(C)._replace(priorities=jnp.asarray(p), size=jnp.asarray(size, jnp.int32))
    idx, w = jax.block_until_ready(jax.jit(lambda k: per.sample(s, k, B, alpha=0.6, beta=0.4))(jax.random.key(seed)))
    if p[:size].sum() > 0:
        assert (p[np.asarray(idx)] > 0).all()
    assert (np.asarray(idx) < max(size, 1)).all() and np.isfinite(np.asarray(w)).all()
    c = np.asarray(jax.block_until_ready(jax.jit(per.prefix_sum)(jnp.asarray(p))))
    np.testing.assert_allclose(c, np.cumsum(p.astype(np.float64)), rtol=1e-5, atol=1e-3)


def main():
    if not jaxfox.kernels_available():
        print(f"kernels unavailable: {jaxfox.kernels_unavailable_reason()}")
        sys.exit(2)
    for B, D, A, N, seed in [(3, 2, 3, 51, 0), (5, 1, 1, 2, 1), (2, 3, 5, 200, 2), (4, 4, 5, 33, 3)]:
        c51_case(B, D, A, N, seed)
    for C, size, B, seed in [(1, 1, 4, 0), (37, 30, 16, 1), (4099, 4099, 64, 2), (5000, 2049, 33, 3), (64, 10, 8, 4)]:
        per_case(C, size, B, seed)
    s = per.init(100)._replace(size=jnp.asarray(50, jnp.int32))  # all-zero priorities: uniform draws
    idx, _ = jax.block_until_ready(per.sample(s, jax.random.key(0), 32, alpha=0.6, beta=0.4))
    assert (np.asarray(idx) < 50).all()
    print("OK")


if __name__ == "__main__":
    main()
