"""The IQL value loss of an ensemble of value networks, with its gradient fused on CUDA.

Implicit Q-Learning (Kostrikov, Nair & Levine 2021) fits a state-value network V to an expectile tau of the
target values (eq. 5): L_V = E_b[L_2^tau(y_b - V(s_b))] with L_2^tau(u) = |tau - 1{u < 0}| u^2. jaxfox's auxiliary
trainers fit G such networks, one per expectile (0.7 and 0.9), on the same states. For G networks
D -> H -> 1 with a ReLU hidden layer (``jaxfox.models.aux.iql_init(key, D, hidden=(H,), num_networks=G)``)::

    V_g(s)  = ReLU(s W1_g + b1_g) . w2_g + b2_g
    loss_g  = (1 / B) sum_b |tau_g - 1{u < 0}| u^2,   u = target_b - V_g(obs_b)

On CUDA (``ffi/iql.cu``) one kernel computes every loss AND its gradient with respect to the networks'
parameters: per 32-row tile of obs it runs the first layer on the tensor cores, the value, the loss and
dv = d loss_g / d V_g in an epilogue, and accumulates dW1_g = obs^T dh in registers, so no [B, H] activation
goes to global memory and obs is read once per network (XLA's batched GEMMs write and re-read the hidden
activations several times between the forward and the backward). The per-block gradient partials are summed
by :func:`jaxfox.reduce_axis0`'s kernel in a fixed order (no atomics: bitwise reproducible). The gradient is
computed in the forward call and kept as the ``custom_vjp`` residual, so the backward is a scaling by the
cotangent of each loss; a forward alone (no ``jax.grad``) still pays for it.

Precision: float32 inputs; the two products (obs W1 and obs^T dh) in TF32 (10-bit mantissa, operands rounded
to nearest) with float32 accumulation, as XLA's float32 GEMMs on the GPU at
the default precision, which the reference path uses; everything else in float32.

The kernel is opt-in (``JAXFOX_OPT_IN_KERNELS=iql``, read when a function is traced): on the H200 it is not yet
faster than XLA at the benchmark shape (BENCHMARKS.md, 2026-12-03 fourteenth session), so by default every
device runs the reference. It covers D (obs_dim) in {64, 128, 256}, H in {64, 128}, any G and B >= 1 on GPUs whose shared memory
per block holds its layout (about 221 KiB at D = 256, H = 128: compute capability 9.0 and 10.x; 8.0 fits the
smaller shapes). Other shapes and devices run the reference, which is the same math in pure JAX (``jax.vmap``
over the stacked networks: batched GEMMs). The op is for one device: it does not split the batch over a mesh.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from jaxfox._ffi import (cuda_compute_capability, dispatch, ffi_call as _ffi_call, kernel_opted_in, psum_to_match,
                         smem_per_block_limit)
from jaxfox._validate import check_array
from jaxfox.reduce import reduce_chunks

__all__ = ["iql_value_loss"]

_KERNEL_D = (64, 128, 256)   # obs_dim values with a kernel instantiation (ffi/iql.cu ByShape)
_KERNEL_H = (64, 128)        # hidden sizes with a kernel instantiation
_TILE_ROWS = 32              # ffi/iql.cu kRows
_GRID_CTAS = 132             # blocks aimed at (the H200's SM count, fixed so that the gradients' summation
                             # order is a function of the shapes only, not of the device)


class _Config(NamedTuple):
    taus: tuple[float, ...]


def _check_params(params):
    msg = ('params must be {"w": [w1 [G, D, H], w2 [G, H, 1]], "b": [b1 [G, H], b2 [G, 1]]} '
           "(jaxfox.models.aux.iql_init with one hidden layer)")
    if not isinstance(params, dict) or set(params) != {"w", "b"}:
        got = sorted(params) if isinstance(params, dict) else type(params).__name__
        raise ValueError(f"{msg}, got {got}")
    ws, bs = params["w"], params["b"]
    if not isinstance(ws, (list, tuple)) or not isinstance(bs, (list, tuple)) or len(ws) != 2 or len(bs) != 2:
        n = lambda v: f" of {len(v)} entries" if isinstance(v, (list, tuple)) else ""  # noqa: E731
        raise ValueError(f"{msg}: two layers, got w a {type(ws).__name__}{n(ws)} and b a {type(bs).__name__}{n(bs)}")
    w1 = ws[0]
    check_array("params['w'][0]", w1, (None, None, None))
    G, D, H = w1.shape
    if min(G, D, H) < 1:
        raise ValueError(f"params['w'][0] must have G, D, H >= 1, got shape {tuple(w1.shape)}")
    check_array("params['w'][1]", ws[1], (G, H, 1))
    check_array("params['b'][0]", bs[0], (G, H))
    check_array("params['b'][1]", bs[1], (G, 1))
    return G, D, H


def _check_expectiles(expectiles, G):
    vals = (expectiles,) * G if isinstance(expectiles, (int, float, np.floating)) else expectiles
    if isinstance(vals, (jax.Array, np.ndarray)) or not isinstance(vals, (list, tuple)):
        raise TypeError("expectiles must be a Python float or a sequence of G Python floats (static, one per "
                        f"network), got {type(expectiles).__name__}")
    if len(vals) != G:
        raise ValueError(f"expectiles must have one value per network (G = {G}), got {len(vals)}")
    out = []
    for t in vals:
        if isinstance(t, bool) or not isinstance(t, (int, float, np.floating)) or not 0.0 < float(t) < 1.0:
            raise ValueError(f"expectiles must be floats in (0, 1), got {expectiles!r}")
        out.append(float(t))
    return tuple(out)


def _values(params, obs):
    """V_g(obs) [G, B]: the networks vmapped over their stacked weights (batched GEMMs)."""
    def one(w1, b1, w2, b2):
        return (jnp.dot(jax.nn.relu(jnp.dot(obs, w1) + b1), w2) + b2)[:, 0]

    return jax.vmap(one)(params["w"][0], params["b"][0], params["w"][1], params["b"][1])


def _reference(taus, params, obs, target):
    u = target[None, :] - _values(params, obs)                                  # [G, B]
    w = jnp.abs(jnp.asarray(taus, jnp.float32)[:, None] - (u < 0).astype(jnp.float32))
    return jnp.mean(w * u * u, axis=1)


# ----------------------------------------------------------------------------------------------
# Kernel path: one FFI call returns, per network, the reduced row [dW1 (D H) | db1 (H) | dw2 (H) | db2 | loss | 0 0]
# and dy [G, B] = d loss_g / d target_b.
def _splits(B, G):
    return min(-(-B // _TILE_ROWS), max(1, _GRID_CTAS // G))


def _call(cfg, w1, b1, w2, b2, obs, target):
    G, D, H = w1.shape
    B = obs.shape[0]
    P = D * H + 2 * H + 4    # ffi/iql.cu Layout::kP (two floats of padding)
    S = _splits(B, G)
    chunks = reduce_chunks(S, G * P)
    f32 = jnp.float32
    out = (jax.ShapeDtypeStruct((G, P), f32),                                  # grads (reduced partial rows)
           jax.ShapeDtypeStruct((G, B), f32),                                  # dy
           jax.ShapeDtypeStruct((S, G, P), f32),                               # workspace: per-block partials
           jax.ShapeDtypeStruct((chunks * G * P if chunks > 1 else 0,), f32))  # workspace: chunk partials
    rows, dy, *_ = _ffi_call("jaxfox_iql_value_loss", out, vmap_method="sequential")(
        obs, target, w1, b1, w2.reshape(G, H), b2.reshape(G), jnp.asarray(cfg.taus, f32),
        inv_batch=np.float32(1.0 / B), chunks=np.int64(chunks))
    return rows[:, D * H + 2 * H + 1], rows, dy


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _loss_kernel(cfg, w1, b1, w2, b2, obs, target):
    return _call(cfg, w1, b1, w2, b2, obs, target)[0]


def _loss_kernel_fwd(cfg, w1, b1, w2, b2, obs, target):
    # symbolic_zeros: the primals arrive as CustomVJPPrimal (value, perturbed); d obs (on the XLA path) and
    # d target are formed only for the inputs being differentiated.
    loss, rows, dy = _call(cfg, w1.value, b1.value, w2.value, b2.value, obs.value, target.value)
    res = (rows, dy, w1.value, b1.value, w2.value, b2.value, obs.value, target.value,
           bool(obs.perturbed), bool(target.perturbed))
    return loss, res


def _loss_kernel_bwd(cfg, res, gl):
    rows, dy, w1, b1, w2, b2, obs, target, want_obs, want_target = res
    if isinstance(gl, jax.custom_derivatives.SymbolicZero):
        return (None,) * 6
    G, D, H = w1.shape
    s = gl[:, None] * rows                                         # d (sum_g gl_g loss_g) / d params_g
    dw1 = s[:, :D * H].reshape(G, D, H)
    db1 = s[:, D * H:D * H + H]
    dw2 = s[:, D * H + H:D * H + 2 * H].reshape(G, H, 1)
    db2 = s[:, D * H + 2 * H:D * H + 2 * H + 1]
    dtarget = jnp.sum(gl[:, None] * dy, axis=0) if want_target else None
    dobs = None
    if want_obs:  # dh recomputed from the pre-activations on the XLA path (the kernel has no d obs)
        pre = jnp.einsum("bd,gdh->gbh", obs, w1) + b1[:, None, :]
        dh = jnp.where(pre > 0, (-gl[:, None] * dy)[..., None] * w2[:, None, :, 0], 0.0)
        dobs = jnp.einsum("gbh,gdh->bd", dh, w1)
    return psum_to_match((dw1, db1, dw2, db2, dobs, dtarget), (w1, b1, w2, b2, obs, target))


_loss_kernel.defvjp(_loss_kernel_fwd, _loss_kernel_bwd, symbolic_zeros=True)


def _smem_bytes(D, H):
    """Dynamic shared memory of a kernel instantiation (ffi/iql.cu Layout<D, H>::kTotal floats)."""
    return 4 * (D * (H + 8) + 2 * _TILE_ROWS * (D + 4) + _TILE_ROWS * (H + 8) + 2 * H + 5 * _TILE_ROWS + 2 * H)


def _kernel_supported(G, D, H, B):
    if not (D in _KERNEL_D and H in _KERNEL_H and 1 <= B < 2**31 - _TILE_ROWS and G <= 65535):
        return False
    cc = cuda_compute_capability()  # None when no CUDA device is visible (tracing for CUDA elsewhere)
    if cc is None:
        return True
    return cc >= (8, 0) and _smem_bytes(D, H) <= smem_per_block_limit(cc)


def iql_value_loss(params, obs, target, expectiles):
    """Expectile value losses of G value networks on one batch: ``loss_g = mean_b |tau_g - 1{u < 0}| u^2``.

    Args:
      params: ``{"w": [w1 [G, D, H], w2 [G, H, 1]], "b": [b1 [G, H], b2 [G, 1]]}`` float32, the stacked
        weights ([in, out]) of G networks D -> H -> 1 with a ReLU hidden layer, as
        ``jaxfox.models.aux.iql_init(key, D, hidden=(H,), num_networks=G)`` returns them.
      obs: [B, D] float32, the states (shared by the G networks).
      target: [B] float32, the regression targets y (in IQL the target network's min over its Q heads at the
        data action, Q(s, a)); u = target - V_g(obs).
      expectiles: tau, a Python float in (0, 1) for every network, or a sequence of G of them (static: they
        are compiled into the call).

    Returns:
      loss [G] float32: each network's loss, the mean over the B rows (the mean of
      ``jaxfox.expectile_loss(target[:, None] - V, expectiles)`` over the batch, per network).

    Differentiable (reverse mode) in params, obs and target. On the kernel path the parameter gradient comes
    from the fused kernel, d target from its per-row dv, and d obs (rarely wanted: obs is data) from XLA,
    recomputing the hidden pre-activations; forward mode and higher derivatives only off the kernel path.
    The kernel's products are TF32, as XLA's at the default precision (module docstring).

    Source: Kostrikov, Nair & Levine 2021, "Offline Reinforcement Learning with Implicit Q-Learning", eq. (5)
    and ikostrikov/implicit_q_learning's ``expectile_loss`` (mean over the batch); OPS.md "Losses".

    Raises:
      TypeError: a parameter, obs or target is not a float32 array; expectiles is an array (it must be static).
      ValueError: params is not of the form above, a shape does not match (the message names the argument, the
        expected and the actual shape), expectiles has not G entries or one is outside (0, 1), or B = 0.
    """
    G, D, H = _check_params(params)
    check_array("obs", obs, (None, D))
    B = obs.shape[0]
    check_array("target", target, (B,))
    taus = _check_expectiles(expectiles, G)
    if B == 0:
        raise ValueError("obs must have at least one row (the loss is a mean over the batch), got B = 0")
    reference = functools.partial(_reference, taus)
    if not kernel_opted_in("iql") or not _kernel_supported(G, D, H, B):
        return reference(params, obs, target)

    def kernel(params, obs, target):
        (w1, w2), (b1, b2) = params["w"], params["b"]
        return _loss_kernel(_Config(taus), w1, b1, w2, b2, obs, target)

    return dispatch(kernel, reference, params, obs, target)
