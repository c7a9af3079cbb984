"""One small CfC fwd+bwd and one reduce_axis0 through the CUDA kernels, for compute-sanitizer:

    compute-sanitizer --tool memcheck python tests/gpu_sanitize.py
    compute-sanitizer --tool racecheck python tests/gpu_sanitize.py
"""
import jax
import jax.numpy as jnp
import numpy as np

import jaxfox

assert jaxfox.kernels_available(), jaxfox.kernels_unavailable_reason()
for mode, L in (("default", 1), ("pure", 0), ("no_gate", 2)):
    p = jaxfox.cfc_init(jax.random.key(0), 5, 12, backbone_units=10, backbone_layers=L, mode=mode)
    xs = jax.random.normal(jax.random.key(1), (3, 6, 5))
    g = jax.jit(jax.grad(lambda p, xs: jnp.sum(jaxfox.cfc_scan(p, xs, 0.5, mode=mode) ** 2), argnums=(0, 1)))(p, xs)
    assert all(np.isfinite(np.asarray(leaf)).all() for leaf in jax.tree.leaves(g))
r = jax.jit(jaxfox.reduce_axis0)(jnp.ones((300, 1001), jnp.float32))
assert float(r[0]) == 300.0
print("OK")
