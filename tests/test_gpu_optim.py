"""GPU tests of the fused AdamW update-and-apply kernel (``ffi/optim.cu``, target jaxfox_adamw_apply);
``pytest -m gpu``.

``fused_adamw(...).step`` on FlatParams runs the kernel (opted in here: JAXFOX_OPT_IN_KERNELS=adamw; the tree
tests run it by the default rule, without the opt-in) and
is compared with the reference path on the same GPU (``update`` then ``optax.apply_updates``, traced inside
``jaxfox.use_reference()``) and with a float64 NumPy AdamW written from the equations (``np_adamw_steps``,
optax's order of terms; it shares no code with jaxfox.optim).

Tolerances: the kernel rounds every float32 operation of the reference's expressions on its own; XLA's
fusion of the reference may contract a * b + c into FMAs and sums the clip's global norm in another order,
so one step differs by ~1-2 ulp per operation (4 ulps at the buffer's scale allowed after 1 and 3 steps).
Over many steps the rounding of p + update differs by up to 1 ulp of p whenever the updates differ, and
the moments carry their differences on (nu decays by b2 = 0.999 per step only), so after N steps
2 N ulps at the buffer's scale are allowed (a wrong constant, bias correction or mask moves p by ~lr
per step, far beyond that).
"""

from __future__ import annotations

import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jaxfox
from conftest import assert_command_buffers_identical
from jaxfox import optim

if not jaxfox.kernels_available():
    pytest.skip(f"jaxfox CUDA kernels unavailable: {jaxfox.kernels_unavailable_reason()}",
                allow_module_level=True)

pytestmark = pytest.mark.gpu

SIZES = (1, 3, 4097, 10_000_003)
B1, B2, EPS, WD, LR = 0.9, 0.999, 1e-8, 0.05, 1e-3


@pytest.fixture(autouse=True)
def _opt_in(monkeypatch):
    monkeypatch.setenv("JAXFOX_OPT_IN_KERNELS", "adamw")  # the kernel is opt-in (jaxfox._ffi.OPT_IN)


def layout_for(P):
    """A FlatParams layout of P elements: a vector "b" (not decayed) then a matrix "w" [k, 1] (decayed)."""
    k = (P + 1) // 2
    return optim.FlatParams.from_tree({"b": jnp.zeros((P - k,)), "w": jnp.zeros((k, 1))}).layout


def decay_of(layout):
    return np.concatenate([np.full(n, len(s) >= 2) for s, n in zip(layout.shapes, layout.sizes)])


def random_state(P, seed, count):
    """(params, FusedAdamWState) with random params, moments (nu >= 0) and step count."""
    rng = np.random.default_rng(seed)
    lay = layout_for(P)
    f = lambda x: optim.FlatParams(jnp.asarray(x, jnp.float32), lay)  # noqa: E731
    params = f(rng.standard_normal(P))
    mu = 0.01 * rng.standard_normal(P)
    # nu >= mu^2, as for moments of one gradient sequence (so |m / sqrt(v)| stays O(1))
    st = optim.FusedAdamWState(count=jnp.asarray(count, jnp.int32), mu=f(mu),
                               nu=f(mu * mu + 1e-4 * rng.uniform(0.0, 1.0, P) ** 2))
    return params, st


def scan_steps(tx, steps, scales):
    """A fresh function (params, state, key) -> (params, state) after `steps` steps; the gradient of
    step t is normal(fold_in(key, t)) * scales[t % len(scales)], drawn on the device."""
    sc = jnp.asarray(scales, jnp.float32)

    def run(params, st, key):
        def body(c, t):
            p, s = c
            g = jax.random.normal(jax.random.fold_in(key, t), p.flat.shape, jnp.float32) * sc[t % sc.shape[0]]
            return tx.step(optim.FlatParams(g, p.layout), s, p), None
        return jax.lax.scan(body, (params, st), jnp.arange(steps))[0]

    return run


def run_both(fn, *args):
    """(kernel path, reference path) results of jit(fn)(*args), on the host."""
    assert jaxfox.kernels_available()
    got = jax.device_get(jax.jit(fn)(*args))
    with jaxfox.use_reference():
        want = jax.device_get(jax.jit(fn)(*args))
    return got, want


def assert_at_scale(got, want, ulps, what=""):
    """max |got - want| <= ulps * ulp(max |want|) over the finite elements; NaN and +-Inf where want has them."""
    a, b = np.asarray(got, np.float64), np.asarray(want, np.float64)
    assert np.array_equal(np.isnan(a), np.isnan(b)), f"{what}: NaN pattern differs"
    inf = np.isinf(b)
    assert np.array_equal(np.isinf(a), inf) and np.array_equal(a[inf], b[inf]), f"{what}: Inf pattern differs"
    fin = np.isfinite(b)
    if not fin.any():
        return
    scale = np.spacing(np.float32(np.max(np.abs(b[fin]))))
    err = np.max(np.abs(a[fin] - b[fin]))
    assert err <= ulps * scale, f"{what}: {err / scale:.1f} ulps at scale (allowed {ulps})"


def assert_states_close(got, want, ulps):
    (pk, sk), (pr, sr) = got, want
    assert int(sk.count) == int(sr.count)
    for name, a, b in (("params", pk.flat, pr.flat), ("mu", sk.mu.flat, sr.mu.flat), ("nu", sk.nu.flat, sr.nu.flat)):
        assert_at_scale(a, b, ulps, name)


def np_adamw_steps(params, st, grads, lr, b1, b2, eps, wd, decay, max_norm):
    """float64 AdamW (optax.adamw + clip_by_global_norm with the norm == 0 guard) from the equations."""
    p, m, v = (np.asarray(x.flat, np.float64) for x in (params, st.mu, st.nu))
    t = int(st.count)
    for g in grads:
        g = np.asarray(g, np.float64)
        t += 1
        if max_norm is not None:
            n = np.sqrt(np.sum(g * g))
            if not n < max_norm and n > 0:
                g = g / n * max_norm
        m = (1 - b1) * g + b1 * m
        v = (1 - b2) * g * g + b2 * v
        u = (m / (1 - b1 ** t)) / (np.sqrt(v / (1 - b2 ** t)) + eps) + np.where(decay, wd * p, 0.0)
        p = p - lr * u
    return p, m, v


def assert_matches_float64(params0, st0, got, want64, grads):
    """Kernel results against np_adamw_steps. float32 AdamW itself (kernel and reference alike) rounds
    b2 = 0.999 and 1 - b2^t, a relative error up to ~1.3e-5 in v_hat, so p may differ by ~1e-5 of each
    step's update (3e-5 of the movement allowed); mu = (1 - b1) g + b1 mu may cancel, so its absolute
    error is bounded by ulps of its terms (1e-6 of their scale allowed)."""
    p64, m64, v64 = want64
    p, s = got
    p0 = np.asarray(params0.flat, np.float64)
    pk, mk, vk = (np.asarray(x, np.float64) for x in (p.flat, s.mu.flat, s.nu.flat))
    assert np.all(np.abs(pk - p64) <= 1e-6 * np.abs(p64) + 3e-5 * np.abs(p64 - p0) + 1e-7), \
        np.max(np.abs(pk - p64) - 3e-5 * np.abs(p64 - p0))
    terms = max(np.max(np.abs(np.asarray(st0.mu.flat))), np.max(np.abs(grads)) if np.size(grads) else 0.0, 1e-30)
    np.testing.assert_allclose(mk, m64, rtol=1e-5, atol=1e-6 * terms)
    np.testing.assert_allclose(vk, v64, rtol=1e-5, atol=0)


def _hlo(fn, *args):
    return jax.jit(fn).lower(*args).compile().as_text()


# ----------------------------------------------------------------------------------------------
def test_kernel_is_in_the_program(monkeypatch):
    params, st = random_state(4097, 0, 0)
    g = optim.FlatParams(jnp.ones(4097, jnp.float32), params.layout)
    tx = optim.fused_adamw(LR, weight_decay=WD, max_grad_norm=1.0)
    assert "jaxfox_adamw_apply" in _hlo(tx.step, g, st, params)
    with jaxfox.use_reference():
        assert "jaxfox_adamw_apply" not in _hlo(tx.step, g, st, params)
    monkeypatch.delenv("JAXFOX_OPT_IN_KERNELS")  # read at trace time: a fresh optimizer, traced anew
    tx = optim.fused_adamw(LR, weight_decay=WD, max_grad_norm=1.0)
    assert "jaxfox_adamw_apply" not in _hlo(tx.step, g, st, params)


@pytest.mark.parametrize("P", SIZES)
@pytest.mark.parametrize("clip", [None, "active", "inactive", "mixed"])
def test_kernel_matches_reference_and_float64(P, clip):
    """1 and 3 steps from a random state against the reference (4 ulps at scale) and the float64
    equations; 100 steps against the reference (2 N ulps at scale)."""
    # norm of N(0, 1) * s over P elements ~ s sqrt(P): max_norm far below / above it, or between scales.
    max_norm = {None: None, "active": 0.01 * np.sqrt(P), "inactive": 100.0 * np.sqrt(P),
                "mixed": np.sqrt(P)}[clip]
    scales = (0.2, 5.0) if clip == "mixed" else (1.0,)
    lr = optax.warmup_cosine_decay_schedule(0.0, LR, 10, 200, 1e-5) if clip == "mixed" else LR
    tx = optim.fused_adamw(lr, b1=B1, b2=B2, eps=EPS, weight_decay=WD, max_grad_norm=max_norm)
    params, st = random_state(P, seed=P % 1000, count=7)
    rng = np.random.default_rng(1)
    grads = (rng.standard_normal((3, P)) * np.resize(scales, 3)[:, None]).astype(np.float32)

    def three(params, st, grads):
        out = []
        for k in range(3):
            params, st = tx.step(optim.FlatParams(grads[k], params.layout), st, params)
            out.append((params, st))
        return out

    got, want = run_both(three, params, st, jnp.asarray(grads))
    for k in (0, 2):
        assert_states_close(got[k], want[k], ulps=4)
    if not callable(lr):  # the float64 equations (constant learning rate)
        want64 = np_adamw_steps(params, st, grads, LR, B1, B2, EPS, WD, decay_of(params.layout), max_norm)
        assert_matches_float64(params, st, got[2], want64, grads)
    steps = 100
    got, want = run_both(scan_steps(tx, steps, scales), params, st, jax.random.key(P))
    assert_states_close(got, want, ulps=2 * steps)
    assert int(got[1].count) == 7 + steps
    assert not np.array_equal(np.asarray(got[0].flat), np.asarray(params.flat))


@pytest.mark.parametrize("P", (3, 4097))
@pytest.mark.parametrize("kw", [dict(), dict(mask=True), dict(weight_decay=0.0), dict(mask=False)],
                         ids=["elementwise", "all", "wd0", "none"])
def test_mask_modes(P, kw):
    tx = optim.fused_adamw(LR, **{"weight_decay": WD, **kw}, max_grad_norm=1.0)
    params, st = random_state(P, seed=3, count=0)
    g = optim.FlatParams(jnp.asarray(np.random.default_rng(4).standard_normal(P), jnp.float32), params.layout)
    got, want = run_both(tx.step, g, st, params)
    assert_states_close(got, want, ulps=4)
    wd = kw.get("weight_decay", WD)
    decay = decay_of(params.layout) if "mask" not in kw else np.full(P, kw["mask"])
    gs = np.asarray(g.flat)[None]
    assert_matches_float64(params, st, got, np_adamw_steps(params, st, gs, LR, 0.9, 0.999, 1e-8, wd, decay, 1.0), gs)


@pytest.mark.parametrize("P", SIZES)
def test_zero_norm_zero_max_norm_and_nonfinite_gradients(P):
    params, st = random_state(P, seed=5, count=2)
    lay = params.layout
    # ||g|| == max_norm == 0: g stays 0 (no 0/0), only the decay and the moments' decay act.
    tx0 = optim.fused_adamw(LR, weight_decay=WD, max_grad_norm=0.0)
    zeros = optim.FlatParams(jnp.zeros(P, jnp.float32), lay)
    got, want = run_both(tx0.step, zeros, st, params)
    assert all(np.isfinite(np.asarray(x)).all() for x in jax.tree.leaves(got))
    assert_states_close(got, want, ulps=4)
    z = np.zeros((1, P))
    assert_matches_float64(params, st, got, np_adamw_steps(params, st, z, LR, 0.9, 0.999, 1e-8, WD, decay_of(lay), 0.0), z)
    # NaN / Inf gradients propagate as in the reference: without clipping only at their element, with
    # clipping a NaN norm poisons every element, an Inf norm zeroes the finite ones (g / Inf) and makes
    # Inf / Inf = NaN at the Inf.
    gbad = np.random.default_rng(6).standard_normal(P).astype(np.float32)
    gbad[P // 2] = np.nan
    ginf = gbad.copy()
    ginf[P // 2] = np.inf
    for clip in (None, 1.0):
        tx = optim.fused_adamw(LR, weight_decay=WD, max_grad_norm=clip)
        for gb in (gbad, ginf):
            got, want = run_both(tx.step, optim.FlatParams(jnp.asarray(gb), lay), st, params)
            assert_states_close(got, want, ulps=4)  # includes: the same NaN pattern
            nan_p = np.isnan(np.asarray(got[0].flat))
            assert nan_p[P // 2]
            if clip is None or np.isnan(gb[P // 2]):
                assert nan_p.sum() == (1 if clip is None else P)


@pytest.mark.parametrize("P", (4096, 4097, 5))
def test_vmap_ensemble(P):
    """vmap over 2 optimizer instances (broadcast_all: [V, P] buffers; P % 4 != 0 takes the scalar loads)."""
    tx = optim.fused_adamw(LR, weight_decay=WD, max_grad_norm=float(np.sqrt(P)))
    (p1, s1), (p2, s2) = random_state(P, 7, 3), random_state(P, 8, 3)
    stack = lambda a, b: jax.tree.map(lambda x, y: jnp.stack([x, y]), a, b)  # noqa: E731
    rng = np.random.default_rng(9)
    g = optim.FlatParams(jnp.asarray(rng.standard_normal((2, P)) * np.array([[0.2], [5.0]]), jnp.float32), p1.layout)
    got, want = run_both(jax.vmap(tx.step), g, stack(s1, s2), stack(p1, p2))

    def pick(tree, v):
        return jax.tree.map(lambda x: x[v], tree)

    for v in range(2):
        assert_states_close(pick(got, v), pick(want, v), ulps=4)
    alone = jax.device_get(jax.jit(tx.step)(pick(g, 1), s2, p2))
    # instance 1 alone: the same per-element operations and norm order (a function of P), the same bits
    assert_states_close(pick(got, 1), alone, ulps=0)


@pytest.mark.parametrize("P", (4097, 10_000_003))
def test_bitwise_repeatable(P):
    tx = optim.fused_adamw(LR, weight_decay=WD, max_grad_norm=float(np.sqrt(P)))
    params, st = random_state(P, 10, 5)
    g = optim.FlatParams(jnp.asarray(np.random.default_rng(11).standard_normal(P) * 2.0, jnp.float32), params.layout)
    f = jax.jit(tx.step)
    first = jax.device_get(f(g, st, params))
    for run in range(9):
        again = jax.device_get(f(g, st, params))
        for a, b in zip(jax.tree.leaves(first), jax.tree.leaves(again)):
            assert np.array_equal(np.asarray(a), np.asarray(b)), f"run {run + 2} differs"
    jax.clear_caches()
    other = jax.device_get(jax.jit(tx.step)(g, st, params))  # a second compilation
    for a, b in zip(jax.tree.leaves(first), jax.tree.leaves(other)):
        assert np.array_equal(np.asarray(a), np.asarray(b))


def test_dqn_update_runs_the_kernel():
    """The DQN update (make_update uses opt.step) with the kernel opted in equals the reference path."""
    from jaxfox import per
    from jaxfox.models.branching_c51 import Transition, init_agent, make_update, support

    n = 256
    agent, opt, dan = init_agent(jax.random.key(0), num_branches=3, capacity=n, lr=1e-3)
    r = np.random.default_rng(12)
    items = Transition(jnp.asarray(r.standard_normal((n, 48)), jnp.float32), jnp.asarray(r.integers(0, 5, (n, 3)), jnp.int32),
                       jnp.asarray(r.standard_normal(n), jnp.float32), jnp.full((n,), 0.9, jnp.float32),
                       jnp.asarray(r.standard_normal((n, 48)), jnp.float32))
    # eps = 1e-3: u = m / (sqrt(v) + eps) is then insensitive to the last-bit differences of the loss
    # kernels' gradients where |g| ~ 0 (with eps = 1e-8 those flip u between -1 and 1).
    opt = jaxfox.fused_adamw(1e-3, eps=1e-3, weight_decay=1e-4, max_grad_norm=10.0)
    agent = agent._replace(buffer=per.add(agent.buffer, items), opt=opt.init(agent.online))
    update = make_update(opt, dan, support(), batch_size=64, bf16=False)
    assert "jaxfox_adamw_apply" in jax.jit(update).lower(agent, jax.random.key(1), 0.4).compile().as_text()
    got, _ = jax.device_get(jax.jit(update)(agent, jax.random.key(1), 0.4))
    with jaxfox.use_reference():
        want, _ = jax.device_get(jax.jit(update)(agent, jax.random.key(1), 0.4))
    # the loss kernels differ from their references in the last bits too: compared at the step's scale
    step = np.max(np.abs(np.asarray(want.online.flat) - np.asarray(agent.online.flat)))
    assert step > 1e-4
    assert np.max(np.abs(np.asarray(got.online.flat) - np.asarray(want.online.flat))) <= 1e-3 * step


# ----------------------------------------------------------------------------------------------
# Parameter trees: every leaf in one call (the default rule: > 1 leaf, <= 65536 elements per leaf on average).
_TREE_SHAPES = [(), (0,), (1,), (3,), (5, 7), (4097,), (64, 33), (16, 16, 3), (2, 2), (257,)]


def tree_case(seed, n_leaves=60, flat_moments=False, count=4):
    """(params, state, tx-independent grads [3]) for a dict of n_leaves leaves cycling through _TREE_SHAPES
    (a scalar, an empty leaf, sizes around the float4 body and the 256-thread block); 60 leaves take two
    launches of ffi/optim.cu's 56-leaf table."""
    rng = np.random.default_rng(seed)
    shapes = [_TREE_SHAPES[i % len(_TREE_SHAPES)] for i in range(n_leaves)]
    mk = lambda sh, s=1.0: jnp.asarray(rng.standard_normal(sh) * s, jnp.float32)  # noqa: E731
    params = {f"l{i:02d}": mk(sh) for i, sh in enumerate(shapes)}
    mu = {k: mk(v.shape, 0.01) for k, v in params.items()}
    nu = {k: jnp.asarray(np.asarray(m) ** 2 + 1e-4 * rng.uniform(0, 1, m.shape) ** 2, jnp.float32) for k, m in mu.items()}
    if flat_moments:
        lay = optim.flatten(params)[1]
        mu, nu = (optim.FlatParams(optim.flatten(t)[0], lay) for t in (mu, nu))
    st = optim.FusedAdamWState(count=jnp.asarray(count, jnp.int32), mu=mu, nu=nu)
    grads = [{k: mk(v.shape, sc) for k, v in params.items()} for sc in (1.0, 5.0, 0.2)]
    return params, st, grads


def flat_view(params, st):
    """(params, state) of a tree as objects with .flat (numpy, jax.tree.leaves order), for np_adamw_steps."""
    from types import SimpleNamespace as NS

    cat = lambda t: np.concatenate([np.ravel(np.asarray(x)) for x in jax.tree.leaves(t)])  # noqa: E731
    return NS(flat=cat(params)), NS(count=st.count, mu=NS(flat=cat(st.mu)), nu=NS(flat=cat(st.nu)))


def assert_trees_close(got, want, ulps):
    (pk, sk), (pr, sr) = got, want
    assert int(sk.count) == int(sr.count)
    for name, a, b in (("params", pk, pr), ("mu", sk.mu, sr.mu), ("nu", sk.nu, sr.nu)):
        assert jax.tree.structure(a) == jax.tree.structure(b), name
        cat = lambda t: np.concatenate([np.ravel(np.asarray(x)) for x in jax.tree.leaves(t)])  # noqa: E731
        assert_at_scale(cat(a), cat(b), ulps, name)


@pytest.mark.parametrize("flat_moments", [False, True], ids=["tree_moments", "flat_moments"])
@pytest.mark.parametrize("clip", [None, "active", "inactive"])
def test_tree_kernel_matches_reference_and_float64(flat_moments, clip, monkeypatch):
    """A 60-leaf tree, the kernel by the default rule (no opt-in): 1 and 3 steps against the reference path
    (4 ulps at the tree's scale) and the float64 equations (the default mask: matrices decayed), 50 scanned
    steps against the reference (2 N ulps)."""
    monkeypatch.delenv("JAXFOX_OPT_IN_KERNELS")
    params, st, grads = tree_case(1, flat_moments=flat_moments)
    P = sum(int(np.size(x)) for x in jax.tree.leaves(params))
    max_norm = {None: None, "active": 0.01 * np.sqrt(P), "inactive": 100.0 * np.sqrt(P)}[clip]
    tx = optim.fused_adamw(LR, b1=B1, b2=B2, eps=EPS, weight_decay=WD, max_grad_norm=max_norm,
                           flatten_moments=flat_moments)
    assert "jaxfox_adamw_apply" in _hlo(tx.step, grads[0], st, params)

    def three(params, st, grads):
        out = []
        for g in grads:
            params, st = tx.step(g, st, params)
            out.append((params, st))
        return out

    got, want = run_both(three, params, st, grads)
    for k in (0, 2):
        assert_trees_close(got[k], want[k], ulps=4)
    decay = np.concatenate([np.full(int(np.size(x)), np.ndim(x) >= 2) for x in jax.tree.leaves(params)])
    gflat = np.stack([flat_view(g, st)[0].flat for g in grads])
    p0, s0 = flat_view(params, st)
    want64 = np_adamw_steps(p0, s0, gflat, LR, B1, B2, EPS, WD, decay, max_norm)
    assert_matches_float64(p0, s0, flat_view(*got[2]), want64, gflat)

    def scanned(params, st, key):
        def body(c, t):
            p, s = c
            ks = jax.random.split(jax.random.fold_in(key, t), len(jax.tree.leaves(p)))
            g = jax.tree.unflatten(jax.tree.structure(p), [jax.random.normal(k, x.shape) for k, x in
                                                           zip(ks, jax.tree.leaves(p))])
            return tx.step(g, s, p), None
        return jax.lax.scan(body, (params, st), jnp.arange(50))[0]

    got, want = run_both(scanned, params, st, jax.random.key(3))
    assert_trees_close(got, want, ulps=100)


@pytest.mark.parametrize("flat_moments", [False, True], ids=["tree_moments", "flat_moments"])
def test_tree_kernel_mask_vmap_and_bitwise(flat_moments, monkeypatch):
    """Elementwise masks per leaf (mode 2) and decay everywhere (mode 1); vmap over 2 instances (flat moments:
    rows P apart, P % 4 != 0: the scalar loads) against each instance alone (same bits); 10 runs bitwise equal."""
    monkeypatch.delenv("JAXFOX_OPT_IN_KERNELS")
    params, st, grads = tree_case(2, n_leaves=12, flat_moments=flat_moments)
    elementwise = lambda p: jax.tree.map(lambda x: jnp.arange(x.size).reshape(x.shape) % 3 == 0, p)  # noqa: E731
    for mask in (elementwise, True):
        tx = optim.fused_adamw(LR, weight_decay=WD, mask=mask, max_grad_norm=1.0, flatten_moments=flat_moments)
        got, want = run_both(tx.step, grads[0], st, params)
        assert_trees_close(got, want, ulps=4)
    P = sum(int(np.size(x)) for x in jax.tree.leaves(params))
    assert P % 4 != 0
    tx = optim.fused_adamw(LR, weight_decay=WD, max_grad_norm=float(np.sqrt(P)), flatten_moments=flat_moments)
    _, st2, grads2 = tree_case(3, n_leaves=12, flat_moments=flat_moments)
    stack = lambda a, b: jax.tree.map(lambda x, y: jnp.stack([x, y]), a, b)  # noqa: E731
    pick = lambda t, v: jax.tree.map(lambda x: x[v], t)  # noqa: E731
    args = (stack(grads[1], grads2[1]), stack(st, st2), stack(params, params))
    assert "jaxfox_adamw_apply" in _hlo(jax.vmap(tx.step), *args)
    got, want = run_both(jax.vmap(tx.step), *args)
    for v in range(2):
        assert_trees_close(pick(got, v), pick(want, v), ulps=4)
    alone = jax.device_get(jax.jit(tx.step)(grads2[1], st2, params))
    assert_trees_close(pick(got, 1), alone, ulps=0)
    f = jax.jit(tx.step)
    first = jax.device_get(f(grads[1], st, params))
    for run in range(9):
        again = jax.device_get(f(grads[1], st, params))
        for a, b in zip(jax.tree.leaves(first), jax.tree.leaves(again), strict=True):
            assert np.array_equal(np.asarray(a), np.asarray(b)), f"run {run + 2} differs"


def test_perception_training_step_runs_the_kernel(monkeypatch):
    """The main job's optimizer (make_optimizer: jaxfox.nn.Optimizer over fused_adamw with flat moments) runs the
    kernel in the whole training step by default; the losses of 5 steps (each after the previous updates) match
    the reference path's to 2e-5 (float32 matmuls: default_matmul_precision("highest"); the model's kernels and
    the optimizer's differ from their references in the last bits) and fall."""
    monkeypatch.delenv("JAXFOX_OPT_IN_KERNELS")
    from jaxfox.models.perception import benchmark_step

    step_fn, state, batch = benchmark_step(batch=32, window=16, num_features=8)
    assert "jaxfox_adamw_apply" in _hlo(step_fn, state, batch)

    def five(state, batch):
        losses = []
        for _ in range(5):
            state, loss = step_fn(state, batch)
            losses.append(loss)
        return jnp.stack(losses)

    with jax.default_matmul_precision("highest"):
        l_k, l_r = run_both(five, state, batch)
    assert float(l_k[-1]) < float(l_k[0]) - 0.1
    np.testing.assert_allclose(np.asarray(l_k), np.asarray(l_r), rtol=2e-5)


_CMD_BUFFER_SCRIPT = textwrap.dedent("""
    import os, sys
    os.environ["JAXFOX_OPT_IN_KERNELS"] = "adamw"
    import jax, jax.numpy as jnp, numpy as np
    import jaxfox
    from jaxfox import optim
    assert jaxfox.kernels_available(), jaxfox.kernels_unavailable_reason()
    out = {}
    for P in (4097, 10_000_003):
        k = (P + 1) // 2
        lay = optim.FlatParams.from_tree({"b": jnp.zeros((P - k,)), "w": jnp.zeros((k, 1))}).layout
        rng = np.random.default_rng(P % 97)
        f = lambda x: optim.FlatParams(jnp.asarray(x, jnp.float32), lay)
        params = f(rng.standard_normal(P))
        st = optim.FusedAdamWState(jnp.asarray(4, jnp.int32), f(0.01 * rng.standard_normal(P)),
                                   f(1e-4 * rng.uniform(0, 1, P) ** 2))
        g = f(rng.standard_normal(P) * 3.0)
        for clip in (None, float(np.sqrt(P))):
            tx = optim.fused_adamw(1e-3, weight_decay=0.05, max_grad_norm=clip)
            step = jax.jit(lambda g, s, p: tx.step(g, *tx.step(g, s, p)[::-1]))  # two steps in one program
            assert "jaxfox_adamw_apply" in step.lower(g, st, params).compile().as_text()
            for run in range(3):  # command buffers are recorded / updated over the first executions
                p, s = jax.device_get(step(g, st, params))
                for name, a in (("p", p.flat), ("mu", s.mu.flat), ("nu", s.nu.flat)):
                    out[f"adamw_{P}_{clip is not None}_{name}_run{run}"] = np.asarray(a)
    rng = np.random.default_rng(5)
    tree = {f"l{i:02d}": jnp.asarray(rng.standard_normal(sh), jnp.float32)
            for i, sh in enumerate([(3,), (5, 7), (4097,), (64, 33), ()] * 12)}
    g = jax.tree.map(lambda x: x * 2.0 + 0.1, tree)
    for flat in (False, True):
        tx = optim.fused_adamw(1e-3, weight_decay=0.05, max_grad_norm=1.0, flatten_moments=flat)
        st = tx.init(tree)
        step = jax.jit(lambda g, s, p: tx.step(g, *tx.step(g, s, p)[::-1]))
        assert "jaxfox_adamw_apply" in step.lower(g, st, tree).compile().as_text()
        for run in range(3):
            p, s = jax.device_get(step(g, st, tree))
            for i, a in enumerate(jax.tree.leaves((p, s.mu, s.nu))):
                out[f"tree_{flat}_{i}_run{run}"] = np.asarray(a)
    np.savez(sys.argv[1], **out)
    print("DONE", len(out))
""")


def test_command_buffers_on_and_off_identical(tmp_path):
    assert_command_buffers_identical(_CMD_BUFFER_SCRIPT, tmp_path)
