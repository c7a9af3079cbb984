"""CPU tests of the IQN quantile head (jaxfox/iqn.py): ``iqn_head`` and ``iqn_head_init``.

* values and gradients (every parameter, psi and taus) against an independent float64 NumPy
  implementation of the module docstring's equations, with a hand-written VJP (itself checked against
  central differences), and ``jax.test_util.check_grads``;
* ``iqn_head_init``'s shapes, dtypes and scales; the argument checks (raised before anything runs);
* the CUDA kernel path (ffi/iqn.cu), traced and lowered for CUDA on this CPU machine with the kernels
  forced on: which FFI calls the program makes, with which operand / result shapes and attributes, and
  which shapes fall back to the reference.

The float64 oracle (``np_iqn_forward`` / ``np_iqn_vjp``) is also used by test_gpu_iqn.py.
"""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.test_util import check_grads

import jaxfox
import jaxfox.iqn as iqn_mod
from jaxfox import iqn_head, iqn_head_init

from conftest import assert_raises_naming, central_diff_grad, rel_err

KEYS = ("w_phi", "b_phi", "w_h", "b_h", "w_out", "b_out")
SHAPES = [(5, 8, 64, 128), (3, 1, 32, 64), (2, 70, 16, 48), (7, 3, 5, 9)]  # B, N, K, H
# float32 vs float64: the cosine argument pi tau k (up to ~200 at K = 64) is rounded to float32, an
# absolute error up to ~1e-5 in each feature; measured max|err| / max|z| <= 6e-6 at K = 64.
FWD_TOL = 2e-5
GRAD_TOL = 5e-5   # norm-wise, per leaf (rel_err)


# ----------------------------------------------------------------------------------------------
# Float64 NumPy oracle, written from the equations of jaxfox/iqn.py's module docstring:
#   e[b, i, k] = cos(pi tau[b, i] k), k = 0..K-1;  phi = ReLU(e W_phi + b_phi);  m = psi (.) phi;
#   h = ReLU(m W_h + b_h);  z = h . w_out[:, 0] + b_out[0].
def _f64(params, psi, taus):
    p = {k: np.asarray(params[k], np.float64) for k in KEYS}
    return p, np.asarray(psi, np.float64), np.asarray(taus, np.float64)


def _np_forward_all(p, psi, taus):
    K = p["w_phi"].shape[0]
    k = np.arange(K, dtype=np.float64)
    arg = np.pi * taus[..., None] * k                      # [B, N, K]
    e = np.cos(arg)
    a1 = e @ p["w_phi"] + p["b_phi"]                       # [B, N, H]
    phi = np.maximum(a1, 0.0)
    m = psi[:, None, :] * phi
    a2 = m @ p["w_h"] + p["b_h"]
    h = np.maximum(a2, 0.0)
    z = h @ p["w_out"][:, 0] + p["b_out"][0]               # [B, N]
    return z, dict(k=k, arg=arg, e=e, a1=a1, phi=phi, m=m, a2=a2, h=h)


def np_iqn_forward(params, psi, taus):
    """z [B, N] float64 from params (iqn_head_init layout), psi [B, H], taus [B, N]."""
    return _np_forward_all(*_f64(params, psi, taus))[0]


def np_iqn_vjp(params, psi, taus, dz):
    """The VJP of z w.r.t. (params, psi, taus) at cotangent dz [B, N], float64, by the chain rule
    (ReLU derivative 1 where the pre-activation is > 0, else 0). Returns (dparams dict, dpsi, dtaus)."""
    p, psi, taus = _f64(params, psi, taus)
    dz = np.asarray(dz, np.float64)
    _, c = _np_forward_all(p, psi, taus)
    H = p["w_h"].shape[0]
    d = {}
    d["b_out"] = np.array([dz.sum()])
    d["w_out"] = np.einsum("bih,bi->h", c["h"], dz)[:, None]
    dh = dz[..., None] * p["w_out"][:, 0]                  # [B, N, H]
    da2 = dh * (c["a2"] > 0)
    d["w_h"] = c["m"].reshape(-1, H).T @ da2.reshape(-1, H)
    d["b_h"] = da2.sum(axis=(0, 1))
    dm = da2 @ p["w_h"].T
    dpsi = (dm * c["phi"]).sum(axis=1)                     # [B, H]
    da1 = dm * psi[:, None, :] * (c["a1"] > 0)
    K = p["w_phi"].shape[0]
    d["w_phi"] = c["e"].reshape(-1, K).T @ da1.reshape(-1, H)
    d["b_phi"] = da1.sum(axis=(0, 1))
    de = da1 @ p["w_phi"].T                                # [B, N, K]
    dtaus = (de * -np.sin(c["arg"]) * np.pi * c["k"]).sum(axis=-1)
    return d, dpsi, dtaus


def np_iqn_loss(params, psi, taus, y, kappa):
    """The quantile Huber loss of z = iqn_head(params, psi, taus) against targets y [B, N'], float64, written from
    IQN eq. (3) / (10): loss = (1 / B) sum_b sum_i (1 / N') sum_j |tau_i - 1{d < 0}| L_kappa(d) / kappa with
    d = y_j - z_i. Returns (loss, d loss / d z [B, N], d loss / d y [B, N'], the indicator term's d loss / d tau)."""
    return np_quantile_huber_at(np_iqn_forward(params, psi, taus), taus, y, kappa)


def np_quantile_huber_at(z, taus, y, kappa):
    """np_iqn_loss's loss and derivatives at given quantile values z [B, N] (float64)."""
    z = np.asarray(z, np.float64)
    t, y = np.asarray(taus, np.float64), np.asarray(y, np.float64)
    B, Nt = y.shape
    d = y[:, None, :] - z[:, :, None]                                  # [B, N, N']
    w = np.abs(t[:, :, None] - (d < 0))
    ad = np.abs(d)
    hub = np.where(ad <= kappa, 0.5 * d * d, kappa * (ad - 0.5 * kappa))
    dhub = np.where(ad <= kappa, d, kappa * np.sign(d))                 # L_kappa'(d)
    scale = 1.0 / (B * Nt * kappa)
    loss = float((w * hub).sum() * scale)
    dz = -(w * dhub).sum(axis=2) * scale
    dy = (w * dhub).sum(axis=1) * scale
    dtau_ind = (np.sign(t[:, :, None] - (d < 0)) * hub).sum(axis=2) * scale
    return loss, dz, dy, dtau_ind


# ----------------------------------------------------------------------------------------------
# Inputs.
def make_params(K, H, seed=0, scale=0.1):
    """iqn_head_init params plus a random perturbation of every leaf (so no bias is trivially zero)."""
    p = iqn_head_init(jax.random.key(seed), H, n_cos=K)
    rng = np.random.default_rng(seed + 1000)
    return {k: p[k] + jnp.asarray(scale * rng.standard_normal(p[k].shape), jnp.float32) for k in KEYS}


def make_inputs(B, N, H, seed=0):
    """psi [B, H] (a ReLU output: about half exact zeros), taus [B, N] in [0, 1), dz [B, N]; float32."""
    rng = np.random.default_rng(seed + 2000)
    psi = jnp.asarray(np.maximum(rng.standard_normal((B, H)), 0.0), jnp.float32)
    taus = jnp.asarray(rng.uniform(size=(B, N)), jnp.float32)
    dz = jnp.asarray(rng.standard_normal((B, N)), jnp.float32)
    return psi, taus, dz


def _max_rel(got, want):
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    assert got.shape == want.shape, (got.shape, want.shape)
    return float(np.abs(got - want).max() / max(np.abs(want).max(), 1e-30))


def _vjp(params, psi, taus, dz):
    z, vjp = jax.vjp(iqn_head, params, psi, taus)
    return z, vjp(dz)


# ----------------------------------------------------------------------------------------------
# The oracle itself.
def test_oracle_vjp_matches_central_differences():
    B, N, K, H = 2, 3, 4, 6
    params = {k: np.asarray(v, np.float64) for k, v in make_params(K, H, seed=3, scale=0.3).items()}
    psi, taus, dz = (np.asarray(x, np.float64) for x in make_inputs(B, N, H, seed=3))
    psi = psi + 0.1  # keep clear of ReLU kinks in psi's products (psi itself has no kink here)
    dp, dpsi, dtaus = np_iqn_vjp(params, psi, taus, dz)

    def scalar(p, s, t):
        return float(np.sum(np_iqn_forward(p, s, t) * dz))

    for k in KEYS:
        fd = central_diff_grad(lambda x: scalar({**params, k: x}, psi, taus), params[k])
        np.testing.assert_allclose(dp[k], fd, rtol=1e-6, atol=1e-8, err_msg=k)
    np.testing.assert_allclose(dpsi, central_diff_grad(lambda x: scalar(params, x, taus), psi), rtol=1e-6, atol=1e-8)
    np.testing.assert_allclose(dtaus, central_diff_grad(lambda x: scalar(params, psi, x), taus), rtol=1e-6, atol=1e-8)


def test_oracle_known_values():
    """A hand-computable case: K = 2, H = 1, identity-like weights."""
    params = {"w_phi": np.array([[0.5], [2.0]]), "b_phi": np.array([0.25]), "w_h": np.array([[3.0]]),
              "b_h": np.array([-1.0]), "w_out": np.array([[2.0]]), "b_out": np.array([0.5])}
    psi = np.array([[2.0]])
    taus = np.array([[0.0, 0.5, 1.0]])
    # e = [1, cos(pi tau)] -> a1 = 0.75 + 2 cos(pi tau) = [2.75, 0.75, -1.25]; phi = [2.75, 0.75, 0]
    # m = 2 phi; a2 = 3 m - 1 = [15.5, 3.5, -1]; h = [15.5, 3.5, 0]; z = 2 h + 0.5
    np.testing.assert_allclose(np_iqn_forward(params, psi, taus), [[31.5, 7.5, 0.5]], rtol=1e-12)
    z = iqn_head({k: jnp.asarray(v, jnp.float32) for k, v in params.items()}, jnp.asarray(psi, jnp.float32),
                 jnp.asarray(taus, jnp.float32))
    np.testing.assert_allclose(np.asarray(z), [[31.5, 7.5, 0.5]], rtol=1e-6, atol=1e-5)


# ----------------------------------------------------------------------------------------------
# Values and gradients.
@pytest.mark.parametrize("B,N,K,H", SHAPES)
def test_forward_matches_oracle(B, N, K, H):
    params = make_params(K, H, seed=B + N)
    psi, taus, _ = make_inputs(B, N, H, seed=B * N)
    z = iqn_head(params, psi, taus)
    assert z.shape == (B, N) and z.dtype == jnp.float32
    assert _max_rel(z, np_iqn_forward(params, psi, taus)) <= FWD_TOL
    zj = jax.jit(iqn_head)(params, psi, taus)
    assert _max_rel(zj, np_iqn_forward(params, psi, taus)) <= FWD_TOL


@pytest.mark.parametrize("B,N,K,H", SHAPES)
def test_gradients_match_oracle(B, N, K, H):
    params = make_params(K, H, seed=B + N + 1)
    psi, taus, dz = make_inputs(B, N, H, seed=B * N + 1)
    z, (dp, dpsi, dtaus) = jax.jit(_vjp)(params, psi, taus, dz)
    wp, wpsi, wtaus = np_iqn_vjp(params, psi, taus, dz)
    assert _max_rel(z, np_iqn_forward(params, psi, taus)) <= FWD_TOL
    for k in KEYS:
        assert dp[k].shape == params[k].shape and dp[k].dtype == jnp.float32
        assert rel_err(dp[k], wp[k]) <= GRAD_TOL, (k, rel_err(dp[k], wp[k]))
    assert rel_err(dpsi, wpsi) <= GRAD_TOL, rel_err(dpsi, wpsi)
    assert rel_err(dtaus, wtaus) <= GRAD_TOL, rel_err(dtaus, wtaus)


def test_grad_of_scalar_loss_wrt_params_only():
    """jax.grad of a loss (the usual use: taus sampled, not differentiated) equals the oracle's VJP."""
    B, N, K, H = 6, 16, 64, 128
    params = make_params(K, H, seed=11)
    psi, taus, dz = make_inputs(B, N, H, seed=11)
    g = jax.jit(jax.grad(lambda p: jnp.sum(iqn_head(p, psi, taus) * dz)))(params)
    wp, _, _ = np_iqn_vjp(params, psi, taus, dz)
    for k in KEYS:
        assert rel_err(g[k], wp[k]) <= GRAD_TOL, k


def test_check_grads():
    """Numerical vs autodiff JVPs and VJPs (float32, eps = 1e-4), at a point whose pre-activations are all
    >= 0.04 away from the ReLU kinks (seed chosen for that; asserted), so the differences cross none."""
    B, N, K, H = 2, 3, 8, 16
    params = make_params(K, H, seed=13, scale=0.3)
    psi, taus, _ = make_inputs(B, N, H, seed=13)
    psi = psi + 0.2
    _, c = _np_forward_all(*_f64(params, psi, taus))
    assert np.abs(c["a1"]).min() > 0.04 and np.abs(c["a2"]).min() > 0.03
    check_grads(iqn_head, (params, psi, taus), order=1, modes=("fwd", "rev"), atol=1e-2, rtol=1e-2, eps=1e-4)


def test_relu_derivative_is_zero_at_zero():
    """Units whose pre-activation is exactly 0 (zero weight column and bias) pass no gradient."""
    B, N, K, H = 4, 8, 32, 64
    params = make_params(K, H, seed=13)
    j1, j2 = 5, 17
    params["w_phi"] = params["w_phi"].at[:, j1].set(0.0)
    params["b_phi"] = params["b_phi"].at[j1].set(0.0)
    params["w_h"] = params["w_h"].at[:, j2].set(0.0)
    params["b_h"] = params["b_h"].at[j2].set(0.0)
    psi, taus, dz = make_inputs(B, N, H, seed=13)
    _, (dp, dpsi, dtaus) = _vjp(params, psi, taus, dz)
    wp, wpsi, wtaus = np_iqn_vjp(params, psi, taus, dz)
    assert np.all(np.asarray(dp["w_phi"])[:, j1] == 0.0) and float(dp["b_phi"][j1]) == 0.0
    assert np.all(np.asarray(dp["w_h"])[:, j2] == 0.0) and float(dp["b_h"][j2]) == 0.0
    assert float(dp["w_out"][j2, 0]) == 0.0
    assert np.all(np.asarray(dpsi)[:, j1] == 0.0)  # phi[..., j1] = 0
    assert np.all(wp["w_phi"][:, j1] == 0.0) and wp["b_phi"][j1] == 0.0  # the oracle agrees
    for k in KEYS:
        assert rel_err(dp[k], wp[k]) <= GRAD_TOL, k
    assert rel_err(dpsi, wpsi) <= GRAD_TOL and rel_err(dtaus, wtaus) <= GRAD_TOL


def test_vmap_matches_loop():
    V, B, N, K, H = 3, 4, 8, 32, 64
    ps = [make_params(K, H, seed=20 + v) for v in range(V)]
    ins = [make_inputs(B, N, H, seed=20 + v) for v in range(V)]
    stacked = {k: jnp.stack([p[k] for p in ps]) for k in KEYS}
    psi, taus, dz = (jnp.stack([x[i] for x in ins]) for i in range(3))
    z, (dp, dpsi, dtaus) = jax.jit(jax.vmap(_vjp))(stacked, psi, taus, dz)
    for v in range(V):
        wp, wpsi, wtaus = np_iqn_vjp(ps[v], psi[v], taus[v], dz[v])
        assert _max_rel(z[v], np_iqn_forward(ps[v], psi[v], taus[v])) <= FWD_TOL
        for k in KEYS:
            assert rel_err(dp[k][v], wp[k]) <= GRAD_TOL, (v, k)
        assert rel_err(dpsi[v], wpsi) <= GRAD_TOL and rel_err(dtaus[v], wtaus) <= GRAD_TOL


def test_empty_batch_and_no_quantiles():
    K, H = 32, 64
    params = make_params(K, H)
    z = iqn_head(params, jnp.zeros((0, H)), jnp.zeros((0, 8)))
    assert z.shape == (0, 8) and z.dtype == jnp.float32
    z = iqn_head(params, jnp.ones((3, H)), jnp.zeros((3, 0)))
    assert z.shape == (3, 0) and z.dtype == jnp.float32


# ----------------------------------------------------------------------------------------------
# iqn_head_init.
@pytest.mark.parametrize("H,K", [(128, 64), (64, 32), (9, 5)])
def test_init_shapes_dtypes_scales(H, K):
    p = iqn_head_init(jax.random.key(1), H, n_cos=K)
    want = {"w_phi": (K, H), "b_phi": (H,), "w_h": (H, H), "b_h": (H,), "w_out": (H, 1), "b_out": (1,)}
    assert set(p) == set(want)
    for k, shape in want.items():
        assert p[k].shape == shape and p[k].dtype == jnp.float32, k
    for k in ("b_phi", "b_h", "b_out"):
        assert np.all(np.asarray(p[k]) == 0.0), k
    assert all(np.isfinite(np.asarray(p[k])).all() for k in want)
    if H >= 64:  # He-normal std sqrt(2 / fan_in); w_out scaled by 0.1 (fixed key: not a flaky check)
        np.testing.assert_allclose(np.std(np.asarray(p["w_phi"])), np.sqrt(2.0 / K), rtol=0.1)
        np.testing.assert_allclose(np.std(np.asarray(p["w_h"])), np.sqrt(2.0 / H), rtol=0.1)
        np.testing.assert_allclose(np.std(np.asarray(p["w_out"])), 0.1 * np.sqrt(2.0 / H), rtol=0.3)
    assert iqn_head_init(jax.random.key(1), H, n_cos=K)["w_h"].tolist() == p["w_h"].tolist()  # deterministic
    assert not np.array_equal(iqn_head_init(jax.random.key(2), H, n_cos=K)["w_h"], p["w_h"])
    assert iqn_head_init(jax.random.key(0), H)["w_phi"].shape == (64, H)  # default n_cos = 64


@pytest.mark.parametrize("kw", [dict(hidden_size=0), dict(hidden_size=-3), dict(hidden_size=2.0),
                                dict(hidden_size=True), dict(hidden_size=8, n_cos=0),
                                dict(hidden_size=8, n_cos=1.5)])
def test_init_errors(kw):
    name = "n_cos" if "n_cos" in kw else "hidden_size"
    assert_raises_naming(lambda: iqn_head_init(jax.random.key(0), **kw), ValueError, name)


# ----------------------------------------------------------------------------------------------
# Argument checks: raised before anything runs (neither path is entered), naming the argument.
@pytest.fixture
def nothing_runs(monkeypatch):
    calls = []
    monkeypatch.setattr(iqn_mod, "_reference", lambda *a: calls.append("reference"))
    monkeypatch.setattr(iqn_mod, "dispatch", lambda *a, **k: calls.append("dispatch"))
    return calls


def _good(B=3, N=4, K=8, H=16):
    params = make_params(K, H)
    psi, taus, _ = make_inputs(B, N, H)
    return params, psi, taus


def _with(params, key, value):
    out = dict(params)
    out[key] = value
    return out


def _without(params, key):
    return {k: v for k, v in params.items() if k != key}


_P = _good()[0]
PARAM_ERRORS = [  # (params, exception, words in the message)
    (_without(_P, "w_out"), ValueError, ["params", "w_out"]),
    (_without(_P, "b_phi"), ValueError, ["params", "b_phi"]),
    (_with(_P, "w_s", jnp.zeros((4, 16))), ValueError, ["params", "w_s"]),
    ((_P["w_phi"], _P["b_phi"]), ValueError, ["params", "tuple"]),
    ([_P[k] for k in KEYS], ValueError, ["params", "list"]),
    (_with(_P, "w_phi", jnp.zeros((16,))), ValueError, ["params['w_phi']", "(16,)"]),
    (_with(_P, "w_phi", jnp.zeros((8, 16, 1))), ValueError, ["params['w_phi']"]),
    (_with(_P, "w_phi", jnp.zeros((0, 16))), ValueError, ["params['w_phi']"]),
    (_with(_P, "b_phi", jnp.zeros((17,))), ValueError, ["params['b_phi']", "[16]", "(17,)"]),
    (_with(_P, "w_h", jnp.zeros((16, 15))), ValueError, ["params['w_h']", "[16, 16]", "(16, 15)"]),
    (_with(_P, "b_h", jnp.zeros((1, 16))), ValueError, ["params['b_h']", "[16]"]),
    (_with(_P, "w_out", jnp.zeros((16,))), ValueError, ["params['w_out']", "[16, 1]", "(16,)"]),
    (_with(_P, "w_out", jnp.zeros((16, 2))), ValueError, ["params['w_out']", "[16, 1]", "(16, 2)"]),
    (_with(_P, "b_out", jnp.zeros(())), ValueError, ["params['b_out']", "[1]", "()"]),
    (_with(_P, "b_out", jnp.zeros((2,))), ValueError, ["params['b_out']", "[1]", "(2,)"]),
    (_with(_P, "w_phi", _P["w_phi"].astype(jnp.bfloat16)), TypeError, ["params['w_phi']", "float32", "bfloat16"]),
    (_with(_P, "w_h", _P["w_h"].astype(jnp.int32)), TypeError, ["params['w_h']", "float32", "int32"]),
    (_with(_P, "b_out", [0.0]), TypeError, ["params['b_out']", "list"]),
    # not an array: TypeError as for every other parameter (w_phi, read first for K and H, gave a ValueError)
    (_with(_P, "w_phi", [[0.0] * 16] * 8), TypeError, ["params['w_phi']", "array", "list"]),
]


@pytest.mark.parametrize("i", range(len(PARAM_ERRORS)))
def test_param_errors(i, nothing_runs):
    params, exc, words = PARAM_ERRORS[i]
    _, psi, taus = _good()
    assert_raises_naming(lambda: iqn_head(params, psi, taus), exc, *words)
    assert_raises_naming(lambda: jax.jit(iqn_head)(params, psi, taus), exc, *words)
    assert nothing_runs == []


INPUT_ERRORS = [  # (which, value, exception, words)
    ("psi", jnp.zeros((3, 15)), ValueError, ["psi", "[?, 16]", "(3, 15)"]),
    ("psi", jnp.zeros((16,)), ValueError, ["psi", "(16,)"]),
    ("psi", jnp.zeros((3, 16)).astype(jnp.bfloat16), TypeError, ["psi", "float32", "bfloat16"]),
    ("psi", jnp.zeros((3, 16), jnp.int32), TypeError, ["psi", "float32", "int32"]),
    ("psi", np.zeros((3, 16), np.float64), TypeError, ["psi", "float32", "float64"]),
    ("psi", [[0.0] * 16] * 3, TypeError, ["psi", "list"]),
    ("taus", jnp.zeros((2, 4)), ValueError, ["taus", "[3, ?]", "(2, 4)"]),
    ("taus", jnp.zeros((3,)), ValueError, ["taus", "(3,)"]),
    ("taus", jnp.zeros((3, 4, 1)), ValueError, ["taus", "(3, 4, 1)"]),
    ("taus", jnp.zeros((3, 4)).astype(jnp.bfloat16), TypeError, ["taus", "float32", "bfloat16"]),
    ("taus", jnp.zeros((3, 4), jnp.int32), TypeError, ["taus", "float32", "int32"]),
]


@pytest.mark.parametrize("i", range(len(INPUT_ERRORS)))
def test_input_errors(i, nothing_runs):
    which, value, exc, words = INPUT_ERRORS[i]
    params, psi, taus = _good()
    args = {"psi": psi, "taus": taus, which: value}
    assert_raises_naming(lambda: iqn_head(params, args["psi"], args["taus"]), exc, *words)
    assert nothing_runs == []


def test_good_inputs_reach_a_path(nothing_runs):
    """The fixture above does see a call when the arguments are fine (so the error tests can fail)."""
    iqn_head(*_good(K=32, H=64))
    assert nothing_runs == ["dispatch"]
    iqn_head(*_good(N=65, K=32, H=64))  # N > 64: no kernel, the reference directly
    assert nothing_runs == ["dispatch", "reference"]


# ----------------------------------------------------------------------------------------------
# The CUDA kernel path, lowered for CUDA on this CPU machine (kernels forced on).
FWD, BWD = "jaxfox_iqn_head_fwd", "jaxfox_iqn_head_bwd"


@pytest.fixture
def kernels_on(monkeypatch):
    import jaxfox._ffi

    monkeypatch.setattr(jaxfox._ffi, "kernels_available", lambda: True)


def _cuda_text(f, *args):
    return jax.jit(f).trace(*args).lower(lowering_platforms=("cuda",)).as_text()


def _calls(text):
    """[(target, attrs {name: int}, operand types, result types)] of every jaxfox custom call."""
    out = []
    for line in text.splitlines():
        m = re.search(r"custom_call @(jaxfox_\w+)\(.*mhlo\.backend_config = \{([^}]*)\}.*\} : \((.*)\) -> (.*)$",
                      line)
        if not m:
            continue
        attrs = {k: int(v) for k, v in re.findall(r"(\w+) = (-?\d+) : i64", m.group(2))}
        res = m.group(4).strip()
        res = res[1:-1] if res.startswith("(") else res
        out.append((m.group(1), attrs, m.group(3).split(", "), res.split(", ")))
    return out


def _padded_p(K, H):
    P = K * H + H + H * H + H + H + 1  # w_phi, b_phi, w_h, b_h, w_out, b_out
    return (P + 7) // 8 * 8


def _grid(B, N):
    per_tile = 64 // N               # whole samples per tile of at most 64 rows
    return min(-(-B // per_tile), 132)


def _loss_fn(argnums):
    def loss(params, psi, taus, dz):
        return jnp.sum(iqn_head(params, psi, taus) * dz)
    return jax.value_and_grad(loss, argnums=argnums)


@pytest.mark.parametrize("B,N,K,H", [(5, 32, 64, 128), (37, 32, 64, 128), (1000, 32, 64, 128), (3, 64, 32, 64),
                                     (4, 1, 64, 64), (9, 24, 32, 128), (2, 17, 32, 128)])
@pytest.mark.parametrize("argnums", [(0, 1), (0, 1, 2), (0,), (2,)], ids=str)
def test_kernel_path_lowering(kernels_on, B, N, K, H, argnums):
    from jaxfox.reduce import reduce_chunks

    params = make_params(K, H)
    psi, taus, dz = make_inputs(B, N, H)
    calls = _calls(_cuda_text(_loss_fn(argnums), params, psi, taus, dz))
    assert sorted(t for t, *_ in calls) == [BWD, FWD], [t for t, *_ in calls]
    P, G = _padded_p(K, H), _grid(B, N)
    f32 = lambda *s: "tensor<" + "".join(f"{d}x" for d in s) + "f32>"  # noqa: E731
    for target, attrs, operands, results in calls:
        assert {k: attrs[k] for k in ("n_cos", "hidden", "n_quantiles")} == dict(n_cos=K, hidden=H, n_quantiles=N)
        if target == FWD:
            assert operands == [f32(P), f32(B, H), f32(B, N)] and results == [f32(B, N)]
            continue
        chunks = reduce_chunks(G, P)
        assert attrs["grid"] == G and attrs["chunks"] == chunks
        assert operands == [f32(P), f32(B, H), f32(B, N), f32(B, N)]
        dtaus = f32(B, N) if 2 in argnums else f32(0)
        assert results == [f32(P), f32(B, H), dtaus, f32(G, P), f32(chunks * P if chunks > 1 else 0)], results
    if B == 1000:
        assert _grid(B, N) == 132 and reduce_chunks(132, P) > 1  # the chunked parameter-gradient sum


def test_kernel_path_forward_only(kernels_on):
    params = make_params(64, 128)
    psi, taus, _ = make_inputs(8, 32, 128)
    calls = _calls(_cuda_text(iqn_head, params, psi, taus))
    assert [t for t, *_ in calls] == [FWD]


@pytest.mark.parametrize("B,N,K,H", [(5, 65, 64, 128), (5, 32, 64, 96), (5, 32, 16, 128), (5, 32, 128, 128),
                                     (5, 32, 64, 256), (5, 32, 48, 64)])
def test_unsupported_shapes_lower_to_the_reference(kernels_on, B, N, K, H):
    params = make_params(K, H)
    psi, taus, dz = make_inputs(B, N, H)
    text = _cuda_text(_loss_fn((0, 1, 2)), params, psi, taus, dz)
    assert "jaxfox_iqn" not in text and "custom_call @jaxfox" not in text
    assert "stablehlo.dot_general" in text and "stablehlo.cosine" in text  # the reference's products


def test_kernels_unavailable_lowers_to_the_reference():
    """Without kernels (this machine as it is), even a supported shape lowered for CUDA uses the reference."""
    params = make_params(64, 128)
    psi, taus, dz = make_inputs(5, 32, 128)
    text = _cuda_text(_loss_fn((0, 1, 2)), params, psi, taus, dz)
    assert "jaxfox_iqn" not in text and "stablehlo.dot_general" in text


def test_kernel_path_vmap_lowering(kernels_on):
    """vmap (vmap_method="sequential"): one call per instance, per-instance operand shapes."""
    V, B, N, K, H = 3, 5, 32, 64, 128
    stacked = {k: jnp.stack([make_params(K, H, seed=v)[k] for v in range(V)]) for k in KEYS}
    psi, taus, dz = (jnp.stack([x] * V) for x in make_inputs(B, N, H))
    text = _cuda_text(jax.vmap(_loss_fn((0, 1))), stacked, psi, taus, dz)
    calls = _calls(text)
    assert sorted(t for t, *_ in calls) == [BWD, FWD]
    P = _padded_p(K, H)
    for _, _, operands, _ in calls:
        assert operands[:3] == [f"tensor<{P}xf32>", f"tensor<{B}x{H}xf32>", f"tensor<{B}x{N}xf32>"]
    assert "stablehlo.while" in text


def test_kernel_path_per_shard_under_explicit_sharding(kernels_on):
    """Explicit batch-sharded psi / taus: the FFI calls see the local batch (4 of 16 rows), nothing gathered."""
    from jax.sharding import AxisType, NamedSharding, PartitionSpec

    from jaxfox.sharding import batch_sharding

    B, N, K, H = 16, 32, 64, 128
    mesh = jax.make_mesh((4,), ("batch",), axis_types=(AxisType.Explicit,), devices=jax.devices()[:4])
    params = jax.device_put(make_params(K, H), NamedSharding(mesh, PartitionSpec()))
    psi, taus, dz = jax.device_put(make_inputs(B, N, H), batch_sharding(mesh))
    text = _cuda_text(_loss_fn((0, 1, 2)), params, psi, taus, dz)
    calls = _calls(text)
    assert sorted(t for t, *_ in calls) == [BWD, FWD]
    for _, _, operands, _ in calls:
        assert operands[1] == f"tensor<4x{H}xf32>" and operands[2] == f"tensor<4x{N}xf32>", operands
    assert "all_gather" not in text and "sdy.manual_computation" in text


# ----------------------------------------------------------------------------------------------
# jaxfox.models.aux's IQN trainer, which runs its head through iqn_head.
@pytest.mark.parametrize("F,H,K", [(16, 32, 16), (8, 128, 64)])
def test_aux_iqn_quantiles_match_oracle(F, H, K):
    from jaxfox.models.aux import iqn_init, iqn_quantiles

    params = iqn_init(jax.random.key(3), F, H, K)
    rng = np.random.default_rng(3)
    obs = jnp.asarray(rng.standard_normal((6, F)), jnp.float32)
    taus = jnp.asarray(rng.uniform(size=(6, 32)), jnp.float32)
    psi = np.maximum(np.asarray(obs, np.float64) @ np.asarray(params["w_s"], np.float64)
                     + np.asarray(params["b_s"], np.float64), 0.0)
    want = np_iqn_forward({k: params[k] for k in KEYS}, psi, taus)
    assert _max_rel(iqn_quantiles(params, obs, taus, K), want) <= FWD_TOL
    assert_raises_naming(lambda: iqn_quantiles(params, obs, taus, K + 1), ValueError, "n_cos")


@pytest.mark.parametrize("cc,K,H,ok", [
    ((9, 0), 64, 128, True), ((10, 0), 64, 128, True), ((8, 0), 64, 128, False), ((8, 0), 64, 64, True),
    ((8, 6), 32, 64, True), ((8, 6), 64, 64, False), ((12, 0), 32, 128, False), ((7, 5), 32, 64, False)])
def test_kernel_needs_the_shared_memory_of_its_layout(monkeypatch, cc, K, H, ok):
    """The kernel path is taken only where the device's opt-in shared memory per block holds the kernels'
    layout (ffi/iqn.cu Layout: 220 KiB at K=64 H=128, 105 KiB at K=64 H=64, 88 KiB at K=32 H=64)."""
    monkeypatch.setattr(iqn_mod, "cuda_compute_capability", lambda: cc)
    assert iqn_mod._kernel_supported(iqn_mod._Config(K, H, 32), 16) is ok
    assert iqn_mod._smem_bytes(64, 128, False) == 225536 and iqn_mod._smem_bytes(64, 128, True) == 222464


def test_kernel_not_used_for_2_to_the_31_rows(monkeypatch):
    monkeypatch.setattr(iqn_mod, "cuda_compute_capability", lambda: (9, 0))
    assert iqn_mod._kernel_supported(iqn_mod._Config(64, 128, 32), 2**26 - 1)
    assert not iqn_mod._kernel_supported(iqn_mod._Config(64, 128, 32), 2**26)



# ----------------------------------------------------------------------------------------------
# iqn_quantile_huber_loss: the head's loss with the gradient fused on CUDA (the kernel is opt-in).
LOSS = "jaxfox_iqn_loss"


def make_targets(B, Nt, seed=0, scale=1.0):
    rng = np.random.default_rng(seed + 3000)
    return jnp.asarray(scale * rng.standard_normal((B, Nt)), jnp.float32)


@pytest.mark.parametrize("B,N,Nt,K,H,kappa", [(5, 8, 6, 64, 128, 1.0), (3, 1, 1, 32, 64, 0.5), (7, 3, 9, 5, 9, 2.0)])
def test_iqn_loss_matches_oracle(B, N, Nt, K, H, kappa):
    """Value and every gradient (params, psi, taus, targets) against the float64 oracle: the loss's d z pushed
    through np_iqn_vjp, plus the indicator weight's own d tau."""
    params = make_params(K, H)
    psi, taus, _ = make_inputs(B, N, H)
    y = make_targets(B, Nt, scale=0.5)   # |d| both below and above kappa
    want, dz, dy, dtau_ind = np_iqn_loss(params, psi, taus, y, kappa)
    dp, dpsi, dtaus = np_iqn_vjp(params, psi, taus, dz)
    with jax.default_matmul_precision("highest"):
        got, g = jax.value_and_grad(jaxfox.iqn_quantile_huber_loss, argnums=(0, 1, 2, 3))(params, psi, taus, y, kappa)
    assert got.dtype == jnp.float32 and got.shape == ()
    assert abs(float(got) - want) <= FWD_TOL * max(abs(want), 1e-30)
    for k in KEYS:
        assert rel_err(g[0][k], dp[k]) <= GRAD_TOL, k
    assert rel_err(g[1], dpsi) <= GRAD_TOL
    assert rel_err(g[2], dtaus + dtau_ind) <= GRAD_TOL
    assert rel_err(g[3], dy) <= GRAD_TOL


def test_iqn_loss_equals_the_composition_and_check_grads():
    params = make_params(8, 16)
    psi, taus, _ = make_inputs(4, 3, 16)
    y = make_targets(4, 5)
    with jax.default_matmul_precision("highest"):
        got = jaxfox.iqn_quantile_huber_loss(params, psi, taus, y, 1.5)
        want = jaxfox.quantile_huber_loss(iqn_head(params, psi, taus), taus, y, 1.5)
        assert abs(float(got) - float(want)) <= 1e-6 * abs(float(want))
        check_grads(lambda p, s: jaxfox.iqn_quantile_huber_loss(p, s, taus, y, 1.5), (params, psi), order=1,
                    modes=("rev",), atol=2e-2, rtol=2e-2)


def test_iqn_loss_argument_errors():
    params = make_params(8, 16)
    psi, taus, _ = make_inputs(4, 3, 16)
    y = make_targets(4, 5)
    f = jaxfox.iqn_quantile_huber_loss
    assert_raises_naming(lambda: f(params, psi, taus, y[:3]), ValueError, "target_quantiles")
    assert_raises_naming(lambda: f(params, psi, taus, y[:, :, None]), ValueError, "target_quantiles")
    assert_raises_naming(lambda: f(params, psi, taus, y.astype(jnp.bfloat16)), TypeError, "target_quantiles")
    assert_raises_naming(lambda: f(params, psi, taus[:2], y), ValueError, "taus")
    assert_raises_naming(lambda: f(params, psi[:, :8], taus, y), ValueError, "psi")
    assert_raises_naming(lambda: f(params, psi, taus, y, 0.0), ValueError, "kappa")
    # kappa is a constant of the computation: a concrete 0-d array is taken as its value, a traced one is refused
    np.testing.assert_array_equal(np.asarray(f(params, psi, taus, y, jnp.float32(2.0))),
                                  np.asarray(f(params, psi, taus, y, 2.0)))
    assert_raises_naming(lambda: jax.jit(lambda k: f(params, psi, taus, y, k))(1.0), TypeError, "kappa")
    assert_raises_naming(lambda: f(params, psi, taus, y[:, :0]), ValueError, "target_quantiles")
    # a kappa that underflows float32 (subnormals are flushed to zero): 1e-40 gave a NaN loss, 1e-30 dropped terms
    assert_raises_naming(lambda: f(params, psi, taus, y, 1e-40), ValueError, "kappa", "normal float32")
    assert_raises_naming(lambda: f(params, psi, taus, y, 1e-30), ValueError, "kappa", "2^-63")
    assert_raises_naming(lambda: f(params, psi[:0], taus[:0], y[:0]), ValueError, "psi")


@pytest.fixture
def loss_opted_in(monkeypatch, kernels_on):
    """The fused loss kernel runs by default (it was opt-in until measured): kernels on is all it takes."""


def _loss_grad(argnums, kappa=1.0):
    return jax.value_and_grad(lambda p, s, t, y: jaxfox.iqn_quantile_huber_loss(p, s, t, y, kappa), argnums=argnums)


@pytest.mark.parametrize("B,N,Nt,K,H", [(5, 32, 32, 64, 128), (1000, 32, 32, 64, 128), (3, 64, 7, 32, 64),
                                        (9, 1, 64, 64, 64)])
def test_iqn_loss_kernel_path_lowering(loss_opted_in, B, N, Nt, K, H):
    """Opted in, the gradient w.r.t. params and psi is ONE jaxfox_iqn_loss call (no forward kernel): operand and
    result shapes, grid / chunks as the backward's, kappa as a float attribute."""
    from jaxfox.reduce import reduce_chunks

    params = make_params(K, H)
    psi, taus, _ = make_inputs(B, N, H)
    y = make_targets(B, Nt)
    text = _cuda_text(_loss_grad((0, 1), kappa=0.75), params, psi, taus, y)
    calls = _calls(text)
    assert [t for t, *_ in calls] == [LOSS], [t for t, *_ in calls]
    (_, attrs, operands, results), = calls
    P, G = _padded_p(K, H), _grid(B, N)
    chunks = reduce_chunks(G, P)
    f32 = lambda *s: "tensor<" + "".join(f"{d}x" for d in s) + "f32>"  # noqa: E731
    assert attrs == dict(n_cos=K, hidden=H, n_quantiles=N, grid=G, chunks=chunks), attrs
    assert re.search(r"kappa = 7\.5\d*e-01 : f32", text), "kappa attribute"
    assert operands == [f32(P), f32(B, H), f32(B, N), f32(B, Nt)]
    assert results == [f32(B), f32(P), f32(B, H), f32(G, P), f32(chunks * P if chunks > 1 else 0)], results


@pytest.mark.parametrize("argnums", [(0, 2), (0, 3), (2,)], ids=str)
def test_iqn_loss_kernel_path_differentiating_taus_or_targets_uses_the_head_kernels(loss_opted_in, argnums):
    """d taus / d targets are not in the fused kernel: the composition (forward + backward kernels) runs."""
    params = make_params(64, 128)
    psi, taus, _ = make_inputs(5, 32, 128)
    calls = _calls(_cuda_text(_loss_grad(argnums), params, psi, taus, make_targets(5, 32)))
    assert sorted(t for t, *_ in calls) == [BWD, FWD], [t for t, *_ in calls]


def test_iqn_loss_without_any_opt_in_uses_the_fused_kernel(kernels_on, monkeypatch):
    """The fused loss kernel runs by default since it was measured faster (2.08x XLA, BENCHMARKS.md)."""
    monkeypatch.delenv("JAXFOX_OPT_IN_KERNELS", raising=False)
    params = make_params(64, 128)
    psi, taus, _ = make_inputs(5, 32, 128)
    calls = _calls(_cuda_text(_loss_grad((0, 1)), params, psi, taus, make_targets(5, 32)))
    assert sorted(t for t, *_ in calls) == [LOSS], [t for t, *_ in calls]


def _unflatten(flat, K, H):
    o = np.cumsum([0, H * H, K * H, H, H, H, 1])
    return {"w_h": flat[o[0]:o[1]].reshape(H, H), "w_phi": flat[o[1]:o[2]].reshape(K, H), "b_phi": flat[o[2]:o[3]],
            "b_h": flat[o[3]:o[4]], "w_out": flat[o[4]:o[5]].reshape(H, 1), "b_out": flat[o[5]:o[6]]}


def test_iqn_loss_custom_vjp_runs_on_cpu_with_stand_in_kernels(monkeypatch):
    """The custom_vjp around the fused call, executed on this CPU machine: the two FFI-calling functions are
    replaced by pure-JAX stand-ins (same outputs, from the reference), the kernel branch is forced. The gradient
    is the residual scaled by the cotangent; with taus or targets differentiated the composition's VJP is used."""
    monkeypatch.setattr(iqn_mod, "_kernel_supported", lambda cfg, B: True)
    monkeypatch.setattr(iqn_mod, "dispatch", lambda kernel, reference, *a, **k: kernel(*a))
    used = []

    def ref_loss(cfg, flat, psi, taus, y):
        return jaxfox.quantile_huber_loss(iqn_mod._reference(_unflatten(flat, cfg.n_cos, cfg.hidden), psi, taus),
                                          taus, y, cfg.kappa)

    def fake_loss_call(cfg, flat, psi, taus, y):
        used.append("fused")
        loss, (dflat, dpsi) = jax.value_and_grad(ref_loss, argnums=(1, 2))(cfg, flat, psi, taus, y)
        return loss, dflat, dpsi

    def fake_composed(cfg, flat, psi, taus, y):
        used.append("composed")
        return ref_loss(cfg, flat, psi, taus, y)

    monkeypatch.setattr(iqn_mod, "_loss_call", fake_loss_call)
    monkeypatch.setattr(iqn_mod, "_composed_kernel", fake_composed)
    B, N, Nt, K, H = 4, 3, 5, 8, 16
    params = make_params(K, H)
    psi, taus, _ = make_inputs(B, N, H)
    y = make_targets(B, Nt)
    want, dz, dy, dtau_ind = np_iqn_loss(params, psi, taus, y, 1.0)
    dp, dpsi, dtaus = np_iqn_vjp(params, psi, taus, dz)
    with jax.default_matmul_precision("highest"):
        g = jax.grad(lambda p, s: 3.0 * jaxfox.iqn_quantile_huber_loss(p, s, taus, y), argnums=(0, 1))(params, psi)
        assert used == ["fused"]
        for k in KEYS:
            assert rel_err(g[0][k], 3.0 * dp[k]) <= GRAD_TOL, k
        assert rel_err(g[1], 3.0 * dpsi) <= GRAD_TOL
        g = jax.grad(lambda s, t, yy: 2.0 * jaxfox.iqn_quantile_huber_loss(params, s, t, yy), argnums=(0, 1, 2))(
            psi, taus, y)
        assert used == ["fused", "composed"]
        assert rel_err(g[0], 2.0 * dpsi) <= GRAD_TOL
        assert rel_err(g[1], 2.0 * (dtaus + dtau_ind)) <= GRAD_TOL
        assert rel_err(g[2], 2.0 * dy) <= GRAD_TOL
        assert abs(float(jaxfox.iqn_quantile_huber_loss(params, psi, taus, y)) - want) <= FWD_TOL * abs(want)


def test_aux_iqn_step_with_the_fused_loss_lowers_to_one_loss_call(loss_opted_in):
    """By default, the aux IQN step is the target head's forward kernel plus ONE fused loss call."""
    from jaxfox.models.aux import AuxConfig, make_aux, synthetic_batch

    cfg = AuxConfig(obs_dim=16)
    tr = make_aux(cfg)
    st = tr.init(jax.random.key(0))
    batch = synthetic_batch(jax.random.key(1), cfg, 64)["iqn"]
    calls = [c for c in _calls(_cuda_text(tr.iqn_step, st.iqn, batch)) if c[0].startswith("jaxfox_iqn")]
    assert sorted(t for t, *_ in calls) == [FWD, LOSS], [t for t, *_ in calls]


def test_iqn_loss_batch_split_over_explicit_axes_runs_the_composition_per_shard(loss_opted_in):
    """Opted in, but psi / taus / targets split over an Explicit mesh axis: the fused loss (a mean over the whole
    batch on one device) is not used; the head's kernels run per shard (4 of 16 rows)."""
    from jax.sharding import AxisType, NamedSharding, PartitionSpec

    from jaxfox.sharding import batch_sharding

    B, N, K, H = 16, 32, 64, 128
    mesh = jax.make_mesh((4,), ("batch",), axis_types=(AxisType.Explicit,), devices=jax.devices()[:4])
    params = jax.device_put(make_params(K, H), NamedSharding(mesh, PartitionSpec()))
    psi, taus, _ = make_inputs(B, N, H)
    psi, taus, y = jax.device_put((psi, taus, make_targets(B, 32)), batch_sharding(mesh))
    text = _cuda_text(_loss_grad((0, 1)), params, psi, taus, y)
    calls = _calls(text)
    assert sorted(t for t, *_ in calls) == [BWD, FWD], [t for t, *_ in calls]
    for _, _, operands, _ in calls:
        assert operands[1] == f"tensor<4x{H}xf32>", operands
    assert "sdy.manual_computation" in text
