"""Tests for jaxfox.nn.CfC, jaxfox.models.perception_v0, the main job (examples/train_perception.py)
and the walkthrough notebook (examples/perception.ipynb). CPU; the real-data runs take ~1 minute."""

import json
import math

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import jaxfox
import jaxfox.nn
from jaxfox.models import (benchmark_step, evaluate, make_model, make_optimizer, predict_logits, train_epoch,
                           train_step)

from conftest import import_main_job



# ---------------------------------------------------------------- independent float64 NumPy forward
def _lecun_tanh(x):
    return 1.7159 * np.tanh(0.666 * x)


def _sigmoid(x):
    return 1.0 / (1.0 + np.exp(-x))


def _np_cfc_scan(p, xs, ts, mode):
    """ncps CfCCell equations, float64, time loop in Python. p: dict of float64 arrays (cfc_init layout)."""
    B, T, _ = xs.shape
    H = p["heads_w"].shape[1] // (1 if mode == "pure" else 4)
    h = np.zeros((B, H))
    out = []
    for t in range(T):
        z = np.concatenate([xs[:, t], h], axis=1)
        for layer in p["backbone"]:
            z = _lecun_tanh(z @ layer["w"] + layer["b"])
        pre = z @ p["heads_w"] + p["heads_b"]
        if mode == "pure":
            h = -p["A"] * np.exp(-ts * (np.abs(p["w_tau"]) + np.abs(pre))) * pre + p["A"]
        else:
            ff1, ff2, ta, tb = (np.tanh(pre[:, :H]), np.tanh(pre[:, H:2 * H]), pre[:, 2 * H:3 * H], pre[:, 3 * H:])
            g = _sigmoid(ta * ts + tb)
            h = ff1 + g * ff2 if mode == "no_gate" else ff1 * (1.0 - g) + g * ff2
        out.append(h)
    return np.stack(out, axis=1)


def _f64(tree):
    return jax.tree.map(lambda a: np.asarray(a, np.float64), tree)


# ---------------------------------------------------------------- jaxfox.nn.CfC
@pytest.mark.parametrize("mode,layers", [("default", 1), ("default", 0), ("no_gate", 2), ("pure", 1)])
def test_nn_cfc_params_are_cfc_init_and_forward_matches_numpy(mode, layers):
    I, H, U, B, T = 5, 7, 16, 3, 6
    m = jaxfox.nn.CfC(I, H, backbone_units=U, backbone_layers=layers, mode=mode, rngs=nnx.Rngs(3))
    want = jaxfox.cfc_init(nnx.Rngs(3).params(), I, H, backbone_units=U, backbone_layers=layers, mode=mode)
    got = m.params
    assert jax.tree.structure(got) == jax.tree.structure(want)
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    # every array of the module is an nnx.Param (the optimizer's `wrt`)
    n_param = sum(v.size for v in jax.tree.leaves(nnx.state(m, nnx.Param)))
    assert n_param == sum(v.size for v in jax.tree.leaves(want))

    xs = np.random.default_rng(0).normal(size=(B, T, I)).astype(np.float32)
    hs = np.asarray(m(jnp.asarray(xs), 0.7))
    ref = _np_cfc_scan(_f64(want), xs.astype(np.float64), 0.7, mode)
    assert hs.shape == (B, T, H) and hs.dtype == np.float32
    np.testing.assert_allclose(hs, ref, rtol=2e-5, atol=2e-5)
    # and it is exactly the functional op on the same params
    np.testing.assert_array_equal(hs, np.asarray(jaxfox.cfc_scan(want, jnp.asarray(xs), 0.7, mode=mode)))


def test_nn_cfc_grad_matches_functional_grad_and_h0():
    I, H, B, T = 4, 6, 2, 5
    m = jaxfox.nn.CfC(I, H, backbone_units=8, rngs=nnx.Rngs(1))
    xs = jax.random.normal(jax.random.key(0), (B, T, I))
    h0 = jax.random.normal(jax.random.key(1), (B, H))
    np.testing.assert_allclose(np.asarray(m(xs, 1.0, h0)),
                               np.asarray(jaxfox.cfc_scan(m.params, xs, 1.0, h0)), rtol=0, atol=0)
    g_mod = nnx.grad(lambda mod: (mod(xs, 1.0, h0) ** 2).sum())(m)
    g_fun = jax.grad(lambda p: (jaxfox.cfc_scan(p, xs, 1.0, h0) ** 2).sum())(m.params)
    np.testing.assert_allclose(np.asarray(g_mod["heads_w"][...]), np.asarray(g_fun["heads_w"]), rtol=1e-6)
    np.testing.assert_allclose(np.asarray(g_mod["backbone"][0]["w"][...]), np.asarray(g_fun["backbone"][0]["w"]),
                               rtol=1e-6)
    assert float(jnp.abs(g_fun["heads_w"]).sum()) > 0


def test_nn_cfc_errors_name_the_argument():
    m = jaxfox.nn.CfC(4, 6, rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match="xs"):
        m(jnp.zeros((2, 5, 3)))
    with pytest.raises(TypeError, match="xs"):
        m(jnp.zeros((2, 5, 4), jnp.float16))
    with pytest.raises(ValueError, match="h0"):
        m(jnp.zeros((2, 5, 4)), 1.0, jnp.zeros((2, 5)))
    with pytest.raises(ValueError, match="ts"):
        m(jnp.zeros((2, 5, 4)), -1.0)
    with pytest.raises(ValueError, match="hidden_size"):
        jaxfox.nn.CfC(4, 0, rngs=nnx.Rngs(0))


# ---------------------------------------------------------------- perception v0
@pytest.mark.parametrize("proj_size", [None, 3])
def test_perception_v0_logits_match_numpy(proj_size):
    m_feat, d, H, B, T = 5, 3, 6, 4, 7
    model = make_model(m_feat, hidden=H, embed_dim=d, backbone_units=8, proj_size=proj_size, rngs=nnx.Rngs(0))
    x = np.random.default_rng(1).normal(size=(B, T, m_feat)).astype(np.float32)
    got = np.asarray(model(jnp.asarray(x)))
    ew, eb = np.asarray(model.embed_w[...], np.float64), np.asarray(model.embed_b[...], np.float64)
    z = (x.astype(np.float64)[..., None] * ew + eb).reshape(B, T, m_feat * d)  # variable-major flatten
    if proj_size is not None:
        z = z @ np.asarray(model.proj.kernel[...], np.float64) + np.asarray(model.proj.bias[...], np.float64)
        assert z.shape == (B, T, proj_size)
    hs = _np_cfc_scan(_f64(model.cfc.params), z, 1.0, "default")
    want = hs[:, -1] @ np.asarray(model.head.kernel[...], np.float64)[:, 0] + float(model.head.bias[...][0])
    assert got.shape == (B,) and got.dtype == np.float32
    np.testing.assert_allclose(got, want, rtol=2e-5, atol=2e-5)
    with pytest.raises(ValueError, match="x must have shape"):
        model(jnp.zeros((B, T, m_feat + 1)))
    with pytest.raises(TypeError, match="x must be float32"):
        model(jnp.zeros((B, T, m_feat), jnp.float16))
    # predict_logits in chunks of 3 (the last one padded) gives the NumPy logits; a batch_size < 1 returned
    # no logits at all (range with a negative step) without an error
    np.testing.assert_allclose(predict_logits(model, x, batch_size=3), want, rtol=2e-5, atol=2e-5)
    for bs in (-1, 0, 2.0, True):
        with pytest.raises(ValueError, match="^batch_size must be an int >= 1"):
            predict_logits(model, x, batch_size=bs)
    # x is checked whole: a wrong m was reported with the padded chunk's shape, and N = 0 was never checked
    with pytest.raises(ValueError, match=rf"^x must have shape \[N, T, {m_feat}\], got \(3, {T}, {m_feat + 1}\)"):
        predict_logits(model, np.ones((3, T, m_feat + 1), np.float32), batch_size=256)
    with pytest.raises(ValueError, match=r"^x must have shape \[N, T,"):
        predict_logits(model, np.zeros((0, T), np.float32))
    assert predict_logits(model, np.zeros((0, T, m_feat), np.float32)).shape == (0,)
    # evaluate: the mean BCE of the NumPy logits; a [N, 1] y broadcast the BCE to [N, N] (a wrong loss, the
    # AUC unchanged) without an error
    y = np.array([0.0, 1.0, 1.0, 0.0], np.float32)
    p = 1.0 / (1.0 + np.exp(-want))
    loss, _ = evaluate(model, x, y, batch_size=3)
    assert loss == pytest.approx(float(-(y * np.log(p) + (1 - y) * np.log(1 - p)).mean()), rel=1e-4)
    with pytest.raises(ValueError, match=r"^y must have shape \[N\] = \[4\]"):
        evaluate(model, x, y[:, None])


def test_train_step_decreases_loss_on_fixed_batch():
    model = make_model(6, hidden=8, embed_dim=2, backbone_units=16, rngs=nnx.Rngs(0))
    opt = make_optimizer(model, lr=1e-2)
    x = jax.random.normal(jax.random.key(0), (16, 10, 6))
    y = (x[:, -1, 0] > 0).astype(jnp.float32)
    losses = [float(train_step(model, opt, x, y)) for _ in range(30)]
    assert losses[0] > 0.6 and losses[-1] < 0.5 * losses[0]


def test_train_epoch_equals_its_train_steps():
    """train_epoch = N // batch train_steps over the key's permutation (the remainder left out), with the
    noise drawn per step: checked against a Python loop of train_step on the same batches."""
    n, bs, sigma = 37, 8, 0.3                   # 4 steps, 5 windows left out
    x = jax.random.normal(jax.random.key(1), (n, 10, 6))
    y = (x[:, -1, 0] > 0).astype(jnp.float32)
    key = jax.random.key(7)

    def fresh():
        model = make_model(6, hidden=8, embed_dim=2, backbone_units=16, rngs=nnx.Rngs(0))
        return model, make_optimizer(model, lr=1e-2)

    model, opt = fresh()
    losses = train_epoch(model, opt, x, y, key, batch_size=bs, input_noise=sigma)
    assert losses.shape == (4,) and losses.dtype == jnp.float32

    k_perm, k_noise = jax.random.split(key)
    order = np.asarray(jax.random.permutation(k_perm, n))
    noise_keys = jax.random.split(k_noise, 4)
    model2, opt2 = fresh()
    expect = []
    for i in range(4):
        idx = order[i * bs:(i + 1) * bs]
        xb = x[idx] + sigma * jax.random.normal(noise_keys[i], (bs, 10, 6))
        expect.append(float(train_step(model2, opt2, xb, y[idx])))
    np.testing.assert_allclose(np.asarray(losses), expect, rtol=1e-5)
    for a, b in zip(jax.tree.leaves(nnx.state(model, nnx.Param)), jax.tree.leaves(nnx.state(model2, nnx.Param))):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-4, atol=1e-6)
    assert int(opt.step[...]) == 4

    with pytest.raises(ValueError, match="at least batch_size"):
        train_epoch(model, opt, x[:5], y[:5], key, batch_size=bs)


def _epoch_data():
    x = jax.random.normal(jax.random.key(1), (16, 10, 6))
    return x, (x[:, -1, 0] > 0).astype(jnp.float32)


@pytest.mark.parametrize("change, error, match", [
    (lambda x, y: {"y": y[:9]}, ValueError, r"y must have shape \[N\] = \[16\].*\(9,\)"),  # was: NaN params
    (lambda x, y: {"y": y[:, None]}, ValueError, r"y must have shape \[N\] = \[16\].*\(16, 1\)"),  # was: [B, B] BCE
    (lambda x, y: {"y": y.astype(jnp.int32)}, TypeError, "y must be float32"),
    (lambda x, y: {"x": x[..., :5]}, ValueError, r"x must have shape \[N, T, 6\]"),
    (lambda x, y: {"x": np.asarray(x, np.float64)}, TypeError, "x must be float32, got float64"),
    (lambda x, y: {"batch_size": 8.0}, TypeError, "batch_size must be an int"),
    (lambda x, y: {"batch_size": True}, TypeError, "batch_size must be an int"),              # was: batch 1
    (lambda x, y: {"batch_size": 0}, ValueError, "batch_size must be >= 1"),                  # was: ZeroDivisionError
    (lambda x, y: {"batch_size": 32}, ValueError, "at least batch_size=32 windows, got 16"),
    (lambda x, y: {"input_noise": -0.5}, ValueError, "input_noise must be a finite std >= 0"),
    (lambda x, y: {"input_noise": float("nan")}, ValueError, "input_noise must be a finite std >= 0"),
    (lambda x, y: {"input_noise": jnp.float32(0.3)}, TypeError, "input_noise must be a Python float"),
    (lambda x, y: {"key": 7}, TypeError, "key must be a jax.random key"),
    (lambda x, y: {"key": jax.random.split(jax.random.key(0), 3)}, ValueError, "key must be a single jax.random key"),
], ids=["y_short", "y_2d", "y_int", "x_m", "x_f64", "bs_float", "bs_bool", "bs_0", "bs_gt_n", "noise_neg", "noise_nan",
        "noise_array", "key_int", "key_array"])
def test_train_epoch_rejects_bad_arguments_before_running(change, error, match):
    x, y = _epoch_data()
    model = make_model(6, hidden=8, embed_dim=2, backbone_units=16, rngs=nnx.Rngs(0))
    opt = make_optimizer(model, lr=1e-2)
    before = [np.array(a) for a in jax.tree.leaves(nnx.state(model, nnx.Param))]
    args = {"x": x, "y": y, "key": jax.random.key(0), "batch_size": 8, "input_noise": 0.3, **change(x, y)}
    with pytest.raises(error, match=match):
        train_epoch(model, opt, args["x"], args["y"], args["key"], batch_size=args["batch_size"],
                    input_noise=args["input_noise"])
    assert int(opt.step[...]) == 0
    for a, b in zip(before, jax.tree.leaves(nnx.state(model, nnx.Param))):
        np.testing.assert_array_equal(a, np.asarray(b))


def test_train_epoch_compiles_once_over_epochs(monkeypatch):
    """Epochs with new keys, numpy-typed but equal static arguments and the state train_epoch itself returned
    (replicated over the mesh, which the first call's freshly made state was not) reuse one trace; before
    the state was placed first, the second epoch compiled the whole scan again."""
    import jaxfox.models.perception_v0 as v0

    traces = []
    real = v0.data_parallel_epoch
    monkeypatch.setattr(v0, "data_parallel_epoch", lambda *a, **k: traces.append(1) or real(*a, **k))
    x, y = _epoch_data()
    model = make_model(6, hidden=8, embed_dim=2, backbone_units=16, rngs=nnx.Rngs(0))
    opt = make_optimizer(model, lr=1e-2)
    for epoch, (bs, noise) in enumerate([(8, 0.3), (np.int64(8), np.float64(0.3)), (8, 0.3)]):
        train_epoch(model, opt, x, y, jax.random.key(epoch), batch_size=bs, input_noise=noise)
    assert len(traces) == 1 and int(opt.step[...]) == 6


def test_make_optimizer_update_equals_numpy_adamw_with_global_norm_clipping():
    """Two updates of make_optimizer (optax.flatten over clip_by_global_norm + adamw) equal float64 NumPy
    written from the equations (Pascanu et al. 2013 clipping; Loshchilov & Hutter 2019 AdamW with optax's
    defaults b1 0.9, b2 0.999, eps 1e-8, eps_root 0, bias correction, decay on every parameter), leaf by leaf.
    Step 1's gradient (norm ~10) is clipped to norm 1, step 2's (norm ~0.1) is not, so step 2's update depends
    on the clip of step 1 through the moments."""
    lr, wd, clip, b1, b2, eps = 1e-2, 0.5, 1.0, 0.9, 0.999, 1e-8
    model = make_model(3, hidden=4, embed_dim=2, backbone_units=8, rngs=nnx.Rngs(0))
    opt = make_optimizer(model, lr=lr, weight_decay=wd, clip_norm=clip)
    params = nnx.state(model, nnx.Param)
    leaves = [np.asarray(a, np.float64) for a in jax.tree.leaves(params)]
    rng = np.random.default_rng(0)
    n_par = sum(a.size for a in leaves)
    g_steps = []
    for norm in (10.0, 0.1):
        g = [rng.standard_normal(a.shape) for a in leaves]
        scale = norm / math.sqrt(sum(float(np.sum(x * x)) for x in g))
        g_steps.append([(x * scale).astype(np.float32) for x in g])

    p = [a.copy() for a in leaves]
    m = [np.zeros_like(a) for a in leaves]
    v = [np.zeros_like(a) for a in leaves]
    for t, g32 in enumerate(g_steps, start=1):
        grads = jax.tree.unflatten(jax.tree.structure(params), [jnp.asarray(x) for x in g32])
        opt.update(model, grads)
        g = [x.astype(np.float64) for x in g32]
        gnorm = math.sqrt(sum(float(np.sum(x * x)) for x in g))
        g = [x * min(1.0, clip / gnorm) for x in g]
        m = [b1 * mi + (1 - b1) * gi for mi, gi in zip(m, g)]
        v = [b2 * vi + (1 - b2) * gi * gi for vi, gi in zip(v, g)]
        # optax evaluates decay ** count in float32, i.e. with b1, b2 rounded to float32 (0.999 -> 0.99900001:
        # 1 - b2 ** 1 is then 1.3e-5 smaller, relatively), so the bias corrections here do the same
        c1, c2 = 1 - float(np.float32(b1)) ** t, 1 - float(np.float32(b2)) ** t
        p = [pi - lr * ((mi / c1) / (np.sqrt(vi / c2) + eps) + wd * pi) for pi, mi, vi in zip(p, m, v)]
    got = [np.asarray(a) for a in jax.tree.leaves(nnx.state(model, nnx.Param))]
    assert len(got) == len(p) > 3
    for gi, pi, li in zip(got, p, leaves):
        assert gi.shape == pi.shape and gi.dtype == np.float32
        assert np.abs(pi - li).max() > 1e-3                 # every leaf moved (decay or gradient)
        # relative to the leaf's scale: float32 rounds the stored params and cancels in m = b1 m + (1 - b1) g
        np.testing.assert_allclose(gi, pi, rtol=1e-6, atol=1e-6 * np.abs(pi).max())
    # the state is flat: one [P] vector per moment, in the order of the parameter leaves
    adam = nnx.as_pure(opt.opt_state)
    assert isinstance(adam, jaxfox.optim.FusedAdamWState) and isinstance(adam.mu, jaxfox.FlatParams)
    assert int(adam.count) == 2 and adam.mu.flat.shape == (n_par,) and adam.nu.flat.shape == (n_par,)
    m_flat, v_flat = np.concatenate([x.ravel() for x in m]), np.concatenate([x.ravel() for x in v])
    np.testing.assert_allclose(np.asarray(adam.mu.flat), m_flat, rtol=1e-6, atol=1e-6 * np.abs(m_flat).max())
    np.testing.assert_allclose(np.asarray(adam.nu.flat), v_flat, rtol=1e-6)


def test_make_optimizer_reference_is_optax_flatten_chain():
    """On the reference path make_optimizer's step is optax.flatten(chain(clip_by_global_norm, adamw)) in an
    nnx.Optimizer (the optimizer it replaced, update then apply_updates) to 2 ulps over 5 jitted steps, with
    clipping active in some; its update returns the change applied."""
    lr, wd, clip = 1e-2, 0.5, 1.0
    models = [make_model(3, hidden=4, embed_dim=2, backbone_units=8, rngs=nnx.Rngs(0)) for _ in range(2)]
    ours = make_optimizer(models[0], lr=lr, weight_decay=wd, clip_norm=clip)
    assert isinstance(ours, jaxfox.nn.Optimizer)
    theirs = nnx.Optimizer(models[1], optax.flatten(optax.chain(optax.clip_by_global_norm(clip),
                                                                optax.adamw(lr, weight_decay=wd))), wrt=nnx.Param)
    upd = nnx.jit(lambda m, o, g: o.update(m, g))
    params = nnx.state(models[0], nnx.Param)
    rng = np.random.default_rng(1)
    for t, norm in enumerate((10.0, 0.1, 3.0, 0.5, 0.05)):
        g = [rng.standard_normal(a.shape).astype(np.float32) for a in jax.tree.leaves(params)]
        total = math.sqrt(sum(float(np.sum(x.astype(np.float64) ** 2)) for x in g))
        grads = jax.tree.unflatten(jax.tree.structure(params), [jnp.asarray(x * (norm / total)) for x in g])
        before = [np.asarray(a) for a in jax.tree.leaves(nnx.state(models[0], nnx.Param))]
        change = upd(models[0], ours, grads)
        upd(models[1], theirs, grads)
        after = [np.asarray(a) for a in jax.tree.leaves(nnx.state(models[0], nnx.Param))]
        for c, a, b in zip(jax.tree.leaves(change), after, before, strict=True):
            np.testing.assert_array_equal(np.asarray(c), a - b)
        for a, b in zip(after, jax.tree.leaves(nnx.state(models[1], nnx.Param)), strict=True):
            b = np.asarray(b)
            tol = 2 * np.spacing(np.maximum(np.abs(a), np.abs(b)))
            assert np.all(np.abs(a.astype(np.float64) - b) <= tol), (t, np.max(np.abs(a - b)))
    assert int(ours.step[...]) == 5


def test_train_step_rejects_labels_of_the_wrong_shape():
    model = make_model(6, hidden=8, embed_dim=2, backbone_units=16, rngs=nnx.Rngs(0))
    opt = make_optimizer(model)
    x = jnp.zeros((4, 5, 6))
    with pytest.raises(ValueError, match=r"y must have shape \[B\] = \[4\]"):
        train_step(model, opt, x, jnp.zeros((4, 1)))
    with pytest.raises(TypeError, match="y must be float32"):
        train_step(model, opt, x, jnp.zeros((4,), jnp.int32))


def test_loss_fns_reject_labels_that_would_broadcast():
    """The public loss_fn of both models took a [B, 1] y and broadcast the BCE to [B, B] (a wrong loss, no error);
    train_step refused it. Now loss_fn refuses it too, and integer labels; a [B] y gives the mean BCE."""
    from jaxfox.models import perception

    v0 = make_model(6, hidden=8, embed_dim=2, backbone_units=16, rngs=nnx.Rngs(0))
    full = perception.make_model(6, embed_dim=2, vsn_hidden=4, vsn_out=4, hidden=4, backbone_units=8, num_heads=2,
                                 rngs=nnx.Rngs(0))
    x = jax.random.normal(jax.random.key(1), (4, 5, 6))
    y = jnp.array([0.0, 1.0, 0.0, 1.0])
    for fn, model, logits in ((jaxfox.models.loss_fn, v0, lambda: v0(x)),
                              (perception.loss_fn, full, lambda: full(x)[0])):
        z = np.asarray(logits(), np.float64)
        want = np.mean(np.logaddexp(0.0, z) - np.asarray(y) * z)  # BCE with logits, float64
        np.testing.assert_allclose(float(fn(model, x, y)), want, rtol=1e-5)
        with pytest.raises(ValueError, match=r"y must have shape \[B\] = \[4\]"):
            fn(model, x, y[:, None])
        with pytest.raises(TypeError, match="y must be float32"):
            fn(model, x, y.astype(jnp.int32))


def test_models_reject_windows_without_time_steps():
    """T = 0 raised a bare IndexError from hs[:, -1]; now a ValueError names x and T (both models)."""
    from jaxfox.models import perception

    v0 = make_model(6, hidden=8, embed_dim=2, backbone_units=16, rngs=nnx.Rngs(0))
    full = perception.make_model(6, embed_dim=2, vsn_hidden=4, vsn_out=4, hidden=4, backbone_units=8, num_heads=2,
                                 rngs=nnx.Rngs(0))
    for model in (v0, full):
        with pytest.raises(ValueError, match=r"x must have at least one time step.*\(4, 0, 6\)"):
            model(jnp.zeros((4, 0, 6)))
        model(jnp.zeros((4, 1, 6)))  # one step is enough


def test_benchmark_step_is_pure_and_jittable():
    step_fn, state, batch = benchmark_step(batch=8, window=12, num_features=5, hidden=8)
    x, y = batch
    assert x.shape == (8, 12, 5) and x.dtype == jnp.float32 and y.shape == (8,)
    s1, l1 = step_fn(state, batch)            # un-jitted
    s1b, l1b = step_fn(state, batch)          # same input -> same output: no hidden state mutated
    np.testing.assert_array_equal(np.asarray(l1), np.asarray(l1b))
    for a, b in zip(jax.tree.leaves(s1), jax.tree.leaves(s1b)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    assert jax.tree.structure(s1) == jax.tree.structure(state)
    jitted = jax.jit(step_fn)
    s2, l2 = jitted(state, batch)
    np.testing.assert_allclose(np.asarray(l2), np.asarray(l1), rtol=1e-5)
    s, losses = state, []
    for _ in range(20):
        s, loss = jitted(s, batch)
        losses.append(float(loss))
    assert losses[-1] < losses[0]
    assert math.isclose(losses[0], float(l1), rel_tol=1e-5)
    # batch / window / seed were not checked: -4 failed in MLIR ("invalid tensor dimension size"), 3.0 in
    # jax.random.normal, and 0 built a step that failed only when run
    from jaxfox.models import perception as pf

    for make in (benchmark_step, pf.benchmark_step):
        for kw, name in (({"batch": -8}, "batch"), ({"batch": 0}, "batch"), ({"window": 3.0}, "window"),
                         ({"window": 0}, "window"), ({"seed": -1}, "seed")):
            with pytest.raises(ValueError, match=f"^{name} must be an int >= "):
                make(**{"batch": 8, "window": 12, "num_features": 5, **kw})


# ---------------------------------------------------------------- the main job on the real data
def test_main_job_one_short_epoch_on_real_data(tmp_path, capsys):
    tp = import_main_job()
    metrics = tp.main(["--model", "v0", "--epochs", "1", "--max-train-windows", "256", "--out", str(tmp_path)])
    out = capsys.readouterr().out
    saved = json.loads((tmp_path / "metrics.json").read_text())
    assert saved["n_train"] == 256 and saved["n_val"] > 500 and saved["n_test"] > 500
    assert len(saved["history"]["val_auc"]) == 1 and saved["best_epoch"] == 1
    for k in ("test_auc", "best_val_auc"):
        assert math.isfinite(saved[k]) and 0.0 <= saved[k] <= 1.0
    assert set(saved["baselines_test"]) == {"trailing_abs_return", "trailing_vix"}
    assert all(math.isfinite(v) for v in saved["baselines_test"].values())
    assert saved["test_auc"] == pytest.approx(metrics["test_auc"])
    assert saved["kernels_available"] == jaxfox.kernels_available()
    png = (tmp_path / "curves.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 10_000
    assert "TEST AUC" in out and "trailing_vix" in out and "kernels used" in out


def test_main_job_rejects_bad_arguments(tmp_path):
    tp = import_main_job()
    with pytest.raises(SystemExit):
        tp.main(["--model", "v0", "--epochs", "0", "--out", str(tmp_path)])
    with pytest.raises(SystemExit):
        tp.main(["--max-train-windows", "4", "--out", str(tmp_path)])


# ---------------------------------------------------------------- the notebook
def test_notebook_executes(tmp_path, monkeypatch):
    from conftest import execute_notebook

    _, text = execute_notebook("perception.ipynb", tmp_path, monkeypatch,
                               {"JAXFOX_NB_EPOCHS": "1", "JAXFOX_NB_MAX_TRAIN": "256"})
    assert "test AUC" in text


def test_v0_training_functions_refuse_the_full_model_naming_its_own():
    """jaxfox.models.train_step / train_epoch / evaluate / predict_logits / loss_fn are model v0's; given the full
    Perception model they failed deep inside ("'tuple' object has no attribute 'dtype'", an inhomogeneous-array
    ValueError). Now a TypeError names the function of jaxfox.models.perception to use."""
    from jaxfox.models import Perception, loss_fn

    full = Perception(5, embed_dim=2, vsn_hidden=4, vsn_out=4, hidden=4, backbone_units=8, num_heads=2,
                      rngs=nnx.Rngs(0))
    opt = make_optimizer(full)
    x, y = jnp.zeros((4, 6, 5), jnp.float32), jnp.zeros((4,), jnp.float32)
    calls = {"train_step": lambda: train_step(full, opt, x, y),
             "train_epoch": lambda: train_epoch(full, opt, x, y, jax.random.key(0), batch_size=2),
             "evaluate": lambda: evaluate(full, x, np.array([0, 1, 0, 1], np.float32)),
             "predict": lambda: predict_logits(full, x),
             "loss_fn": lambda: loss_fn(full, x, y)}
    for use, call in calls.items():
        with pytest.raises(TypeError, match=rf"model must be a jaxfox.models.PerceptionV0 .*got Perception; for "
                                            rf"jaxfox.models.Perception use jaxfox.models.perception.{use}\b"):
            call()


def test_bad_windows_are_named_before_the_labels():
    """A malformed x (2-D, a 2-D list, 0-d, wrong m) given to loss_fn / train_step / evaluate of either model raised
    an error about y, with an expected size read off the wrong axis ("y must have shape [B] = [5]" for a [5, 6] x,
    "= [None]" for a list): x was only checked after the labels. Now x is checked first and the message names it."""
    from jaxfox.models import perception

    v0 = make_model(6, hidden=8, embed_dim=2, backbone_units=16, rngs=nnx.Rngs(0))
    full = perception.make_model(6, embed_dim=2, vsn_hidden=4, vsn_out=4, hidden=4, backbone_units=8, num_heads=2,
                                 rngs=nnx.Rngs(0))
    y = jnp.array([0.0, 1.0, 0.0, 1.0])
    good = jnp.zeros((4, 5, 6))
    for model, loss, step, ev in ((v0, jaxfox.models.loss_fn, train_step, evaluate),
                                  (full, perception.loss_fn, perception.train_step, perception.evaluate)):
        opt = make_optimizer(model)
        for bad in (jnp.zeros((5, 6)), np.zeros((5, 6)).tolist(), jnp.float32(1.0), jnp.zeros((4, 5, 7))):
            with pytest.raises(ValueError, match=r"^x must have shape \[B, T, 6\]"):
                loss(model, bad, y)
            with pytest.raises(ValueError, match=r"^x must have shape \[B, T, 6\]"):
                step(model, opt, bad, y)
            with pytest.raises(ValueError, match=r"^x must have shape \[N, T, 6\]"):
                ev(model, bad, np.asarray(y))
        # the labels are still checked (against a good x)
        with pytest.raises(ValueError, match=r"^y must have shape \[B\] = \[4\]"):
            loss(model, good, y[:3])
        with pytest.raises(ValueError, match=r"^y must have shape \[N\] = \[4\]"):
            ev(model, good, np.asarray(y)[:3])


def test_benchmark_step_names_a_non_int_seed():
    """benchmark_step(seed=1.5) of either model raised flax's "Invalid rng value: 1.5 ..." (nnx.Rngs, built before
    the seed was checked), not the documented error naming seed."""
    from jaxfox.models import perception

    for bench in (benchmark_step, perception.benchmark_step):
        for bad in (1.5, "0", None):
            with pytest.raises(ValueError, match=r"^seed must be an int >= 0"):
                bench(batch=2, window=3, num_features=4, seed=bad)
