"""GPU visit tool: the TF32 GRN kernels (jaxfox/grn.py _grn_tc, opt-in ``grn``) against XLA at the default matmul
precision, both measured against XLA at "highest": relative errors of y, dx and every parameter gradient, and
whether the jitted program really calls jaxfox_grn_tc_fwd. Run on the GPU machine: ``python3 tools/tc_check.py``.
(The pass/fail checks are tests/test_gpu_grn.py ``-k tc``; this prints the numbers behind them.)"""
import os
os.environ.setdefault("JAXFOX_OPT_IN_KERNELS", "grn")
import numpy as np
import jax
import jax.numpy as jnp
import jaxfox
from jaxfox.grn import grn, grn_init


def run(R, I, H, O):
    k = jax.random.split(jax.random.PRNGKey(R + I + H + O), 4)
    p = grn_init(k[0], I, H, O)
    p = jax.tree.map(lambda a: a + 0.05 * jax.random.normal(k[1], a.shape), p)
    x = jax.random.normal(k[2], (R, I))
    dy = jax.random.normal(k[3], (R, O))
    loss = lambda p, x: jnp.sum(grn(p, x) * dy)
    step = lambda p, x: (grn(p, x), jax.grad(loss, (0, 1))(p, x))
    fresh = lambda: jax.jit(lambda p, x: step(p, x))  # a new function: jit's cache ignores use_reference()
    f = fresh()
    used = "jaxfox_grn_tc_fwd" in f.lower(p, x).as_text()
    y, (gp, gx) = f(p, x)
    with jaxfox.use_reference():
        y0, (gp0, gx0) = fresh()(p, x)
        with jax.default_matmul_precision("highest"):
            yh, (gph, gxh) = fresh()(p, x)
    def rel(a, b):
        a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
        return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))
    print(f"R={R} I={I} H={H} O={O} tc_used={used}")
    print(f"  y: kernel-vs-highest {rel(y, yh):.2e}  xla-vs-highest {rel(y0, yh):.2e}")
    print(f"  dx: kernel {rel(gx, gxh):.2e}  xla {rel(gx0, gxh):.2e}")
    for key in sorted(gp):
        print(f"  d{key}: kernel {rel(gp[key], gph[key]):.2e}  xla {rel(gp0[key], gph[key]):.2e}")


for shape in [(2048, 128, 128, 128), (100, 16, 128, 128), (1, 128, 128, 128), (130, 64, 128, 64), (70, 128, 32, 128)]:
    try:
        run(*shape)
    except Exception as e:  # noqa: BLE001
        print("FAILED", shape, type(e).__name__, str(e)[:2000])
