"""CPU tests of jaxfox.optim (flat parameter buffers, fused AdamW, EMA, float32 -> bfloat16).

Oracles: optax.adamw / optax.clip_by_global_norm (the reference implementation OPS.md names), a float64
NumPy AdamW written from the equations, NumPy concatenation for the flat layout, and a float64
nearest-value search for bfloat16 rounding. None of them calls jaxfox.optim.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from jaxfox import optim


def mlp_params(seed=0):
    """A small MLP-like pytree: two dense layers, a LayerNorm, a scalar."""
    k = jax.random.split(jax.random.key(seed), 6)
    return {
        "dense1": {"w": jax.random.normal(k[0], (8, 16)) * 0.3, "b": jax.random.normal(k[1], (16,)) * 0.1},
        "ln": {"scale": 1.0 + 0.1 * jax.random.normal(k[2], (16,)), "offset": jnp.zeros((16,))},
        "dense2": {"w": jax.random.normal(k[3], (16, 3)) * 0.3, "b": jnp.zeros((3,))},
        "temp": jnp.asarray(0.5, jnp.float32),
    }


def grads_at(step, params, scale):
    key = jax.random.fold_in(jax.random.key(123), step)
    leaves, tdef = jax.tree.flatten(params)
    ks = jax.random.split(key, len(leaves))
    return jax.tree.unflatten(tdef, [jax.random.normal(kk, l.shape) * scale for kk, l in zip(ks, leaves)])


def ndim_mask(p):
    return jax.tree.map(lambda x: x.ndim >= 2, p)


def assert_within_ulps(got, want, ulps=4):
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
        tol = ulps * np.spacing(np.maximum(np.abs(a), np.abs(b)).astype(np.float32)).astype(np.float64)
        assert np.all(np.abs(a - b) <= tol), np.max(np.abs(a - b) / tol)


def run_steps(tx, params, n_steps, scales):
    upd = jax.jit(tx.update)
    state = tx.init(params)
    for t in range(n_steps):
        g = grads_at(t, params, scales[t % len(scales)])
        u, state = upd(g, state, params)
        params = optax.apply_updates(params, u)
    return params, state


# ----------------------------------------------------------------------------------------------
# Flat parameter buffer.
def test_flatten_layout_and_roundtrip():
    params = mlp_params()
    params["half"] = jnp.asarray([1.5, -2.25], jnp.bfloat16)
    flat, unravel = optim.flatten(params)
    want = np.concatenate([np.asarray(l, np.float32).ravel() for l in jax.tree.leaves(params)])
    assert flat.dtype == jnp.float32 and flat.shape == (want.size,) and unravel.size == want.size
    np.testing.assert_array_equal(np.asarray(flat), want)
    back = unravel(flat)
    assert jax.tree.structure(back) == jax.tree.structure(params)
    for a, b in zip(jax.tree.leaves(back), jax.tree.leaves(params)):
        assert a.dtype == b.dtype and a.shape == b.shape
        np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32))
    assert hash(unravel) == hash(optim.flatten(params)[1])
    with pytest.raises(ValueError, match="flat must have shape"):
        unravel(flat[:-1])
    with pytest.raises(TypeError, match=r"params\['x'\]"):
        optim.flatten({"x": jnp.arange(3)})
    with pytest.raises(TypeError, match="float32"):
        optim.flatten({"x": np.zeros(3, np.float64)})


def test_flatparams_pytree_jit_and_grad():
    params = mlp_params()
    fp = optim.FlatParams.from_tree(params)

    def loss(tree):
        h = jnp.tanh(jnp.ones((2, 8)) @ tree["dense1"]["w"] + tree["dense1"]["b"])
        return jnp.sum((h * tree["ln"]["scale"] + tree["ln"]["offset"]) @ tree["dense2"]["w"]) * tree["temp"]

    g_flat = jax.jit(jax.grad(lambda f: loss(f.tree)))(fp)
    assert isinstance(g_flat, optim.FlatParams) and g_flat.flat.shape == fp.flat.shape
    g_tree = jax.grad(loss)(params)
    want = np.concatenate([np.asarray(l).ravel() for l in jax.tree.leaves(g_tree)])
    np.testing.assert_allclose(np.asarray(g_flat.flat), want, rtol=1e-6, atol=1e-7)


# ----------------------------------------------------------------------------------------------
# AdamW against optax.
@pytest.mark.parametrize("schedule", [False, True])
@pytest.mark.parametrize("clip", [None, 1.0])
def test_adamw_matches_optax_100_steps(clip, schedule):
    lr = optax.warmup_cosine_decay_schedule(0.0, 3e-3, 10, 100, 1e-4) if schedule else 3e-3
    kw = dict(b1=0.9, b2=0.999, eps=1e-8, weight_decay=0.05)
    ours = optim.fused_adamw(lr, **kw, max_grad_norm=clip)
    ref = optax.adamw(lr, **kw, mask=ndim_mask)
    if clip is not None:
        ref = optax.chain(optax.clip_by_global_norm(clip), ref)
    params = mlp_params()
    scales = (0.01, 0.5, 2.0)  # global norms ~0.2, ~10, ~40: clipping on some steps only
    if clip is not None:
        norms = [float(optax.tree.norm(grads_at(t, params, scales[t % 3]))) for t in range(3)]
        assert min(norms) < clip < max(norms)
    p1, s1 = run_steps(ours, params, 100, scales)
    p2, _ = run_steps(ref, params, 100, scales)
    assert_within_ulps(p1, p2, ulps=4)
    moved = max(float(jnp.max(jnp.abs(a - b))) for a, b in zip(jax.tree.leaves(p1), jax.tree.leaves(params)))
    assert moved > 1e-2  # the parameters really moved
    assert int(s1.count) == 100
    assert all(l.dtype == jnp.float32 for l in jax.tree.leaves((s1.mu, s1.nu)))


def np_adamw(params, grads_seq, lr_fn, b1, b2, eps, wd, mask, max_norm):
    """float64 AdamW from the equations (Loshchilov & Hutter; optax ordering of the terms)."""
    p = {k: np.asarray(v, np.float64) for k, v in params.items()}
    m = {k: np.zeros_like(v) for k, v in p.items()}
    v = {k: np.zeros_like(x) for k, x in p.items()}
    for t, g in enumerate(grads_seq, start=1):
        g = {k: np.asarray(x, np.float64) for k, x in g.items()}
        if max_norm is not None:
            norm = np.sqrt(sum(np.sum(x * x) for x in g.values()))
            if not norm < max_norm and norm > 0:
                g = {k: x / norm * max_norm for k, x in g.items()}
        for k in p:
            m[k] = (1 - b1) * g[k] + b1 * m[k]
            v[k] = (1 - b2) * g[k] ** 2 + b2 * v[k]
            u = (m[k] / (1 - b1 ** t)) / (np.sqrt(v[k] / (1 - b2 ** t)) + eps)
            if mask[k]:
                u = u + wd * p[k]
            p[k] = p[k] - lr_fn(t - 1) * u
    return p


@pytest.mark.parametrize("clip", [None, 0.3])
def test_adamw_matches_float64_equations(clip):
    params = {"w": jax.random.normal(jax.random.key(1), (5, 4)), "b": jax.random.normal(jax.random.key(2), (4,))}
    grads = [grads_at(t, params, 0.2) for t in range(10)]
    lr_fn = lambda c: 1e-2 * (1.0 - c / 20.0)  # noqa: E731
    tx = optim.fused_adamw(lambda c: 1e-2 * (1.0 - c / 20.0), weight_decay=0.1, max_grad_norm=clip)
    state, p = tx.init(params), params
    for g in grads:
        u, state = tx.update(g, state, p)
        p = optax.apply_updates(p, u)
    want = np_adamw(params, grads, lr_fn, 0.9, 0.999, 1e-8, 0.1, {"w": True, "b": False}, clip)
    for k in params:
        np.testing.assert_allclose(np.asarray(p[k]), want[k], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("flat", [False, True])
def test_adamw_under_inject_hyperparams(flat):
    """optax.inject_hyperparams(fused_adamw): the hyperparameters arrive as (traced) 0-d arrays; the result follows
    optax's own chain under the same wrapper, including a learning rate changed in the state mid-run."""
    params = mlp_params(5)

    # every numeric argument of fused_adamw becomes a float32 array under the wrapper (b2 too: 1 - b2 is then a
    # float32 difference, not Python's float64 one), so optax's side takes all of them as well
    def optax_factory(learning_rate, b1, b2, eps, weight_decay, max_grad_norm):
        return optax.chain(optax.clip_by_global_norm(max_grad_norm),
                           optax.adamw(learning_rate, b1=b1, b2=b2, eps=eps, weight_decay=weight_decay, mask=ndim_mask))

    hp = dict(learning_rate=1e-2, b1=0.8, b2=0.99, eps=1e-6, weight_decay=0.1, max_grad_norm=0.4)
    ours = optax.inject_hyperparams(functools.partial(optim.fused_adamw, flatten_moments=flat))(**hp)
    ref = optax.inject_hyperparams(optax_factory)(**hp)

    def run(tx):
        state, p = tx.init(params), params
        upd = jax.jit(lambda g, s, p: tx.update(g, s, p))
        for t in range(6):
            if t == 3:
                state.hyperparams["learning_rate"] = jnp.asarray(4e-2, jnp.float32)
            u, state = upd(grads_at(t, params, 0.3), state, p)
            p = optax.apply_updates(p, u)
        return p

    got, want = run(ours), run(ref)
    moved = jax.tree.map(lambda a, b: float(jnp.max(jnp.abs(a - b))), want, params)
    assert max(jax.tree.leaves(moved)) > 0.1  # six steps of ~1e-2 .. 4e-2 moved the params
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-6, atol=1e-7)
    with pytest.raises(ValueError, match="learning_rate"):  # concrete arrays are range-checked
        optim.fused_adamw(jnp.asarray(-1e-3))
    with pytest.raises(ValueError, match=r"b1 must be a scalar \(shape \[\]\), got shape \(2,\)"):
        optim.fused_adamw(1e-3, b1=jnp.asarray([0.9, 0.9]))


def test_adamw_float64_traced_hyperparameters_keep_float32_moments():
    """With jax_enable_x64, traced float64 b1/b2/eps (a jitted factory, or optax.inject_hyperparams with
    hyperparam_dtype=float64) leave the state's moments float32 as FusedAdamWState documents: step runs in a
    lax.scan (whose carry types must not change) and the params follow the float64 equations."""
    params = {"w": jax.random.normal(jax.random.key(1), (5, 4)), "b": jax.random.normal(jax.random.key(2), (4,))}
    grads = [grads_at(t, params, 0.2) for t in range(4)]
    with jax.enable_x64(True):
        def loop(b1, b2, eps, p, gs):
            tx = optim.fused_adamw(1e-2, b1=b1, b2=b2, eps=eps, weight_decay=0.1)

            def body(c, g):
                return tx.step(g, c[1], c[0]), None

            return jax.lax.scan(body, (p, tx.init(p)), gs)[0]

        gs = jax.tree.map(lambda *x: jnp.stack(x), *grads)
        p, state = jax.jit(loop)(jnp.float64(0.8), jnp.float64(0.99), jnp.float64(1e-6), params, gs)
        assert all(x.dtype == jnp.float32 for x in jax.tree.leaves((p, state.mu, state.nu)))
        tx = optax.inject_hyperparams(optim.fused_adamw, hyperparam_dtype=jnp.float64)(learning_rate=1e-2)
        st, q = tx.init(params), params
        for g in grads:
            u, st = jax.jit(tx.update)(g, st, q)
            q = optax.apply_updates(q, u)
        assert all(x.dtype == jnp.float32 for x in jax.tree.leaves((st.inner_state.mu, st.inner_state.nu)))
    want = np_adamw(params, grads, lambda c: 1e-2, 0.8, 0.99, 1e-6, 0.1, {"w": True, "b": False}, None)
    want_q = np_adamw(params, grads, lambda c: 1e-2, 0.9, 0.999, 1e-8, 1e-4, {"w": True, "b": False}, None)
    for k in params:
        np.testing.assert_allclose(np.asarray(p[k]), want[k], rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(np.asarray(q[k]), want_q[k], rtol=1e-5, atol=1e-6)


def test_adamw_explicit_and_elementwise_masks():
    params = mlp_params(3)
    mask = {"dense1": {"w": True, "b": True}, "ln": False, "dense2": {"w": False, "b": True}, "temp": True}
    p1, _ = run_steps(optim.fused_adamw(1e-2, weight_decay=0.3, mask=mask), params, 20, (0.3,))
    p2, _ = run_steps(optax.adamw(1e-2, weight_decay=0.3, mask=mask), params, 20, (0.3,))
    assert_within_ulps(p1, p2, ulps=4)
    # Elementwise mask on the flat buffer (what the kernel sees) == per-leaf default mask on the tree.
    # Not bitwise: under jit XLA CPU contracts a * b + c into FMAs differently for one flat array and
    # for separate leaves (vector body vs scalar tail), and with clipping the global norm is summed
    # in another order; the 1-ulp differences of each step accumulate. Compared at the leaf's scale.
    for clip in (None, 1.0):
        fp = optim.FlatParams.from_tree(params)
        tx = optim.fused_adamw(1e-2, weight_decay=0.3, max_grad_norm=clip)
        st_f, st_t, p_t = tx.init(fp), tx.init(params), params
        upd = jax.jit(tx.update)
        for t in range(20):
            g = grads_at(t, params, 0.3)
            u, st_f = upd(optim.FlatParams(optim.flatten(g)[0], fp.layout), st_f, fp)
            fp = optax.apply_updates(fp, u)
            u, st_t = upd(g, st_t, p_t)
            p_t = optax.apply_updates(p_t, u)
        for a, b in zip(jax.tree.leaves(fp.tree), jax.tree.leaves(p_t)):
            scale = np.spacing(np.float32(np.max(np.abs(np.asarray(b)))))
            assert np.max(np.abs(np.asarray(a, np.float64) - np.asarray(b, np.float64))) <= 8 * scale
    dm = optim.default_decay_mask(fp).flat
    assert int(dm.sum()) == 8 * 16 + 16 * 3
    with pytest.raises(ValueError, match="mask"):
        run_steps(optim.fused_adamw(1e-2, mask={"dense1": 1}), params, 1, (0.1,))


def test_adamw_zero_norm_zero_max_norm_is_finite():
    params = mlp_params(4)
    zeros = jax.tree.map(jnp.zeros_like, params)
    tx = optim.fused_adamw(1e-2, weight_decay=0.1, max_grad_norm=0.0)
    state = tx.init(params)
    u, state = jax.jit(tx.update)(zeros, state, params)
    assert all(bool(jnp.all(jnp.isfinite(l))) for l in jax.tree.leaves((u, state)))
    # Zero gradients: only the decoupled weight decay acts, u = -lr * wd * theta on decayed leaves.
    for (path, ul), pl in zip(jax.tree_util.tree_leaves_with_path(u), jax.tree.leaves(params)):
        want = -1e-2 * 0.1 * np.asarray(pl, np.float64) if pl.ndim >= 2 else np.zeros(pl.shape)
        np.testing.assert_allclose(np.asarray(ul), want, rtol=1e-6, atol=0, err_msg=str(path))
    # max_norm = 0 with nonzero gradients clips them to 0 (as optax does).
    g = grads_at(0, params, 1.0)
    u1, _ = tx.update(g, tx.init(params), params)
    ref = optax.chain(optax.clip_by_global_norm(0.0), optax.adamw(1e-2, weight_decay=0.1, mask=ndim_mask))
    u2, _ = ref.update(g, ref.init(params), params)
    assert_within_ulps(u1, u2, ulps=1)
    # ...and those clipped zeros give exactly the decay-only update above.
    for ul, pl in zip(jax.tree.leaves(u1), jax.tree.leaves(params)):
        want = -1e-2 * 0.1 * np.asarray(pl, np.float64) if pl.ndim >= 2 else np.zeros(pl.shape)
        np.testing.assert_allclose(np.asarray(ul), want, rtol=1e-6, atol=0)


def test_adamw_state_moments_must_be_like_params():
    """Per-leaf moments of another shape, structure or dtype than params raise (a mu of shape (1,) for a (4,)
    leaf used to broadcast silently into a wrong state)."""
    params, grads = {"a": jnp.ones((4,))}, {"a": jnp.arange(4.0)}
    tx = optim.fused_adamw(1e-2)
    st = tx.init(params)
    cases = ((tx.init({"a": jnp.ones((1,))}), ValueError, r"state.mu\['a'\] must have shape \(4,\) like params"),
             (tx.init({"b": jnp.ones((4,))}), ValueError, "state.mu must have the structure of params"),
             (optim.fused_adamw(1e-2, flatten_moments=True).init(params), ValueError,
              "state.mu must have the structure of params"),
             (st._replace(nu={"a": jnp.ones((2, 2))}), ValueError, r"state.nu\['a'\] must have shape"),
             (st._replace(mu={"a": jnp.ones((4,), jnp.bfloat16)}), TypeError, r"state.mu\['a'\] must be a float32"))
    for bad, err, match in cases:
        for fn in (tx.update, tx.step, jax.jit(tx.update), jax.jit(tx.step)):
            with pytest.raises(err, match=match):
                fn(grads, bad, params)
    tx.update(grads, st, params)  # the state from init passes


def test_adamw_validation():
    for kw, match in ((dict(b1=1.0), "b1"), (dict(b2=-0.1), "b2"), (dict(eps=-1.0), "eps"),
                      (dict(weight_decay=-1e-3), "weight_decay"), (dict(max_grad_norm=-1.0), "max_grad_norm"),
                      (dict(max_grad_norm=float("nan")), "max_grad_norm")):
        with pytest.raises(ValueError, match=match):
            optim.fused_adamw(1e-3, **kw)
    with pytest.raises(ValueError, match="learning_rate"):
        optim.fused_adamw(-1e-3)
    # b in [1 - 2**-25, 1) is 1 in float32, where the bias correction 1 - b^t is computed: it passed the [0, 1) check
    # and the first update was -inf (b1) or NaN (b2, on a zero gradient)
    for kw in (dict(b1=1 - 1e-9), dict(b2=1 - 2.0 ** -25), dict(b2=np.float64(0.99999999))):
        name = next(iter(kw))
        with pytest.raises(ValueError, match=rf"^{name} must be < 1 in float32"):
            optim.fused_adamw(1e-3, **kw)
    b = 1 - 2.0 ** -24  # the largest float32 below 1: accepted; one step from zero moments is -lr g / (|g| + eps)
    g = np.array([0.5, -2.0, 0.0], np.float32)
    tx = optim.fused_adamw(0.1, b1=b, b2=b, eps=1e-3, weight_decay=0.0)
    p = {"b": jnp.zeros((3,), jnp.float32)}
    u, _ = tx.update({"b": jnp.asarray(g)}, tx.init(p), p)
    np.testing.assert_allclose(np.asarray(u["b"]), -0.1 * g / (np.abs(g) + 1e-3), rtol=1e-5, atol=0)
    tx = optim.fused_adamw(1e-3)
    params = {"w": jnp.ones((2, 2))}
    st = tx.init(params)
    with pytest.raises(ValueError, match="needs params"):
        tx.update(params, st)
    with pytest.raises(TypeError, match=r"updates\['w'\] must be a float32"):
        tx.update({"w": jnp.ones((2, 2), jnp.bfloat16)}, st, params)
    with pytest.raises(ValueError, match=r"updates\['w'\] must have shape \(2, 2\)"):
        tx.update({"w": jnp.ones((2, 3))}, st, params)
    with pytest.raises(TypeError, match="float32"):
        tx.init({"w": jnp.ones((2,), jnp.int32)})
    # flatten_moments: a bool; the state must be the flat moments of init(params)
    with pytest.raises(TypeError, match="flatten_moments must be a bool"):
        optim.fused_adamw(1e-3, flatten_moments=1)
    txf = optim.fused_adamw(1e-3, flatten_moments=True)
    stf = txf.init(params)
    assert isinstance(stf.mu, optim.FlatParams) and stf.mu.flat.shape == (4,)
    for bad in (st, txf.init({"w": jnp.ones((4,))})):  # moments like params; flat moments of other shapes
        with pytest.raises(ValueError, match=r"state.mu must be the FlatParams of init\(params\)"):
            txf.update(params, bad, params)
        with pytest.raises(ValueError, match=r"state.mu must be the FlatParams of init\(params\)"):
            txf.step(params, bad, params)


# ----------------------------------------------------------------------------------------------
# EMA.
SPECIAL = np.array([0.0, -0.0, 1.0, -1.5, np.inf, -np.inf, np.nan, 1e-45, -1e-45, 3.4e38, -3.4e38, 1e-40],
                   np.float32)


def _bits(x):
    return np.asarray(x).view(np.uint32)


def _special_pair():
    tgt = SPECIAL.copy()
    onl = SPECIAL[::-1].copy()
    onl_bits = onl.view(np.uint32)
    onl_bits[np.isnan(onl)] = 0x7FC12345  # a NaN with a payload must come through unchanged
    return jnp.asarray(tgt), jnp.asarray(onl_bits.view(np.float32))


@pytest.mark.parametrize("how", ["python", "array", "jit"])
def test_ema_tau_0_and_1_bitwise(how):
    tgt, onl = _special_pair()
    target = {"a": tgt, "b": {"c": jnp.asarray(np.full((3, 2), -0.0, np.float32))}}
    online = {"a": onl, "b": {"c": jnp.asarray(np.full((3, 2), 2.0, np.float32))}}
    for tau, want in ((0.0, target), (1.0, online)):
        if how == "python":
            got = optim.ema_update(target, online, tau)
        elif how == "array":
            got = optim.ema_update(target, online, jnp.asarray(tau, jnp.float32))
        else:
            got = jax.jit(optim.ema_update)(target, online, jnp.asarray(tau, jnp.float32))
        for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
            np.testing.assert_array_equal(_bits(a), _bits(b))


def test_ema_values():
    rng = np.random.default_rng(0)
    tgt = rng.normal(size=(50,)).astype(np.float32)
    onl = rng.normal(size=(50,)).astype(np.float32)
    tgt[0], onl[0] = 3.0e38, -3.0e38  # the lerp form target + tau * (online - target) overflows here
    f = jax.jit(optim.ema_update)
    for tau in (0.005, 0.5, 0.99):
        want = tau * onl.astype(np.float64) + (1 - tau) * tgt.astype(np.float64)
        np.testing.assert_allclose(np.asarray(optim.ema_update(jnp.asarray(tgt), jnp.asarray(onl), tau)), want,
                                   rtol=1e-6, atol=1e-7)
        np.testing.assert_allclose(np.asarray(f(jnp.asarray(tgt), jnp.asarray(onl), jnp.float32(tau))), want,
                                   rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
def test_ema_narrow_leaves_mix_in_float32(dtype):
    """tau is not rounded to the leaf dtype (0.995 in bfloat16 is 0.99609375): the result is the float64 mix
    rounded once to the leaf dtype."""
    rng = np.random.default_rng(1)
    tgt = jnp.asarray(rng.normal(size=(256,)), dtype)
    onl = tgt + jnp.asarray(rng.normal(size=(256,)) * 4, dtype)  # far enough apart that 1 - tau matters
    for tau in (0.995, 0.9, 0.3):
        want = (tau * np.asarray(onl, np.float64) + (1 - tau) * np.asarray(tgt, np.float64))
        want = np.asarray(jnp.asarray(want.astype(np.float32)).astype(dtype), np.float64)
        for t in (tau, jnp.float32(tau)):
            got = optim.ema_update({"w": tgt}, {"w": onl}, t)["w"]
            assert got.dtype == dtype
            ulp = np.spacing(np.abs(want).astype(np.float16 if dtype == jnp.float16 else np.float32)).astype(np.float64)
            if dtype == jnp.bfloat16:
                ulp = ulp * 2.0 ** 16  # bfloat16 keeps 8 of float32's 24 significand bits
            # one ulp of the leaf dtype (float64 -> float32 -> leaf is a double rounding near ties)
            assert np.all(np.abs(np.asarray(got, np.float64) - want) <= ulp), tau


def test_ema_validation():
    x = {"a": jnp.ones(3)}
    with pytest.raises(ValueError, match="tau"):
        optim.ema_update(x, x, 1.5)
    with pytest.raises(ValueError, match="tau"):
        optim.ema_update(x, x, float("nan"))
    with pytest.raises(ValueError, match="tau"):
        optim.ema_update(x, x, jnp.ones(2))
    with pytest.raises(ValueError, match="structure"):
        optim.ema_update(x, {"b": jnp.ones(3)}, 0.5)
    with pytest.raises(ValueError, match=r"online\['a'\]"):
        optim.ema_update(x, {"a": jnp.ones(4)}, 0.5)
    with pytest.raises(TypeError, match="float"):
        optim.ema_update({"a": jnp.ones(3, jnp.int32)}, {"a": jnp.ones(3, jnp.int32)}, 0.5)
    for tau in (True, np.bool_(True), jnp.asarray(True)):   # a bool is not a mixing weight, Python's or an array's
        with pytest.raises(TypeError, match="tau"):
            optim.ema_update(x, x, tau)
    # float64 NumPy leaves with x64 off came back float32, not "in the leaf dtype" as documented
    if not jax.config.jax_enable_x64:
        y = {"a": np.ones(3)}
        with pytest.raises(TypeError, match=r"target\['a'\] is float64 but jax_enable_x64 is off"):
            optim.ema_update(y, y, 0.5)


# ----------------------------------------------------------------------------------------------
# float32 -> bfloat16.
def np_bf16_bits(x):
    """Independent oracle: nearest bfloat16 by comparing the two neighbours in float64, ties to the
    even mantissa; overflow past bf16_max + half ulp -> Inf; NaN -> sign | 0x7FC0."""
    u = np.asarray(x, np.float32).view(np.uint32).astype(np.uint64)
    out = np.empty(u.shape, np.uint16)
    with np.errstate(invalid="ignore"):  # signalling NaN payloads
        vals = np.asarray(x, np.float32).astype(np.float64)
    for j, (bits, val) in enumerate(zip(u, vals)):
        bits = int(bits)
        sign = bits & 0x80000000
        if np.isnan(val):
            out[j] = (sign >> 16) | 0x7FC0
            continue
        lo = bits & 0xFFFF0000  # truncation toward zero (same sign)
        hi = lo + 0x10000  # next bf16 away from zero (may be Inf)
        to_f = lambda b: np.array([b], np.uint32).view(np.float32).astype(np.float64)[0]  # noqa: E731
        if np.isinf(val) or bits == lo:
            out[j] = lo >> 16
            continue
        dlo, dhi = abs(val - to_f(lo)), abs(to_f(hi) - val)
        if (hi & 0x7FFFFFFF) == 0x7F800000:  # hi is Inf: compare with the would-be next finite step
            dhi = abs(to_f(lo) + (to_f(lo) - to_f(lo - 0x10000)) - val)
        pick = lo if dlo < dhi or (dlo == dhi and ((lo >> 16) & 1) == 0) else hi
        out[j] = pick >> 16
    return out


EDGE_BITS = [
    0x00000000, 0x80000000,  # +-0
    0x7F800000, 0xFF800000,  # +-Inf
    0x7FC00000, 0xFFC00000, 0x7F800001, 0xFF800001, 0x7FBFFFFF, 0x7FFFFFFF, 0xFFFFFFFF, 0x7F80FFFF,  # NaNs
    0x00000001, 0x80000001, 0x00007FFF, 0x00008000, 0x00008001, 0x00018000, 0x007FFFFF, 0x807FFFFF,  # subnormals
    0x00800000, 0x3F800000,  # smallest normal, 1.0
    0x3F808000,  # 1 + 2^-8: tie, even mantissa -> 1.0
    0x3F818000,  # 1 + 3 * 2^-8: tie, odd below -> rounds up to 1 + 2^-6
    0x3F808001, 0x3F807FFF,  # just above / below the tie
    0x7F7F0000, 0x7F7F7FFF, 0x7F7F8000, 0x7F7FFFFF, 0xFF7F8000,  # near bf16 max: 0x7F7F8000 ties to Inf
    0x477FE000, 0xC0490FDB,  # 65504, -pi
]


def test_cast_bf16_edge_values_bit_exact():
    x = np.array(EDGE_BITS, np.uint32).view(np.float32)
    got = np.asarray(optim.cast_bf16(jnp.asarray(x))).view(np.uint16)
    astype = np.asarray(jnp.asarray(x).astype(jnp.bfloat16)).view(np.uint16)
    oracle = np_bf16_bits(x)
    np.testing.assert_array_equal(got, oracle)
    np.testing.assert_array_equal(got, astype)
    named = dict(zip(EDGE_BITS, got))
    assert named[0x3F808000] == 0x3F80 and named[0x3F818000] == 0x3F82 and named[0x80000000] == 0x8000
    assert named[0x7F7F8000] == 0x7F80 and named[0x00018000] == 0x0002 and named[0x7F800001] == 0x7FC0


def test_cast_bf16_random_bits_and_jit():
    rng = np.random.default_rng(0)
    bits = rng.integers(0, 2 ** 32, 200_000, dtype=np.uint64).astype(np.uint32)
    x = jnp.asarray(bits.view(np.float32).reshape(400, 500))
    got = np.asarray(jax.jit(optim.cast_bf16)(x)).view(np.uint16)
    assert got.shape == (400, 500)
    np.testing.assert_array_equal(got, np.asarray(x.astype(jnp.bfloat16)).view(np.uint16))
    sub = bits[:3000]
    np.testing.assert_array_equal(got.ravel()[:3000], np_bf16_bits(sub.view(np.float32)))
    with pytest.raises(TypeError, match="float32"):
        optim.cast_bf16(jnp.ones(3, jnp.bfloat16))


def test_cast_bf16_gradient_is_that_of_astype():
    """d cast_bf16(x) is the tangent cast to bfloat16 (as for x.astype), not the zero of a bit-pattern path."""
    x = jnp.asarray([1.0, -2.5, 3e-3, 7.0], jnp.float32)
    w = np.array([1.0, -2.0, 0.5, 4.0])  # exact in bfloat16: d/dx sum(w * float32(bf16(x))) = w
    loss = lambda x: jnp.sum(jnp.asarray(w, jnp.float32) * optim.cast_bf16(x).astype(jnp.float32))  # noqa: E731
    np.testing.assert_array_equal(np.asarray(jax.grad(loss)(x)), w)
    np.testing.assert_array_equal(np.asarray(jax.jit(jax.grad(loss))(x)), w)
    y, t = jax.jvp(optim.cast_bf16, (x,), (jnp.asarray(w, jnp.float32),))
    assert y.dtype == t.dtype == jnp.bfloat16
    np.testing.assert_array_equal(np.asarray(t, np.float64), w)
    np.testing.assert_array_equal(np.asarray(y).view(np.uint16), np_bf16_bits(np.asarray(x)))


# ----------------------------------------------------------------------------------------------
# FusedAdamW.step (update + apply_updates in one call; one CUDA kernel on FlatParams when opted in).
def _flat_case(seed=0):
    params = mlp_params(seed)
    fp = optim.FlatParams.from_tree(params)
    gs = [optim.FlatParams(optim.flatten(grads_at(t, params, (0.01, 0.5, 2.0)[t % 3]))[0], fp.layout)
          for t in range(12)]
    return fp, gs


def _bits_equal(a, b):
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        x, y = np.asarray(x), np.asarray(y)
        assert x.dtype == y.dtype and x.shape == y.shape
        np.testing.assert_array_equal(x.reshape(-1).view(np.uint8), y.reshape(-1).view(np.uint8))


@pytest.mark.parametrize("flat", [True, False])
@pytest.mark.parametrize("clip", [None, 1.0])
def test_step_is_update_then_apply_updates_bitwise(flat, clip):
    """Reference path: step == update then optax.apply_updates, bitwise, eagerly and under one jit each."""
    fp, gs = _flat_case(1)
    params = fp if flat else fp.tree
    grads = gs if flat else [g.tree for g in gs]
    lr = optax.warmup_cosine_decay_schedule(0.0, 3e-3, 4, 12, 1e-4)
    tx = optim.fused_adamw(lr, weight_decay=0.05, max_grad_norm=clip)
    assert isinstance(tx, optim.FusedAdamW) and isinstance(tx, optax.GradientTransformation)

    def two_calls(g, s, p):
        u, s = tx.update(g, s, p)
        return optax.apply_updates(p, u), s

    for mode in ("eager", "jit"):
        step = tx.step if mode == "eager" else jax.jit(tx.step)
        ref = two_calls if mode == "eager" else jax.jit(two_calls)
        p1 = p2 = params
        s1 = s2 = tx.init(params)
        for g in grads:
            p1, s1 = step(g, s1, p1)
            p2, s2 = ref(g, s2, p2)
            _bits_equal((p1, s1), (p2, s2))
        assert type(p1) is type(params) and int(s1.count) == len(grads)
    # ...and the result is AdamW's: the float64 equations on the tree (clipping crosses the threshold).
    tree = fp.tree
    mask = {k: jax.tree.map(lambda x: x.ndim >= 2, v) for k, v in tree.items()}
    want = np_adamw_tree(tree, [g.tree for g in gs], lr, 0.9, 0.999, 1e-8, 0.05, mask, clip)
    got = p1.tree if flat else p1
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        np.testing.assert_allclose(np.asarray(a), b, rtol=2e-5, atol=2e-6)


def np_adamw_tree(params, grads_seq, lr_fn, b1, b2, eps, wd, mask, max_norm):
    """np_adamw over nested dicts (flattened by path)."""
    flat = lambda t: {jax.tree_util.keystr(k): v for k, v in jax.tree_util.tree_leaves_with_path(t)}  # noqa: E731
    out = np_adamw(flat(params), [flat(g) for g in grads_seq], lambda c: float(lr_fn(c)), b1, b2, eps, wd,
                   flat(mask), max_norm)
    return jax.tree.unflatten(jax.tree.structure(params), [out[k] for k in flat(params)])


def test_fused_adamw_is_a_gradient_transformation_everywhere():
    """optax.chain, flax nnx.Optimizer, copies and pytree round trips keep working (and keep step)."""
    import copy

    from flax import nnx

    params = mlp_params(2)
    g = grads_at(0, params, 0.3)
    tx = optim.fused_adamw(1e-2, weight_decay=0.1, mask=ndim_mask)
    ref = optax.adamw(1e-2, weight_decay=0.1, mask=ndim_mask)
    # optax.chain
    ch, ch_ref = optax.chain(tx, optax.scale(0.5)), optax.chain(ref, optax.scale(0.5))
    u1, _ = ch.update(g, ch.init(params), params)
    u2, _ = ch_ref.update(g, ch_ref.init(params), params)
    assert_within_ulps(u1, u2, ulps=2)
    # copies and pytree round trips rebuild the NamedTuple as type(tx)(init, update): step survives
    leaves, tdef = jax.tree.flatten(tx, is_leaf=callable)
    for other in (copy.copy(tx), copy.deepcopy(tx), jax.tree.unflatten(tdef, leaves)):
        assert isinstance(other, optim.FusedAdamW)
        _bits_equal(other.step(g, other.init(params), params), tx.step(g, tx.init(params), params))
    # a transformation rebuilt around another update still steps (update then apply)
    plain = tx._replace(update=ref.update)
    p_plain, _ = plain.step(g, ref.init(params), params)
    u, _ = ref.update(g, ref.init(params), params)
    _bits_equal(p_plain, optax.apply_updates(params, u))
    # flax nnx.Optimizer
    def make(t):
        model = nnx.Linear(4, 3, rngs=nnx.Rngs(0))
        return model, nnx.Optimizer(model, t, wrt=nnx.Param)

    (m1, o1), (m2, o2) = make(optim.fused_adamw(1e-2, weight_decay=0.1)), make(
        optax.adamw(1e-2, weight_decay=0.1, mask=lambda p: jax.tree.map(lambda x: x.ndim >= 2, p)))
    x = jnp.linspace(-1.0, 1.0, 8).reshape(2, 4)
    grads = nnx.grad(lambda mm: jnp.sum(mm(x) ** 2))(m1)  # the same gradients for both (no feedback)
    upd = nnx.jit(lambda m, o, g: o.update(m, g))  # jitted: eager pow(0.999, count) rounds otherwise
    for _ in range(3):
        for m, o in ((m1, o1), (m2, o2)):
            upd(m, o, grads)
    assert_within_ulps(nnx.state(m1, nnx.Param), nnx.state(m2, nnx.Param), ulps=4)
    assert float(jnp.max(jnp.abs(m1.kernel[...] - nnx.Linear(4, 3, rngs=nnx.Rngs(0)).kernel[...]))) > 1e-3


def _lower_step(tx, g, st, fp, jit_fn=None):
    fn = jit_fn or jax.jit(tx.step)
    return fn.trace(g, st, fp).lower(lowering_platforms=("cuda",)).as_text()


def _adamw_calls(text):
    return [l for l in text.splitlines() if "custom_call @jaxfox_adamw_apply" in l]


def _call_types(call):
    """(operand types, result types) of a lowered custom call line, as lists of 'NxT' strings."""
    sig = call.rsplit(" : (", 1)[1]
    ins, outs = sig.split(") -> (")
    return [t.strip()[7:-1] for t in ins.split(",")], [t.strip()[7:-1] for t in outs.rstrip(")").split(",")]


def _aliases(call):
    """{operand index: result index} of a lowered custom call line."""
    import re

    return {int(o): int(r) for r, o in re.findall(r"output_tuple_indices = \[(\d+)\], operand_index = (\d+)", call)}


@pytest.mark.parametrize("clip", [None, 1.0])
def test_step_kernel_path_lowers_for_cuda_with_aliasing(clip, monkeypatch):
    """Kernels forced available: step lowers (no GPU needed) to ONE jaxfox_adamw_apply call over every leaf,
    with params, mu, nu aliased to its results and the attrs of the reference: on FlatParams (opted in), on a
    tree of 7 leaves (by default) and on the same tree with flat moments."""
    import jaxfox._ffi

    monkeypatch.setattr(jaxfox._ffi, "kernels_available", lambda: True)
    monkeypatch.setenv("JAXFOX_OPT_IN_KERNELS", "adamw")
    fp, gs = _flat_case(0)
    P = fp.layout.size
    lr = optax.warmup_cosine_decay_schedule(0.0, 3e-3, 10, 100, 1e-4)  # a traced learning rate
    tx = optim.fused_adamw(lr, b1=0.8, b2=0.99, eps=1e-6, weight_decay=0.05, max_grad_norm=clip)
    st = tx.init(fp)
    (call,) = _adamw_calls(_lower_step(tx, gs[0], st, fp))
    ins, outs = _call_types(call)
    assert ins == ["3xf32", f"{P}xf32", f"{P}xf32", f"{P}xf32", f"{P}xf32", f"{P}xi1"], ins
    nb = optim._norm_blocks(P) if clip else 0
    assert outs == [f"{nb}xf32", f"{P}xf32", f"{P}xf32", f"{P}xf32"], outs
    assert _aliases(call) == {1: 1, 3: 2, 4: 3}
    assert f"clip = {int(clip is not None)} : i64" in call and "mask_modes = dense<2> : tensor<1xi64>" in call
    assert "flat_moments = 0 : i64" in call and "one_minus_b1 = 2.000000e-01 : f32" in call
    # a tree of 7 leaves, the default rule (no opt-in): per-leaf moments, then flat ones
    monkeypatch.delenv("JAXFOX_OPT_IN_KERNELS")
    tree, gtree = fp.tree, gs[0].tree
    sizes = [x.size for x in jax.tree.leaves(tree)]
    ndim2 = [x.ndim >= 2 for x in jax.tree.leaves(tree)]
    for flat_m in (False, True):
        t = optim.fused_adamw(lr, weight_decay=0.05, max_grad_norm=clip, flatten_moments=flat_m)
        (call,) = _adamw_calls(_lower_step(t, gtree, t.init(tree), tree))
        ins, outs = _call_types(call)
        L, S = len(sizes), (1 if flat_m else len(sizes))
        moments = [f"{P}xf32"] * 2 if flat_m else [f"{n}xf32" for n in sizes] * 2
        assert ins == ["3xf32"] + [f"{n}xf32" for n in sizes] * 2 + moments + ["0xi1"] * L, ins
        parts = sum(optim._norm_blocks(n) for n in sizes) if clip else 0
        assert outs == [f"{parts}xf32"] + [f"{n}xf32" for n in sizes] + moments, outs
        want = {1 + i: 1 + i for i in range(L)} | {1 + 2 * L + k: 1 + L + k for k in range(2 * S)}
        assert _aliases(call) == want
        modes = ", ".join(str(int(b)) for b in ndim2)  # the default mask: Python bools per leaf -> modes 1 / 0
        assert f"mask_modes = dense<[{modes}]> : tensor<{L}xi64>" in call and f"flat_moments = {int(flat_m)}" in call
    # inside a jitted training loop (scan over steps), with the schedule's count traced
    def loop(fp, st, gflat):
        def body(c, g):
            p, s = tx.step(optim.FlatParams(g, fp.layout), c[1], c[0])
            return (p, s), None
        return jax.lax.scan(body, (fp, st), gflat)[0]

    monkeypatch.setenv("JAXFOX_OPT_IN_KERNELS", "adamw")
    gflat = jnp.stack([g.flat for g in gs])
    text = jax.jit(loop).trace(fp, st, gflat).lower(lowering_platforms=("cuda",)).as_text()
    assert len(_adamw_calls(text)) == 1
    # vmap (an ensemble of optimizers): broadcast_all batches every operand, aliasing kept
    vtext = jax.jit(jax.vmap(tx.step)).trace(
        *jax.tree.map(lambda x: jnp.stack([x, x]), (gs[0], st, fp))).lower(lowering_platforms=("cuda",)).as_text()
    (vcall,) = _adamw_calls(vtext)
    assert _call_types(vcall)[0] == ["2x3xf32"] + [f"2x{P}xf32"] * 4 + [f"2x{P}xi1"]
    assert _aliases(vcall) == {1: 1, 3: 2, 4: 3}
    # lowered for CPU and CUDA at once: platform_dependent keeps both branches (their types must agree)
    both = jax.jit(tx.step).trace(gs[0], st, fp).lower(lowering_platforms=("cpu", "cuda")).as_text()
    assert len(_adamw_calls(both)) == 1 and "stablehlo.case" in both


def test_dqn_update_lowers_with_the_adamw_kernel_when_opted_in(monkeypatch):
    """make_update uses opt.step: inside its shard_map the fused AdamW kernel replaces update + apply."""
    import jaxfox._ffi
    from jaxfox.models.branching_c51 import init_agent, make_update, support

    monkeypatch.setattr(jaxfox._ffi, "kernels_available", lambda: True)
    agent, opt, dan = init_agent(jax.random.key(0), num_branches=2, capacity=128)
    # a fresh update function per lowering: shard_map caches its traced body (the opt-in is read at trace time)
    lower = lambda: jax.jit(make_update(opt, dan, support(), batch_size=32)).trace(  # noqa: E731
        agent, jax.random.key(1), 0.4).lower(lowering_platforms=("cuda",)).as_text()
    monkeypatch.delenv("JAXFOX_OPT_IN_KERNELS", raising=False)
    assert not _adamw_calls(lower())
    monkeypatch.setenv("JAXFOX_OPT_IN_KERNELS", "adamw")
    text = lower()
    assert len(_adamw_calls(text)) == 1 and "custom_call @jaxfox_c51_loss" in text


def test_step_kernel_path_mask_modes_and_fallbacks(monkeypatch):
    import jaxfox
    import jaxfox._ffi

    monkeypatch.setattr(jaxfox._ffi, "kernels_available", lambda: True)
    fp, gs = _flat_case(0)
    tx = optim.fused_adamw(1e-3, weight_decay=0.1)
    st = tx.init(fp)
    # one flat buffer: opt-in off -> the reference, no custom call; opted in -> the kernel
    monkeypatch.delenv("JAXFOX_OPT_IN_KERNELS", raising=False)
    assert not _adamw_calls(_lower_step(tx, gs[0], st, fp))
    monkeypatch.setenv("JAXFOX_OPT_IN_KERNELS", "adamw")
    assert len(_adamw_calls(_lower_step(tx, gs[0], st, fp))) == 1
    monkeypatch.delenv("JAXFOX_OPT_IN_KERNELS")
    # update alone never runs the kernel
    tree, gtree = fp.tree, gs[0].tree
    assert not _adamw_calls(jax.jit(tx.update).trace(gtree, tx.init(tree), tree).lower(
        lowering_platforms=("cuda",)).as_text())
    # trees: the kernel by default for > 1 leaf of <= 65536 elements on average; not for one leaf or big leaves
    assert len(_adamw_calls(_lower_step(tx, gtree, tx.init(tree), tree))) == 1
    one = {"w": tree["dense1"]["w"]}
    assert not _adamw_calls(_lower_step(tx, {"w": gtree["dense1"]["w"]}, tx.init(one), one))
    big = {"a": jnp.zeros((300, 300)), "b": jnp.zeros((10,))}  # mean leaf 45005 elements: the kernel
    assert len(_adamw_calls(_lower_step(tx, big, tx.init(big), big))) == 1
    big["a"] = jnp.zeros((400, 400))                          # mean 80005: XLA
    assert not _adamw_calls(_lower_step(tx, big, tx.init(big), big))
    assert optim._kernel_by_default([65536, 65536]) and not optim._kernel_by_default([65537, 65536])
    # traced hyperparameters: a traced learning rate is a device scalar of the kernel; a traced b1 (a kernel
    # attribute otherwise) sends step to XLA
    def lower_traced(**hyper):
        def f(h, g, p):
            t = optim.fused_adamw(**{**dict(learning_rate=1e-3, weight_decay=0.1), **{k: h for k in hyper}})
            return t.step(g, t.init(p), p)
        return jax.jit(f).trace(jnp.float32(0.5), gtree, tree).lower(lowering_platforms=("cuda",)).as_text()
    assert len(_adamw_calls(lower_traced(learning_rate=True))) == 1
    assert not _adamw_calls(lower_traced(b1=True))
    # moments of another structure than params (not from init): the reference decides (and raises)
    with jaxfox.use_reference():
        monkeypatch.setattr(jaxfox._ffi, "kernels_available", lambda: False)
        assert not _adamw_calls(_lower_step(tx, gtree, tx.init(tree), tree))
    monkeypatch.setattr(jaxfox._ffi, "kernels_available", lambda: True)
    # mask modes per leaf: no decay (wd = 0, or mask False) -> 0 with empty masks, decay everywhere -> 1,
    # an elementwise mask -> 2 with the leaf's bool mask
    L = len(jax.tree.leaves(tree))
    elementwise = lambda p: jax.tree.map(lambda x: jnp.arange(x.size).reshape(x.shape) % 2 == 0, p)  # noqa: E731
    for kw, mode in ((dict(weight_decay=0.0), 0), (dict(mask=False), 0), (dict(mask=True), 1),
                     (dict(mask=elementwise), 2)):
        t = optim.fused_adamw(1e-3, **kw)
        (call,) = _adamw_calls(_lower_step(t, gtree, t.init(tree), tree))
        assert f"mask_modes = dense<{mode}> : tensor<{L}xi64>" in call, call
        masks = _call_types(call)[0][-L:]
        assert masks == ([f"{x.size}xi1" for x in jax.tree.leaves(tree)] if mode == 2 else ["0xi1"] * L)


def _fake_adamw_apply(target, out_shapes, vmap_method, input_output_aliases):
    """NumPy model of ffi/optim.cu jaxfox_adamw_apply (float32, one rounding per operation, the
    header's order; the norm summed in float64 over all leaves), run through pure_callback: checks on CPU
    what the Python side hands the kernel (scalars, leaves, moments, masks, attrs, result order, aliases)."""
    assert target == "jaxfox_adamw_apply" and vmap_method == "broadcast_all"

    def run(*args, b1, one_minus_b1, b2, one_minus_b2, eps, weight_decay, max_grad_norm, clip, flat_moments,
            mask_modes):
        f = np.float32
        L = len(mask_modes)
        S = 1 if flat_moments else L
        assert len(args) == 1 + 3 * L + 2 * S and len(out_shapes) == 1 + L + 2 * S
        assert input_output_aliases == {1 + i: 1 + i for i in range(L)} | {1 + 2 * L + k: 1 + L + k
                                                                             for k in range(2 * S)}
        scal = np.asarray(args[0])
        ps = [np.asarray(a, np.float32).copy() for a in args[1:1 + L]]
        gs = [np.asarray(a, np.float32).copy() for a in args[1 + L:1 + 2 * L]]
        mus = [np.asarray(a, np.float32).copy() for a in args[1 + 2 * L:1 + 2 * L + S]]
        nus = [np.asarray(a, np.float32).copy() for a in args[1 + 2 * L + S:1 + 2 * L + 2 * S]]
        masks = [np.asarray(a, bool) for a in args[1 + 2 * L + 2 * S:]]
        sizes = [p.size for p in ps]
        if flat_moments:  # leaf i's moments at offsets n_0 + .. + n_{i-1}
            cut = np.cumsum(sizes)[:-1]
            mus, nus = np.split(mus[0], cut), np.split(nus[0], cut)
        lr_neg, bc1, bc2 = (f(x) for x in scal)
        if clip:
            norm = f(np.sqrt(f(sum(np.sum(g.astype(np.float64) ** 2) for g in gs))))
            if not (norm < max_grad_norm or norm == 0):
                gs = [(g / norm) * f(max_grad_norm) for g in gs]
        for i in range(L):
            g, m, v, p = gs[i], mus[i], nus[i], ps[i]
            m = f(one_minus_b1) * g + f(b1) * m
            v = f(one_minus_b2) * (g * g) + f(b2) * v
            u = (m / bc1) / (np.sqrt(v / bc2) + f(eps))
            decay = masks[i] if mask_modes[i] == 2 else np.full(p.shape, mask_modes[i] == 1)
            assert masks[i].size == (p.size if mask_modes[i] == 2 else 0)
            u = np.where(decay, u + f(weight_decay) * p, u)
            ps[i], mus[i], nus[i] = (p + lr_neg * u).astype(np.float32), m.astype(np.float32), v.astype(np.float32)
        if flat_moments:
            mus, nus = [np.concatenate(mus)], [np.concatenate(nus)]
        ws = np.zeros(out_shapes[0].shape, np.float32)
        return (ws, *ps, *mus, *nus)

    def call(*args, **attrs):
        attrs["mask_modes"] = [int(x) for x in attrs["mask_modes"]]
        return jax.pure_callback(lambda *a: run(*a, **attrs), out_shapes, *args)

    return call


@pytest.mark.parametrize("case", ["flat", "tree", "flat_moments"])
@pytest.mark.parametrize("clip", [None, 1.0, 0.0])
@pytest.mark.parametrize("mask", [None, True])
def test_step_kernel_inputs_give_adamw(case, clip, mask, monkeypatch):
    """The kernel branch of step, with the FFI call replaced by a NumPy model of the kernel, matches
    the reference path to a few ulps and the float64 equations over 12 steps (traced schedule), on
    FlatParams, a tree (moments per leaf) and a tree with flat moments."""
    import jaxfox._ffi

    monkeypatch.setenv("JAXFOX_OPT_IN_KERNELS", "adamw")
    monkeypatch.setattr(jaxfox._ffi, "kernels_available", lambda: True)
    monkeypatch.setattr(optim, "dispatch", lambda kernel, reference, *a, **kw: kernel(*a))
    monkeypatch.setattr(optim, "_ffi_call", _fake_adamw_apply)
    fp, gs = _flat_case(3)
    params, grads = (fp, gs) if case == "flat" else (fp.tree, [g.tree for g in gs])
    lr = optax.warmup_cosine_decay_schedule(0.0, 3e-3, 4, 12, 1e-4)
    kw = dict(b1=0.8, b2=0.99, eps=1e-6, weight_decay=0.05, max_grad_norm=clip, mask=mask,
              flatten_moments=case == "flat_moments")
    tx = optim.fused_adamw(lr, **kw)
    step = jax.jit(tx.step)
    p, s = params, tx.init(params)
    pr, sr = params, tx.init(params)
    for g in grads:
        p, s = step(g, s, p)
        u, sr = tx.update(g, sr, pr)
        pr = optax.apply_updates(pr, u)
    assert int(s.count) == len(gs) and type(p) is type(params) and type(s.mu) is type(sr.mu)
    assert isinstance(s.mu, optim.FlatParams) == (case != "tree")
    # Compared at each buffer's scale (values crossing zero have tiny ulps): XLA CPU contracts the
    # reference's a * b + c into FMAs, the model rounds every operation, and 12 steps accumulate that.
    for a, b in ((p, pr), (s.mu, sr.mu), (s.nu, sr.nu)):
        scale = max(float(np.max(np.abs(np.asarray(y)))) for y in jax.tree.leaves(b))  # the whole tree's
        for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
            x, y = np.asarray(x, np.float64), np.asarray(y, np.float64)
            assert x.shape == y.shape and np.max(np.abs(x - y)) <= 8 * np.spacing(np.float32(scale))
    tree = fp.tree
    m = jax.tree.map(lambda x: x.ndim >= 2 if mask is None else True, tree)
    want = np_adamw_tree(tree, [g.tree for g in gs], lr, 0.8, 0.99, 1e-6, 0.05, m, clip)
    got = p.tree if case == "flat" else p
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        np.testing.assert_allclose(np.asarray(a), b, rtol=2e-5, atol=2e-6)
    moved = max(float(jnp.max(jnp.abs(a - b))) for a, b in zip(jax.tree.leaves(p), jax.tree.leaves(params)))
    assert moved > (1e-5 if clip == 0.0 else 1e-3)


def test_nn_optimizer_falls_back_to_nnx_optimizer_without_step():
    """jaxfox.nn.Optimizer with a transformation that has no step (optax.adam) is nnx.Optimizer, bitwise."""
    from flax import nnx

    import jaxfox.nn

    def make(cls):
        model = nnx.Linear(4, 3, rngs=nnx.Rngs(0))
        return model, cls(model, optax.adam(1e-2), wrt=nnx.Param)

    (m1, o1), (m2, o2) = make(jaxfox.nn.Optimizer), make(nnx.Optimizer)
    x = jnp.linspace(-1.0, 1.0, 8).reshape(2, 4)
    grads = nnx.grad(lambda mm: jnp.sum(mm(x) ** 2))(m1)
    upd = nnx.jit(lambda m, o, g: o.update(m, g))
    for _ in range(3):
        upd(m1, o1, grads)
        upd(m2, o2, grads)
    _bits_equal(nnx.state(m1, nnx.Param), nnx.state(m2, nnx.Param))
    assert int(o1.step[...]) == 3


def test_default_mask_decays_the_matrices_inside_a_nested_flatparams():
    """A FlatParams inside a larger tree (e.g. {"net": FlatParams, "head": ...}) was one 1-D leaf [P] to the
    ndim >= 2 rule, so none of its weight matrices were decayed. Oracle: np_adamw per leaf of the view."""
    rng = np.random.default_rng(4)
    inner = {"w": jnp.asarray(rng.normal(size=(3, 4)), jnp.float32), "b": jnp.asarray(rng.normal(size=4), jnp.float32)}
    params = {"net": optim.FlatParams.from_tree(inner), "w2": jnp.asarray(rng.normal(size=(2, 2)), jnp.float32)}
    mask = optim.default_decay_mask(params)
    np.testing.assert_array_equal(np.asarray(mask["net"].flat), [False] * 4 + [True] * 12)  # leaves b, w
    assert mask["w2"] is True
    grads = [{"net.w": rng.normal(size=(3, 4)), "net.b": rng.normal(size=4), "w2": rng.normal(size=(2, 2))}
             for _ in range(5)]
    grads = [{k: v.astype(np.float32) for k, v in g.items()} for g in grads]
    for flat_m in (False, True):
        tx = optim.fused_adamw(1e-2, weight_decay=0.5, max_grad_norm=1.0, flatten_moments=flat_m)
        p, st = params, tx.init(params)
        for g in grads:
            gt = {"net": optim.FlatParams(optim.flatten({"w": g["net.w"], "b": g["net.b"]})[0], params["net"].layout),
                  "w2": jnp.asarray(g["w2"])}
            p, st = tx.step(gt, st, p)
        want = np_adamw({"net.w": inner["w"], "net.b": inner["b"], "w2": params["w2"]}, grads, lambda c: 1e-2,
                        0.9, 0.999, 1e-8, 0.5, {"net.w": True, "net.b": False, "w2": True}, 1.0)
        got = {"net.w": p["net"].tree["w"], "net.b": p["net"].tree["b"], "w2": p["w2"]}
        for k in want:
            np.testing.assert_allclose(np.asarray(got[k]), want[k], rtol=1e-5, atol=1e-6, err_msg=k)
