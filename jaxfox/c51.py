"""Branching categorical (C51) double-Q loss with the BDQ dueling aggregation.

Distributional RL with a categorical return distribution on a fixed support (Bellemare, Dabney and
Munos 2017, "A Distributional Perspective on Reinforcement Learning", C51), action branching with
dueling aggregation (Tavakoli, Pardo and Kormushev 2018, "Action Branching Architectures for Deep
Reinforcement Learning", BDQ) and double-DQN action selection (van Hasselt, Guez and Silver 2016).
Axes: B batch, D action branches, A actions per branch, N atoms; z [N] the support.

    logits[b, d, a, i] = V[b, i] + A[b, d, a, i] - mean_a' A[b, d, a', i]         (BDQ eq. 1, per atom)
    q_online[b, d, a]  = sum_i z_i softmax(logits_t_online[b, d, a])_i
    a*[b, d]           = argmax_a q_online[b, d, a]                 (ties -> the first index)
    p[b, d]            = softmax(logits_t_target[b, d, a*[b, d]])                     [N]
    Tz_j               = clip(r_t[b] + discount_t[b] z_j, z_0, z_{N-1})
    m_i                = sum_j clip(1 - |Tz_j - z_i| / dz, 0, 1) p_j                  (C51 eq. 7)
    loss_d             = -sum_i m_i log_softmax(logits_tm1[b, d, a_tm1[b, d]])_i
    loss[b]            = mean_d loss_d

The projection is the clipped "hat kernel" form of dopamine's ``project_distribution``
(google/dopamine, ``dopamine/agents/rainbow/rainbow_agent.py``), equal in value to the L2
projection of rlax ``categorical_l2_project`` and to eq. 7 of the paper; unlike the floor/ceil
form of the paper's Algorithm 1 it loses no mass when Tz_j lands exactly on a support point. For a single
branch (D = 1) the loss equals rlax ``categorical_double_q_learning`` (google-deepmind/rlax,
``rlax/_src/value_learning.py``) with ``q_t_selector = q_online``. The target is per branch
("independent" targets in the BDQ paper). Everything is float32; bfloat16 logits are accepted and
upcast to float32 before any arithmetic.

On CUDA, ``ffi/c51.cu`` (target ``jaxfox_c51_loss``) computes the forward pass and the gradient
wrt logits_tm1 in one kernel (block per sample, a warp per branch; argmax, target softmax,
projection, log-softmax, cross-entropy and softmax - m); the backward pass only scales that saved
gradient by the cotangent / D. Branch losses are summed in order d = 0 .. D-1, then divided by D.
Elsewhere (and for B = 0, N > 1024 atoms, or D so large that the kernel's min(D, 4) * 2N + D floats of
shared memory exceed the device's limit) the pure-JAX reference below runs; it is the contract the kernel
matches to float32 rounding (near-exact argmax ties may resolve differently).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from jaxfox._ffi import (cuda_compute_capability, dispatch, ffi_call as _ffi_call, psum_to_match,
                         smem_per_block_limit)
from jaxfox._validate import is_concrete as _is_concrete

__all__ = ["branching_dueling_logits", "categorical_projection", "categorical_double_q_loss"]

_LOGIT_DTYPES = (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16))
_SUPPORT_RTOL = 1e-5     # spacing of the support must be uniform to this, relative to dz ...
_SUPPORT_ULPS = 4        # ... plus this many float32 epsilons (2^-23) times max|z| (rounding of a float32 linspace)


# ----------------------------------------------------------------------------------------------
# Validation helpers. Messages name the argument, the expected shape (with axis names) and the
# actual one.
def _require_array(name, x):
    if not hasattr(x, "shape") or not hasattr(x, "dtype"):
        raise TypeError(f"{name} must be an array, got {type(x).__name__}")


def _fmt_expected(axes, sizes):
    names = "[" + ", ".join(axes) + "]"
    if sizes is None or all(s is None for s in sizes):
        return names
    return names + " = [" + ", ".join("?" if s is None else str(s) for s in sizes) + "]"


def _check_shape(name, x, axes, sizes=None, origin=""):
    """x must have rank len(axes) and, where sizes[k] is not None, size sizes[k] on axis k."""
    sizes = sizes if sizes is not None else (None,) * len(axes)
    shape = tuple(x.shape)
    if len(shape) != len(axes) or any(w is not None and w != s for w, s in zip(sizes, shape)):
        raise ValueError(f"{name} must have shape {_fmt_expected(axes, sizes)}{origin}, got {shape}")


def _check_logit_dtype(name, x):
    if jnp.dtype(x.dtype) not in _LOGIT_DTYPES:
        raise TypeError(f"{name} must be float32 or bfloat16, got {x.dtype}")


def _check_float_dtype(name, x):
    if not jnp.issubdtype(x.dtype, jnp.floating):
        raise TypeError(f"{name} must have a floating dtype (it is used as float32), got {x.dtype}")


def _check_support(support, n_atoms=None, origin=""):
    """Validates support [N]; returns N. Value checks run on concrete (non-traced) supports only."""
    _require_array("support", support)
    _check_float_dtype("support", support)
    if len(support.shape) != 1:
        raise ValueError(f"support must have shape [N], got {tuple(support.shape)}")
    if n_atoms is not None and support.shape[0] != n_atoms:
        raise ValueError(f"support must have shape [N] = [{n_atoms}]{origin}, got {tuple(support.shape)}")
    N = support.shape[0]
    if N < 2:
        raise ValueError(f"support must have at least 2 atoms (N >= 2), got shape {tuple(support.shape)}")
    if _is_concrete(support):
        z = np.asarray(support, np.float64)
        if not np.all(np.isfinite(z)):
            raise ValueError("support must be finite; got NaN or Inf")
        with np.errstate(over="ignore"):
            z32 = z.astype(np.float32)
            span32 = z32[-1] - z32[0]
        if not (np.all(np.isfinite(z32)) and np.isfinite(span32)):  # the ops compute in float32
            raise ValueError(f"support must lie within float32's range with a finite float32 span support[-1] - "
                             f"support[0] (the ops compute in float32); got support[0] = {float(z[0])!r}, "
                             f"support[-1] = {float(z[-1])!r}")
        diffs = np.diff(z)
        if not np.all(diffs > 0):
            k = int(np.argmax(~(diffs > 0)))
            raise ValueError(f"support must be strictly increasing; support[{k + 1}] = {float(z[k + 1])!r} "
                             f"<= support[{k}] = {float(z[k])!r}")
        dz = (z[-1] - z[0]) / (N - 1)
        tol = _SUPPORT_RTOL * dz + _SUPPORT_ULPS * np.finfo(np.float32).eps * np.max(np.abs(z))
        dev = np.abs(diffs - dz)
        if np.max(dev) > tol:
            k = int(np.argmax(dev))
            raise ValueError(f"support must be uniformly spaced (dz = (support[-1] - support[0]) / (N - 1) = "
                             f"{float(dz)!r}, relative tolerance {_SUPPORT_RTOL}); support[{k + 1}] - support[{k}] "
                             f"= {float(diffs[k])!r}")
    return N


def _check_batch_vector(name, x, B, origin):
    _require_array(name, x)
    _check_float_dtype(name, x)
    _check_shape(name, x, ("B",), (B,), origin)


# ----------------------------------------------------------------------------------------------
# Pure-JAX reference (float32).
def _project(z, probs, r, discount):
    """Hat-kernel projection. z [N] f32; probs [..., N] f32; r, discount [...] f32 -> m [..., N] f32.

    Evaluated as clip(1 - |b_j - i|, 0, 1) with b_j = (Tz_j - z_0) / dz, which equals
    clip(1 - |Tz_j - z_i| / dz, 0, 1) on the uniform grid z_i = z_0 + i dz. Using the ideal grid
    (only z_0, z_{N-1} are read) keeps the weights of each j summing to 1 up to float32 rounding,
    even where the float32 support's spacing differs from dz by rounding. Sums of products rather
    than a matmul, so no TF32 on GPUs.
    """
    N = z.shape[0]
    vmin, vmax = z[0], z[-1]
    dz = (vmax - vmin) / (N - 1)
    tz = jnp.clip(r[..., None] + discount[..., None] * z, vmin, vmax)          # [..., N_j]
    b = jnp.clip((tz - vmin) / dz, 0.0, N - 1.0)                               # [..., N_j]
    i = jnp.arange(N, dtype=jnp.float32)
    w = jnp.clip(1.0 - jnp.abs(b[..., None, :] - i[:, None]), 0.0, 1.0)       # [..., N_i, N_j]
    return jnp.sum(w * probs[..., None, :], axis=-1)


def _loss_reference(logits_tm1, a_tm1, r_t, discount_t, logits_t_target, logits_t_online, support):
    f32 = jnp.float32
    sg = jax.lax.stop_gradient
    z = sg(support.astype(f32))
    online = sg(logits_t_online.astype(f32))                                   # [B, D, A, N]
    target = sg(logits_t_target.astype(f32))
    q_online = jnp.sum(jax.nn.softmax(online, axis=-1) * z, axis=-1)          # [B, D, A]
    a_star = jnp.argmax(q_online, axis=-1)                                     # [B, D], first on ties
    p = jax.nn.softmax(jnp.take_along_axis(target, a_star[:, :, None, None], axis=2)[:, :, 0], axis=-1)
    r = sg(r_t.astype(f32))[:, None]                                           # [B, 1]
    discount = sg(discount_t.astype(f32))[:, None]
    m = sg(_project(z, p, jnp.broadcast_to(r, p.shape[:-1]), jnp.broadcast_to(discount, p.shape[:-1])))
    chosen = jnp.take_along_axis(logits_tm1.astype(f32), a_tm1[:, :, None, None], axis=2)[:, :, 0]
    loss_d = -jnp.sum(m * jax.nn.log_softmax(chosen, axis=-1), axis=-1)       # [B, D]
    return jnp.mean(loss_d, axis=-1)


# ----------------------------------------------------------------------------------------------
# CUDA kernel path (jaxfox_c51_loss): forward and the saved gradient in one launch.
_KERNEL_MAX_ATOMS = 1024
_KERNEL_MAX_BRANCHES = 65536
_KERNEL_MAX_WARPS = 4     # ffi/c51.cu kMaxWarps


def _kernel_takes(B, D, N):
    """Whether ffi/c51.cu runs these sizes rather than returning InvalidArgument at run time: N <= 1024,
    D <= 65536, B < 2^31 and its dynamic shared memory, min(D, 4) * 2N + D floats (ffi/c51.cu Launch), within
    the opt-in limit per block of the device (9.0's when no CUDA device is visible, tracing for CUDA elsewhere)."""
    if N > _KERNEL_MAX_ATOMS or D > _KERNEL_MAX_BRANCHES or B >= 2**31:
        return False
    smem = 4 * (min(D, _KERNEL_MAX_WARPS) * 2 * N + D)
    return smem <= smem_per_block_limit(cuda_compute_capability())


def _c51_call(with_grad, logits_tm1, a_tm1, r_t, discount_t, logits_t_target, logits_t_online, support):
    B, D, A, N = logits_tm1.shape
    f32 = jnp.float32
    out = (jax.ShapeDtypeStruct((B,), f32),
           jax.ShapeDtypeStruct((B, D, A, N) if with_grad else (0,), f32))
    return _ffi_call("jaxfox_c51_loss", out, vmap_method="broadcast_all")(
        logits_tm1, a_tm1, r_t, discount_t, logits_t_target, logits_t_online, support)


@jax.custom_vjp
def _loss_kernel_f32(logits_tm1, a_tm1, r_t, discount_t, logits_t_target, logits_t_online, support):
    return _c51_call(False, logits_tm1, a_tm1, r_t, discount_t, logits_t_target, logits_t_online, support)[0]


def _loss_kernel_fwd(logits_tm1, a_tm1, r_t, discount_t, logits_t_target, logits_t_online, support):
    loss, delta = _c51_call(True, logits_tm1, a_tm1, r_t, discount_t, logits_t_target, logits_t_online, support)
    # a zero-size slice of logits_tm1: no memory, but it carries the input's type under shard_map
    return loss, (delta, logits_tm1.reshape(-1)[:0])


def _loss_kernel_bwd(res, g):
    delta, logits_like = res
    D = delta.shape[1]
    scale = (g.astype(jnp.float32) / D)[:, None, None, None]  # d mean_d / d loss_d = 1 / D
    (dlogits,) = psum_to_match((scale * delta,), (logits_like,))
    return (dlogits, None, None, None, None, None, None)  # targets are stop-gradient


_loss_kernel_f32.defvjp(_loss_kernel_fwd, _loss_kernel_bwd)


def _loss_kernel(logits_tm1, a_tm1, r_t, discount_t, logits_t_target, logits_t_online, support):
    f32 = jnp.float32
    sg = jax.lax.stop_gradient
    r, discount, z = sg(r_t.astype(f32)), sg(discount_t.astype(f32)), sg(support.astype(f32))
    loss = _loss_kernel_f32(logits_tm1.astype(f32), a_tm1.astype(jnp.int32), r, discount,
                            sg(logits_t_target.astype(f32)), sg(logits_t_online.astype(f32)), z)
    # The kernel clamps r + discount z with fmaxf/fminf, which map NaN to v_min (a finite loss); the reference's
    # projection propagates it. Where r + discount z_j is NaN for some j (a NaN reward or discount, or inf * 0,
    # inf - inf with an infinite discount), that sample's loss and gradient are NaN here too.
    nan_tz = jnp.any(jnp.isnan(r[..., None] + discount[..., None] * z), axis=-1)
    return loss * jnp.where(nan_tz, jnp.nan, 1.0).astype(f32)


def _loss_dispatch(logits_tm1, a_tm1, r_t, discount_t, logits_t_target, logits_t_online, support):
    B, D, A, N = logits_tm1.shape
    args = (logits_tm1, a_tm1, r_t, discount_t, logits_t_target, logits_t_online, support)
    if B == 0 or not _kernel_takes(B, D, N):
        return _loss_reference(*args)
    return dispatch(_loss_kernel, _loss_reference, *args, batch=(True,) * 6 + (False,))


# ----------------------------------------------------------------------------------------------
# Public API.
def branching_dueling_logits(value, advantages):
    """BDQ dueling aggregation per atom: logits = V + A - mean_a A.

    logits[b, d, a, i] = value[b, i] + advantages[b, d, a, i] - mean_a' advantages[b, d, a', i]
    (Tavakoli et al. 2018, eq. 1 with the mean aggregation, applied to each atom's logit as in the
    branching C51 formulation; OPS.md "Branching C51").

    Args:
      value: [B, N] float32 or bfloat16, the state-value logits (shared by all branches).
      advantages: [B, D, A, N] float32 or bfloat16, the per-branch advantage logits.

    Returns:
      logits [B, D, A, N] float32 (computed in float32 whatever the input dtypes).
      Differentiable in both arguments.

    Raises:
      TypeError: an argument is not an array or not float32/bfloat16.
      ValueError: a rank or size does not match (the message names the argument, the expected
        and the actual shape).
    """
    _require_array("advantages", advantages)
    _check_logit_dtype("advantages", advantages)
    _check_shape("advantages", advantages, ("B", "D", "A", "N"))
    B, D, A, N = advantages.shape
    if A < 1:
        raise ValueError(f"advantages must have A >= 1 actions, got shape {(B, D, A, N)}")
    _require_array("value", value)
    _check_logit_dtype("value", value)
    _check_shape("value", value, ("B", "N"), (B, N), " (B, N from advantages)")
    adv = advantages.astype(jnp.float32)
    v = value.astype(jnp.float32)
    return v[:, None, None, :] + adv - jnp.mean(adv, axis=2, keepdims=True)


def categorical_projection(support, probs, r, discount):
    """Projects the distribution of r + discount * Z onto the support (C51 eq. 7, hat-kernel form).

    m[b, i] = sum_j clip(1 - |Tz[b, j] - z_i| / dz, 0, 1) probs[b, j],
    Tz[b, j] = clip(r[b] + discount[b] z_j, z_0, z_{N-1}), dz = (z_{N-1} - z_0) / (N - 1).
    As dopamine ``project_distribution`` (no floor/ceil: an atom landing exactly on a support point
    keeps its mass; atoms beyond [z_0, z_{N-1}] go to the end atoms). When probs sums to 1, m sums
    to 1 up to float32 rounding and m >= 0. Non-finite values: r = +-inf with a finite discount puts the
    mass on the end atom (Tz is clipped); where r[b] + discount[b] z_j is NaN for some j (a NaN r or
    discount, or inf * 0 from an infinite discount), row m[b] is all NaN (the clip propagates NaN;
    nothing is checked or raised).

    Args:
      support: z [N] floating (used as float32; the return's units), strictly increasing and uniformly
        spaced (|z_{k+1} - z_k - dz| <= 1e-5 dz + 4 * 2^-23 * max|z|), N >= 2, so v_min = z_0 < v_max =
        z_{N-1}. Values are checked only when the array is concrete (not traced under jit/vmap); a traced
        support is used as given.
      probs: [B, N] float32 or bfloat16, probabilities over the atoms z_j.
      r: [B] floating, rewards (the units of z).  discount: [B] floating, gamma * (1 - done) (0 at
        terminal transitions: all mass goes to the one or two atoms nearest clip(r)).

    Returns:
      m [B, N] float32. Differentiable in probs, r and discount (piecewise linear in r, discount).

    Raises:
      TypeError: an argument is not an array or has a wrong dtype.
      ValueError: wrong rank or size (the message names the argument, expected and actual shape),
        or a concrete support that is not finite, strictly increasing and uniform.
    """
    _require_array("probs", probs)
    _check_logit_dtype("probs", probs)
    _check_shape("probs", probs, ("B", "N"))
    B, N = probs.shape
    _check_support(support, N, " (N from probs)")
    _check_batch_vector("r", r, B, " (B from probs)")
    _check_batch_vector("discount", discount, B, " (B from probs)")
    f32 = jnp.float32
    return _project(support.astype(f32), probs.astype(f32), r.astype(f32), discount.astype(f32))


def categorical_double_q_loss(logits_tm1, a_tm1, r_t, discount_t, logits_t_target, logits_t_online, support):
    """Per-sample branching C51 double-Q loss (cross-entropy to the projected target).

    For each sample b and branch d (module docstring for the full equations):
    a*_d = argmax_a sum_i z_i softmax(logits_t_online[b, d, a])_i (ties -> the first index, as
    ``jnp.argmax``), p = softmax(logits_t_target[b, d, a*_d]), m = the hat-kernel projection of
    r_t[b] + discount_t[b] z under p (:func:`categorical_projection`), and
    loss_d = -sum_i m_i log_softmax(logits_tm1[b, d, a_tm1[b, d]])_i; loss[b] = mean_d loss_d.
    Sources: Bellemare et al. 2017 eq. 7; dopamine ``project_distribution``; rlax
    ``categorical_double_q_learning`` (equal for D = 1); Tavakoli et al. 2018 (per-branch targets).

    Args:
      logits_tm1: [B, D, A, N] float32 or bfloat16, online logits at s_{t-1} (gradients flow here).
      a_tm1: [B, D] integer dtype, the action taken in each branch, in [0, A). Concrete arrays are
        checked (ValueError; a host read of a device array); traced ones (under jit/vmap) cannot
        raise and are clipped into [0, A) with ``jnp.clip``.
      r_t: [B] floating, reward (the units of z).  discount_t: [B] floating, gamma * (1 - done) (0 at
        terminal transitions). Where r_t[b] + discount_t[b] z_j is NaN for some j (a NaN reward or
        discount, or inf * 0 from an infinite discount), loss[b] and its gradient are NaN, on every
        path (nothing is checked or raised); r_t = +-inf with a finite discount puts the target mass
        on the end atom.
      logits_t_target: [B, D, A, N] float32 or bfloat16, target-network logits at s_t.
      logits_t_online: [B, D, A, N] float32 or bfloat16, online-network logits at s_t (action
        selection only).
      support: z [N] floating, strictly increasing and uniformly spaced (as in
        :func:`categorical_projection`), N >= 2; values checked when concrete.

    Returns:
      loss [B] float32 (nats), for the optimiser (take the mean) and as PER priorities.
      All arithmetic is float32 (bfloat16 logits are upcast first). Gradients flow only into
      ``logits_tm1``: the target distribution m (including the online argmax path, r_t,
      discount_t and support) is under ``stop_gradient``. d loss[b] / d logits_tm1[b, d, a_tm1] =
      (sum_i m_i softmax(.) - m) / D, which is (softmax - m) / D as m sums to 1.
      On CUDA (the fused kernel, the default there) only reverse mode of order 1: ``jax.jvp`` /
      ``jax.jacfwd`` raise "can't apply forward-mode autodiff (jvp) to a custom_vjp function" and
      ``jax.hessian`` "The FFI call to `jaxfox_c51_loss` cannot be differentiated"; elsewhere, or traced
      inside :func:`jaxfox.use_reference`, every JAX derivative of the reference works.

    Raises:
      TypeError: an argument is not an array or has a wrong dtype (a_tm1 must be integer).
      ValueError: a rank or size does not match (the message names the argument, expected and
        actual shape), an out-of-range concrete a_tm1, or a concrete support that is not finite,
        strictly increasing and uniform.
    """
    _require_array("logits_tm1", logits_tm1)
    _check_logit_dtype("logits_tm1", logits_tm1)
    _check_shape("logits_tm1", logits_tm1, ("B", "D", "A", "N"))
    B, D, A, N = logits_tm1.shape
    if D < 1 or A < 1:
        raise ValueError(f"logits_tm1 must have D >= 1 branches and A >= 1 actions, got shape {(B, D, A, N)}")
    origin = " (from logits_tm1)"
    for name, x in (("logits_t_target", logits_t_target), ("logits_t_online", logits_t_online)):
        _require_array(name, x)
        _check_logit_dtype(name, x)
        _check_shape(name, x, ("B", "D", "A", "N"), (B, D, A, N), origin)
    _require_array("a_tm1", a_tm1)
    if not jnp.issubdtype(a_tm1.dtype, jnp.integer):
        raise TypeError(f"a_tm1 must have an integer dtype (int32), got {a_tm1.dtype}")
    _check_shape("a_tm1", a_tm1, ("B", "D"), (B, D), origin)
    _check_batch_vector("r_t", r_t, B, origin)
    _check_batch_vector("discount_t", discount_t, B, origin)
    _check_support(support, N, " (N from logits_tm1)")
    if _is_concrete(a_tm1):
        a = np.asarray(a_tm1)
        bad = (a < 0) | (a >= A)
        if bad.any():
            b, d = (int(k) for k in np.argwhere(bad)[0])
            raise ValueError(f"a_tm1 must be in [0, A) = [0, {A}); got a_tm1[{b}, {d}] = {a[b, d]} "
                             f"({int(bad.sum())} out of range)")
    if jnp.iinfo(a_tm1.dtype).bits < 32:
        a_tm1 = a_tm1.astype(jnp.int32)  # so that A - 1 fits the dtype of the clip
    a_tm1 = jnp.clip(a_tm1, 0, A - 1).astype(jnp.int32)  # clip before a narrowing cast
    return _loss_dispatch(logits_tm1, a_tm1, r_t, discount_t, logits_t_target, logits_t_online, support)
