"""CPU tests of jaxfox.c51 (branching_dueling_logits, categorical_projection, categorical_double_q_loss).

Oracles, sharing no code with the library:
* ``np_project_hat``: float64 double loop of dopamine's ``project_distribution`` hat kernel,
  m_i = sum_j clip(1 - |Tz_j - z_i| / dz, 0, 1) p_j, Tz_j = clip(r + discount z_j, z_0, z_{N-1}).
* ``np_project_floor_ceil``: float64 loop of the projection of Bellemare et al. 2017 as their
  Algorithm 1 writes it (b = (Tz - z_0) / dz, l = floor(b), u = ceil(b), m_l += p (u - b), m_u += p (b - l)); it
  drops p_j whenever b_j is integral (l == u), so it is compared only where no b_j is integral.
* ``np_branch_loss`` / ``np_loss``: float64 single-branch C51 double-Q loss (softmax expectation,
  first-index argmax, hat projection, cross-entropy), looped over samples and branches.
* ``rlax.categorical_double_q_learning`` (when rlax is installed) as a second single-branch oracle.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import rel_err
from jaxfox.c51 import branching_dueling_logits, categorical_double_q_loss, categorical_projection


# ----------------------------------------------------------------------------------------------
# Float64 oracles.
def np_softmax(x):
    x = np.asarray(x, np.float64)
    e = np.exp(x - x.max(axis=-1, keepdims=True))
    return e / e.sum(axis=-1, keepdims=True)


def np_log_softmax(x):
    x = np.asarray(x, np.float64)
    s = x - x.max(axis=-1, keepdims=True)
    return s - np.log(np.exp(s).sum(axis=-1, keepdims=True))


def np_project_hat(z, p, r, discount):
    """One distribution: z [N], p [N], scalars r, discount -> m [N] (float64 loops)."""
    z = np.asarray(z, np.float64)
    p = np.asarray(p, np.float64)
    N = len(z)
    vmin, vmax = z[0], z[-1]
    dz = (vmax - vmin) / (N - 1)
    m = np.zeros(N)
    for j in range(N):
        tz = min(max(float(r) + float(discount) * z[j], vmin), vmax)
        m += np.clip(1.0 - np.abs(tz - z) / dz, 0.0, 1.0) * p[j]          # over all i at once
    return m


def np_project_floor_ceil(z, p, r, discount):
    """Eq. 7 via floor/ceil (loses p_j where b_j is integral). Returns (m [N], b [N])."""
    z = np.asarray(z, np.float64)
    p = np.asarray(p, np.float64)
    N = len(z)
    vmin, vmax = z[0], z[-1]
    dz = (vmax - vmin) / (N - 1)
    m = np.zeros(N)
    bs = np.zeros(N)
    for j in range(N):
        tz = min(max(float(r) + float(discount) * z[j], vmin), vmax)
        b = (tz - vmin) / dz
        lo, up = int(np.floor(b)), int(np.ceil(b))
        m[lo] += p[j] * (up - b)
        m[up] += p[j] * (b - lo)
        bs[j] = b
    return m, bs


def np_branch_loss(lt, a, r, discount, tgt, onl, z, a_star=None):
    """Single branch, single sample: lt, tgt, onl [A, N]; a int -> (loss, m [N], a_star)."""
    z = np.asarray(z, np.float64)
    q = (np_softmax(onl) * z).sum(axis=-1)                      # [A]
    if a_star is None:
        a_star = int(np.argmax(q))                              # first index on ties
    m = np_project_hat(z, np_softmax(tgt[a_star]), r, discount)
    loss = -(m * np_log_softmax(lt[a])).sum()
    return loss, m, a_star


def np_loss(lt, a, r, discount, tgt, onl, z):
    """[B, D, A, N] logits -> (loss [B], m [B, D, N]) in float64."""
    lt, tgt, onl = (np.asarray(x, np.float64) for x in (lt, tgt, onl))
    a = np.asarray(a)
    B, D = a.shape
    loss = np.zeros(B)
    ms = np.zeros((B, D, lt.shape[-1]))
    for b in range(B):
        for d in range(D):
            l, m, _ = np_branch_loss(lt[b, d], a[b, d], r[b], discount[b], tgt[b, d], onl[b, d], z)
            loss[b] += l / D
            ms[b, d] = m
    return loss, ms


def min_argmax_gap(onl, z):
    """Smallest gap between the best and second-best expected value over all (b, d), float64."""
    q = (np_softmax(onl) * np.asarray(z, np.float64)).sum(-1)
    top2 = np.sort(q, axis=-1)[..., -2:]
    return float(np.min(top2[..., 1] - top2[..., 0]))


# ----------------------------------------------------------------------------------------------
# Inputs.
Z51 = np.linspace(-10.0, 10.0, 51).astype(np.float32)      # the usual C51 support (not exactly representable)
Z11 = np.arange(-5.0, 6.0, dtype=np.float32)                # dz = 1, every value exact


def make_inputs(B=8, D=3, A=5, N=51, seed=0, scale=1.0, support=None):
    rng = np.random.default_rng(seed)
    z = Z51 if support is None and N == 51 else (support if support is not None
                                                 else np.linspace(-10, 10, N).astype(np.float32))
    f = lambda: (scale * rng.standard_normal((B, D, A, N))).astype(np.float32)
    return dict(
        logits_tm1=f(),
        a_tm1=rng.integers(0, A, (B, D)).astype(np.int32),
        r_t=rng.uniform(-3, 3, B).astype(np.float32),
        discount_t=(0.99 * (rng.uniform(size=B) > 0.2)).astype(np.float32),
        logits_t_target=f(),
        logits_t_online=f(),
        support=z,
    )


def random_probs(rng, B, N):
    return np.asarray(jax.nn.softmax(jnp.asarray(2.0 * rng.standard_normal((B, N)), jnp.float32)))


def project(z, p, r, discount):
    return np.asarray(categorical_projection(jnp.asarray(z), jnp.asarray(p, jnp.float32),
                                             jnp.asarray(r, jnp.float32), jnp.asarray(discount, jnp.float32)))


# ----------------------------------------------------------------------------------------------
# Projection edge cases.
def test_atoms_exactly_on_support_points_keep_their_mass():
    rng = np.random.default_rng(0)
    p = random_probs(rng, 3, 11)
    # r = +1 dz shifts every atom onto the next support point; the last one is clipped onto z_10.
    # r = -2, discount 1: shift down by two atoms; discount 0.5, r = 0: z_j / 2 (every other atom on a point).
    r = np.array([1.0, -2.0, 0.0], np.float32)
    disc = np.array([1.0, 1.0, 0.5], np.float32)
    m = project(Z11, p, r, disc)
    p64 = p.astype(np.float64)
    want = np.zeros((3, 11))
    want[0, 1:] = p64[0, :10]
    want[0, 10] += p64[0, 10]
    want[1, :9] = p64[1, 2:]
    want[1, 0] += p64[1, 0] + p64[1, 1]
    for j in range(11):                       # z_j / 2 = -2.5 .. 2.5: halves split, integers exact
        t = Z11[j] / 2.0 + 5.0
        lo = int(np.floor(t))
        want[2, lo] += p64[2, j] * (1 - (t - lo))
        if t != lo:
            want[2, lo + 1] += p64[2, j] * (t - lo)
    np.testing.assert_allclose(m, want, atol=1e-6, rtol=0)
    np.testing.assert_allclose(m.astype(np.float64).sum(-1), p64.sum(-1), atol=1e-6, rtol=0)
    # The floor/ceil form of eq. 7 would have lost mass in exactly these cases (so this test can fail).
    lost = [1.0 - np_project_floor_ceil(Z11, p64[k], r[k], disc[k])[0].sum() for k in range(3)]
    assert min(lost) > 1e-3


def test_shift_by_dz_on_float32_support_conserves_mass():
    """Z51's values are rounded; r = dz lands each Tz on (or within an ulp of) a support point."""
    rng = np.random.default_rng(1)
    p = random_probs(rng, 4, 51)
    r = np.array([0.4, -0.4, 0.8, 2.0], np.float32)
    disc = np.ones(4, np.float32)
    m = project(Z51, p, r, disc)
    assert (m >= 0).all()
    np.testing.assert_allclose(m.astype(np.float64).sum(-1), p.astype(np.float64).sum(-1), atol=1e-6, rtol=0)
    for k in range(4):
        np.testing.assert_allclose(m[k], np_project_hat(Z51, p[k], r[k], disc[k]), atol=2e-6, rtol=0)
        shift = int(round(r[k] / 0.4))
        want = np.zeros(51)
        for j in range(51):
            want[min(max(j + shift, 0), 50)] += p[k, j]
        np.testing.assert_allclose(m[k], want, atol=2e-6, rtol=0)


@pytest.mark.parametrize("r,end", [(100.0, -1), (20.0, -1), (-100.0, 0), (-20.0, 0)])
def test_rewards_beyond_the_support_put_all_mass_on_the_end_atom(r, end):
    """|r| >= 10 + 0.99 * 10: every Tz_j is beyond the support for each discount used."""
    rng = np.random.default_rng(2)
    p = random_probs(rng, 3, 51)
    m = project(Z51, p, np.full(3, r, np.float32), np.array([0.0, 0.5, 0.99], np.float32))
    want = np.zeros((3, 51))
    want[:, end] = p.astype(np.float64).sum(-1)
    np.testing.assert_allclose(m, want, atol=1e-6, rtol=0)


@pytest.mark.parametrize("gamma,done", [(0.99, 1.0), (0.0, 0.0), (0.0, 1.0)])
def test_zero_discount_puts_all_mass_at_clipped_reward(gamma, done):
    """discount_t = gamma (1 - done) = 0: Tz_j = clip(r) for every j, whatever p is."""
    rng = np.random.default_rng(3)
    r = np.array([2.0, -5.0, 5.0, 7.0, -9.0, 0.25, -3.75, 4.5], np.float32)
    p = random_probs(rng, len(r), 11)
    disc = np.full(len(r), gamma * (1.0 - done), np.float32)
    m = project(Z11, p, r, disc)
    want = np.zeros((len(r), 11))
    for k, rk in enumerate(r):
        t = min(max(float(rk), -5.0), 5.0) + 5.0          # position on the grid
        lo = int(np.floor(t))
        want[k, lo] = 1.0 - (t - lo)
        if t != lo:
            want[k, lo + 1] = t - lo
    want *= p.astype(np.float64).sum(-1, keepdims=True)
    np.testing.assert_allclose(m, want, atol=1e-6, rtol=0)


def test_projected_mass_sums_to_one_and_is_nonnegative():
    rng = np.random.default_rng(4)
    B = 4096
    p = random_probs(rng, B, 51)
    r = rng.uniform(-25, 25, B).astype(np.float32)
    r[:256] = np.round(r[:256] / 0.4) * 0.4                   # some rewards on multiples of dz
    disc = rng.uniform(0, 1, B).astype(np.float32)
    disc[:512] = 1.0
    disc[512:768] = 0.0
    m = project(Z51, p, r, disc)
    assert m.dtype == np.float32 and m.shape == (B, 51)
    assert (m >= 0).all()
    np.testing.assert_allclose(m.astype(np.float64).sum(-1), 1.0, atol=1e-6, rtol=0)


def test_projection_random_vs_hat_kernel_everywhere():
    rng = np.random.default_rng(5)
    B = 64
    p = random_probs(rng, B, 51)
    r = rng.uniform(-15, 15, B).astype(np.float32)
    disc = rng.uniform(0, 1, B).astype(np.float32)
    disc[::7] = 1.0
    m = project(Z51, p, r, disc)
    want = np.stack([np_project_hat(Z51, p[k], r[k], disc[k]) for k in range(B)])
    np.testing.assert_allclose(m, want, atol=2e-6, rtol=0)


def test_projection_random_vs_floor_ceil_eq7_where_no_atom_is_integral():
    """Interior cases only: |r| + discount * 10 < 10, so nothing is clipped (clipping makes b integral)."""
    rng = np.random.default_rng(6)
    B = 64
    p = random_probs(rng, B, 51)
    r = rng.uniform(-0.9, 0.9, B).astype(np.float32)
    disc = rng.uniform(0.5, 0.9, B).astype(np.float32)
    m = project(Z51, p, r, disc)
    for k in range(B):
        want, b = np_project_floor_ceil(Z51, p[k], r[k], disc[k])
        assert np.all(b != np.round(b))                        # the construction holds: no b integral
        assert abs(want.sum() - p[k].astype(np.float64).sum()) < 1e-12
        np.testing.assert_allclose(m[k], want, atol=2e-6, rtol=0)


def test_projection_differentiable_in_probs():
    """m is linear in p: the VJP with cotangent g is W^T g, W the float64 hat matrix."""
    rng = np.random.default_rng(7)
    p = random_probs(rng, 2, 11)
    r, disc = np.array([0.3, -1.7], np.float32), np.array([0.9, 0.6], np.float32)
    g = rng.standard_normal((2, 11))
    grad = jax.grad(lambda q: jnp.sum(categorical_projection(jnp.asarray(Z11), q, jnp.asarray(r),
                                                             jnp.asarray(disc)) * g))(jnp.asarray(p))
    for k in range(2):
        W = np.stack([np_project_hat(Z11, np.eye(11)[j], r[k], disc[k]) for j in range(11)], axis=1)  # [i, j]
        np.testing.assert_allclose(np.asarray(grad[k]), W.T @ g[k], atol=1e-5, rtol=0)


# ----------------------------------------------------------------------------------------------
# The loss.
def loss_of(inp):
    return categorical_double_q_loss(**{k: jnp.asarray(v) for k, v in inp.items()})


@pytest.mark.parametrize("B,D,A,N,seed", [(8, 3, 5, 51, 0), (5, 1, 2, 51, 1), (3, 4, 7, 11, 2), (1, 2, 1, 21, 3)])
def test_loss_matches_float64_oracle(B, D, A, N, seed):
    inp = make_inputs(B, D, A, N, seed=seed)
    if A > 1:
        assert min_argmax_gap(inp["logits_t_online"], inp["support"]) > 1e-4
    got = loss_of(inp)
    assert got.dtype == jnp.float32 and got.shape == (B,)
    want, _ = np_loss(inp["logits_tm1"], inp["a_tm1"], inp["r_t"], inp["discount_t"],
                      inp["logits_t_target"], inp["logits_t_online"], inp["support"])
    np.testing.assert_allclose(np.asarray(got), want, rtol=1e-5, atol=1e-6)


def test_each_branch_is_an_independent_single_branch_loss():
    """Branch d of a D-branch batch equals the single-branch oracle run on branch d alone."""
    inp = make_inputs(6, 4, 5, 51, seed=10)
    assert min_argmax_gap(inp["logits_t_online"], inp["support"]) > 1e-4
    got = np.asarray(loss_of(inp), np.float64)
    per_branch = np.zeros((6, 4))
    for b in range(6):
        for d in range(4):
            per_branch[b, d] = np_branch_loss(
                inp["logits_tm1"][b, d].astype(np.float64), inp["a_tm1"][b, d], inp["r_t"][b],
                inp["discount_t"][b], inp["logits_t_target"][b, d].astype(np.float64),
                inp["logits_t_online"][b, d].astype(np.float64), inp["support"])[0]
    np.testing.assert_allclose(got, per_branch.mean(-1), rtol=1e-5, atol=1e-6)
    # Branches are not interchangeable (the check above could fail if targets were mixed across branches).
    assert np.ptp(per_branch, axis=1).min() > 1e-3


def rlax_loss(rlax, inp, d):
    """rlax.categorical_double_q_learning on branch d, vmapped over the batch -> [B]."""
    z = jnp.asarray(inp["support"])
    onl = jnp.asarray(inp["logits_t_online"][:, d])
    selector = jnp.sum(jax.nn.softmax(onl, axis=-1) * z, axis=-1)             # [B, A] expected values
    fn = jax.vmap(rlax.categorical_double_q_learning, in_axes=(None, 0, 0, 0, 0, None, 0, 0))
    return fn(z, jnp.asarray(inp["logits_tm1"][:, d]), jnp.asarray(inp["a_tm1"][:, d]),
              jnp.asarray(inp["r_t"]), jnp.asarray(inp["discount_t"]), z,
              jnp.asarray(inp["logits_t_target"][:, d]), selector)


@pytest.mark.filterwarnings("ignore:Rlax categorical_cross_entropy will be deprecated")
@pytest.mark.parametrize("D", [1, 3])
def test_matches_rlax_categorical_double_q_learning(D):
    rlax = pytest.importorskip("rlax")
    inp = make_inputs(16, D, 5, 51, seed=20 + D)
    inp["r_t"][:4] = np.array([15.0, -15.0, 0.4, 0.0], np.float32)      # beyond the support, on a point
    assert min_argmax_gap(inp["logits_t_online"], inp["support"]) > 1e-4
    got = np.asarray(loss_of(inp))
    want = np.mean([np.asarray(rlax_loss(rlax, inp, d)) for d in range(D)], axis=0)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


def test_argmax_ties_take_the_first_index():
    B, D, A, N = 4, 2, 5, 11
    inp = make_inputs(B, D, A, N, seed=30, support=Z11)
    rng = np.random.default_rng(31)
    onl = inp["logits_t_online"]
    # Branch 0: all actions identical (tie over all A) -> a* = 0.
    onl[:, 0] = onl[:, 0, :1]
    # Branch 1: actions 2 and 4 tie for the maximum; the others have mass moved to the lowest atoms.
    base = rng.standard_normal((B, N)).astype(np.float32)
    lower = base.copy()
    lower[:, :3] += 5.0
    onl[:, 1] = lower[:, None, :]
    onl[:, 1, 2] = base
    onl[:, 1, 4] = base
    inp["logits_t_target"] = (3.0 * rng.standard_normal((B, D, A, N))).astype(np.float32)
    got = np.asarray(loss_of(inp), np.float64)

    def expected(astar):
        out = np.zeros(B)
        for b in range(B):
            for d in range(D):
                out[b] += np_branch_loss(inp["logits_tm1"][b, d], inp["a_tm1"][b, d], inp["r_t"][b],
                                         inp["discount_t"][b], inp["logits_t_target"][b, d], onl[b, d],
                                         inp["support"], a_star=astar[d])[0] / D
        return out

    first, other = expected((0, 2)), expected((A - 1, 4))
    assert np.min(np.abs(first - other)) > 1e-3               # the tie rule is observable here
    np.testing.assert_allclose(got, first, rtol=1e-5, atol=1e-6)


# ----------------------------------------------------------------------------------------------
# Gradients.
def test_gradient_is_softmax_minus_target_at_the_chosen_action_only():
    B, D, A, N = 6, 3, 4, 51
    inp = make_inputs(B, D, A, N, seed=40)
    args = {k: jnp.asarray(v) for k, v in inp.items()}

    def mean_loss(lt, r, disc, tgt, onl):
        return jnp.mean(categorical_double_q_loss(lt, args["a_tm1"], r, disc, tgt, onl, args["support"]))

    grads = jax.grad(mean_loss, argnums=(0, 1, 2, 3, 4))(
        args["logits_tm1"], args["r_t"], args["discount_t"], args["logits_t_target"], args["logits_t_online"])
    g_lt = np.asarray(grads[0], np.float64)
    _, m = np_loss(inp["logits_tm1"], inp["a_tm1"], inp["r_t"], inp["discount_t"],
                   inp["logits_t_target"], inp["logits_t_online"], inp["support"])
    want = np.zeros((B, D, A, N))
    for b in range(B):
        for d in range(D):
            a = inp["a_tm1"][b, d]
            want[b, d, a] = (np_softmax(inp["logits_tm1"][b, d, a]) - m[b, d]) / (D * B)
    assert rel_err(g_lt, want) < 1e-5
    np.testing.assert_array_equal(g_lt[want == 0], 0.0)       # exactly zero at actions not taken
    for g in grads[1:]:                                        # r_t, discount_t, target, online
        np.testing.assert_array_equal(np.asarray(g), 0.0)


def test_gradient_flows_to_bf16_logits_and_the_loss_is_float32():
    inp = make_inputs(4, 2, 3, 51, seed=41)
    bf = {k: (jnp.asarray(v, jnp.bfloat16) if k.startswith("logits") else jnp.asarray(v)) for k, v in inp.items()}
    got = categorical_double_q_loss(**bf)
    assert got.dtype == jnp.float32
    up = {k: (v.astype(jnp.float32) if k.startswith("logits") else v) for k, v in bf.items()}
    np.testing.assert_array_equal(np.asarray(got), np.asarray(categorical_double_q_loss(**up)))
    want, _ = np_loss(*(np.asarray(up[k]) for k in
                        ("logits_tm1", "a_tm1", "r_t", "discount_t", "logits_t_target", "logits_t_online")),
                      inp["support"])
    np.testing.assert_allclose(np.asarray(got), want, rtol=1e-5, atol=1e-6)
    g = jax.grad(lambda lt: categorical_double_q_loss(lt, *(bf[k] for k in (
        "a_tm1", "r_t", "discount_t", "logits_t_target", "logits_t_online", "support"))).sum())(bf["logits_tm1"])
    assert g.dtype == jnp.bfloat16
    # (softmax - m) / D at the taken action (float64, from the bf16-rounded logits), zero elsewhere; bf16 rounding.
    keys = ("logits_tm1", "a_tm1", "r_t", "discount_t", "logits_t_target", "logits_t_online")
    _, m = np_loss(*(np.asarray(up[k]) for k in keys), inp["support"])
    lt64 = np.asarray(up["logits_tm1"], np.float64)
    want_g = np.zeros(lt64.shape)
    for b in range(4):
        for d in range(2):
            a = inp["a_tm1"][b, d]
            want_g[b, d, a] = (np_softmax(lt64[b, d, a]) - m[b, d]) / 2
    np.testing.assert_allclose(np.asarray(g, np.float64), want_g, rtol=2.0 ** -7, atol=1e-6)


# ----------------------------------------------------------------------------------------------
# Dueling aggregation.
def test_dueling_logits_vs_numpy_and_gradients():
    rng = np.random.default_rng(50)
    B, D, A, N = 3, 4, 5, 51
    v = rng.standard_normal((B, N)).astype(np.float32)
    adv = rng.standard_normal((B, D, A, N)).astype(np.float32)
    got = branching_dueling_logits(jnp.asarray(v), jnp.asarray(adv))
    assert got.dtype == jnp.float32 and got.shape == (B, D, A, N)
    v64, a64 = v.astype(np.float64), adv.astype(np.float64)
    want = np.empty((B, D, A, N))
    for b in range(B):
        for d in range(D):
            mean = a64[b, d].sum(axis=0) / A
            for a in range(A):
                want[b, d, a] = v64[b] + a64[b, d, a] - mean
    np.testing.assert_allclose(np.asarray(got), want, atol=2e-6, rtol=0)
    # VJP: d/dV = sum_{d,a} g;  d/dA = g - mean_a g.
    g = rng.standard_normal((B, D, A, N))
    gv, ga = jax.grad(lambda x, y: jnp.sum(branching_dueling_logits(x, y) * g), argnums=(0, 1))(
        jnp.asarray(v), jnp.asarray(adv))
    np.testing.assert_allclose(np.asarray(gv), g.sum(axis=(1, 2)), atol=1e-5, rtol=0)
    np.testing.assert_allclose(np.asarray(ga), g - g.mean(axis=2, keepdims=True), atol=1e-5, rtol=0)


def test_dueling_bf16_inputs_give_float32():
    rng = np.random.default_rng(51)
    v = jnp.asarray(rng.standard_normal((2, 7)), jnp.bfloat16)
    adv = jnp.asarray(rng.standard_normal((2, 3, 4, 7)), jnp.bfloat16)
    got = branching_dueling_logits(v, adv)
    assert got.dtype == jnp.float32
    v64, a64 = np.asarray(v, np.float64), np.asarray(adv, np.float64)
    want = v64[:, None, None] + a64 - a64.mean(axis=2, keepdims=True)
    np.testing.assert_allclose(np.asarray(got), want, atol=2e-6, rtol=0)


# ----------------------------------------------------------------------------------------------
# Errors name the argument (and give expected and actual shapes).
B0, D0, A0, N0 = 4, 2, 3, 11


def base_inputs():
    return make_inputs(B0, D0, A0, N0, seed=60, support=Z11)


def _set(key, value):
    def f(inp):
        inp[key] = value(inp) if callable(value) else value
        return inp
    return f


ERROR_CASES = [
    ("logits_tm1-rank", _set("logits_tm1", np.zeros((B0, D0, A0), np.float32)), ValueError,
     r"logits_tm1 must have shape \[B, D, A, N\], got \(4, 2, 3\)"),
    ("logits_tm1-dtype", _set("logits_tm1", lambda i: i["logits_tm1"].astype(np.float16)), TypeError, "logits_tm1"),
    ("logits_tm1-list", _set("logits_tm1", [[1.0]]), TypeError, "logits_tm1 must be an array"),
    ("target-N", _set("logits_t_target", np.zeros((B0, D0, A0, N0 - 1), np.float32)), ValueError,
     r"logits_t_target must have shape \[B, D, A, N\] = \[4, 2, 3, 11\] \(from logits_tm1\), got \(4, 2, 3, 10\)"),
    ("online-B", _set("logits_t_online", np.zeros((B0 + 1, D0, A0, N0), np.float32)), ValueError,
     r"logits_t_online must have shape .*got \(5, 2, 3, 11\)"),
    ("online-dtype", _set("logits_t_online", lambda i: i["logits_t_online"].astype(np.float64)), TypeError,
     "logits_t_online"),
    ("a_tm1-float", _set("a_tm1", lambda i: i["a_tm1"].astype(np.float32)), TypeError, "a_tm1 must have an integer"),
    ("a_tm1-shape", _set("a_tm1", np.zeros((B0,), np.int32)), ValueError,
     r"a_tm1 must have shape \[B, D\] = \[4, 2\].*got \(4,\)"),
    ("a_tm1-too-big", _set("a_tm1", np.full((B0, D0), A0, np.int32)), ValueError,
     r"a_tm1 must be in \[0, A\) = \[0, 3\)"),
    ("a_tm1-negative", _set("a_tm1", lambda i: np.where(np.arange(D0) == 1, -1, i["a_tm1"]).astype(np.int32)),
     ValueError, r"a_tm1\[0, 1\] = -1"),
    ("r_t-shape", _set("r_t", np.zeros((B0, 1), np.float32)), ValueError, r"r_t must have shape \[B\] = \[4\]"),
    ("r_t-int", _set("r_t", np.zeros((B0,), np.int32)), TypeError, "r_t"),
    ("discount_t-shape", _set("discount_t", np.zeros((B0 + 1,), np.float32)), ValueError,
     r"discount_t must have shape \[B\] = \[4\].*got \(5,\)"),
    ("support-N", _set("support", Z11[:-1]), ValueError, r"support must have shape \[N\] = \[11\].*got \(10,\)"),
    ("support-2d", _set("support", Z11[None]), ValueError, r"support must have shape \[N\]"),
    ("support-int", _set("support", np.arange(11, dtype=np.int32)), TypeError, "support"),
    ("support-decreasing", _set("support", Z11[::-1].copy()), ValueError, "support must be strictly increasing"),
    ("support-repeated", _set("support", np.concatenate([Z11[:5], Z11[4:10]])), ValueError,
     "support must be strictly increasing"),
    ("support-nonuniform", _set("support", np.geomspace(1, 100, 11).astype(np.float32)), ValueError,
     "support must be uniformly spaced"),
    ("support-slightly-nonuniform", _set("support", (Z11 + np.where(np.arange(11) == 3, 1e-3, 0)).astype(np.float32)),
     ValueError, "support must be uniformly spaced"),
    ("support-nan", _set("support", np.where(np.arange(11) == 2, np.nan, Z11).astype(np.float32)), ValueError,
     "support must be finite"),
]


@pytest.mark.parametrize("case", ERROR_CASES, ids=[c[0] for c in ERROR_CASES])
def test_loss_errors_name_the_argument(case):
    _, modify, exc, match = case
    inp = modify(base_inputs())
    with pytest.raises(exc, match=match):
        categorical_double_q_loss(**inp)


def test_base_inputs_of_the_error_cases_are_valid():
    assert loss_of(base_inputs()).shape == (B0,)


@pytest.mark.parametrize("N,lo,hi", [(51, -10, 10), (201, -10, 10), (401, -100, 100), (101, 0, 1), (2, -1, 1)])
def test_float32_linspace_supports_are_accepted(N, lo, hi):
    z = jnp.linspace(lo, hi, N, dtype=jnp.float32)
    p = jnp.full((1, N), 1.0 / N, jnp.float32)
    m = categorical_projection(z, p, jnp.zeros(1), jnp.ones(1))
    np.testing.assert_allclose(np.asarray(m), np.asarray(p), atol=1e-6, rtol=0)


def test_support_beyond_float32_range_is_rejected():
    """The ops compute in float32: a span support[-1] - support[0] that overflows float32 gave NaN masses; it is
    an error now, while a support of half float32's range still projects without loss."""
    p = jax.nn.softmax(jnp.arange(4 * 51, dtype=jnp.float32).reshape(4, 51) / 50)
    with pytest.raises(ValueError, match="support must lie within float32's range"):
        categorical_projection(jnp.linspace(-3e38, 3e38, 51, dtype=jnp.float32), p, jnp.zeros(4), jnp.ones(4))
    m = categorical_projection(jnp.linspace(-1.5e38, 1.5e38, 51, dtype=jnp.float32), p, jnp.zeros(4), jnp.ones(4))
    np.testing.assert_allclose(np.asarray(m), np.asarray(p), atol=1e-6, rtol=0)  # r = 0, discount 1: identity


def test_projection_and_dueling_errors_name_the_argument():
    p = np.full((3, 11), 1 / 11, np.float32)
    one = np.ones(3, np.float32)
    with pytest.raises(ValueError, match=r"probs must have shape \[B, N\], got \(11,\)"):
        categorical_projection(Z11, p[0], one, one)
    with pytest.raises(ValueError, match=r"support must have shape \[N\] = \[11\] \(N from probs\), got \(10,\)"):
        categorical_projection(Z11[:10], p, one, one)
    with pytest.raises(ValueError, match=r"r must have shape \[B\] = \[3\] \(B from probs\), got \(2,\)"):
        categorical_projection(Z11, p, one[:2], one)
    with pytest.raises(ValueError, match=r"discount must have shape \[B\] = \[3\]"):
        categorical_projection(Z11, p, one, one[:, None])
    with pytest.raises(ValueError, match="support must have at least 2 atoms"):
        categorical_projection(Z11[:1], p[:, :1], one, one)
    adv = np.zeros((3, 2, 4, 11), np.float32)
    with pytest.raises(ValueError,
                       match=r"value must have shape \[B, N\] = \[3, 11\] \(B, N from advantages\), got \(3, 10\)"):
        branching_dueling_logits(np.zeros((3, 10), np.float32), adv)
    with pytest.raises(ValueError, match=r"advantages must have shape \[B, D, A, N\], got \(3, 4, 11\)"):
        branching_dueling_logits(np.zeros((3, 11), np.float32), adv[:, 0])
    with pytest.raises(TypeError, match="value must be float32 or bfloat16"):
        branching_dueling_logits(np.zeros((3, 11), np.int32), adv)


# ----------------------------------------------------------------------------------------------
# jit / vmap composition.
def test_jit_matches_eager_and_clips_traced_out_of_range_actions():
    inp = make_inputs(8, 3, 5, 51, seed=70)
    assert min_argmax_gap(inp["logits_t_online"], inp["support"]) > 1e-4
    args = {k: jnp.asarray(v) for k, v in inp.items()}
    eager = categorical_double_q_loss(**args)
    jitted = jax.jit(categorical_double_q_loss)(**args)                # support traced: value checks skipped
    np.testing.assert_allclose(np.asarray(jitted), np.asarray(eager), rtol=1e-6, atol=1e-6)

    bad = inp["a_tm1"].copy()
    bad[0, 0], bad[1, 2], bad[2, 1] = 5, -3, 1000
    with pytest.raises(ValueError, match="a_tm1"):
        categorical_double_q_loss(**{**args, "a_tm1": jnp.asarray(bad)})
    f = jax.jit(functools.partial(categorical_double_q_loss, support=args["support"]))
    got = f(**{k: v for k, v in args.items() if k != "support"} | {"a_tm1": jnp.asarray(bad)})
    clipped = np.clip(bad, 0, 4).astype(np.int32)
    want, _ = np_loss(inp["logits_tm1"], clipped, inp["r_t"], inp["discount_t"], inp["logits_t_target"],
                      inp["logits_t_online"], inp["support"])
    np.testing.assert_allclose(np.asarray(got), want, rtol=1e-5, atol=1e-6)
    assert not np.allclose(np.asarray(got)[:3], np.asarray(eager)[:3])   # the clipping changed something


def test_vmap_over_a_leading_axis_matches_slices():
    V = 3
    ins = [make_inputs(4, 2, 3, 51, seed=80 + v) for v in range(V)]
    stacked = {k: jnp.stack([jnp.asarray(i[k]) for i in ins]) for k in ins[0] if k != "support"}
    z = jnp.asarray(Z51)
    fn = jax.vmap(lambda lt, a, r, d, tg, on: categorical_double_q_loss(lt, a, r, d, tg, on, z))
    got = fn(*(stacked[k] for k in ("logits_tm1", "a_tm1", "r_t", "discount_t", "logits_t_target",
                                    "logits_t_online")))
    assert got.shape == (V, 4)
    for v in range(V):
        want, _ = np_loss(*(ins[v][k] for k in ("logits_tm1", "a_tm1", "r_t", "discount_t",
                                                "logits_t_target", "logits_t_online")), Z51)
        np.testing.assert_allclose(np.asarray(got[v]), want, rtol=1e-5, atol=1e-6)
    # vmap + jit + grad compose.
    g = jax.jit(jax.grad(lambda lt: fn(lt, *(stacked[k] for k in (
        "a_tm1", "r_t", "discount_t", "logits_t_target", "logits_t_online"))).sum()))(stacked["logits_tm1"])
    assert g.shape == stacked["logits_tm1"].shape
    for v in range(V):                  # d sum / d logits_tm1 = (softmax - m) / D at the taken action, else 0
        _, m = np_loss(*(ins[v][k] for k in ("logits_tm1", "a_tm1", "r_t", "discount_t", "logits_t_target",
                                             "logits_t_online")), Z51)
        want = np.zeros((4, 2, 3, 51))
        for b in range(4):
            for d in range(2):
                a = ins[v]["a_tm1"][b, d]
                want[b, d, a] = (np_softmax(ins[v]["logits_tm1"][b, d, a]) - m[b, d]) / 2
        np.testing.assert_allclose(np.asarray(g[v]), want, rtol=1e-5, atol=1e-6)


def test_empty_batch():
    inp = make_inputs(0, 2, 3, 11, support=Z11)
    assert loss_of(inp).shape == (0,)


def test_kernel_path_nan_reward_or_discount_gives_nan_like_the_reference(monkeypatch):
    """ffi/c51.cu clamps r + discount z with fmaxf/fminf, which turn NaN into v_min: its loss for a sample with a
    NaN reward or discount is finite. The kernel path must give NaN there (loss and gradient), as the reference
    does; the other samples keep the kernel's values. The FFI call is replaced by a stand-in with the kernel's
    clamp (NaN rewards and discounts read as finite), run through the kernel path's custom_vjp on this CPU."""
    import jaxfox.c51 as c51_mod

    def fake_call(with_grad, logits_tm1, a_tm1, r_t, discount_t, target, online, support):
        clean = (jnp.nan_to_num(r_t), jnp.nan_to_num(discount_t))  # any finite stand-in: the clamp hides NaN
        loss, vjp = jax.vjp(lambda l: c51_mod._loss_reference(l, a_tm1, *clean, target, online, support), logits_tm1)
        delta = vjp(jnp.ones_like(loss))[0] * logits_tm1.shape[1] if with_grad else jnp.zeros((0,), jnp.float32)
        return loss, delta

    monkeypatch.setattr(c51_mod, "_c51_call", fake_call)
    monkeypatch.setattr(c51_mod, "dispatch", lambda kernel, reference, *args, **_: kernel(*args))
    rng = np.random.default_rng(3)
    B, D, A, N = 5, 2, 3, 11
    logits = [jnp.asarray(rng.normal(size=(B, D, A, N)), jnp.float32) for _ in range(3)]
    a = jnp.asarray(rng.integers(0, A, size=(B, D)), jnp.int32)
    r = rng.normal(size=B).astype(np.float32)
    disc = np.full(B, 0.9, np.float32)
    r[1], disc[3] = np.nan, np.nan
    f = lambda l0: categorical_double_q_loss(l0, a, r, disc, logits[1], logits[2], Z11)  # noqa: E731
    loss, vjp = jax.vjp(f, logits[0])
    (g,) = vjp(jnp.ones(B, jnp.float32))
    monkeypatch.undo()
    want_loss, want_vjp = jax.vjp(f, logits[0])                    # the reference: NaN rows 1 and 3
    (want_g,) = want_vjp(jnp.ones(B, jnp.float32))
    bad = np.array([False, True, False, True, False])
    assert np.isnan(np.asarray(want_loss)[bad]).all() and np.isnan(np.asarray(loss)[bad]).all()
    assert np.isnan(np.asarray(g)[bad]).all()
    np.testing.assert_allclose(np.asarray(loss)[~bad], np.asarray(want_loss)[~bad], rtol=1e-6)
    np.testing.assert_allclose(np.asarray(g)[~bad], np.asarray(want_g)[~bad], rtol=1e-5, atol=1e-7)


def _fake_kernel_call():
    """A stand-in for the FFI call with ffi/c51.cu's clamp: fminf/fmaxf read a NaN r + discount z_j as v_min, so its
    loss is finite where the reference's is NaN (modelled by nan_to_num before the clip)."""
    def fake_call(with_grad, logits_tm1, a_tm1, r_t, discount_t, target, online, support):
        def ref(lt):
            z, N = support, support.shape[0]
            tz = jnp.clip(jnp.nan_to_num(r_t[:, None] + discount_t[:, None] * z, nan=z[0]), z[0], z[-1])
            bpos = (tz - z[0]) / ((z[-1] - z[0]) / (N - 1))
            w = jnp.clip(1.0 - jnp.abs(bpos[:, None, :] - jnp.arange(N, dtype=jnp.float32)[:, None]), 0.0, 1.0)
            q = jnp.sum(jax.nn.softmax(online, -1) * z, -1)
            p = jax.nn.softmax(jnp.take_along_axis(target, jnp.argmax(q, -1)[..., None, None], 2)[:, :, 0], -1)
            m = jnp.einsum("bij,bdj->bdi", w, p)
            chosen = jnp.take_along_axis(lt, a_tm1[..., None, None], 2)[:, :, 0]
            return jnp.mean(-jnp.sum(m * jax.nn.log_softmax(chosen, -1), -1), -1)
        loss, vjp = jax.vjp(ref, logits_tm1)
        delta = vjp(jnp.ones_like(loss))[0] * logits_tm1.shape[1] if with_grad else jnp.zeros((0,), jnp.float32)
        return loss, delta
    return fake_call


def test_kernel_path_nan_target_atoms_from_an_infinite_discount_give_nan_like_the_reference(monkeypatch):
    """discount_t = inf (inf * z_j = NaN at the atom z_j = 0), or r_t = +inf with discount_t = +inf (inf - inf at
    the negative atoms): the reference's Tz has a NaN, so its loss and gradient for that sample are NaN; the kernel's
    clamp read it as v_min (a finite loss). The kernel path must give NaN there too; r_t = +inf with a finite
    discount is finite on both (all target mass on the last atom), and the other samples keep their values."""
    import jaxfox.c51 as c51_mod

    rng = np.random.default_rng(4)
    B, D, A, N = 5, 2, 3, 11
    logits = [jnp.asarray(rng.normal(size=(B, D, A, N)), jnp.float32) for _ in range(3)]
    a = jnp.asarray(rng.integers(0, A, size=(B, D)), jnp.int32)
    r = jnp.asarray([0.5, 1.0, np.inf, np.inf, -2.0], jnp.float32)
    disc = jnp.asarray([0.9, np.inf, np.inf, 0.5, 0.0], jnp.float32)
    bad = np.array([False, True, True, False, False])
    f = lambda l0: categorical_double_q_loss(l0, a, r, disc, logits[1], logits[2], Z11)  # noqa: E731
    monkeypatch.setattr(c51_mod, "_c51_call", _fake_kernel_call())
    monkeypatch.setattr(c51_mod, "dispatch", lambda kernel, reference, *args, **_: kernel(*args))
    loss, vjp = jax.vjp(f, logits[0])
    (g,) = vjp(jnp.ones(B, jnp.float32))
    monkeypatch.undo()
    want_loss, want_vjp = jax.vjp(f, logits[0])                    # the reference
    (want_g,) = want_vjp(jnp.ones(B, jnp.float32))
    assert np.isnan(np.asarray(want_loss)[bad]).all() and np.isfinite(np.asarray(want_loss)[~bad]).all()
    assert np.isnan(np.asarray(loss)[bad]).all() and np.isnan(np.asarray(g)[bad]).all()
    np.testing.assert_allclose(np.asarray(loss)[~bad], np.asarray(want_loss)[~bad], rtol=1e-6)
    np.testing.assert_allclose(np.asarray(g)[~bad], np.asarray(want_g)[~bad], rtol=1e-5, atol=1e-7)
    # r = +inf, discount 0.5: the float64 oracle with all target mass on z_{N-1}.
    lt = np.asarray(logits[0], np.float64)
    want3 = np.mean([-np_log_softmax(lt[3, d, int(a[3, d])])[-1] for d in range(D)])
    np.testing.assert_allclose(np.asarray(loss)[3], want3, rtol=1e-5)


@pytest.mark.parametrize("D,N,fits", [(2, 51, True), (40000, 51, True), (50000, 1024, False), (65537, 2, False)])
def test_kernel_path_only_for_sizes_the_kernel_takes(D, N, fits, monkeypatch):
    """ffi/c51.cu needs min(D, 4) * 2N + D floats of shared memory per block (at most 227 KiB on sm_90) and D <= 65536;
    beyond that it returns InvalidArgument when the program runs. Such shapes must lower to the reference instead.
    Traced from shapes only (nothing is allocated) and lowered for CUDA on this CPU."""
    import jaxfox._ffi

    monkeypatch.setattr(jaxfox._ffi, "kernels_available", lambda: True)
    B, A = 2, 1
    f32 = jnp.float32
    specs = [jax.ShapeDtypeStruct((B, D, A, N), f32), jax.ShapeDtypeStruct((B, D), jnp.int32),
             jax.ShapeDtypeStruct((B,), f32), jax.ShapeDtypeStruct((B,), f32), jax.ShapeDtypeStruct((B, D, A, N), f32),
             jax.ShapeDtypeStruct((B, D, A, N), f32), jax.ShapeDtypeStruct((N,), f32)]
    text = jax.jit(categorical_double_q_loss).trace(*specs).lower(lowering_platforms=("cuda",)).as_text()
    assert ("jaxfox_c51_loss" in text) == fits


def test_projection_of_non_finite_rewards_and_discounts_as_documented():
    """r = +-inf: all mass on the end atom; a NaN r or discount, or inf * 0 (discount inf, z_5 = 0): a NaN row."""
    p = random_probs(np.random.default_rng(9), 5, 11)
    r = np.array([np.inf, -np.inf, np.nan, 0.0, 1.0], np.float32)
    disc = np.array([0.9, 0.0, 0.9, np.inf, np.nan], np.float32)
    m = project(Z11, p, r, disc)
    mass = p.astype(np.float64).sum(-1)
    np.testing.assert_allclose(m[0], np.eye(11)[10] * mass[0], atol=1e-6, rtol=0)
    np.testing.assert_allclose(m[1], np.eye(11)[0] * mass[1], atol=1e-6, rtol=0)
    assert np.isnan(m[2:]).all()
