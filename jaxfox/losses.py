"""Losses of the auxiliary trainers: expectile (IQL), quantile Huber (IQN) with its cosine quantile
embedding, and the discrete CQL penalty (OPS.md "Losses").

All four are pure JAX: they are short elementwise/reduction chains that XLA fuses into one or two
kernels, so no CUDA kernel is used (a fused kernel would only be added where it beats XLA). Inputs may
be float32 or bfloat16; every loss is computed and returned in float32.

Conventions (OPS.md "Losses"; where public implementations disagree the choice is named):

* :func:`expectile_loss` is elementwise (no reduction): L_tau(u) = |tau - 1{u < 0}| u^2. At
  tau = 0.5 it is u^2 / 2, so its mean is half the MSE.
* :func:`quantile_huber_loss` sums over the online quantiles i, averages over the target samples j
  and over the batch, and divides the Huber term by kappa (dopamine; rlax does not divide -- the two
  agree at kappa = 1). The indicator is 1{delta_ij < 0} with delta_ij = target_j - online_i, under
  ``stop_gradient``.
* :func:`cql_penalty` is per sample (no reduction over the batch).
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np

from jaxfox._validate import (in_open_unit_float32, is_concrete, positive_float32, positive_int,
                              real_scalar as _real_scalar)

__all__ = ["expectile_loss", "quantile_huber_loss", "quantile_embedding", "cql_penalty"]

_FLOATS = (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16))


# ----------------------------------------------------------------------------------------------
# Validation helpers.
def _check_float_array(name, x, min_ndim=0):
    if not hasattr(x, "shape") or not hasattr(x, "dtype"):
        raise TypeError(f"{name} must be a float32 or bfloat16 array, got {type(x).__name__}")
    if jnp.dtype(x.dtype) not in _FLOATS:
        raise TypeError(f"{name} must be float32 or bfloat16, got {x.dtype}")
    if len(x.shape) < min_ndim:
        raise ValueError(f"{name} must have at least {min_ndim} dims, got shape {tuple(x.shape)}")


def _is_python_number(v):
    return isinstance(v, (int, float, np.integer, np.floating)) and not isinstance(v, bool)


_KAPPA_MIN = 2.0 ** -63  # sqrt(2^-126), the square root of the smallest normal float32


def _huber_kappa(kappa, name="kappa"):
    """The Huber threshold of quantile_huber_loss / iqn_quantile_huber_loss as a Python float: positive_float32's
    checks, and kappa >= 2^-63 (about 1.1e-19) in float32.

    The loss is computed as |tau - 1{d < 0}| L_kappa(d) / kappa in float32, and XLA on CPU flushes subnormal values
    to zero: a subnormal kappa (1e-40) gave 0 / 0 = NaN losses, and a tiny normal one dropped whole terms (kappa =
    1e-30, |d| = 1e-9: kappa (|d| - kappa / 2) = 1e-39 -> 0, a term of 3e-10 lost). A product flushed to zero is below
    2^-126, so the term it stood for is below 2^-126 / kappa: at kappa >= 2^-63, below 2^-63 in absolute value.
    """
    k = positive_float32(name, kappa)
    if float(np.float32(k)) < _KAPPA_MIN:
        raise ValueError(f"{name} must be >= 2^-63 (about 1.1e-19) in float32: below, L_kappa(delta) / kappa "
                         f"underflows float32 (subnormals are flushed to zero: NaN or 0 losses), got {kappa!r}")
    return k


# ----------------------------------------------------------------------------------------------
def expectile_loss(diff, expectile):
    """Asymmetric squared loss of IQL value learning, elementwise: ``|tau - 1{u < 0}| * u**2``.

    Args:
      diff: u [...], float32 or bfloat16; in IQL u = Q_target_min(s, a) - V(s) (target minus
        prediction, so tau > 0.5 weights under-estimates of the target more).
      expectile: tau, a Python float in (0, 1), or a float array of shape [] or [K] with
        K = diff.shape[-1] (one expectile per group along the last axis, e.g. the K value networks of
        an IQL ensemble with u [B, K]). Values of a traced array are not range-checked.

    Returns:
      float32 array of diff's shape: the per-element loss (no reduction; take the mean over the batch).
      At tau = 0.5 it is u**2 / 2 (half the squared error). The gradient w.r.t. u is
      2 |tau - 1{u < 0}| u (continuous at u = 0; the indicator's gradient is zero).

    Source: Kostrikov, Nair & Levine 2021, "Offline Reinforcement Learning with Implicit Q-Learning",
    eq. (5) with L_2^tau(u) = |tau - 1(u < 0)| u^2; as ``expectile_loss`` in ikostrikov/implicit_q_learning
    (``weight * diff**2``, reduced with a mean there). OPS.md "Losses".

    Raises:
      TypeError: diff is not a float32/bfloat16 array; expectile is neither a number nor a float array.
      ValueError: a numeric (or concrete array) expectile is outside (0, 1), NaN, rounds to 0 or 1 in float32
        (1 - 1e-9), or is subnormal there (below 2^-126 ~ 1.2e-38: flushed to 0 by XLA on CPU); an array
        expectile's shape is not [] or [diff.shape[-1]].
    """
    _check_float_array("diff", diff)
    if _is_python_number(expectile):
        if not in_open_unit_float32(expectile):
            raise ValueError(f"expectile must be in (0, 1), also when rounded to float32 (and >= 2^-126, a normal "
                             f"float32), got {expectile!r}")
        tau = jnp.float32(expectile)
    elif hasattr(expectile, "shape") and hasattr(expectile, "dtype"):
        if not jnp.issubdtype(expectile.dtype, jnp.floating):
            raise TypeError(f"expectile must be a float array, got {expectile.dtype}")
        want = (tuple(diff.shape[-1:]),) if diff.ndim else ()
        if tuple(expectile.shape) != () and tuple(expectile.shape) not in want:
            raise ValueError(f"expectile must have shape [] or [K] = [diff.shape[-1]] = "
                             f"{list(diff.shape[-1:])}, got {tuple(expectile.shape)}")
        if is_concrete(expectile):
            if not in_open_unit_float32(expectile):
                raise ValueError(f"expectile must be in (0, 1), also when rounded to float32 (and >= 2^-126, a normal "
                                 f"float32), got {np.asarray(expectile, np.float64).tolist()}")
        tau = expectile.astype(jnp.float32)
    else:
        raise TypeError(f"expectile must be a float or a float array, got {type(expectile).__name__}")
    u = diff.astype(jnp.float32)
    weight = jnp.where(u < 0, 1.0 - tau, tau)
    return weight * (u * u)


# ----------------------------------------------------------------------------------------------
def quantile_embedding(taus, n_cos=64):
    """Cosine features of quantile fractions: ``cos(pi * i * tau)`` for i = 0 .. n_cos - 1.

    Args:
      taus: [...] float32 or bfloat16 quantile fractions (usually in [0, 1], e.g. [B, N]).
      n_cos: number of cosine features n (int >= 1; IQN uses 64).

    Returns:
      [..., n_cos] float32. Feature 0 is cos(0) = 1 (a constant, as in the paper's sum from i = 0);
      feed it to a Linear + ReLU to get phi(tau) (IQN eq. 4).

    Source: Dabney, Ostrovski, Silver & Munos 2018, "Implicit Quantile Networks for Distributional
    Reinforcement Learning", eq. (4): phi_j(tau) = ReLU(sum_{i=0}^{n-1} cos(pi i tau) w_ij + b_j).
    dopamine's ``ImplicitQuantileNetwork`` uses i = 1 .. n instead: no constant feature (which the Linear's bias
    already spans) but cos(pi n tau), which is not here; ``quantile_embedding(taus, n + 1)[..., 1:]`` is dopamine's
    n features.

    Raises:
      TypeError: taus is not a float32/bfloat16 array.  ValueError: n_cos is not an int >= 1.
    """
    _check_float_array("taus", taus)
    i = jnp.arange(positive_int("n_cos", n_cos), dtype=jnp.float32)
    return jnp.cos(jnp.float32(math.pi) * taus.astype(jnp.float32)[..., None] * i)


# ----------------------------------------------------------------------------------------------
def _huber(d, kappa):
    a = jnp.abs(d)
    quad = a <= kappa
    dq = jnp.where(quad, d, 0.0)  # the unselected quadratic branch at |d| = inf would give 0 * inf = NaN gradients
    return jnp.where(quad, 0.5 * dq * dq, kappa * (a - 0.5 * kappa))


def quantile_huber_loss(online_quantiles, taus, target_quantiles, kappa=1.0, *, per_sample=False):
    """Quantile Huber loss of IQN between N online quantile values and N' target samples per state.

    With delta_ij = target_j - online_i (pairwise TD errors, j over the N' target samples):

        rho_ij = |tau_i - 1{delta_ij < 0}| * L_kappa(delta_ij) / kappa
        L_kappa(d) = d^2 / 2 if |d| <= kappa else kappa (|d| - kappa / 2)
        loss_b = sum_i mean_j rho_ij;   loss = mean_b loss_b

    The indicator carries no gradient (``stop_gradient``); gradients flow into online_quantiles,
    target_quantiles and taus as written -- pass a ``stop_gradient``-ed target (r + gamma Z_target)
    as usual. The sign convention matters: for delta > 0 (target above the prediction) the weight is
    tau_i, so a high tau pushes its quantile up.

    Args:
      online_quantiles: [B, N] float32/bfloat16, Z_tau_i(s, a) of the online network.
      taus: [B, N] or [N] float32/bfloat16, the fractions tau_i in [0, 1] the online values were taken at (not
        checked: a value outside still weighs delta by |tau - 1{delta < 0}|, which is then no quantile loss).
      target_quantiles: [B, N'] float32/bfloat16, the target samples (e.g. r + gamma Z'_tau'_j(s', a*)).
      kappa: Huber threshold, a concrete real >= 2^-63 (~1.1e-19; below, float32 underflow gives NaN or 0 losses), a
        Python float or a 0-d array, in the units of the quantile values (IQN uses 1).
      per_sample: return loss_b [B] instead of the batch mean.

    Returns:
      float32 scalar (mean over the batch), or [B] float32 when per_sample.

    Source: Dabney et al. 2018 (IQN), eq. (3) and (10) (QR-DQN, Dabney et al. 2017, eq. 10, has no 1 / kappa);
    matches dopamine ``implicit_quantile_agent`` (divides by kappa, sums over online quantiles, means
    over target samples). rlax ``quantile_regression_loss`` does not divide by kappa: equal at
    kappa = 1. OPS.md "Losses".

    Raises:
      TypeError: an input is not a float32/bfloat16 array; kappa is not a concrete real scalar (a bool, a string,
        a traced value).
      ValueError: wrong ranks or mismatched B/N (the message names the argument and both shapes); N' = 0
        (a mean over no target samples); B = 0 without per_sample (a mean over no states); kappa <= 0, not
        finite, or below 2^-63 in float32.
      TypeError: per_sample is not a Python bool.
    """
    if not isinstance(per_sample, bool):
        raise TypeError(f"per_sample must be a Python bool (it picks the output's shape), got {per_sample!r}")
    _check_float_array("online_quantiles", online_quantiles)
    _check_float_array("taus", taus)
    _check_float_array("target_quantiles", target_quantiles)
    if online_quantiles.ndim != 2:
        raise ValueError(f"online_quantiles must have shape [B, N], got {tuple(online_quantiles.shape)}")
    B, N = online_quantiles.shape
    if target_quantiles.ndim != 2 or target_quantiles.shape[0] != B:
        raise ValueError(f"target_quantiles must have shape [B, N'] = [{B}, ?], got "
                         f"{tuple(target_quantiles.shape)}")
    if target_quantiles.shape[1] == 0:
        raise ValueError(f"target_quantiles must have N' >= 1 target samples (the loss is a mean over them), got "
                         f"shape {tuple(target_quantiles.shape)}")
    if tuple(taus.shape) not in ((B, N), (N,)):
        raise ValueError(f"taus must have shape [B, N] = [{B}, {N}] or [N] = [{N}], got {tuple(taus.shape)}")
    if B == 0 and not per_sample:
        raise ValueError("online_quantiles must have at least one row (the loss is a mean over the batch), got B = 0; "
                         "per_sample=True gives the empty [0] losses")
    kappa = _huber_kappa(kappa)
    f32 = jnp.float32
    z = online_quantiles.astype(f32)
    t = jnp.broadcast_to(taus.astype(f32), (B, N))
    y = target_quantiles.astype(f32)
    delta = y[:, None, :] - z[:, :, None]                                 # [B, N, N']
    ind = jax.lax.stop_gradient((delta < 0).astype(f32))
    rho = jnp.abs(t[:, :, None] - ind) * _huber(delta, f32(kappa)) / f32(kappa)
    loss_b = jnp.sum(jnp.mean(rho, axis=2), axis=1)                       # sum_i mean_j
    return loss_b if per_sample else jnp.mean(loss_b)


# ----------------------------------------------------------------------------------------------
def cql_penalty(q_values, actions, alpha=1.0):
    """Discrete CQL(H) regulariser per sample: ``alpha * (logsumexp_a Q(s, a) - Q(s, a_data))``.

    Args:
      q_values: [..., A] float32/bfloat16 (e.g. [B, A], or [B, D, A] for D action branches).
      actions: [...] integer data actions in [0, A) (the leading shape of q_values). An action
        outside [0, A) (negative ones included) gives NaN for that sample (it cannot be checked when traced).
      alpha: the penalty weight, a Python float >= 0 or a float scalar array (range-checked when concrete).

    Returns:
      float32 [...] (no reduction). Always >= 0 (up to rounding); exactly 0 when A = 1 and Q is finite. The
      logsumexp is ``jax.nn.logsumexp`` in float32 (max-subtracted), so large Q values do not overflow; a
      +inf Q of another action gives +inf, a -inf Q(s, a_data) +inf, and Q(s, a_data) = +inf NaN (inf - inf; also
      when A = 1). Gradient w.r.t. Q: alpha (softmax(Q) - onehot(a_data)).

    Source: Kumar, Zhou, Tucker & Levine 2020, "Conservative Q-Learning for Offline RL", eq. (4),
    CQL(H) for discrete actions (as in the authors' QR-DQN/atari CQL code: ``logsumexp(q) - q_data``).
    OPS.md "Losses".

    Raises:
      TypeError: q_values not float32/bfloat16; actions not an integer array; alpha not a real scalar (a bool, a
        non-numeric value or array).
      ValueError: A = 0; actions' shape is not q_values.shape[:-1]; alpha an array of shape other than []; a
        concrete alpha < 0 or not finite.
    """
    _check_float_array("q_values", q_values, min_ndim=1)
    if q_values.shape[-1] < 1:
        raise ValueError(f"q_values must have A >= 1 actions (last axis), got shape {tuple(q_values.shape)}")
    if not hasattr(actions, "shape") or not hasattr(actions, "dtype") or not jnp.issubdtype(
            actions.dtype, jnp.integer):
        raise TypeError(f"actions must be an integer array, got "
                        f"{getattr(actions, 'dtype', type(actions).__name__)}")
    if tuple(actions.shape) != tuple(q_values.shape[:-1]):
        raise ValueError(f"actions must have shape q_values.shape[:-1] = {tuple(q_values.shape[:-1])}, "
                         f"got {tuple(actions.shape)}")
    _real_scalar("alpha", alpha, 0.0)
    q = q_values.astype(jnp.float32)
    # jax.nn.logsumexp: max-subtracted like a hand-written one, and a +inf Q gives lse = +inf (inf - inf gave NaN)
    lse = jax.nn.logsumexp(q, axis=-1)
    a = actions if jnp.iinfo(actions.dtype).bits >= 32 else actions.astype(jnp.int32)
    a = jnp.where((a >= 0) & (a < q.shape[-1]), a, q.shape[-1]).astype(jnp.int32)  # out of range (also < 0) -> fill
    q_data = jnp.take_along_axis(q, a[..., None], axis=-1, mode="fill", fill_value=jnp.nan)[..., 0]
    return jnp.asarray(alpha, jnp.float32) * (lse - q_data)
