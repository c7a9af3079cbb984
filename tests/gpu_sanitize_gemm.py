"""Small grouped-GEMM runs through the CUDA kernels (ffi/grouped_gemm.cu: jaxfox_grouped_gemm, jaxfox_grouped_wgrad),
for compute-sanitizer.

Run on the GPU machine (tools/gpu_visit.sh phase ``sanitize:gemm``), e.g.:
    compute-sanitizer --tool memcheck  python3 tests/gpu_sanitize_gemm.py
    compute-sanitizer --tool racecheck python3 tests/gpu_sanitize_gemm.py
Cases, each a forward and a backward (jax.vjp at a given cotangent: dx is a second grouped GEMM, dw and db the
split-K wgrad kernel and its split sum), each run once:
  odd:      float32 "highest" (the SIMT kernel), list form, groups (M, K, N) with partial tiles on every edge, a
            K = 1 group, an empty group (M = 0, produced outside the kernels) and bias on every other group;
  splitk:   float32 "highest", M = 4097 rows (several wgrad splits, the last split partial) and M = 65 (one);
  tf32:     default precision (the TF32 tensor-core kernels), partial tiles;
  bf16:     bfloat16 groups (the bf16 tensor-core kernels, float32 accumulation);
  stacked:  grouped_matmul_stacked with one shared x [M, K] (the IQL pair's first layer) and with x [G, M, K].
The programs hold only the jaxfox custom calls and XLA elementwise work (no cuBLAS: the sanitizer has segfaulted
at start-up on programs with XLA GEMMs, CONTEXT.md); the script checks that. Every result must be finite and
within the case's tolerance of a float64 NumPy oracle computed on the host (1e-5 for "highest", 2e-3 for TF32,
1e-2 for bfloat16: tests/test_gpu_gemm.py's bounds). Prints OK at the end. Exit status: 0 when all pass; 1 when a
result is not finite, off the oracle, or a program lacks a kernel or holds a cuBLAS call; 2 when the kernels are
not available (nothing would be sanitized). JAXFOX_SANITIZE_CASES=odd,bf16 runs only those cases.
"""

from __future__ import annotations

import os
import sys

# Keep the sanitizer's view small: no 75% preallocation, no GEMM autotuning launches.
os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
# one cudaMalloc per buffer (not XLA's pool), so that memcheck sees a read or write just past a buffer's end
os.environ.setdefault("XLA_PYTHON_CLIENT_ALLOCATOR", "platform")
# the kernels are opt-in (jaxfox._ffi.OPT_IN): add grouped_matmul to whatever JAXFOX_OPT_IN_KERNELS names already
_names = [n for n in os.environ.get("JAXFOX_OPT_IN_KERNELS", "").split(",") if n.strip()]
os.environ["JAXFOX_OPT_IN_KERNELS"] = ",".join(_names + ["grouped_matmul"])
if "xla_gpu_autotune_level" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_gpu_autotune_level=0").strip()

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

import jaxfox  # noqa: E402
from jaxfox.gemm import wgrad_splits  # noqa: E402

TARGETS = ("jaxfox_grouped_gemm", "jaxfox_grouped_wgrad")
TOL = {"highest": 1e-5, "tf32": 2e-3, "bf16": 1e-2}


def _rand(rng, shape, dtype):
    return jnp.asarray(rng.standard_normal(shape).astype(np.float32), dtype)


def _f64(a):
    return None if a is None else np.asarray(jnp.asarray(a, jnp.float32), np.float64)


def _check(name, compiled, got, want, tol) -> bool:
    from conftest import rel_err

    text = compiled.as_text()
    missing = [t for t in TARGETS if t not in text]
    if missing or "cublas" in text.lower():
        print(f"{name}: PROGRAM WRONG (missing {missing}, cuBLAS call {'cublas' in text.lower()})", flush=True)
        return False
    got_l, want_l = jax.tree.leaves(got), jax.tree.leaves(want)
    assert len(got_l) == len(want_l), (name, len(got_l), len(want_l))
    bad = [i for i, a in enumerate(got_l) if not np.isfinite(np.asarray(a, np.float32)).all()]
    if bad:
        print(f"{name}: NOT FINITE (results {bad})", flush=True)
        return False
    errs = [rel_err(np.asarray(a, np.float32), b) for a, b in zip(got_l, want_l) if np.asarray(b).size]
    ok = max(errs, default=0.0) <= tol
    print(f"{name}: {'ok' if ok else 'OFF THE ORACLE'} (max rel err {max(errs, default=0.0):.1e}, tol {tol:.0e}, "
          f"{len(errs)} arrays)", flush=True)
    return ok


def list_case(name, shapes, dtype, precision, seed) -> bool:
    """grouped_matmul forward and VJP of groups (M, K, N), bias on the even groups, against float64 NumPy."""
    rng = np.random.default_rng(seed)
    xs = [_rand(rng, (M, K), dtype) for M, K, N in shapes]
    ws = [_rand(rng, (K, N), dtype) for M, K, N in shapes]
    bs = [_rand(rng, (N,), dtype) if g % 2 == 0 else None for g, (M, K, N) in enumerate(shapes)]
    cots = [_rand(rng, (M, N), dtype) for M, K, N in shapes]

    def f(xs, ws, bs, cots):
        ys, vjp = jax.vjp(jaxfox.grouped_matmul, xs, ws, bs)
        return ys, vjp(cots)

    with jax.default_matmul_precision(precision):
        compiled = jax.jit(f).lower(xs, ws, bs, cots).compile()
        got = jax.device_get(jax.block_until_ready(compiled(xs, ws, bs, cots)))
    X, W, Bs, C = ([_f64(a) for a in v] for v in (xs, ws, bs, cots))
    want = ([x @ w + (0 if b is None else b) for x, w, b in zip(X, W, Bs)],
            ([c @ w.T for c, w in zip(C, W)], [x.T @ c for x, c in zip(X, C)],
             [None if b is None else c.sum(0) for b, c in zip(Bs, C)]))
    return _check(name, compiled, got, want, TOL["bf16" if dtype == jnp.bfloat16 else
                                                 "highest" if precision == "highest" else "tf32"])


def stacked_case(name, G, M, K, N, shared, seed) -> bool:
    """grouped_matmul_stacked (float32 "highest") forward and VJP, x shared [M, K] or stacked [G, M, K]."""
    rng = np.random.default_rng(seed)
    x = _rand(rng, (M, K) if shared else (G, M, K), jnp.float32)
    w, b, dy = _rand(rng, (G, K, N), jnp.float32), _rand(rng, (G, N), jnp.float32), _rand(rng, (G, M, N), jnp.float32)

    def f(x, w, b, dy):
        y, vjp = jax.vjp(jaxfox.grouped_matmul_stacked, x, w, b)
        return y, vjp(dy)

    with jax.default_matmul_precision("highest"):
        compiled = jax.jit(f).lower(x, w, b, dy).compile()
        got = jax.device_get(jax.block_until_ready(compiled(x, w, b, dy)))
    x64 = np.broadcast_to(_f64(x), (G, M, K))
    w64, b64, dy64 = _f64(w), _f64(b), _f64(dy)
    dxw = np.einsum("gmn,gkn->gmk", dy64, w64)
    want = (np.einsum("gmk,gkn->gmn", x64, w64) + b64[:, None],
            (dxw.sum(0) if shared else dxw, np.einsum("gmk,gmn->gkn", x64, dy64), dy64.sum(1)))
    return _check(name, compiled, got, want, TOL["highest"])


def main() -> int:
    if not jaxfox.kernels_available():
        print(f"jaxfox kernels unavailable: {jaxfox.kernels_unavailable_reason()}", file=sys.stderr)
        return 2
    odd = [(1, 1, 1), (7, 129, 3), (129, 7, 65), (0, 5, 4), (65, 64, 1), (3, 100, 129)]
    splitk = [(4097, 64, 32), (65, 33, 17)]
    splits = wgrad_splits([(M, K, N, g % 2 == 0) for g, (M, K, N) in enumerate(splitk)])  # bias: even groups
    assert splits[0][0] > 1 and 4097 % splits[0][1] != 0, ("the split-K case no longer splits unevenly", splits)
    cases = {
        "odd": lambda: list_case("odd (float32 highest)", odd, jnp.float32, "highest", 1),
        "splitk": lambda: list_case(f"splitk (float32 highest, wgrad splits {splits})", splitk, jnp.float32,
                                    "highest", 2),
        "tf32": lambda: list_case("tf32 (default precision)", [(100, 64, 48), (33, 7, 9)], jnp.float32,
                                  "tensorfloat32", 3),
        "bf16": lambda: list_case("bf16", [(130, 70, 33), (1, 16, 16), (0, 3, 2)], jnp.bfloat16, "highest", 4),
        "stacked": lambda: (stacked_case("stacked shared x (G=2, 37 x 256 -> 128)", 2, 37, 256, 128, True, 5)
                            & stacked_case("stacked x [G, M, K] (G=3, 70 x 33 -> 9)", 3, 70, 33, 9, False, 6)),
    }
    only = [c for c in os.environ.get("JAXFOX_SANITIZE_CASES", "").split(",") if c]
    unknown = [c for c in only if c not in cases]
    if unknown:
        print(f"JAXFOX_SANITIZE_CASES names unknown cases {unknown}; known: {list(cases)}", file=sys.stderr)
        return 1
    ok = True
    for name, run in cases.items():
        if not only or name in only:
            ok = run() and ok
    if not ok:
        print("FAILED")
        return 1
    print("OK")
    return 0


if __name__ == "__main__":
    sys.exit(main())
