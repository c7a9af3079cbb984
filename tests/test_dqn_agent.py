"""BranchingC51 network, the jitted DQN update, and examples/train_dqn.py end to end (CPU)."""

from __future__ import annotations

import importlib.util
import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import jaxfox
from jaxfox import optim, per
from jaxfox.models.branching_c51 import (AgentState, BranchingC51, Transition, batch_loss, epsilon_greedy, forward,
                                         greedy_actions, init_agent, make_update, q_values, support)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _np_forward(p, x, D, A, N):
    """Float64 NumPy forward of the module docstring's equations; returns (value, adv, logits)."""
    p = {k: np.asarray(v, np.float64) for k, v in p.items()}
    h = np.maximum(x @ p["w1"] + p["b1"], 0)
    h = np.maximum(h @ p["w2"] + p["b2"], 0)
    v = h @ p["wv"] + p["bv"]
    a = (h @ p["wa"] + p["ba"]).reshape(x.shape[0], D, A, N)
    return v, a, v[:, None, None, :] + a - a.mean(axis=2, keepdims=True)


def _params(model):
    return {k: np.asarray(v[...]) for k, v in nnx.state(model, nnx.Param).items()}


@pytest.mark.parametrize("D,A,N", [(3, 5, 51), (4, 5, 51), (1, 2, 11)])
def test_shapes_and_dueling_identity(D, A, N):
    model = BranchingC51(48, D, A, N, rngs=nnx.Rngs(0))
    p = _params(model)
    # randomise biases so the identity is not trivially satisfied by zeros
    rng = np.random.default_rng(0)
    for k in ("b1", "b2", "bv", "ba"):
        getattr(model, k)[...] = jnp.asarray(0.3 * rng.standard_normal(p[k].shape), jnp.float32)
    p = _params(model)
    assert p["w1"].shape == (48, 256) and p["w2"].shape == (256, 128)
    assert p["wv"].shape == (128, N) and p["wa"].shape == (128, D * A * N)
    x = rng.standard_normal((7, 48)).astype(np.float32)
    logits = model(jnp.asarray(x))
    assert logits.shape == (7, D, A, N) and logits.dtype == jnp.float32
    v, _, want = _np_forward(p, x.astype(np.float64), D, A, N)
    np.testing.assert_allclose(np.asarray(logits), want, rtol=2e-4, atol=2e-4)
    # dueling identity: the mean over actions of the logits is the value logits, for every branch
    np.testing.assert_allclose(np.asarray(logits).mean(axis=2), np.broadcast_to(v[:, None], (7, D, N)),
                               rtol=2e-4, atol=2e-4)
    with pytest.raises(ValueError, match=r"x must have shape \[B, obs_dim\]"):
        model(jnp.zeros((2, 47)))


def test_bf16_forward_and_master_grad():
    state, _, dan = init_agent(jax.random.key(0), capacity=16)
    x = jax.random.normal(jax.random.key(1), (32, 48))
    lf = forward(state.online, x, dan, bf16=False)
    lb = forward(state.online, x, dan, bf16=True)
    assert lb.dtype == jnp.float32 and lb.shape == (32, 3, 5, 51)
    err = float(jnp.max(jnp.abs(lb - lf)))
    assert 0 < err < 0.05  # bf16 rounding is visible but small
    assert state.online.flat.dtype == jnp.float32
    g = jax.grad(lambda fp: jnp.sum(forward(fp, x, dan, bf16=True) ** 2))(state.online)
    assert g.flat.dtype == jnp.float32 and g.flat.shape == state.online.flat.shape
    gf = jax.grad(lambda fp: jnp.sum(forward(fp, x, dan, bf16=False) ** 2))(state.online)
    cos = float(jnp.dot(g.flat, gf.flat) / (jnp.linalg.norm(g.flat) * jnp.linalg.norm(gf.flat)))
    assert cos > 0.99, cos


def _fixed_items(n, seed=0):
    r = np.random.default_rng(seed)
    return Transition(jnp.asarray(r.standard_normal((n, 48)), jnp.float32),
                      jnp.asarray(r.integers(0, 5, (n, 3)), jnp.int32),
                      jnp.asarray(3.0 * r.standard_normal(n), jnp.float32),
                      jnp.full((n,), 0.9, jnp.float32),
                      jnp.asarray(r.standard_normal((n, 48)), jnp.float32))


def test_update_step_decreases_loss_and_sets_priorities():
    n = 256
    state, opt, dan = init_agent(jax.random.key(0), capacity=n, lr=1e-3)
    z = support()
    items = _fixed_items(n)
    state = state._replace(buffer=per.add(state.buffer, items))
    update = jax.jit(make_update(opt, dan, z, batch_size=128, alpha=0.5, tau=0.005))
    ones = jnp.ones((n,), jnp.float32)
    full = jax.jit(lambda s: batch_loss(s.online, s.target, items, ones, dan, z)[0])
    before = float(full(state))
    target0 = np.asarray(state.target.flat)
    online0 = np.asarray(state.online.flat)
    losses = []
    for i in range(30):
        state, info = update(state, jax.random.key(i), 0.4)
        losses.append(float(info["loss"]))
    after = float(full(state))
    assert np.isfinite(losses).all()
    assert after < before - 0.1, (before, after)  # 4.04 -> 3.86 nats observed (entropy of m is the floor)
    assert int(state.step) == 30 and int(state.opt.count) == 30
    # EMA target moved towards the online params, but is not a copy
    t1, o1 = np.asarray(state.target.flat), np.asarray(state.online.flat)
    assert np.linalg.norm(t1 - o1) < np.linalg.norm(target0 - o1)
    assert not np.array_equal(t1, o1) and not np.array_equal(t1, target0)
    # priorities of the last sampled slots = their per-sample loss + 1e-3
    idx, lb = np.asarray(info["indices"]), np.asarray(info["loss_b"])
    np.testing.assert_allclose(np.asarray(state.buffer.priorities)[idx], lb + 1e-3, rtol=1e-6)
    assert online0.dtype == np.float32 and state.online.flat.dtype == jnp.float32


def test_update_on_an_empty_buffer_changes_nothing():
    """make_update on an empty buffer ran an AdamW step on zero-weight placeholder items, wrote a priority into the
    unfilled slot 0 and raised max_priority. Now a concrete empty buffer raises, and under jit (traced size) the
    state comes back unchanged, leaf for leaf, with NaN losses."""
    state, opt, dan = init_agent(jax.random.key(0), capacity=64, lr=1e-3)
    update = make_update(opt, dan, support(), batch_size=8)
    with pytest.raises(ValueError, match="replay buffer is empty"):
        update(state, jax.random.key(1), 0.4)
    new, info = jax.jit(update)(state, jax.random.key(1), 0.4)
    for a, b in zip(jax.tree.leaves(state), jax.tree.leaves(new), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    assert np.isnan(float(info["loss"])) and np.isnan(np.asarray(info["loss_b"])).all()
    # one item in: the same jitted update learns (the step counter and the optimizer count move)
    state1 = state._replace(buffer=per.add(state.buffer, jax.tree.map(lambda x: x[:1], _fixed_items(4))))
    new1, info1 = jax.jit(update)(state1, jax.random.key(1), 0.4)
    assert int(new1.step) == 1 and int(new1.opt.count) == 1 and np.isfinite(float(info1["loss"]))


# ---------------------------------------------------------------- one update against an independent oracle
def _np_c51_target(p, pt, next_obs, r, discount, z, dan):
    """Float64 NumPy target of OPS.md "Branching C51": online argmax a* (double DQN), target distribution
    p_target(s', a*_d) and its hat-kernel projection m [B, D, N]. Returns (m, a* online [B, D], argmax of the
    target net [B, D]); the latter only shows that the two selections differ in the test's batch."""
    D, A, N = dan
    z = np.asarray(z, np.float64)
    dz = (z[-1] - z[0]) / (N - 1)

    def softmax(l):
        e = np.exp(l - l.max(-1, keepdims=True))
        return e / e.sum(-1, keepdims=True)

    x1 = np.asarray(next_obs, np.float64)
    lo = _np_forward(p, x1, D, A, N)[2]                                        # online logits at s'
    lt = _np_forward(pt, x1, D, A, N)[2]                                       # target logits at s'
    a_on = np.argmax((softmax(lo) * z).sum(-1), axis=-1)                       # first index on ties
    a_tg = np.argmax((softmax(lt) * z).sum(-1), axis=-1)
    pj = softmax(np.take_along_axis(lt, a_on[:, :, None, None], axis=2)[:, :, 0])           # [B, D, N_j]
    r, g = np.asarray(r, np.float64), np.asarray(discount, np.float64)
    tz = np.clip(r[:, None] + g[:, None] * z[None, :], z[0], z[-1])                           # [B, N_j]
    hat = np.clip(1.0 - np.abs(tz[:, None, :] - z[None, :, None]) / dz, 0.0, 1.0)            # [B, N_i, N_j]
    return np.einsum("bij,bdj->bdi", hat, pj), a_on, a_tg


def _np_weighted_ce(p, obs, action, m, w, dan):
    """Float64 NumPy: L = mean_b w_b mean_d -sum_i m_i log_softmax(logits(s, a_d))_i with m constant, and the
    hand-written backprop dL/dparams through the dueling heads, the ReLU trunk and the biases.
    Returns (L, loss_b [B], grads {name: array})."""
    D, A, N = dan
    P = {k: np.asarray(v, np.float64) for k, v in p.items()}
    x = np.asarray(obs, np.float64)
    act = np.asarray(action)
    w = np.asarray(w, np.float64)
    B = x.shape[0]
    pre1 = x @ P["w1"] + P["b1"]
    h1 = np.maximum(pre1, 0)
    pre2 = h1 @ P["w2"] + P["b2"]
    h2 = np.maximum(pre2, 0)
    v = h2 @ P["wv"] + P["bv"]
    adv = (h2 @ P["wa"] + P["ba"]).reshape(B, D, A, N)
    logits = v[:, None, None] + adv - adv.mean(axis=2, keepdims=True)
    chosen = np.take_along_axis(logits, act[:, :, None, None], axis=2)[:, :, 0]               # [B, D, N]
    logp = chosen - chosen.max(-1, keepdims=True)
    logp = logp - np.log(np.exp(logp).sum(-1, keepdims=True))
    loss_b = -(m * logp).sum(-1).mean(-1)
    loss = np.mean(w * loss_b)
    dchosen = (w / (B * D))[:, None, None] * (np.exp(logp) * m.sum(-1, keepdims=True) - m)
    dlogits = np.zeros_like(logits)
    np.put_along_axis(dlogits, act[:, :, None, None], dchosen[:, :, None], axis=2)
    dv = dlogits.sum(axis=(1, 2))
    dadv = (dlogits - dlogits.mean(axis=2, keepdims=True)).reshape(B, D * A * N)
    g = {"wv": h2.T @ dv, "bv": dv.sum(0), "wa": h2.T @ dadv, "ba": dadv.sum(0)}
    dpre2 = (dv @ P["wv"].T + dadv @ P["wa"].T) * (pre2 > 0)
    g["w2"], g["b2"] = h1.T @ dpre2, dpre2.sum(0)
    dpre1 = (dpre2 @ P["w2"].T) * (pre1 > 0)
    g["w1"], g["b1"] = x.T @ dpre1, dpre1.sum(0)
    return loss, loss_b, g


def test_init_agent_and_update_keep_float32_under_x64():
    """With jax_enable_x64 the trunk init's np.float64 scale made the weights float64, which the agent's own
    checks then refused (params['w1'] ... got float64): init and one update step now stay float32."""
    n = 64
    with jax.enable_x64(True):
        state, opt, dan = init_agent(jax.random.key(0), capacity=n, lr=1e-3)
        floats = [l for l in jax.tree.leaves(state) if jnp.issubdtype(l.dtype, jnp.floating)]
        assert floats and {str(l.dtype) for l in floats} == {"float32"}
        state = state._replace(buffer=per.add(state.buffer, _fixed_items(n)))
        update = jax.jit(make_update(opt, dan, support(), batch_size=16, alpha=0.5, tau=0.005))
        new, info = update(state, jax.random.key(1), 0.4)
        assert info["loss"].dtype == jnp.float32 and np.isfinite(float(info["loss"]))
        assert new.online.flat.dtype == jnp.float32
        assert not np.array_equal(np.asarray(new.online.flat), np.asarray(state.online.flat))


def test_update_step_matches_independent_float64_oracle():
    """ONE call of make_update(bf16=False: float32 forward) against an oracle that shares no loss/projection/
    model code with jaxfox: float64 NumPy forward, projection, cross-entropy, IS weights and hand-written
    gradient (itself checked by a central difference), optax.clip_by_global_norm + optax.adamw for the step
    (from a mid-training Adam state), then the EMA target and the priorities. Two optimizers, one call each:
    max_grad_norm 0.5 (below the gradient norm ~1.56: the clip is active, so only the gradient's direction
    reaches Adam) and 5.0 (inactive: the gradient's size reaches Adam too).

    PER draw: per.sample(buffer, key, ...) is called here with the key given to the update (make_update passes
    it to per.sample unchanged); the update's info["indices"] must equal those indices; the draw is checked to
    be stratified over the independently computed prefix sums, and the IS weights are recomputed here from the
    stored priorities, w_i = (n P(i))^-beta / max w, P(i) = p_i^alpha / sum p^alpha.

    Tolerances (jaxfox runs in float32 on CPU, the oracle in float64; optax runs in float32 on the oracle's
    gradient): losses and priorities rtol 2e-6 (~17 float32 ulps; observed <= 2.4e-7); online and EMA target
    parameters rtol 1e-6 + atol 1e-7 (~8 ulps of |theta| ~ 1, observed <= 3e-8, while the step moves every
    leaf by ~lr = 1e-2); the Adam moments: first rtol 1e-5 + atol 5e-8 (observed <= 5.6e-9: ulps of the
    ~0.03 summands and the float32 gradient's error; the gradient's share (1 - b1) g is ~1e-3 per coordinate,
    so a wrong gradient shows), second rtol 2e-6 (observed <= 2.5e-7; the g^2 share is ~2 %).
    """
    D, A, N, F, H1, H2 = 2, 3, 11, 6, 16, 12
    dan = (D, A, N)
    B, C, n = 8, 32, 27
    alpha, beta, tau, eps_p = 0.7, 0.6, 0.25, 1e-3
    lr, wd, b1, b2, adam_eps, count0 = 1e-2, 0.05, 0.9, 0.999, 1e-8, 3
    rng = np.random.default_rng(7)

    shapes = {"w1": (F, H1), "b1": (H1,), "w2": (H1, H2), "b2": (H2,), "wv": (H2, N), "bv": (N,),
              "wa": (H2, D * A * N), "ba": (D * A * N,)}
    fan = {"w1": F, "w2": H1, "wv": H2, "wa": H2}
    p0 = {k: (rng.standard_normal(s) / np.sqrt(fan[k]) if k in fan else 0.3 * rng.standard_normal(s))
          .astype(np.float32) for k, s in shapes.items()}
    # the target net differs from the online net, so that the double-DQN selection is observable
    pt0 = {k: (v + 0.5 * np.std(v) * rng.standard_normal(v.shape)).astype(np.float32) for k, v in p0.items()}
    # a mid-training optimizer state: at count 0 Adam's step is lr * sign(g), blind to |g| and to clipping
    mu0 = {k: (0.01 * rng.standard_normal(s)).astype(np.float32) for k, s in shapes.items()}
    nu0 = {k: (1e-4 * (0.5 + rng.random(s))).astype(np.float32) for k, s in shapes.items()}
    fp = lambda t: jaxfox.FlatParams.from_tree({k: jnp.asarray(v) for k, v in t.items()})  # noqa: E731

    z = support(N, v_max=5.0)  # dz = 1
    items = Transition(rng.standard_normal((n, F)).astype(np.float32),
                       rng.integers(0, A, (n, D)).astype(np.int32),
                       (2.5 * rng.standard_normal(n)).astype(np.float32),  # some Tz beyond +-5: clipped
                       np.where(rng.random(n) < 0.25, 0.0, 0.9).astype(np.float32),
                       rng.standard_normal((n, F)).astype(np.float32))
    items.reward[::5], items.discount[::5] = 1.0, 0.0  # terminal, Tz on the support point z = 1
    spec = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape[1:], a.dtype), items)
    buf = per.add(per.init(C, spec), jax.tree.map(jnp.asarray, items))
    prio0 = rng.uniform(0.05, 4.0, n).astype(np.float32)
    buf = per.update(buf, jnp.arange(n, dtype=jnp.int32), jnp.asarray(prio0))
    key = jax.random.key(11)

    # --- PER draw and IS weights
    idx, w_lib = (np.asarray(a) for a in per.sample(buf, key, B, alpha=alpha, beta=beta))
    q = prio0.astype(np.float64) ** alpha
    S = q.sum()
    c = np.cumsum(q)
    k = np.arange(B)
    assert (idx >= 0).all() and (idx < n).all()
    # stratified: slot idx_k's prefix interval [c_{i-1}, c_i) meets stratum [k/B, (k+1)/B) * S
    assert np.all(c[idx] >= k / B * S * (1 - 1e-6)) and np.all((c - q)[idx] <= (k + 1) / B * S * (1 + 1e-6))
    w = (n * q[idx] / S) ** -beta
    w = w / w.max()
    np.testing.assert_allclose(w_lib, w, rtol=1e-5)
    assert w.min() < 0.8, w  # the IS weights are far from uniform: dropping them changes the loss

    # --- loss and gradient (float64 oracle)
    bt = Transition(*(a[idx] for a in items))
    m, a_on, a_tg = _np_c51_target(p0, pt0, bt.next_obs, bt.reward, bt.discount, z, dan)
    # (not 1e-12: the float32 support has z_6 = 1.0000001, so its spacing is uniform only to ~1e-7)
    np.testing.assert_allclose(m.sum(-1), 1.0, atol=1e-6)
    assert (a_on != a_tg).any()  # selecting a* with the target net would give another target here
    loss, loss_b, g = _np_weighted_ce(p0, bt.obs, bt.action, m, w, dan)
    d = {kk: rng.standard_normal(s) for kk, s in shapes.items()}  # central difference along d
    h = 1e-6

    def shifted(sgn):
        return _np_weighted_ce({kk: p0[kk] + sgn * h * d[kk] for kk in p0}, bt.obs, bt.action, m, w, dan)[0]

    fd = (shifted(1) - shifted(-1)) / (2 * h)
    np.testing.assert_allclose(sum(np.sum(g[kk] * d[kk]) for kk in g), fd, rtol=1e-6)
    gnorm = np.sqrt(sum(np.sum(v ** 2) for v in g.values()))
    assert 1.0 < gnorm < 2.5, gnorm  # between the two clipping thresholds below (by a factor 2)

    j32 = lambda t: {kk: jnp.asarray(v, jnp.float32) for kk, v in t.items()}  # noqa: E731
    mask = {kk: v.ndim >= 2 for kk, v in p0.items()}  # optax.adamw decays weight matrices only (the default mask)
    for max_norm in (0.5, 5.0):
        opt = jaxfox.fused_adamw(lr, b1, b2, adam_eps, weight_decay=wd, max_grad_norm=max_norm)
        opt_state = optim.FusedAdamWState(jnp.asarray(count0, jnp.int32), fp(mu0), fp(nu0))
        state = AgentState(fp(p0), fp(pt0), opt_state, buf, jnp.zeros((), jnp.int32))
        update = jax.jit(make_update(opt, dan, z, batch_size=B, alpha=alpha, tau=tau, priority_eps=eps_p,
                                     bf16=False))
        new, info = update(state, key, beta)
        np.testing.assert_array_equal(np.asarray(info["indices"]), idx)
        np.testing.assert_allclose(float(info["loss"]), loss, rtol=2e-6)
        np.testing.assert_allclose(np.asarray(info["loss_b"]), loss_b, rtol=2e-6)
        np.testing.assert_allclose(float(info["loss_unweighted"]), loss_b.mean(), rtol=2e-6)

        # --- optimizer step: optax from the same mid-training state
        tx = optax.chain(optax.clip_by_global_norm(max_norm),
                         optax.adamw(lr, b1, b2, adam_eps, weight_decay=wd, mask=mask))
        st = optax.tree_utils.tree_set(tx.init(j32(p0)), count=jnp.asarray(count0, jnp.int32), mu=j32(mu0),
                                       nu=j32(nu0))

        @jax.jit  # one compilation instead of one per eager optax op
        def optax_step(grads, s, params, tx=tx):
            upd, s1 = tx.update(grads, s, params)
            return optax.apply_updates(params, upd), s1

        p1, st1 = optax_step(j32(g), st, j32(p0))
        p1 = {kk: np.asarray(v, np.float64) for kk, v in p1.items()}
        mu1, nu1 = optax.tree_utils.tree_get(st1, "mu"), optax.tree_utils.tree_get(st1, "nu")
        got_online, got_target = new.online.tree, new.target.tree
        got_mu, got_nu = new.opt.mu.tree, new.opt.nu.tree
        for kk in shapes:
            msg = f"{kk}, max_grad_norm {max_norm}"
            assert np.max(np.abs(p1[kk] - p0[kk])) > 1e-3, msg  # every leaf moves by ~lr >> the tolerance
            np.testing.assert_allclose(np.asarray(got_online[kk]), p1[kk], rtol=1e-6, atol=1e-7, err_msg=msg)
            np.testing.assert_allclose(np.asarray(got_mu[kk]), np.asarray(mu1[kk]), rtol=1e-5, atol=5e-8,
                                       err_msg=msg)
            np.testing.assert_allclose(np.asarray(got_nu[kk]), np.asarray(nu1[kk]), rtol=2e-6, err_msg=msg)
            # EMA target: tau * online' + (1 - tau) * target
            np.testing.assert_allclose(np.asarray(got_target[kk]), tau * p1[kk] + (1 - tau) * pt0[kk],
                                       rtol=1e-6, atol=1e-7, err_msg=msg)
        assert int(new.opt.count) == count0 + 1 and int(new.step) == 1

        # --- priorities: sampled slots <- loss_b + eps (duplicates carry equal losses), the rest unchanged
        want = np.zeros(C)
        want[:n] = prio0
        want[idx] = loss_b + eps_p
        np.testing.assert_allclose(np.asarray(new.buffer.priorities), want, rtol=2e-6)
        np.testing.assert_allclose(float(new.buffer.max_priority), max(1.0, prio0.max(), want.max()), rtol=2e-6)


def test_greedy_and_epsilon_greedy_match_numpy_and_refuse_bad_input():
    """greedy_actions against a float64 NumPy argmax of Q = sum_i z_i softmax(logits)_i (ties -> first index);
    epsilon_greedy: epsilon 0 is greedy, epsilon 1 uniform in every branch, the exploring draw independent per
    branch, same key -> same actions. Bad inputs used to fail deep inside (obs [B, 47]: a dot_general TypeError;
    obs [48]: a reshape error; dan not matching the params: a reshape error; a length-1 z broadcast silently to
    Q = z for every action, so the greedy action was always 0; epsilon 1.5, -0.1 or NaN ran as 1, 0 and 0)."""
    D, A, N = 3, 5, 11
    state, _, dan = init_agent(jax.random.key(0), num_branches=D, num_actions=A, num_atoms=N, capacity=16)
    z = support(N, v_max=5.0)
    rng = np.random.default_rng(3)
    obs = jnp.asarray(rng.standard_normal((4000, 48)), jnp.float32)
    p = {k: np.asarray(v) for k, v in state.online.tree.items()}
    logits = _np_forward(p, np.asarray(obs, np.float64), D, A, N)[2]
    e = np.exp(logits - logits.max(-1, keepdims=True))
    q = (e / e.sum(-1, keepdims=True) * np.asarray(z, np.float64)).sum(-1)                      # [B, D, A]
    srt = np.sort(q, axis=-1)
    clear = srt[..., -1] - srt[..., -2] > 1e-4                                                   # no near-ties
    assert clear.mean() > 0.95
    g = np.asarray(greedy_actions(state.online, obs, dan, z, bf16=False))
    assert g.shape == (4000, D) and g.dtype == np.int32
    np.testing.assert_array_equal(g[clear], np.argmax(q, -1)[clear])
    # an exact tie between actions 1 and 3 (advantage head = its bias, the same for both) -> action 1 everywhere
    tie = dict(p, wa=np.zeros_like(p["wa"]), ba=np.zeros((D, A, N), np.float32))
    tie["ba"][:, 1, -1] = tie["ba"][:, 3, -1] = 2.0                                              # mass on z = +5
    tie["ba"] = tie["ba"].reshape(-1)
    tie_fp = jaxfox.FlatParams.from_tree({k: jnp.asarray(v) for k, v in tie.items()})
    for bf16 in (False, True):
        np.testing.assert_array_equal(np.asarray(greedy_actions(tie_fp, obs[:64], dan, z, bf16=bf16)), 1)

    gb = np.asarray(greedy_actions(state.online, obs, dan, z))                                   # bf16 forward
    eg = lambda key, eps: np.asarray(epsilon_greedy(key, state.online, obs, dan, z, eps))  # noqa: E731
    np.testing.assert_array_equal(eg(jax.random.key(1), 0.0), gb)
    a1 = eg(jax.random.key(1), 1.0)
    for d in range(D):  # uniform over the A actions in each branch: counts within 5 sigma of 4000 / A
        c = np.bincount(a1[:, d], minlength=A)
        assert np.all(np.abs(c - 800) < 5 * np.sqrt(4000 * 0.2 * 0.8)), (d, c)
    a = eg(jax.random.key(2), 0.5)
    np.testing.assert_array_equal(a, eg(jax.random.key(2), 0.5))
    assert not np.array_equal(a, eg(jax.random.key(3), 0.5))
    # P(a_d = greedy_d) = 1 - eps + eps / A = 0.6 per branch; all three greedy: 0.6^3 = 0.216 when the branches
    # explore independently (0.5 + 0.5 / 125 = 0.504 with one shared draw). 5-sigma bounds.
    same = a == gb
    assert np.all(np.abs(same.mean(0) - 0.6) < 5 * np.sqrt(0.24 / 4000)), same.mean(0)
    assert abs(same.all(1).mean() - 0.216) < 5 * np.sqrt(0.216 * 0.784 / 4000), same.all(1).mean()
    # a traced epsilon (a schedule under jit) is not checked, and gives the same actions as the concrete one
    jit_eg = jax.jit(lambda k, fp, o, e: epsilon_greedy(k, fp, o, dan, z, e))
    np.testing.assert_array_equal(np.asarray(jit_eg(jax.random.key(2), state.online, obs, 0.5)), a)

    with pytest.raises(ValueError, match=r"^obs must have shape \[B, F\] = \[\?, 48\]"):
        greedy_actions(state.online, obs[:, :47], dan, z)
    with pytest.raises(ValueError, match=r"^obs must have shape \[B, F\]"):
        forward(state.online, obs[0], dan)
    for bad in ((3, 5, 10), (3, 4, 11), (3, 5), (15, 1, 11.0)):
        with pytest.raises(ValueError, match=r"^dan must be \(D, A, N\)"):
            forward(state.online, obs[:4], bad)
    for bad_z in (z[:1], z[:-1], z[None]):
        with pytest.raises(ValueError, match=r"^z must have shape \[N\] = \[11\]"):
            greedy_actions(state.online, obs[:4], dan, bad_z)
    for eps in (1.5, -0.1, float("nan"), np.ones(2)):
        with pytest.raises(ValueError, match="^epsilon must be"):
            epsilon_greedy(jax.random.key(0), state.online, obs[:4], dan, z, eps)
    for eps in (True, np.bool_(False), "0.1"):
        with pytest.raises(TypeError, match="^epsilon must be a real scalar"):
            epsilon_greedy(jax.random.key(0), state.online, obs[:4], dan, z, eps)


def test_bad_sizes_support_and_update_arguments_raise_naming_them():
    # hidden was unpacked unchecked: (256,) gave an IndexError, 3 widths a bare unpacking error
    for hidden in ((256,), (256, 128, 64), 256):
        with pytest.raises(ValueError, match="^hidden must be a pair"):
            BranchingC51(hidden=hidden, rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match=r"^hidden\[1\] must be an int >= 1"):
        BranchingC51(hidden=(8, 0), rngs=nnx.Rngs(0))
    m = BranchingC51(6, 2, 3, 5, hidden=[16, 8], rngs=nnx.Rngs(0))
    assert _params(m)["w1"].shape == (6, 16) and _params(m)["w2"].shape == (16, 8)
    # a nested list gave "AttributeError: 'list' object has no attribute 'shape'"
    with pytest.raises(TypeError, match=r"^x must be an array \[B, obs_dim\] = \[\?, 6\], got list"):
        m([[0.0] * 6])
    # support: num_atoms was unchecked (1 -> the single atom -v_max, 0 -> an empty support) and a bool v_max
    # passed while a NumPy float32 was refused
    for n in (1, 0, True, 51.0):
        with pytest.raises(ValueError, match="^num_atoms must be an int >= 2"):
            support(n, 25.0)
    for v in (0.0, float("inf"), -1):
        with pytest.raises(ValueError, match=r"^v_max must be finite and in \(0, inf\)"):
            support(11, v)
    for v in (True, "25", None):
        with pytest.raises(TypeError, match="^v_max must be a real scalar"):
            support(11, v)
    np.testing.assert_allclose(np.asarray(support(np.int64(11), np.float32(2.0))), np.linspace(-2.0, 2.0, 11),
                               rtol=0, atol=1e-6)
    # a v_max finite as a float64 but not in float32 (or with a span 2 v_max beyond float32) gave a NaN support
    for v in (1e39, 2e38):
        with pytest.raises(ValueError, match=r"^v_max must be at most float32's max / 2"):
            support(11, v)
    top = float(np.finfo(np.float32).max) / 2
    np.testing.assert_allclose(np.asarray(support(3, top), np.float64), [-top, 0.0, top], rtol=1e-7, atol=0)
    # make_update: a negative priority_eps was accepted (under jit a negative priority is stored as 0: that
    # slot is never sampled again); a float batch size failed deep inside the sampler
    _, opt, dan = init_agent(jax.random.key(0), capacity=64)
    z = support(dan[2])
    for kw, name in (({"priority_eps": -1e-3}, "priority_eps"), ({"priority_eps": float("nan")}, "priority_eps"),
                     ({"batch_size": 16.0}, "batch_size"), ({"batch_size": 0}, "batch_size")):
        with pytest.raises(ValueError, match=f"^{name} must be"):
            make_update(opt, dan, z, **kw)
    with pytest.raises(TypeError, match="^priority_eps must be a real scalar"):
        make_update(opt, dan, z, priority_eps=True)
    # alpha and tau were checked only when the update was first traced; beta never: inside the update's shard_map it
    # is a tracer, so per.sample could not check it, and beta = nan made the online parameters NaN without an error
    for kw, name in (({"alpha": -1.0}, "alpha"), ({"tau": 2.0}, "tau"), ({"tau": float("nan")}, "tau")):
        with pytest.raises(ValueError, match=f"^{name} must be finite and in"):
            make_update(opt, dan, z, **kw)
    state, opt, dan = init_agent(jax.random.key(0), capacity=64)
    state = state._replace(buffer=per.add(state.buffer, _fixed_items(8, seed=1)))
    update = make_update(opt, dan, z, batch_size=8)  # the tests' 8 CPU devices share the batch
    for beta in (float("nan"), 5.0, -3.0):
        with pytest.raises(ValueError, match=r"^beta must be finite and in \[0, 1\]"):
            update(state, jax.random.key(1), beta)
    with pytest.raises(TypeError, match="^beta must be a real scalar"):
        update(state, jax.random.key(1), True)
    new, info = update(state, jax.random.key(1), 0.5)  # a traced beta (under jit) is not checked, as per.sample's
    assert int(new.step) == 1 and np.isfinite(float(info["loss"]))
    # forward on a params dict, q_values on a list: AttributeError ('dict' has no 'flat', 'list' has no 'shape')
    with pytest.raises(TypeError, match="^fp must be a jaxfox.FlatParams .*got dict"):
        forward(state.online.tree, jnp.zeros((2, 48), jnp.float32), dan)
    with pytest.raises(TypeError, match=r"^logits must be an array \[\.\.\., N\], got list"):
        q_values([[0.0] * dan[2]], z)


def _load_train_dqn():
    spec = importlib.util.spec_from_file_location("train_dqn", os.path.join(ROOT, "examples", "train_dqn.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_train_dqn_main_tiny(tmp_path):
    mod = _load_train_dqn()
    out = str(tmp_path / "dqn")
    # --chunk 8 does not divide --steps 20: the last scan runs the remaining 4 (it ran a whole chunk: 24 updates)
    m = mod.main(["--steps", "20", "--num-envs", "8", "--batch-size", "64", "--capacity", "4096",
                  "--learning-starts", "256", "--chunk", "8", "--out", out])
    with open(os.path.join(out, "metrics.json")) as f:
        disk = json.load(f)
    assert disk["updates"] == 20 and m["updates"] == 20
    # transitions collected (the warm-up's 256 plus 8 a step); it was the buffer's size, capped at --capacity
    assert disk["transitions"] == 256 + 20 * 8 and disk["buffer_size"] == min(4096, 256 + 20 * 8)
    for k in ("agent", "buy_and_hold", "equal_weight", "flat"):
        for v in disk["test"][k].values():
            assert np.isfinite(v)
    assert np.isfinite(disk["final_loss"])
    assert disk["test"]["flat"]["total_log_return"] == 0.0
    # buy & hold (+1 everywhere) over the test span, independently from the arch closes: the sum of daily log
    # returns of each instrument is log(last close / first close); one entry cost of 3 units * 5 bps.
    from arch.data import nasdaq, sp500, wti
    import pandas as pd

    c = pd.concat([sp500.load()["Close"], nasdaq.load()["Close"], wti.load()["DCOILWTICO"]], axis=1,
                  join="inner").dropna()
    c.index = pd.DatetimeIndex(c.index)
    c = c[(c.index >= "2016-01-04") & (c.index <= "2018-12-28")].to_numpy(np.float64)
    want = float(np.sum(np.log(c[-1] / c[0])) - 3 * 5e-4)
    assert disk["test"]["buy_and_hold"]["total_log_return"] == pytest.approx(want, abs=1e-4)
    assert disk["test"]["equal_weight"]["total_log_return"] == pytest.approx((want + 3 * 5e-4) / 3 - 5e-4, abs=1e-4)
    assert disk["test_days"] == 749
    for png in ("equity.png", "loss.png"):
        assert os.path.getsize(os.path.join(out, png)) > 1000
    curves = np.load(os.path.join(out, "curves.npz"))
    assert curves["agent"].shape == curves["buy_and_hold"].shape == (749,) and curves["positions"].shape == (749, 3)
    assert str(curves["dates"][0]) == "2016-01-05" and str(curves["dates"][-1]) == "2018-12-28"
    assert float(curves["buy_and_hold"].sum()) == pytest.approx(want, abs=1e-4)
    assert float(curves["agent"].sum()) == pytest.approx(disk["test"]["agent"]["total_log_return"], abs=1e-9)
    assert set(np.unique(curves["positions"])) <= {-1.0, -0.5, 0.0, 0.5, 1.0}


def test_cli_rejects_bad_args():
    mod = _load_train_dqn()
    with pytest.raises(SystemExit):
        mod.parse_args(["--steps", "0"])
    with pytest.raises(SystemExit):
        mod.parse_args(["--batch-size", "1024", "--learning-starts", "100"])
    # flags that were passed on unchecked (a negative or zero reward scale trains the agent on inverted or no
    # rewards without any error; a beta0 outside [0, 1] failed only after the data had loaded)
    for bad in (["--reward-scale", "-100"], ["--reward-scale", "0"], ["--reward-scale", "nan"], ["--v-max", "0"],
                ["--beta0", "1.5"], ["--alpha", "-0.5"], ["--lr", "-1e-4"], ["--max-grad-norm", "inf"],
                ["--cost-bps", "-5"], ["--weight-decay", "nan"], ["--out", __file__]):
        with pytest.raises(SystemExit):
            mod.parse_args(bad)
    a = mod.parse_args(["--reward-scale", "1", "--v-max", "0.25", "--beta0", "1", "--alpha", "0"])
    assert (a.reward_scale, a.v_max, a.beta0, a.alpha) == (1.0, 0.25, 1.0, 0.0)


def test_train_dqn_episode_longer_than_the_data_is_a_usage_error(tmp_path, capsys):
    """--episode-len beyond the instruments' train span ended in the env's ValueError traceback; the folder is not
    created for a run that cannot start."""
    out = tmp_path / "never"
    with pytest.raises(SystemExit) as e:
        _load_train_dqn().main(["--episode-len", "100000", "--steps", "1", "--out", str(out)])
    err = capsys.readouterr().err.strip().splitlines()
    assert e.value.code == 2 and "--episode-len 100000: episode_len must be <= " in err[-1], err
    assert "Traceback" not in "\n".join(err) and not out.exists()


def _load_example(name):
    spec = importlib.util.spec_from_file_location(name, os.path.join(ROOT, "examples", f"{name}.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_cartpole_cli_rejects_bad_args():
    # parse_args needs no gymnax (gymnax is only in the `examples` extra: it pins jax<0.12).
    mod = _load_example("train_cartpole")
    a = mod.parse_args([])
    assert (a.lr, a.gamma, a.num_atoms, a.v_max, a.batch_size, a.stop_at) == (2.5e-4, 0.99, 101, 100.0, 128, 475.0)
    for bad in (["--total-steps", "100"], ["--batch-size", "512", "--learning-starts", "100"],
                ["--gamma", "1.0"], ["--num-atoms", "1"], ["--tau", "2"], ["--v-max", "0"],
                # a budget with no training step after the warm-up (learning_starts rounds up to whole steps of
                # the envs: 1005 - 1000 ran 0 updates and exited 0), and values that failed deep inside jaxfox
                # after JAX and gymnax had loaded, or were taken silently (--stop-at nan)
                ["--total-steps", "1005", "--learning-starts", "1000"], ["--alpha", "-1"], ["--beta0", "5"],
                ["--lr", "-1"], ["--weight-decay", "-1"], ["--max-grad-norm", "-1"], ["--v-max", "inf"],
                ["--stop-at", "nan"], ["--out", __file__]):
        with pytest.raises(SystemExit):
            mod.parse_args(bad)
    assert mod.parse_args(["--total-steps", "1010", "--learning-starts", "1000"]).total_steps == 1010
    assert mod.parse_args(["--stop-at", "inf"]).stop_at == float("inf")


# ---------------------------------------------------------------- the notebook
def test_dqn_notebook_executes(tmp_path, monkeypatch):
    from conftest import execute_notebook

    env = {f"JAXFOX_NB_DQN_{k}": v for k, v in (("STEPS", "20"), ("ENVS", "8"), ("BATCH", "64"), ("WARMUP", "256"))}
    env.update(JAXFOX_NB_PER_DRAWS="500", JAXFOX_NB_OUT=str(tmp_path / "dqn"))
    # the notebook's own asserts (projection/loss vs NumPy, PER) raise CellExecutionError
    nb, text = execute_notebook("dqn.ipynb", tmp_path, monkeypatch, env)
    assert "draws of the zero-priority slots 0 and 6: 0 0" in text
    assert "buy_and_hold" in text and "20 updates" in text
    m = json.load(open(tmp_path / "dqn" / "metrics.json"))
    assert m["updates"] == 20 and m["test"]["flat"]["total_log_return"] == 0.0
    imgs = [o for c in nb.cells if c.cell_type == "code" for o in c.get("outputs", []) if "image/png" in o.get("data", {})]
    assert len(imgs) == 3  # projection, PER frequencies, equity curves
