"""Quick GPU check of the CfC and reduce kernels against the reference (run on the H200)."""
import time, sys
import numpy as np
import jax, jax.numpy as jnp
import jaxfox
from jaxfox import cfc_scan, cfc_init

print("devices", jax.devices(), "kernels:", jaxfox.kernels_available(), jaxfox.kernels_unavailable_reason())

def rel(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))

def case(B, T, I, H, U, L, mode, seed=0):
    k = jax.random.split(jax.random.key(seed), 5)
    p = cfc_init(k[0], I, H, backbone_units=U, backbone_layers=L, mode=mode)
    xs = jax.random.normal(k[1], (B, T, I))
    ts = jax.random.uniform(k[2], (B, T), minval=0.0, maxval=2.0)
    h0 = 0.5 * jax.random.normal(k[3], (B, H))
    wout = jax.random.normal(k[4], (B, T, H))
    def loss(p, xs, ts, h0):
        return jnp.sum(cfc_scan(p, xs, ts, h0, mode=mode) * wout)
    with jax.default_matmul_precision("highest"):
        f_k = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2, 3)))
        vk, gk = f_k(p, xs, ts, h0)
        with jaxfox.use_reference():
            vr, gr = f_k(p, xs, ts, h0)
        hk = jax.jit(lambda p, xs, ts, h0: cfc_scan(p, xs, ts, h0, mode=mode))(p, xs, ts, h0)
        with jaxfox.use_reference():
            hr = jax.jit(lambda p, xs, ts, h0: cfc_scan(p, xs, ts, h0, mode=mode))(p, xs, ts, h0)
    errs = {"hs": rel(hk, hr)}
    for name, a, b in zip(["params", "xs", "ts", "h0"], gk, gr):
        la, lb = jax.tree.leaves(a), jax.tree.leaves(b)
        errs[name] = max(rel(x, y) for x, y in zip(la, lb))
    ok = all(v <= 1e-5 for v in errs.values())
    print(f"{'OK ' if ok else 'BAD'} B={B} T={T} I={I} H={H} U={U} L={L} {mode:8s}", {k: f"{v:.1e}" for k, v in errs.items()}, flush=True)
    return ok

allok = True
for args in [(3, 5, 7, 9, 13, 1, "default"), (32, 64, 48, 128, 128, 1, "default"), (4, 9, 6, 16, 8, 0, "default"),
             (5, 7, 4, 33, 20, 2, "no_gate"), (6, 11, 5, 12, 10, 1, "pure"), (2, 3, 3, 200, 300, 2, "default"),
             (32, 256, 48, 128, 128, 1, "default"), (32, 64, 32, 32, 64, 1, "default"), (7, 6, 5, 33, 17, 1, "pure"),
             (3, 4, 300, 20, 8, 0, "no_gate"), (2, 5, 270, 16, 24, 1, "default")]:
    try:
        allok &= case(*args)
    except Exception as e:
        allok = False
        print("ERR", args, repr(e)[:2000], flush=True)

# reduce
x = jax.random.normal(jax.random.key(3), (32, 1 << 20))
r = jax.jit(jaxfox.reduce_axis0)(x)
print("reduce rel", rel(r, np.asarray(x, np.float64).sum(0)))
for shp in [(1, 7), (3, 1000), (2048, 4096), (16384, 64), (100, 5)]:
    x = jax.random.normal(jax.random.key(4), shp)
    print("reduce", shp, rel(jax.jit(jaxfox.reduce_axis0)(x), np.asarray(x, np.float64).sum(0)))

print("ALL OK" if allok else "SOME BAD")
