"""CPU tests of the IQL value loss (jaxfox/iql.py): ``iql_value_loss``.

* the loss and its gradient with respect to every parameter, obs and target against an independent float64 NumPy
  implementation of the module docstring's equations (``np_iql_loss`` / ``np_iql_grads``, the gradient written by
  hand with the chain rule and itself checked against central differences), and ``jax.test_util.check_grads``;
* jit / vmap composition; the argument checks (raised before anything runs, naming the argument);
* the CUDA kernel path (ffi/iql.cu, FFI target jaxfox_iql_head; by default for H >= 128, opt-in below:
  JAXFOX_OPT_IN_KERNELS=iql), traced and lowered for CUDA on this CPU machine with the kernels forced on and
  opted in: one FFI call between XLA's first-layer GEMM and its weight-gradient GEMM, with which operand / result
  shapes and attributes, which products, and which shapes fall back to the reference; the same for the fused target
  jaxfox_iql_fused (forced: it needs an sm_90 device), and which shapes, devices, builds and precisions choose it;
  its Python wiring (the custom_vjp around the call) against the oracle with the FFI call's results computed in JAX.

The oracle and the input builders (``exact_inputs``: every first-layer pre-activation and every residual u kept
away from 0, asserted by ``assert_far_from_kinks``; ``typical_inputs``: iql_init) are also used by
test_gpu_iql.py and gpu_sanitize_iql.py; ``test_exact_inputs_premise`` checks here that the exact-math inputs of
the GPU tests' cases (tests/iql_cases.py) satisfy their premise.
"""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.test_util import check_grads

import jaxfox
import jaxfox.iql as iql_mod
from jaxfox import iql_value_loss
from jaxfox.models.aux import iql_init

import iql_cases
from conftest import assert_raises_naming, central_diff_grad, cuda_custom_calls, rel_err

GRAD_KEYS = ("dw1", "db1", "dw2", "db2", "dobs", "dtarget")
LOSS_TOL = 1e-5    # float32 (CPU, no TF32) vs float64: max relative error of the G losses
GRAD_TOL = 5e-5    # norm-wise (rel_err) per gradient array
KINK_MARGIN = 0.2  # exact_inputs: |first-layer pre-activation| >= this everywhere
U_MARGIN = 0.25    # exact_inputs: |u_g[b]| = |target_b - V_g(obs_b)| >= this everywhere


# ----------------------------------------------------------------------------------------------
# Float64 NumPy oracle, written from jaxfox/iql.py's module docstring (Kostrikov et al. 2021, eq. 5):
#   p_g = obs W1_g + b1_g [B, H],  h = ReLU(p),  V_g = h w2_g + b2_g [B],  u = target - V_g,
#   w = |tau_g - 1{u < 0}|,  loss_g = (1 / B) sum_b w u^2.
def _f64(params, obs, target):
    (w1, w2), (b1, b2) = params["w"], params["b"]
    f = lambda x: np.asarray(x, np.float64)  # noqa: E731
    return f(w1), f(b1), f(w2), f(b2), f(obs), f(target)


def _np_forward_all(params, obs, target, taus):
    w1, b1, w2, b2, x, y = _f64(params, obs, target)
    tau = np.asarray(taus, np.float64).reshape(-1, 1)                  # [G, 1]
    p = np.einsum("bd,gdh->gbh", x, w1) + b1[:, None, :]               # [G, B, H]
    h = np.maximum(p, 0.0)
    v = np.einsum("gbh,gh->gb", h, w2[:, :, 0]) + b2                   # [G, B] (b2 [G, 1] broadcasts over b)
    u = y[None, :] - v
    w = np.abs(tau - (u < 0))
    loss = np.mean(w * u * u, axis=1)                                  # [G]
    return loss, dict(x=x, w1=w1, w2=w2, p=p, h=h, v=v, u=u, w=w)


def np_iql_loss(params, obs, target, taus):
    """loss [G] float64 of params (iql_init layout, one hidden layer), obs [B, D], target [B], taus [G]."""
    return _np_forward_all(params, obs, target, taus)[0]


def np_iql_grads(params, obs, target, taus, c):
    """The gradient of sum_g c_g loss_g w.r.t. (w1, b1, w2, b2, obs, target), float64, by the chain rule (ReLU
    derivative 1 where p > 0, else 0; the weight w piecewise constant in u). Returns {"dw1": [G, D, H],
    "db1": [G, H], "dw2": [G, H, 1], "db2": [G, 1], "dobs": [B, D], "dtarget": [B]}."""
    _, k = _np_forward_all(params, obs, target, taus)
    c = np.asarray(c, np.float64).reshape(-1, 1)                       # [G, 1]
    B = k["u"].shape[1]
    dv = -c * 2.0 / B * k["w"] * k["u"]                                # d/dV_g[b]  [G, B]
    dh = dv[..., None] * k["w2"][:, None, :, 0] * (k["p"] > 0)         # d/dp  [G, B, H]
    return {
        "dw1": np.einsum("bd,gbh->gdh", k["x"], dh),
        "db1": dh.sum(axis=1),
        "dw2": np.einsum("gbh,gb->gh", k["h"], dv)[..., None],
        "db2": dv.sum(axis=1, keepdims=True),
        "dobs": np.einsum("gbh,gdh->bd", dh, k["w1"]),
        "dtarget": -dv.sum(axis=0),
    }


def preactivations(params, obs, target):
    """(p [G, B, H], u [G, B]) float64: the first-layer pre-activations and the residuals target - V_g."""
    _, k = _np_forward_all(params, obs, target, np.full(params["w"][0].shape[0], 0.5))
    return k["p"], k["u"]


def assert_far_from_kinks(params, obs, target, kink_margin=KINK_MARGIN, u_margin=U_MARGIN, skip_units=()):
    """The premise of the exact-math tests (no TF32 / float32 rounding can flip a ReLU mask or the expectile
    weight): |p| >= kink_margin for every network, row and unit (except skip_units), |u| >= u_margin; and, with
    >= 2 rows, every network has units always on, always off and on in some rows only, and both signs of u."""
    p, u = preactivations(params, obs, target)
    p = np.delete(p, list(skip_units), axis=2)
    worst_p, worst_u = float(np.abs(p).min()), float(np.abs(u).min())
    assert worst_p >= kink_margin, f"min |pre-activation| {worst_p:.3g} < {kink_margin}"
    assert worst_u >= u_margin, f"min |u| {worst_u:.3g} < {u_margin}"
    if p.shape[1] >= 2:
        for g in range(p.shape[0]):
            on = p[g] > 0
            kinds = (int(on.all(0).sum()), int((~on).all(0).sum()), int((on.any(0) & ~on.all(0)).sum()))
            assert min(kinds) > 0, f"network {g}: units always on / always off / switching: {kinds}"
            assert (u[g] > 0).any() and (u[g] < 0).any(), f"network {g}: u of one sign only"


# ----------------------------------------------------------------------------------------------
# Inputs.
def taus_for(G):
    """G distinct expectiles in (0, 1) (0.7 and 0.9 first, as jaxfox's aux trainers)."""
    base = (0.7, 0.9, 0.3, 0.5, 0.8, 0.6)
    return base[:G] if G <= len(base) else tuple(float(t) for t in np.linspace(0.05, 0.95, G))


def to_params(w1, b1, w2, b2):
    f = lambda x: jnp.asarray(x, jnp.float32)  # noqa: E731
    return {"w": [f(w1), f(w2)], "b": [f(b1), f(b2)]}


def exact_inputs(G, D, H, B, seed=0):
    """(params, obs, target) float32 whose first-layer pre-activations all have |p| >= KINK_MARGIN and whose
    residuals |u| >= U_MARGIN (asserted by the callers with :func:`assert_far_from_kinks`), masks varying over
    units, rows AND networks:

    obs entries +-U[0.5, 1.5] (random signs); W1 small (0.05 He) and, by kind = (j + g) mod 4 of unit j of
    network g: 0 always on (b1 = +1), 1 always off (b1 = -1), 2 and 3 switching (b1 = 0, W1[c, j] += +-2.5 for one
    feature c = (j + 7 g) mod D, so p = +-2.5 obs_c + small, the sign set by the row); the small part is
    ~N(0, 0.074^2), far below the margins. w2 He, b2 ~ 0.1 N. target: half the rows max_g V_g + U[0.3, 1.3], the
    others min_g V_g - U[0.3, 1.3] (V from the float64 oracle at the float32-rounded params and obs), so every
    network sees both signs of u with |u| >= 0.3."""
    rng = np.random.default_rng(seed + 5000)
    obs = rng.uniform(0.5, 1.5, (B, D)) * rng.choice([-1.0, 1.0], (B, D))
    j = np.arange(H)
    w1 = rng.standard_normal((G, D, H)) * np.sqrt(2.0 / D) * 0.05
    b1 = np.zeros((G, H))
    for g in range(G):
        kind = (j + g) % 4
        b1[g] = np.select([kind == 0, kind == 1], [1.0, -1.0], 0.0)
        sw = np.nonzero(kind >= 2)[0]
        w1[g, (sw + 7 * g) % D, sw] += np.where((sw // 4) % 2 == 0, 2.5, -2.5)
    w2 = rng.standard_normal((G, H, 1)) * np.sqrt(2.0 / H)
    b2 = 0.1 * rng.standard_normal((G, 1))
    params = to_params(w1, b1, w2, b2)
    obs = jnp.asarray(obs, jnp.float32)
    _, k = _np_forward_all(params, obs, np.zeros(B), np.full(G, 0.5))
    v = k["v"]                                                          # [G, B]
    up = rng.uniform(size=B) < 0.5
    if B >= 2:
        up[0], up[1] = True, False
    off = rng.uniform(0.3, 1.3, B)
    target = np.where(up, v.max(axis=0) + off, v.min(axis=0) - off)
    return params, obs, jnp.asarray(target, jnp.float32)


def exact_targets(params, obs, target, n, seed=0):
    """[n, B] float32 targets for the same (params, obs), each meeting the exact-math premise when ``target``
    does: instance 0 is ``target``, instance v > 0 moves every row further from the networks' values, by
    U[0, 1] in the direction of its residual (target above every V_g stays above, below stays below), so |u|
    only grows. (Another case's target, drawn against other networks' values, can land next to these V_g.)"""
    _, u = preactivations(params, obs, target)
    away = np.sign(u[0])                       # the same sign for every network (exact_inputs)
    rng = np.random.default_rng(seed + 8000)
    t = np.asarray(target, np.float64)
    out = [t] + [t + away * rng.uniform(0.0, 1.0, t.shape) for _ in range(n - 1)]
    return jnp.asarray(np.stack(out), jnp.float32)


def typical_inputs(G, D, H, B, seed=0, perturbed=True):
    """iql_init params (He weights; with perturbed=True the zero biases get a 0.1 N(0, 1) perturbation so that no
    bias is trivially 0), obs ~ N(0, 1), target ~ 1.5 N(0, 1); float32. Pre-activations and residuals close to 0
    occur (see test_gpu_iql.py's docstring)."""
    params = iql_init(jax.random.key(seed), D, hidden=(H,), num_networks=G)
    rng = np.random.default_rng(seed + 6000)
    if perturbed:
        params["b"] = [b + jnp.asarray(0.1 * rng.standard_normal(b.shape), jnp.float32) for b in params["b"]]
    obs = jnp.asarray(rng.standard_normal((B, D)), jnp.float32)
    target = jnp.asarray(1.5 * rng.standard_normal(B), jnp.float32)
    return params, obs, target


def cotangent(G, seed=0):
    """Random-sign loss cotangent c [G] float32 (the gradient of sum_g c_g loss_g)."""
    return jnp.asarray(np.random.default_rng(seed + 7000).standard_normal(G), jnp.float32)


def named(dparams, dobs=None, dtarget=None):
    """JAX gradients (params pytree, d obs, d target) -> {"dw1", "db1", "dw2", "db2"[, "dobs"][, "dtarget"]}."""
    out = {"dw1": dparams["w"][0], "db1": dparams["b"][0], "dw2": dparams["w"][1], "db2": dparams["b"][1]}
    if dobs is not None:
        out["dobs"] = dobs
    if dtarget is not None:
        out["dtarget"] = dtarget
    return out


def loss_vjp(taus):
    """(params, obs, target, c) -> (loss [G], {name: gradient of sum_g c_g loss_g}) through iql_value_loss."""
    def f(params, obs, target, c):
        loss, vjp = jax.vjp(lambda p, o, t: iql_value_loss(p, o, t, taus), params, obs, target)
        return loss, named(*vjp(c))
    return f


def _max_rel(got, want):
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    assert got.shape == want.shape, (got.shape, want.shape)
    return float(np.abs(got - want).max() / max(np.abs(want).max(), 1e-30))


def _assert_grads(got, want, tol=GRAD_TOL):
    for k, g in got.items():
        assert np.shape(g) == np.shape(want[k]) and np.asarray(g).dtype == np.float32, (k, np.shape(g))
        assert rel_err(g, want[k]) <= tol, (k, rel_err(g, want[k]))


# ----------------------------------------------------------------------------------------------
# The oracle itself.
def test_oracle_gradient_matches_central_differences():
    G, D, H, B = 2, 4, 8, 6
    params, obs, target = exact_inputs(G, D, H, B, seed=1)
    assert_far_from_kinks(params, obs, target)  # steps of 1e-6 cross no kink and no sign change of u
    w1, b1, w2, b2, x, y = _f64(params, obs, target)
    taus = taus_for(G)
    c = np.asarray(cotangent(G, seed=1), np.float64)
    want = np_iql_grads(params, obs, target, taus, c)

    def scalar(w1=w1, b1=b1, w2=w2, b2=b2, x=x, y=y):
        return float(np.sum(c * np_iql_loss({"w": [w1, w2], "b": [b1, b2]}, x, y, taus)))

    for name, arg, val in (("w1", "w1", w1), ("b1", "b1", b1), ("w2", "w2", w2), ("b2", "b2", b2),
                           ("obs", "x", x), ("target", "y", y)):
        fd = central_diff_grad(lambda v: scalar(**{arg: v}), val)
        np.testing.assert_allclose(want["d" + name], fd, rtol=1e-6, atol=1e-9, err_msg=name)


def test_oracle_known_values():
    """G = 1, D = H = 1 by hand: p = 2 x - 1, h = ReLU(p), V = 3 h + 0.5, tau = 0.8."""
    params = {"w": [np.array([[[2.0]]]), np.array([[[3.0]]])], "b": [np.array([[-1.0]]), np.array([[0.5]])]}
    obs, target = np.array([[1.0], [0.0], [2.0]]), np.array([0.0, 1.0, 10.0])
    # p = [1, -1, 3], h = [1, 0, 3], V = [3.5, 0.5, 9.5], u = [-3.5, 0.5, 0.5], w = [0.2, 0.8, 0.8]
    # w u^2 = [2.45, 0.2, 0.2]: loss = 2.85 / 3 = 0.95
    np.testing.assert_allclose(np_iql_loss(params, obs, target, (0.8,)), [0.95], rtol=1e-12)
    # d loss / d target = (2 / B) w u = [-7/15, 4/15, 4/15]; d loss / d b2 = -sum = -1/15
    g = np_iql_grads(params, obs, target, (0.8,), [1.0])
    np.testing.assert_allclose(g["dtarget"], [-7 / 15, 4 / 15, 4 / 15], rtol=1e-12)
    np.testing.assert_allclose(g["db2"], [[-1 / 15]], rtol=1e-12)
    p32 = jax.tree.map(lambda a: jnp.asarray(a, jnp.float32), params)
    got = iql_value_loss(p32, jnp.asarray(obs, jnp.float32), jnp.asarray(target, jnp.float32), 0.8)
    np.testing.assert_allclose(np.asarray(got), [0.95], rtol=1e-6)


# ----------------------------------------------------------------------------------------------
# Values and gradients (the reference path: this machine has no kernels).
SHAPES = [  # G, D, H, B
    (1, 8, 16, 1),        # G = 1, B = 1
    (3, 16, 32, 37),      # G = 3, B not a multiple of 32
    (2, 64, 64, 100),     # a kernel shape
    (2, 256, 128, 33),    # the aux trainers' shape, one row past a 32-row tile
    (1, 5, 7, 3),         # odd sizes
    (3, 128, 64, 1000),
]


@pytest.mark.parametrize("G,D,H,B", SHAPES)
def test_loss_matches_oracle(G, D, H, B):
    params, obs, target = typical_inputs(G, D, H, B, seed=G + B)
    taus = taus_for(G)
    want = np_iql_loss(params, obs, target, taus)
    loss = iql_value_loss(params, obs, target, taus)
    assert loss.shape == (G,) and loss.dtype == jnp.float32
    assert _max_rel(loss, want) <= LOSS_TOL
    assert _max_rel(jax.jit(lambda p, o, t: iql_value_loss(p, o, t, taus))(params, obs, target), want) <= LOSS_TOL


@pytest.mark.parametrize("G,D,H,B", SHAPES)
def test_gradients_match_oracle(G, D, H, B):
    params, obs, target = typical_inputs(G, D, H, B, seed=G + B + 1)
    taus, c = taus_for(G), cotangent(G, seed=B)
    loss, got = jax.jit(loss_vjp(taus))(params, obs, target, c)
    assert _max_rel(loss, np_iql_loss(params, obs, target, taus)) <= LOSS_TOL
    assert got.keys() == set(GRAD_KEYS)
    _assert_grads(got, np_iql_grads(params, obs, target, taus, c))


def test_grad_of_params_only_matches_oracle():
    """jax.grad of a weighted sum of the losses w.r.t. the params only (the training use)."""
    G, D, H, B = 2, 256, 128, 300
    params, obs, target = typical_inputs(G, D, H, B, seed=3)
    c = cotangent(G, seed=3)
    g = jax.jit(jax.grad(lambda p: jnp.sum(c * iql_value_loss(p, obs, target, (0.7, 0.9)))))(params)
    want = np_iql_grads(params, obs, target, (0.7, 0.9), c)
    _assert_grads(named(g), want)


def test_scalar_expectile_broadcasts():
    G, D, H, B = 3, 16, 32, 37
    params, obs, target = typical_inputs(G, D, H, B, seed=4)
    a = iql_value_loss(params, obs, target, 0.8)
    b = iql_value_loss(params, obs, target, (0.8, 0.8, 0.8))
    assert np.array_equal(np.asarray(a), np.asarray(b))
    assert _max_rel(a, np_iql_loss(params, obs, target, (0.8,) * G)) <= LOSS_TOL
    assert np.array_equal(np.asarray(iql_value_loss(params, obs, target, np.float32(0.8))), np.asarray(a))
    # a different tau per network is honoured (not only the first): network g's loss depends on tau_g alone
    mixed = np.asarray(iql_value_loss(params, obs, target, (0.8, 0.3, 0.8)))
    assert mixed[0] == np.asarray(a)[0] and mixed[2] == np.asarray(a)[2] and mixed[1] != np.asarray(a)[1]
    assert _max_rel(mixed, np_iql_loss(params, obs, target, (0.8, 0.3, 0.8))) <= LOSS_TOL


def test_tau_one_half_is_half_the_mse():
    G, D, H, B = 2, 32, 16, 50
    params, obs, target = typical_inputs(G, D, H, B, seed=5)
    _, u = preactivations(params, obs, target)
    want = 0.5 * np.mean(u * u, axis=1)
    assert _max_rel(iql_value_loss(params, obs, target, 0.5), want) <= LOSS_TOL


def test_expectile_weights_by_sign():
    """u > 0 rows weigh tau, u < 0 rows 1 - tau: with every u of one sign, loss(tau) = tau MSE resp. (1 - tau) MSE."""
    G, D, H, B = 2, 16, 16, 20
    params, obs, _ = exact_inputs(G, D, H, B, seed=6)
    _, u0 = preactivations(params, obs, np.zeros(B))
    v = -u0                                                      # V_g(obs) [G, B]
    for sign in (1.0, -1.0):
        target = jnp.asarray(np.where(sign > 0, v.max(0) + 1.0, v.min(0) - 1.0), jnp.float32)
        _, u = preactivations(params, obs, target)
        assert (np.sign(u) == sign).all()
        mse = np.mean(u * u, axis=1)
        got = iql_value_loss(params, obs, target, (0.9, 0.2))
        assert _max_rel(got, (mse * [0.9, 0.2]) if sign > 0 else (mse * [0.1, 0.8])) <= LOSS_TOL


@pytest.mark.parametrize("G,D,H,B", [(2, 4, 8, 5), (1, 8, 16, 1), (3, 8, 16, 33)])
def test_check_grads(G, D, H, B):
    """Numerical vs reverse-mode derivatives (float32) at a point >= 0.2 away from every ReLU kink and with
    |u| >= 0.25 (asserted), so the finite differences cross neither a kink nor a sign change of u."""
    params, obs, target = exact_inputs(G, D, H, B, seed=7)
    assert_far_from_kinks(params, obs, target)
    check_grads(lambda p, o, t: iql_value_loss(p, o, t, taus_for(G)), (params, obs, target), order=1,
                modes=["rev"], atol=1e-2, rtol=1e-2, eps=1e-3)


def test_relu_derivative_is_zero_at_zero():
    """A unit whose pre-activation is exactly 0 in every row (zero W1 column and bias) passes no gradient."""
    G, D, H, B = 2, 16, 16, 30
    params, obs, target = exact_inputs(G, D, H, B, seed=8)
    j = 5
    params["w"][0] = params["w"][0].at[1, :, j].set(0.0)
    params["b"][0] = params["b"][0].at[1, j].set(0.0)
    p, _ = preactivations(params, obs, target)
    assert np.all(p[1, :, j] == 0.0)
    c = cotangent(G, seed=8)
    _, got = loss_vjp((0.7, 0.9))(params, obs, target, c)
    assert np.all(np.asarray(got["dw1"])[1, :, j] == 0.0) and float(got["db1"][1, j]) == 0.0
    assert float(got["dw2"][1, j, 0]) == 0.0
    want = np_iql_grads(params, obs, target, (0.7, 0.9), c)
    assert np.all(want["dw1"][1, :, j] == 0.0)
    _assert_grads(got, want)


# ----------------------------------------------------------------------------------------------
# jit / vmap composition.
def test_vmap_over_batches_matches_loop():
    """vmap over a leading axis of obs / target (shared params), and over stacked params too, vs a Python loop."""
    V, G, D, H, B = 3, 2, 64, 64, 37
    taus = (0.7, 0.9)
    cases = [typical_inputs(G, D, H, B, seed=20 + v) for v in range(V)]
    params = cases[0][0]
    obs = jnp.stack([c[1] for c in cases])
    target = jnp.stack([c[2] for c in cases])
    c = cotangent(G, seed=20)
    f = loss_vjp(taus)
    loss, got = jax.jit(jax.vmap(f, in_axes=(None, 0, 0, None)))(params, obs, target, c)
    assert loss.shape == (V, G) and got["dw1"].shape == (V, G, D, H) and got["dobs"].shape == (V, B, D)
    for v in range(V):
        l1, g1 = jax.jit(f)(params, obs[v], target[v], c)
        np.testing.assert_allclose(np.asarray(loss[v]), np.asarray(l1), rtol=1e-6)
        for k in GRAD_KEYS:
            np.testing.assert_allclose(np.asarray(got[k][v]), np.asarray(g1[k]), rtol=1e-5, atol=1e-8, err_msg=k)
        assert _max_rel(loss[v], np_iql_loss(params, obs[v], target[v], taus)) <= LOSS_TOL
        _assert_grads({k: got[k][v] for k in GRAD_KEYS}, np_iql_grads(params, obs[v], target[v], taus, c))
    # stacked params too (V ensembles, each on its own batch)
    stacked = jax.tree.map(lambda *a: jnp.stack(a), *[cs[0] for cs in cases])
    loss, got = jax.jit(jax.vmap(f, in_axes=(0, 0, 0, None)))(stacked, obs, target, c)
    for v in range(V):
        assert _max_rel(loss[v], np_iql_loss(cases[v][0], obs[v], target[v], taus)) <= LOSS_TOL
        _assert_grads({k: got[k][v] for k in GRAD_KEYS}, np_iql_grads(cases[v][0], obs[v], target[v], taus, c))


def test_jit_value_and_grad_in_a_scan():
    """jit(scan(value_and_grad)): three plain SGD steps on the params, each step's loss from the oracle at the
    params that step saw."""
    G, D, H, B = 2, 32, 16, 64
    params, obs, target = typical_inputs(G, D, H, B, seed=9)
    lr = 0.1

    @jax.jit
    def run(p):
        def body(p, _):
            loss, g = jax.value_and_grad(lambda p: jnp.sum(iql_value_loss(p, obs, target, (0.7, 0.9))))(p)
            return jax.tree.map(lambda a, b: a - lr * b, p, g), (loss, p)
        return jax.lax.scan(body, p, None, length=3)

    _, (losses, ps) = run(params)
    for i in range(3):
        p_i = jax.tree.map(lambda a: a[i], ps)
        want = np.sum(np_iql_loss(p_i, obs, target, (0.7, 0.9)))
        assert abs(float(losses[i]) - want) <= LOSS_TOL * want, (i, float(losses[i]), want)
    assert float(losses[2]) < float(losses[0])


# ----------------------------------------------------------------------------------------------
# Argument checks: raised before anything runs (neither path is entered), naming the argument.
@pytest.fixture
def nothing_runs(monkeypatch):
    calls = []
    monkeypatch.setattr(iql_mod, "_reference", lambda *a: calls.append("reference"))
    monkeypatch.setattr(iql_mod, "dispatch", lambda *a, **k: calls.append("dispatch"))
    return calls


def _good(G=2, D=64, H=64, B=5):
    return typical_inputs(G, D, H, B, seed=0)


_P = _good()[0]
_W1, _W2 = _P["w"]
_B1, _B2 = _P["b"]


def _p(w1=_W1, w2=_W2, b1=_B1, b2=_B2):
    return {"w": [w1, w2], "b": [b1, b2]}


PARAM_ERRORS = [  # (params, exception, words in the message)
    ([_W1, _W2, _B1, _B2], ValueError, ["params", "list"]),
    ({"w": [_W1, _W2]}, ValueError, ["params", "['w']"]),
    ({"w": [_W1, _W2], "b": [_B1, _B2], "extra": 1}, ValueError, ["params", "extra"]),
    ({"w": [_W1, jnp.zeros((2, 64, 64)), _W2], "b": [_B1, jnp.zeros((2, 64)), _B2]}, ValueError,
     ["params", "two layers", "3"]),
    ({"w": [_W1], "b": [_B1]}, ValueError, ["params", "two layers"]),
    ({"w": _W1, "b": _B1}, ValueError, ["params", "two layers"]),
    (_p(w1=jnp.zeros((64, 64))), ValueError, ["params['w'][0]", "(64, 64)"]),
    (_p(w1=jnp.zeros((0, 64, 64))), ValueError, ["params['w'][0]", "(0, 64, 64)"]),
    (_p(w1=jnp.zeros((2, 63, 64))), ValueError, ["obs", "[?, 63]", "(5, 64)"]),  # obs must follow w1's D
    (_p(w2=jnp.zeros((2, 64, 2))), ValueError, ["params['w'][1]", "[2, 64, 1]", "(2, 64, 2)"]),
    (_p(w2=jnp.zeros((2, 64))), ValueError, ["params['w'][1]", "[2, 64, 1]", "(2, 64)"]),
    (_p(w2=jnp.zeros((3, 64, 1))), ValueError, ["params['w'][1]", "[2, 64, 1]", "(3, 64, 1)"]),
    (_p(b1=jnp.zeros((2, 65))), ValueError, ["params['b'][0]", "[2, 64]", "(2, 65)"]),
    (_p(b1=jnp.zeros((64,))), ValueError, ["params['b'][0]", "[2, 64]", "(64,)"]),
    (_p(b2=jnp.zeros((2,))), ValueError, ["params['b'][1]", "[2, 1]", "(2,)"]),
    (_p(b2=jnp.zeros((1, 1))), ValueError, ["params['b'][1]", "[2, 1]", "(1, 1)"]),
    (_p(w1=np.asarray(_W1, np.float64)), TypeError, ["params['w'][0]", "float32", "float64"]),
    (_p(w2=_W2.astype(jnp.int32)), TypeError, ["params['w'][1]", "float32", "int32"]),
    (_p(b1=_B1.astype(jnp.bfloat16)), TypeError, ["params['b'][0]", "float32", "bfloat16"]),
    (_p(b2=[[0.0], [0.0]]), TypeError, ["params['b'][1]", "list"]),
]


@pytest.mark.parametrize("i", range(len(PARAM_ERRORS)))
def test_param_errors(i, nothing_runs):
    params, exc, words = PARAM_ERRORS[i]
    _, obs, target = _good()
    assert_raises_naming(lambda: iql_value_loss(params, obs, target, 0.7), exc, *words)
    if all(isinstance(x, jax.Array) for x in jax.tree.leaves(params)):  # jit would turn numpy float64 / lists
        # into float32 / scalar tracers (x64 off): the eager call above covers those
        assert_raises_naming(lambda: jax.jit(lambda p, o, t: iql_value_loss(p, o, t, 0.7))(params, obs, target),
                             exc, *words)
    assert nothing_runs == []


def test_param_errors_b_without_length(nothing_runs):
    _, obs, target = _good()
    with pytest.raises(Exception) as e:
        iql_value_loss({"w": [_W1, _W2], "b": None}, obs, target, 0.7)
    assert isinstance(e.value, ValueError) and "params" in str(e.value), repr(e.value)
    assert nothing_runs == []


INPUT_ERRORS = [  # (which, value, exception, words)
    ("obs", jnp.zeros((5, 63)), ValueError, ["obs", "[?, 64]", "(5, 63)"]),
    ("obs", jnp.zeros((64,)), ValueError, ["obs", "(64,)"]),
    ("obs", jnp.zeros((1, 5, 64)), ValueError, ["obs", "(1, 5, 64)"]),
    ("obs", np.zeros((5, 64), np.float64), TypeError, ["obs", "float32", "float64"]),
    ("obs", jnp.zeros((5, 64), jnp.int32), TypeError, ["obs", "float32", "int32"]),
    ("obs", jnp.zeros((5, 64), jnp.bfloat16), TypeError, ["obs", "float32", "bfloat16"]),
    ("obs", [[0.0] * 64] * 5, TypeError, ["obs", "list"]),
    ("target", jnp.zeros((6,)), ValueError, ["target", "[5]", "(6,)"]),
    ("target", jnp.zeros((5, 1)), ValueError, ["target", "[5]", "(5, 1)"]),
    ("target", jnp.zeros(()), ValueError, ["target", "[5]", "()"]),
    ("target", np.zeros((5,), np.float64), TypeError, ["target", "float32", "float64"]),
    ("target", jnp.zeros((5,), jnp.int32), TypeError, ["target", "float32", "int32"]),
]


@pytest.mark.parametrize("i", range(len(INPUT_ERRORS)))
def test_input_errors(i, nothing_runs):
    which, value, exc, words = INPUT_ERRORS[i]
    params, obs, target = _good()
    args = {"obs": obs, "target": target, which: value}
    assert_raises_naming(lambda: iql_value_loss(params, args["obs"], args["target"], 0.7), exc, *words)
    assert nothing_runs == []


EXPECTILE_ERRORS = [  # (expectiles for G = 2, exception, words)
    ((0.7,), ValueError, ["expectiles", "G = 2", "1"]),
    ((0.7, 0.9, 0.5), ValueError, ["expectiles", "G = 2", "3"]),
    ([], ValueError, ["expectiles", "G = 2", "0"]),
    (0.0, ValueError, ["expectiles", "(0, 1)"]),
    (1.0, ValueError, ["expectiles", "(0, 1)"]),
    (1.5, ValueError, ["expectiles", "(0, 1)"]),
    (-0.1, ValueError, ["expectiles", "(0, 1)"]),
    (float("nan"), ValueError, ["expectiles", "(0, 1)"]),
    ((0.7, 1.0), ValueError, ["expectiles", "(0, 1)"]),
    ((0.7, 0.0), ValueError, ["expectiles", "(0, 1)"]),
    ((0.7, 1.0 - 1e-9), ValueError, ["expectiles", "(0, 1)", "float32"]),   # 1.0 in float32
    (1e-50, ValueError, ["expectiles", "(0, 1)", "float32"]),                # 0.0 in float32
    ((0.7, 1e-40), ValueError, ["expectiles", "(0, 1)", "subnormal"]),      # flushed to 0 by XLA
    (True, ValueError, ["expectiles"]),
    ((0.7, "0.9"), ValueError, ["expectiles"]),
    (jnp.asarray([0.7, 0.9]), TypeError, ["expectiles", "static"]),
    (jnp.float32(0.7), TypeError, ["expectiles", "static"]),
    (np.asarray([0.7, 0.9]), TypeError, ["expectiles", "ndarray"]),
    ("0.7", TypeError, ["expectiles", "str"]),
    (None, TypeError, ["expectiles", "NoneType"]),
]


@pytest.mark.parametrize("i", range(len(EXPECTILE_ERRORS)))
def test_expectile_errors(i, nothing_runs):
    expectiles, exc, words = EXPECTILE_ERRORS[i]
    params, obs, target = _good()
    assert_raises_naming(lambda: iql_value_loss(params, obs, target, expectiles), exc, *words)
    assert nothing_runs == []


def test_empty_batch(nothing_runs):
    params, _, _ = _good()
    assert_raises_naming(lambda: iql_value_loss(params, jnp.zeros((0, 64)), jnp.zeros((0,)), 0.7), ValueError,
                         "obs", "B = 0")
    assert nothing_runs == []


def test_good_inputs_reach_a_path(nothing_runs, monkeypatch):
    """The fixture above does see a call when the arguments are fine (so the error tests can fail)."""
    monkeypatch.setenv("JAXFOX_OPT_IN_KERNELS", "iql")
    iql_value_loss(*_good(), (0.7, 0.9))
    assert nothing_runs == ["dispatch"]
    iql_value_loss(*typical_inputs(2, 32, 6, 5), 0.7)   # H = 6: no kernel, the reference directly
    assert nothing_runs == ["dispatch", "reference"]
    monkeypatch.setenv("JAXFOX_OPT_IN_KERNELS", "")
    iql_value_loss(*_good(), (0.7, 0.9))                # H = 64 not opted in: the reference directly
    assert nothing_runs == ["dispatch", "reference", "reference"]
    iql_value_loss(*typical_inputs(2, 16, 128, 5), 0.7)  # H = 128: the kernel path by default
    assert nothing_runs == ["dispatch", "reference", "reference", "dispatch"]


def _exact_cases():
    return sorted({case[:5] for cases in iql_cases.EXACT.values() for case in cases})


@pytest.mark.parametrize("G,D,H,B,seed", _exact_cases())
def test_exact_inputs_premise(G, D, H, B, seed):
    """Every exact-math case of test_gpu_iql.py and gpu_sanitize_iql.py (tests/iql_cases.py, the (shape, seed)
    pairs those files run) meets the premise of those tests: checked here, so that a broken premise shows on CPU
    (the GPU tests assert it again)."""
    assert_far_from_kinks(*exact_inputs(G, D, H, B, seed=seed))


def test_exact_targets_premise():
    """The vmap-over-target instances of test_gpu_iql.py::test_vmap_matches_per_instance_calls (exact_targets of the
    first VMAP case at each H) meet the premise, and differ from each other."""
    for H in sorted({case[2] for case in iql_cases.VMAP}):
        cases = [case for case in iql_cases.VMAP if case[2] == H]
        G, D, _, B, seed = cases[0]
        params, obs, target = exact_inputs(G, D, H, B, seed=seed)
        targets = exact_targets(params, obs, target, len(cases), seed=seed)
        assert targets.shape == (len(cases), B)
        np.testing.assert_array_equal(targets[0], target)
        for v in range(len(cases)):
            assert_far_from_kinks(params, obs, targets[v])
            assert v == 0 or not np.array_equal(targets[v], targets[v - 1])


def test_every_exact_case_list_is_checked():
    """iql_cases.EXACT names every case list of tests/iql_cases.py, so the premise test above sees every case."""
    lists = {k for k, v in vars(iql_cases).items() if k.isupper() and isinstance(v, list)}
    assert lists == set(iql_cases.EXACT), lists ^ set(iql_cases.EXACT)
    assert all(len(case) >= 5 and all(isinstance(x, int) for x in case[:5])
               for cases in iql_cases.EXACT.values() for case in cases)


# ----------------------------------------------------------------------------------------------
# The CUDA kernel path, lowered for CUDA on this CPU machine (kernels forced on: conftest's kernels_on).
TARGET = "jaxfox_iql_head"


@pytest.fixture
def kernels_on(kernels_on, monkeypatch):
    # conftest's kernels_on, and the IQL kernel opted in (the kernel path is opt-in below H = 128, and most shapes
    # here are smaller)
    monkeypatch.setenv("JAXFOX_OPT_IN_KERNELS", "iql")


def _cuda_text(f, *args):
    return jax.jit(f).trace(*args).lower(lowering_platforms=("cuda",)).as_text()


def _calls(text):
    """[(attrs {name: str}, operand types, result types)] of every jaxfox_iql_head custom call."""
    out = []
    for line in text.splitlines():
        m = re.search(r"custom_call @" + TARGET + r"\(.*mhlo\.backend_config = \{([^}]*)\}.*\} : \((.*)\) -> (.*)$",
                      line)
        if not m:
            continue
        attrs = dict(re.findall(r"(\w+) = ([^,]+?)(?:,|$)", m.group(1)))
        res = m.group(3).strip()
        res = res[1:-1] if res.startswith("(") else res
        out.append(({k: v.strip() for k, v in attrs.items()}, m.group(2).split(", "), res.split(", ")))
    return out


def _dot_types(text):
    """The type signatures of every dot_general in the program."""
    return [line.split(" : ", 1)[1] for line in text.splitlines() if "stablehlo.dot_general" in line]


def _t(*s):
    return "tensor<" + "".join(f"{d}x" for d in s) + "f32>"


def _value_and_grad(taus, argnums):
    def loss(params, obs, target, c):
        return jnp.sum(c * iql_value_loss(params, obs, target, taus))
    return jax.value_and_grad(loss, argnums=argnums)


def _splits(G, B):
    """S: the grid's splits of the 32-row tiles (jaxfox/iql.py: ~264 blocks over the G networks)."""
    return min(-(-B // 32), max(1, 264 // G))


@pytest.mark.parametrize("G,D,H,B", [(2, 256, 128, 37), (2, 256, 128, 4097), (2, 256, 128, 16384),
                                     (1, 64, 64, 1), (3, 128, 64, 1000), (2, 64, 128, 100), (2, 48, 12, 70)])
@pytest.mark.parametrize("argnums", [(0,), (0, 2), (0, 1, 2), (1,)], ids=str)
def test_kernel_path_lowering(kernels_on, G, D, H, B, argnums):
    """One kernel call between XLA's two products: pre = obs [W1_1 | .. | W1_G] (one GEMM of [B, D] and the weights
    as [G H, D]) and dW1 = dpre^T obs (one [G H, B] x [B, D] GEMM; only when the params are differentiated), plus
    d obs = dpre [W1_1 | ..]^T when obs is."""
    params, obs, target = typical_inputs(G, D, H, B)
    taus = taus_for(G)
    text = _cuda_text(_value_and_grad(taus, argnums), params, obs, target, cotangent(G))
    calls = _calls(text)
    assert len(calls) == 1 and text.count("custom_call @jaxfox") == 1, text.count("custom_call @jaxfox")
    attrs, operands, results = calls[0]
    P, S = 2 * H + 4, _splits(G, B)  # ffi/iql.cu IqlHeadImpl: partial rows [db1 | dw2 | db2 | loss | 0 0]
    assert operands == [_t(B, G * H), _t(B), _t(G, H), _t(G, H), _t(G), _t(G)], operands
    assert results == [_t(G, H), _t(G, H), _t(G), _t(G), _t(B, G * H), _t(G, B), _t(S, G, P)], results
    assert set(attrs) == {"inv_batch"}, attrs
    assert abs(float(attrs["inv_batch"].split(":")[0]) - 1.0 / B) <= 1e-7 / B
    if (G, B) == (2, 4097):
        assert S == 129  # ceil(4097 / 32) tiles, fewer than 264 // 2
    dots = _dot_types(text)
    want = [f"({_t(B, D)}, {_t(G * H, D)}) -> {_t(B, G * H)}"]                 # the forward (weights as [G H, D])
    if 0 in argnums:
        want.append(f"({_t(B, G * H)}, {_t(B, D)}) -> {_t(G * H, D)}")          # dW1 (as [G H, D]: dpre^T obs)
    if 1 in argnums:
        want.append(f"({_t(B, G * H)}, {_t(G * H, D)}) -> {_t(B, D)}")          # d obs
    assert sorted(dots) == sorted(want), dots
    assert all("precision = [DEFAULT, DEFAULT]" in line for line in text.splitlines() if "dot_general" in line)
    # nothing of [G, B, H] is computed: the only such values are the zero placeholders that platform_dependent's
    # linearization adds for the reference branch's residuals (broadcast constants, unused: XLA removes them;
    # test_gpu_iql.py checks the compiled program)
    ops = set()
    for line in text.splitlines() if B > 1 else ():  # B = 1: [G, H, B] is w2's shape
        if re.search(rf"tensor<{G}x{B}x{H}x(f32|i1)>|tensor<{G}x{H}x{B}x(f32|i1)>", line):
            m = re.search(r"= \"?stablehlo\.(\w+)|^\s*(stablehlo\.return|\}\))", line)
            ops.add(m.group(1) or m.group(2) if m else line.strip()[:80])
    assert ops <= {"broadcast_in_dim", "stablehlo.return", "})"}, ops


def test_kernel_path_forward_only(kernels_on):
    params, obs, target = typical_inputs(2, 256, 128, 37)
    text = _cuda_text(lambda p, o, t: iql_value_loss(p, o, t, (0.7, 0.9)), params, obs, target)
    assert len(_calls(text)) == 1 and _dot_types(text) == [f"({_t(37, 256)}, {_t(256, 256)}) -> {_t(37, 256)}"]


def test_kernel_path_taus_operand(kernels_on):
    """The expectiles reach the kernel as a constant [G] operand with their values (static: one program each)."""
    params, obs, target = typical_inputs(3, 64, 64, 10)
    text = _cuda_text(lambda p, o, t: iql_value_loss(p, o, t, (0.25, 0.5, 0.75)), params, obs, target)
    assert re.search(r"dense<\[2\.500000e-01, 5\.000000e-01, 7\.500000e-01\]> : tensor<3xf32>", text), \
        [l for l in text.splitlines() if "tensor<3xf32>" in l and "constant" in l]


@pytest.mark.parametrize("G,D,H,B", [(2, 256, 128, 37), (2, 256, 128, 16384), (1, 100, 256, 129), (3, 36, 128, 1)])
@pytest.mark.parametrize("argnums", [(0,), (0, 1, 2), (1,)], ids=str)
def test_fused_path_lowering(kernels_on, monkeypatch, G, D, H, B, argnums):
    """Where the fused kernel applies (forced here: it needs a compute capability 9.0 device), ONE jaxfox_iql_fused
    call takes obs and the weights as [G H, D] (no forward dot_general, no jaxfox_iql_head), its partials have
    ceil(B / 128) rows, dpre comes transposed ([G H, B]), and the backward is XLA's dW1 = dpre^T obs and d obs =
    dpre W1^T, each only when wanted."""
    monkeypatch.setattr(iql_mod, "_fused_supported", lambda *a: True)
    monkeypatch.setattr(iql_mod, "_FUSED_MIN_B", 1)
    params, obs, target = typical_inputs(G, D, H, B)
    text = _cuda_text(_value_and_grad(taus_for(G), argnums), params, obs, target, cotangent(G))
    assert text.count("custom_call @jaxfox_iql_fused") == 1 and text.count("custom_call @jaxfox") == 1
    m = re.search(r"custom_call @jaxfox_iql_fused\(.*mhlo\.backend_config = \{([^}]*)\}.*\} : \((.*)\) -> \((.*)\)$",
                  text, re.M)
    assert m, text
    assert m.group(2).split(", ") == [_t(B, D), _t(G * H, D), _t(B), _t(G, H), _t(G, H), _t(G), _t(G)]
    S = -(-B // 128)
    assert m.group(3).split(", ") == [_t(G, H), _t(G, H), _t(G), _t(G), _t(G * H, B), _t(G, B),
                                      _t(S, G, 2 * H + 4)]
    assert abs(float(dict(re.findall(r"(\w+) = ([^,]+?)(?:,|$)", m.group(1)))["inv_batch"].split(":")[0])
               - 1.0 / B) <= 1e-7 / B
    want = []
    if 0 in argnums:
        want.append(f"({_t(G * H, B)}, {_t(B, D)}) -> {_t(G * H, D)}")          # dW1 as [G H, D]: dpre^T obs
    if 1 in argnums:
        want.append(f"({_t(G * H, B)}, {_t(G * H, D)}) -> {_t(B, D)}")          # d obs = (dpre^T)^T (gcol W1^T)
    assert sorted(_dot_types(text)) == sorted(want), _dot_types(text)


def test_fused_path_needs_hopper_and_its_build(monkeypatch):
    """The fused kernel is chosen only for H = 128 or 256, D a multiple of 4, on compute capability 9.0 with the
    jaxfox_iql_fused target registered (builds with sm_90a machine code), and not when float32 products are asked
    for (its product is TF32)."""
    monkeypatch.setattr(iql_mod, "cuda_compute_capability", lambda: (9, 0))
    monkeypatch.setattr(iql_mod, "has_target", lambda name: name == "jaxfox_iql_fused")
    assert iql_mod._fused_supported(2, 256, 128, 16384) and iql_mod._fused_supported(1, 4, 256, 1)
    assert iql_mod._fused_supported(2, 256, 128, 2**31 - 129) and not iql_mod._fused_supported(2, 256, 128, 2**31 - 128)
    for G, D, H in [(2, 256, 64), (2, 256, 132), (2, 256, 512), (2, 30, 128), (65536, 8, 128)]:
        assert not iql_mod._fused_supported(G, D, H, 100), (G, D, H)
    for cc in [(8, 0), (8, 9), (10, 0), None]:
        monkeypatch.setattr(iql_mod, "cuda_compute_capability", lambda cc=cc: cc)
        assert not iql_mod._fused_supported(2, 256, 128, 100), cc
    monkeypatch.setattr(iql_mod, "cuda_compute_capability", lambda: (9, 0))
    for precision, ok in [("highest", False), ("float32", False), ("tensorfloat32", True), ("bfloat16", True)]:
        with jax.default_matmul_precision(precision):  # float32 products asked for: the head path (XLA's product)
            assert iql_mod._fused_supported(2, 256, 128, 100) is ok, precision
    monkeypatch.setattr(iql_mod, "has_target", lambda name: False)  # a build without sm_90a code
    assert not iql_mod._fused_supported(2, 256, 128, 100)


def test_fused_path_by_default_from_4096_rows(monkeypatch):
    """Where the fused kernel is supported, the kernel path takes it by default from B = 4096 rows on and the head
    path below (at B = 2048 the head path was faster on an H100, BENCHMARKS.md forty-ninth session);
    JAXFOX_OPT_IN_KERNELS=iql (or all) takes it at any B; nothing takes it where it is not supported."""
    monkeypatch.setattr(iql_mod, "cuda_compute_capability", lambda: (9, 0))
    monkeypatch.setattr(iql_mod, "has_target", lambda name: name == "jaxfox_iql_fused")
    assert iql_mod._FUSED_MIN_B == 4096
    for opt_in, small in [(None, False), ("", False), ("grn", False), ("iql", True), ("all", True)]:
        if opt_in is None:
            monkeypatch.delenv("JAXFOX_OPT_IN_KERNELS", raising=False)
        else:
            monkeypatch.setenv("JAXFOX_OPT_IN_KERNELS", opt_in)
        for B, want in [(1, small), (2048, small), (4095, small), (4096, True), (16384, True)]:
            assert iql_mod._fused_chosen(2, 256, 128, B) is want, (opt_in, B)
        assert not iql_mod._fused_chosen(2, 256, 64, 16384) and not iql_mod._fused_chosen(2, 30, 128, 16384)


@pytest.mark.parametrize("B,target", [(100, "jaxfox_iql_head"), (4095, "jaxfox_iql_head"), (4096, "jaxfox_iql_fused")])
def test_default_lowering_by_batch(kernels_on, monkeypatch, B, target):
    """Lowered for CUDA with the fused kernel supported (forced) and nothing opted in: the head kernel below 4096
    rows, the fused kernel from 4096 on, one jaxfox call either way."""
    monkeypatch.setenv("JAXFOX_OPT_IN_KERNELS", "")
    monkeypatch.setattr(iql_mod, "_fused_supported", lambda *a: True)
    params, obs, target_values = typical_inputs(2, 16, 128, B)
    text = _cuda_text(_value_and_grad(taus_for(2), (0,)), params, obs, target_values, cotangent(2))
    assert text.count(f"custom_call @{target}") == 1 and text.count("custom_call @jaxfox") == 1


def _emulated_head_call(cfg, pre, b1, w2, b2, target):
    """jaxfox_iql_head's results written in JAX from ffi/iql.cu's comment (float32 sums in XLA's order): db1, dw2,
    db2, loss, dpre and dy."""
    B = pre.shape[0]
    G, H = b1.shape
    p = pre.reshape(B, G, H) + b1[None]
    h = jnp.maximum(p, 0.0)
    v = jnp.einsum("bgh,gh->bg", h, w2, precision="highest") + b2[None]
    u = target[:, None] - v
    tau = jnp.asarray(cfg.taus, jnp.float32)[None]
    w = jnp.where(u < 0, 1.0 - tau, tau)
    dv = -2.0 * w * u / B
    dpre = jnp.where(p > 0, dv[..., None] * w2[None], 0.0)
    return (dpre.sum(0), jnp.einsum("bgh,bg->gh", h, dv, precision="highest"), dv.sum(0), (w * u * u).mean(0),
            dpre.reshape(B, G * H), -dv.T)


def _emulated_fused_call(cfg, obs, w1t, b1, w2, b2, target):
    """jaxfox_iql_fused's results: jaxfox_iql_head's for pre = obs w1t^T, with dpre transposed ([G H, B])."""
    db1, dw2, db2, loss, dpre, dy = _emulated_head_call(cfg, jnp.dot(obs, w1t.T, precision="highest"), b1, w2, b2,
                                                        target)
    return db1, dw2, db2, loss, dpre.T, dy


@pytest.mark.parametrize("path", ["head", "fused"])
@pytest.mark.parametrize("G,D,H,B", [(2, 32, 16, 50), (3, 24, 8, 7), (1, 16, 4, 1)])
def test_kernel_path_wiring_with_emulated_target(monkeypatch, G, D, H, B, path):
    """The kernel path's Python around the FFI call (the concatenated first layer, the custom_vjp's scaling of the
    kernel's gradients by each loss's cotangent, dpre through XLA's products to dW1 and d obs, d target) against
    the float64 oracle, with the FFI call's results computed in JAX (_emulated_head_call, _emulated_fused_call)
    and the products at the highest precision: every loss and gradient to float32 accuracy, also under vmap. Both
    paths: the head kernel between XLA's products, and the fused kernel (first product and head; its custom_vjp
    scales the small products by the cotangents instead of dpre)."""
    monkeypatch.setattr(iql_mod, "_head_call", _emulated_head_call)
    monkeypatch.setattr(iql_mod, "_fused_call", _emulated_fused_call)
    monkeypatch.setattr(iql_mod, "_fused_supported", lambda *a: path == "fused")
    monkeypatch.setattr(iql_mod, "_FUSED_MIN_B", 1)
    params, obs, target = typical_inputs(G, D, H, B, seed=3)
    taus, c = taus_for(G), cotangent(G)

    def loss(p, o, t):
        (w1, w2), (b1, b2) = p["w"], p["b"]
        return iql_mod._loss_head(iql_mod._Config(taus), w1, b1, w2, b2, o, t)

    with jax.default_matmul_precision("highest"):
        out, vjp = jax.vjp(jax.jit(loss), params, obs, target)
        got = named(*vjp(c))
        want = np_iql_grads(params, obs, target, taus, c)
        np.testing.assert_allclose(out, np_iql_loss(params, obs, target, taus), rtol=2e-5, atol=1e-6)
        for k in GRAD_KEYS:
            assert rel_err(got[k], want[k]) <= 1e-5, (k, rel_err(got[k], want[k]))
        batch = ((obs, target), (2 * obs, -target))
        gv = jax.vmap(jax.grad(lambda p, o, t: jnp.sum(c * loss(p, o, t))), in_axes=(None, 0, 0))(
            params, jnp.stack([o for o, _ in batch]), jnp.stack([t for _, t in batch]))
    for i, (o, t) in enumerate(batch):
        want = np_iql_grads(params, o, t, taus, c)
        for k, leaf in named(gv).items():
            assert rel_err(leaf[i], want[k]) <= 1e-5, (i, k, rel_err(leaf[i], want[k]))


@pytest.mark.parametrize("path", ["head", "fused"])
def test_kernel_path_inside_shard_map(kernels_on, monkeypatch, path):
    """jax.shard_map over 2 devices (params replicated, rows split, the losses pmean-ed): lowered for CUDA, one
    kernel call per device program and all-reduces for the replicated parameters' gradients; on CPU, with the kernel
    path forced and jaxfox_iql_head's results computed in JAX (_emulated_head_call), the values and the gradients
    of params, obs and target equal the unsharded float64 oracle (each device's loss is the mean over its rows, so
    the pmean over equal shards is the mean over the batch). Both paths (the fused one forced; its custom_vjp sums
    the replicated parameters' cotangents itself)."""
    from jax.sharding import AxisType, PartitionSpec

    G, D, H, B = 2, 6, 8, 16
    monkeypatch.setattr(iql_mod, "_fused_supported", lambda *a: path == "fused")
    monkeypatch.setattr(iql_mod, "_FUSED_MIN_B", 1)
    target_name = TARGET if path == "head" else "jaxfox_iql_fused"
    taus, c = taus_for(G), cotangent(G)
    params, obs, target = typical_inputs(G, D, H, B, seed=5)
    mesh = jax.make_mesh((2,), ("x",), axis_types=(AxisType.Auto,), devices=jax.devices()[:2])

    def per_device(p, o, t):
        return jax.lax.pmean(iql_value_loss(p, o, t, taus), "x")

    def f(p, o, t):
        sm = jax.shard_map(per_device, mesh=mesh, in_specs=(PartitionSpec(), PartitionSpec("x"), PartitionSpec("x")),
                           out_specs=PartitionSpec())
        return jnp.sum(c * sm(p, o, t))

    g = jax.value_and_grad(f, argnums=(0, 1, 2))
    text = _cuda_text(g, params, obs, target)
    assert text.count(f"custom_call @{target_name}") == 1 and text.count("custom_call @jaxfox") == 1
    assert "stablehlo.all_reduce" in text
    monkeypatch.setattr(iql_mod, "_head_call", _emulated_head_call)
    monkeypatch.setattr(iql_mod, "_fused_call", _emulated_fused_call)
    monkeypatch.setattr(iql_mod, "dispatch", lambda kernel, reference, *args: kernel(*args))
    with jax.default_matmul_precision("highest"):
        loss, (gp, gobs, gt) = jax.jit(g)(params, obs, target)
    np.testing.assert_allclose(loss, np.sum(np.asarray(c) * np_iql_loss(params, obs, target, taus)), rtol=1e-5)
    want = np_iql_grads(params, obs, target, taus, c)
    got = named(gp, gobs, gt)
    for k in GRAD_KEYS:
        assert rel_err(got[k], want[k]) <= 1e-5, (k, rel_err(got[k], want[k]))


@pytest.mark.parametrize("argnums", [(0,), (0, 1, 2)], ids=str)
@pytest.mark.parametrize("split", ["batch", "params"])
def test_explicit_sharding_runs_the_reference(kernels_on, argnums, split):
    """obs / target split over an Explicit mesh axis (or a parameter split over one): the kernel path is not taken
    (its loss is a mean over the whole batch on one device, its FFI results carry no sharding: the cotangent of
    the batch-split first-layer product would not match its type), the reference's gradient lowers for CUDA, and
    on CPU it equals the unsharded one."""
    from jax.sharding import AxisType, NamedSharding, PartitionSpec

    G, D, H, B = 2, 64, 64, 64
    params, obs, target = typical_inputs(G, D, H, B)
    c = cotangent(G)
    want = _value_and_grad(taus_for(G), argnums)(params, obs, target, c)
    mesh = jax.make_mesh((2,), ("x",), axis_types=(AxisType.Explicit,), devices=jax.devices()[:2])
    with jax.set_mesh(mesh):
        if split == "batch":
            obs, target = jax.device_put((obs, target), NamedSharding(mesh, PartitionSpec("x")))
        else:
            w1 = jax.device_put(params["w"][0], NamedSharding(mesh, PartitionSpec(None, None, "x")))
            params = dict(params, w=[w1, params["w"][1]])
        f = _value_and_grad(taus_for(G), argnums)
        text = _cuda_text(f, params, obs, target, c)
        got = jax.jit(f)(params, obs, target, c)
    assert "custom_call @jaxfox" not in text and "stablehlo.dot_general" in text
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-6)


def test_explicitly_split_reads_the_types():
    from jax.sharding import AxisType, NamedSharding, PartitionSpec

    from jaxfox._ffi import explicitly_split

    x = jnp.zeros((4, 6))
    assert not explicitly_split(x, {"a": [x]})
    for types, want in ((AxisType.Explicit, True), (AxisType.Auto, False)):
        mesh = jax.make_mesh((2,), ("x",), axis_types=(types,), devices=jax.devices()[:2])
        with jax.set_mesh(mesh):
            assert explicitly_split(x, [jax.device_put(x, NamedSharding(mesh, PartitionSpec(None, "x")))]) is want
            assert not explicitly_split(jax.device_put(x, NamedSharding(mesh, PartitionSpec())))


@pytest.mark.parametrize("G,D,H", [(2, 32, 6), (2, 64, 516), (1, 64, 2)])
def test_unsupported_shapes_lower_to_the_reference(kernels_on, G, D, H):
    params, obs, target = typical_inputs(G, D, H, 40)
    text = _cuda_text(_value_and_grad(taus_for(G), (0, 1, 2)), params, obs, target, cotangent(G))
    assert "custom_call @jaxfox" not in text
    assert "stablehlo.dot_general" in text  # the reference's batched GEMMs


def test_reference_and_no_kernels_lower_without_the_call(kernels_on):
    params, obs, target = typical_inputs(2, 256, 128, 37)
    f = _value_and_grad((0.7, 0.9), (0, 1, 2))
    with jaxfox.use_reference():
        text = _cuda_text(f, params, obs, target, cotangent(2))
    assert "custom_call @jaxfox" not in text and "stablehlo.dot_general" in text
    assert cuda_custom_calls(f, params, obs, target, cotangent(2)).keys() == {TARGET}


@pytest.mark.parametrize("opt_in", [None, "", "grn", " iql ", "grn,iql", "all"])
@pytest.mark.parametrize("H", [128, 132, 512, 64, 4])
def test_kernel_by_default_from_h_128_opt_in_below(kernels_on, monkeypatch, opt_in, H):
    """H >= 128: the call on CUDA whatever JAXFOX_OPT_IN_KERNELS names; H < 128: only with ``iql`` (or ``all``)
    named, else XLA code. Inside use_reference(): XLA code always."""
    if opt_in is None:
        monkeypatch.delenv("JAXFOX_OPT_IN_KERNELS", raising=False)
    else:
        monkeypatch.setenv("JAXFOX_OPT_IN_KERNELS", opt_in)
    params, obs, target = typical_inputs(2, 32, H, 37)
    f = _value_and_grad((0.7, 0.9), (0,))
    kernel = H >= 128 or (opt_in or "").strip() in ("iql", "grn,iql", "all")
    assert set(cuda_custom_calls(f, params, obs, target, cotangent(2))) == ({TARGET} if kernel else set())
    with jaxfox.use_reference():
        assert set(cuda_custom_calls(f, params, obs, target, cotangent(2))) == set()


def test_kernels_unavailable_lowers_to_the_reference(monkeypatch):
    """Without kernels (this machine as it is), even a supported shape lowered for CUDA uses the reference."""
    params, obs, target = typical_inputs(2, 256, 128, 37)
    text = _cuda_text(_value_and_grad((0.7, 0.9), (0,)), params, obs, target, cotangent(2))
    assert "custom_call @jaxfox" not in text and "stablehlo.dot_general" in text


def test_kernel_path_vmap_lowering(kernels_on):
    """vmap (vmap_method="sequential"): one call in a loop, with the per-instance operand shapes."""
    V, G, D, H, B = 3, 2, 128, 64, 37
    params, obs, target = typical_inputs(G, D, H, B)
    f = jax.vmap(_value_and_grad((0.7, 0.9), (0, 2)), in_axes=(None, 0, 0, None))
    text = _cuda_text(f, params, jnp.stack([obs] * V), jnp.stack([target] * V), cotangent(G))
    calls = _calls(text)
    assert len(calls) == 1 and "stablehlo.while" in text
    assert calls[0][1][:2] == [_t(B, G * H), _t(B)], calls[0][1]


@pytest.mark.parametrize("cc,H,ok", [((9, 0), 128, True), ((8, 0), 128, True), ((8, 6), 512, True),
                                     ((12, 0), 4, True), ((7, 5), 128, False), ((9, 0), 6, False),
                                     ((9, 0), 516, False), ((9, 0), 0, False)])
def test_kernel_needs_sm80_and_h_a_multiple_of_4(monkeypatch, cc, H, ok):
    """The kernel path is taken on compute capability 8.0 or newer, for H a multiple of 4 in [4, 512] (ffi/iql.cu
    IqlHeadImpl: a lane holds 4 columns of each of up to 4 chunks of 128), for any D (XLA's GEMMs)."""
    monkeypatch.setattr(iql_mod, "cuda_compute_capability", lambda: cc)
    assert iql_mod._kernel_supported(2, H, 100) is ok


def test_kernel_row_and_network_limits(monkeypatch):
    monkeypatch.setattr(iql_mod, "cuda_compute_capability", lambda: (9, 0))
    assert iql_mod._kernel_supported(2, 128, 2**31 - 33)   # the handler's limit: B <= 2^31 - 33
    assert not iql_mod._kernel_supported(2, 128, 2**31 - 32)
    assert iql_mod._kernel_supported(65535, 64, 1) and not iql_mod._kernel_supported(65536, 64, 1)
