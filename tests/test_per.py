"""CPU tests of jaxfox.per (prioritized replay, proportional variant, prefix-sum sampler).

Oracles are float64 NumPy written from OPS.md "Prioritized replay" (Schaul et al. 2015): P(i) =
p_i^alpha / sum p^alpha over the filled slots, IS weights (n P(i))^(-beta) / max, a Python ring
buffer, and a sequential loop for duplicate updates. None of them calls jaxfox.per.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from scipy import stats

import jaxfox
from jaxfox import per

P_THRESHOLD = 1e-3


# ----------------------------------------------------------------------------------------------
# Oracles.
def np_probs(p, size, alpha):
    """float64 P(i) over the filled slots; zero priorities get 0 (also for alpha = 0)."""
    p = np.asarray(p, np.float64)
    q = np.zeros_like(p)
    filled = np.arange(p.size) < size
    pos = filled & (p > 0)
    q[pos] = p[pos] ** alpha
    if q.sum() == 0:
        return np.where(filled, 1.0 / size, 0.0)
    return q / q.sum()


def np_weights(P, idx, n, beta):
    w = (n * P[idx]) ** (-beta)
    return w / w.max()


def filled_state(priorities, capacity=None, size=None):
    """A buffer with `size` filled slots holding `priorities` (the first `size` entries)."""
    priorities = np.asarray(priorities, np.float32)
    capacity = capacity or priorities.size
    size = priorities.size if size is None else size
    s = per.add(per.init(capacity), size)
    return per.update(s, jnp.arange(size, dtype=jnp.int32), jnp.asarray(priorities[:size]))


@functools.partial(jax.jit, static_argnames=("batch_size", "draws"))
def many_samples(state, key, batch_size, draws, alpha, beta):
    keys = jax.random.split(key, draws)
    return jax.vmap(lambda k: per.sample(state, k, batch_size, alpha=alpha, beta=beta))(keys)


def counts_of(idx, C):
    return np.bincount(np.asarray(idx).ravel(), minlength=C)


# ----------------------------------------------------------------------------------------------
def test_init():
    s = per.init(7, {"obs": jax.ShapeDtypeStruct((3,), jnp.float32), "a": jax.ShapeDtypeStruct((), jnp.int32)})
    assert s.priorities.shape == (7,) and s.priorities.dtype == jnp.float32
    assert float(s.max_priority) == 1.0 and int(s.size) == 0 and int(s.pos) == 0
    assert s.items["obs"].shape == (7, 3) and s.items["a"].shape == (7,) and s.items["a"].dtype == jnp.int32
    assert per.init(5).items is None
    for bad in (0, -1, 2.0, True):
        with pytest.raises(ValueError, match="capacity"):
            per.init(bad)
    with pytest.raises(TypeError, match="item_spec"):
        per.init(4, {"x": 3})


def _ring_oracle(C, batches):
    store, prio = [None] * C, np.zeros(C)
    pos = size = 0
    for batch in batches:
        for x in batch:
            store[pos] = x
            prio[pos] = 1.0
            pos = (pos + 1) % C
            size = min(size + 1, C)
    return store, prio, pos, size


@pytest.mark.parametrize("C,ns", [(5, (3, 4)), (5, (12,)), (7, (7, 1, 9, 0, 2)), (1, (1, 3))])
def test_add_ring_wraparound(C, ns):
    s = per.init(C, {"x": jax.ShapeDtypeStruct((2,), jnp.float32), "i": jax.ShapeDtypeStruct((), jnp.int32)})
    counter, batches = 0, []
    for n in ns:
        ids = np.arange(counter, counter + n)
        counter += n
        batches.append(list(ids))
        s = per.add(s, {"x": jnp.asarray(np.stack([ids, -ids], 1).astype(np.float32).reshape(n, 2)),
                        "i": jnp.asarray(ids, jnp.int32)})
    store, prio, pos, size = _ring_oracle(C, batches)
    assert int(s.pos) == pos and int(s.size) == size
    np.testing.assert_array_equal(np.asarray(s.priorities), prio.astype(np.float32))
    got = np.asarray(s.items["i"])
    for j in range(C):
        if store[j] is not None:
            assert got[j] == store[j]
            np.testing.assert_array_equal(np.asarray(s.items["x"][j]), [store[j], -store[j]])


def test_add_uses_running_max_priority():
    s = filled_state([1.0, 2.0, 3.0], capacity=6)
    s = per.update(s, jnp.array([1], jnp.int32), jnp.array([7.5], jnp.float32))
    s = per.add(s, 2)
    np.testing.assert_array_equal(np.asarray(s.priorities), [1.0, 7.5, 3.0, 7.5, 7.5, 0.0])
    assert float(s.max_priority) == 7.5


def test_add_jit_matches_eager():
    spec = {"x": jax.ShapeDtypeStruct((3,), jnp.float32)}
    items = {"x": jnp.arange(12.0).reshape(4, 3)}
    s0 = per.add(per.init(6, spec), {"x": jnp.ones((4, 3))})
    a = per.add(s0, items)
    b = jax.jit(per.add)(s0, items)
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def test_add_to_a_state_of_numpy_arrays():
    # A state restored from a checkpoint (flax.serialization.from_bytes) holds NumPy arrays; add raised
    # AttributeError ('numpy.ndarray' object has no attribute 'at'). Expected values: a Python ring buffer.
    flax_ser = pytest.importorskip("flax.serialization")
    spec = {"x": jax.ShapeDtypeStruct((2,), jnp.float32)}
    s = per.update(per.add(per.init(3, spec), {"x": jnp.ones((2, 2))}), jnp.array([1]), jnp.array([4.0]))
    s_np = flax_ser.from_bytes(per.init(3, spec), flax_ser.to_bytes(s))
    assert isinstance(s_np.priorities, np.ndarray) and isinstance(s_np.items["x"], np.ndarray)
    out = per.add(s_np, {"x": jnp.array([[5.0, 6.0], [7.0, 8.0]])})  # slots 2, then 0 (ring wraps)
    np.testing.assert_array_equal(np.asarray(out.priorities), [4.0, 4.0, 4.0])
    np.testing.assert_array_equal(np.asarray(out.items["x"]), [[7, 8], [1, 1], [5, 6]])
    assert (int(out.size), int(out.pos), float(out.max_priority)) == (3, 1, 4.0)
    out2 = per.add(jax.tree.map(np.asarray, per.add(per.init(4), 1)), 2)  # no item storage
    np.testing.assert_array_equal(np.asarray(out2.priorities), [1, 1, 1, 0])
    assert (int(out2.size), int(out2.pos)) == (3, 3)


def test_add_validation():
    s = per.init(4, {"x": jax.ShapeDtypeStruct((2,), jnp.float32)})
    with pytest.raises(ValueError, match=r"items\['x'\] must have shape \[n, 2\]"):
        per.add(s, {"x": jnp.zeros((3, 5))})
    with pytest.raises(TypeError, match="float32"):
        per.add(s, {"x": jnp.zeros((3, 2), jnp.int32)})
    with pytest.raises(ValueError, match="structure"):
        per.add(s, {"y": jnp.zeros((3, 2))})
    with pytest.raises(TypeError, match="count"):
        per.add(s, 3)
    with pytest.raises(TypeError, match="no item storage"):
        per.add(per.init(4), {"x": jnp.zeros((3, 2))})
    with pytest.raises(TypeError, match="PERState"):
        per.add((1, 2), 3)


# ----------------------------------------------------------------------------------------------
# Sampling distribution.
def _chi2_p(counts, P):
    keep = P > 0
    expected = P[keep] * counts.sum()
    assert expected.min() >= 5  # chi-square approximation is valid
    return stats.chisquare(counts[keep], expected).pvalue


@pytest.mark.parametrize("x64", [False, True])
def test_sampling_frequencies_match_P(x64):
    C, size, alpha, beta = 37, 30, 0.6, 0.5  # C is not a power of two; 7 slots are never filled
    rng = np.random.default_rng(0)
    p = rng.uniform(0.2, 3.0, size).astype(np.float32)
    p[[0, 11, 12, 29]] = 0.0  # first, adjacent middle and last filled slot have zero priority
    with jax.enable_x64(x64):
        s = filled_state(p, capacity=C)
        idx, w = many_samples(s, jax.random.key(1), 64, 2000, alpha, beta)
    idx = np.asarray(idx)
    assert idx.dtype == np.int32 and np.asarray(w).dtype == np.float32
    counts = counts_of(idx, C)
    P = np_probs(np.concatenate([p, np.zeros(C - size)]), size, alpha)
    assert counts[P == 0].sum() == 0  # zero priorities and unfilled slots never drawn
    assert _chi2_p(counts, P) > P_THRESHOLD
    # The test has power: the same counts reject a wrong exponent.
    assert _chi2_p(counts, np_probs(np.concatenate([p, np.zeros(C - size)]), size, 1.0)) < P_THRESHOLD
    # Library probabilities agree with the oracle.
    np.testing.assert_allclose(np.asarray(per.probabilities(s, alpha=alpha)), P, rtol=2e-6, atol=1e-9)


def test_stratified_one_draw_per_stratum():
    # Two slots with equal mass and B = 2: stratum 0 covers slot 0, stratum 1 slot 1, exactly.
    s = filled_state([1.0, 1.0])
    idx, _ = many_samples(s, jax.random.key(3), 2, 500, 1.0, 0.4)
    idx = np.asarray(idx)
    assert (idx[:, 0] == 0).all() and (idx[:, 1] == 1).all()


@pytest.mark.parametrize("alpha", [0.0, 0.7, 1.0])
def test_zero_priorities_never_sampled(alpha):
    # Zeros between tiny and huge priorities, at both ends of the filled part; u_k near S.
    p = np.array([0, 1e-6, 0, 0, 5e3, 0, 1e-3, 1.0, 0, 2e4, 0], np.float32)
    s = filled_state(p, capacity=13)
    idx, w = many_samples(s, jax.random.key(7), 128, 4000, alpha, 1.0)
    counts = counts_of(idx, 13)
    assert counts[p.tolist().index(0.0)] == 0
    assert (counts[np.flatnonzero(np.concatenate([p, [0, 0]]) == 0)] == 0).all()
    assert np.isfinite(np.asarray(w)).all()
    if alpha == 0.0:  # uniform over the positive slots, never over zero ones (0^0 is not 1 here)
        P = np_probs(np.concatenate([p, [0, 0]]), 11, 0.0)
        assert np.count_nonzero(P) == 5
        assert _chi2_p(counts, P) > P_THRESHOLD


def test_all_zero_priorities_uniform_over_filled():
    C, size, B = 10, 7, 5
    s = filled_state(np.zeros(size, np.float32), capacity=C)
    idx, w = many_samples(s, jax.random.key(2), B, 3000, 0.6, 0.7)
    counts = counts_of(idx, C)
    assert counts[size:].sum() == 0
    assert _chi2_p(counts, np.where(np.arange(C) < size, 1.0 / size, 0.0)) > P_THRESHOLD
    np.testing.assert_array_equal(np.asarray(w), 1.0)
    np.testing.assert_allclose(np.asarray(per.probabilities(s, alpha=0.6)), np.where(np.arange(C) < size, 1 / 7, 0),
                               rtol=1e-6)


def test_only_filled_part_eligible():
    # Stale priorities beyond `size` (e.g. restored state) must be ignored.
    s = filled_state([1.0, 2.0, 3.0], capacity=8)
    s = s._replace(priorities=s.priorities.at[3:].set(100.0))
    idx, _ = many_samples(s, jax.random.key(4), 16, 500, 1.0, 0.4)
    assert np.asarray(idx).max() <= 2


@pytest.mark.parametrize("beta", [0.0, 0.4, 1.0])
def test_importance_weights(beta):
    C, alpha = 50, 0.6
    rng = np.random.default_rng(5)
    p = rng.lognormal(0.0, 2.0, 40).astype(np.float32)
    s = filled_state(p, capacity=C)
    idx, w = many_samples(s, jax.random.key(6), 32, 50, alpha, beta)
    idx, w = np.asarray(idx), np.asarray(w)
    P = np_probs(np.concatenate([p, np.zeros(C - 40)]), 40, alpha)
    for b in range(idx.shape[0]):
        want = np_weights(P, idx[b], 40, beta)
        np.testing.assert_allclose(w[b], want, rtol=2e-6)
        assert w[b].max() == 1.0 and (w[b] <= 1.0).all() and (w[b] > 0).all()


def test_capacity_not_power_of_two_and_tiny():
    # C = 3 full buffer: slot C-1 reachable; C = 1: always slot 0 with weight 1.
    s = filled_state([1.0, 0.0, 3.0])
    idx, w = many_samples(s, jax.random.key(8), 4, 2000, 1.0, 1.0)
    counts = counts_of(idx, 3)
    assert counts[1] == 0
    assert _chi2_p(counts, np.array([0.25, 0.0, 0.75])) > P_THRESHOLD
    np.testing.assert_allclose(np.asarray(w)[np.asarray(idx) == 2], 1.0 / 3.0, rtol=1e-6)
    s1 = filled_state([2.0])
    idx, w = per.sample(s1, jax.random.key(0), 5, alpha=0.6, beta=0.4)
    np.testing.assert_array_equal(np.asarray(idx), 0)
    np.testing.assert_array_equal(np.asarray(w), 1.0)


def test_sample_under_jit_with_traced_state_and_beta():
    s = filled_state([1.0, 2.0, 0.0, 4.0], capacity=6)
    sched = per.beta_schedule(100)
    f = jax.jit(lambda st, k, step: per.sample(st, k, 8, alpha=0.6, beta=sched(step)))
    i1, w1 = f(s, jax.random.key(9), 50)
    i2, w2 = per.sample(s, jax.random.key(9), 8, alpha=0.6, beta=float(sched(50)))
    np.testing.assert_array_equal(np.asarray(i1), np.asarray(i2))
    np.testing.assert_allclose(np.asarray(w1), np.asarray(w2), rtol=1e-6)


def test_empty_buffer_traced_gives_zero_weights():
    idx, w = jax.jit(lambda st, k: per.sample(st, k, 4, alpha=0.6, beta=0.4))(per.init(5), jax.random.key(0))
    np.testing.assert_array_equal(np.asarray(idx), 0)
    np.testing.assert_array_equal(np.asarray(w), 0.0)


def test_sample_validation():
    s = filled_state([1.0, 2.0])
    with pytest.raises(ValueError, match="empty"):
        per.sample(per.init(4), jax.random.key(0), 2, alpha=0.6, beta=0.4)
    with pytest.raises(ValueError, match="batch_size"):
        per.sample(s, jax.random.key(0), 0, alpha=0.6, beta=0.4)
    with pytest.raises(ValueError, match="alpha"):
        per.sample(s, jax.random.key(0), 2, alpha=-0.1, beta=0.4)
    with pytest.raises(ValueError, match="beta"):
        per.sample(s, jax.random.key(0), 2, alpha=0.6, beta=1.5)
    with pytest.raises(ValueError, match="beta"):
        per.sample(s, jax.random.key(0), 2, alpha=0.6, beta=float("nan"))
    with pytest.raises(ValueError, match="alpha"):
        per.sample(s, jax.random.key(0), 2, alpha=jnp.ones(2), beta=0.4)


@pytest.mark.parametrize("flag", [jnp.array(True), np.bool_(True), np.array(False)])
def test_bool_array_alpha_or_beta_is_refused_like_a_python_bool(flag):
    # A Python bool is refused; a bool array used to be taken silently as 1.0 / 0.0 (beta=True: full IS correction).
    s = filled_state([1.0, 2.0])
    for kw in (dict(alpha=flag, beta=0.4), dict(alpha=0.6, beta=flag)):
        name = next(k for k, v in kw.items() if v is flag)
        with pytest.raises(TypeError, match=f"{name} must be a real scalar"):
            per.sample(s, jax.random.key(0), 2, **kw)
    with pytest.raises(TypeError, match="alpha must be a real scalar"):
        per.probabilities(s, alpha=flag)
    with pytest.raises(TypeError, match="alpha must be a real scalar"):
        jax.jit(lambda a: per.sample(s, jax.random.key(0), 2, alpha=a, beta=0.4))(jnp.asarray(flag))


def test_sample_items():
    spec = {"obs": jax.ShapeDtypeStruct((2,), jnp.float32), "a": jax.ShapeDtypeStruct((), jnp.int32)}
    s = per.add(per.init(5, spec), {"obs": jnp.arange(8.0).reshape(4, 2), "a": jnp.arange(4, dtype=jnp.int32) * 10})
    got = per.sample_items(s, jnp.array([3, 0, 3], jnp.int32))
    np.testing.assert_array_equal(np.asarray(got["obs"]), [[6, 7], [0, 1], [6, 7]])
    np.testing.assert_array_equal(np.asarray(got["a"]), [30, 0, 30])
    with pytest.raises(TypeError, match="no item storage"):
        per.sample_items(per.init(3), jnp.array([0], jnp.int32))
    with pytest.raises(TypeError, match="integer"):
        per.sample_items(s, jnp.array([0.0]))


def test_sample_items_refuses_concrete_slots_outside_the_filled_part():
    # The gather clamps 7 to slot 4 (an unfilled slot: zeros) and wraps -1 to slot 4: concrete indices outside
    # [0, size) returned another slot's item silently. Traced ones follow JAX indexing (documented).
    spec = {"x": jax.ShapeDtypeStruct((), jnp.float32)}
    s = per.add(per.init(5, spec), {"x": jnp.array([10.0, 11.0, 12.0])})
    for bad, k in (([0, 3], 1), ([7], 0), ([1, 2, -1], 2)):
        with pytest.raises(ValueError, match=rf"indices must be in \[0, 3\).*got {bad[k]} at position {k}"):
            per.sample_items(s, jnp.array(bad, jnp.int32))
    np.testing.assert_array_equal(np.asarray(per.sample_items(s, jnp.array([2, 0], jnp.int8))["x"]), [12.0, 10.0])
    traced = jax.jit(per.sample_items)(s, jnp.array([2, 7, -1], jnp.int32))["x"]
    np.testing.assert_array_equal(np.asarray(traced), [12.0, 0.0, 0.0])


# ----------------------------------------------------------------------------------------------
# Updates.
def _np_update(prio, maxp, idx, vals):
    prio = prio.copy()
    final = {}
    for i, v in zip(idx, vals):  # sequential: the last occurrence wins
        prio[i] = v
        final[int(i)] = float(v)
    return prio, max([maxp] + list(final.values()))  # running max of the values actually stored


@pytest.mark.parametrize("jit", [False, True])
def test_update_duplicates_last_wins(jit):
    C = 23
    rng = np.random.default_rng(11)
    s = per.add(per.init(C), C)
    upd = jax.jit(per.update) if jit else per.update
    prio, maxp = np.asarray(s.priorities).copy(), 1.0
    for trial in range(20):
        K = (1, 7, 33, 59)[trial % 4]  # few distinct shapes: few compilations
        idx = rng.integers(0, 6 if trial % 2 else C, K).astype(np.int32)  # many duplicates
        vals = rng.uniform(0, 3, K).astype(np.float32)
        s = upd(s, jnp.asarray(idx), jnp.asarray(vals))
        prio, maxp = _np_update(prio, maxp, idx, vals)
        np.testing.assert_array_equal(np.asarray(s.priorities), prio)
        assert float(s.max_priority) == np.float32(maxp)


def test_update_duplicate_with_higher_earlier_value():
    s = per.add(per.init(4), 4)
    s = per.update(s, jnp.array([2, 2, 2], jnp.int32), jnp.array([9.0, 0.5, 0.25], jnp.float32))
    np.testing.assert_array_equal(np.asarray(s.priorities), [1, 1, 0.25, 1])
    assert float(s.max_priority) == 1.0  # the running max counts stored values only


def test_update_invalid_concrete_raises():
    s = per.add(per.init(6), 4)
    i = jnp.array([0, 1], jnp.int32)
    for bad in (-1.0, float("nan"), float("inf")):
        with pytest.raises(ValueError, match="priorities must be finite and >= 0"):
            per.update(s, i, jnp.array([1.0, bad], jnp.float32))
    with pytest.raises(ValueError, match=r"indices must be in \[0, 4\)"):
        per.update(s, jnp.array([0, 4], jnp.int32), jnp.array([1.0, 1.0]))
    with pytest.raises(ValueError, match="indices must be in"):
        per.update(s, jnp.array([-1], jnp.int32), jnp.array([1.0]))
    with pytest.raises(ValueError, match="shape"):
        per.update(s, i, jnp.array([1.0]))
    with pytest.raises(TypeError, match="integer"):
        per.update(s, jnp.array([0.0, 1.0]), jnp.array([1.0, 1.0]))
    with pytest.raises(TypeError, match="float"):
        per.update(s, i, jnp.array([1, 1]))
    # float64 values beyond the float32 range would be stored as inf -> 0 (never sampled): they raise too
    with pytest.raises(ValueError, match="priorities must be finite and >= 0"):
        per.update(s, i, np.array([1.0, 1e39], np.float64))


def test_update_invalid_traced_is_safe():
    s = per.add(per.init(6), 6)
    vals = jnp.array([-2.0, jnp.nan, jnp.inf, 3.0, 4.0], jnp.float32)
    idx = jnp.array([0, 1, 2, 3, 99], jnp.int32)  # 99 is out of range: ignored
    s2 = jax.jit(per.update)(s, idx, vals)
    np.testing.assert_array_equal(np.asarray(s2.priorities), [0, 0, 0, 3, 1, 1])
    assert float(s2.max_priority) == 3.0
    i, w = per.sample(s2, jax.random.key(0), 64, alpha=0.6, beta=0.4)
    assert set(np.asarray(i).tolist()) <= {3, 4, 5} and np.isfinite(np.asarray(w)).all()


def test_update_traced_int64_index_out_of_range_is_ignored_not_wrapped():
    # Under jax_enable_x64 a traced int64 index 2**32 + 1 is outside [0, C): it must be ignored, not narrowed
    # to int32 first (where it wraps to slot 1 and overwrites that slot's priority).
    with jax.enable_x64(True):
        s = per.add(per.init(6), 4)
        idx = jnp.array([2**32 + 1, 2**33 + 2, -(2**32) + 3, 0], jnp.int64)
        s2 = jax.jit(per.update)(s, idx, jnp.array([5.0, 6.0, 7.0, 2.0], jnp.float32))
        got, got_max = np.asarray(s2.priorities), float(s2.max_priority)
    np.testing.assert_array_equal(got, [2, 1, 1, 1, 0, 0])
    assert got_max == 2.0


# ----------------------------------------------------------------------------------------------
# Accuracy of the prefix sum and absence of drift.
def test_prefix_sum_within_one_ulp_over_1e6():
    rng = np.random.default_rng(0)
    x = rng.random(1_000_000).astype(np.float32)
    exact = np.cumsum(x.astype(np.float64))
    got = np.asarray(jax.jit(per.prefix_sum)(jnp.asarray(x))).astype(np.float64)
    ulp = np.spacing(exact.astype(np.float32)).astype(np.float64)
    assert np.max(np.abs(got - exact) / ulp) <= 1.0
    # The bound is meaningful: a sequential float32 cumsum is far outside it.
    seq = np.cumsum(x).astype(np.float64)
    assert np.max(np.abs(seq - exact) / ulp) > 100.0


def test_prefix_sum_mixed_magnitudes_and_x64():
    rng = np.random.default_rng(1)
    x = (rng.lognormal(0, 4, 100_003)).astype(np.float32)
    x[rng.integers(0, x.size, 1000)] = 0.0
    exact = np.cumsum(x.astype(np.float64))
    got = np.asarray(per.prefix_sum(jnp.asarray(x))).astype(np.float64)
    np.testing.assert_array_less(np.abs(got - exact), np.spacing(exact.astype(np.float32)) * 1.0 + 1e-300)
    with jax.enable_x64(True):
        g64 = np.asarray(per.prefix_sum(jnp.asarray(x, jnp.float64)))
        assert g64.dtype == np.float64
        np.testing.assert_allclose(g64, exact, rtol=1e-12)
    with pytest.raises(TypeError):
        per.prefix_sum(jnp.arange(3))
    with pytest.raises(ValueError):
        per.prefix_sum(jnp.ones((2, 2)))


def test_prefix_sum_derivatives_on_the_kernel_path_and_the_reference(kernels_on):
    """prefix_sum is linear: c = L x with L lower-triangular ones, so jvp(t) = cumsum(t), grad of w . c is the
    reversed cumsum of w and the Hessian of sum c^2 is 2 L^T L. The kernel path (FFI call jaxfox_prefix_sum, no
    differentiation rule) must trace and lower for CUDA under jax.grad / jax.jvp as the reference does."""
    from conftest import cuda_custom_calls

    rng = np.random.default_rng(7)
    x = jnp.asarray(rng.random(37), jnp.float32)
    w = rng.normal(size=37)
    tri = np.tril(np.ones((37, 37)))
    f = lambda v: jnp.sum(per.prefix_sum(v) * jnp.asarray(w, jnp.float32))  # noqa: E731
    calls = cuda_custom_calls(jax.value_and_grad(f), x)  # raised "cannot be differentiated" before
    assert "jaxfox_prefix_sum" in calls
    cuda_custom_calls(lambda v, t: jax.jvp(per.prefix_sum, (v,), (t,)), x, x)
    with jaxfox.use_reference():
        np.testing.assert_allclose(np.asarray(jax.grad(f)(x)), tri.T @ w, rtol=1e-5, atol=1e-5)
        t = rng.normal(size=37).astype(np.float32)
        _, jt = jax.jvp(per.prefix_sum, (x,), (jnp.asarray(t),))
        np.testing.assert_allclose(np.asarray(jt), tri @ t, rtol=1e-5, atol=1e-5)
        hess = jax.hessian(lambda v: jnp.sum(per.prefix_sum(v) ** 2))(x[:6])
        np.testing.assert_allclose(np.asarray(hess), 2 * tri[:6, :6].T @ tri[:6, :6], rtol=1e-6)


def test_1e5_updates_no_drift():
    C, alpha, K, steps = 4099, 0.6, 100, 1000  # 1e5 priority updates
    rng = np.random.default_rng(12)
    all_idx = rng.integers(0, C, (steps, K)).astype(np.int32)
    all_val = rng.lognormal(0.0, 1.5, (steps, K)).astype(np.float32)
    all_val[rng.random((steps, K)) < 0.05] = 0.0

    @jax.jit
    def run(s, idx, val):
        return jax.lax.scan(lambda st, iv: (per.update(st, iv[0], iv[1]), None), s, (idx, val))[0]

    s = run(per.add(per.init(C), C), jnp.asarray(all_idx), jnp.asarray(all_val))
    prio = np.ones(C, np.float32)
    for idx, val in zip(all_idx, all_val):
        prio[idx] = val  # NumPy fancy assignment: the last duplicate wins
    np.testing.assert_array_equal(np.asarray(s.priorities), prio)
    assert float(s.max_priority) == max(1.0, float(all_val.max()))
    # Total used by the sampler vs the float64 sum of the same float32 q = p^alpha.
    q = np.where(prio > 0, np.power(prio.astype(np.float64), alpha), 0.0)
    P = np_probs(prio, C, alpha)
    got_P = np.asarray(per.probabilities(s, alpha=alpha)).astype(np.float64)
    np.testing.assert_allclose(got_P, P, rtol=2e-6, atol=0)
    total = float(per.prefix_sum(jnp.asarray(q.astype(np.float32)))[-1])
    assert abs(total - q.astype(np.float32).astype(np.float64).sum()) <= np.spacing(np.float32(total))
    idx, w = many_samples(s, jax.random.key(13), 256, 20, alpha, 1.0)
    assert (prio[np.asarray(idx)] > 0).all()


# ----------------------------------------------------------------------------------------------
def test_beta_schedule():
    f = per.beta_schedule(1000)
    for step, want in ((0, 0.4), (250, 0.55), (1000, 1.0), (5000, 1.0)):
        assert abs(float(f(step)) - want) < 1e-6
        assert abs(float(per.linear_beta(step, 1000)) - want) < 1e-6
    assert abs(float(per.beta_schedule(10, 0.5, 0.9)(5)) - 0.7) < 1e-6
    # float32 as documented, also under jax_enable_x64 (optax's schedule is float64 there)
    with jax.enable_x64(True):
        assert per.linear_beta(5, 10).dtype == jnp.float32 and per.beta_schedule(10)(jnp.int64(3)).dtype == jnp.float32
    assert jax.jit(f)(jnp.int32(250)).dtype == jnp.float32
    with pytest.raises(ValueError, match="total_steps"):
        per.beta_schedule(0)
    with pytest.raises(ValueError, match="beta0"):
        per.beta_schedule(10, beta0=1.5)
    # a concrete 0-d array is a scalar like any other (jnp.float32(0.4) was refused as "must be a float in
    # [0, 1]"); bools and traced values are refused by type, non-scalars by shape (jaxfox._validate.real_scalar)
    assert abs(float(per.beta_schedule(10, jnp.float32(0.5), np.float32(0.9))(5)) - 0.7) < 1e-6
    with pytest.raises(ValueError, match=r"^beta1 must be finite and in \[0, 1\], got 1.25"):
        per.beta_schedule(10, beta1=jnp.float32(1.25))
    for bad in (True, np.bool_(True), "0.4"):
        with pytest.raises(TypeError, match="^beta0 must be a real scalar"):
            per.beta_schedule(10, beta0=bad)
    with pytest.raises(ValueError, match=r"^beta0 must be a scalar \(shape \[\]\), got shape \(1,\)"):
        per.beta_schedule(10, beta0=jnp.ones((1,)))
    with pytest.raises(TypeError, match="^beta0 must be a concrete real scalar"):
        jax.jit(lambda b: per.beta_schedule(10, beta0=b)(3))(jnp.float32(0.4))


def test_draws_rounding_up_to_the_total_never_hit_a_zero_slot():
    # With B = 2^22 strata, (k + r_k) rounds to B in float32 for about half of the batches' last
    # stratum, so u = S exactly: searchsorted returns C and the clamp must land on the last slot
    # with positive priority, not on size - 1 (whose priority is 0 here).
    p = np.array([0.5, 0.0, 2.0, 1.0, 0.0], np.float32)
    s = filled_state(p, capacity=7)
    f = jax.jit(lambda k: per.sample(s, k, 2 ** 22, alpha=1.0, beta=0.4))
    hit_top = 0
    for i in range(8):
        idx, w = f(jax.random.key(100 + i))
        counts = counts_of(idx, 7)
        assert counts[1] == 0 and counts[4] == 0 and counts[5:].sum() == 0
        assert np.isfinite(np.asarray(w)).all()
        r_last = float(jax.random.uniform(jax.random.key(100 + i), (2 ** 22,))[-1])
        hit_top += (np.float32(2 ** 22 - 1) + np.float32(r_last)) == np.float32(2 ** 22)
    assert hit_top >= 1  # the edge case really occurred


def test_corrupt_size_and_float64_without_x64_raise():
    """A state whose size is outside [0, C] was sampled silently (size -3 drew slot 0 with weight 0; size > C let
    the uniform fallback index past the slots); prefix_sum took float64 with x64 off and returned float32."""
    s = per.add(per.init(6), 4)
    for size in (-3, 7):
        bad = s._replace(size=jnp.asarray(size, s.size.dtype))
        with pytest.raises(ValueError, match=rf"^state.size must be in \[0, C\] = \[0, 6\], got {size}$"):
            per.sample(bad, jax.random.key(0), 2, alpha=0.5, beta=0.4)
        with pytest.raises(ValueError, match=r"^state.size must be in \[0, C\]"):
            per.probabilities(bad, alpha=0.5)
    idx, w = per.sample(s._replace(size=jnp.asarray(6, s.size.dtype)), jax.random.key(0), 2, alpha=0.5, beta=0.4)
    assert idx.shape == (2,) and bool(jnp.all((idx >= 0) & (idx < 6)))
    if not jax.config.jax_enable_x64:
        with pytest.raises(TypeError, match="^x is float64 but jax_enable_x64 is off"):
            per.prefix_sum(np.ones(4, np.float64))
    np.testing.assert_array_equal(np.asarray(per.prefix_sum(np.ones(4, np.float32))), [1, 2, 3, 4])


def test_init_refuses_64bit_item_spec_without_x64():
    """A float64 / int64 item_spec leaf with x64 off was stored as float32 / int32 silently, and add() then refused
    items of the dtype the spec asked for ("must be float32, got float64"). It raises at init, naming the leaf."""
    for dt, canon in ((np.float64, "float32"), (np.int64, "int32")):
        for spec in (jax.ShapeDtypeStruct((3,), dt), np.zeros((3,), dt)):
            with pytest.raises(TypeError, match=rf"^item_spec\['o'\] is {np.dtype(dt).name} but jax_enable_x64 is "
                                                rf"off: the storage would be {canon}"):
                per.init(4, {"o": spec})
    with jax.enable_x64(True):  # with x64 the storage has the asked dtype and keeps float64 values exactly
        s = per.init(4, {"o": jax.ShapeDtypeStruct((3,), jnp.float64)})
        x = np.array([[1 + 2.0 ** -40, 2.0, 3.0], [4.0, 5.0, 1e300]])
        s = per.add(s, {"o": jnp.asarray(x)})
        got = np.asarray(s.items["o"])
    assert got.dtype == np.float64
    np.testing.assert_array_equal(got[:2], x)


@pytest.mark.parametrize("x64", [False, True])
def test_overflowing_scores_fall_back_to_uniform_on_both_reference_paths(x64):
    """q = p^alpha = inf (1e38^10) or S beyond the float32 range: the module docstring's rule is uniform
    stratified draws over the filled slots, weights 1, P = 1/size. Under x64 the float64 cumsum gave S = inf,
    which passed the `total > 0` test: every draw went to the last positive slot and probabilities were NaN."""
    cases = [([1e38, 0.0, 3.0, 4.0], 10.0)]  # q_0 overflows float32 and float64
    if not x64:
        cases.append(([3e38, 0.0, 3e38, 1.0], 1.0))  # finite q, S > float32 max
    for p, alpha in cases:
        with jax.enable_x64(x64):
            s = filled_state(p, capacity=5)
            idx, w = many_samples(s, jax.random.key(3), 8, 50, alpha, 0.7)
            probs = np.asarray(per.probabilities(s, alpha=alpha))
        # oracle: idx_k = floor((k + r_k) / B * size) with B = 8, size = 4 is k // 2 for every r_k in [0, 1)
        np.testing.assert_array_equal(np.asarray(idx), np.broadcast_to(np.arange(8) // 2, (50, 8)))
        np.testing.assert_array_equal(np.asarray(w), 1.0)
        np.testing.assert_array_equal(probs, [0.25, 0.25, 0.25, 0.25, 0.0])


def test_sample_key_must_be_one_prng_key():
    """A seed, a batch of keys or a non-key array gave JAX errors that did not name the argument."""
    s = filled_state([1.0, 2.0])
    for bad, err, msg in ((0, TypeError, r"^key must be a single jax.random key .* got int$"),
                          (jnp.zeros(2, jnp.int32), TypeError,
                           r"^key must be a single jax.random key .* got an array of dtype int32"),
                          ("k", TypeError, r"^key must be a single jax.random key .* got str$"),
                          (jax.random.split(jax.random.key(0), 2), ValueError,
                           r"^key must be a single jax.random key \(shape \[\]\), got a key array of shape \(2,\)"),
                          (jax.random.split(jax.random.PRNGKey(0), 2), ValueError,
                           r"^key must be a single jax.random key \(a raw uint32 key has shape \[2\]\), got shape "
                           r"\(2, 2\)")):
        with pytest.raises(err, match=msg):
            per.sample(s, bad, 2, alpha=0.6, beta=0.4)
    # both key kinds draw the same stratified slots (B = 2, equal masses: one slot per stratum)
    for key in (jax.random.key(0), jax.random.PRNGKey(0)):
        idx, w = per.sample(filled_state([1.0, 1.0]), key, 2, alpha=1.0, beta=0.4)
        np.testing.assert_array_equal(np.asarray(idx), [0, 1])
        np.testing.assert_array_equal(np.asarray(w), 1.0)
