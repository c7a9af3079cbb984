"""CPU tests of jaxfox.grouped_matmul / grouped_matmul_stacked (reference path) against float64 NumPy.

The oracle is per-group ``x.astype(float64) @ w.astype(float64) + b`` written here with NumPy; the
gradients are checked against the closed forms dx = dy w^T, dw = x^T dy, db = sum_m dy (NumPy,
float64) and with jax.test_util.check_grads.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.test_util import check_grads

import jaxfox

MIXED = [(5, 7, 3), (0, 4, 6), (33, 1, 9), (1, 16, 1), (17, 12, 130)]  # (M, K, N) per group


def _rand(rng, shape, dtype=np.float32):
    return jnp.asarray(rng.standard_normal(shape).astype(np.float32), dtype)


def _groups(shapes, seed=0, bias=True, dtype=jnp.float32):
    rng = np.random.default_rng(seed)
    xs = [_rand(rng, (M, K), dtype) for M, K, N in shapes]
    ws = [_rand(rng, (K, N), dtype) for M, K, N in shapes]
    bs = [(_rand(rng, (N,), dtype) if (bias and g % 2 == 0) else None) for g, (M, K, N) in enumerate(shapes)]
    return xs, ws, bs


def _np_fwd(x, w, b):
    y = np.asarray(x, np.float64) @ np.asarray(w, np.float64)
    return y if b is None else y + np.asarray(b, np.float64)


def _close(got, want, tol):
    got = np.asarray(got, np.float64)
    scale = max(1.0, float(np.max(np.abs(want)))) if want.size else 1.0
    np.testing.assert_allclose(got, want, rtol=0, atol=tol * scale)


@pytest.mark.parametrize("jit", [False, True])
def test_mixed_shapes_forward(jit):
    xs, ws, bs = _groups(MIXED)
    f = jax.jit(jaxfox.grouped_matmul) if jit else jaxfox.grouped_matmul
    with jax.default_matmul_precision("highest"):
        ys = f(xs, ws, bs)
    assert isinstance(ys, list) and len(ys) == len(MIXED)
    for g, (M, K, N) in enumerate(MIXED):
        assert ys[g].shape == (M, N) and ys[g].dtype == jnp.float32
        _close(ys[g], _np_fwd(xs[g], ws[g], bs[g]), 1e-5)


def test_empty_group_and_bias_only():
    # M = 0 -> [0, N]; K = 0 -> y = b (or 0), with correct gradients.
    xs = [jnp.zeros((0, 3)), jnp.ones((4, 0)), jnp.ones((2, 2))]
    ws = [jnp.ones((3, 5)), jnp.ones((0, 3)), 2 * jnp.ones((2, 1))]
    bs = [jnp.ones(5), jnp.arange(3.0), None]
    ys = jaxfox.grouped_matmul(xs, ws, bs)
    assert ys[0].shape == (0, 5)
    np.testing.assert_array_equal(np.asarray(ys[1]), np.tile(np.arange(3.0), (4, 1)))
    np.testing.assert_array_equal(np.asarray(ys[2]), np.full((2, 1), 4.0))
    loss = lambda bs: sum(jnp.sum(y) for y in jaxfox.grouped_matmul(xs, ws, bs))  # noqa: E731
    db = jax.grad(lambda b0, b1: loss([b0, b1, None]), argnums=(0, 1))(bs[0], bs[1])
    np.testing.assert_array_equal(np.asarray(db[0]), np.zeros(5))   # M = 0: nothing to sum
    np.testing.assert_array_equal(np.asarray(db[1]), np.full(3, 4.0))


def test_one_group():
    xs, ws, bs = _groups([(9, 5, 4)], seed=3)
    (y,) = jaxfox.grouped_matmul(xs, ws, bs)
    _close(y, _np_fwd(xs[0], ws[0], bs[0]), 1e-5)


def test_gradients_closed_form():
    xs, ws, bs = _groups(MIXED, seed=1)
    rng = np.random.default_rng(7)
    cots = [rng.standard_normal((M, N)) for M, K, N in MIXED]

    def loss(xs, ws, bs):
        ys = jaxfox.grouped_matmul(xs, ws, bs)
        return sum(jnp.sum(y * jnp.asarray(c, jnp.float32)) for y, c in zip(ys, cots))

    with jax.default_matmul_precision("highest"):
        dxs, dws, dbs = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))(xs, ws, bs)
    for g in range(len(MIXED)):
        x, w, dy = np.asarray(xs[g], np.float64), np.asarray(ws[g], np.float64), cots[g]
        _close(dxs[g], dy @ w.T, 1e-5)
        _close(dws[g], x.T @ dy, 1e-5)
        if bs[g] is None:
            assert dbs[g] is None
        else:
            _close(dbs[g], dy.sum(axis=0), 1e-5)


def test_check_grads():
    xs, ws, bs = _groups([(4, 3, 2), (2, 5, 3), (0, 2, 2)], seed=2)
    with jax.default_matmul_precision("highest"):
        check_grads(lambda xs, ws, bs: jaxfox.grouped_matmul(xs, ws, bs), (xs, ws, bs), order=2,
                    modes=("rev",), atol=2e-2, rtol=2e-2)


def test_bfloat16():
    shapes = [(8, 16, 4), (3, 7, 5)]
    xs, ws, bs = _groups(shapes, seed=4, dtype=jnp.bfloat16)
    ys = jaxfox.grouped_matmul(xs, ws, bs)
    for g in range(len(shapes)):
        assert ys[g].dtype == jnp.bfloat16
        # float32 accumulation of exact bf16 products, one rounding: within 2^-8 relative of the exact value.
        want = _np_fwd(xs[g], ws[g], bs[g])
        got = np.asarray(ys[g].astype(jnp.float32), np.float64)
        assert np.all(np.abs(got - want) <= 2.0 ** -8 * np.abs(want) + 1e-6 * np.abs(want).max())
    # Mixed bf16/f32 promotes to float32, as jnp.dot.
    (y,) = jaxfox.grouped_matmul([xs[0]], [ws[0].astype(jnp.float32)])
    assert y.dtype == jnp.float32
    _close(y, _np_fwd(xs[0], ws[0], None), 1e-5)
    # Gradients keep their input's dtype.
    dx, dw = jax.grad(lambda x, w: jnp.sum(jaxfox.grouped_matmul([x], [w])[0].astype(jnp.float32)),
                      argnums=(0, 1))(xs[0], ws[0])
    assert dx.dtype == jnp.bfloat16 and dw.dtype == jnp.bfloat16
    np.testing.assert_allclose(np.asarray(dw, np.float64),
                               np.asarray(xs[0], np.float64).T @ np.ones((8, 4)), rtol=1e-2)


@pytest.mark.parametrize("shared", [False, True])
@pytest.mark.parametrize("bias", [False, True])
def test_stacked(shared, bias):
    G, M, K, N = 3, 10, 6, 4
    rng = np.random.default_rng(5)
    x = _rand(rng, (M, K) if shared else (G, M, K))
    w = _rand(rng, (G, K, N))
    b = _rand(rng, (G, N)) if bias else None
    dy = rng.standard_normal((G, M, N))
    with jax.default_matmul_precision("highest"):
        y, vjp = jax.vjp(lambda x, w, b: jaxfox.grouped_matmul_stacked(x, w, b), x, w, b)
        dx, dw, db = vjp(jnp.asarray(dy, jnp.float32))
    x64 = np.broadcast_to(np.asarray(x, np.float64), (G, M, K))
    w64 = np.asarray(w, np.float64)
    want = np.einsum("gmk,gkn->gmn", x64, w64) + (np.asarray(b, np.float64)[:, None, :] if bias else 0)
    assert y.shape == (G, M, N)
    _close(y, want, 1e-5)
    dx_want = np.einsum("gmn,gkn->gmk", dy, w64)
    _close(dx, dx_want.sum(0) if shared else dx_want, 1e-5)
    _close(dw, np.einsum("gmk,gmn->gkn", x64, dy), 1e-5)
    if bias:
        _close(db, dy.sum(axis=1), 1e-5)
    else:
        assert db is None


def test_vmap():
    xs, ws, bs = _groups([(4, 3, 2), (5, 2, 6)], seed=6)
    Xs = [jnp.stack([x, 2 * x]) for x in xs]
    ys = jax.vmap(lambda xs: jaxfox.grouped_matmul(xs, ws, bs))(Xs)
    for g in range(2):
        for v, s in enumerate((1, 2)):  # every instance (a vmap that repeated one instance would pass on one)
            _close(ys[g][v], _np_fwd(s * np.asarray(xs[g]), ws[g], bs[g]), 1e-5)


def test_wgrad_splits_rule():
    # Deterministic function of shape; ranges cover M exactly, split_len a multiple of 32.
    for groups in ([(16384, 256, 128, True)] * 2, [(16384, 128, 1, True)] * 2, [(0, 3, 4, False)],
                   [(1, 1, 1, True), (100000, 7, 9, False)]):
        for (M, K, N, hb), (s, ln) in zip(groups, jaxfox.gemm.wgrad_splits(groups)):
            assert 1 <= s <= 64 and ln % 32 == 0
            assert s * ln >= M and (s - 1) * ln < max(M, 1)
    assert jaxfox.gemm.wgrad_splits([(16384, 256, 128, True)] * 2)[0][0] > 1


def test_errors():
    x, w = jnp.ones((3, 4)), jnp.ones((4, 2))
    with pytest.raises(TypeError, match="xs"):
        jaxfox.grouped_matmul(x, [w])
    with pytest.raises(ValueError, match="at least one group"):
        jaxfox.grouped_matmul([], [])
    with pytest.raises(ValueError, match="ws must have one entry"):
        jaxfox.grouped_matmul([x, x], [w])
    with pytest.raises(ValueError, match=r"ws\[1\].*K = 4.*\(5, 2\)"):
        jaxfox.grouped_matmul([x, x], [w, jnp.ones((5, 2))])
    with pytest.raises(ValueError, match=r"xs\[0\] must have shape \[M, K\]"):
        jaxfox.grouped_matmul([jnp.ones(3)], [w])
    with pytest.raises(TypeError, match=r"xs\[1\] must be float32 or bfloat16, got int32"):
        jaxfox.grouped_matmul([x, jnp.ones((3, 4), jnp.int32)], [w, w])
    with pytest.raises(ValueError, match=r"bs\[1\] must have shape \[2\]"):
        jaxfox.grouped_matmul([x, x], [w, w], [None, jnp.ones(3)])
    with pytest.raises(ValueError, match="bs must have one entry"):
        jaxfox.grouped_matmul([x], [w], [None, None])
    with pytest.raises(TypeError, match=r"bs\[0\] must be float32 or bfloat16, got int32"):
        jaxfox.grouped_matmul([x], [w], [jnp.ones(2, jnp.int32)])
    with pytest.raises(ValueError, match="Precision argument"):        # documented: jnp.dot's own message
        jaxfox.grouped_matmul([x], [w], precision="fp8")
    with pytest.raises(ValueError, match=r"x must have shape \[2, M, 4\]"):
        jaxfox.grouped_matmul_stacked(jnp.ones((3, 5, 4)), jnp.ones((2, 4, 6)))
    with pytest.raises(ValueError, match=r"b must have shape \[2, 6\]"):
        jaxfox.grouped_matmul_stacked(jnp.ones((5, 4)), jnp.ones((2, 4, 6)), jnp.ones((6,)))


@pytest.mark.parametrize("precision", [jax.lax.DotAlgorithmPreset.F32_F32_F32, "F32_F32_F32",
                                       jax.lax.DotAlgorithmPreset.BF16_BF16_F32_X6, None])
@pytest.mark.parametrize("form", ["list", "stacked"])
def test_kernel_precision_follows_jnp_dot_algorithm_presets(precision, form, monkeypatch):
    """A float32-accurate dot algorithm (as precision= or jax.default_matmul_precision) must give the kernel's
    float32 FMA path (tf32 = 0), as Precision.HIGHEST does, not TF32; the default stays TF32 (tf32 = 1)."""
    import re

    import jaxfox._ffi

    monkeypatch.setattr(jaxfox._ffi, "kernels_available", lambda: True)
    monkeypatch.setenv("JAXFOX_OPT_IN_KERNELS", "grouped_matmul")
    x, w = jnp.ones((4, 3), jnp.float32), jnp.ones((2, 3, 5), jnp.float32)

    def tf32_attr(prec, default=None):
        def f(x, w):
            if form == "list":
                return jaxfox.grouped_matmul([x, x], [w[0], w[1]], precision=prec)
            return jaxfox.grouped_matmul_stacked(x, w, precision=prec)
        with jax.default_matmul_precision(default):
            text = jax.jit(f).trace(x, w).lower(lowering_platforms=("cuda",)).as_text()
        return set(re.findall(r"tf32 = (\d)", text))

    assert tf32_attr(jax.lax.Precision.HIGHEST) == {"0"} and tf32_attr(jax.lax.Precision.DEFAULT) == {"1"}
    if precision is None:    # the same presets through jax.default_matmul_precision
        assert tf32_attr(None, "F32_F32_F32") == {"0"}
        assert tf32_attr(None, "tensorfloat32") == {"1"}
    else:
        assert tf32_attr(precision) == tf32_attr(jax.lax.Precision.HIGHEST)


@pytest.mark.parametrize("form", ["list", "stacked", "stacked_shared"])
def test_kernel_path_with_rows_split_over_explicit_axes(form, monkeypatch):
    """With the rows split over an Explicit mesh axis (jax.make_mesh's default, no shard_map of one's own), the
    opt-in kernel path used to fail to trace ("switch branches must have equal output types": the FFI call's
    result typed unsharded, the reference's split). Now each device runs its own rows: it lowers for CUDA with
    the kernels and no all-gather, and (the reference running per shard on this CPU) gives the float64 NumPy
    values and gradients; weights split too are gathered whole onto each device."""
    import jaxfox._ffi
    from jax.sharding import NamedSharding, PartitionSpec as P

    monkeypatch.setattr(jaxfox._ffi, "kernels_available", lambda: True)
    monkeypatch.setenv("JAXFOX_OPT_IN_KERNELS", "grouped_matmul")
    mesh = jax.make_mesh((4,), ("batch",), devices=jax.devices()[:4])
    rng = np.random.default_rng(11)
    G, M, K, N = 2, 16, 8, 3
    x_np = rng.standard_normal((M, K) if form != "stacked" else (G, M, K)).astype(np.float32)
    w_np = rng.standard_normal((G, K, N)).astype(np.float32)
    b_np = rng.standard_normal((G, N)).astype(np.float32)
    c_np = rng.standard_normal((G, M, N))
    x = jax.device_put(x_np, NamedSharding(mesh, P("batch") if x_np.ndim == 2 else P(None, "batch")))
    w = jax.device_put(w_np, NamedSharding(mesh, P()))
    b = jax.device_put(b_np, NamedSharding(mesh, P()))
    c = jnp.asarray(c_np, jnp.float32)

    def loss(w, b, x):
        if form == "list":
            ys = jnp.stack(jaxfox.grouped_matmul([x, x], [w[0], w[1]], [b[0], b[1]]))
        else:
            ys = jaxfox.grouped_matmul_stacked(x, w, b)
        return jnp.sum(ys * c)

    vg = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2)))
    with jax.set_mesh(mesh), jax.default_matmul_precision("highest"):
        text = vg.trace(w, b, x).lower(lowering_platforms=("cuda",)).as_text()
        val, (dw, db, dx) = vg(w, b, x)
    assert "custom_call @jaxfox_grouped_gemm" in text and "custom_call @jaxfox_grouped_wgrad" in text
    assert "all_gather" not in text
    x64 = np.broadcast_to(np.asarray(x_np, np.float64), (G, M, K))
    w64, b64 = np.asarray(w_np, np.float64), np.asarray(b_np, np.float64)
    y64 = np.einsum("gmk,gkn->gmn", x64, w64) + b64[:, None, :]
    _close(np.asarray(val), np.sum(y64 * c_np), 1e-5)
    _close(dw, np.einsum("gmk,gmn->gkn", x64, c_np), 1e-5)
    _close(db, c_np.sum(axis=1), 1e-5)
    dx64 = np.einsum("gmn,gkn->gmk", c_np, w64)
    _close(dx, dx64 if form == "stacked" else dx64.sum(0), 1e-5)
    # Weights split over the axis as well: gathered whole onto each device, the same values.
    w_k = jax.device_put(w_np, NamedSharding(mesh, P(None, "batch")))
    with jax.set_mesh(mesh), jax.default_matmul_precision("highest"):
        jax.jit(loss).trace(w_k, b, x).lower(lowering_platforms=("cuda",))
        _close(np.asarray(jax.jit(loss)(w_k, b, x)), np.sum(y64 * c_np), 1e-5)
