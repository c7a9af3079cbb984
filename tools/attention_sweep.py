"""Where the attention_pool kernels beat the factored XLA form (a tuning tool for GPU visits, not a test).

    python3 tools/attention_sweep.py [--shapes 32x64x128,256x64x128,...] [--params-only] [--repeats 5]

For each shape BxTxH (4 heads, no mask) it times the forward+backward of ``sum(pooled * w)`` (w.r.t. the
parameters and hs, or the parameters only) on the jaxfox path twice in one process: attention_pool opted in
(the CUDA kernels) and not (the factored XLA form), with the bench's in-graph loop (jaxfox.bench._Path),
calls alternating, and prints one line per shape: median us per op call (loop overhead included) and
factored / kernels (> 1: the kernels are faster). Used to choose jaxfox.attention's default path.
"""

from __future__ import annotations

import argparse

import jax
import jax.numpy as jnp

import jaxfox
from jaxfox.bench import _Path
from jaxfox.bench.cases import _opted_in

_DEFAULT = ("32x64x128,64x64x128,128x64x128,256x64x128,1024x64x128,256x16x128,2048x16x128,32x256x128,"
            "128x256x128,256x64x64,2048x64x64,1024x16x64,16384x16x64")


def _builder(opt_in, w, params_only):
    def builder():
        def op(p, x):
            with _opted_in("attention_pool", opt_in):
                f = lambda p, x: jnp.sum(jaxfox.attention_pool(p, x)[0] * w)  # noqa: E731
                return jax.value_and_grad(f, argnums=0 if params_only else (0, 1))(p, x)

        return op

    return builder


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shapes", default=_DEFAULT)
    ap.add_argument("--params-only", action="store_true")
    ap.add_argument("--repeats", type=int, default=5)
    a = ap.parse_args()
    print(f"device {jax.devices()[0].device_kind}, kernels available: {jaxfox.kernels_available()}")
    print("B x T x H: factored us, kernels us, factored / kernels")
    for s in a.shapes.split(","):
        B, T, H = (int(v) for v in s.split("x"))
        p = jaxfox.attention_pool_init(jax.random.key(0), H, num_heads=4)
        x = jax.random.normal(jax.random.key(1), (B, T, H))
        w = jax.random.normal(jax.random.key(2), (H,))
        kw = dict(unroll=1, stateful=False, reference=False, min_call_s=0.02, max_inner=100_000, log=lambda m: None)
        paths = {k: _Path(_builder(k == "kernels", w, a.params_only), (p, x), **kw) for k in ("factored", "kernels")}
        calls = {k: paths[k].compiled.ffi_calls for k in paths}
        for _ in range(a.repeats):
            for q in paths.values():
                q.call()
        t = {k: q.result()["median_s"] * 1e6 for k, q in paths.items()}
        print(f"{B}x{T}x{H}: {t['factored']:.2f} {t['kernels']:.2f} {t['factored'] / t['kernels']:.3f}"
              f"  (ffi calls {calls['factored']} / {calls['kernels']})", flush=True)


if __name__ == "__main__":
    main()
