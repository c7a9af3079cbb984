"""One iqn_head forward + backward at the benchmark shape, for Nsight Compute (a diagnosis tool, not a test).

    ncu --clock-control none -k regex:iqn_head --section WarpStateStats --section SourceCounters \
        -o iqn python3 tools/ncu_iqn.py [--B 16384 --N 32 --K 64 --H 128]

Compiles first, then runs the jitted fwd+bwd (taus not differentiated) once: one launch of each kernel.
"""

from __future__ import annotations

import argparse

import jax
import jax.numpy as jnp

import jaxfox


def main() -> None:
    ap = argparse.ArgumentParser()
    for k, v in dict(B=16384, N=32, K=64, H=128).items():
        ap.add_argument(f"--{k}", type=int, default=v)
    a = ap.parse_args()
    assert jaxfox.kernels_available(), jaxfox.kernels_unavailable_reason()
    params = jaxfox.iqn_head_init(jax.random.key(0), a.H, n_cos=a.K)
    psi = jax.nn.relu(jax.random.normal(jax.random.key(1), (a.B, a.H)))
    taus = jax.random.uniform(jax.random.key(2), (a.B, a.N))
    c = jax.random.normal(jax.random.key(3), (a.B, a.N))
    f = jax.jit(jax.value_and_grad(lambda p, psi: jnp.sum(jaxfox.iqn_head(p, psi, taus) * c), argnums=(0, 1)))
    compiled = f.lower(params, psi).compile()
    out = jax.block_until_ready(compiled(params, psi))
    print("loss", float(out[0]))


if __name__ == "__main__":
    main()
