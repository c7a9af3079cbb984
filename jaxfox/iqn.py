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
reproducible).

Precision: float32 inputs, products on the tensor cores in TF32 (10-bit mantissa, the operands rounded
to nearest) with float32 accumulation -- what XLA does for float32 matmuls on the GPU at the default
precision, which the reference path uses; biases, ReLU, the Hadamard product and every sum outside the
products are float32.

The kernels cover H in {64, 128}, K (= n_cos) in {32, 64} and 1 <= N <= 64; other shapes run the
reference on CUDA too, as do GPUs whose shared memory per block is smaller than the kernels' layout (up to
220 KiB at n_cos = 64, H = 128: compute capability 9.0 and 10.x have 227 KiB; 8.0 fits only H = 64) and
batches of 2^31 rows or more. Under ``jax.vmap`` the kernel runs once per instance (``vmap_method="sequential"``).
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from jaxfox._ffi import cuda_compute_capability, dispatch, smem_per_block_limit, ffi_call as _ffi_call, psum_to_match
from jaxfox._validate import check_array, positive_int as _positive_int
from jaxfox.losses import quantile_embedding
from jaxfox.reduce import reduce_chunks

__all__ = ["iqn_head_init", "iqn_head"]

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

    Returns ``{"w_phi": [n_cos, H], "b_phi": [H], "w_h": [H, H], "b_h": [H], "w_out": [H, 1],
    "b_out": [1]}`` float32, weights as [in, out]. ``w_out`` is scaled by 0.1 so that the initial
    quantiles are small. He-normal: N(0, 2 / fan_in) (He et al. 2015, "Delving Deep into Rectifiers",
    eq. 10), as ``jaxfox.models.aux`` initialises its other ReLU layers.

    Raises: ValueError if hidden_size or n_cos is not an int >= 1.
    """
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
    if not hasattr(w_phi, "shape") or len(w_phi.shape) != 2:
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
    G = min(_tiles(B, N), _GRID_CTAS)
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
    return 4 * ((H + K) * lw + _MAX_TILE_ROWS * lk + 3 * _MAX_TILE_ROWS * lh + 3 * H + 2 * _MAX_TILE_ROWS)


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
