"""Small IQL value-loss runs through the CUDA kernel paths (ffi/iql.cu: jaxfox_iql_head, and jaxfox_iql_fused where
it applies: H = 128 or 256 and D a multiple of 4 on compute capability 9.0), for compute-sanitizer.

Run on the GPU machine (tools/gpu_visit.sh phase ``sanitize:iql``), e.g.:
    compute-sanitizer --tool memcheck  python3 tests/gpu_sanitize_iql.py
    compute-sanitizer --tool racecheck python3 tests/gpu_sanitize_iql.py
Cases: tests/iql_cases.py SANITIZE ((G, D, H, B, seed), each run once; which kernel each runs is noted there).
Each case runs jax.vjp w.r.t. the params (XLA's first-layer GEMM and the head kernel, or the fused kernel; then
XLA's weight-gradient GEMM;
on an H100 the sanitizer ran such programs, the thirty-fifth session), blocks until ready, and checks that every
result is finite, and the values against the float64 NumPy oracle of tests/test_iql.py (rel err <= 5e-3 per
array, the TF32 tolerance) on the exact-math inputs of tests/test_iql.py (every first-layer pre-activation
|p| >= 0.2 and every residual |u| >= 0.25, asserted with the oracle, so TF32 flips no mask).
Prints OK at the end. Exit status: 0 when all pass; 1 when a result is not finite or off the oracle; 2 when the
kernels are not available (nothing would be sanitized).
"""

from __future__ import annotations

import os
import sys

# Keep the sanitizer's view small: no 75% preallocation, no GEMM autotuning launches.
os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
# one cudaMalloc per buffer (not XLA's pool), so that memcheck sees a read or write just past a buffer's end
os.environ.setdefault("XLA_PYTHON_CLIENT_ALLOCATOR", "platform")
# the kernel path is opt-in below H = 128 (jaxfox.iql._DEFAULT_MIN_H): add iql to what JAXFOX_OPT_IN_KERNELS names
_names = [n for n in os.environ.get("JAXFOX_OPT_IN_KERNELS", "").split(",") if n.strip()]
os.environ["JAXFOX_OPT_IN_KERNELS"] = ",".join(_names + ["iql"])
if "xla_gpu_autotune_level" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_gpu_autotune_level=0").strip()

import jax  # noqa: E402
import numpy as np  # noqa: E402

import jaxfox  # noqa: E402

TARGETS = ("jaxfox_iql_head", "jaxfox_iql_fused")  # the fused kernel where it applies (H = 128, 256 on sm_90)
TOL = 5e-3


def case(G, D, H, B, seed=0) -> bool:
    """One run of the kernel; True when every result is finite and within TOL of the oracle."""
    from conftest import rel_err
    from test_iql import (assert_far_from_kinks, cotangent, exact_inputs, named, np_iql_grads, np_iql_loss,
                          taus_for)

    params, obs, target = exact_inputs(G, D, H, B, seed=seed)
    assert_far_from_kinks(params, obs, target)
    taus, c = taus_for(G), cotangent(G, seed=seed)

    def f(p, o, t, c):  # the losses and the gradient of sum_g c_g loss_g w.r.t. the params: one kernel call
        loss, vjp = jax.vjp(lambda p: jaxfox.iql_value_loss(p, o, t, taus), p)
        return loss, named(*vjp(c))

    compiled = jax.jit(f).lower(params, obs, target, c).compile()
    text = compiled.as_text()
    taken = [t for t in TARGETS if t in text]
    assert taken, "kernel path not taken"
    loss, grads = jax.device_get(jax.block_until_ready(compiled(params, obs, target, c)))
    got = {"loss": loss, **grads}
    bad = [k for k, v in got.items() if not np.isfinite(np.asarray(v)).all()]
    if bad:
        print(f"iql_value_loss G={G} D={D} H={H} B={B}: NOT FINITE: {bad}", flush=True)
        return False
    want_g = np_iql_grads(params, obs, target, taus, c)
    want = {"loss": np_iql_loss(params, obs, target, taus), **{k: want_g[k] for k in grads}}
    errs = {k: rel_err(got[k], want[k]) for k in got}
    ok = all(e <= TOL for e in errs.values())
    print(f"iql_value_loss G={G} D={D} H={H} B={B} ({taken[0]}): {'ok' if ok else 'OFF THE ORACLE'} "
          f"(rel errs {', '.join(f'{k} {e:.1e}' for k, e in errs.items())})", flush=True)
    return ok


def main() -> int:
    if not jaxfox.kernels_available():
        print(f"jaxfox kernels unavailable: {jaxfox.kernels_unavailable_reason()}", file=sys.stderr)
        return 2
    ok = True
    from iql_cases import SANITIZE

    for G, D, H, B, seed in SANITIZE:
        ok = case(G, D, H, B, seed=seed) and ok
    if not ok:
        print("FAILED")
        return 1
    print("OK")
    return 0


if __name__ == "__main__":
    sys.exit(main())
