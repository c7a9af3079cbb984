"""CPU tests of jaxfox.vsn (vsn_init, vsn).

Oracle: ``np_vsn`` below, float64 NumPy written from OPS.md "GRN, GLU, VSN" (TFT eqs. 6-8): the
selection GRN on the flattened variables, a softmax over the m variables, one GRN per variable,
the weighted sum. It reuses only the float64 GRN oracle of test_grn.py (itself independent of the
library). Gradients are checked against float64 central differences of it.

The kernel path's host side is checked as in test_grn.py: ``kernel_path`` answers the
``jaxfox_vsn_fwd`` / ``jaxfox_vsn_bwd`` FFI calls with a float64 NumPy transcription of what
ffi/vsn.cu computes (selection GRN with softmax, per-variable GRNs, weighted sum; backward through
<dout, y_j>, the softmax and both GRNs), reading the flat parameter vectors through the documented
layout. The CUDA code itself is tested in test_gpu_grn_vsn.py.
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

from conftest import assert_raises_naming as _bad, rel_err
import jaxfox
from jaxfox import vsn, vsn_init
from test_grn import (
    assert_f32_close, assert_tree_close, fd_grads, flat_layout, grn_backward_f64, grn_forward_f64,
    make_kernel_path, np_grn, unpack_flat,
)

vsn_mod = importlib.import_module("jaxfox.vsn")  # the module (jaxfox.vsn is the function)


# ----------------------------------------------------------------------------------------------
# Float64 oracle.
def np_softmax(z):
    e = np.exp(z - z.max(axis=-1, keepdims=True))
    return e / e.sum(axis=-1, keepdims=True)


def np_vsn(params, xs, c=None, eps=1e-5):
    """(out [..., O], weights [..., m]) in float64."""
    xs = np.asarray(xs, np.float64)
    m, d = xs.shape[-2:]
    v = np_softmax(np_grn(params["selection"], xs.reshape(xs.shape[:-2] + (m * d,)), c, eps))
    var = params["variables"]
    ys = np.stack([np_grn({k: np.asarray(x)[j] for k, x in var.items()}, xs[..., j, :], None, eps)
                   for j in range(m)], axis=-2)
    return np.sum(v[..., None] * ys, axis=-2), v


def random_vsn_params(m, d, H, O, C=None, seed=0, scale=0.3):
    p = vsn_init(jax.random.key(seed), m, d, H, O, context_size=C)
    rng = np.random.default_rng(seed + 1000)
    return jax.tree.map(lambda x: x + jnp.asarray(scale * rng.standard_normal(x.shape), jnp.float32), p)


def _inputs(m, d, C, lead, seed=0):
    rng = np.random.default_rng(seed + 2000)
    xs = rng.standard_normal(lead + (m, d)).astype(np.float32)
    c = None if C is None else rng.standard_normal(lead + (C,)).astype(np.float32)
    return xs, c


def _call(p, xs, c, eps=1e-5):
    return vsn(p, jnp.asarray(xs), None if c is None else jnp.asarray(c), eps=eps)


CONFIGS = [  # (m, d, H, O, C, lead)
    (3, 2, 5, 4, None, (4,)),
    (4, 3, 6, 3, 2, (2, 3)),      # context; per-variable skip Dense (d != O)
    (2, 4, 3, 4, None, (3,)),     # d = O: identity skip in the per-variable GRNs
    (5, 1, 4, 2, 3, (2,)),        # d = 1: identity skip in the selection GRN (m*d = m)
]


# ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("m,d,H,O,C,lead", CONFIGS)
def test_matches_float64_oracle(m, d, H, O, C, lead):
    p = random_vsn_params(m, d, H, O, C, seed=m + d)
    xs, c = _inputs(m, d, C, lead, seed=H)
    out, w = _call(p, xs, c)
    assert out.shape == lead + (O,) and w.shape == lead + (m,)
    want_out, want_w = np_vsn(p, xs, c)
    assert_f32_close(out, want_out)
    assert_f32_close(w, want_w)
    np.testing.assert_allclose(np.asarray(w).sum(-1), 1.0, rtol=1e-6)
    out, w = jax.jit(functools.partial(vsn, eps=1e-3))(p, jnp.asarray(xs), None if c is None else jnp.asarray(c))
    assert_f32_close(out, np_vsn(p, xs, c, 1e-3)[0])


@pytest.mark.parametrize("m,d,H,O,C,lead", CONFIGS[:2] + CONFIGS[3:])
def test_grads_match_oracle_finite_differences(m, d, H, O, C, lead):
    p = random_vsn_params(m, d, H, O, C, seed=2 * m + d)
    xs, c = _inputs(m, d, C, lead, seed=3 + H)
    rng = np.random.default_rng(5)
    r1, r2 = rng.standard_normal(lead + (O,)), rng.standard_normal(lead + (m,))

    def loss(p, xs, c=None):
        out, w = vsn(p, xs, c)
        return jnp.sum(out * jnp.asarray(r1, jnp.float32)) + jnp.sum(w * jnp.asarray(r2, jnp.float32))

    args = (p, jnp.asarray(xs)) + (() if c is None else (jnp.asarray(c),))
    g = jax.grad(loss, argnums=tuple(range(len(args))))(*args)

    def np_loss(t):
        out, w = np_vsn(t[0], t[1], t[2] if c is not None else None)
        return float(np.sum(out * r1) + np.sum(w * r2))

    want = fd_grads(np_loss, (p, xs) + (() if c is None else (c,)))
    # A float32 backward against float64 truth: leaves whose contributions cancel (skip_w here) reach
    # ~1e-4 relative (CI saw 1.04e-4), hence 3e-4.
    assert_tree_close(g[0]["selection"], want[0]["selection"], 3e-4)
    assert_tree_close(g[0]["variables"], want[0]["variables"], 3e-4)
    assert_f32_close(g[1], want[1], 3e-4)
    if c is not None:
        assert_f32_close(g[2], want[2], 3e-4)


def test_check_grads():
    p = random_vsn_params(3, 2, 4, 3, 2, seed=11)
    xs, c = _inputs(3, 2, 2, (2,), seed=12)
    check_grads(lambda p, x, c: vsn(p, x, c), (p, jnp.asarray(xs), jnp.asarray(c)), order=1, modes=("rev",),
                atol=2e-2, rtol=2e-2, eps=1e-2)


def test_single_variable_weight_is_exactly_one():
    p = random_vsn_params(1, 4, 5, 3, 2, seed=13)
    xs, c = _inputs(1, 4, 2, (3, 5), seed=14)
    xs[0, 0] = 1e4                     # extreme logits make no difference
    out, w = _call(p, xs, c)
    np.testing.assert_array_equal(np.asarray(w), np.ones((3, 5, 1), np.float32))
    assert_f32_close(out, np_vsn(p, xs, c)[0])
    # the output is the variable's GRN alone; nothing flows into the selection network
    gp = jax.grad(lambda p: jnp.sum(vsn(p, jnp.asarray(xs), jnp.asarray(c))[0]))(p)
    for leaf in jax.tree.leaves(gp["selection"]):
        assert np.all(np.asarray(leaf) == 0.0)
    assert any(np.any(np.asarray(leaf) != 0.0) for leaf in jax.tree.leaves(gp["variables"]))


def test_context_broadcasts_over_time():
    m, d, H, O, C = 3, 2, 4, 5, 3
    p = random_vsn_params(m, d, H, O, C, seed=15)
    rng = np.random.default_rng(16)
    xs = rng.standard_normal((2, 6, m, d)).astype(np.float32)
    c = rng.standard_normal((2, 1, C)).astype(np.float32)
    out, w = vsn(p, jnp.asarray(xs), jnp.asarray(c))
    want_out, want_w = np_vsn(p, xs, np.broadcast_to(c, (2, 6, C)))
    assert_f32_close(out, want_out)
    assert_f32_close(w, want_w)


def test_bfloat16_inputs_keep_float32_statistics():
    m, d, H, O = 3, 4, 5, 4
    p = random_vsn_params(m, d, H, O, seed=17)
    rng = np.random.default_rng(18)
    xs16 = jnp.asarray((150.0 + rng.integers(-4, 5, size=(4, m, d))).astype(np.float32), jnp.bfloat16)
    xs = np.asarray(xs16.astype(jnp.float32))
    out, w = vsn(p, xs16)
    assert out.dtype == jnp.float32 and w.dtype == jnp.float32
    want_out, want_w = np_vsn(p, xs)
    assert_f32_close(out, want_out)
    assert_f32_close(w, want_w)
    r = rng.standard_normal((4, O)).astype(np.float32)
    g16 = jax.grad(lambda x: jnp.sum(vsn(p, x)[0] * r))(xs16)
    g32 = jax.grad(lambda x: jnp.sum(vsn(p, x)[0] * r))(xs16.astype(jnp.float32))
    assert g16.dtype == jnp.bfloat16
    np.testing.assert_array_equal(np.asarray(g16), np.asarray(g32.astype(jnp.bfloat16)))


def test_errors():
    m, d, H, O, C = 3, 2, 4, 5, 2
    p = random_vsn_params(m, d, H, O, C)
    xs = jnp.ones((4, m, d))
    c = jnp.ones((4, C))
    _bad(lambda: vsn(p, xs.astype(jnp.int32), c), TypeError, "xs", "int32")
    _bad(lambda: vsn(p, xs.astype(jnp.float16), c), TypeError, "xs", "float16")
    _bad(lambda: vsn(p, xs[:, :2], c), ValueError, "xs", "[..., 3, 2]", "(4, 2, 2)")
    _bad(lambda: vsn(p, xs[..., :1], c), ValueError, "xs", "[..., 3, 2]")
    _bad(lambda: vsn(p, jnp.ones((2,)), c), ValueError, "xs")
    _bad(lambda: vsn(p, xs), ValueError, "context", "required")
    _bad(lambda: vsn(p, xs, c[:, :1]), ValueError, "context", "[..., 2]")
    _bad(lambda: vsn(p, xs, jnp.ones((3, C))), ValueError, "context")
    q = random_vsn_params(m, d, H, O)
    _bad(lambda: vsn(q, xs, c), ValueError, "context", "w3")
    _bad(lambda: vsn({"selection": q["selection"]}, xs), ValueError, "params", "variables")
    _bad(lambda: vsn({**q, "selection": random_vsn_params(m + 1, d, H, O)["selection"]}, xs), ValueError,
         "params['selection']")
    bad_var = {**q["variables"], "w1": q["variables"]["w1"][:, :, :3]}
    _bad(lambda: vsn({**q, "variables": bad_var}, xs), ValueError, "params['variables']['w1']")
    bad_var = {**q["variables"], "b4": q["variables"]["b4"][:2]}
    _bad(lambda: vsn({**q, "variables": bad_var}, xs), ValueError, "params['variables']['b4']")
    _bad(lambda: vsn(q, xs, eps=0.0), ValueError, "eps")
    _bad(lambda: vsn_init(jax.random.key(0), 0, 2, 4, 5), ValueError, "num_vars")
    _bad(lambda: vsn_init(jax.random.key(0), 3, 2, 4, 5, context_size=-1), ValueError, "context_size")


def test_init():
    m, d, H, O, C = 4, 3, 8, 6, 5
    p = vsn_init(jax.random.key(1), m, d, H, O, context_size=C)
    sel, var = p["selection"], p["variables"]
    assert sel["w2"].shape == (m * d, H) and sel["w3"].shape == (C, H) and sel["w4"].shape == (H, m)
    assert sel["skip_w"].shape == (m * d, m)
    assert var["w2"].shape == (m, d, H) and var["w1"].shape == (m, H, H) and var["w5"].shape == (m, H, O)
    assert var["skip_w"].shape == (m, d, O) and var["gamma"].shape == (m, O) and "w3" not in var
    w2 = np.asarray(var["w2"])
    bound = math.sqrt(6.0 / (d + H))
    assert np.abs(w2).max() <= bound
    assert not np.array_equal(w2[0], w2[1])              # every variable has its own weights
    assert np.all(np.asarray(var["gamma"]) == 1.0) and np.all(np.asarray(var["b1"]) == 0.0)
    assert "skip_w" not in vsn_init(jax.random.key(1), m, 4, H, 4)["variables"]
    assert "skip_w" not in vsn_init(jax.random.key(1), m, 1, H, 4)["selection"]


def test_jit_vmap_grad():
    m, d, H, O, C = 3, 2, 4, 3, 2
    p = random_vsn_params(m, d, H, O, C, seed=21)
    xs, c = _inputs(m, d, C, (3, 4), seed=22)
    eager = _call(p, xs, c)
    jitted = jax.jit(vsn)(p, jnp.asarray(xs), jnp.asarray(c))
    for a, b in zip(eager, jitted):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-6, atol=1e-6)
    out, w = jax.vmap(lambda x, z: vsn(p, x, z))(jnp.asarray(xs), jnp.asarray(c))
    assert_f32_close(out, np_vsn(p, xs, c)[0])
    ps = [random_vsn_params(m, d, H, O, C, seed=30 + s) for s in range(2)]
    stacked = jax.tree.map(lambda *x: jnp.stack(x), *ps)
    outs, _ = jax.vmap(lambda q: vsn(q, jnp.asarray(xs), jnp.asarray(c)))(stacked)
    for s in range(2):
        assert_f32_close(outs[s], np_vsn(ps[s], xs, c)[0])
    r = np.random.default_rng(23).standard_normal((3, 4, O)).astype(np.float32)
    g = jax.jit(jax.grad(lambda q, x: jnp.sum(vsn(q, x, jnp.asarray(c))[0] * r), argnums=(0, 1)))(p, jnp.asarray(xs))
    want = fd_grads(lambda t: float(np.sum(np_vsn(t[0], t[1], c)[0] * r)), (p, xs))
    assert_tree_close(g[0]["variables"], want[0]["variables"], 1e-4)
    assert_f32_close(g[1], want[1], 1e-4)


def test_zero_rows():
    p = random_vsn_params(3, 2, 4, 5)
    out, w = vsn(p, jnp.zeros((0, 7, 3, 2)))
    assert out.shape == (0, 7, 5) and w.shape == (0, 7, 3)


# ----------------------------------------------------------------------------------------------
# Host side of the kernel path, through a float64 NumPy transcription of ffi/vsn.cu.
def _sizes(num_vars, var_size, hidden_size, output_size, context_size):
    m, d, H, O, C = num_vars, var_size, hidden_size, output_size, context_size
    return m, d, H, O, C, (m * d, C, H, m), (d, 0, H, O)


def emu_vsn_fwd(w_sel, w_var, xs, c, *, num_vars, var_size, hidden_size, output_size, context_size,
                tile_rows_sel, tile_rows_var, groups, eps):
    m, d, H, O, C, sel, var = _sizes(num_vars, var_size, hidden_size, output_size, context_size)
    lead = xs.shape[:-2]
    R = xs.shape[-2]
    assert xs.shape[-1] == m * d and c.shape == lead + (R, C) and xs.dtype == c.dtype
    assert tile_rows_sel in (16, 32) and tile_rows_var in (16, 32)
    vpg = -(-m // groups)
    assert 1 <= groups <= m and -(-m // vpg) == groups
    _, Ps, (_, _, H4s, O4s, _) = flat_layout(*sel)
    _, Pv, _ = flat_layout(*var)
    V = int(np.prod(lead, dtype=np.int64))
    assert w_sel.shape == lead + (Ps,) and w_var.shape == lead + (m * Pv,)
    xx = np.asarray(xs, np.float64).reshape(V, R, m, d)
    cc = np.asarray(c, np.float64).reshape(V, R, C)
    outs = [np.zeros((V, R) + s) for s in ((O,), (m,), (H4s,), (H4s,), (2 * O4s,), (O4s,), ())]
    for v in range(V):
        Ws = unpack_flat(w_sel.reshape(V, Ps)[v], *sel)
        logits, *saved = grn_forward_f64(Ws, xx[v].reshape(R, m * d), cc[v], *sel, float(eps))
        wts = np_softmax(logits)
        out = np.zeros((R, O))
        for j in range(m):
            Wj = unpack_flat(w_var.reshape(V, m, Pv)[v, j], *var)
            out += wts[:, j:j + 1] * grn_forward_f64(Wj, xx[v][:, j], np.zeros((R, 0)), *var, float(eps))[0]
        for o, r in zip(outs, [out, wts] + saved):
            o[v] = r
    f32 = np.float32
    res = tuple(o.reshape(lead + o.shape[1:]).astype(f32) for o in outs)
    return res + (np.zeros(lead + ((groups * R * O if groups > 1 else 0),), f32),)


def emu_vsn_bwd(w_sel, w_sel_t, w_var, w_var_t, xs, c, weights, eta2, eta1, g, xhat, rstd, dout, dweights, *,
                num_vars, var_size, hidden_size, output_size, context_size, tile_rows_sel, tile_rows_var,
                chunks_sel, chunks_var, reduce_chunks_sel, reduce_chunks_var, eps):
    m, d, H, O, C, sel, var = _sizes(num_vars, var_size, hidden_size, output_size, context_size)
    lead = xs.shape[:-2]
    R = xs.shape[-2]
    _, Ps, (_, _, H4s, O4s, _) = flat_layout(*sel)
    _, Pv, _ = flat_layout(*var)
    for S, TR in ((chunks_sel, tile_rows_sel), (chunks_var, tile_rows_var)):
        tiles = -(-R // TR)
        assert 1 <= S <= tiles and -(-tiles // -(-tiles // S)) == S
    assert reduce_chunks_sel == jaxfox.reduce.reduce_chunks(chunks_sel, Ps)
    assert reduce_chunks_var == jaxfox.reduce.reduce_chunks(chunks_var, m * Pv)
    V = int(np.prod(lead, dtype=np.int64))
    sv = lambda x, *s: np.asarray(x, np.float64).reshape((V,) + s)  # noqa: E731
    xx, cc = sv(xs, R, m, d), sv(c, R, C)
    dws, dwv = np.zeros((V, Ps)), np.zeros((V, m * Pv))
    dxs, dc = np.zeros((V, R, m, d)), np.zeros((V, R, C))
    for v in range(V):
        Ws = unpack_flat(w_sel.reshape(V, Ps)[v], *sel)
        Wst = unpack_flat(w_sel_t.reshape(V, Ps)[v], *sel, transposed=True)
        assert all(np.array_equal(Ws[k], Wst[k]) for k in Ws)
        wts, do, dvw = sv(weights, R, m)[v], sv(dout, R, O)[v], sv(dweights, R, m)[v]
        sdot = np.zeros((R, m))
        for j in range(m):
            Wj = unpack_flat(w_var.reshape(V, m, Pv)[v, j], *var)
            Wjt = unpack_flat(w_var_t.reshape(V, m, Pv)[v, j], *var, transposed=True)
            assert all(np.array_equal(Wj[k], Wjt[k]) for k in Wj)
            y, *saved = grn_forward_f64(Wj, xx[v][:, j], np.zeros((R, 0)), *var, float(eps))
            sdot[:, j] = np.sum(do * y, axis=1)
            dflat, da, _ = grn_backward_f64(Wj, xx[v][:, j], np.zeros((R, 0)), *saved, wts[:, j:j + 1] * do, *var)
            dwv[v, j * Pv:(j + 1) * Pv] = dflat
            dxs[v][:, j] = da
        gsum = dvw + sdot
        dlogits = wts * (gsum - np.sum(wts * gsum, axis=1, keepdims=True))
        dflat, da, dcv = grn_backward_f64(Ws, xx[v].reshape(R, m * d), cc[v], sv(eta2, R, H4s)[v], sv(eta1, R, H4s)[v],
                                          sv(g, R, 2 * O4s)[v], sv(xhat, R, O4s)[v], sv(rstd, R)[v], dlogits, *sel)
        dws[v] = dflat
        dxs[v] += da.reshape(R, m, d)
        dc[v] = dcv
    f32 = np.float32
    bf16 = xs.dtype != np.float32
    return (dws.reshape(lead + (Ps,)).astype(f32), dwv.reshape(lead + (m * Pv,)).astype(f32),
            dxs.reshape(xs.shape).astype(xs.dtype), dc.reshape(c.shape).astype(c.dtype),
            np.zeros(lead + (R, m), f32), np.zeros(lead + ((R * m * d if bf16 else 0),), f32),
            np.zeros(lead + (chunks_sel, Ps), f32), np.zeros(lead + (chunks_var, m * Pv), f32),
            np.zeros(lead + ((reduce_chunks_sel * Ps if reduce_chunks_sel > 1 else 0),), f32),
            np.zeros(lead + ((reduce_chunks_var * m * Pv if reduce_chunks_var > 1 else 0),), f32))


@pytest.fixture
def kernel_path(monkeypatch):
    monkeypatch.setattr(vsn_mod, "_KERNELS_ENABLED", True)  # the kernels are not enabled in the package yet
    return make_kernel_path(monkeypatch, vsn_mod, {"jaxfox_vsn_fwd": emu_vsn_fwd, "jaxfox_vsn_bwd": emu_vsn_bwd})


@pytest.mark.parametrize("m,d,H,O,C,lead", [(3, 2, 5, 4, None, (4,)), (4, 3, 6, 3, 2, (2, 3)), (2, 4, 3, 4, None, (40,))])
def test_kernel_path_wiring(kernel_path, m, d, H, O, C, lead):
    p = random_vsn_params(m, d, H, O, C, seed=40 + m)
    xs, c = _inputs(m, d, C, lead, seed=41)
    out, w = _call(p, xs, c)
    want_out, want_w = np_vsn(p, xs, c)
    assert_f32_close(out, want_out)
    assert_f32_close(w, want_w)
    rng = np.random.default_rng(42)
    r1 = rng.standard_normal(lead + (O,)).astype(np.float32)
    r2 = rng.standard_normal(lead + (m,)).astype(np.float32)

    def loss(*args):
        o, wt = vsn(*args)
        return jnp.sum(o * r1) + jnp.sum(wt * r2)

    args = (p, jnp.asarray(xs)) + (() if c is None else (jnp.asarray(c),))
    g = jax.grad(loss, argnums=tuple(range(len(args))))(*args)
    assert "jaxfox_vsn_fwd" in kernel_path and kernel_path.count("jaxfox_vsn_bwd") == 1

    def np_loss(t):  # float64 truth (the emulation is float64 too, so the tolerance can be tight)
        o, wt = np_vsn(t[0], t[1], t[2] if c is not None else None)
        return float(np.sum(o * r1) + np.sum(wt * r2))

    want = fd_grads(np_loss, (p, xs) + (() if c is None else (c,)))
    assert_tree_close(g[0]["selection"], want[0]["selection"], 2e-5)
    assert_tree_close(g[0]["variables"], want[0]["variables"], 2e-5)
    for got, wnt in zip(g[1:], want[1:]):
        assert_f32_close(got, wnt, 2e-5)


def test_kernel_path_vmap_bf16_single_variable(kernel_path):
    m, d, H, O, C = 3, 2, 4, 3, 2
    ps = [random_vsn_params(m, d, H, O, C, seed=50 + s) for s in range(2)]
    stacked = jax.tree.map(lambda *x: jnp.stack(x), *ps)
    rng = np.random.default_rng(51)
    xs = rng.standard_normal((2, 5, m, d)).astype(np.float32)
    c = rng.standard_normal((2, 5, C)).astype(np.float32)
    outs, ws = jax.vmap(vsn)(stacked, jnp.asarray(xs), jnp.asarray(c))
    for s in range(2):
        wo, ww = np_vsn(ps[s], xs[s], c[s])
        assert_f32_close(outs[s], wo)
        assert_f32_close(ws[s], ww)
    r = rng.standard_normal((5, O)).astype(np.float32)
    gv = jax.vmap(jax.grad(lambda q, x, z: jnp.sum(vsn(q, x, z)[0] * r)))(stacked, jnp.asarray(xs), jnp.asarray(c))
    for s in range(2):
        want = fd_grads(lambda t: float(np.sum(np_vsn(t, xs[s], c[s])[0] * r)), ps[s])
        assert_tree_close({k: x[s] for k, x in gv["variables"].items()}, want["variables"], 1e-4)
        assert_tree_close({k: x[s] for k, x in gv["selection"].items()}, want["selection"], 1e-4)
    x16 = jnp.asarray(xs[0], jnp.bfloat16)
    gx = jax.grad(lambda x: jnp.sum(vsn(ps[0], x, jnp.asarray(c[0], jnp.bfloat16))[0] * r))(x16)
    assert gx.dtype == jnp.bfloat16
    q = random_vsn_params(1, d, H, O, seed=52)
    _, w1 = vsn(q, jnp.asarray(xs[0][:, :1]))
    np.testing.assert_array_equal(np.asarray(w1), np.ones((5, 1), np.float32))


def test_launch_configuration():
    for R in (1, 100, 2048, 16384):
        cfg = vsn_mod._vsn_config(48, 16, 128, 128, 0, R, 1e-5)
        assert cfg is not None and cfg.tile_rows_var == 32
        assert cfg == vsn_mod._vsn_config(48, 16, 128, 128, 0, R, 1e-5)
        vpg = -(-48 // cfg.groups)
        assert -(-48 // vpg) == cfg.groups
        for S, TR in ((cfg.chunks_sel, cfg.tile_rows_sel), (cfg.chunks_var, cfg.tile_rows_var)):
            tiles = -(-R // TR)
            assert 1 <= S <= tiles and -(-tiles // -(-tiles // S)) == S
    cfg = vsn_mod._vsn_config(48, 16, 128, 128, 0, 2048, 1e-5)
    assert cfg.groups > 1 and cfg.chunks_var > 1   # enough blocks for the GPU at B*T = 2048
    assert vsn_mod._vsn_config(48, 16, 128, 128, 0, 0, 1e-5) is None
    assert vsn_mod._vsn_config(4096, 16, 128, 128, 0, 64, 1e-5) is None  # selection input too wide
