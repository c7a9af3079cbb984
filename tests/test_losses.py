"""jaxfox.losses against independent float64 NumPy written from the equations (OPS.md "Losses")."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.test_util import check_grads

import jaxfox

jax.config.update("jax_enable_x64", False)
RNG = np.random.default_rng(0)


# ---------------------------------------------------------------- NumPy oracles
def np_expectile(u, tau):
    u = np.asarray(u, np.float64)
    w = np.where(u < 0, 1.0 - np.asarray(tau, np.float64), np.asarray(tau, np.float64))
    return w * u ** 2


def np_quantile_huber(z, taus, y, kappa):
    """Loops over b, i, j; delta = y_j - z_i; dopamine convention (divide by kappa, sum i, mean j)."""
    z, y = np.asarray(z, np.float64), np.asarray(y, np.float64)
    taus = np.broadcast_to(np.asarray(taus, np.float64), z.shape)
    B, N = z.shape
    Np = y.shape[1]
    out = np.zeros(B)
    for b in range(B):
        tot = 0.0
        for i in range(N):
            s = 0.0
            for j in range(Np):
                d = y[b, j] - z[b, i]
                hub = 0.5 * d * d if abs(d) <= kappa else kappa * (abs(d) - 0.5 * kappa)
                s += abs(taus[b, i] - (1.0 if d < 0 else 0.0)) * hub / kappa
            tot += s / Np
        out[b] = tot
    return out


def np_cql(q, a, alpha):
    q = np.asarray(q, np.float64)
    m = q.max(-1, keepdims=True)
    lse = (m + np.log(np.exp(q - m).sum(-1, keepdims=True)))[..., 0]
    qa = np.take_along_axis(q, np.asarray(a)[..., None], -1)[..., 0]
    return alpha * (lse - qa)


# ---------------------------------------------------------------- expectile
@pytest.mark.parametrize("tau", [0.1, 0.5, 0.7, 0.9])
def test_expectile_matches_numpy(tau):
    u = RNG.normal(size=(64, 3)).astype(np.float32)
    got = np.asarray(jaxfox.expectile_loss(jnp.asarray(u), tau))
    assert got.dtype == np.float32 and got.shape == u.shape
    np.testing.assert_allclose(got, np_expectile(u, tau), rtol=1e-6, atol=1e-7)


def test_expectile_half_mse_at_half():
    u = RNG.normal(size=(1000,)).astype(np.float32) * 3
    got = float(jnp.mean(jaxfox.expectile_loss(jnp.asarray(u), 0.5)))
    assert got == pytest.approx(0.5 * np.mean(np.asarray(u, np.float64) ** 2), rel=1e-6)


def test_expectile_asymmetry_and_per_group_tau():
    # u > 0 (target above V) weighted tau, u < 0 weighted 1 - tau.
    u = jnp.asarray([[2.0, 2.0], [-2.0, -2.0]], jnp.float32)
    got = np.asarray(jaxfox.expectile_loss(u, jnp.asarray([0.7, 0.9], jnp.float32)))
    np.testing.assert_allclose(got, [[0.7 * 4, 0.9 * 4], [0.3 * 4, 0.1 * 4]], rtol=1e-6)
    bf = jaxfox.expectile_loss(u.astype(jnp.bfloat16), 0.7)
    assert bf.dtype == jnp.float32


def test_expectile_grads():
    u = jnp.asarray(RNG.normal(size=(5, 2)) + 0.3, jnp.float32)   # away from 0
    check_grads(lambda x: jaxfox.expectile_loss(x, 0.8), (u,), order=2, modes=("rev", "fwd"), atol=1e-2,
                rtol=1e-2)
    g = jax.grad(lambda x: jnp.sum(jaxfox.expectile_loss(x, 0.8)))(u)
    u64 = np.asarray(u, np.float64)
    np.testing.assert_allclose(np.asarray(g), 2 * np.where(u64 < 0, 0.2, 0.8) * u64, rtol=1e-5)


def test_expectile_errors():
    u = jnp.zeros((4, 2), jnp.float32)
    with pytest.raises(ValueError, match="expectile"):
        jaxfox.expectile_loss(u, 1.0)
    with pytest.raises(ValueError, match="expectile"):
        jaxfox.expectile_loss(u, 0.0)
    # in (0, 1) as float64 but 1.0 / 0.0 in float32 (the loss would silently become one-sided)
    for tau in (1.0 - 1e-9, 1e-50, np.float64(1.0 - 1e-9)):
        assert np.float32(tau) in (0.0, 1.0)
        with pytest.raises(ValueError, match=r"expectile must be in \(0, 1\), also when rounded to float32"):
            jaxfox.expectile_loss(u, tau)
    with pytest.raises(ValueError, match="rounded to float32"):
        jaxfox.expectile_loss(u, np.asarray([0.5, 1.0 - 1e-9]))
    np.testing.assert_allclose(jaxfox.expectile_loss(u + 1.0, 1.0 - 1e-7), 1.0 - 1e-7, rtol=1e-6)  # float32 < 1
    with pytest.raises(ValueError, match=r"expectile must have shape .*\(3,\)"):
        jaxfox.expectile_loss(u, jnp.full((3,), 0.5, jnp.float32))
    with pytest.raises(ValueError, match="expectile"):
        jaxfox.expectile_loss(u, jnp.asarray([0.5, 1.5], jnp.float32))
    with pytest.raises(TypeError, match="diff"):
        jaxfox.expectile_loss(jnp.zeros(3, jnp.int32), 0.5)
    with pytest.raises(TypeError, match="expectile"):
        jaxfox.expectile_loss(u, "0.5")


# ---------------------------------------------------------------- quantile Huber
@pytest.mark.parametrize("kappa", [1.0, 0.5, 2.0])
@pytest.mark.parametrize("shared_taus", [False, True])
def test_quantile_huber_matches_numpy(kappa, shared_taus):
    B, N, Np = 4, 5, 7
    z = RNG.normal(size=(B, N)).astype(np.float32) * 2
    y = RNG.normal(size=(B, Np)).astype(np.float32) * 2
    taus = RNG.uniform(size=(N,) if shared_taus else (B, N)).astype(np.float32)
    ref = np_quantile_huber(z, taus, y, kappa)
    got_b = np.asarray(jaxfox.quantile_huber_loss(jnp.asarray(z), jnp.asarray(taus), jnp.asarray(y), kappa,
                                                  per_sample=True))
    np.testing.assert_allclose(got_b, ref, rtol=1e-5, atol=1e-6)
    got = float(jaxfox.quantile_huber_loss(jnp.asarray(z), jnp.asarray(taus), jnp.asarray(y), kappa))
    assert got == pytest.approx(ref.mean(), rel=1e-5)


def test_quantile_huber_indicator_sign():
    # One online quantile z = 0 at tau = 0.9, one target: y = +1 (delta > 0) weights tau = 0.9,
    # y = -1 (delta < 0) weights 1 - tau = 0.1. Huber(1) = 0.5 at kappa = 1.
    z = jnp.zeros((2, 1), jnp.float32)
    taus = jnp.full((2, 1), 0.9, jnp.float32)
    y = jnp.asarray([[1.0], [-1.0]], jnp.float32)
    got = np.asarray(jaxfox.quantile_huber_loss(z, taus, y, 1.0, per_sample=True))
    np.testing.assert_allclose(got, [0.9 * 0.5, 0.1 * 0.5], rtol=1e-6)
    # The gradient pushes a high-tau quantile up when the target is above it.
    g = jax.grad(lambda zz: jaxfox.quantile_huber_loss(zz, taus[:1], y[:1], 1.0))(z[:1])
    assert float(g[0, 0]) == pytest.approx(-0.9, rel=1e-6)


def test_quantile_huber_kappa_scaling_and_linear_region():
    # |delta| = 3 > kappa = 1: huber = kappa (3 - 0.5) = 2.5, divided by kappa = 1.
    z = jnp.zeros((1, 1), jnp.float32)
    got = float(jaxfox.quantile_huber_loss(z, jnp.full((1, 1), 0.25, jnp.float32), jnp.full((1, 1), 3.0), 1.0))
    assert got == pytest.approx(0.25 * 2.5)
    # kappa = 4: quadratic region, 0.5 * 9 / 4.
    got = float(jaxfox.quantile_huber_loss(z, jnp.full((1, 1), 0.25, jnp.float32), jnp.full((1, 1), 3.0), 4.0))
    assert got == pytest.approx(0.25 * 4.5 / 4)


def test_quantile_huber_grads():
    B, N, Np = 3, 4, 5
    z = jnp.asarray(RNG.normal(size=(B, N)), jnp.float32)
    y = jnp.asarray(RNG.normal(size=(B, Np)) * 2, jnp.float32)
    taus = jnp.asarray(RNG.uniform(size=(B, N)), jnp.float32)
    check_grads(lambda a, b: jaxfox.quantile_huber_loss(a, taus, b, 1.0), (z, y), order=1, modes=("rev",),
                atol=1e-2, rtol=1e-2)


def test_quantile_huber_errors():
    z = jnp.zeros((4, 5), jnp.float32)
    y = jnp.zeros((4, 6), jnp.float32)
    t = jnp.zeros((4, 5), jnp.float32)
    with pytest.raises(ValueError, match=r"online_quantiles must have shape \[B, N\]"):
        jaxfox.quantile_huber_loss(z[0], t, y)
    with pytest.raises(ValueError, match=r"target_quantiles must have shape \[B, N'\] = \[4, \?\], got \(3, 6\)"):
        jaxfox.quantile_huber_loss(z, t, y[:3])
    with pytest.raises(ValueError, match=r"taus must have shape"):
        jaxfox.quantile_huber_loss(z, t[:, :4], y)
    with pytest.raises(ValueError, match="kappa"):
        jaxfox.quantile_huber_loss(z, t, y, 0.0)
    with pytest.raises(TypeError, match="target_quantiles"):
        jaxfox.quantile_huber_loss(z, t, y.astype(jnp.int32))
    # B = 0: the batch mean was NaN (a mean over no states); per_sample gives the empty [0] losses
    with pytest.raises(ValueError, match="at least one row.*B = 0"):
        jaxfox.quantile_huber_loss(z[:0], t[0], y[:0])
    assert jaxfox.quantile_huber_loss(z[:0], t[0], y[:0], per_sample=True).shape == (0,)
    # per_sample picks the output shape: a truthy string or an array was taken as True
    for bad in ("no", jnp.array(True), 1):
        with pytest.raises(TypeError, match="per_sample must be a Python bool"):
            jaxfox.quantile_huber_loss(z, t, y, per_sample=bad)


# ---------------------------------------------------------------- quantile embedding
def test_quantile_embedding_matches_numpy():
    taus = RNG.uniform(size=(3, 4)).astype(np.float32)
    got = np.asarray(jaxfox.quantile_embedding(jnp.asarray(taus), 8))
    ref = np.cos(np.pi * np.asarray(taus, np.float64)[..., None] * np.arange(8))
    assert got.shape == (3, 4, 8)
    np.testing.assert_allclose(got, ref, atol=2e-6)
    np.testing.assert_array_equal(got[..., 0], 1.0)
    with pytest.raises(ValueError, match="n_cos"):
        jaxfox.quantile_embedding(jnp.asarray(taus), 0)
    with pytest.raises(TypeError, match="taus"):
        jaxfox.quantile_embedding(np.arange(3), 4)


# ---------------------------------------------------------------- CQL
@pytest.mark.parametrize("shape", [(6, 5), (4, 3, 5)])
def test_cql_matches_numpy(shape):
    q = (RNG.normal(size=shape) * 5).astype(np.float32)
    a = RNG.integers(0, shape[-1], size=shape[:-1]).astype(np.int32)
    got = np.asarray(jaxfox.cql_penalty(jnp.asarray(q), jnp.asarray(a), 0.5))
    np.testing.assert_allclose(got, np_cql(q, a, 0.5), rtol=1e-5, atol=1e-5)
    assert np.all(got >= -1e-6)


def test_cql_one_action_is_zero_and_large_values_do_not_overflow():
    q = jnp.asarray(RNG.normal(size=(7, 1)) * 1e3, jnp.float32)
    np.testing.assert_array_equal(np.asarray(jaxfox.cql_penalty(q, jnp.zeros(7, jnp.int32))), 0.0)
    big = jnp.asarray([[1e30, 1e30 - 1e24, -1e30]], jnp.float32)
    v = np.asarray(jaxfox.cql_penalty(big, jnp.asarray([2], jnp.int32)))
    assert np.isfinite(v).all()
    # a +inf Q of another action: logsumexp = +inf, so the penalty is +inf (the hand-written max subtraction
    # computed inf - inf = NaN); -inf Q of the other actions: the penalty is exactly 0 (lse = the data action's Q)
    q = jnp.asarray([[np.inf, 1.0, 0.0], [-np.inf, 2.5, -np.inf]], jnp.float32)
    np.testing.assert_array_equal(np.asarray(jaxfox.cql_penalty(q, jnp.asarray([1, 1], jnp.int32))), [np.inf, 0.0])
    # as the docstring says: a -inf data-action Q gives +inf; a +inf one inf - inf = NaN, with A = 1 too
    q = jnp.asarray([[-np.inf, 1.0], [np.inf, 1.0]], jnp.float32)
    np.testing.assert_array_equal(np.asarray(jaxfox.cql_penalty(q, jnp.asarray([0, 0], jnp.int32))), [np.inf, np.nan])
    assert np.isnan(np.asarray(jaxfox.cql_penalty(jnp.full((1, 1), np.inf, jnp.float32), jnp.zeros(1, jnp.int32))))


def test_cql_grad_is_softmax_minus_onehot():
    q = jnp.asarray(RNG.normal(size=(3, 4)), jnp.float32)
    a = jnp.asarray([0, 3, 1], jnp.int32)
    g = np.asarray(jax.grad(lambda x: jnp.sum(jaxfox.cql_penalty(x, a, 2.0)))(q))
    q64 = np.asarray(q, np.float64)
    sm = np.exp(q64 - q64.max(1, keepdims=True))
    sm /= sm.sum(1, keepdims=True)
    np.testing.assert_allclose(g, 2.0 * (sm - np.eye(4)[np.asarray(a)]), rtol=1e-5, atol=1e-6)
    check_grads(lambda x: jaxfox.cql_penalty(x, a), (q,), order=1, modes=("rev",), atol=1e-2, rtol=1e-2)


def test_cql_errors():
    q = jnp.zeros((4, 3), jnp.float32)
    with pytest.raises(ValueError, match=r"actions must have shape .*\(4,\)"):
        jaxfox.cql_penalty(q, jnp.zeros((4, 1), jnp.int32))
    with pytest.raises(TypeError, match="actions"):
        jaxfox.cql_penalty(q, jnp.zeros((4,), jnp.float32))
    with pytest.raises(ValueError, match="alpha"):
        jaxfox.cql_penalty(q, jnp.zeros((4,), jnp.int32), -1.0)
    with pytest.raises(TypeError, match="q_values"):
        jaxfox.cql_penalty(jnp.zeros((4, 3), jnp.int32), jnp.zeros((4,), jnp.int32))
    # An out-of-range action gives NaN (not a silently clamped value).
    assert math.isnan(float(jaxfox.cql_penalty(q[:1], jnp.asarray([3], jnp.int32))[0]))


def test_cql_negative_and_wrapped_actions_give_nan():
    """A negative action is out of range too: NaN, eagerly and under jit, not Q of the action -1 + A
    (jnp's negative indexing); uint32 actions >= 2^31 likewise."""
    q = jnp.asarray(RNG.normal(size=(3, 4)), jnp.float32)
    for f in (jaxfox.cql_penalty, jax.jit(jaxfox.cql_penalty)):
        got = np.asarray(f(q, jnp.asarray([-1, 2, -4], jnp.int32)))
        assert np.isnan(got[0]) and np.isnan(got[2]) and np.isfinite(got[1])
        assert np.isnan(np.asarray(f(q[:1], jnp.asarray([2 ** 32 - 1], jnp.uint32)))[0])


def test_cql_bad_alpha_array_and_no_actions_raise():
    q = jnp.zeros((4, 3), jnp.float32)
    a = jnp.zeros((4,), jnp.int32)
    for bad in (jnp.float32(-1.0), jnp.float32(jnp.nan), np.float32(-2.0)):  # as for a Python float
        with pytest.raises(ValueError, match=r"alpha must be finite and in \[0, inf\)"):
            jaxfox.cql_penalty(q, a, bad)
    with pytest.raises(ValueError, match=r"q_values must have A >= 1 actions.*\(4, 0\)"):
        jaxfox.cql_penalty(jnp.zeros((4, 0), jnp.float32), a)
    assert float(jnp.sum(jax.jit(jaxfox.cql_penalty)(q, a, jnp.float32(2.0)))) == pytest.approx(8 * math.log(3))


# ---------------------------------------------------------------- concurrency flag helper
def test_enable_concurrent_command_buffers_after_init_raises(monkeypatch):
    jnp.ones(2).block_until_ready()          # backends are initialised now
    monkeypatch.setenv("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
    assert not jaxfox.concurrent_command_buffers_enabled()
    with pytest.raises(RuntimeError, match="already initialised"):
        jaxfox.enable_concurrent_command_buffers()
    with pytest.raises(ValueError, match="mode"):
        jaxfox.enable_concurrent_command_buffers("FAST")
    monkeypatch.setenv("XLA_FLAGS", "--xla_gpu_command_buffer_scheduling_mode=CONCURRENT")
    jaxfox.enable_concurrent_command_buffers()   # already set: a no-op, no error
    assert jaxfox.concurrent_command_buffers_enabled()


def test_enable_concurrent_command_buffers_in_fresh_process(tmp_path):
    import os
    import subprocess
    import sys

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    code = ("import os, jaxfox; jaxfox.enable_concurrent_command_buffers(); "
            "import jax.numpy as jnp; jnp.ones(2).block_until_ready(); print(os.environ['XLA_FLAGS'])")
    env = dict(os.environ, PYTHONPATH=root,
               XLA_FLAGS="--xla_gpu_command_buffer_scheduling_mode=SERIALIZE --xla_cpu_use_thunk_runtime=true")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    flags = out.stdout.split()
    assert "--xla_gpu_command_buffer_scheduling_mode=CONCURRENT" in flags
    assert "--xla_gpu_command_buffer_scheduling_mode=SERIALIZE" not in flags
    assert "--xla_cpu_use_thunk_runtime=true" in flags


@pytest.mark.parametrize("kappa", [1e-46, 1e39])
def test_quantile_huber_kappa_must_be_a_positive_finite_float32(kappa):
    """The loss is float32: kappa = 1e-46 would be 0 there (NaN loss), 1e39 inf (loss 0); both are rejected."""
    z = jnp.zeros((2, 3), jnp.float32)
    with pytest.raises(ValueError, match="kappa"):
        jaxfox.quantile_huber_loss(z, jnp.full((2, 3), 0.5, jnp.float32), z, kappa)


def test_quantile_huber_needs_a_target_sample():
    """N' = 0 used to give a NaN loss per sample silently (a mean over no target samples); N' = 1 is fine."""
    z = jnp.asarray(RNG.normal(size=(3, 4)), jnp.float32)
    t = jnp.asarray(RNG.uniform(size=(4,)), jnp.float32)
    with pytest.raises(ValueError, match=r"target_quantiles must have N' >= 1.*\(3, 0\)"):
        jaxfox.quantile_huber_loss(z, t, jnp.zeros((3, 0), jnp.float32), per_sample=True)
    y = jnp.asarray(RNG.normal(size=(3, 1)), jnp.float32)
    np.testing.assert_allclose(np.asarray(jaxfox.quantile_huber_loss(z, t, y, per_sample=True)),
                               np_quantile_huber(z, t, y, 1.0), rtol=1e-5, atol=1e-6)


def test_quantile_huber_infinite_target_gives_the_bounded_gradient():
    """An infinite TD error is in the linear region: the loss is inf, and d loss / d z_i is the limit of the
    Huber slope, -sum_j |tau_i - 1{delta_ij < 0}| sign(delta_ij) / N' (float64 NumPy from the equations), not the
    NaN that the unselected quadratic branch used to contribute (0 * inf)."""
    B, N, Np, kappa = 2, 3, 4, 1.5
    rng = np.random.default_rng(5)
    z = rng.normal(size=(B, N)).astype(np.float32)
    taus = rng.uniform(0.05, 0.95, size=(B, N)).astype(np.float32)
    y = rng.normal(size=(B, Np)).astype(np.float32)
    y[0, 1], y[1, 3] = np.inf, -np.inf
    loss, dz = jax.value_and_grad(lambda z: jaxfox.quantile_huber_loss(z, taus, y, kappa, per_sample=True).sum())(
        jnp.asarray(z))
    assert np.all(np.isinf(np.asarray(loss)))
    d = y.astype(np.float64)[:, None, :] - z.astype(np.float64)[:, :, None]
    w = np.abs(taus.astype(np.float64)[:, :, None] - (d < 0))
    want = -np.sum(w * np.clip(d, -kappa, kappa) / kappa, axis=2) / Np
    np.testing.assert_allclose(np.asarray(dz), want, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("kappa", [1e-40, 1e-38, 1e-30, 1e-20, np.float32(1e-40), jnp.float32(1e-30)])
def test_quantile_huber_kappa_that_underflows_float32_raises(kappa):
    """XLA (CPU) flushes float32 subnormals to zero: kappa = 1e-40 gave NaN losses (0 / 0), 1e-38 NaN eagerly and 0
    under jit, and kappa = 1e-30 at |delta| = 1e-9 a loss of 0 instead of 3e-10 (kappa (|delta| - kappa / 2) = 1e-39
    -> 0). kappa < 2^-63 is now refused, naming kappa (a subnormal one as not a normal float32)."""
    z = jnp.zeros((2, 3), jnp.float32)
    with pytest.raises(ValueError, match=r"^kappa must be (>= 2\^-63|a positive finite normal float32)"):
        jaxfox.quantile_huber_loss(z, jnp.full((3,), 0.3, jnp.float32), z + 1.0, kappa)


def test_quantile_huber_smallest_kappa_matches_numpy():
    """At kappa = 2^-63 (the smallest accepted) the losses match float64 NumPy up to 2^-63 absolute per term, for
    TD errors in the quadratic region, just past kappa, and far in the linear region."""
    kappa = 2.0 ** -63
    z = jnp.zeros((1, 2), jnp.float32)
    taus = jnp.asarray([0.3, 0.8], jnp.float32)
    for d in (0.5 * kappa, 3 * kappa, 1e-9, -1e-9, 1.0):
        y = jnp.full((1, 1), d, jnp.float32)
        got = np.asarray(jaxfox.quantile_huber_loss(z, taus, y, kappa, per_sample=True))
        want = np_quantile_huber(z, taus, np.asarray(y, np.float64), kappa)
        np.testing.assert_allclose(got, want, rtol=1e-6, atol=2 * 2.0 ** -63, err_msg=str(d))
    with pytest.raises(ValueError, match="kappa"):
        jaxfox.quantile_huber_loss(z, taus, y, np.nextafter(np.float32(kappa), np.float32(0)))


@pytest.mark.parametrize("tau", [1e-40, np.float32(1e-40), np.asarray([0.5, 1e-40], np.float32)])
def test_expectile_subnormal_in_float32_raises(tau):
    """tau = 1e-40 is in (0, 1) also in float32, but subnormal: XLA (CPU) flushed it to 0, so the loss of u > 0 was 0
    (u = 1e10: 0 instead of 1e-20) and its gradient 0 -- a one-sided loss, which the (0, 1) check exists to prevent."""
    u = jnp.asarray([[1e10, -1.0]], jnp.float32)
    with pytest.raises(ValueError, match=r"expectile must be in \(0, 1\).*2\^-126"):
        jaxfox.expectile_loss(u, tau)
    tiny = np.finfo(np.float32).tiny   # the smallest normal float32 is accepted and not flushed
    got = np.asarray(jaxfox.expectile_loss(u, float(tiny) * 1e8))
    np.testing.assert_allclose(got, np_expectile(u, np.float64(np.float32(tiny * 1e8))), rtol=1e-6)


def test_quantile_huber_edge_values_match_numpy():
    """|delta| exactly kappa, delta = 0, far in the linear region, and taus at 0 and 1: value and the gradients with
    respect to the online quantiles and the targets against float64 NumPy from the equations (d rho / d delta =
    |tau - 1{delta < 0}| clip(delta, -kappa, kappa) / kappa)."""
    kappa = 0.5
    z = jnp.zeros((1, 3), jnp.float32)
    taus = jnp.asarray([0.0, 1.0, 0.25], jnp.float32)
    y = jnp.asarray([[0.5, -0.5, 0.0, 2.0, -2.0]], jnp.float32)
    loss, (dz, dy) = jax.value_and_grad(lambda a, b: jaxfox.quantile_huber_loss(a, taus, b, kappa), argnums=(0, 1))(
        z, y)
    d = np.asarray(y, np.float64)[:, None, :] - np.asarray(z, np.float64)[:, :, None]     # [1, N, N']
    w = np.abs(np.asarray(taus, np.float64)[None, :, None] - (d < 0))
    assert float(loss) == pytest.approx(float(np_quantile_huber(z, taus, y, kappa).mean()), rel=1e-6)
    # by hand: huber/kappa at |d| = 0.5: 0.25; 0: 0; 2: 1.75. tau 0: 0.25 + 1.75 (d < 0); tau 1: 0.25 + 1.75
    # (d > 0); tau 0.25: 0.25 * (0.25 + 1.75) + 0.75 * (0.25 + 1.75) = 2; sum 6, mean over N' = 5
    assert float(loss) == pytest.approx(6.0 / 5, rel=1e-6)
    slope = w * np.clip(d, -kappa, kappa) / kappa / d.shape[2]
    np.testing.assert_allclose(np.asarray(dz), -slope.sum(axis=2), rtol=1e-6, atol=1e-7)
    np.testing.assert_allclose(np.asarray(dy), slope.sum(axis=1), rtol=1e-6, atol=1e-7)


def test_quantile_embedding_dopamine_features():
    """The docstring's mapping: dopamine's n features cos(pi i tau), i = 1 .. n, are quantile_embedding(taus, n + 1)
    without its constant column (float64 NumPy)."""
    taus = RNG.uniform(size=(4, 3)).astype(np.float32)
    n = 6
    dopamine = np.cos(np.pi * np.arange(1, n + 1) * np.asarray(taus, np.float64)[..., None])
    np.testing.assert_allclose(np.asarray(jaxfox.quantile_embedding(jnp.asarray(taus), n + 1))[..., 1:], dopamine,
                               atol=2e-6)
