"""The IQN quantile head: Z_tau(s) from a state embedding and quantile fractions, fused on CUDA.

Implicit Quantile Networks (Dabney, Ostrovski, Silver & Munos 2018, eq. 4 and section 3) model the
return distribution of a state as Z_tau(s) = f(psi(s) (.) phi(tau)). With psi [B, H] the state
embedding (computed by the caller, e.g. ``ReLU(s W_s + b_s)``) and tau [B, N] the fractions::

    e[b, i, k]   = cos(pi tau[b, i] k),  k = 0 .. K - 1          (jaxfox.quantile_embedding)
    phi[b, i, :] = ReLU(e[b, i, :] W_phi + b_phi)                 [H]  (IQN eq. 4)
    m[b, i, :]   = psi[b, :] * phi[b, i, :]                       [H]  (the Hadamard product)
    h[b, i, :]   = ReLU(m[b, i, :] W_h + b_h)                     [H]
    z[b, i]      = h[b, i, :] . w_out[:, 0] + b_out[0]

The [B, N, H] activations are what makes this head expensive in XLA (B N rows of width H, written
and read several times by the forward and backward): at B = 16384, N = 32, H = 128 each one is
268 MB. On CUDA (``ffi/iqn.cu``) a persistent thread block keeps W_phi and W_h in shared memory and
runs the two layers tile by tile (whole samples per tile) on the tensor cores, forward and backward,
without writing any [B, N, H] tensor: the backward recomputes the forward, and the parameter gradients
are per-block partials summed by :func:`jaxfox.reduce_axis0` in a fixed order (no atomics, bitwise
reproducible). On compute capability 9.0 with H = 128 the forward kernel runs both products on Hopper's
warpgroup MMA (wgmma, TF32; ``iqn_head_fwd_wgmma_kernel``: two warpgroups a CTA, each on its own tiles); the
backward and the fused loss stay on mma.sync. At B = 16384, N = 32, n_cos = 64 on an H100 it takes 239 us, against
433 us for the mma.sync forward and 981 us for XLA's (BENCHMARKS.md, fifty-second session).

Precision: float32 inputs, products on the tensor cores in TF32 (10-bit mantissa, the operands rounded
to nearest) with float32 accumulation -- what XLA does for float32 matmuls on the GPU at the default
precision, which the reference path uses; biases, ReLU, the Hadamard product and every sum outside the
products are float32.

The kernels cover H in {64, 128}, K (= n_cos) in {32, 64} and 1 <= N <= 64; other shapes run the
reference on CUDA too, as do GPUs whose shared memory per block is smaller than the kernels' layout (up to
220 KiB at n_cos = 64, H = 128: compute capability 9.0 and 10.x have 227 KiB; 8.0 fits only H = 64) and
batches of 2^31 rows or more. Under ``jax.vmap`` the kernel runs once per instance (``vmap_method="sequential"``).

:func:`iqn_quantile_huber_loss` is the IQN training loss of this head, ``quantile_huber_loss(iqn_head(...), taus,
targets, kappa)``, with its gradient fused on CUDA: under ``jax.grad`` the composition runs the forward kernel
(for z) and then the backward kernel, which recomputes the forward; the fused kernel (``jaxfox_iqn_loss``) runs
the backward kernel alone, computing z, the loss and d z inside each tile (a tile holds whole samples, so all
N x N' pairs of a sample are in it). It runs by default on CUDA: fwd+bwd 2.05x the XLA composition and 1.30x
the head's own two kernels at B=16384 N=N'=32 H=128 on the H200 (1146 vs 2352 and 1490 us, BENCHMARKS.md
"twenty-eighth session").
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from jaxfox._ffi import (_explicit_batch_axes, cuda_compute_capability, dispatch, ffi_call as _ffi_call,
                         psum_to_match, smem_per_block_limit)
from jaxfox._validate import check_array, check_key, positive_int as _positive_int
from jaxfox.losses import _huber_kappa, quantile_embedding, quantile_huber_loss
from jaxfox.reduce import reduce_chunks

__all__ = ["iqn_head_init", "iqn_head", "iqn_quantile_huber_loss"]

_PARAM_KEYS = ("w_phi", "b_phi", "w_h", "b_h", "w_out", "b_out")
_KERNEL_H = (64, 128)      # hidden sizes with a kernel instantiation (ffi/iqn.cu)
_KERNEL_K = (32, 64)       # n_cos values with a kernel instantiation
_MAX_TILE_ROWS = 64        # kMaxTileRows: rows (sample quantiles) per tile
_GRID_CTAS = 132           # backward grid, attr `grid` (persistent blocks: the H200's SM count, fixed so
                           # that the gradients' summation order does not depend on the device)


class _Config(NamedTuple):
    n_cos: int
    hidden: int
    n_quantiles: int


def iqn_head_init(key, hidden_size, *, n_cos=64):
    """Parameters of :func:`iqn_head`: He-normal weights (ReLU layers), zero biases.

    Args:
      key: a ``jax.random`` key (``jax.random.key(seed)`` or a legacy uint32 [2] ``PRNGKey``).
      hidden_size: H, the width of psi, phi and the hidden layer (int >= 1; the CUDA kernels cover 64 and 128).
      n_cos: K, the number of cosine features of :func:`jaxfox.quantile_embedding` (int >= 1; kernels: 32, 64).

    Returns ``{"w_phi": [n_cos, H], "b_phi": [H], "w_h": [H, H], "b_h": [H], "w_out": [H, 1],
    "b_out": [1]}`` float32, weights as [in, out]. ``w_out`` is scaled by 0.1 so that the initial
    quantiles are small. He-normal: N(0, 2 / fan_in) (He et al. 2015, "Delving Deep into Rectifiers",
    eq. 10), as ``jaxfox.models.aux`` initialises its other ReLU layers.

    Raises: ValueError if hidden_size or n_cos is not an int >= 1 or key is a batch of keys; TypeError if key is not
    a jax.random key.
    """
    check_key(key, "iqn_head_init: ")
    H = _positive_int("hidden_size", hidden_size)
    K = _positive_int("n_cos", n_cos)
    k = jax.random.split(key, 3)
    he = lambda kk, a, b: jax.random.normal(kk, (a, b), jnp.float32) * np.float32(np.sqrt(2.0 / a))  # noqa: E731
    return {"w_phi": he(k[0], K, H), "b_phi": jnp.zeros((H,), jnp.float32),
            "w_h": he(k[1], H, H), "b_h": jnp.zeros((H,), jnp.float32),
            "w_out": he(k[2], H, 1) * np.float32(0.1), "b_out": jnp.zeros((1,), jnp.float32)}


def _check_params(params):
    if not isinstance(params, dict) or set(params) != set(_PARAM_KEYS):
        got = sorted(params) if isinstance(params, dict) else type(params).__name__
        raise ValueError(f"params must be a dict with keys {list(_PARAM_KEYS)} (iqn_head_init), got {got}")
    w_phi = params["w_phi"]
    if not hasattr(w_phi, "shape") or not hasattr(w_phi, "dtype"):
        raise TypeError(f"params['w_phi'] must be an array, got {type(w_phi).__name__}")
    if len(w_phi.shape) != 2:
        raise ValueError(f"params['w_phi'] must have shape [n_cos, H], got "
                         f"{getattr(w_phi, 'shape', type(w_phi).__name__)}")
    K, H = w_phi.shape
    if K < 1 or H < 1:
        raise ValueError(f"params['w_phi'] must have n_cos >= 1 and H >= 1, got shape {tuple(w_phi.shape)}")
    want = {"w_phi": (K, H), "b_phi": (H,), "w_h": (H, H), "b_h": (H,), "w_out": (H, 1), "b_out": (1,)}
    for name in _PARAM_KEYS:
        check_array(f"params['{name}']", params[name], want[name])
    return K, H


def _reference(params, psi, taus):
    K = params["w_phi"].shape[0]
    e = quantile_embedding(taus, K)                                            # [B, N, K]
    phi = jax.nn.relu(e @ params["w_phi"] + params["b_phi"])                   # [B, N, H]
    h = jax.nn.relu((psi[:, None, :] * phi) @ params["w_h"] + params["b_h"])
    return (h @ params["w_out"] + params["b_out"])[..., 0]


# ----------------------------------------------------------------------------------------------
# Kernel path. Flat parameter layout (ffi/iqn.cu Layout): w_h [H*H], w_phi [K*H], b_phi [H], b_h [H],
# w_out [H], b_out [1], zero-padded to a multiple of 8 floats (so that every block's partial row is
# 32-byte aligned for the tensor-core stores).
def _flatten(params):
    flat = jnp.concatenate([params["w_h"].reshape(-1), params["w_phi"].reshape(-1), params["b_phi"],
                            params["b_h"], params["w_out"].reshape(-1), params["b_out"]])
    return jnp.pad(flat, (0, -flat.shape[0] % 8))


def _tiles(B, N):
    per_tile = max(1, _MAX_TILE_ROWS // N)   # whole samples per tile
    return -(-B // per_tile)


def _attrs(cfg):
    return dict(n_cos=np.int64(cfg.n_cos), hidden=np.int64(cfg.hidden), n_quantiles=np.int64(cfg.n_quantiles))


def _grid(B, N):
    """Blocks of the backward and loss launches (fixed, so that the gradients' summation order is too)."""
    return min(_tiles(B, N), _GRID_CTAS)


def _fwd_call(cfg, flat, psi, taus):
    B, N = taus.shape
    return _ffi_call("jaxfox_iqn_head_fwd", jax.ShapeDtypeStruct((B, N), jnp.float32),
                     vmap_method="sequential")(flat, psi, taus, **_attrs(cfg))


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _head_kernel(cfg, flat, psi, taus):
    return _fwd_call(cfg, flat, psi, taus)


def _head_kernel_fwd(cfg, flat, psi, taus):
    # symbolic_zeros: the primals arrive as CustomVJPPrimal; the backward skips d taus (one more
    # product per tile) when taus is not being differentiated (the usual case: sampled fractions).
    z = _fwd_call(cfg, flat.value, psi.value, taus.value)
    return z, (flat.value, psi.value, taus.value, bool(taus.perturbed))


def _head_kernel_bwd(cfg, res, dz):
    flat, psi, taus, want_dtaus = res
    B, N = taus.shape
    H = cfg.hidden
    if isinstance(dz, jax.custom_derivatives.SymbolicZero):
        return (None, None, None)
    P = flat.shape[0]
    G = _grid(B, N)
    chunks = reduce_chunks(G, P)
    f32 = jnp.float32
    out = (jax.ShapeDtypeStruct((P,), f32),                               # d flat (reduced)
           jax.ShapeDtypeStruct((B, H), f32),                             # d psi
           jax.ShapeDtypeStruct((B, N) if want_dtaus else (0,), f32),     # d taus
           jax.ShapeDtypeStruct((G, P), f32),                             # workspace: per-block partials
           jax.ShapeDtypeStruct((chunks * P if chunks > 1 else 0,), f32))  # workspace: chunk partials
    dflat, dpsi, dtaus, *_ = _ffi_call("jaxfox_iqn_head_bwd", out, vmap_method="sequential")(
        flat, psi, taus, dz.astype(f32), chunks=np.int64(chunks), grid=np.int64(G), **_attrs(cfg))
    return psum_to_match((dflat, dpsi, dtaus if want_dtaus else None), (flat, psi, taus))


_head_kernel.defvjp(_head_kernel_fwd, _head_kernel_bwd, symbolic_zeros=True)


def _smem_bytes(K, H, backward):
    """Dynamic shared memory of a kernel instantiation (ffi/iqn.cu Layout<K, H, backward>::kTotal floats)."""
    lh, lk, lw = H + 4, K + 4, (H + 4 if backward else H + 8)
    return 4 * ((H + K) * lw + _MAX_TILE_ROWS * lk + 3 * _MAX_TILE_ROWS * lh + 3 * H + 3 * _MAX_TILE_ROWS)


def _kernel_supported(cfg, B):
    if not (cfg.hidden in _KERNEL_H and cfg.n_cos in _KERNEL_K and 1 <= cfg.n_quantiles <= _MAX_TILE_ROWS
            and 1 <= B and B * cfg.n_quantiles < 2**31):
        return False
    cc = cuda_compute_capability()  # None when no CUDA device is visible (tracing for CUDA elsewhere)
    need = max(_smem_bytes(cfg.n_cos, cfg.hidden, b) for b in (False, True))
    return cc is None or (cc >= (8, 0) and need <= smem_per_block_limit(cc))


def iqn_head(params, psi, taus):
    """Quantile values of IQN: psi [B, H] and taus [B, N] -> z [B, N] (the module docstring's equations).

    Args:
      params: from :func:`iqn_head_init`: ``w_phi`` [K, H], ``b_phi`` [H], ``w_h`` [H, H], ``b_h`` [H],
        ``w_out`` [H, 1], ``b_out`` [1], float32 (weights as [in, out]); K is the number of cosine
        features (n_cos).
      psi: [B, H] float32, the state embedding of each of the B samples (already through its ReLU).
      taus: [B, N] float32, the N quantile fractions of each sample (usually in [0, 1)).

    Returns:
      z [B, N] float32: Z_tau(s) for every (sample, fraction).

    Differentiable in params, psi and taus: reverse mode (``jax.grad``, ``jax.vjp``) everywhere, through
    ``jax.custom_vjp`` over the forward and backward kernels on CUDA (which skip the taus gradient when
    taus is not differentiated); forward mode (``jax.jvp``, ``jax.linearize``) and higher derivatives only
    off the kernel path (autodiff of the reference). The kernels' products are TF32 (see the module
    docstring), as XLA's at default precision.

    Source: Dabney et al. 2018, "Implicit Quantile Networks for Distributional Reinforcement Learning",
    eq. (4) (cosine embedding from i = 0, see :func:`jaxfox.quantile_embedding`) and the Hadamard
    combination psi (.) phi of section 3; dopamine's ``ImplicitQuantileNetwork`` (one hidden layer in f).

    Raises:
      TypeError: psi, taus or a parameter is not float32.
      ValueError: params is not an iqn_head_init dict, or a shape does not match (the message names the
        argument, the expected and the actual shape).
    """
    K, H = _check_params(params)
    check_array("psi", psi, (None, H))
    B = psi.shape[0]
    check_array("taus", taus, (B, None))
    N = taus.shape[1]
    cfg = _Config(K, H, N)
    if N == 0 or not _kernel_supported(cfg, B):
        return _reference(params, psi, taus)

    def kernel(params, psi, taus):
        return _head_kernel(cfg, _flatten(params), psi, taus)

    return dispatch(kernel, _reference, params, psi, taus, batch=(False, True, True))


# ----------------------------------------------------------------------------------------------
# The fused loss: one FFI call returns the per-sample losses and the gradient of their batch mean; the
# gradient is the custom_vjp residual and the backward scales it by the cotangent (as jaxfox.iql_value_loss).
class _LossConfig(NamedTuple):
    n_cos: int
    hidden: int
    n_quantiles: int
    kappa: float


def _loss_call(cfg, flat, psi, taus, y):
    """(mean loss, d flat, d psi) of the batch-mean loss, from ONE kernel launch (+ the partials' ordered sum)."""
    B, N = taus.shape
    P = flat.shape[0]
    G = _grid(B, N)
    chunks = reduce_chunks(G, P)
    f32 = jnp.float32
    out = (jax.ShapeDtypeStruct((B,), f32),                               # loss_b: each sample's loss
           jax.ShapeDtypeStruct((P,), f32),                               # d flat (reduced)
           jax.ShapeDtypeStruct((B, cfg.hidden), f32),                    # d psi
           jax.ShapeDtypeStruct((G, P), f32),                             # workspace: per-block partials
           jax.ShapeDtypeStruct((chunks * P if chunks > 1 else 0,), f32))  # workspace: chunk partials
    loss_b, dflat, dpsi, *_ = _ffi_call("jaxfox_iqn_loss", out, vmap_method="sequential")(
        flat, psi, taus, y, chunks=np.int64(chunks), grid=np.int64(G), kappa=np.float32(cfg.kappa), **_attrs(cfg))
    return jnp.mean(loss_b), dflat, dpsi


def _composed_kernel(cfg, flat, psi, taus, y):
    """The same loss as quantile_huber_loss over the head's own kernels (for d taus / d targets)."""
    return quantile_huber_loss(_head_kernel(_Config(cfg.n_cos, cfg.hidden, cfg.n_quantiles), flat, psi, taus), taus, y,
                               cfg.kappa)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _loss_kernel(cfg, flat, psi, taus, y):
    return _loss_call(cfg, flat, psi, taus, y)[0]


def _loss_kernel_fwd(cfg, flat, psi, taus, y):
    # symbolic_zeros: the primals arrive as CustomVJPPrimal. The fused kernel gives d flat and d psi only; when
    # taus or the targets are differentiated too (rare: sampled fractions, stop_gradient-ed targets), the
    # composition of the head's kernels and the XLA loss runs instead, and its VJP is the residual.
    if taus.perturbed or y.perturbed:
        loss, pullback = jax.vjp(functools.partial(_composed_kernel, cfg), flat.value, psi.value, taus.value, y.value)
        return loss, (None, None, pullback, flat.value, psi.value, taus.value, y.value)
    loss, dflat, dpsi = _loss_call(cfg, flat.value, psi.value, taus.value, y.value)
    return loss, (dflat, dpsi, None, flat.value, psi.value, taus.value, y.value)


def _loss_kernel_bwd(cfg, res, g):
    dflat, dpsi, pullback, flat, psi, taus, y = res
    if isinstance(g, jax.custom_derivatives.SymbolicZero):
        return (None,) * 4
    if pullback is not None:
        grads = pullback(g)
    else:
        grads = (g * dflat, g * dpsi, None, None)
    return psum_to_match(grads, (flat, psi, taus, y))


_loss_kernel.defvjp(_loss_kernel_fwd, _loss_kernel_bwd, symbolic_zeros=True)


def iqn_quantile_huber_loss(params, psi, taus, target_quantiles, kappa=1.0):
    """The IQN loss of :func:`iqn_head`: ``quantile_huber_loss(iqn_head(params, psi, taus), taus, target_quantiles,
    kappa)``, with the gradient fused on CUDA.

    Args:
      params: from :func:`iqn_head_init` (see :func:`iqn_head`), float32.
      psi: [B, H] float32, the state embeddings (already through their ReLU).
      taus: [B, N] float32, the fractions of the N online quantiles of each sample.
      target_quantiles: [B, N'] float32, the N' target samples of each sample (in IQN r + gamma Z'_tau'(s', a*),
        usually ``jax.lax.stop_gradient``-ed).
      kappa: the Huber threshold, a concrete real >= 2^-63 (~1.1e-19; below, float32 underflow gives NaN or 0
        losses), a Python float or a 0-d array, in the units of the quantile values (IQN uses 1).

    Returns:
      float32 scalar: (1 / B) sum_b sum_i (1 / N') sum_j |tau_i - 1{delta_ij < 0}| L_kappa(delta_ij) / kappa with
      delta_ij = target_j - z_i and z = iqn_head(params, psi, taus) (:func:`jaxfox.quantile_huber_loss`'s
      conventions: the indicator carries no gradient).

    Differentiable (reverse mode) in params, psi, taus and target_quantiles. On CUDA (kernel shapes as
    :func:`iqn_head`), ONE kernel launch computes z, the loss, d z and the gradient with
    respect to params and psi (the backward of the head, which recomputes z from its inputs): the gradient is
    computed in the forward call and kept as the residual, so a forward alone pays for it too. When taus or the
    targets are differentiated, the composition (the head's kernels and the XLA loss) runs instead. Products in
    TF32 as :func:`iqn_head`; forward mode only off the kernel path. Off CUDA, for other shapes, and for a
    batch split over Explicit mesh axes, the composition runs (the head's own kernels on CUDA, per shard).

    Source: Dabney et al. 2018 (IQN), eq. (3), (4) and (10); dopamine ``implicit_quantile_agent`` (OPS.md "Losses").

    Raises:
      TypeError: psi, taus, target_quantiles or a parameter is not float32; kappa is not a concrete real scalar.
      ValueError: params is not an iqn_head_init dict, a shape does not match (the message names the argument,
        the expected and the actual shape), B = 0, N' = 0, or kappa is not finite or is below 2^-63 in float32.
    """
    K, H = _check_params(params)
    check_array("psi", psi, (None, H))
    B = psi.shape[0]
    check_array("taus", taus, (B, None))
    check_array("target_quantiles", target_quantiles, (B, None))
    kappa = _huber_kappa(kappa)
    N, Nt = taus.shape[1], target_quantiles.shape[1]
    if B == 0 or Nt == 0:
        raise ValueError(f"psi must have at least one row and target_quantiles at least one column (the loss is "
                         f"a mean over both), got psi {tuple(psi.shape)}, target_quantiles "
                         f"{tuple(target_quantiles.shape)}")

    def reference(params, psi, taus, y):
        return quantile_huber_loss(_reference(params, psi, taus), taus, y, kappa)

    cfg = _LossConfig(K, H, N, kappa)
    # a batch split over Explicit mesh axes: the composition, which runs per shard (the fused loss is a mean over
    # the whole batch, computed on one device)
    split = _explicit_batch_axes((psi, taus, target_quantiles), (True, True, True)) is not None
    if (N == 0 or split or not _kernel_supported(_Config(K, H, N), B)
            or B * Nt >= 2**31):
        return quantile_huber_loss(iqn_head(params, psi, taus), taus, target_quantiles, kappa)

    def kernel(params, psi, taus, y):
        return _loss_kernel(cfg, _flatten(params), psi, taus, y)

    return dispatch(kernel, reference, params, psi, taus, target_quantiles)
