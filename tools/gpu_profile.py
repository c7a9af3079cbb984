"""Times the CfC kernels at the benchmark shape: forward only and forward+backward (in-graph loop)."""
import os, sys, time
import numpy as np
import jax, jax.numpy as jnp
import jaxfox
from jaxfox import cfc_scan, cfc_init

B, T, I, H, U = [int(v) for v in (sys.argv[1:6] if len(sys.argv) > 5 else (32, 256, 48, 128, 128))]
p = cfc_init(jax.random.key(0), I, H, backbone_units=U)
xs = jax.random.normal(jax.random.key(1), (B, T, I))
N = 20

def fwd_body(i, c):
    return c + cfc_scan(p, xs * (1 + 0 * c))[0, -1, 0]

def fb_body(i, c):
    g = jax.grad(lambda p, xs: jnp.sum(cfc_scan(p, xs) ** 2), argnums=(0, 1))(p, xs * (1 + 0 * c))
    return c + g[1][0, 0, 0]

def timed(body, ref):
    import contextlib
    with (jaxfox.use_reference() if ref else contextlib.nullcontext()):
        f = jax.jit(lambda: jax.lax.fori_loop(0, N, body, 0.0))
        f().block_until_ready()
        ts = []
        for _ in range(7):
            t0 = time.perf_counter(); f().block_until_ready(); ts.append((time.perf_counter() - t0) / N)
    return np.median(ts) * 1e3

tag = os.environ.get("JAXFOX_CFC_CLUSTER", "auto")
if len(sys.argv) > 6 and sys.argv[6] == "once":
    g = jax.jit(jax.grad(lambda p, xs: jnp.sum(cfc_scan(p, xs) ** 2), argnums=(0, 1)))
    for _ in range(3):
        jax.block_until_ready(g(p, xs))
    sys.exit(0)
print(f"cluster={tag} B={B} T={T}: fwd kernel {timed(fwd_body, False):.3f} ms | fwd+bwd kernel {timed(fb_body, False):.3f} ms",
      flush=True)
if tag == "auto":
    print(f"  reference: fwd {timed(fwd_body, True):.3f} ms | fwd+bwd {timed(fb_body, True):.3f} ms", flush=True)
