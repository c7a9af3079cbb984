"""CPU tests of jaxfox.grn (grn_init, grn).

Oracle: ``np_grn`` below, float64 NumPy written from OPS.md "GRN, GLU, VSN" (TFT eqs. 2-5: ELU,
bias-free context weight, GLU, Dense skip when widths differ, LayerNorm with the textbook mean and
biased variance); it shares no code with the library. Gradients are checked against float64
central differences of it.
"""

from __future__ import annotations

import functools
import importlib
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.test_util import check_grads

import jaxfox
from conftest import assert_raises_naming as _bad, central_diff_grad, cuda_custom_calls, rel_err
from jaxfox import grn, grn_init

grn_mod = importlib.import_module("jaxfox.grn")  # the module (jaxfox.grn is the function)


# ----------------------------------------------------------------------------------------------
# Float64 oracle.
def np_elu(x):
    return np.where(x > 0, x, np.expm1(np.minimum(x, 0.0)))


def np_sigmoid(x):
    return 0.5 * (1.0 + np.tanh(0.5 * x))  # 1 / (1 + exp(-x)) without overflow


def np_layer_norm(x, gamma, beta, eps):
    mu = x.mean(axis=-1, keepdims=True)
    var = ((x - mu) ** 2).mean(axis=-1, keepdims=True)
    return (x - mu) / np.sqrt(var + eps) * gamma + beta


def f64(p):
    return {k: np.asarray(v, np.float64) for k, v in p.items()}


def np_grn(p, a, c=None, eps=1e-5):
    """GRN(a, c) in float64; p: grn_init-style dict (any array type); a [..., I], c [..., C]."""
    p = f64(p)
    a = np.asarray(a, np.float64)
    h = a @ p["w2"] + p["b2"]
    if c is not None:
        h = h + np.asarray(c, np.float64) @ p["w3"]
    eta1 = np_elu(h) @ p["w1"] + p["b1"]
    glu = (eta1 @ p["w4"] + p["b4"]) * np_sigmoid(eta1 @ p["w5"] + p["b5"])
    skip = a @ p["skip_w"] + p["skip_b"] if "skip_w" in p else a
    return np_layer_norm(skip + glu, p["gamma"], p["beta"], eps)


def random_grn_params(I, H, O, C=None, seed=0, scale=0.3):
    """grn_init plus a perturbation of every leaf (nonzero biases, gamma != 1, beta != 0)."""
    p = grn_init(jax.random.key(seed), I, H, O, context_size=C)
    rng = np.random.default_rng(seed + 1000)
    return {k: v + jnp.asarray(scale * rng.standard_normal(v.shape), jnp.float32) for k, v in p.items()}


def fd_grads(f, tree, eps=1e-6):
    """Float64 central differences of scalar f(tree) w.r.t. every leaf of a dict/tuple of arrays."""
    leaves, treedef = jax.tree.flatten(tree)
    leaves = [np.asarray(x, np.float64) for x in leaves]
    sizes = [x.size for x in leaves]
    x0 = np.concatenate([x.ravel() for x in leaves])

    def unflat(x):
        out, o = [], 0
        for leaf, s in zip(leaves, sizes):
            out.append(x[o:o + s].reshape(leaf.shape))
            o += s
        return jax.tree.unflatten(treedef, out)

    g = central_diff_grad(lambda x: f(unflat(x)), x0, eps)
    return unflat(g)


def assert_f32_close(got, want, tol=1e-5):
    got = np.asarray(got)
    assert got.dtype == np.float32, got.dtype
    assert got.shape == np.shape(want), (got.shape, np.shape(want))
    assert np.isfinite(got).all()
    err = rel_err(got, want)
    assert err <= tol, err


def assert_tree_close(got, want, tol):
    assert set(got) == set(want), (set(got), set(want))
    for k in want:
        err = rel_err(got[k], want[k])
        assert err <= tol, (k, err)


CONFIGS = [  # (I, H, O, C, lead)
    (5, 7, 3, None, (4,)),        # dense skip, no context
    (6, 8, 6, 4, (2, 3)),         # identity skip, context
    (4, 3, 9, 2, (3,)),           # O > I, context
    (1, 1, 1, None, (5,)),        # all widths 1 (identity skip, LayerNorm over one value)
    (3, 5, 2, None, ()),          # no leading dims
]


def _inputs(I, C, lead, seed=0):
    rng = np.random.default_rng(seed + 2000)
    a = rng.standard_normal(lead + (I,)).astype(np.float32)
    c = None if C is None else rng.standard_normal(lead + (C,)).astype(np.float32)
    return a, c


def _call(p, a, c, eps=1e-5):
    return grn(p, jnp.asarray(a), None if c is None else jnp.asarray(c), eps=eps)


# ----------------------------------------------------------------------------------------------
# Values and gradients.
@pytest.mark.parametrize("I,H,O,C,lead", CONFIGS)
def test_matches_float64_oracle(I, H, O, C, lead):
    p = random_grn_params(I, H, O, C, seed=I + H)
    a, c = _inputs(I, C, lead, seed=O)
    y = _call(p, a, c)
    assert y.shape == lead + (O,)
    assert_f32_close(y, np_grn(p, a, c))
    y = jax.jit(functools.partial(grn, eps=1e-3))(p, jnp.asarray(a), None if c is None else jnp.asarray(c))
    assert_f32_close(y, np_grn(p, a, c, eps=1e-3))


@pytest.mark.parametrize("I,H,O,C,lead", CONFIGS[:4])
def test_grads_match_oracle_finite_differences(I, H, O, C, lead):
    p = random_grn_params(I, H, O, C, seed=3 * I + H)
    a, c = _inputs(I, C, lead, seed=5 + O)
    r = np.random.default_rng(7).standard_normal(lead + (O,))

    def loss(p, a, c):
        return jnp.sum(grn(p, a, c) * jnp.asarray(r, jnp.float32))

    args = (p, jnp.asarray(a)) + (() if c is None else (jnp.asarray(c),))
    g = jax.grad(lambda *xs: loss(*xs, *((None,) if c is None else ())), argnums=tuple(range(len(args))))(*args)
    want = fd_grads(lambda t: float(np.sum(np_grn(t[0], t[1], t[2] if c is not None else None) * r)),
                    (p, a) + (() if c is None else (c,)))
    assert_tree_close(g[0], want[0], 1e-4)
    assert_f32_close(g[1], want[1], 1e-4)
    if c is not None:
        assert_f32_close(g[2], want[2], 1e-4)


def test_check_grads():
    p = random_grn_params(4, 5, 3, 2, seed=11)
    a, c = _inputs(4, 2, (3,), seed=12)
    check_grads(lambda p, a, c: grn(p, a, c), (p, jnp.asarray(a), jnp.asarray(c)), order=1, modes=("rev",),
                atol=2e-2, rtol=2e-2, eps=1e-2)


def test_context_broadcasts_over_leading_dims():
    p = random_grn_params(5, 6, 4, 3, seed=21)
    rng = np.random.default_rng(22)
    a = rng.standard_normal((2, 7, 5)).astype(np.float32)
    c = rng.standard_normal((2, 1, 3)).astype(np.float32)      # static context, one per sample
    want = np_grn(p, a, np.broadcast_to(c, (2, 7, 3)))
    assert_f32_close(grn(p, jnp.asarray(a), jnp.asarray(c)), want)
    # gradient w.r.t. the broadcast context sums over time
    r = rng.standard_normal((2, 7, 4))
    g = jax.grad(lambda c: jnp.sum(grn(p, jnp.asarray(a), c) * r))(jnp.asarray(c))
    want_g = fd_grads(lambda t: float(np.sum(np_grn(p, a, np.broadcast_to(t[0], (2, 7, 3))) * r)), (c,))[0]
    assert_f32_close(g, want_g, 1e-4)


# ----------------------------------------------------------------------------------------------
# LayerNorm edge cases (through the public op: identity skip and a zeroed GLU make x = a).
def _passthrough_params(width, seed=0, gamma=None, beta=None):
    p = grn_init(jax.random.key(seed), width, 2, width)
    p = {**p, "w4": jnp.zeros_like(p["w4"]), "b4": jnp.zeros_like(p["b4"])}  # GLU output 0
    rng = np.random.default_rng(seed)
    if gamma is None:
        gamma = 1.0 + 0.5 * rng.standard_normal(width)
    if beta is None:
        beta = rng.standard_normal(width)
    return {**p, "gamma": jnp.asarray(gamma, jnp.float32), "beta": jnp.asarray(beta, jnp.float32)}


def test_layer_norm_constant_row():
    p = _passthrough_params(6, seed=1)
    a = np.full((3, 6), 3.25, np.float32)
    a[1] = -1e4
    a[2] = 0.0
    y = np.asarray(grn(p, jnp.asarray(a)))
    np.testing.assert_array_equal(y, np.broadcast_to(np.asarray(p["beta"]), (3, 6)))  # output = beta exactly
    r = np.random.default_rng(2).standard_normal((3, 6)).astype(np.float32)
    gp, ga = jax.grad(lambda p, a: jnp.sum(grn(p, a) * r), argnums=(0, 1))(p, jnp.asarray(a))
    for leaf in jax.tree.leaves((gp, ga)):
        assert np.isfinite(np.asarray(leaf)).all()
    # d out / d beta = r exactly; d out / d gamma = r * xhat = 0
    np.testing.assert_array_equal(np.asarray(gp["beta"]), r.sum(0))
    np.testing.assert_array_equal(np.asarray(gp["gamma"]), np.zeros(6, np.float32))


def test_layer_norm_large_common_offset():
    rng = np.random.default_rng(3)
    O = 64
    a = (1449.0 + rng.integers(-1, 2, size=(5, O))).astype(np.float32)   # 1449 +- 1
    a[:, 0] = 1449.0 + np.array([-1, 0, 1, 1, -1])                         # shift pivot varies
    p = _passthrough_params(O, seed=4)
    y = grn(p, jnp.asarray(a))
    assert np.isfinite(np.asarray(y)).all()
    assert_f32_close(y, np_grn(p, a), tol=1e-5)
    # the test can fail: E[x^2] - E[x]^2 in float32 is far off for these rows
    x = a.astype(np.float32)
    naive = np.mean(x * x, axis=-1) - np.mean(x, axis=-1) ** 2
    exact = np.var(a.astype(np.float64), axis=-1)
    assert np.max(np.abs(naive - exact) / exact) > 0.05


@pytest.mark.parametrize("pos", [0, 5000, 10240])
def test_layer_norm_one_outlier_among_10240(pos):
    O = 10241
    a = np.full((1, O), 256.0, np.float32)
    a[0, pos] = 255.0
    p = _passthrough_params(O, seed=5, gamma=np.ones(O), beta=np.zeros(O))
    for eps in (1e-5, 1e-12):
        y = np.asarray(grn(p, jnp.asarray(a), eps=eps), np.float64)
        assert np.isfinite(y).all()
        want = np_grn(p, a, eps=eps)
        np.testing.assert_allclose(y, want, rtol=1e-5, atol=0)
        # implied variance: mean(y^2) = var / (var + eps) with gamma = 1, beta = 0
        s = np.mean(y * y)
        var = eps * s / (1.0 - s) if eps > 1e-9 else None
        pvar = (1.0 / O) * (1.0 - 1.0 / O)
        if var is not None:
            np.testing.assert_allclose(var, pvar, rtol=1e-4)
        np.testing.assert_allclose(y[0, pos], -(1 - 1 / O) / math.sqrt(pvar + eps), rtol=1e-5)
    g = jax.grad(lambda a: grn(p, a)[0, pos])(jnp.asarray(a))
    assert np.isfinite(np.asarray(g)).all()


def test_layer_norm_helper():
    rng = np.random.default_rng(6)
    x = (1e3 + rng.standard_normal((4, 33))).astype(np.float32)
    g, b = rng.standard_normal(33), rng.standard_normal(33)
    y = grn_mod.layer_norm(jnp.asarray(x), jnp.asarray(g, jnp.float32), jnp.asarray(b, jnp.float32), 1e-5)
    assert_f32_close(y, np_layer_norm(x.astype(np.float64), g, b, 1e-5), tol=2e-6)


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
def test_layer_norm_narrow_inputs_use_float32_statistics(dtype):
    """layer_norm's statistics are float32 (its docstring) for bfloat16/float16 x too: bfloat16 means and variances
    were 1e-2 off, and a float16 row spread over 600 squared to inf (every output became beta)."""
    rng = np.random.default_rng(7)
    x = jnp.asarray(rng.standard_normal((4, 64)) * 3.0 + 1.0, dtype)
    x = x.at[0, :4].set(jnp.asarray([0.0, 600.0, 100.0, 300.0], dtype))
    g, b = rng.standard_normal(64), rng.standard_normal(64)
    y = grn_mod.layer_norm(x, jnp.asarray(g, jnp.float32), jnp.asarray(b, jnp.float32), 1e-5)
    assert y.dtype == jnp.float32
    assert_f32_close(y, np_layer_norm(np.asarray(x.astype(jnp.float32), np.float64), g, b, 1e-5), tol=2e-6)


@pytest.mark.parametrize("eps", [1e-30, 1.2e-38])
def test_tiny_eps_constant_rows_have_finite_exact_gradients(eps):
    """A constant LayerNorm row (a zero padding row of a freshly initialised GRN is one) with a small but valid eps
    (a normal float32 below ~2e-26): autodiff of rsqrt(var + eps) multiplied the zero cotangent of var by
    -0.5 (var + eps)^-1.5 = inf, giving NaN in that row's input gradient and in every weight's gradient. The
    gradients are finite and equal the textbook LayerNorm backward (float64, written from the equations)."""
    O = 6
    p = _passthrough_params(O, seed=12)            # w4 = b4 = 0 and identity skip: the LayerNorm input is a
    rng = np.random.default_rng(13)
    a = np.stack([np.zeros(O), np.full(O, 3.25), rng.standard_normal(O)]).astype(np.float32)
    r = rng.standard_normal((3, O))
    y = grn(p, jnp.asarray(a), eps=eps)
    np.testing.assert_allclose(np.asarray(y), np_grn(p, a, eps=eps), rtol=1e-5, atol=1e-6)
    gp, ga = jax.grad(lambda q, x: jnp.sum(grn(q, x, eps=eps) * jnp.asarray(r, jnp.float32)), argnums=(0, 1))(
        p, jnp.asarray(a))
    for k, leaf in {**gp, "a": ga}.items():
        assert np.isfinite(np.asarray(leaf)).all(), k
    # float64 oracle: x = a, xhat = (x - mu) rstd, dx = rstd (gy - mean(gy) - xhat mean(gy xhat)), gy = r gamma
    q = f64(p)
    x = a.astype(np.float64)
    gy = r * q["gamma"]

    def np_ln_backward(x):
        mu = x.mean(-1, keepdims=True)
        rstd = 1.0 / np.sqrt(((x - mu) ** 2).mean(-1, keepdims=True) + eps)
        xhat = (x - mu) * rstd
        return rstd * (gy - gy.mean(-1, keepdims=True) - xhat * (gy * xhat).mean(-1, keepdims=True)), xhat

    dx, xhat = np_ln_backward(x)
    eta1 = np_elu(x @ q["w2"] + q["b2"]) @ q["w1"] + q["b1"]
    dglu_value = dx * np_sigmoid(eta1 @ q["w5"] + q["b5"])     # d out / d (eta1 w4 + b4)
    for row in range(3):
        np.testing.assert_allclose(np.asarray(ga)[row], dx[row], rtol=1e-5, atol=1e-6 * np.abs(dx[row]).max())
    assert rel_err(gp["w4"], eta1.T @ dglu_value) <= 1e-5
    assert rel_err(gp["b4"], dglu_value.sum(0)) <= 1e-5
    assert rel_err(gp["gamma"], (r * xhat).sum(0)) <= 1e-5
    assert rel_err(gp["beta"], r.sum(0)) <= 1e-6
    # second order: Hessian-vector products (0 on a constant row, where xhat = 0 and mean(xhat t) = 0; float64
    # central differences of the backward above on the other row)
    v = rng.standard_normal((3, O)).astype(np.float32)
    hv = jax.jvp(jax.grad(lambda x: jnp.sum(grn(p, x, eps=eps) * jnp.asarray(r, jnp.float32))), (jnp.asarray(a),),
                 (jnp.asarray(v),))[1]
    np.testing.assert_array_equal(np.asarray(hv)[:2], np.zeros((2, O), np.float32))
    h = 1e-6
    want = (np_ln_backward(x + h * v)[0] - np_ln_backward(x - h * v)[0]) / (2 * h)
    assert rel_err(np.asarray(hv)[2], want[2]) <= 1e-4


# ----------------------------------------------------------------------------------------------
# bfloat16 inputs.
def test_bfloat16_inputs_keep_float32_statistics():
    I = O = 16
    p = _passthrough_params(I, seed=7)
    rng = np.random.default_rng(8)
    # values exactly representable in bfloat16, large common offset: bfloat16 statistics would
    # lose the deviations entirely (spacing 1 at 128..256)
    a16 = jnp.asarray((200.0 + rng.integers(-3, 4, size=(4, I))).astype(np.float32), jnp.bfloat16)
    a = np.asarray(a16.astype(jnp.float32))
    y = grn(p, a16)
    assert y.dtype == jnp.float32
    assert_f32_close(y, np_grn(p, a), tol=1e-5)
    # dense skip + context, bf16 both: same as the float32 op on the same values
    q = random_grn_params(6, 5, 4, 3, seed=9)
    x16 = jnp.asarray(rng.standard_normal((3, 6)), jnp.bfloat16)
    c16 = jnp.asarray(rng.standard_normal((3, 3)), jnp.bfloat16)
    x32, c32 = np.asarray(x16.astype(jnp.float32)), np.asarray(c16.astype(jnp.float32))
    assert_f32_close(grn(q, x16, c16), np_grn(q, x32, c32))
    # gradient w.r.t. bf16 inputs: bf16, the float32 gradient rounded once
    r = rng.standard_normal((3, 4)).astype(np.float32)
    ga, gc = jax.grad(lambda x, c: jnp.sum(grn(q, x, c) * r), argnums=(0, 1))(x16, c16)
    assert ga.dtype == jnp.bfloat16 and gc.dtype == jnp.bfloat16
    fa, fc = jax.grad(lambda x, c: jnp.sum(grn(q, x, c) * r), argnums=(0, 1))(
        x16.astype(jnp.float32), c16.astype(jnp.float32))
    np.testing.assert_array_equal(np.asarray(ga), np.asarray(fa.astype(jnp.bfloat16)))
    np.testing.assert_array_equal(np.asarray(gc), np.asarray(fc.astype(jnp.bfloat16)))
    # mixed: bf16 a with float32 context is computed from float32 copies
    y = grn(q, x16, c16.astype(jnp.float32))
    assert y.dtype == jnp.float32
    assert_f32_close(y, np_grn(q, np.asarray(x16.astype(jnp.float32)), np.asarray(c16.astype(jnp.float32))))


def test_bfloat16_broadcast_context_gradient_rounded_once():
    """A bfloat16 context broadcast over the input's leading dims ([B, 1, C] for [B, T, I]): its gradient is the
    float32 gradient (summed over T in float32) rounded once, as the docstring says, not a bfloat16 sum over T."""
    q = random_grn_params(3, 4, 5, 2, seed=10)
    rng = np.random.default_rng(11)
    B, T = 8, 4096
    x16 = jnp.asarray(rng.standard_normal((B, T, 3)), jnp.bfloat16)
    c16 = jnp.asarray(rng.standard_normal((B, 1, 2)), jnp.bfloat16)
    r = jnp.asarray(rng.standard_normal((B, T, 5)), jnp.float32)
    gc = jax.grad(lambda c: jnp.sum(grn(q, x16, c) * r))(c16)
    fc = jax.grad(lambda c: jnp.sum(grn(q, x16.astype(jnp.float32), c) * r))(c16.astype(jnp.float32))
    assert gc.dtype == jnp.bfloat16
    np.testing.assert_array_equal(np.asarray(gc), np.asarray(fc.astype(jnp.bfloat16)))


# ----------------------------------------------------------------------------------------------
# Errors.
def test_errors():
    p = random_grn_params(5, 6, 3, 2)
    a = jnp.ones((4, 5))
    c = jnp.ones((4, 2))
    _bad(lambda: grn(p, a.astype(jnp.int32), c), TypeError, "a", "int32")
    _bad(lambda: grn(p, a.astype(jnp.float16), c), TypeError, "a", "float16")
    _bad(lambda: grn(p, np.ones((4, 5), np.float64), c), TypeError, "a", "float64")
    _bad(lambda: grn(p, [[1.0] * 5], c), TypeError, "a")
    _bad(lambda: grn(p, a[:, :4], c), ValueError, "a", "[..., 5]", "(4, 4)")
    _bad(lambda: grn(p, a), ValueError, "context", "required")
    _bad(lambda: grn(p, a, c[:, :1]), ValueError, "context", "[..., 2]", "(4, 1)")
    _bad(lambda: grn(p, a, jnp.ones((3, 2))), ValueError, "context", "(3,)", "(4,)")
    # rank promotion: a [B, C] context of a [B, T, I] input was aligned with T and accepted whenever B == T
    a3 = jnp.ones((4, 4, 5))
    _bad(lambda: grn(p, a3, c), ValueError, "context", "rank 3", "(4, 2)", "context[:, None]")
    _bad(lambda: grn(p, a, jnp.ones((2,))), ValueError, "context", "rank 2")
    np.testing.assert_allclose(np.asarray(grn(p, a3, c[:, None])), np.asarray(grn(p, a3, jnp.ones((4, 4, 2)))),
                               rtol=1e-6)
    _bad(lambda: grn(p, a, c.astype(jnp.int32)), TypeError, "context", "int32")
    q = random_grn_params(5, 6, 3)
    _bad(lambda: grn(q, a, c), ValueError, "context", "w3")
    _bad(lambda: grn({**q, "w1": jnp.ones((6, 5))}, a), ValueError, "params['w1']", "[6, 6]", "(6, 5)")
    _bad(lambda: grn({**q, "b5": jnp.ones((4,))}, a), ValueError, "params['b5']", "[3]")
    _bad(lambda: grn({**q, "w2": jnp.ones((5, 7))}, a), ValueError, "params['w2']", "[5, 6]", "(5, 7)")
    _bad(lambda: grn({**q, "w5": jnp.ones((6, 4))}, a), ValueError, "params['w5']", "[6, 3]", "(6, 4)")
    _bad(lambda: grn({**q, "w4": q["w4"].astype(jnp.bfloat16)}, a), TypeError, "params['w4']", "float32")
    _bad(lambda: grn({k: v for k, v in q.items() if k != "gamma"}, a), ValueError, "params", "gamma")
    _bad(lambda: grn({k: v for k, v in q.items() if k != "skip_w"}, a), ValueError, "params", "skip_w")
    _bad(lambda: grn([q], a), TypeError, "params")
    s = random_grn_params(5, 6, 5)
    _bad(lambda: grn({**s, "skip_w": jnp.ones((5, 5)), "skip_b": jnp.ones(5)}, a), ValueError, "identity")
    _bad(lambda: grn(q, a, eps=0.0), ValueError, "eps")
    _bad(lambda: grn(q, a, eps=-1e-5), ValueError, "eps")
    _bad(lambda: grn(q, a, eps=float("nan")), ValueError, "eps")
    _bad(lambda: grn(q, a, eps=1e-46), ValueError, "eps", "float32")  # float32(eps) == 0
    _bad(lambda: grn(q, a, eps=1e39), ValueError, "eps", "float32")   # float32(eps) == inf
    _bad(lambda: grn(q, a, eps="1e-5"), TypeError, "eps")
    _bad(lambda: grn_init(jax.random.key(0), 5, 0, 3), ValueError, "hidden_size")
    _bad(lambda: grn_init(jax.random.key(0), 5, 4, 3.0), ValueError, "output_size")
    _bad(lambda: grn_init(jax.random.key(0), 5, 4, 3, context_size=0), ValueError, "context_size")


# ----------------------------------------------------------------------------------------------
# Init.
def test_init():
    p = grn_init(jax.random.key(3), 12, 20, 7, context_size=5)
    shapes = {"w2": (12, 20), "b2": (20,), "w3": (5, 20), "w1": (20, 20), "b1": (20,), "w4": (20, 7), "b4": (7,),
              "w5": (20, 7), "b5": (7,), "skip_w": (12, 7), "skip_b": (7,), "gamma": (7,), "beta": (7,)}
    assert {k: tuple(v.shape) for k, v in p.items()} == shapes
    for k in ("w2", "w3", "w1", "w4", "w5", "skip_w"):
        w = np.asarray(p[k])
        assert w.dtype == np.float32
        bound = math.sqrt(6.0 / sum(w.shape))
        assert np.abs(w).max() <= bound and np.abs(w).max() > 0.7 * bound and abs(w.mean()) < 0.2 * bound
    for k in ("b2", "b1", "b4", "b5", "skip_b", "beta"):
        assert np.all(np.asarray(p[k]) == 0.0)
    assert np.all(np.asarray(p["gamma"]) == 1.0)
    assert not np.array_equal(np.asarray(p["w4"]), np.asarray(p["w5"]))
    q = grn_init(jax.random.key(3), 12, 20, 7, context_size=5)
    assert all(np.array_equal(np.asarray(p[k]), np.asarray(q[k])) for k in p)
    p = grn_init(jax.random.key(4), 8, 4, 8)
    assert "w3" not in p and "skip_w" not in p and "skip_b" not in p


# ----------------------------------------------------------------------------------------------
# Composition.
def test_jit_vmap_scan_grad():
    I, H, O, C = 5, 6, 4, 3
    p = random_grn_params(I, H, O, C, seed=31)
    a, c = _inputs(I, C, (3, 4), seed=32)
    eager = grn(p, jnp.asarray(a), jnp.asarray(c))
    jitted = jax.jit(grn)(p, jnp.asarray(a), jnp.asarray(c))
    np.testing.assert_allclose(np.asarray(eager), np.asarray(jitted), rtol=1e-6, atol=1e-6)
    # vmap over a batch axis of the data
    v = jax.vmap(lambda a, c: grn(p, a, c))(jnp.asarray(a), jnp.asarray(c))
    assert_f32_close(v, np_grn(p, a, c))
    # vmap over an ensemble of parameters (stacked), shared data
    ps = [random_grn_params(I, H, O, C, seed=40 + s) for s in range(3)]
    stacked = jax.tree.map(lambda *xs: jnp.stack(xs), *ps)
    ys = jax.vmap(lambda q: grn(q, jnp.asarray(a), jnp.asarray(c)))(stacked)
    for s in range(3):
        assert_f32_close(ys[s], np_grn(ps[s], a, c))
    # grad under jit and vmap of grad
    r = np.random.default_rng(33).standard_normal((3, 4, O)).astype(np.float32)
    g = jax.jit(jax.grad(lambda q, a, c: jnp.sum(grn(q, a, c) * r), argnums=(0, 1)))(p, jnp.asarray(a), jnp.asarray(c))
    want = fd_grads(lambda t: float(np.sum(np_grn(t[0], t[1], c) * r)), (p, a))
    assert_tree_close(g[0], want[0], 1e-4)
    assert_f32_close(g[1], want[1], 1e-4)
    gv = jax.vmap(jax.grad(lambda q: jnp.sum(grn(q, jnp.asarray(a), jnp.asarray(c)) * r)))(stacked)
    for s in range(3):
        g1 = jax.grad(lambda q: jnp.sum(grn(q, jnp.asarray(a), jnp.asarray(c)) * r))(ps[s])
        assert_tree_close({k: v[s] for k, v in gv.items()}, g1, 1e-5)

    # inside lax.scan (GRN applied to a carried state)
    def body(h, x):
        y = grn(random_grn_params(O, H, O, seed=50), h + x)
        return y, y

    xs = np.random.default_rng(34).standard_normal((3, 2, O)).astype(np.float32)
    _, out = jax.lax.scan(body, jnp.zeros((2, O)), jnp.asarray(xs))
    q = random_grn_params(O, H, O, seed=50)
    h = np.zeros((2, O))
    for t in range(3):
        h = np_grn(q, h.astype(np.float32) + xs[t])
        assert_f32_close(out[t], h)


def test_symbolic_leading_dims_export():
    """``a`` [..., I] with symbolic leading dims (``jax.export`` shape polymorphism, e.g. a serving batch b and
    length t): grn counted the rows with int(np.prod(lead)), which raised InconclusiveDimensionOperation."""
    from jax import export

    I, H, O, C = 5, 6, 3, 2
    p = random_grn_params(I, H, O, C, seed=60)
    q = random_grn_params(I, H, I, seed=61)
    b, t = export.symbolic_shape("b, t")
    f32 = jnp.float32
    ctx = export.export(jax.jit(lambda a, c: grn(p, a, c)))(
        jax.ShapeDtypeStruct((b, t, I), f32), jax.ShapeDtypeStruct((b, 1, C), f32))
    plain = export.export(jax.jit(lambda a: grn(q, a)))(jax.ShapeDtypeStruct((b, I), f32))
    assert ctx.out_avals[0].shape == (b, t, O) and plain.out_avals[0].shape == (b, I)
    for B, T in ((2, 3), (1, 7)):
        rng = np.random.default_rng(B + T)
        a = rng.standard_normal((B, T, I)).astype(np.float32)
        c = rng.standard_normal((B, 1, C)).astype(np.float32)
        assert_f32_close(ctx.call(jnp.asarray(a), jnp.asarray(c)), np_grn(p, a, np.broadcast_to(c, (B, T, C))))
        assert_f32_close(plain.call(jnp.asarray(a[:, 0])), np_grn(q, a[:, 0]))


def test_zero_rows():
    p = random_grn_params(5, 6, 3, 2)
    y = grn(p, jnp.zeros((0, 4, 5)), jnp.zeros((0, 4, 2)))
    assert y.shape == (0, 4, 3)
    g = jax.grad(lambda p: jnp.sum(grn(p, jnp.zeros((0, 5)), jnp.zeros((0, 2)))))(p)
    assert all(np.all(np.asarray(x) == 0) for x in jax.tree.leaves(g))


# ----------------------------------------------------------------------------------------------
# The CUDA kernel path (ffi/grn.cu), traced and lowered for CUDA on this CPU machine with the kernels forced
# on: which FFI calls the program makes, with which operand shapes and attributes.
GRN_FWD, GRN_BWD = "jaxfox_grn_fwd", "jaxfox_grn_bwd"
VSN_FWD, VSN_BWD = "jaxfox_vsn_grn_fwd", "jaxfox_vsn_grn_bwd"


@pytest.fixture
def kernels_on(kernels_on, monkeypatch):
    # conftest's kernels_on, and the GRN kernels opted in (they are opt-in: slower than XLA so far,
    # jaxfox._ffi.OPT_IN)
    monkeypatch.setenv("JAXFOX_OPT_IN_KERNELS", "grn")


def _value_and_grad(eps=1e-5):
    """(p, a, r) -> (grn(p, a), grads of sum(grn(p, a) * r) w.r.t. (p, a))."""
    def loss(p, a, r):
        return jnp.sum(grn(p, a, eps=eps) * r)

    return lambda p, a, r: (grn(p, a, eps=eps), jax.grad(loss, argnums=(0, 1))(p, a, r))


def _flat_size(I, H, O):
    """P: floats of the flat parameter vector (every leaf of a context-free GRN once)."""
    return I * H + H + H * H + H + 2 * (H * O + O) + (I * O + O if I != O else 0) + 2 * O


def test_kernel_fits_truth_table():
    fits = grn_mod._kernel_fits
    assert (grn_mod.KERNEL_MAX_INPUT, grn_mod.KERNEL_MAX_HIDDEN, grn_mod.KERNEL_MAX_OUTPUT) == (256, 64, 64)
    for shape in [(192, 0, 32, 48), (64, 0, 32, 32), (32, 0, 17, 32), (5, 0, 3, 7), (1, 0, 1, 1)]:
        got = fits(*shape)
        assert isinstance(got, bool) and got, shape
    for shape in [(192, 5, 32, 48), (64, 1, 32, 32), (5, 3, 3, 7),         # a context
                  (64, 0, 65, 32), (32, 0, 65, 65), (64, 0, 32, 65),        # Hd or O > 64
                  (257, 0, 32, 32), (257, 0, 1, 1), (1000, 0, 32, 48)]:     # I > 256
        got = fits(*shape)
        assert isinstance(got, bool) and not got, shape
    # the limits are monotone: a shape that fits still fits with any width smaller
    for I, H, O in [(192, 32, 48), (64, 32, 32)]:
        for smaller in [(I - 1, H, O), (I, H - 1, O), (I, H, O - 1), (1, 1, 1)]:
            assert fits(smaller[0], 0, *smaller[1:]), smaller


def test_kernel_path_lowers_for_cuda(kernels_on):
    from jaxfox.reduce import reduce_chunks

    R, I, H, O = 64, 192, 32, 48
    p = random_grn_params(I, H, O, seed=1)
    P = _flat_size(I, H, O)
    a, r = jnp.zeros((R, I)), jnp.zeros((R, O))
    calls = cuda_custom_calls(_value_and_grad(), p, a, r)
    assert set(calls) == {GRN_FWD, GRN_BWD} and len(calls[GRN_FWD]) == 2 and len(calls[GRN_BWD]) == 1
    # the forward returns y and the residuals for the backward: [R, 2 H + 3 O + 1] (e2, e1, g4, g5, zhat, rstd)
    # inside jax.grad, [R, 0] for the primal call outside it
    W = 2 * H + 3 * O + 1
    fwd_out = f"(tensor<{P}xf32>, tensor<{R}x{I}xf32>) -> (tensor<{R}x{O}xf32>, tensor<{R}x{{}}xf32>)"
    assert sorted(w for c in calls[GRN_FWD] for w in (0, W) if fwd_out.format(w) in c) == [0, W]
    fwd, bwd = calls[GRN_FWD][0], calls[GRN_BWD][0]
    assert f"hidden_size = {H} : i64" in fwd and f"output_size = {O} : i64" in fwd and "eps = 9.99999974E-6" in fwd
    assert "softmax = 1 : i64" not in fwd and "softmax = 1 : i64" not in bwd   # a plain GRN: no softmax
    # the backward takes the parameters, a, d y and the residuals; returns dw [P] and d a [R, I] (plus workspaces)
    assert f"(tensor<{P}xf32>, tensor<{R}x{I}xf32>, tensor<{R}x{O}xf32>, tensor<{R}x{W}xf32>) -> " in bwd
    per, blocks = grn_mod._bwd_tiling(R)
    chunks = reduce_chunks(blocks, P)
    ws = f"tensor<{chunks * P}xf32>" if chunks > 1 else "tensor<0xf32>"
    assert f"-> (tensor<{P}xf32>, tensor<{R}x{I}xf32>, tensor<{blocks}x{P}xf32>, {ws})" in bwd
    assert f"tiles_per_block = {per} : i64" in bwd and f"chunks = {chunks} : i64" in bwd
    # eps reaches both kernels; bfloat16 a and leading dims [B, T, I] keep the kernel path, whose operands are
    # float32 [R, I]
    calls = cuda_custom_calls(_value_and_grad(eps=1e-3), p, jnp.zeros((4, 16, I), jnp.bfloat16), jnp.zeros((4, 16, O)))
    assert set(calls) == {GRN_FWD, GRN_BWD}
    assert all("eps = 1.000000e-03" in c for c in calls[GRN_FWD] + calls[GRN_BWD])
    assert f"tensor<{R}x{I}xf32>" in calls[GRN_FWD][0] and f"tensor<{R}x{I}xf32>" in calls[GRN_BWD][0]
    # the identity skip (I == O) drops skip_w / skip_b from the flat vector
    q = random_grn_params(32, 17, 32, seed=2)
    calls = cuda_custom_calls(_value_and_grad(), q, jnp.zeros((37, 32)), jnp.zeros((37, 32)))
    assert set(calls) == {GRN_FWD, GRN_BWD}
    assert any(f"(tensor<{_flat_size(32, 17, 32)}xf32>, tensor<37x32xf32>) -> (tensor<37x32xf32>, tensor<37x131xf32>)"
               in c for c in calls[GRN_FWD])
    with jaxfox.use_reference():
        assert cuda_custom_calls(_value_and_grad(), p, a, r) == {}


@pytest.mark.parametrize("opt_in", ["", "attention_pool", "grn,adamw", " grn ", "all"])
def test_kernels_are_opt_in(kernels_on, monkeypatch, opt_in):
    """Without ``grn`` (or ``all``) in JAXFOX_OPT_IN_KERNELS a GRN lowers to XLA code on CUDA too."""
    monkeypatch.setenv("JAXFOX_OPT_IN_KERNELS", opt_in)
    p = random_grn_params(64, 32, 32, seed=6)
    calls = cuda_custom_calls(_value_and_grad(), p, jnp.zeros((64, 64)), jnp.zeros((64, 32)))
    want = {GRN_FWD, GRN_BWD} if opt_in.strip() in ("grn,adamw", "grn", "all") else set()
    assert set(calls) == want


def test_kernel_path_lowers_for_cuda_under_vmap(kernels_on):
    V, R, I, H, O = 3, 37, 5, 3, 7
    ps = jax.vmap(lambda k: grn_init(k, I, H, O))(jax.random.split(jax.random.key(3), V))
    P = _flat_size(I, H, O)
    calls = cuda_custom_calls(jax.vmap(_value_and_grad()), ps, jnp.zeros((V, R, I)), jnp.zeros((V, R, O)))
    assert set(calls) == {GRN_FWD, GRN_BWD}
    for rest in calls[GRN_FWD] + calls[GRN_BWD]:   # broadcast_all: one call over the V instances
        assert f"tensor<{V}x{P}xf32>" in rest and f"tensor<{V}x{R}x{I}xf32>" in rest, rest[-300:]


@pytest.mark.parametrize("I,H,O,C", [(32, 32, 48, 5), (32, 65, 32, None), (32, 32, 65, None), (257, 32, 32, None)])
def test_routed_shapes_lower_without_the_kernels(kernels_on, I, H, O, C):
    """A context, Hd > 64, O > 64 or I > 256: the reference on CUDA too."""
    p = random_grn_params(I, H, O, C, seed=4)
    a, r = jnp.zeros((37, I)), jnp.zeros((37, O))
    if C is None:
        f, args = _value_and_grad(), (p, a, r)
    else:
        f = lambda p, a, c: jax.value_and_grad(lambda p: jnp.sum(grn(p, a, c)))(p)  # noqa: E731
        args = (p, a, jnp.zeros((37, C)))
    calls = cuda_custom_calls(f, *args)
    assert GRN_FWD not in calls and GRN_BWD not in calls, set(calls)


def test_symbolic_leading_dims_export_for_cuda_runs_the_reference(kernels_on):
    """With the kernels on (and grn opted in), symbolic leading dims route to the reference: the kernels need a
    concrete row count for their grids and workspaces. Exported for CUDA, no jaxfox FFI call is made, forward or
    backward, for grn and vsn (whose per-variable GRN kernels run by default)."""
    from jax import export

    b, t = export.symbolic_shape("b, t")
    f32 = jnp.float32
    p = random_grn_params(8, 16, 8, seed=62)
    pv = jaxfox.vsn_init(jax.random.key(63), 4, 2, 8, 8)
    fns = [(lambda p, a: jax.value_and_grad(lambda p: jnp.sum(grn(p, a)))(p), p, (b, t, 8)),
           (lambda p, x: jax.value_and_grad(lambda p: jnp.sum(jaxfox.vsn(p, x)[0]))(p), pv, (b, 4, 2))]
    for f, params, shape in fns:
        exp = export.export(jax.jit(f), platforms=("cuda",))(params, jax.ShapeDtypeStruct(shape, f32))
        assert "jaxfox_" not in exp.mlir_module()
        # the same function with concrete dims does take the kernels (so the assertion above can fail)
        assert cuda_custom_calls(f, params, jnp.zeros(tuple(s if isinstance(s, int) else 3 for s in shape), f32))


def test_vsn_selection_lowers_to_the_grn_kernels(kernels_on):
    """jaxfox.vsn at the main job's shape (m = 48, d = 4, Hd = O = 32; 2048 rows): the selection GRN (input
    m d = 192, output m = 48) runs the grn kernels with the softmax fused, the per-variable GRNs the vsn ones."""
    from jaxfox import vsn, vsn_init

    m, d, H, O, R = 48, 4, 32, 32, 2048
    p = vsn_init(jax.random.key(5), m, d, H, O)
    P = _flat_size(m * d, H, m)

    def step(p, xs):
        def loss(p, xs):
            out, w = vsn(p, xs)
            return jnp.sum(out * out) + jnp.sum(w * jnp.arange(m, dtype=jnp.float32))

        return vsn(p, xs), jax.grad(loss, argnums=(0, 1))(p, xs)

    calls = cuda_custom_calls(step, p, jnp.zeros((32, 64, m, d)))
    assert {GRN_FWD, GRN_BWD, VSN_FWD, VSN_BWD} <= set(calls), set(calls)
    assert len(calls[GRN_BWD]) == 1
    W = 2 * H + 3 * m + 1   # the selection GRN's residuals a row (inside jax.grad; 0 for the primal call)
    for rest in calls[GRN_FWD]:
        assert any(f"(tensor<{P}xf32>, tensor<{R}x{m * d}xf32>) -> (tensor<{R}x{m}xf32>, tensor<{R}x{w}xf32>)"
                   in rest for w in (0, W)), rest[-200:]
    for rest in calls[GRN_FWD] + calls[GRN_BWD]:
        assert "softmax = 1 : i64" in rest and f"output_size = {m} : i64" in rest
    # a selection context routes the selection GRN to the reference; the per-variable kernels stay
    pc = vsn_init(jax.random.key(5), m, d, H, O, context_size=5)
    calls = cuda_custom_calls(lambda p, x, c: jax.value_and_grad(lambda p: jnp.sum(vsn(p, x, c)[0]))(p), pc,
                              jnp.zeros((32, 64, m, d)), jnp.zeros((32, 64, 5)))
    assert GRN_FWD not in calls and GRN_BWD not in calls and VSN_BWD in calls, set(calls)
    with jaxfox.use_reference():
        assert cuda_custom_calls(step, p, jnp.zeros((32, 64, m, d))) == {}


def test_output_size_one_is_the_constant_beta():
    """O = 1: the final LayerNorm over one feature gives 0 before its affine part, so the output is beta for every
    input and the weights get no gradient (TFT's definition, documented in grn's Returns)."""
    p = jaxfox.grn_init(jax.random.key(0), 8, 16, 1)
    p["beta"] = jnp.asarray([0.75], jnp.float32)
    a = jnp.asarray(np.random.default_rng(0).standard_normal((5, 8)), jnp.float32)
    np.testing.assert_array_equal(np.asarray(jaxfox.grn(p, a)), np.full((5, 1), 0.75, np.float32))
    g = jax.grad(lambda p: jaxfox.grn(p, a).sum())(p)
    assert float(np.abs(np.asarray(g["w2"])).max()) == 0.0 and float(np.asarray(g["beta"])[0]) == 5.0


# ----------------------------------------------------------------------------------------------
# The TF32 tensor-core kernels (ffi/grn.cu namespace tc, jaxfox.grn._grn_tc): routing, their CUDA lowering, and the
# Python wiring (operands, XLA's weight gradients, reduce_axis0, the cotangent tree) run against a NumPy emulation
# of the FFI targets.
TC_FWD, TC_BWD = "jaxfox_grn_tc_fwd", "jaxfox_grn_tc_bwd"
REDUCE = "jaxfox_reduce_axis0"


def test_tc_fits_truth_table():
    fits, smem = grn_mod._tc_fits, grn_mod._tc_smem_bytes
    for I in (16, 32, 64, 128):
        for H in (32, 64, 128):
            for O in (32, 64, 128):
                assert fits(I, 0, H, O) is True and grn_mod._tc_smem_fits(I, H, O) is True
    for shape in [(48, 0, 128, 128), (8, 0, 128, 128), (256, 0, 128, 128), (128, 0, 16, 128), (128, 0, 128, 96),
                  (128, 0, 256, 128), (128, 5, 128, 128)]:
        assert fits(*shape) is False, shape
    # 32 rows x (row stride = width + 4 floats) per tile buffer: fwd [I | max(H, O) | 2 O], bwd [2 O | max(H, O) | O];
    # plus the two staged weight chunks of 16 rows of K: fwd 2 x 16 x (max(H, 2 O) + 8), bwd max(H, I) x 2 x 20
    # (transposed, row stride 16 + 4)
    assert smem(16, 32, 64) == (4 * (32 * (20 + 68 + 132) + 32 * 136), 4 * (32 * (132 + 68 + 68) + 32 * 40))
    assert smem(128, 128, 128) == (4 * (32 * 524 + 32 * 264), 4 * (32 * 524 + 128 * 40))
    assert max(smem(128, 128, 128)) <= 227 * 1024 // 2   # two CTAs an SM on sm_90
    assert grn_mod._tc_smem_fits(1024, 1024, 1024) is False


@pytest.mark.parametrize("I,H,O", [(128, 128, 128), (16, 128, 128), (128, 64, 64)])
def test_tc_path_lowers_for_cuda(kernels_on, I, H, O):
    """Shapes the CUDA-core kernels do not take (Hd or O = 128; I = 128 with Hd = O = 64) run the TF32 kernels: the
    forward (save = 0 outside jax.grad: zero-row residuals), the backward and one reduce_axis0 of the per-tile
    [sum dy zhat | sum dy]; the weight and bias gradients are XLA code (no other custom call)."""
    assert not grn_mod._kernel_fits(I, 0, H, O)
    R, T = 100, 4   # 4 row tiles of 32 (ffi/grn.cu tc kRows)
    p = random_grn_params(I, H, O, seed=I + H)
    calls = cuda_custom_calls(_value_and_grad(), p, jnp.zeros((R, I)), jnp.zeros((R, O)))
    assert set(calls) == {TC_FWD, TC_BWD, REDUCE}, set(calls)
    assert len(calls[TC_FWD]) == 2 and all(len(calls[k]) == 1 for k in (TC_BWD, REDUCE))
    t = lambda *s: "tensor<" + "x".join(map(str, s)) + "xf32>"  # noqa: E731
    skip = f"{t(I, O)}, {t(O)}" if I != O else f"{t(0, O)}, {t(0)}"
    ops = (f"({t(R, I)}, {t(I, H)}, {t(H)}, {t(H, H)}, {t(H)}, {t(H, 2 * O)}, {t(2 * O)}, {skip}, {t(O)}, {t(O)}) -> "
           f"({t(R, O)}, ")
    for save, Rs in ((0, 0), (1, R)):
        res = f"{t(Rs, H)}, {t(Rs, H)}, {t(Rs, 2 * O)}, {t(Rs, O)}, {t(Rs)})"
        (c,) = [c for c in calls[TC_FWD] if f"save = {save} : i64" in c]
        assert ops + res in c, c[-600:]
        assert f"hidden_size = {H} : i64" in c and f"output_size = {O} : i64" in c and "eps = 9.99999974E-6" in c
    bwd = calls[TC_BWD][0]
    ws = t(I, O) if I != O else t(0, O)
    assert (f"({t(R, O)}, {t(R, H)}, {t(R, 2 * O)}, {t(R, O)}, {t(R)}, {t(O)}, {t(H, 2 * O)}, {t(H, H)}, {t(I, H)}, "
            f"{ws}) -> ({t(R, I)}, {t(R, 2 * O)}, {t(R, H)}, {t(R, H)}, {t(R, O)}, {t(T, 2 * O)})") in bwd, bwd[-600:]
    assert f"({t(T, 2 * O)}) -> ({t(2 * O)}, " in calls[REDUCE][0]
    with jaxfox.use_reference():
        assert cuda_custom_calls(_value_and_grad(), p, jnp.zeros((R, I)), jnp.zeros((R, O))) == {}


@pytest.mark.parametrize("case", ["cuda_core_kernel", "I=48", "highest", "float32", "softmax", "context", "opt_out"])
def test_tc_path_is_not_taken(kernels_on, monkeypatch, case):
    """The TF32 kernels only for context-free GRNs of their widths that the CUDA-core kernels do not take, at the
    default matmul precision, opted in, without the softmax."""
    I, H, O, C = {"cuda_core_kernel": (32, 64, 64, None), "I=48": (48, 128, 128, None),
                  "context": (128, 128, 128, 5)}.get(case, (128, 128, 128, None))
    if case == "opt_out":
        monkeypatch.setenv("JAXFOX_OPT_IN_KERNELS", "attention_pool")
    p = random_grn_params(I, H, O, C, seed=9)
    a, r = jnp.zeros((70, I)), jnp.zeros((70, O))
    f, args = _value_and_grad(), (p, a, r)
    if case == "softmax":
        def f(p, a):
            return jax.grad(lambda p: jnp.sum(grn_mod._grn_apply(p, a, None, 1e-5, softmax=True)))(p)

        args = (p, a)
    elif C is not None:
        f, args = lambda p, a, c: jax.grad(lambda p: jnp.sum(grn(p, a, c)))(p), (p, a, jnp.zeros((70, C)))
    if case in ("highest", "float32"):
        with jax.default_matmul_precision(case):
            calls = cuda_custom_calls(f, *args)
    else:
        calls = cuda_custom_calls(f, *args)
    assert TC_FWD not in calls and TC_BWD not in calls, set(calls)
    if case == "cuda_core_kernel":
        assert grn_mod._tc_fits(I, 0, H, O) and {GRN_FWD, GRN_BWD} <= set(calls)
    else:
        assert calls == {}


# A NumPy float64 emulation of the FFI targets that the TF32 path calls, written from their contracts (the comments
# of ffi/grn.cu tc and ffi/grouped_gemm.cu, jaxfox/grn.py _grn_tc), independent of jaxfox's code. It runs through
# jax.pure_callback with vmap_method="broadcast_all", so every operand carries the same leading (vmap) dims, as the
# FFI handlers see them.
def _is_tf32(w):
    return bool(np.all((np.asarray(w, np.float32).view(np.uint32) & 0x1FFF) == 0))


def np_tf32(w):
    """float32 -> TF32 (10 mantissa bits), round to nearest even, in NumPy (finite values)."""
    u = np.asarray(w, np.float32).view(np.uint32)
    u = (u + np.uint32(0xFFF) + ((u >> np.uint32(13)) & np.uint32(1))) & np.uint32(0xFFFFE000)
    return u.view(np.float32)


def _row(b):
    return b[..., None, :]


def _T(w):
    return np.swapaxes(w, -1, -2)


def _np_tc_fwd(structs, x, w2, b2, w1, b1, w45, b45, ws, bs, gamma, beta, *, hidden_size, output_size, eps, save):
    assert type(hidden_size) is np.int64 and type(output_size) is np.int64 and type(save) is np.int64
    assert type(eps) is np.float32
    H, O, I = int(hidden_size), int(output_size), x.shape[-1]
    assert w2.shape[-2:] == (I, H) and w1.shape[-2:] == (H, H) and w45.shape[-2:] == (H, 2 * O)
    assert ws.shape[-2:] == ((I, O) if I != O else (0, O)) and bs.shape[-1] == (O if I != O else 0)
    assert all(_is_tf32(w) for w in (w2, w1, w45, ws)), "weights must arrive TF32-rounded"
    x, w2, b2, w1, b1, w45, b45, ws, bs, gamma, beta = (np.asarray(v, np.float64) for v in
                                                        (x, w2, b2, w1, b1, w45, b45, ws, bs, gamma, beta))
    e2 = np_elu(x @ w2 + _row(b2))
    e1 = e2 @ w1 + _row(b1)
    g = e1 @ w45 + _row(b45)
    z = (x @ ws + _row(bs) if I != O else x) + g[..., :O] * np_sigmoid(g[..., O:])
    mu = z.mean(-1, keepdims=True)
    rstd = 1.0 / np.sqrt(((z - mu) ** 2).mean(-1, keepdims=True) + float(eps))
    zhat = (z - mu) * rstd
    Rs = x.shape[-2] if save else 0
    outs = [zhat * _row(gamma) + _row(beta)] + [v[..., :Rs, :] for v in (e2, e1, g, zhat)] + [rstd[..., :Rs, 0]]
    return tuple(np.asarray(v, np.float32) for v in outs)


def _np_tc_bwd(structs, dy, e2, g, zhat, rstd, gamma, w45, w1, w2, ws, *, hidden_size, output_size):
    assert type(hidden_size) is np.int64 and type(output_size) is np.int64
    assert all(_is_tf32(w) for w in (w2, w1, w45, ws))
    O, I = int(output_size), w2.shape[-2]
    dy, e2, g, zhat, rstd, gamma, w45, w1, w2, ws = (np.asarray(v, np.float64) for v in
                                                     (dy, e2, g, zhat, rstd, gamma, w45, w1, w2, ws))
    gy = dy * _row(gamma)
    dz = rstd[..., None] * (gy - gy.mean(-1, keepdims=True) - zhat * (gy * zhat).mean(-1, keepdims=True))
    s = np_sigmoid(g[..., O:])
    dg = np.concatenate([dz * s, dz * g[..., :O] * s * (1 - s)], -1)
    de1 = dg @ _T(w45)
    da2 = (de1 @ _T(w1)) * np.where(e2 > 0, 1.0, e2 + 1.0)
    dx = da2 @ _T(w2) + (dz @ _T(ws) if I != O else dz)
    R = dy.shape[-2]
    rows = 32   # ffi/grn.cu tc kRows
    tiles = -(-R // rows)
    q = np.concatenate([dy * zhat, dy], -1)
    q = np.pad(q, [(0, 0)] * (q.ndim - 2) + [(0, tiles * rows - R), (0, 0)])
    gb = q.reshape(q.shape[:-2] + (tiles, rows, 2 * O)).sum(-2)
    return tuple(np.asarray(v, np.float32) for v in (dx, dg, de1, da2, dz, gb))


def _np_reduce_axis0(structs, x, *, chunks):
    x = np.asarray(x, np.float64)
    return x.sum(-2).astype(np.float32), np.zeros(x.shape[:-2] + structs[1].shape, np.float32)


_NP_TARGETS = {TC_FWD: _np_tc_fwd, TC_BWD: _np_tc_bwd, REDUCE: _np_reduce_axis0}


def _emulated_ffi_call(target, result_shape_dtypes, vmap_method=None):
    assert vmap_method == "broadcast_all", vmap_method
    impl = _NP_TARGETS[target]
    structs = tuple(result_shape_dtypes)

    def call(*args, **attrs):
        cb = lambda *xs: impl(structs, *xs, **attrs)  # noqa: E731
        return jax.pure_callback(cb, structs, *args, vmap_method="broadcast_all")

    return call


@pytest.fixture
def tc_emulated(monkeypatch):
    """The FFI calls of jaxfox.grn and jaxfox.reduce served by the NumPy emulation above."""
    for name in ("jaxfox.grn", "jaxfox.reduce"):
        monkeypatch.setattr(importlib.import_module(name), "_ffi_call", _emulated_ffi_call)


def tf32_weights(p):
    """p with its weight matrices rounded to TF32 (np_tf32), the other leaves as they are."""
    return {k: jnp.asarray(np_tf32(v)) if k in ("w2", "w1", "w4", "w5", "skip_w") else v for k, v in p.items()}


@pytest.mark.parametrize("I,H,O", [(16, 32, 64), (32, 64, 32)])
def test_tc_wiring_matches_autodiff_emulated(tc_emulated, I, H, O):
    """_grn_tc with its FFI targets emulated in float64 NumPy from their contracts: value and jax.grad (every
    parameter leaf and x) equal the reference's autodiff at precision "highest" evaluated at the TF32-rounded
    weights (rounded here in NumPy, independently). So the Python side rounds the weights (the emulation also
    checks each weight operand is a TF32 value), orders the operands, forms the weight gradients, splits dW45 and
    b45, reduces the LayerNorm partials and passes the rounded weights' gradients straight through to the
    unrounded ones. The emulation does not round activations to TF32 (the kernels do): that is the GPU tests'
    business. I != O (dense skip) and I == O (identity skip); R = 100 rows: one full and one partial tile."""
    R, eps = 100, 1e-5
    p = random_grn_params(I, H, O, seed=I + O)
    rng = np.random.default_rng(I)
    x = jnp.asarray(rng.standard_normal((R, I)), jnp.float32)
    r = jnp.asarray(rng.standard_normal((R, O)), jnp.float32)
    cfg = grn_mod._TcCfg(H, O, eps)
    y = jax.jit(lambda p, x: grn_mod._grn_tc(cfg, p, x))(p, x)
    g = jax.jit(jax.grad(lambda p, x: jnp.sum(grn_mod._grn_tc(cfg, p, x) * r), argnums=(0, 1)))(p, x)
    pr = tf32_weights(p)
    with jax.default_matmul_precision("highest"):
        y_ref = grn_mod._grn_reference(pr, x, None, eps)
        g_ref = jax.grad(lambda p, x: jnp.sum(grn_mod._grn_reference(p, x, None, eps) * r), argnums=(0, 1))(pr, x)
    assert rel_err(pr["w1"], p["w1"]) > 1e-5            # the rounding is visible at this tolerance
    assert_f32_close(y, y_ref, 1e-5)
    assert set(g[0]) == set(p) and ("skip_w" in p) == (I != O)
    assert_tree_close(g[0], g_ref[0], 1e-5)
    assert_f32_close(g[1], g_ref[1], 1e-5)


def _kernel_branch(monkeypatch, module):
    """``module.dispatch`` runs the kernel branch (CPU: platform_dependent would pick the reference); returns the
    list that records each call."""
    calls = []

    def kernel_branch(kernel, reference, *args, **kwargs):
        calls.append(kernel)
        return kernel(*args)

    monkeypatch.setattr(module, "dispatch", kernel_branch)
    return calls


@pytest.mark.parametrize("kind", ["extra_leaf", "ordered_dict"])
def test_tc_path_takes_any_params_mapping(tc_emulated, kernels_on, monkeypatch, kind):
    """jaxfox.grn on the TF32 path (FFI targets emulated) with params that grn() validates but that are not a plain
    dict of the GRN's leaves, as the reference and CUDA-core paths take them: an extra leaf gets a zero gradient,
    and an OrderedDict's gradient is an OrderedDict of the same key order (the same tree); values and gradients
    equal those of the plain dict (before the fix, the custom_vjp's backward failed on the tree structure)."""
    import collections

    monkeypatch.setenv("JAXFOX_OPT_IN_KERNELS", "grn")
    calls = _kernel_branch(monkeypatch, grn_mod)
    I, H, O, R = 16, 128, 128, 40
    p = random_grn_params(I, H, O, seed=5)
    rng = np.random.default_rng(5)
    x = jnp.asarray(rng.standard_normal((R, I)), jnp.float32)
    r = jnp.asarray(rng.standard_normal((R, O)), jnp.float32)
    if kind == "extra_leaf":
        q = {**p, "step": jnp.full((3,), 7.0)}
    else:
        q = collections.OrderedDict(sorted(p.items(), reverse=True))
    loss = lambda p: jnp.sum(grn(p, x) * r)  # noqa: E731
    y_p, g_p = jax.value_and_grad(loss)(p)
    y_q, g_q = jax.value_and_grad(loss)(q)
    assert calls and grn_mod._tc_routed(I, 0, H, O) and not grn_mod._kernel_fits(I, 0, H, O)
    assert type(g_q) is type(q) and jax.tree.structure(g_q) == jax.tree.structure(q)
    np.testing.assert_array_equal(np.asarray(y_q), np.asarray(y_p))
    for k in p:
        np.testing.assert_array_equal(np.asarray(g_q[k]), np.asarray(g_p[k]), err_msg=k)
    if kind == "extra_leaf":
        np.testing.assert_array_equal(np.asarray(g_q["step"]), np.zeros(3, np.float32))
