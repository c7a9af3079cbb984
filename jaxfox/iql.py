"""The IQL value loss of an ensemble of value networks, with its gradient fused on CUDA.

Implicit Q-Learning (Kostrikov, Nair & Levine 2021) fits a state-value network V to an expectile tau of the
target values (eq. 5): L_V = E_b[L_2^tau(y_b - V(s_b))] with L_2^tau(u) = |tau - 1{u < 0}| u^2. jaxfox's auxiliary
trainers fit G such networks, one per expectile (0.7 and 0.9), on the same states. For G networks
D -> H -> 1 with a ReLU hidden layer (``jaxfox.models.aux.iql_init(key, D, hidden=(H,), num_networks=G)``)::

    V_g(s)  = ReLU(s W1_g + b1_g) . w2_g + b2_g
    loss_g  = (1 / B) sum_b |tau_g - 1{u < 0}| u^2,   u = target_b - V_g(obs_b)

On CUDA the first layer's product of all G networks is ONE XLA GEMM, pre = obs [W1_1 | .. | W1_G] [B, G H],
and one kernel (``ffi/iql.cu``, FFI target ``jaxfox_iql_head``) does everything after it in a single pass over
pre: the bias, ReLU, the value, the residual, the expectile weight and loss, dv = d loss_g / d V_g, the gradient
of the pre-activations dpre [B, G H] and the column sums for db1, dw2 and db2 (per-block partial rows, summed by a
second kernel of the same call in a fixed order: no atomics, bitwise reproducible). The weight gradient
dW1 = obs^T dpre (and d obs = dpre W1^T, when wanted) is XLA's GEMM again, by autodiff of the first product.
The kernel computes the gradient in the forward call and keeps it as the ``custom_vjp`` residual, so the
backward is a scaling by the cotangent of each loss; a forward alone (no ``jax.grad``) still pays for it.

On compute capability 9.0 (H100, H200) with H = 128 or 256, D a multiple of 4 and B >= 4096 rows (any B with
``JAXFOX_OPT_IN_KERNELS=iql``), one kernel does the first product too (FFI target ``jaxfox_iql_fused``): it runs obs
W1_g on the tensor cores (wgmma, TF32) for a tile of 128 rows and applies the head to the products in registers, so
pre [B, G H] is never written nor read back; its results and the backward are the head path's (it writes dpre
transposed, [G H, B], which XLA's products of the backward read as they are). (Its machine code is sm_90a: builds
for other architectures do not register the target, and then the head path runs.)

Precision: float32 inputs; the two products are XLA's float32 GEMMs (TF32 on the GPU at the default matmul
precision, as on the reference path), except the fused kernel's first product: TF32, its inputs truncated to
TF32 by the tensor cores, float32 accumulation (under ``jax.default_matmul_precision("highest")`` the head path
runs, with XLA's float32 product); everything else in the kernels is float32.

The kernel path runs by default for hidden widths H >= 128 (chosen when a function is traced); for smaller H it is
opt-in (``JAXFOX_OPT_IN_KERNELS=iql``). On an H100 (``python -m jaxfox.bench --ops iql_pair``, B = 16384, 2 x (256
-> 128 -> 1); BENCHMARKS.md, forty-fifth session) the fused path takes 55.16 us a step against XLA's 67.65 us
(1.23x), and the head path 61.06 us (1.10x) in the same command; the fused kernel is 19.0 us of it, XLA's
weight-gradient GEMM 17.3 us. With dpre written transposed (forty-seventh session, one H100): 54.70 and 55.09 us
(1.19x, 1.17x) against 57.07 and 56.77 us (1.15x, 1.13x) for dpre [B, G H], the fused kernel 17.7-17.9 us. With two
networks a CTA at H = 128 and G even (forty-eighth session, one H100, same build): 50.00 and 50.01 us (1.31x, 1.32x)
against 52.61 and 53.13 us (1.24x, 1.23x) for one network a CTA; 52.07 us (1.26x) in the forty-ninth session. Below
4096 rows the head path runs by default (B = 2048: 27.65 us against the fused path's 30.06 us and XLA's 27.93 us),
and two networks share a CTA only where that gives at least 96 CTAs (B = 8192, G = 2: one network a CTA 38.32 us,
two 40.09 us; B = 12288: 50.06 and 44.82 us; B = 65536: 177.03 and 143.78 us, 1.50x XLA); forty-ninth session, one
H100. ``JAXFOX_OPT_IN_KERNELS=iql`` takes the fused path at any B. The head path, at D = 256 with other shapes
(thirty-sixth session), is 1.03x, 1.06x, 1.03x and 1.10x XLA at H = 128 and B = 1024, 4096, 8192 and 16384. At H <
128 a warp's lanes are partly idle (H / 4 of 32 hold columns), and it was 0.95-0.97x at H = 64, 1.13x at H = 32, and
0.88x at B = 256, D = 32, H = 16. It covers any D, H a multiple of 4 up to 512, G <= 65535 networks and 1 <= B <
2^31 - 32 rows on compute capability 8.0 and newer; other shapes and devices run the reference, which is the same
math in pure JAX (``jax.vmap`` over the stacked networks: batched GEMMs). The kernel path is for one device:
arguments split over Explicit mesh axes (``jax.make_mesh``) run the reference, which XLA partitions; inside
``jax.shard_map`` each device computes the losses of its own rows, and the gradients of parameters replicated over
the mesh axes are summed over them. """

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from jaxfox._ffi import (cuda_compute_capability, dispatch, explicitly_split, ffi_call as _ffi_call, has_target,
                         kernel_opted_in, psum_to_match)
from jaxfox._validate import check_array, in_open_unit_float32
from jaxfox.gemm import _precision_is_highest

__all__ = ["iql_value_loss"]

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
        if isinstance(t, bool) or not isinstance(t, (int, float, np.floating)) or not in_open_unit_float32(t):
            raise ValueError(f"expectiles must be floats in (0, 1), also when rounded to float32 (and not subnormal "
                             f"there), got {expectiles!r}")
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
# Kernel path: XLA's GEMMs for pre = obs [W1_1 | .. | W1_G] and, by autodiff, dW1 = obs^T dpre (and d obs); one
# FFI call (ffi/iql.cu jaxfox_iql_head: the head kernel and the fixed-order sum of its per-block rows) for
# everything between them, returning db1 [G, H], dw2 [G, H], db2 [G], loss [G], dpre [B, G H] and dy [G, B].
_HEAD_TILE = 32              # ffi/iql.cu kHeadTile
_DEFAULT_MIN_H = 128         # the kernel path by default from this hidden width on; below it, opt-in
_HEAD_CTAS = 264             # blocks aimed at: 2 an SM of a 132-SM H100 / H200, one wave (the bench on an H100:
                             # 62.98 us a step, 64.58 with 528 = 1.33 waves at 3 an SM, 66.65 with 132; BENCHMARKS.md,
                             # thirty-sixth session); fixed: the summation order is a function of the shapes only


def _head_splits(B, G):
    return min(-(-B // _HEAD_TILE), max(1, _HEAD_CTAS // G))


def _results(B, G, H, S, dpre_transposed=False):
    """The results of both FFI targets (jaxfox_iql_head, jaxfox_iql_fused: dpre transposed), all float32."""
    f32 = jnp.float32
    return (jax.ShapeDtypeStruct((G, H), f32),                                  # db1
            jax.ShapeDtypeStruct((G, H), f32),                                  # dw2
            jax.ShapeDtypeStruct((G,), f32),                                    # db2
            jax.ShapeDtypeStruct((G,), f32),                                    # loss
            jax.ShapeDtypeStruct((G * H, B) if dpre_transposed else (B, G * H), f32),  # dpre (or dpre^T)
            jax.ShapeDtypeStruct((G, B), f32),                                  # dy
            jax.ShapeDtypeStruct((S, G, 2 * H + 4), f32))                       # workspace: S partial rows a network


def _head_call(cfg, pre, b1, w2, b2, target):
    B = pre.shape[0]
    G = b1.shape[0]
    *res, _ = _ffi_call("jaxfox_iql_head", _results(B, *b1.shape, _head_splits(B, G)), vmap_method="sequential")(
        pre, target, b1, w2, b2, jnp.asarray(cfg.taus, jnp.float32), inv_batch=np.float32(1.0 / B))
    return tuple(res)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _head(cfg, pre, b1, w2, b2, target):
    return _head_fwd(cfg, pre, b1, w2, b2, target)[0]


def _head_fwd(cfg, pre, b1, w2, b2, target):
    db1, dw2, db2, loss, dpre, dy = _head_call(cfg, pre, b1, w2, b2, target)
    return loss, (db1, dw2, db2, dpre, dy, (pre, b1, w2, b2, target))


def _scaled_head_grads(gl, db1, dw2, db2, dy):
    """The kernels' gradients of b1, w2, b2 and target scaled by each network's loss cotangent gl [G] (both paths)."""
    return gl[:, None] * db1, gl[:, None] * dw2, gl * db2, jnp.sum(gl[:, None] * dy, axis=0)


def _head_bwd(cfg, res, gl):
    db1, dw2, db2, dpre, dy, primals = res
    H = db1.shape[1]
    cts = (dpre * jnp.repeat(gl, H)[None, :], *_scaled_head_grads(gl, db1, dw2, db2, dy))
    return psum_to_match(cts, primals)  # inside shard_map: the replicated params' per-device partials summed


_head.defvjp(_head_fwd, _head_bwd)


# The fused path (compute capability 9.0, H = 128 or 256): one FFI call (ffi/iql.cu jaxfox_iql_fused) runs the first
# product on the tensor cores (wgmma) with the head in its epilogue, so pre never reaches device memory; its results
# are jaxfox_iql_head's, except dpre, which it writes transposed (dpre^T [G H, B]: a faster store, BENCHMARKS.md,
# forty-seventh session). The backward is XLA's products of dpre^T.
_FUSED_TARGET = "jaxfox_iql_fused"
_FUSED_ROWS = 128            # ffi/iql.cu kFusedRows: rows of a CTA's tile (one partial row per tile and network)
_FUSED_MIN_B = 4096          # the fused path by default from this batch on, the head path below (_fused_chosen; the
                             # numbers: module docstring, BENCHMARKS.md forty-ninth session)


def _fused_supported(G, D, H, B):
    """ffi/iql.cu IqlFusedImpl's limits: H = 128 or 256, D a multiple of 4, G <= 65535, B <= 2^31 - 129, on a
    compute capability 9.0 device with an extension built with sm_90a machine code (its kernel uses wgmma); and
    the default matmul precision not float32 (its product is TF32: under ``jax.default_matmul_precision("highest")``
    the head path runs, whose product is XLA's at that precision)."""
    return (H in (128, 256) and D % 4 == 0 and G <= 65535 and 1 <= B <= 2**31 - 129
            and cuda_compute_capability() == (9, 0) and has_target(_FUSED_TARGET)
            and not _precision_is_highest(None))


def _fused_chosen(G, D, H, B):
    """Whether the kernel path takes the fused kernel: where it is supported, from B = _FUSED_MIN_B rows on, or at
    any B with ``JAXFOX_OPT_IN_KERNELS=iql``; otherwise the head path. B is the rows of one call: inside
    ``jax.shard_map`` a device's own rows. The threshold was measured at G = 2, D = 256, H = 128 only."""
    return _fused_supported(G, D, H, B) and (B >= _FUSED_MIN_B or kernel_opted_in("iql"))


def _fused_call(cfg, obs, w1t, b1, w2, b2, target):
    B = obs.shape[0]
    results = _results(B, *b1.shape, -(-B // _FUSED_ROWS), dpre_transposed=True)
    *res, _ = _ffi_call(_FUSED_TARGET, results, vmap_method="sequential")(
        obs, w1t, target, b1, w2, b2, jnp.asarray(cfg.taus, jnp.float32), inv_batch=np.float32(1.0 / B))
    return tuple(res)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _fused(cfg, obs, w1t, b1, w2, b2, target):
    return _fused_fwd(cfg, obs, w1t, b1, w2, b2, target)[0]


def _fused_fwd(cfg, obs, w1t, b1, w2, b2, target):
    db1, dw2, db2, loss, dpre, dy = _fused_call(cfg, obs, w1t, b1, w2, b2, target)
    return loss, (db1, dw2, db2, dpre, dy, (obs, w1t, b1, w2, b2, target))


def _fused_bwd(cfg, res, gl):
    db1, dw2, db2, dpret, dy, primals = res
    obs, w1t = primals[0], primals[1]
    gcol = jnp.repeat(gl, db1.shape[1])  # [G H]: each network's loss cotangent on its columns
    # the cotangent scales the small products, not dpre: dW1^T = gcol dpre^T obs, d obs = dpre (gcol W1^T)
    dw1t = gcol[:, None] * jnp.dot(dpret, obs)
    dobs = jax.lax.dot_general(dpret, gcol[:, None] * w1t, (((0,), (0,)), ((), ())))
    cts = (dobs, dw1t, *_scaled_head_grads(gl, db1, dw2, db2, dy))
    return psum_to_match(cts, primals)  # inside shard_map: the replicated params' per-device partials summed


_fused.defvjp(_fused_fwd, _fused_bwd)


def _loss_head(cfg, w1, b1, w2, b2, obs, target):
    G, D, H = w1.shape
    # the weights as [G H, D]: the fused kernel's K-major operand, and on the head path XLA's Hopper TF32 GEMM with
    # both operands contracted along their last axis (13.2 us against 14.9 us for a [D, G H] operand on the H100 at
    # B = 16384, D = G H = 256; BENCHMARKS.md, thirty-sixth session)
    w1t = jnp.swapaxes(w1, 1, 2).reshape(G * H, D)
    if _fused_chosen(G, D, H, obs.shape[0]):
        return _fused(cfg, obs, w1t, b1, w2.reshape(G, H), b2.reshape(G), target)
    pre = jax.lax.dot_general(obs, w1t, (((1,), (1,)), ((), ())))
    return _head(cfg, pre, b1, w2.reshape(G, H), b2.reshape(G), target)


def _kernel_supported(G, H, B):
    """The kernel's limits (ffi/iql.cu IqlHeadImpl): H a multiple of 4 up to 512 (a lane holds 4 columns of
    up to 4 chunks of 128), G <= 65535 (grid y), B <= 2^31 - 33; compute capability 8.0 or newer."""
    if not (H % 4 == 0 and 4 <= H <= 512 and G <= 65535 and 1 <= B < 2**31 - _HEAD_TILE):
        return False
    cc = cuda_compute_capability()  # None when no CUDA device is visible (tracing for CUDA elsewhere)
    return cc is None or cc >= (8, 0)


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
      loss [G] float32, in units of target squared (tau is dimensionless): each network's loss, the mean over
      the B rows; with V [B, G] the networks' values, the mean over the batch of
      ``jaxfox.expectile_loss(target[:, None] - V, jnp.asarray(taus))`` (taus: the G expectiles).

    Differentiable (reverse mode) in params, obs and target. On the kernel path the kernel gives dpre, d target
    (its per-row dv) and the gradients of b1, w2 and b2; XLA's GEMMs give dW1 = obs^T dpre and d obs; forward
    mode and higher derivatives only off the kernel path. The products are XLA's, except the first one on an
    sm_90 GPU at H = 128 or 256, D a multiple of 4 and B >= 4096 (any B with ``JAXFOX_OPT_IN_KERNELS=iql``) and a
    default matmul precision other than "highest" / float32, which the fused kernel computes in TF32 (module
    docstring).

    Source: Kostrikov, Nair & Levine 2021, "Offline Reinforcement Learning with Implicit Q-Learning", eq. (5)
    and ikostrikov/implicit_q_learning's ``expectile_loss`` (mean over the batch); OPS.md "Losses".

    Raises:
      TypeError: a parameter, obs or target is not a float32 array; expectiles is neither a Python number nor a
        list or tuple of them (e.g. an array, which cannot be static, a string or None).
      ValueError: params is not of the form above, a shape does not match (the message names the argument, the
        expected and the actual shape), expectiles has not G entries or an entry is not a Python or NumPy float in
        (0, 1) (also when rounded to float32, and not subnormal there; a bool or a JAX scalar inside the sequence
        is refused too), or B = 0.
    """
    G, D, H = _check_params(params)
    check_array("obs", obs, (None, D))
    B = obs.shape[0]
    check_array("target", target, (B,))
    taus = _check_expectiles(expectiles, G)
    if B == 0:
        raise ValueError("obs must have at least one row (the loss is a mean over the batch), got B = 0")
    reference = functools.partial(_reference, taus)
    # split over Explicit mesh axes: the reference, which XLA partitions (the kernel path's loss is a mean over the
    # whole batch on one device, and its FFI results carry no sharding for the cotangents to match)
    if (not _kernel_supported(G, H, B) or (H < _DEFAULT_MIN_H and not kernel_opted_in("iql"))
            or explicitly_split(params, obs, target)):
        return reference(params, obs, target)

    def kernel(params, obs, target):
        (w1, w2), (b1, b2) = params["w"], params["b"]
        return _loss_head(_Config(taus), w1, b1, w2, b2, obs, target)

    return dispatch(kernel, reference, params, obs, target)
