"""CPU tests of jaxfox.cfc (cfc_init, cfc_cell, cfc_scan) against an independent float64 NumPy oracle.

The oracle (``np_cfc_scan`` in conftest.py) is written from OPS.md "CfC cell and scan" and shares no
code with the library. On CPU these tests exercise the pure-JAX reference path; the CUDA kernels are
compared with that path in test_gpu_cfc.py.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P
from jax.test_util import check_grads

from conftest import central_diff_grad, np_cfc_cell, np_cfc_scan, random_cfc_params, random_inputs, rel_err, to_f64
from jaxfox import cfc_cell, cfc_init, cfc_scan

MODES = ("default", "no_gate", "pure")
LAYERS = (0, 1, 2)

# Jitted entry points (compiled once per shape and mode, which keeps this file fast). Eager calls are
# covered where they matter: concrete-ts validation, errors, and test_jit_equals_eager.
_scan = jax.jit(cfc_scan, static_argnames="mode")
_cell = jax.jit(cfc_cell, static_argnames="mode")


def _setup(mode, L, B=3, T=6, I=5, H=7, U=9, seed=0, ts_kind="per_step"):
    params = random_cfc_params(jax.random.key(seed), I, H, U, L, mode, seed=seed)
    xs, ts, h0 = random_inputs(B, T, I, H, seed=seed + 100, ts_kind=ts_kind)
    return params, xs, ts, h0


def _assert_close_f64(got, want, rtol=1e-5, atol=1e-5):
    got = np.asarray(got)
    assert got.dtype == np.float32
    assert got.shape == want.shape, (got.shape, want.shape)
    np.testing.assert_allclose(got, want, rtol=rtol, atol=atol)
    assert rel_err(got, want) <= rtol


# ----------------------------------------------------------------------------------------------
# Values against the float64 oracle.
@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("L", LAYERS)
@pytest.mark.parametrize("mode", MODES)
def test_scan_matches_numpy(mode, L, seed):
    params, xs, ts, h0 = _setup(mode, L, seed=seed)
    want = np_cfc_scan(params, xs, ts, h0, mode)
    assert np.std(want) > 0.05  # the case is not trivial (states move)
    _assert_close_f64(_scan(params, xs, ts, h0, mode=mode), want)


@pytest.mark.parametrize("L", LAYERS)
@pytest.mark.parametrize("mode", MODES)
def test_scan_default_ts_and_h0(mode, L):
    params, xs, _, _ = _setup(mode, L, seed=3)
    want = np_cfc_scan(params, xs, 1.0, None, mode)
    _assert_close_f64(cfc_scan(params, jnp.asarray(xs), mode=mode), want)


@pytest.mark.parametrize("ts_kind", ["scalar", "per_sample"])
@pytest.mark.parametrize("L", LAYERS)
@pytest.mark.parametrize("mode", MODES)
def test_cell_matches_numpy(mode, L, ts_kind):
    params, xs, ts, h0 = _setup(mode, L, seed=4, ts_kind=ts_kind)
    x = xs[:, 0]
    want = np_cfc_cell(to_f64(params), h0, x, np.broadcast_to(np.asarray(ts, np.float64), (x.shape[0],)), mode)
    _assert_close_f64(_cell(params, h0, x, ts, mode=mode), want)
    _assert_close_f64(cfc_cell(params, jnp.asarray(h0), jnp.asarray(x), ts, mode=mode), want)  # eager


@pytest.mark.parametrize("mode", MODES)
def test_ts_zero(mode):
    """ts = 0 is valid (not 'missing'): pure mode gives h = A - A*ff1, the gates become sigmoid(t_b)."""
    params, xs, _, h0 = _setup(mode, 1, seed=5)
    for ts in (0.0, np.zeros(3, np.float32), np.zeros((3, 6), np.float32)):
        want = np_cfc_scan(params, xs, ts, h0, mode)
        _assert_close_f64(cfc_scan(params, jnp.asarray(xs), ts, jnp.asarray(h0), mode=mode), want)
    # zeros mixed with positive steps
    ts = np.where(np.arange(6)[None, :] % 2 == 0, 0.0, 1.5).astype(np.float32) * np.ones((3, 1), np.float32)
    want = np_cfc_scan(params, xs, ts, h0, mode)
    _assert_close_f64(_scan(params, xs, ts, h0, mode=mode), want)
    # the case is sensitive to ts (ts = 0 steps are not treated like ts = 1.5 steps)
    assert not np.allclose(np_cfc_scan(params, xs, 1.5, h0, mode), want, atol=1e-4)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("B,H", [(3, 7), (4, 4), (1, 5), (6, 2)])
def test_ts_per_sample_shapes(mode, B, H):
    """ts [B] means one elapsed time per *sample* (row), also when B == H (the ncps broadcast bug)."""
    params = random_cfc_params(jax.random.key(6), 3, H, 5, 1, mode, seed=6)
    xs, ts, h0 = random_inputs(B, 4, 3, H, seed=7, ts_kind="per_sample")
    want = np_cfc_scan(params, xs, ts, h0, mode)
    _assert_close_f64(_scan(params, xs, ts, h0, mode=mode), want)
    if B > 1:  # a per-sample ts that varies really matters
        assert not np.allclose(want, np_cfc_scan(params, xs, float(np.mean(ts)), h0, mode), atol=1e-4)


@pytest.mark.parametrize("mode", MODES)
def test_ts_scalar_forms_agree(mode):
    params, xs, _, h0 = _setup(mode, 1, seed=8)
    want = np_cfc_scan(params, xs, 0.7, h0, mode)
    for ts in (0.7, np.float32(0.7), np.asarray(0.7, np.float32), jnp.float32(0.7),
               np.full((3,), 0.7, np.float32), jnp.full((3, 6), 0.7, jnp.float32)):
        _assert_close_f64(cfc_scan(params, jnp.asarray(xs), ts, jnp.asarray(h0), mode=mode), want)


def test_ts_matters_per_step():
    params, xs, ts, h0 = _setup("default", 1, seed=9)
    a = np.asarray(_scan(params, xs, ts, h0))
    ts2 = ts.copy()
    ts2[1, 3] += 1.0
    b = np.asarray(_scan(params, xs, ts2, h0))
    np.testing.assert_array_equal(a[:, :3], b[:, :3])  # causal
    np.testing.assert_array_equal(a[0], b[0])          # other samples untouched
    assert not np.allclose(a[1, 3:], b[1, 3:])


# ----------------------------------------------------------------------------------------------
# Negative ts.
@pytest.mark.parametrize("mode", MODES)
def test_negative_concrete_ts_raises(mode):
    params, xs, ts, h0 = _setup(mode, 1, seed=10)
    xs, h0 = jnp.asarray(xs), jnp.asarray(h0)
    bad = ts.copy()
    bad[2, 4] = -0.5
    for t in (-1.0, np.float32(-1e-6), bad, jnp.asarray(bad), -np.ones(3, np.float32)):
        with pytest.raises(ValueError, match="ts"):
            cfc_scan(params, xs, t, h0, mode=mode)
    with pytest.raises(ValueError, match="ts"):
        cfc_cell(params, h0, xs[:, 0], -1.0, mode=mode)
    with pytest.raises(ValueError, match="ts"):
        cfc_cell(params, h0, xs[:, 0], jnp.asarray([1.0, -1.0, 1.0]), mode=mode)


@pytest.mark.parametrize("mode", MODES)
def test_nan_concrete_ts_raises(mode):
    """NaN is not a valid elapsed time (ts must be >= 0): a concrete NaN raises like a negative value instead
    of silently turning that sample's state, and every later step of it, into NaN."""
    params, xs, ts, h0 = _setup(mode, 1, seed=12)
    xs, h0 = jnp.asarray(xs), jnp.asarray(h0)
    bad = ts.copy()
    bad[1, 3] = np.nan
    for t in (float("nan"), np.float32("nan"), bad, jnp.asarray(bad), np.array([1.0, np.nan, 0.5], np.float32)):
        with pytest.raises(ValueError, match="ts"):
            cfc_scan(params, xs, t, h0, mode=mode)
    with pytest.raises(ValueError, match="ts"):
        cfc_cell(params, h0, xs[:, 0], float("nan"), mode=mode)


@pytest.mark.parametrize("mode", MODES)
def test_infinite_concrete_ts_raises(mode):
    """An infinite elapsed time gave a finite forward but 0 * inf in the derivatives of the gate (of exp(-ts ...) in
    mode "pure"), so every parameter gradient of the whole batch was NaN. A concrete inf, also a float64 value beyond
    float32's range (the op's ts is float32), raises; the largest finite float32 ts still runs, matches the float64
    oracle and has finite gradients."""
    params, xs, ts, h0 = _setup(mode, 1, seed=13)
    xs, h0 = jnp.asarray(xs), jnp.asarray(h0)
    bad = ts.copy()
    bad[1, 2] = np.inf
    big64 = ts.astype(np.float64)
    big64[0, 3] = 1e39
    for t in (float("inf"), np.float32(np.inf), 1e39, 10**400, bad, jnp.asarray(bad), big64,
              np.array([1.0, np.inf, 0.5], np.float32)):  # 10**400: a Python int beyond float64 (was OverflowError)
        with pytest.raises(ValueError, match="ts .*finite"):
            cfc_scan(params, xs, t, h0, mode=mode)
    with pytest.raises(ValueError, match="ts .*finite"):
        cfc_cell(params, h0, xs[:, 0], float("inf"), mode=mode)
    top = ts.copy()
    top[1, 2] = np.finfo(np.float32).max
    with np.errstate(over="ignore"):
        want = np_cfc_scan(params, xs, top, h0, mode)
    _assert_close_f64(cfc_scan(params, xs, top, h0, mode=mode), want)
    grads = jax.grad(lambda p: jnp.sum(cfc_scan(p, xs, top, h0, mode=mode)))(params)
    assert all(np.isfinite(np.asarray(g)).all() for g in jax.tree.leaves(grads))


@pytest.mark.parametrize("mode", MODES)
def test_negative_traced_ts_gives_nan_in_those_steps_only(mode):
    params, xs, ts, h0 = _setup(mode, 1, seed=11)
    ts = ts.copy()
    ts[0, 4] = -0.3
    ts[2, 1] = -1.0
    hs = np.asarray(jax.jit(lambda p, x, t, h: cfc_scan(p, x, t, h, mode=mode))(params, xs, ts, h0))
    bad = ts < 0
    assert np.isnan(hs[bad]).all()
    assert np.isfinite(hs[~bad]).all()
    # steps before the first negative one are unaffected
    want = np_cfc_scan(params, xs, np.abs(ts), h0, mode)
    np.testing.assert_allclose(hs[0, :4], want[0, :4], rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(hs[1], want[1], rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(hs[2, :1], want[2, :1], rtol=1e-5, atol=1e-5)
    # per-sample and scalar traced ts
    f = jax.jit(lambda t: cfc_scan(params, xs, t, h0, mode=mode))
    hs = np.asarray(f(jnp.asarray([1.0, -1.0, 0.5])))
    assert np.isnan(hs[1]).all() and np.isfinite(hs[[0, 2]]).all()
    assert np.isnan(np.asarray(f(jnp.float32(-2.0)))).all()


# ----------------------------------------------------------------------------------------------
# Gradients.
def _f64_tree_flatten(tree):
    leaves, treedef = jax.tree.flatten(tree)
    shapes = [np.shape(l) for l in leaves]
    flat = np.concatenate([np.asarray(l, np.float64).ravel() for l in leaves])

    def unflatten(v):
        out, k = [], 0
        for s in shapes:
            n = int(np.prod(s))
            out.append(v[k:k + n].reshape(s))
            k += n
        return jax.tree.unflatten(treedef, out)

    return flat, unflatten


@pytest.mark.parametrize("L", LAYERS)
@pytest.mark.parametrize("mode", MODES)
def test_grads_match_float64_finite_differences(mode, L):
    """jax.grad of sum(hs * C) wrt params, xs, ts [B, T], h0 vs float64 central differences of the oracle."""
    B, T, I, H, U = 2, 3, 3, 4, 5
    params, xs, ts, h0 = _setup(mode, L, B, T, I, H, U, seed=12)
    C = np.random.default_rng(13).standard_normal((B, T, H))

    def loss(p, x, t, h):
        return jnp.sum(cfc_scan(p, x, t, h, mode=mode) * C.astype(np.float32))

    g = jax.grad(loss, argnums=(0, 1, 2, 3))(params, jnp.asarray(xs), jnp.asarray(ts), jnp.asarray(h0))

    pflat, unflat = _f64_tree_flatten(params)
    args64 = [np.asarray(a, np.float64) for a in (xs, ts, h0)]

    def np_loss(which, v):
        a = list(args64)
        p = params
        if which == 0:
            p = unflat(v)
        else:
            a[which - 1] = v
        return float(np.sum(np_cfc_scan(p, a[0], a[1], a[2], mode) * C))

    fd_p = unflat(central_diff_grad(lambda v: np_loss(0, v), pflat))
    fds = [central_diff_grad(lambda v, k=k: np_loss(k, v), args64[k - 1]) for k in (1, 2, 3)]
    for name, got, want in zip(("params", "xs", "ts", "h0"), g, [fd_p] + fds):
        assert jax.tree.structure(got) == jax.tree.structure(want), name
        assert rel_err(got, want) <= 1e-4, name
        for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
            np.testing.assert_allclose(np.asarray(a), b, rtol=1e-3, atol=1e-4, err_msg=name)


@pytest.mark.parametrize("ts_kind", ["scalar", "per_sample"])
def test_grad_wrt_broadcast_ts(ts_kind):
    """d/d ts for scalar and [B] ts equals the summed per-step derivative (float64 finite differences)."""
    params, xs, ts, h0 = _setup("default", 1, 2, 4, 3, 4, 5, seed=14, ts_kind=ts_kind)
    C = np.random.default_rng(15).standard_normal((2, 4, 4))
    g = jax.grad(lambda t: jnp.sum(cfc_scan(params, jnp.asarray(xs), t, jnp.asarray(h0)) * C.astype(np.float32)))(
        jnp.asarray(ts))
    assert g.shape == np.shape(ts)
    fd = central_diff_grad(lambda t: float(np.sum(np_cfc_scan(params, xs, t, h0) * C)), np.asarray(ts, np.float64))
    np.testing.assert_allclose(np.asarray(g), fd, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("L", LAYERS)
@pytest.mark.parametrize("mode", MODES)
def test_check_grads(mode, L):
    """jax.test_util.check_grads (reverse mode, float32 numerical JVP along random directions)."""
    params, xs, ts, h0 = _setup(mode, L, 2, 3, 3, 4, 5, seed=16)
    ts = ts + 0.5  # stay well away from 0 when check_grads perturbs ts by eps
    f = jax.jit(lambda p, x, t, h: cfc_scan(p, x, t, h, mode=mode))
    check_grads(f, (params, jnp.asarray(xs), jnp.asarray(ts), jnp.asarray(h0)), order=1, modes=["rev"],
                eps=1e-2, atol=2e-2, rtol=2e-2)
    g = jax.jit(lambda p, h, x, t: cfc_cell(p, h, x, t, mode=mode))
    check_grads(g, (params, jnp.asarray(h0), jnp.asarray(xs[:, 0]), jnp.asarray(ts[:, 0])), order=1,
                modes=["rev"], eps=1e-2, atol=2e-2, rtol=2e-2)


# ----------------------------------------------------------------------------------------------
# Errors.
def _bad_call_cases():
    B, T, I, H = 3, 6, 5, 7
    xs = np.zeros((B, T, I), np.float32)
    h0 = np.zeros((B, H), np.float32)
    return [
        # (id, kwargs overriding (xs, ts, h0, mode), exception, text in message)
        ("xs_rank2", dict(xs=xs[:, 0]), ValueError, "xs"),
        ("xs_rank4", dict(xs=xs[None]), ValueError, "xs"),
        ("xs_float64", dict(xs=xs.astype(np.float64)), TypeError, "xs"),
        ("xs_bfloat16", dict(xs=jnp.asarray(xs, jnp.bfloat16)), TypeError, "xs"),
        ("xs_int32", dict(xs=xs.astype(np.int32)), TypeError, "xs"),
        ("xs_list", dict(xs=xs.tolist()), TypeError, "xs"),
        ("h0_wide", dict(h0=np.zeros((B, H + 1), np.float32)), ValueError, "h0"),
        ("h0_batch", dict(h0=np.zeros((B + 1, H), np.float32)), ValueError, "h0"),
        ("h0_rank1", dict(h0=np.zeros((H,), np.float32)), ValueError, "h0"),
        ("h0_float64", dict(h0=h0.astype(np.float64)), TypeError, "h0"),
        ("ts_T", dict(ts=np.ones((T,), np.float32)), ValueError, "ts"),
        ("ts_BT1", dict(ts=np.ones((B, T + 1), np.float32)), ValueError, "ts"),
        ("ts_rank3", dict(ts=np.ones((B, T, 1), np.float32)), ValueError, "ts"),
        ("ts_int", dict(ts=np.ones((B,), np.int32)), TypeError, "ts"),
        ("ts_str", dict(ts="1.0"), TypeError, "ts"),
        ("mode_unknown", dict(mode="lstm"), ValueError, "mode"),
        # the params are fine: the error names xs and the width the params were made for
        ("xs_width", dict(xs=np.zeros((B, T, I + 1), np.float32)), ValueError,
         r"xs must have last dimension I = 5 \(the input_size of params\), got I = 6"),
    ]


@pytest.mark.parametrize("case", _bad_call_cases(), ids=lambda c: c[0])
def test_scan_bad_arguments(case):
    _, override, exc, text = case
    params = cfc_init(jax.random.key(0), 5, 7, backbone_units=9)
    kw = dict(xs=np.zeros((3, 6, 5), np.float32), ts=1.0, h0=np.zeros((3, 7), np.float32), mode="default")
    kw.update(override)
    with pytest.raises(exc, match=text):
        cfc_scan(params, kw["xs"], kw["ts"], kw["h0"], mode=kw["mode"])


@pytest.mark.parametrize("L", LAYERS)
def test_params_mode_mismatch(L):
    xs = jnp.zeros((2, 3, 5))
    for init_mode, call_mode in [("default", "pure"), ("pure", "default"), ("pure", "no_gate"),
                                 ("no_gate", "pure")]:
        for H in (7, 8):  # H % 4 != 0 and == 0 (pure heads_w [K, H] could be misread as 4 * (H/4))
            params = cfc_init(jax.random.key(0), 5, H, backbone_units=9, backbone_layers=L, mode=init_mode)
            with pytest.raises(ValueError, match="params"):
                cfc_scan(params, xs, mode=call_mode)
            with pytest.raises(ValueError, match="params"):
                cfc_cell(params, jnp.zeros((2, H)), xs[:, 0], mode=call_mode)


@pytest.mark.parametrize("L", LAYERS)
def test_default_params_in_mode_pure_name_the_missing_pure_parameters(L):
    """Params of mode "default"/"no_gate" called with mode "pure": the error names the missing w_tau (it described
    the shapes pure params of hidden width 4 H would have, e.g. "params['backbone'][0]['w'] must have shape
    [I + 4H, ?]")."""
    xs = jnp.zeros((2, 3, 5))
    for init_mode in ("default", "no_gate"):
        params = cfc_init(jax.random.key(0), 5, 7, backbone_units=9, backbone_layers=L, mode=init_mode)
        with pytest.raises(ValueError, match=r"^mode 'pure' needs params\['w_tau'\]"):
            cfc_scan(params, xs, mode="pure")
        with pytest.raises(ValueError, match=r"^mode 'pure' needs params\['w_tau'\]"):
            cfc_cell(params, jnp.zeros((2, 7)), xs[:, 0], mode="pure")
    params = cfc_init(jax.random.key(0), 5, 7, backbone_units=9, backbone_layers=L, mode="pure")
    del params["A"]
    with pytest.raises(ValueError, match=r"^mode 'pure' needs params\['A'\]"):
        cfc_scan(params, xs, mode="pure")


@pytest.mark.parametrize("L", LAYERS)
@pytest.mark.parametrize("mode", MODES)
def test_input_width_error_names_the_input(L, mode):
    params = cfc_init(jax.random.key(0), 5, 8, backbone_units=9, backbone_layers=L, mode=mode)
    with pytest.raises(ValueError, match=r"^xs must have last dimension I = 5 \(the input_size of params\), got I = 6"):
        cfc_scan(params, jnp.zeros((2, 3, 6)), mode=mode)
    with pytest.raises(ValueError, match=r"^x must have last dimension I = 5 \(the input_size of params\), got I = 4"):
        cfc_cell(params, jnp.zeros((2, 8)), jnp.zeros((2, 4)), mode=mode)
    assert cfc_cell(params, jnp.zeros((2, 8)), jnp.zeros((2, 5)), mode=mode).shape == (2, 8)


def test_bad_params():
    params = cfc_init(jax.random.key(0), 5, 7, backbone_units=9, mode="pure")
    xs = jnp.zeros((2, 3, 5))
    with pytest.raises(ValueError, match="params"):
        cfc_scan({k: v for k, v in params.items() if k != "w_tau"}, xs, mode="pure")
    with pytest.raises(ValueError, match="params"):
        cfc_scan({k: v for k, v in params.items() if k != "heads_w"}, xs, mode="pure")
    with pytest.raises(ValueError, match="params"):
        cfc_scan([params], xs, mode="pure")
    # the message gives what was passed: a Mapping that is not a dict (flax FrozenDict, nnx.State) has the keys
    import types

    with pytest.raises(ValueError, match=r"^params must be the dict returned by cfc_init .*, got mappingproxy$"):
        cfc_scan(types.MappingProxyType(params), xs, mode="pure")
    with pytest.raises(ValueError, match=r"^params must be .*, got \['A', 'backbone', 'heads_b', 'w_tau'\]$"):
        cfc_scan({k: v for k, v in params.items() if k != "heads_w"}, xs, mode="pure")
    with pytest.raises(ValueError, match=r"params\['A'\]"):
        cfc_scan({**params, "A": params["A"][:-1]}, xs, mode="pure")
    with pytest.raises(TypeError, match=r"params\['heads_w'\]"):
        cfc_scan({**params, "heads_w": np.asarray(params["heads_w"], np.float64)}, xs, mode="pure")
    with pytest.raises(ValueError, match=r"params\['backbone'\]\[0\]\['b'\]"):
        bad = [{"w": params["backbone"][0]["w"], "b": params["backbone"][0]["b"][:-1]}]
        cfc_scan({**params, "backbone": bad}, xs, mode="pure")


def test_cell_bad_arguments():
    params = cfc_init(jax.random.key(0), 5, 7, backbone_units=9)
    h, x = jnp.zeros((3, 7)), jnp.zeros((3, 5))
    with pytest.raises(ValueError, match="x"):
        cfc_cell(params, h, x[:, None, :])
    with pytest.raises(ValueError, match="h"):
        cfc_cell(params, h[0], x)
    with pytest.raises(ValueError, match="h"):
        cfc_cell(params, jnp.zeros((4, 7)), x)
    with pytest.raises(ValueError, match="h"):
        cfc_cell(params, jnp.zeros((3, 8)), x)
    with pytest.raises(TypeError, match="h"):
        cfc_cell(params, np.zeros((3, 7)), x)
    with pytest.raises(ValueError, match="ts"):
        cfc_cell(params, h, x, jnp.ones((3, 1)))
    with pytest.raises(ValueError, match="ts"):
        cfc_cell(params, h, x, jnp.ones((4,)))
    with pytest.raises(ValueError, match="mode"):
        cfc_cell(params, h, x, mode="gru")


def test_cell_errors_name_h_and_x():
    """cfc_cell's errors name its own arguments h and x (not cfc_scan's h0 and xs), and a non-array is a
    TypeError as in cfc_scan."""
    params = cfc_init(jax.random.key(0), 5, 7, backbone_units=9)
    h, x = jnp.zeros((3, 7)), jnp.zeros((3, 5))
    with pytest.raises(ValueError, match=r"^h must have shape \[3, 7\], got \(3, 8\)"):
        cfc_cell(params, jnp.zeros((3, 8)), x)
    with pytest.raises(TypeError, match="^x must be float32, got float64"):
        cfc_cell(params, h, np.zeros((3, 5)))
    with pytest.raises(TypeError, match="^x must be float32, got int32"):
        cfc_cell(params, h, np.zeros((3, 5), np.int32))
    with pytest.raises(TypeError, match="^x must be an array, got list"):
        cfc_cell(params, h, np.zeros((3, 5), np.float32).tolist())
    with pytest.raises(TypeError, match="^h must be an array, got NoneType"):
        cfc_cell(params, None, x)


def test_malformed_backbone_names_params():
    """A params dict without 'backbone', or whose backbone is not a list of {'w', 'b'} dicts, raises a ValueError
    naming params['backbone'] (it gave KeyError/TypeError from inside, or blamed xs's width)."""
    p = cfc_init(jax.random.key(0), 5, 7, backbone_units=9)
    p0 = cfc_init(jax.random.key(0), 5, 7, backbone_layers=0)
    w, b = p["backbone"][0]["w"], p["backbone"][0]["b"]
    xs = jnp.zeros((2, 3, 5))
    for bad in ({k: v for k, v in p.items() if k != "backbone"}, {k: v for k, v in p0.items() if k != "backbone"},
                {**p, "backbone": [{"w": w}]}, {**p, "backbone": {"w": w, "b": b}}, {**p, "backbone": None},
                {**p, "backbone": [w]}):
        with pytest.raises(ValueError, match=r"^params.*'backbone'"):
            cfc_scan(bad, xs)
        with pytest.raises(ValueError, match=r"^params.*'backbone'"):
            cfc_cell(bad, jnp.zeros((2, 7)), xs[:, 0])
    assert cfc_scan({**p, "backbone": (p["backbone"][0],)}, xs).shape == (2, 3, 7)  # a tuple is fine


@pytest.mark.parametrize("name,value", [
    ("input_size", 0), ("input_size", -3), ("input_size", 2.5), ("input_size", True), ("input_size", "4"),
    ("input_size", None), ("hidden_size", 0), ("hidden_size", 3.0), ("backbone_units", 0),
    ("backbone_layers", -1), ("backbone_layers", 1.0), ("mode", "lstm"), ("mode", None),
])
def test_init_bad_arguments(name, value):
    kw = dict(input_size=3, hidden_size=4, backbone_units=5, backbone_layers=1, mode="default")
    kw[name] = value
    with pytest.raises(ValueError, match=name):
        cfc_init(jax.random.key(0), kw.pop("input_size"), kw.pop("hidden_size"), **kw)


# ----------------------------------------------------------------------------------------------
# cfc_init.
@pytest.mark.parametrize("L", [0, 1, 2, 3])
@pytest.mark.parametrize("mode", MODES)
def test_init_shapes(mode, L):
    I, H, U = 6, 10, 12
    p = cfc_init(jax.random.key(1), I, H, backbone_units=U, backbone_layers=L, mode=mode)
    want_keys = {"backbone", "heads_w", "heads_b"} | ({"w_tau", "A"} if mode == "pure" else set())
    assert set(p) == want_keys
    assert isinstance(p["backbone"], list) and len(p["backbone"]) == L
    fan_in = I + H
    for layer in p["backbone"]:
        assert set(layer) == {"w", "b"}
        assert layer["w"].shape == (fan_in, U) and layer["b"].shape == (U,)
        fan_in = U
    nh = 1 if mode == "pure" else 4
    assert p["heads_w"].shape == ((U if L else I + H), nh * H)
    assert p["heads_b"].shape == (nh * H,)
    if mode == "pure":
        assert p["w_tau"].shape == (H,) and p["A"].shape == (H,)
    for leaf in jax.tree.leaves(p):
        assert leaf.dtype == jnp.float32
    # numpy ints are sizes too; the result runs
    q = cfc_init(jax.random.key(1), np.int64(I), np.int32(H), backbone_units=U, backbone_layers=L, mode=mode)
    assert jax.tree.all(jax.tree.map(lambda a, b: bool(jnp.array_equal(a, b)), p, q))
    assert cfc_scan(p, jnp.ones((2, 3, I)), mode=mode).shape == (2, 3, H)


def test_init_keys():
    a = cfc_init(jax.random.key(0), 4, 6)
    b = cfc_init(jax.random.key(0), 4, 6)
    c = cfc_init(jax.random.key(1), 4, 6)
    for x, y, z in zip(jax.tree.leaves(a), jax.tree.leaves(b), jax.tree.leaves(c)):
        np.testing.assert_array_equal(x, y)
        assert not np.array_equal(x, z)
    # the four head blocks are drawn independently
    w = np.asarray(a["heads_w"]).reshape(128, 4, 6)
    for i in range(4):
        for j in range(i):
            assert not np.allclose(w[:, i], w[:, j])


@pytest.mark.parametrize("L", [0, 1, 2])
@pytest.mark.parametrize("mode", MODES)
def test_init_xavier_bounds(mode, L):
    """xavier-uniform weights (each head block its own bound), nn.Linear-style biases."""
    I, H, U = 20, 30, 40
    p = cfc_init(jax.random.key(2), I, H, backbone_units=U, backbone_layers=L, mode=mode)

    def check_uniform(x, bound, name):
        x = np.asarray(x, np.float64).ravel()
        assert np.abs(x).max() <= bound * (1 + 1e-6), name
        if x.size >= 30:
            assert np.abs(x).max() >= 0.8 * bound, name
        if x.size >= 300:  # U(-a, a): mean 0, std a / sqrt(3)
            assert abs(x.mean()) < 0.1 * bound, name
            assert abs(x.std() / (bound / math.sqrt(3)) - 1) < 0.1, name

    fan_in = I + H
    for l, layer in enumerate(p["backbone"]):
        check_uniform(layer["w"], math.sqrt(6 / (fan_in + U)), f"backbone[{l}].w")
        check_uniform(layer["b"], 1 / math.sqrt(fan_in), f"backbone[{l}].b")
        fan_in = U
    nh = 1 if mode == "pure" else 4
    for k in range(nh):
        check_uniform(p["heads_w"][:, k * H:(k + 1) * H], math.sqrt(6 / (fan_in + H)), f"heads_w[{k}]")
        check_uniform(p["heads_b"][k * H:(k + 1) * H], 1 / math.sqrt(fan_in), f"heads_b[{k}]")
    if mode == "pure":
        check_uniform(p["w_tau"], math.sqrt(6 / (1 + H)), "w_tau")
        check_uniform(p["A"], math.sqrt(6 / (1 + H)), "A")


# ----------------------------------------------------------------------------------------------
# Composition: jit, vmap, grad, lax.scan, shard_map.
@pytest.mark.parametrize("mode", MODES)
def test_jit_equals_eager(mode):
    params, xs, ts, h0 = _setup(mode, 2, seed=20)
    args = (params, jnp.asarray(xs), jnp.asarray(ts), jnp.asarray(h0))
    eager = cfc_scan(*args, mode=mode)
    jitted = jax.jit(cfc_scan, static_argnames="mode")(*args, mode=mode)
    np.testing.assert_allclose(np.asarray(jitted), np.asarray(eager), rtol=1e-6, atol=1e-6)
    loss = lambda p, x, t, h: jnp.sum(jnp.sin(cfc_scan(p, x, t, h, mode=mode)))  # noqa: E731
    ge = jax.grad(loss, argnums=(0, 1, 2, 3))(*args)
    gj = jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3)))(*args)
    assert rel_err(gj, ge) <= 1e-5


def _stack(trees):
    return jax.tree.map(lambda *a: jnp.stack(a), *trees)


@pytest.mark.parametrize("mode", MODES)
def test_vmap_over_ensemble(mode):
    E = 3
    plist, xlist, tlist, hlist = zip(*[_setup(mode, 1, seed=30 + e) for e in range(E)])
    params, xs, ts, h0 = _stack(plist), jnp.stack(xlist), jnp.stack(tlist), jnp.stack(hlist)
    f = jax.jit(lambda p, x, t, h: cfc_scan(p, x, t, h, mode=mode))
    got = jax.vmap(f)(params, xs, ts, h0)
    assert got.shape == (E, 3, 6, 7)
    for e in range(E):
        loop = f(plist[e], jnp.asarray(xlist[e]), jnp.asarray(tlist[e]), jnp.asarray(hlist[e]))
        np.testing.assert_allclose(np.asarray(got[e]), np.asarray(loop), rtol=1e-6, atol=1e-6)
        want = np_cfc_scan(plist[e], xlist[e], tlist[e], hlist[e], mode)
        np.testing.assert_allclose(np.asarray(got[e]), want, rtol=1e-5, atol=1e-5)
    # shared xs and scalar ts, ensemble of params only
    got = jax.vmap(lambda p: cfc_scan(p, xs[0], 0.5, mode=mode))(params)
    for e in range(E):
        np.testing.assert_allclose(np.asarray(got[e]), np_cfc_scan(plist[e], xlist[0], 0.5, None, mode),
                                   rtol=1e-5, atol=1e-5)
    # per-member gradients
    loss = lambda p, x, t, h: jnp.sum(f(p, x, t, h) ** 2)  # noqa: E731
    grad = jax.grad(loss, argnums=(0, 1, 2, 3))
    g = jax.jit(jax.vmap(grad))(params, xs, ts, h0)
    grad = jax.jit(grad)
    for e in range(E):
        ge = grad(plist[e], xs[e], ts[e], h0[e])
        assert rel_err(jax.tree.map(lambda a: a[e], g), ge) <= 1e-5


@pytest.mark.parametrize("mode", MODES)
def test_cell_in_lax_scan_equals_scan(mode):
    params, xs, ts, h0 = _setup(mode, 1, seed=40)

    def step(h, inp):
        x, t = inp
        h = cfc_cell(params, h, x, t, mode=mode)
        return h, h

    _, hs = jax.lax.scan(step, jnp.asarray(h0), (jnp.swapaxes(xs, 0, 1), jnp.swapaxes(ts, 0, 1)))
    want = _scan(params, xs, ts, h0, mode=mode)
    np.testing.assert_allclose(np.asarray(jnp.swapaxes(hs, 0, 1)), np.asarray(want), rtol=1e-6, atol=1e-6)


def test_training_step_reduces_loss():
    """grad of a loss over the scan drives plain gradient descent downhill (small regression task)."""
    params, xs, ts, h0 = _setup("default", 1, B=8, T=5, seed=41)
    y = jnp.asarray(np.cumsum(xs[..., 0], axis=1)[:, -1:] / 3.0)
    head = jnp.zeros((7, 1))

    def loss(ph):
        p, w = ph
        return jnp.mean((cfc_scan(p, jnp.asarray(xs), 1.0)[:, -1] @ w - y) ** 2)

    state = (params, head)
    l0 = float(loss(state))
    step = jax.jit(lambda s: jax.tree.map(lambda a, g: a - 0.05 * g, s, jax.grad(loss)(s)))
    for _ in range(30):
        state = step(state)
    assert float(loss(state)) < 0.7 * l0


def _shard_map_case(n_dev, mode="default", L=1, seed=50):
    B = 2 * n_dev
    params, xs, ts, h0 = _setup(mode, L, B=B, T=5, seed=seed)
    return params, jnp.asarray(xs), jnp.asarray(ts), jnp.asarray(h0)


@pytest.mark.parametrize("mode,n_dev", [(m, 4) for m in MODES] + [("default", 8)])
def test_shard_map_over_batch(n_dev, mode):
    assert len(jax.devices()) >= 8, "conftest.py should force 8 host devices"
    params, xs, ts, h0 = _shard_map_case(n_dev, mode)
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:n_dev]), ("batch",))

    def loss(p, x, t, h):
        return jnp.sum(jnp.tanh(cfc_scan(p, x, t, h, mode=mode)) ** 2)

    def body_explicit(p, x, t, h):
        # local gradients of a per-device copy of the params, summed over devices
        pv = jax.lax.pcast(p, "batch", to="varying")
        hs = cfc_scan(pv, x, t, h, mode=mode)
        l, (gp, gx) = jax.value_and_grad(loss, argnums=(0, 1))(pv, x, t, h)
        return hs, jax.lax.psum(l, "batch"), jax.lax.psum(gp, "batch"), gx

    def body_implicit(p, x, t, h):
        # replicated (unvarying) params: shard_map's transpose already sums their cotangents
        l, (gp, gx) = jax.value_and_grad(loss, argnums=(0, 1))(p, x, t, h)
        return cfc_scan(p, x, t, h, mode=mode), jax.lax.psum(l, "batch"), gp, gx

    specs = dict(mesh=mesh, in_specs=(P(), P("batch"), P("batch"), P("batch")),
                 out_specs=(P("batch"), P(), P(), P("batch")))
    hs1 = _scan(params, xs, ts, h0, mode=mode)
    l1, (gp1, gx1) = jax.jit(jax.value_and_grad(loss, argnums=(0, 1)))(params, xs, ts, h0)
    for body in (body_explicit, body_implicit):
        hs, l, gp, gx = jax.jit(jax.shard_map(body, **specs))(params, xs, ts, h0)
        np.testing.assert_allclose(np.asarray(hs), np.asarray(hs1), rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(float(l), float(l1), rtol=1e-5)
        assert rel_err(gp, gp1) <= 1e-5, body.__name__
        assert rel_err(gx, gx1) <= 1e-5, body.__name__
    np.testing.assert_allclose(np.asarray(hs1), np_cfc_scan(params, xs, ts, h0, mode), rtol=1e-5, atol=1e-5)


def test_shard_map_default_h0():
    """h0=None (zeros) inside shard_map: the zero state must take the batch-varying type of xs."""
    params, xs, ts, _ = _shard_map_case(4)
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:4]), ("batch",))
    f = jax.shard_map(lambda p, x, t: cfc_scan(p, x, t), mesh=mesh,
                      in_specs=(P(), P("batch"), P("batch")), out_specs=P("batch"))
    hs = jax.jit(f)(params, xs, ts)
    np.testing.assert_allclose(np.asarray(hs), np_cfc_scan(params, xs, ts, None), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("L,T", [(5, 6), (1, 0)])
def test_default_h0_follows_an_explicit_batch_sharding_on_the_reference_path(L, T):
    """h0=None with xs split over an Explicit mesh axis, on a path that runs the reference directly (5 backbone
    layers: beyond the kernels; T = 0): the zero state is split like xs's rows (a replicated one made the
    reference's concat([x, h]) a ShardingTypeError). Values and the params gradient against the float64 oracle."""
    from jax.sharding import AxisType, NamedSharding

    B, I, H, U = 8, 3, 5, 6
    params = random_cfc_params(jax.random.key(4), I, H, U, L, "default", seed=4)
    xs, ts, _ = random_inputs(B, T, I, H, seed=44, ts_kind="per_sample")
    mesh = jax.make_mesh((4,), ("batch",), axis_types=(AxisType.Explicit,), devices=jax.devices()[:4])
    with jax.set_mesh(mesh):
        xs_s, ts_s = jax.device_put((jnp.asarray(xs), jnp.asarray(ts)), NamedSharding(mesh, P("batch")))
        hs = jax.jit(lambda p, x, t: cfc_scan(p, x, t))(params, xs_s, ts_s)
        g = jax.jit(jax.grad(lambda p, x, t: jnp.sum(cfc_scan(p, x, t) ** 2)))(params, xs_s, ts_s)
    assert hs.sharding.spec[:1] == P("batch")[:1]
    want = np_cfc_scan(params, xs, ts, None, "default")
    _assert_close_f64(hs, want)
    if T:
        g1 = jax.jit(jax.grad(lambda p: jnp.sum(cfc_scan(p, jnp.asarray(xs), jnp.asarray(ts)) ** 2)))(params)
        for a, b in zip(jax.tree.leaves(g), jax.tree.leaves(g1)):
            assert rel_err(a, b) <= 2e-5


def test_inputs_too_wide_for_the_kernels_shared_memory_run_the_reference(monkeypatch):
    """ffi/cfc.cu's ChooseCluster returns InvalidArgument when even its smallest layout (weights read from global
    memory) does not fit in shared memory: its reduction and task buffers hold max(I + H, U, ...) floats per
    product, ~11 (I + H) floats at L = 1. Such widths must run the reference (as the docstring promises for sizes
    beyond the kernels), not a kernel that fails at run time; common widths still get the kernels."""
    import re

    import jaxfox._ffi
    import jaxfox.cfc as cfc_mod

    monkeypatch.setattr(jaxfox._ffi, "kernels_available", lambda: True)
    monkeypatch.setattr(cfc_mod, "_kernel_hidden_limit", lambda: 2048)

    def targets(I, H, U, L, mode="default"):
        params = cfc_init(jax.random.key(0), I, H, backbone_units=U, backbone_layers=L, mode=mode)
        xs = jnp.zeros((2, 3, I), jnp.float32)
        f = jax.jit(jax.grad(lambda p, x: jnp.sum(cfc_scan(p, x, mode=mode))))
        text = f.trace(params, xs).lower(lowering_platforms=("cuda",)).as_text()
        return sorted(set(re.findall(r"custom_call @(jaxfox_cfc_\w+)", text)))

    # smallest forward layout, floats: red + 4 (L + 1)(red + 1) + 4 (L + 1) + 2 K0 + L U with K0 = I + H and
    # red = max(256, K0, U, ...): 6008 + 8 * 6009 + 8 + 2 * 6008 + 16 = 66120 floats = 264 KB > 227 KiB
    assert 4 * (6008 + 8 * 6009 + 8 + 2 * 6008 + 16) > 227 * 1024
    assert targets(6000, 8, 16, 1) == []
    assert targets(16, 8, 2600, 4) == []       # 4 layers of 2600 units: 25 U floats > 227 KiB
    assert targets(48, 128, 128, 1) == ["jaxfox_cfc_bwd", "jaxfox_cfc_fwd"]   # the bench shape
    assert targets(5, 8, 16, 0, "pure") == ["jaxfox_cfc_bwd", "jaxfox_cfc_fwd"]


def test_lecun_tanh_values_and_bad_input():
    """lecun_tanh = 1.7159 tanh(0.666 x) (ncps), dtype kept; a list failed with "can't multiply sequence"."""
    from jaxfox.cfc import lecun_tanh

    x = np.linspace(-4, 4, 9)
    np.testing.assert_allclose(np.asarray(lecun_tanh(jnp.asarray(x, jnp.float32))), 1.7159 * np.tanh(0.666 * x),
                               rtol=1e-6)
    assert lecun_tanh(jnp.ones(3, jnp.bfloat16)).dtype == jnp.bfloat16
    assert math.isclose(float(lecun_tanh(1.0)), 1.7159 * math.tanh(0.666), rel_tol=1e-6)
    for bad in ([1.0, 2.0], "x", True, jnp.ones(2, bool)):
        with pytest.raises(TypeError, match="^x must be an array"):
            lecun_tanh(bad)


# ----------------------------------------------------------------------------------------------
# Audit findings (each test failed on the code before its fix).
@pytest.mark.parametrize("L", [0, 1])
def test_pure_w_tau_gradient_at_zero_is_the_ncps_subgradient(L):
    """Mode "pure" with some w_tau exactly 0 (ncps creates w_tau as zeros before init_weights): ncps's
    torch.abs backward and the CUDA kernel (Sign(0) = 0) give d|w|/dw = 0 there, as does the float64 central
    difference of the oracle (|eps| - |-eps| = 0); jnp.abs's JVP took 1, so the reference's w_tau gradient was
    sum A ff1 e ts at those units (nonzero) and CPU training moved a w_tau that ncps and the GPU leave at 0."""
    B, T, I, H, U = 2, 3, 3, 4, 5
    params, xs, ts, h0 = _setup("pure", L, B, T, I, H, U, seed=17)
    params["w_tau"] = params["w_tau"].at[::2].set(0.0)
    C = np.random.default_rng(18).standard_normal((B, T, H))
    want_hs = np_cfc_scan(params, xs, ts, h0, "pure")
    _assert_close_f64(cfc_scan(params, jnp.asarray(xs), jnp.asarray(ts), jnp.asarray(h0), mode="pure"), want_hs)

    def loss(p):
        hs = cfc_scan(p, jnp.asarray(xs), jnp.asarray(ts), jnp.asarray(h0), mode="pure")
        return jnp.sum(hs * C.astype(np.float32))

    fd = central_diff_grad(lambda v: float(np.sum(np_cfc_scan({**params, "w_tau": v}, xs, ts, h0, "pure") * C)),
                           np.asarray(params["w_tau"], np.float64))
    assert np.all(fd[::2] == 0.0) and np.all(np.abs(fd[1::2]) > 1e-3)  # the case is not trivial
    for g in (jax.grad(loss)(params), jax.jit(jax.grad(loss))(params)):
        np.testing.assert_allclose(np.asarray(g["w_tau"]), fd, rtol=1e-4, atol=1e-6)
    # one cell step too
    gc = jax.grad(lambda p: jnp.sum(cfc_cell(p, jnp.asarray(h0), jnp.asarray(xs[:, 0]), jnp.asarray(ts[:, 0]),
                                             mode="pure") * C[:, 0].astype(np.float32)))(params)
    fdc = central_diff_grad(
        lambda v: float(np.sum(np_cfc_cell(to_f64({**params, "w_tau": v}), h0, xs[:, 0], ts[:, 0], "pure") * C[:, 0])),
        np.asarray(params["w_tau"], np.float64))
    np.testing.assert_allclose(np.asarray(gc["w_tau"]), fdc, rtol=1e-4, atol=1e-6)


def test_init_bfloat16_dtype_error_does_not_advise_bfloat16_inputs():
    """cfc_init(dtype=bfloat16) said "cast activations, not parameters, to bfloat16" (the shared message of the
    GRN/VSN inits), but cfc_scan refuses bfloat16 xs and h0: the message must say that the CfC op is float32
    throughout, and a user following the old advice gets the TypeError naming xs."""
    for dt in (jnp.bfloat16, jnp.float16, "float64"):
        with pytest.raises(TypeError, match=r"^cfc_init: dtype must be float32") as e:
            cfc_init(jax.random.key(0), 4, 6, dtype=dt)
        assert "cast activations" not in str(e.value) and "inputs" in str(e.value)
    p = cfc_init(jax.random.key(0), 4, 6, backbone_units=8)
    with pytest.raises(TypeError, match="^xs must be float32, got bfloat16"):
        cfc_scan(p, jnp.zeros((2, 3, 4), jnp.bfloat16))


def test_nn_cfc_bad_rngs_is_a_type_error_naming_rngs():
    """jaxfox.nn.CfC(..., rngs=None) or rngs=<int seed> raised AttributeError ("'NoneType' object has no attribute
    'params'"); now a TypeError naming rngs. The params it draws from a good nnx.Rngs are cfc_init's and run."""
    from flax import nnx

    import jaxfox.nn

    for bad in (None, 0, jax.random.key(0)):
        with pytest.raises(TypeError, match=r"^rngs must be an nnx\.Rngs"):
            jaxfox.nn.CfC(4, 6, backbone_units=8, rngs=bad)
    m = jaxfox.nn.CfC(4, 6, backbone_units=8, mode="pure", rngs=nnx.Rngs(params=5))
    want = cfc_init(nnx.Rngs(params=5).params(), 4, 6, backbone_units=8, mode="pure")
    for a, b in zip(jax.tree.leaves(m.params), jax.tree.leaves(want)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    xs = np.random.default_rng(0).standard_normal((2, 3, 4)).astype(np.float32)
    _assert_close_f64(m(jnp.asarray(xs), 0.5), np_cfc_scan(want, xs, 0.5, None, "pure"))


def test_backbone_of_unequal_widths_error_names_params_and_widths():
    """Backbone layers chained correctly but of different widths (ncps has one backbone_units) were refused with
    "all backbone layers must have the same width U", naming neither the argument nor the widths found."""
    p = cfc_init(jax.random.key(0), 5, 7, backbone_units=9, backbone_layers=2)
    bad = {**p, "backbone": [{"w": jnp.zeros((12, 10)), "b": jnp.zeros(10)},
                             {"w": jnp.zeros((10, 9)), "b": jnp.zeros(9)}]}
    msg = r"^params\['backbone'\] layers must all have the same width U, got widths \[10, 9\]"
    with pytest.raises(ValueError, match=msg):
        cfc_scan(bad, jnp.zeros((2, 3, 5)))
    with pytest.raises(ValueError, match=msg):
        cfc_cell(bad, jnp.zeros((2, 7)), jnp.zeros((2, 5)))
