"""One cfc_scan forward + backward at the benchmark shape, for Nsight Compute (a diagnosis tool, not a test).

    ncu --clock-control none -k regex:cfc_ --section WarpStateStats --section SourceCounters \
        -o cfc python3 tools/ncu_cfc.py [--B 32 --T 256 --I 48 --H 128 --U 128]

Compiles first (no kernel launches while tracing), then runs the jitted fwd+bwd exactly once, so the
profile holds one launch of each CfC kernel.
"""

from __future__ import annotations

import argparse

import jax
import jax.numpy as jnp

import jaxfox


def main() -> None:
    ap = argparse.ArgumentParser()
    for k, v in dict(B=32, T=256, I=48, H=128, U=128).items():
        ap.add_argument(f"--{k}", type=int, default=v)
    a = ap.parse_args()
    assert jaxfox.kernels_available(), jaxfox.kernels_unavailable_reason()
    params = jaxfox.cfc_init(jax.random.key(0), a.I, a.H, backbone_units=a.U)
    xs = jax.random.normal(jax.random.key(1), (a.B, a.T, a.I))
    w_out = jax.random.normal(jax.random.key(2), (a.B, a.T, a.H))

    f = jax.jit(jax.value_and_grad(lambda p, x: jnp.sum(jaxfox.cfc_scan(p, x) * w_out)))
    compiled = f.lower(params, xs).compile()
    out = jax.block_until_ready(compiled(params, xs))
    print("loss", float(out[0]))


if __name__ == "__main__":
    main()
