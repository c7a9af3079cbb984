"""Tests for jaxfox.nn.tft (GRN, VSN, AttentionPool modules), jaxfox.models.perception (the full model) and
the main job's ``--model full``. CPU (the modules run the ops' pure-JAX reference paths here); the real-data
run takes ~1 minute.

Expected values come from an independent float64 NumPy implementation of the equations (TFT eqs. 2-8,
google-research form; attention pooling as OPS.md; the CfC from conftest.np_cfc_scan), written here.
"""

import json
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from conftest import import_main_job, np_cfc_scan
from jaxfox.attention import attention_pool, attention_pool_init
from jaxfox.grn import grn, grn_init
from jaxfox.models.perception import Perception, evaluate, make_model, make_optimizer, predict, train_step
from jaxfox.nn.tft import GRN, VSN, AttentionPool
from jaxfox.vsn import vsn, vsn_init



# ---------------------------------------------------------------- independent float64 NumPy forward
def _f64(tree):
    return jax.tree.map(lambda a: np.asarray(a, np.float64), tree)


def _elu(x):
    return np.where(x > 0, x, np.expm1(np.minimum(x, 0.0)))


def _sig(x):
    return 1.0 / (1.0 + np.exp(-x))


def _np_grn(p, a, c=None, eps=1e-5):
    """TFT GRN, float64: LayerNorm(skip(a) + GLU(W1 ELU(W2 a + b2 + W3 c) + b1))."""
    h = a @ p["w2"] + p["b2"]
    if c is not None:
        h = h + c @ p["w3"]
    eta1 = _elu(h) @ p["w1"] + p["b1"]
    x = (a @ p["skip_w"] + p["skip_b"] if "skip_w" in p else a) + (eta1 @ p["w4"] + p["b4"]) * _sig(
        eta1 @ p["w5"] + p["b5"])
    mu = x.mean(-1, keepdims=True)
    var = ((x - mu) ** 2).mean(-1, keepdims=True)
    return (x - mu) / np.sqrt(var + eps) * p["gamma"] + p["beta"]


def _np_vsn(p, xs, eps=1e-5):
    """xs [..., m, d] -> (out [..., O], v [..., m]), float64, one GRN per variable in a Python loop."""
    m, d = xs.shape[-2:]
    logits = _np_grn(p["selection"], xs.reshape(xs.shape[:-2] + (m * d,)), eps=eps)
    e = np.exp(logits - logits.max(-1, keepdims=True))
    v = e / e.sum(-1, keepdims=True)
    out = 0.0
    for j in range(m):
        pj = {k: a[j] for k, a in p["variables"].items()}
        out = out + v[..., j:j + 1] * _np_grn(pj, xs[..., j, :], eps=eps)
    return out, v


def _np_pool(p, hs, n):
    """hs [B, T, H] -> (pooled [B, H], alpha [B, n, T]), float64."""
    B, T, H = hs.shape
    d = H // n
    k = (hs @ p["w_k"]).reshape(B, T, n, d)
    v = (hs @ p["w_v"]).reshape(B, T, n, d)
    s = np.einsum("btjd,jd->bjt", k, p["q"].reshape(n, d)) / math.sqrt(d)
    e = np.exp(s - s.max(-1, keepdims=True))
    alpha = e / e.sum(-1, keepdims=True)
    return np.einsum("bjt,btjd->bjd", alpha, v).reshape(B, H) @ p["w_o"] + p["b_o"], alpha


def _leaves_equal(a, b):
    assert jax.tree.structure(a) == jax.tree.structure(b)
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def _n_params(module):
    return sum(v.size for v in jax.tree.leaves(nnx.state(module, nnx.Param)))


# ---------------------------------------------------------------- modules
@pytest.mark.parametrize("I,O,C", [(5, 6, None), (6, 6, None), (5, 3, 4)])
def test_grn_module_params_forward_and_grad(I, O, C):
    Hd, B, T = 7, 3, 4
    mod = GRN(I, Hd, O, context_size=C, rngs=nnx.Rngs(2))
    want = grn_init(nnx.Rngs(2).params(), I, Hd, O, context_size=C)
    _leaves_equal(mod.params, want)
    assert _n_params(mod) == sum(v.size for v in jax.tree.leaves(want))  # every array is an nnx.Param
    assert ("skip_w" in want) == (I != O) and ("w3" in want) == (C is not None)

    rng = np.random.default_rng(0)
    # non-trivial biases / LayerNorm affine so that they are exercised
    nnx.update(mod, jax.tree.map(lambda a: a + 0.1 * rng.normal(size=a.shape).astype(np.float32),
                                 nnx.state(mod, nnx.Param)))
    a = rng.normal(size=(B, T, I)).astype(np.float32)
    c = None if C is None else rng.normal(size=(B, 1, C)).astype(np.float32)
    y = np.asarray(mod(jnp.asarray(a), None if c is None else jnp.asarray(c)))
    assert y.shape == (B, T, O) and y.dtype == np.float32
    ref = _np_grn(_f64(mod.params), a.astype(np.float64), None if c is None else c.astype(np.float64))
    np.testing.assert_allclose(y, ref, rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(y, np.asarray(grn(mod.params, jnp.asarray(a), None if c is None else jnp.asarray(c))))

    cj = None if c is None else jnp.asarray(c)
    g_mod = nnx.grad(lambda m_: (m_(jnp.asarray(a), cj) ** 3).sum())(mod)
    g_fun = jax.grad(lambda p: (grn(p, jnp.asarray(a), cj) ** 3).sum())(mod.params)
    for k in g_fun:
        np.testing.assert_allclose(np.asarray(g_mod["p"][k][...]), np.asarray(g_fun[k]), rtol=1e-6, atol=1e-7)
    assert float(jnp.abs(g_fun["w2"]).sum()) > 0


def test_vsn_module_params_forward_weights_and_grad():
    m, d, Hd, O, B, T = 5, 3, 8, 6, 2, 4
    mod = VSN(m, d, Hd, O, rngs=nnx.Rngs(4))
    want = vsn_init(nnx.Rngs(4).params(), m, d, Hd, O)
    _leaves_equal(mod.params, want)
    assert _n_params(mod) == sum(v.size for v in jax.tree.leaves(want))
    rng = np.random.default_rng(1)
    nnx.update(mod, jax.tree.map(lambda a: a + 0.1 * rng.normal(size=a.shape).astype(np.float32),
                                 nnx.state(mod, nnx.Param)))
    xs = rng.normal(size=(B, T, m, d)).astype(np.float32)
    out, w = mod(jnp.asarray(xs))
    assert out.shape == (B, T, O) and w.shape == (B, T, m)
    assert out.dtype == jnp.float32 and w.dtype == jnp.float32
    ref_out, ref_w = _np_vsn(_f64(mod.params), xs.astype(np.float64))
    np.testing.assert_allclose(np.asarray(out), ref_out, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(np.asarray(w), ref_w, rtol=1e-5, atol=1e-7)
    np.testing.assert_allclose(np.asarray(w).sum(-1), 1.0, rtol=0, atol=1e-6)
    assert np.asarray(w).min() > 0 and np.asarray(w).std() > 1e-3  # not all uniform
    f_out, f_w = vsn(mod.params, jnp.asarray(xs))
    np.testing.assert_array_equal(np.asarray(out), np.asarray(f_out))
    np.testing.assert_array_equal(np.asarray(w), np.asarray(f_w))

    def obj_mod(m_):
        o, v = m_(jnp.asarray(xs))
        return (o ** 2).sum() + (v * jnp.arange(m)).sum()

    def obj_fun(p):
        o, v = vsn(p, jnp.asarray(xs))
        return (o ** 2).sum() + (v * jnp.arange(m)).sum()

    g_mod, g_fun = nnx.grad(obj_mod)(mod), jax.grad(obj_fun)(mod.params)
    for part in ("selection", "variables"):
        for k in g_fun[part]:
            np.testing.assert_allclose(np.asarray(g_mod[part][k][...]), np.asarray(g_fun[part][k]),
                                       rtol=1e-6, atol=1e-7)


def test_attention_pool_module_params_forward_and_grad():
    H, n, B, T = 8, 4, 3, 5
    mod = AttentionPool(H, num_heads=n, rngs=nnx.Rngs(5))
    _leaves_equal(mod.params, attention_pool_init(nnx.Rngs(5).params(), H, num_heads=n))
    assert _n_params(mod) == 3 * H * H + 2 * H
    mod.b_o[...] = jnp.linspace(-1.0, 1.0, H)
    hs = np.random.default_rng(2).normal(size=(B, T, H)).astype(np.float32)
    pooled, alpha = mod(jnp.asarray(hs))
    assert pooled.shape == (B, H) and alpha.shape == (B, n, T)
    rp, ra = _np_pool(_f64(mod.params), hs.astype(np.float64), n)
    np.testing.assert_allclose(np.asarray(pooled), rp, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(np.asarray(alpha), ra, rtol=1e-5, atol=1e-7)
    fp, fa = attention_pool(mod.params, jnp.asarray(hs), num_heads=n)
    np.testing.assert_array_equal(np.asarray(pooled), np.asarray(fp))
    np.testing.assert_array_equal(np.asarray(alpha), np.asarray(fa))
    g_mod = nnx.grad(lambda m_: (m_(jnp.asarray(hs))[0] ** 2).sum())(mod)
    g_fun = jax.grad(lambda p: (attention_pool(p, jnp.asarray(hs), num_heads=n)[0] ** 2).sum())(mod.params)
    for k in g_fun:
        np.testing.assert_allclose(np.asarray(getattr(g_mod, k)[...]), np.asarray(g_fun[k]), rtol=1e-6, atol=1e-7)
    mask = jnp.asarray(np.array([[True] * T, [True, False, True, False, False], [False] * T]))
    pm, am = mod(jnp.asarray(hs), mask)
    assert np.all(np.asarray(am)[1][:, [1, 3, 4]] == 0) and np.all(np.asarray(pm)[2] == 0)


def test_module_errors_name_the_argument():
    with pytest.raises(ValueError, match="a must have shape"):
        GRN(4, 5, 6, rngs=nnx.Rngs(0))(jnp.zeros((2, 3)))
    with pytest.raises(ValueError, match="context"):
        GRN(4, 5, 6, context_size=2, rngs=nnx.Rngs(0))(jnp.zeros((2, 4)))
    with pytest.raises(ValueError, match="xs"):
        VSN(3, 2, 4, 5, rngs=nnx.Rngs(0))(jnp.zeros((2, 3, 3)))
    with pytest.raises(ValueError, match="hs"):
        AttentionPool(8, rngs=nnx.Rngs(0))(jnp.zeros((2, 3, 6)))
    with pytest.raises(ValueError, match="num_heads"):
        AttentionPool(6, num_heads=4, rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match="hidden_size"):
        GRN(4, 0, 6, rngs=nnx.Rngs(0))


def test_module_eps_checked_at_construction():
    """GRN/VSN check eps when built, as grn/vsn do (it was stored unchecked: eps=0 or -1 built a module that failed
    at its first call, eps="1e-5" was accepted, eps=None raised float()'s TypeError not naming eps)."""
    for make in (lambda e: GRN(4, 5, 6, eps=e, rngs=nnx.Rngs(0)), lambda e: VSN(3, 2, 4, 5, eps=e, rngs=nnx.Rngs(0))):
        for bad, exc in ((0.0, ValueError), (-1.0, ValueError), (float("nan"), ValueError), (1e-46, ValueError),
                         ("1e-5", TypeError), (None, TypeError)):
            with pytest.raises(exc, match="eps"):
                make(bad)
        assert make(1e-3).eps == 1e-3


# ---------------------------------------------------------------- the full model
def _np_perception(model, x):
    """The model's forward in float64 NumPy (module docstring equations), -> (logits [B], weights [B, T, m])."""
    x = x.astype(np.float64)
    e = x[..., None] * np.asarray(model.embed_w[...], np.float64) + np.asarray(model.embed_b[...], np.float64)
    z, w = _np_vsn(_f64(model.vsn.params), e)
    hs = np_cfc_scan(model.cfc.params, z, 1.0)
    pooled, _ = _np_pool(_f64(model.pool.params), hs, model.pool.num_heads)
    g = _np_grn(_f64(model.head.params), np.concatenate([pooled, hs[:, -1]], axis=-1))
    logit = g @ np.asarray(model.out.kernel[...], np.float64)[:, 0] + float(model.out.bias[...][0])
    return logit, w


def test_perception_forward_matches_numpy_and_shapes():
    m, B, T = 6, 3, 9
    model = make_model(m, embed_dim=3, vsn_hidden=8, vsn_out=5, hidden=8, backbone_units=12, num_heads=2,
                       rngs=nnx.Rngs(0))
    assert isinstance(model, Perception)
    x = np.random.default_rng(3).normal(size=(B, T, m)).astype(np.float32)
    logits, w = model(jnp.asarray(x))
    assert logits.shape == (B,) and w.shape == (B, T, m)
    assert logits.dtype == jnp.float32 and w.dtype == jnp.float32
    ref_logits, ref_w = _np_perception(model, x)
    np.testing.assert_allclose(np.asarray(logits), ref_logits, rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(np.asarray(w), ref_w, rtol=1e-5, atol=1e-7)
    np.testing.assert_allclose(np.asarray(w).sum(-1), 1.0, rtol=0, atol=1e-6)
    assert np.std(np.asarray(logits)) > 1e-4  # the samples give different logits

    # predict / evaluate: chunking (pad the last chunk) gives the same logits; weights are per-window means
    lg, wm = predict(model, x, batch_size=2)
    np.testing.assert_allclose(lg, np.asarray(logits), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(wm, np.asarray(w).mean(1), rtol=1e-5, atol=1e-7)
    y = np.array([0.0, 1.0, 1.0], np.float32)
    loss, auc, wmean = evaluate(model, x, y, batch_size=2)
    p = _sig(ref_logits)
    assert loss == pytest.approx(float(-(y * np.log(p) + (1 - y) * np.log(1 - p)).mean()), rel=1e-4)
    s = ref_logits
    pairs = [(s[i] > s[j]) + 0.5 * (s[i] == s[j]) for i in (1, 2) for j in (0,)]
    assert auc == pytest.approx(float(np.mean(pairs)))
    np.testing.assert_allclose(wmean, ref_w.mean((0, 1)), rtol=1e-5, atol=1e-7)
    assert wmean.sum() == pytest.approx(1.0, abs=1e-6)

    with pytest.raises(ValueError, match="x must have shape"):
        model(jnp.zeros((B, T, m + 1)))
    with pytest.raises(TypeError, match="x must be float32"):
        model(jnp.zeros((B, T, m), jnp.float16))
    with pytest.raises(ValueError, match="num_heads"):
        make_model(m, hidden=6, num_heads=4, rngs=nnx.Rngs(0))
    # a batch_size < 1 made predict return no windows at all (range with a negative step) without an error
    for bs in (-1, 0, 2.0, True):
        with pytest.raises(ValueError, match="^batch_size must be an int >= 1"):
            predict(model, x, batch_size=bs)
    # a [N, 1] y broadcast the BCE to [N, N]: a wrong loss (the AUC unchanged) without an error
    with pytest.raises(ValueError, match=r"^y must have shape \[N\] = \[3\]"):
        evaluate(model, x, y[:, None])


def test_predict_checks_the_whole_x_before_padding():
    """predict's errors name x's own shape: a wrong m was reported with the zero-padded chunk's shape ((256, 6, 4)
    for a [3, 6, 4] x), and an x of N = 0 windows was never checked (a [0, 6] x returned weights of shape [0, 6])."""
    model = make_model(5, embed_dim=2, vsn_hidden=4, vsn_out=4, hidden=4, backbone_units=8, num_heads=2,
                       rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match=r"^x must have shape \[N, T, 5\], got \(3, 6, 4\)"):
        predict(model, np.ones((3, 6, 4), np.float32))
    for bad in (np.zeros((0, 6), np.float32), np.zeros((0, 6, 4), np.float32), np.zeros((0,), np.float32)):
        with pytest.raises(ValueError, match=r"^x must have shape \[N, T, 5\]"):
            predict(model, bad)
    lg, w = predict(model, np.zeros((0, 6, 5), np.float32))
    assert lg.shape == (0,) and w.shape == (0, 5)
    # a float64 x is taken as float32 (documented), and the chunked result is the float64 NumPy forward
    x = np.random.default_rng(1).normal(size=(3, 6, 5))
    lg, w = predict(model, x, batch_size=2)
    ref_logits, ref_w = _np_perception(model, x.astype(np.float32))
    np.testing.assert_allclose(lg, ref_logits, rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(w, ref_w.mean(1), rtol=1e-5, atol=1e-7)


def test_full_model_functions_refuse_the_v0_model():
    """jaxfox.models.perception's functions on a PerceptionV0 (whose call returns logits [B], not (logits, weights))
    failed with "too many values to unpack", or for B = 2 unpacked the two logits and returned a wrong loss
    silently. Now a TypeError names the v0 function to use (the reverse of test_perception.py's check)."""
    from jaxfox.models import PerceptionV0
    from jaxfox.models import perception as pf

    v0 = PerceptionV0(5, embed_dim=2, hidden=4, backbone_units=8, rngs=nnx.Rngs(0))
    opt = make_optimizer(v0)
    x, y = jnp.zeros((2, 6, 5), jnp.float32), jnp.array([0.0, 1.0], jnp.float32)
    calls = {"loss_fn": lambda: pf.loss_fn(v0, x, y), "train_step": lambda: train_step(v0, opt, x, y),
             "train_epoch": lambda: pf.train_epoch(v0, opt, x, y, jax.random.key(0), batch_size=2),
             "predict_logits": lambda: predict(v0, x), "evaluate": lambda: evaluate(v0, x, np.array([0, 1]))}
    for use, call in calls.items():
        with pytest.raises(TypeError, match=r"model must be a jaxfox.models.Perception \(these are the full model's "
                                            rf"training functions\), got PerceptionV0; for jaxfox.models.PerceptionV0 "
                                            rf"use jaxfox.models.{use}(\s|$)"):
            call()


def test_perception_train_step_lowers_loss():
    model = make_model(6, embed_dim=2, vsn_hidden=8, vsn_out=8, hidden=8, backbone_units=16, num_heads=2,
                       rngs=nnx.Rngs(0))
    opt = make_optimizer(model, lr=1e-2)
    x = jax.random.normal(jax.random.key(0), (16, 10, 6))
    y = (x[:, -1, 0] > 0).astype(jnp.float32)
    before = {k: np.array(v) for k, v in nnx.to_flat_state(nnx.state(model, nnx.Param))}
    losses = [float(train_step(model, opt, x, y)) for _ in range(30)]
    # the first loss is the untrained model's (~log 2 give or take the initial head); then it must fall
    assert losses[0] > 0.4 and losses[-1] < 0.5 * losses[0] and losses[-1] < min(losses[:5]), losses
    after = dict(nnx.to_flat_state(nnx.state(model, nnx.Param)))
    # every block is trained (nothing detached from the loss)
    for part in ("embed_w", "vsn", "cfc", "pool", "head", "out"):
        changed = [not np.array_equal(before[k], np.asarray(after[k])) for k in before if k[0] == part]
        assert changed and any(changed), part


# ---------------------------------------------------------------- the main job (its default model is full)
def test_main_job_full_one_short_epoch_on_real_data(tmp_path, capsys):
    tp = import_main_job()
    metrics = tp.main(["--epochs", "1", "--max-train-windows", "256", "--out", str(tmp_path)])  # no --model
    out = capsys.readouterr().out
    saved = json.loads((tmp_path / "metrics.json").read_text())
    assert saved["args"]["model"] == "full" and saved["args"]["embed_dim"] == 4
    assert saved["n_train"] == 256 and saved["n_val"] > 500 and saved["n_test"] > 500
    assert len(saved["history"]["val_auc"]) == 1 and saved["best_epoch"] == 1
    for k in ("test_auc", "best_val_auc"):
        assert math.isfinite(saved[k]) and 0.0 <= saved[k] <= 1.0
    assert saved["test_auc"] == pytest.approx(metrics["test_auc"])
    assert set(saved["baselines_test"]) == {"trailing_abs_return", "trailing_vix"}
    w = saved["vsn_weights_test"]
    assert len(w) == 48 and sum(w.values()) == pytest.approx(1.0, abs=1e-5) and min(w.values()) > 0
    assert sum(saved["vsn_weights_val"].values()) == pytest.approx(1.0, abs=1e-5)
    for name in ("curves.png", "vsn_weights.png"):
        png = (tmp_path / name).read_bytes()
        assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 10_000, name
    top = max(w, key=w.get)
    assert "VSN mean variable weights" in out and top in out and "TEST AUC" in out
    assert "model: Perception m=48" in out


def test_main_job_full_rejects_bad_arguments(tmp_path):
    tp = import_main_job()
    with pytest.raises(SystemExit):
        tp.main(["--model", "full", "--heads", "5", "--out", str(tmp_path)])
    with pytest.raises(SystemExit):
        tp.main(["--model", "full", "--vsn-out", "0", "--out", str(tmp_path)])
    with pytest.raises(SystemExit):
        tp.main(["--model", "v1", "--out", str(tmp_path)])
    assert tp.parse_args([]).model == "full" and tp.parse_args([]).embed_dim == 4
    assert tp.parse_args(["--model", "v0"]).embed_dim == 2
    assert tp.parse_args(["--model", "full", "--embed-dim", "3"]).embed_dim == 3
    from jaxfox.models.perception import FULL_DEFAULTS as F
    a = tp.parse_args([])
    assert (a.vsn_hidden, a.vsn_out, a.heads) == (F["vsn_hidden"], F["vsn_out"], F["num_heads"])
    assert tp.parse_args(["--heads", "2"]).heads == 2
    for flag in ("--vsn-hidden", "--vsn-out", "--heads"):   # v0 has none of these: an error, not ignored
        with pytest.raises(SystemExit):
            tp.parse_args(["--model", "v0", flag, "8"])


def test_main_job_usage_errors_are_one_line_and_exit_2(tmp_path, capsys):
    """Bad values that used to end in a traceback (--max-features 0, a batch larger than the data, a window longer
    than the series) or be taken silently (--max-features 100 trained on all 48) are usage errors: status 2 and
    one line naming the option, as argparse's own."""
    tp = import_main_job()
    for argv, match in ((["--max-features", "0"], "--max-features must be in [1, 48], got 0"),
                        (["--max-features", "100"], "--max-features must be in [1, 48], got 100"),
                        (["--batch-size", "100000"], "--batch-size must be <= the "),
                        (["--window", "5000"], "--window 5000: window (5000) is longer than the "),
                        # inf passed the ">= 0" checks and failed in the optimizer; a file as --out failed in
                        # os.makedirs after JAX had started
                        (["--lr", "inf"], "--lr must be a finite number >= 0, got inf"),
                        (["--weight-decay", "inf"], "--weight-decay must be a finite number >= 0, got inf"),
                        (["--out", __file__], "exists and is not a folder")):
        out = tmp_path / "never"
        with pytest.raises(SystemExit) as e:
            tp.main(["--epochs", "1", "--out", str(out), *argv])
        err = capsys.readouterr().err.strip().splitlines()
        assert e.value.code == 2 and match in err[-1] and "Traceback" not in "\n".join(err), err
        assert not out.exists()  # a usage error, also one found with the data loaded, leaves no empty folder
    # one output folder per model by default (a v0 run beside a full run's vsn_weights.png misled)
    assert tp.parse_args([]).out == "runs/perception"
    assert tp.parse_args(["--model", "v0"]).out == "runs/perception_v0"
    assert tp.parse_args(["--out", "x"]).out == "x"
    # --help gives each default once: no "(default: None)" beside the per-model defaults
    with pytest.raises(SystemExit):
        tp.parse_args(["--help"])
    out = capsys.readouterr().out
    assert "default: None" not in out and "default 2 (v0), 4 (full)" in " ".join(out.split())


def test_full_benchmark_step_matches_the_model_loss_and_trains():
    from jaxfox.models import perception

    kw = dict(embed_dim=2, vsn_hidden=8, vsn_out=8, hidden=8, backbone_units=8, num_heads=2)
    step_fn, state, batch = perception.benchmark_step(batch=8, window=6, num_features=5, seed=3, **kw)
    x, y = batch
    assert x.shape == (8, 6, 5) and y.shape == (8,)
    # The first step's loss is the BCE of the same freshly initialised model (seed 3) on that batch.
    fresh = perception.make_model(5, rngs=nnx.Rngs(3), **kw)
    logits, _ = fresh(x)
    p = 1.0 / (1.0 + np.exp(-np.asarray(logits, np.float64)))
    yy = np.asarray(y, np.float64)
    bce = float(np.mean(-(yy * np.log(p) + (1 - yy) * np.log1p(-p))))
    s1, l1 = step_fn(state, batch)
    assert float(l1) == pytest.approx(bce, rel=1e-5)
    _, l1b = step_fn(state, batch)  # pure: the caller's state is not mutated
    assert float(l1b) == float(l1)
    jitted, s, losses = jax.jit(step_fn), state, []
    for _ in range(15):
        s, loss = jitted(s, batch)
        losses.append(float(loss))
    assert losses[0] == pytest.approx(float(l1), rel=1e-5) and losses[-1] < losses[0]
