"""cfc_scan forward+backward time by cluster size: the measurement behind ffi/cfc.cu's ChooseCluster rule.

    python3 tools/cfc_cluster_sweep.py [--clusters 1,2,4] [--repeats 3]

For each cluster size C, a child process with ``JAXFOX_CFC_CLUSTER=C`` (read once per process by the
extension) times value_and_grad of sum(cfc_scan(params, xs) * w) w.r.t. params and xs with the bench
harness (``jaxfox.bench.run_variant``: in-graph loop, reference and jaxfox paths alternating) at a few
sizes around the main job's CfC (B=32 T=64 I=32 H=32 U=64, one backbone layer, mode "default"); the parent
prints one table, jaxfox time per (shape, C). A tuning tool for GPU visits; results go to BENCHMARKS.md.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

SHAPES = [(32, 64, 32, 32, 64), (32, 64, 32, 64, 64), (32, 64, 32, 128, 64)]  # (B, T, I, H, U)


def child(repeats: int) -> None:
    import jax
    import jax.numpy as jnp

    import jaxfox
    from jaxfox.bench import CaseSpec, Variant, run_variant

    assert jaxfox.kernels_available(), jaxfox.kernels_unavailable_reason()
    for B, T, I, H, U in SHAPES:
        def setup(B=B, T=T, I=I, H=H, U=U):
            params = jaxfox.cfc_init(jax.random.key(2), I, H, backbone_units=U, backbone_layers=1)
            xs = jax.random.normal(jax.random.key(3), (B, T, I), jnp.float32)
            w = jax.random.normal(jax.random.key(4), (H,), jnp.float32)

            def builder():
                return lambda p, x, w: jax.value_and_grad(
                    lambda p, x: jnp.sum(jaxfox.cfc_scan(p, x) * w), argnums=(0, 1))(p, x)

            return CaseSpec(builder, None, (params, xs, w), None, None)

        row = run_variant(Variant("cfc_scan", f"B={B} T={T} I={I} H={H} U={U}", setup), repeats=repeats,
                          overhead=False, log=lambda s: print(s, file=sys.stderr))
        print(json.dumps({"shape": [B, T, I, H, U], "jaxfox_s": row["jaxfox"]["median_s"],
                          "reference_s": row["reference"]["median_s"]}), flush=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--clusters", default="1,2,4")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        child(args.repeats)
        return
    table: dict[tuple, dict[int, float]] = {}
    ref: dict[tuple, float] = {}
    for C in (int(c) for c in args.clusters.split(",")):
        env = {**os.environ, "JAXFOX_CFC_CLUSTER": str(C)}
        out = subprocess.run([sys.executable, __file__, "--child", "--repeats", str(args.repeats)], env=env,
                             capture_output=True, text=True)
        if out.returncode:
            print(f"C={C}: child failed (rc {out.returncode}):\n{out.stderr[-3000:]}")
            continue
        for line in out.stdout.splitlines():
            r = json.loads(line)
            table.setdefault(tuple(r["shape"]), {})[C] = r["jaxfox_s"]
            ref.setdefault(tuple(r["shape"]), r["reference_s"])
    for shape, by_c in table.items():
        cols = "  ".join(f"C={C}: {t * 1e6:8.1f} us" for C, t in sorted(by_c.items()))
        print(f"B,T,I,H,U={shape}  reference {ref[shape] * 1e6:8.1f} us  {cols}")


if __name__ == "__main__":
    main()
