"""One forward + backward of a jaxfox op at its benchmark shape, for Nsight Compute (a diagnosis tool, not a
test). Compiles first (no kernel launches while tracing), then runs the jitted fwd+bwd exactly once, so the
profile holds one launch of each of the op's kernels.

    ncu --clock-control none -k regex:cfc_ --section WarpStateStats --section SourceCounters \
        -o cfc python3 tools/ncu_op.py cfc [--B 32 --T 256 --I 48 --H 128 --U 128]
    ncu ... -k regex:iqn_head -o iqn python3 tools/ncu_op.py iqn [--B 16384 --N 32 --K 64 --H 128]
    JAXFOX_OPT_IN_KERNELS=grn ncu ... -k regex:grn_ -o grn python3 tools/ncu_op.py grn [--R 2048 --I 192 --H 32 --O 48]
    ncu ... -k regex:iql_ -o iql python3 tools/ncu_op.py iql [--B 16384 --D 256 --H 128 --G 2]
    XLA_FLAGS=--xla_gpu_autotune_level=0 ncu ... -k regex:vsn_grn -o vsn \
        python3 tools/ncu_op.py vsn [--R 2048 --M 48 --D 4 --H 32 --O 32]

(grn defaults: the VSN's selection GRN of the main job, without its softmax; the head GRN is --R 32 --I 64
--H 32 --O 32. vsn defaults: the main job's VSN, whose m per-variable GRNs are the vsn_grn kernels; without
the XLA_FLAGS, ncu segfaulted during XLA's GEMM autotuning on the H200.) Read an exported source page with
tools/ncu_sass_summary.py.
"""

from __future__ import annotations

import argparse

import jax
import jax.numpy as jnp

import jaxfox


def _normal(seed, shape):
    return jax.random.normal(jax.random.key(seed), shape)


def cfc(a):
    params = jaxfox.cfc_init(jax.random.key(0), a.I, a.H, backbone_units=a.U)
    c = _normal(2, (a.B, a.T, a.H))
    return jax.value_and_grad(lambda p, x: jnp.sum(jaxfox.cfc_scan(p, x) * c)), (params, _normal(1, (a.B, a.T, a.I)))


def iqn(a):
    params = jaxfox.iqn_head_init(jax.random.key(0), a.H, n_cos=a.K)
    psi = jax.nn.relu(_normal(1, (a.B, a.H)))
    taus = jax.random.uniform(jax.random.key(2), (a.B, a.N))
    c = _normal(3, (a.B, a.N))
    return jax.value_and_grad(lambda p, psi: jnp.sum(jaxfox.iqn_head(p, psi, taus) * c), argnums=(0, 1)), (params, psi)


def iql(a):
    from jaxfox.models.aux import iql_init
    params = iql_init(jax.random.key(0), a.D, hidden=(a.H,), num_networks=a.G)
    taus = tuple(0.5 + 0.4 * g / max(1, a.G - 1) for g in range(a.G))
    obs, target = _normal(1, (a.B, a.D)), _normal(2, (a.B,))
    return jax.value_and_grad(lambda p: jnp.sum(jaxfox.iql_value_loss(p, obs, target, taus))), (params,)


def grn(a):
    params = jaxfox.grn_init(jax.random.key(0), a.I, a.H, a.O)
    c = _normal(2, (a.R, a.O))
    return jax.value_and_grad(lambda p, x: jnp.sum(jaxfox.grn(p, x) * c), argnums=(0, 1)), (params, _normal(1, (a.R, a.I)))


def vsn(a):
    params = jaxfox.vsn_init(jax.random.key(0), a.M, a.D, a.H, a.O)
    c = _normal(2, (a.R, a.O))
    xs = _normal(1, (a.R, a.M, a.D))
    return jax.value_and_grad(lambda p, x: jnp.sum(jaxfox.vsn(p, x)[0] * c), argnums=(0, 1)), (params, xs)


_OPS = {"cfc": (cfc, dict(B=32, T=256, I=48, H=128, U=128)),
        "iqn": (iqn, dict(B=16384, N=32, K=64, H=128)),
        "grn": (grn, dict(R=2048, I=192, H=32, O=48)),
        "iql": (iql, dict(B=16384, D=256, H=128, G=2)),
        "vsn": (vsn, dict(R=2048, M=48, D=4, H=32, O=32))}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="op", required=True)
    for name, (_, dims) in _OPS.items():
        p = sub.add_parser(name)
        for k, v in dims.items():
            p.add_argument(f"--{k}", type=int, default=v)
    a = ap.parse_args()
    assert jaxfox.kernels_available(), jaxfox.kernels_unavailable_reason()
    fn, args = _OPS[a.op][0](a)
    compiled = jax.jit(fn).lower(*args).compile()
    out = jax.block_until_ready(compiled(*args))
    print("loss", float(out[0]))


if __name__ == "__main__":
    main()
