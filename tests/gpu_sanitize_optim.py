"""Small fused-AdamW kernel workload for compute-sanitizer (not a pytest module).

Usage on the GPU machine:

    compute-sanitizer --tool memcheck  python tests/gpu_sanitize_optim.py
    compute-sanitizer --tool racecheck python tests/gpu_sanitize_optim.py
    compute-sanitizer --tool initcheck python tests/gpu_sanitize_optim.py

Runs ``fused_adamw(...).step`` on FlatParams through the jaxfox_adamw_apply kernel (opted in here) at sizes
around the float4 body / scalar tail and the 256-thread block (P = 1, 3, 5, 255, 257, 4097, 65539), with
clipping on and off, the three mask modes (elementwise, all, none), and under vmap (V = 2: P % 4 != 0 takes
the scalar loads, P % 4 == 0 the float4 ones), then on parameter trees of 60 leaves (two launches; moments per
leaf and flat, elementwise masks, vmap), compares with the reference path, and prints OK. ``flat`` or ``tree`` as
the first argument runs one of the two parts (compute-sanitizer itself segfaulted part-way through the tree part
on the H200 in the eleventh session, with no error reported before: BENCHMARKS.md). Exits
non-zero when the kernels are not available (nothing would be sanitized).
"""

from __future__ import annotations

import os
import sys

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
# one cudaMalloc per buffer (not XLA's pool), so that memcheck sees a read or write just past a buffer's end
os.environ.setdefault("XLA_PYTHON_CLIENT_ALLOCATOR", "platform")
os.environ["JAXFOX_OPT_IN_KERNELS"] = ",".join(
    [n for n in os.environ.get("JAXFOX_OPT_IN_KERNELS", "").split(",") if n] + ["adamw"])
if "xla_gpu_autotune_level" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_gpu_autotune_level=0").strip()

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

import jaxfox  # noqa: E402
from jaxfox import optim  # noqa: E402


def state(P, seed):
    k = (P + 1) // 2
    lay = optim.FlatParams.from_tree({"b": jnp.zeros((P - k,)), "w": jnp.zeros((k, 1))}).layout
    rng = np.random.default_rng(seed)
    f = lambda x: optim.FlatParams(jnp.asarray(x, jnp.float32), lay)  # noqa: E731
    mu = 0.01 * rng.standard_normal(P)
    st = optim.FusedAdamWState(jnp.asarray(3, jnp.int32), f(mu), f(mu * mu + 1e-4 * rng.uniform(0, 1, P)))
    return f(rng.standard_normal(P)), st, f(rng.standard_normal(P))


def check(fn, *args):
    print("case", [tuple(x.shape) for x in jax.tree.leaves(args)][:3], len(jax.tree.leaves(args)), flush=True)
    got = jax.block_until_ready(jax.jit(fn)(*args))
    assert "jaxfox_adamw_apply" in jax.jit(fn).lower(*args).compile().as_text()
    with jaxfox.use_reference():
        want = jax.jit(fn)(*args)
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-6)


def main(part="all"):
    if part not in ("all", "flat", "tree"):
        sys.exit(f"usage: {sys.argv[0]} [all|flat|tree], got {part!r}")
    if not jaxfox.kernels_available():
        print(f"kernels unavailable: {jaxfox.kernels_unavailable_reason()}")
        sys.exit(2)
    if part in ("all", "flat"):
        flat_cases()
    if part in ("all", "tree"):
        tree_cases()
    print("OK")


def flat_cases():
    for P in (1, 3, 5, 255, 257, 4097, 65539):
        params, st, g = state(P, P)
        for clip in (None, 1.0):
            for kw in ({}, {"mask": True}, {"weight_decay": 0.0}):
                tx = optim.fused_adamw(1e-3, **{"weight_decay": 0.05, **kw}, max_grad_norm=clip)
                check(tx.step, g, st, params)
    for P in (5, 8, 4097):
        (p1, s1, g1), (p2, s2, g2) = state(P, 1), state(P, 2)
        stack = lambda a, b: jax.tree.map(lambda x, y: jnp.stack([x, y]), a, b)  # noqa: E731
        tx = optim.fused_adamw(1e-3, weight_decay=0.05, max_grad_norm=1.0)
        check(jax.vmap(tx.step), stack(g1, g2), stack(s1, s2), stack(p1, p2))


def tree_cases():
    # parameter trees (the default rule runs the kernel): 60 leaves (two launches of the 56-leaf table) with a
    # scalar, an empty leaf and sizes around the float4 body; moments per leaf and flat; elementwise masks; vmap
    rng = np.random.default_rng(7)
    shapes = [(), (0,), (1,), (3,), (5, 7), (4097,), (64, 33), (2, 2), (257,), (6,)] * 6
    tree = {f"l{i:02d}": jnp.asarray(rng.standard_normal(sh), jnp.float32) for i, sh in enumerate(shapes)}
    g = jax.tree.map(lambda x: x * 3.0 + 0.5, tree)
    odd = lambda p: jax.tree.map(lambda x: jnp.arange(x.size).reshape(x.shape) % 2 == 1, p)  # noqa: E731
    for flat in (False, True):
        for clip in (None, 1.0):
            for mask in (None, odd):
                tx = optim.fused_adamw(1e-3, weight_decay=0.05, mask=mask, max_grad_norm=clip, flatten_moments=flat)
                st = tx.init(tree)
                st = st._replace(mu=jax.tree.map(lambda x: x + 0.01, st.mu), nu=jax.tree.map(lambda x: x + 1e-4, st.nu))
                check(tx.step, g, st, tree)
        small = {k: tree[k] for k in list(tree)[:9]}
        gs = {k: g[k] for k in small}
        tx = optim.fused_adamw(1e-3, weight_decay=0.05, max_grad_norm=1.0, flatten_moments=flat)
        st = tx.init(small)
        stack = lambda a: jax.tree.map(lambda x: jnp.stack([x, x * 0.5]), a)  # noqa: E731
        check(jax.vmap(tx.step), stack(gs), stack(st), stack(small))


if __name__ == "__main__":
    main(*sys.argv[1:2])
