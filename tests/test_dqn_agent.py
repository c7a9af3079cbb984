"""BranchingC51 network, the jitted DQN update, and examples/train_dqn.py end to end (CPU)."""

from __future__ import annotations

import importlib.util
import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import jaxfox
from jaxfox import per
from jaxfox.models.branching_c51 import (BranchingC51, Transition, batch_loss, forward, init_agent, make_update,
                                         support)

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


def _load_train_dqn():
    spec = importlib.util.spec_from_file_location("train_dqn", os.path.join(ROOT, "examples", "train_dqn.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_train_dqn_main_tiny(tmp_path):
    mod = _load_train_dqn()
    out = str(tmp_path / "dqn")
    m = mod.main(["--steps", "20", "--num-envs", "8", "--batch-size", "64", "--capacity", "4096",
                  "--learning-starts", "256", "--chunk", "10", "--out", out])
    with open(os.path.join(out, "metrics.json")) as f:
        disk = json.load(f)
    assert disk["updates"] == 20 and m["updates"] == 20
    assert disk["transitions"] == 256 + 20 * 8
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
                ["--gamma", "1.0"], ["--num-atoms", "1"], ["--tau", "2"], ["--v-max", "0"]):
        with pytest.raises(SystemExit):
            mod.parse_args(bad)


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
