"""Auxiliary trainers (jaxfox.models.aux), examples/train_aux.py and examples/aux.ipynb (CPU)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxfox.models.aux import (AuxConfig, attention_predict, iql_init, iql_values, iqn_init, iqn_quantiles,
                               make_aux, synthetic_batch)

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = ROOT / "examples"
SMALL = AuxConfig(obs_dim=16, iql_hidden=(32,), iqn_hidden=32, n_quantiles=8, n_target_quantiles=8, n_cos=16,
                  seq_len=6, seq_dim=16, num_heads=4, lr=3e-3)


def np_relu(x):
    return np.maximum(x, 0.0)


def test_iql_values_match_numpy_all_impls():
    p = iql_init(jax.random.key(0), 16, (32, 8), num_networks=2)
    obs = jax.random.normal(jax.random.key(1), (10, 16), jnp.float32)
    x = np.asarray(obs, np.float64)
    ref = np.zeros((10, 2))
    for g in range(2):
        h = x
        for l in range(3):
            h = h @ np.asarray(p["w"][l][g], np.float64) + np.asarray(p["b"][l][g], np.float64)
            h = h if l == 2 else np_relu(h)
        ref[:, g] = h[:, 0]
    with jax.default_matmul_precision("highest"):
        for impl in ("grouped", "grouped_list", "vmap"):
            got = np.asarray(iql_values(p, obs, impl))
            assert got.shape == (10, 2)
            np.testing.assert_allclose(got, ref, rtol=1e-5, atol=1e-5, err_msg=impl)
    with pytest.raises(ValueError, match=r"obs must have shape \[B, F\] = \[\?, 16\]"):
        iql_values(p, obs[:, :8])
    with pytest.raises(ValueError, match="impl"):
        iql_values(p, obs, "loop")


@pytest.mark.parametrize("impl", ["grouped", "fused"])
def test_iql_grads_equal_vmap(impl):
    tr_g = make_aux(SMALL, iql_impl=impl)
    tr_v = make_aux(SMALL, iql_impl="vmap")
    st = tr_g.init(jax.random.key(0))
    b = synthetic_batch(jax.random.key(1), SMALL, 64)
    with jax.default_matmul_precision("highest"):
        s1, i1 = jax.jit(tr_g.iql_step)(st.iql, b["iql"])
        s2, i2 = jax.jit(tr_v.iql_step)(st.iql, b["iql"])
    np.testing.assert_allclose(float(i1["iql"]), float(i2["iql"]), rtol=1e-6)
    for a, c in zip(jax.tree.leaves(s1.params), jax.tree.leaves(s2.params)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(c), rtol=1e-5, atol=1e-6)


def test_iql_loss_is_expectile_of_numpy():
    tr = make_aux(SMALL)
    st = tr.init(jax.random.key(3))
    b = synthetic_batch(jax.random.key(4), SMALL, 32)
    with jax.default_matmul_precision("highest"):
        _, info = tr.iql_step(st.iql, b["iql"])
        v = np.asarray(iql_values(st.iql.params, b["iql"]["obs"], "vmap"), np.float64)
    u = np.asarray(b["iql"]["q"], np.float64)[:, None] - v
    w = np.where(u < 0, 1 - np.array([0.7, 0.9]), np.array([0.7, 0.9]))
    per_net = (w * u ** 2).mean(0)
    np.testing.assert_allclose(np.asarray(info["iql_per_net"]), per_net, rtol=1e-5)


def test_iqn_quantiles_shape_and_monotone_embedding_input():
    p = iqn_init(jax.random.key(0), 16, 32, 16)
    z = iqn_quantiles(p, jnp.ones((3, 16)), jnp.full((3, 5), 0.5), 16)
    assert z.shape == (3, 5) and z.dtype == jnp.float32
    # Same tau -> same value for every quantile slot.
    np.testing.assert_allclose(np.asarray(z), np.asarray(z[:, :1]).repeat(5, 1), rtol=1e-6)


@pytest.mark.parametrize("which", ["iql_step", "iqn_step", "attention_step"])
def test_each_trainer_loss_falls_alone(which):
    tr = make_aux(SMALL)
    st = tr.init(jax.random.key(0))
    b = synthetic_batch(jax.random.key(1), SMALL, 256)
    name = {"iql_step": "iql", "iqn_step": "iqn", "attention_step": "attn"}[which]
    step = jax.jit(getattr(tr, which))
    ts = getattr(st, name)
    losses = []
    for _ in range(40):
        ts, info = step(ts, b[name])
        losses.append(float(info[name]))
    assert all(np.isfinite(losses))
    assert np.mean(losses[-5:]) < 0.6 * np.mean(losses[:3]), losses
    assert int(ts.step) == 40


def test_aux_step_equals_separate_steps_and_sequential():
    tr = make_aux(SMALL)
    st = tr.init(jax.random.key(0))
    b = synthetic_batch(jax.random.key(1), SMALL, 64)
    new, info = jax.jit(tr.aux_step)(st, b)
    s1, i1 = jax.jit(tr.iql_step)(st.iql, b["iql"])
    s2, i2 = jax.jit(tr.iqn_step)(st.iqn, b["iqn"])
    s3, i3 = jax.jit(tr.attention_step)(st.attn, b["attn"])
    for k, v in {**i1, **i2, **i3}.items():
        np.testing.assert_allclose(np.asarray(info[k]), np.asarray(v), rtol=1e-6, atol=1e-7, err_msg=k)
    for a, c in zip(jax.tree.leaves((new.iql.params, new.iqn.params, new.iqn.target, new.attn.params)),
                    jax.tree.leaves((s1.params, s2.params, s2.target, s3.params))):
        np.testing.assert_allclose(np.asarray(a), np.asarray(c), rtol=1e-5, atol=1e-6)
    seq, info_seq = jax.jit(tr.aux_step_sequential)(st, b)
    for k in info:
        np.testing.assert_allclose(np.asarray(info_seq[k]), np.asarray(info[k]), rtol=1e-6, atol=1e-7, err_msg=k)
    # The IQN target moved by EMA (target_tau of the way) and the key advanced. (The comparison above is with
    # iqn_step, the same code: here the EMA is checked against float64 NumPy, target' = (1 - tau) target + tau p'.)
    tau = SMALL.target_tau
    for t1, t0, p1 in zip(jax.tree.leaves(new.iqn.target), jax.tree.leaves(st.iqn.target),
                          jax.tree.leaves(new.iqn.params), strict=True):
        t1, t0, p1 = (np.asarray(x, np.float64) for x in (t1, t0, p1))
        np.testing.assert_allclose(t1, (1 - tau) * t0 + tau * p1, rtol=1e-6, atol=1e-8)
    moved = max(float(np.abs(np.asarray(a, np.float64) - np.asarray(b, np.float64)).max())
                for a, b in zip(jax.tree.leaves(new.iqn.target), jax.tree.leaves(st.iqn.target)))
    assert moved > 1e-6, moved  # the step moved it: the check above can tell a skipped or mis-weighted update
    assert not np.array_equal(np.asarray(jax.random.key_data(new.iqn.key)), np.asarray(jax.random.key_data(st.iqn.key)))


def test_aux_init_and_step_keep_float32_under_x64():
    """With jax_enable_x64, iql_init's np.float64 He scale made the value networks float64, which
    iql_value_loss then refused: the trainers' state and one aux step now stay float32."""
    with jax.enable_x64(True):
        tr = make_aux(SMALL)
        st = tr.init(jax.random.key(0))
        floats = [l for l in jax.tree.leaves(st) if hasattr(l, "dtype") and jnp.issubdtype(l.dtype, jnp.floating)]
        assert floats and {str(l.dtype) for l in floats} == {"float32"}
        new, info = jax.jit(tr.aux_step)(st, synthetic_batch(jax.random.key(1), SMALL, 64))
        for k, v in info.items():
            assert v.dtype == jnp.float32 and np.isfinite(np.asarray(v)).all(), k
        assert {str(l.dtype) for l in jax.tree.leaves(new.iql.params)} == {"float32"}


def test_aux_step_losses_fall_together():
    tr = make_aux(SMALL)
    st = tr.init(jax.random.key(5))
    b = synthetic_batch(jax.random.key(6), SMALL, 256)
    step = jax.jit(tr.aux_step)
    first = None
    for _ in range(40):
        st, info = step(st, b)
        first = first or {k: float(jnp.sum(v)) for k, v in info.items()}
    last = {k: float(jnp.sum(v)) for k, v in info.items()}
    for k in ("iql", "iqn", "attn"):
        assert last[k] < 0.6 * first[k], (k, first[k], last[k])


def test_config_errors():
    with pytest.raises(ValueError, match="config.expectiles"):
        make_aux(SMALL, expectiles=(0.7, 1.2))
    with pytest.raises(ValueError, match=r"config.expectiles .*rounded to float32"):
        make_aux(SMALL, expectiles=(0.7, 1.0 - 1e-9))   # 1.0 in float32
    with pytest.raises(ValueError, match=r"config.expectiles .*not subnormal"):
        make_aux(SMALL, expectiles=(0.7, 1e-40))        # flushed to 0 by XLA: a one-sided loss
    with pytest.raises(ValueError, match="config.iql_impl"):
        make_aux(SMALL, iql_impl="fast")
    with pytest.raises(ValueError, match="config.num_heads"):
        make_aux(SMALL, num_heads=3)
    with pytest.raises(ValueError, match="config.obs_dim"):
        make_aux(SMALL, obs_dim=0)


def test_config_scalar_fields_and_numpy_expectiles():
    """A bare number where a tuple belongs (expectiles=0.9, iql_hidden=64) used to fail deep inside with
    "object of type 'float' has no len()" / "'int' object is not iterable"; NumPy float expectiles (e.g. from
    np.linspace) were rejected as "not floats"."""
    with pytest.raises(ValueError, match="config.expectiles"):
        make_aux(SMALL, expectiles=0.9)
    with pytest.raises(ValueError, match="config.iql_hidden"):
        make_aux(SMALL, iql_hidden=64)
    with pytest.raises(ValueError, match="config.expectiles"):
        make_aux(SMALL, expectiles=(True,))
    taus = tuple(np.linspace(0.7, 0.9, 2, dtype=np.float32))
    tr = make_aux(SMALL, expectiles=taus)
    st = tr.init(jax.random.key(3))
    b = synthetic_batch(jax.random.key(4), SMALL, 32)
    with jax.default_matmul_precision("highest"):
        _, info = tr.iql_step(st.iql, b["iql"])
    p = st.iql.params
    x = np.asarray(b["iql"]["obs"], np.float64)
    v = np.stack([np_relu(x @ np.asarray(p["w"][0][g], np.float64) + np.asarray(p["b"][0][g], np.float64))
                  @ np.asarray(p["w"][1][g], np.float64)[:, 0] + float(p["b"][1][g, 0]) for g in range(2)], 1)
    u = np.asarray(b["iql"]["q"], np.float64)[:, None] - v
    t = np.asarray(taus, np.float64)
    np.testing.assert_allclose(np.asarray(info["iql_per_net"]), (np.where(u < 0, 1 - t, t) * u ** 2).mean(0),
                               rtol=1e-5)


def test_iqn_step_loss_is_quantile_huber_of_numpy():
    """One iqn_step against float64 NumPy written from IQN (Dabney et al. 2018, eq. 3, 4, 10): the head on the
    online params at tau ~ U[0, 1), targets r + discount Z_target(s', tau') from the TARGET params (made to differ
    from the online ones), rho = |tau_i - 1{delta_ij < 0}| L_kappa(delta_ij) / kappa with delta_ij = y_j - z_i
    (an online quantile below its target is penalised by tau), summed over i, averaged over j and the batch.
    The taus are those of the step's key (split into the next key and the draw, the draw into tau and tau')."""
    cfg = SMALL._replace(n_target_quantiles=5, kappa=0.7)
    tr = make_aux(cfg)
    st = tr.init(jax.random.key(0))
    target = jax.tree.map(lambda a: a + 0.3 * jax.random.normal(jax.random.key(9), a.shape), st.iqn.target)
    ts = st.iqn._replace(target=target)
    b = synthetic_batch(jax.random.key(1), cfg, 16)["iqn"]
    with jax.default_matmul_precision("highest"):
        new, info = jax.jit(tr.iqn_step)(ts, b)
    key, k = jax.random.split(ts.key)
    k1, k2 = jax.random.split(k)
    taus = np.asarray(jax.random.uniform(k1, (16, cfg.n_quantiles)), np.float64)
    taus_t = np.asarray(jax.random.uniform(k2, (16, cfg.n_target_quantiles)), np.float64)

    def head(p, obs, t):
        p = {kk: np.asarray(v, np.float64) for kk, v in p.items()}
        psi = np_relu(np.asarray(obs, np.float64) @ p["w_s"] + p["b_s"])
        phi = np_relu(np.cos(np.pi * t[..., None] * np.arange(cfg.n_cos)) @ p["w_phi"] + p["b_phi"])
        h = np_relu((psi[:, None] * phi) @ p["w_h"] + p["b_h"])
        return (h @ p["w_out"] + p["b_out"])[..., 0]

    z = head(ts.params, b["obs"], taus)
    y = (np.asarray(b["reward"], np.float64)[:, None]
         + np.asarray(b["discount"], np.float64)[:, None] * head(target, b["next_obs"], taus_t))
    d = y[:, None, :] - z[:, :, None]                                                       # [B, N, N']
    k_ = cfg.kappa
    huber = np.where(np.abs(d) <= k_, 0.5 * d ** 2, k_ * (np.abs(d) - 0.5 * k_))
    loss = lambda ind: (np.abs(taus[:, :, None] - ind) * huber / k_).mean(2).sum(1).mean()  # noqa: E731
    np.testing.assert_allclose(float(info["iqn"]), loss(d < 0), rtol=1e-5)
    assert abs(loss(d > 0) - loss(d < 0)) > 0.05 * loss(d < 0)  # the flipped indicator is told apart
    y_online = (np.asarray(b["reward"], np.float64)[:, None]
                + np.asarray(b["discount"], np.float64)[:, None] * head(ts.params, b["next_obs"], taus_t))
    d_on = y_online[:, None, :] - z[:, :, None]
    h_on = np.where(np.abs(d_on) <= k_, 0.5 * d_on ** 2, k_ * (np.abs(d_on) - 0.5 * k_))
    assert abs((np.abs(taus[:, :, None] - (d_on < 0)) * h_on / k_).mean(2).sum(1).mean() - loss(d < 0)) > 1e-3
    np.testing.assert_array_equal(np.asarray(jax.random.key_data(new.key)), np.asarray(jax.random.key_data(key)))


def test_trainers_refuse_batches_of_wrong_shape():
    """A label of shape [B, 1] broadcast silently against the [B] predictions: the attention trainer's MSE was
    taken over [B, B] (and a [1] y over every row), the non-fused IQL losses over [B, B, G] (152 instead of ~4.5);
    a [1] IQN reward broadcast to every row, a scalar discount failed with an IndexError."""
    b = synthetic_batch(jax.random.key(1), SMALL, 32)
    B = 32
    for impl in ("fused", "vmap", "grouped", "grouped_list"):
        tr = make_aux(SMALL, iql_impl=impl)
        st = tr.init(jax.random.key(0))
        for bad in (b["iql"]["q"][:, None], b["iql"]["q"][:1], b["iql"]["q"][:-1]):
            with pytest.raises(ValueError, match=r"^iql batch\['q'\] must have shape \[B\] = \[32\]"):
                tr.iql_step(st.iql, {**b["iql"], "q": bad})
        with pytest.raises(ValueError, match=r"^iql batch\['obs'\] must have shape \[B, 16\]"):
            tr.iql_step(st.iql, {**b["iql"], "obs": b["iql"]["obs"][:, :8]})
    cases = [("attn", "y", b["attn"]["y"][:, None], r"\[B\] = \[32\]"), ("attn", "y", b["attn"]["y"][:1], r"\[B\]"),
             ("attn", "seq", b["attn"]["seq"][..., :8], r"\[B, T, 16\]"),
             ("iqn", "reward", b["iqn"]["reward"][:1], r"\[B\] = \[32\]"),
             ("iqn", "discount", jnp.float32(0.9), r"\[B\] = \[32\]"),
             ("iqn", "next_obs", b["iqn"]["next_obs"][:-1], r"\[B, 16\] = \[32, 16\]")]
    for name, key, bad, want in cases:
        with pytest.raises(ValueError, match=rf"^{name} batch\['{key}'\] must have shape {want}"):
            jax.jit(tr.aux_step)(st, {**b, name: {**b[name], key: bad}})
    # an integer reward or discount (or label) was accepted and promoted silently
    for name, key in (("iqn", "reward"), ("iqn", "discount"), ("iql", "q"), ("attn", "y")):
        with pytest.raises(TypeError, match=rf"^{name} batch\['{key}'\] must be float32, got int32"):
            jax.jit(tr.aux_step)(st, {**b, name: {**b[name], key: b[name][key].astype(jnp.int32)}})
    # unchanged for good batches, e.g. the MSE of the attention trainer against NumPy's
    _, info = tr.attention_step(st.attn, b["attn"])
    with jax.default_matmul_precision("highest"):
        pred = np.asarray(attention_predict(st.attn.params, b["attn"]["seq"], SMALL.num_heads), np.float64)
    assert pred.shape == (B,)
    np.testing.assert_allclose(float(info["attn"]), np.mean((pred - np.asarray(b["attn"]["y"], np.float64)) ** 2),
                               rtol=1e-5)


def test_config_number_fields_are_checked_by_make_aux():
    """kappa, target_tau, lr, weight_decay and max_grad_norm were not checked by make_aux: a string gave
    "'>' not supported between instances of 'str' and 'int'", kappa=inf or target_tau=True failed only when the
    step was traced (naming `kappa` / `tau`), a negative lr only in init (naming `learning_rate`)."""
    for field, bad in (("kappa", float("inf")), ("kappa", 0.0), ("target_tau", float("nan")), ("target_tau", 1.5),
                       ("lr", -1e-3), ("lr", float("nan")), ("weight_decay", -1.0), ("weight_decay", float("inf")),
                       ("max_grad_norm", -1.0), ("max_grad_norm", float("inf"))):
        with pytest.raises(ValueError, match=rf"^config\.{field} must be finite and in"):
            make_aux(SMALL, **{field: bad})
    for field, bad in (("kappa", "1"), ("kappa", True), ("kappa", None), ("target_tau", True), ("target_tau", "0.1"),
                       ("target_tau", None), ("lr", "3e-4"), ("max_grad_norm", True)):
        with pytest.raises(TypeError, match=rf"^config\.{field} must be a real scalar"):
            make_aux(SMALL, **{field: bad})
    for ok in ({"max_grad_norm": None}, {"max_grad_norm": 0.0}, {"target_tau": 0}, {"target_tau": np.float32(1.0)},
               {"kappa": np.float64(2.0)}, {"lr": 0.0}, {"weight_decay": 0}):
        make_aux(SMALL, **ok)
    # kappa as the IQN loss checks it: 1e-46 (0 in float32) and 1e39 (inf) passed make_aux and failed only when
    # iqn_step was traced, naming `kappa`; so did 1e-40 (subnormal) and 1e-30 (below 2^-63: the loss underflows)
    for bad in (1e-46, 1e39, 1e-40):
        with pytest.raises(ValueError, match=r"^config\.kappa must be a positive finite normal float32"):
            make_aux(SMALL, kappa=bad)
    with pytest.raises(ValueError, match=r"^config\.kappa must be >= 2\^-63"):
        make_aux(SMALL, kappa=1e-30)
    make_aux(SMALL, kappa=2.0 ** -63)


# ---------------------------------------------------------------- example and notebook
def _load_train_aux():
    spec = importlib.util.spec_from_file_location("train_aux", EXAMPLES / "train_aux.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_train_aux_main_tiny(tmp_path, capsys):
    mod = _load_train_aux()
    m = mod.main(["--dqn-steps", "10", "--num-envs", "8", "--collect-steps", "40", "--steps", "30",
                  "--batch-size", "64", "--seq-len", "4", "--out", str(tmp_path)])
    for k in ("iql", "iqn", "attn"):
        assert np.isfinite(m["first_loss"][k]) and np.isfinite(m["last_loss"][k])
    assert m["transitions"] == 8 * 40
    assert (tmp_path / "metrics.json").exists()
    out = capsys.readouterr().out
    assert "iql" in out and "iqn" in out and "attn" in out
    # 10 DQN updates: "first" and "last" are the first and the last update (a fixed 10 averaged all ten twice and
    # printed "loss 3.340 -> 3.340")
    assert "DQN: 10 updates" in out and "(means of the first and last 1)" in out
    assert len(m["dqn_loss"]) == 2 and m["dqn_loss"][0] != m["dqn_loss"][1]
    for bad in (["--steps", "0"], ["--reward-scale", "-1"], ["--lr", "nan"], ["--out", __file__]):
        with pytest.raises(SystemExit):
            mod.main(["--out", str(tmp_path), *bad])


def test_notebook_executes(tmp_path, monkeypatch):
    import re

    from conftest import execute_notebook

    _, text = execute_notebook("aux.ipynb", tmp_path, monkeypatch, {"JAXFOX_NB_SMALL": "1"})
    assert "max |grouped - per-group dot|" in text
    assert "aux losses" in text
    # the last cell quotes the newest aux-step paragraph of BENCHMARKS.md (it printed headings without figures)
    assert re.search(r"Newest aux-step result in BENCHMARKS.md:\nAux step \(B=\d+[,;)].*? ms", text, re.S), text[-2000:]
    m = re.search(r"max \|iqn_head - by hand\| = ([0-9.e+-]+)", text)
    assert m and float(m.group(1)) < 1e-5, text[-2000:]


def test_public_namespaces_resolve_every_listed_name():
    """`from jaxfox import *` and `from jaxfox.models import *` name only attributes that exist, and the aux
    trainers are reachable from `jaxfox.models` without importing `jaxfox.models.aux` by hand."""
    import os
    import subprocess
    import sys

    code = ("import jaxfox, jaxfox.models as m\n"
            "missing = [n for n in jaxfox.__all__ if not hasattr(jaxfox, n)]\n"
            "missing += ['models.' + n for n in m.__all__ if not hasattr(m, n)]\n"
            "assert not missing, missing\n"
            "assert m.make_aux is m.aux.make_aux and 'sharding' in jaxfox.__all__\n"
            "print('ok')\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT,
                       env={**os.environ, "PYTHONPATH": str(ROOT), "JAX_PLATFORMS": "cpu"})
    assert r.returncode == 0 and r.stdout.strip() == "ok", r.stderr


def test_helpers_reject_bad_sizes_before_anything_runs():
    """iql_init / iqn_init / synthetic_batch had no checks: a 0 size raised ZeroDivisionError, a negative one an
    MLIRError, a float was truncated; iqn_quantiles gave dot_general's message for obs of the wrong width."""
    k = jax.random.key(0)
    for call, name in ((lambda: iql_init(k, 0), "obs_dim"), (lambda: iql_init(k, 4.7), "obs_dim"),
                       (lambda: iql_init(k, 4, hidden=(0,)), r"hidden\[0\]"),
                       (lambda: iql_init(k, 4, hidden=(-3,)), r"hidden\[0\]"),
                       (lambda: iql_init(k, 4, hidden=8), "hidden"),
                       (lambda: iql_init(k, 4, num_networks=0), "num_networks"),
                       (lambda: iqn_init(k, 0), "obs_dim"), (lambda: iqn_init(k, 4, hidden=2.5), "hidden"),
                       (lambda: iqn_init(k, 4, n_cos=0), "n_cos"),
                       (lambda: synthetic_batch(k, SMALL, -1), "batch_size"),
                       (lambda: synthetic_batch(k, SMALL, 2.5), "batch_size"),
                       # obs_dim 1: q's obs[:, 1] was clamped by JAX to obs[:, 0], another q than documented
                       (lambda: synthetic_batch(k, SMALL._replace(obs_dim=1), 4), r"config\.obs_dim must be >= 2")):
        with pytest.raises(ValueError, match=name):
            call()
    # a config that is not an AuxConfig failed with "'dict' object has no attribute '_replace'"
    for call in (lambda: make_aux(dict(SMALL._asdict())), lambda: synthetic_batch(k, dict(SMALL._asdict()), 4)):
        with pytest.raises(TypeError, match="^config must be a jaxfox.models.aux.AuxConfig, got dict"):
            call()
    p = iqn_init(k, SMALL.obs_dim, SMALL.iqn_hidden, SMALL.n_cos)
    with pytest.raises(ValueError, match=r"obs must have shape \[B, F\] = \[\?, 16\].*\(4, 15\)"):
        iqn_quantiles(p, jnp.ones((4, SMALL.obs_dim - 1)), jnp.full((4, 3), 0.5), SMALL.n_cos)
    # the checked sizes give the documented shapes
    q = iql_init(k, 5, hidden=(7, 3), num_networks=2)
    assert [w.shape for w in q["w"]] == [(2, 5, 7), (2, 7, 3), (2, 3, 1)]
    assert [b.shape for b in q["b"]] == [(2, 7), (2, 3), (2, 1)]
