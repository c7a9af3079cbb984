"""Gated residual network (GRN) of the Temporal Fusion Transformer.

Lim, Arik, Loeff, Pfister 2021, "Temporal Fusion Transformers for interpretable multi-horizon time
series forecasting" (Int. J. Forecasting), eqs. (2)-(5), in the form of google-research
``tft/libs/tft_model.py`` (``gated_residual_network``, ``apply_gating_layer``, ``add_and_norm``),
not pytorch-forecasting's (which interpolates the skip path):

    eta2 = ELU(a W2 + b2 + c W3)            W3 has no bias; the context c is optional
    eta1 = eta2 W1 + b1
    GLU(g) = (g W4 + b4) * sigmoid(g W5 + b5)
    GRN(a, c) = LayerNorm(skip(a) + GLU(eta1))
    skip(a) = a when input and output widths match, else a W_s + b_s (a learned Dense)
    LayerNorm(x) = (x - mu) / sqrt(var + eps) * gamma + beta,  mu = mean(x), var = mean((x - mu)^2)

The paper's eq. (5) writes the GLU as sigmoid(W4 g + b4) (.) (W5 g + b5), the gate on W4; here (as OPS.md)
``w4`` is the value path and ``w5`` the gate: swap the two when loading weights named after the paper.

LayerNorm statistics are float32 and multi-pass (never E[x^2] - E[x]^2), computed on the row
shifted by its first element with a correction pass (:func:`layer_norm`; mathematically
identical, and rows with a large common offset such as 1449 +- 1 keep their digits). Dropout (used in the paper
before the gate) is not part of the op.

Kernels (``ffi/grn.cu``, opt-in): a GRN without context whose widths are small (I <= 256, Hd <= 64,
O <= 64, and the kernel's shared-memory and register-tile limits, see :func:`_kernel_fits`) has one fused
forward kernel (``jaxfox_grn_fwd``, which also saves each row's e2, e1, g4, g5, zhat and rstd for the
backward when one follows) and one fused backward kernel (``jaxfox_grn_bwd``, which reads those residuals and
writes per-row-range parameter partials that ``LaunchReduceAxis0`` sums in a fixed
order: no atomics, bitwise reproducible) inside a ``jax.custom_vjp``. They are written for the perception
model's GRNs: the VSN's selection GRN (I = m d = 192, Hd = 32, O = m = 48, with the softmax of TFT eq. 6
fused) and the head GRN (I = 64, Hd = O = 32). On the H200 they are still not faster than XLA (fwd+bwd 0.98x
the XLA reference at the selection shape and 2048 rows, 0.71x at 16384, 0.86x for the head GRN at 32 rows; the
perception step 692 us with them vs 700 us without, BENCHMARKS.md "fifteenth session"), so they run only
when ``JAXFOX_OPT_IN_KERNELS`` names ``grn`` (or ``all``) at trace time, on CUDA. Wider GRNs, such as the
issue's bench shape I = Hd = O = 128, ran the pure-JAX reference (there XLA's TF32 tensor-core matmuls beat
CUDA-core kernels: a fused kernel measured 0.68x at 2048 rows, BENCHMARKS.md "2026-11-29 — attention_pool, GRN
and VSN kernels"). For them there are TF32 tensor-core kernels (``jaxfox_grn_tc_fwd`` / ``jaxfox_grn_tc_bwd``,
``mma.sync`` m16n8k8, float32 accumulate, 32-row tiles, weights streamed through shared memory; weights rounded
to TF32 in Python, their gradients passed straight through as for XLA's TF32 dot): no context, I in
{16, 32, 64, 128}, Hd and O in {32, 64, 128}, shapes the CUDA-core kernels do not take, and only at the default
matmul precision (not "highest"); the backward kernel returns the activation gradients, and the weight and bias
gradients are XLA's GEMMs and column sums (TF32 at the default precision, as the reference's), so they are
deterministic too. Also opt-in (``grn``): they match XLA's TF32 accuracy but are slower (fwd+bwd 0.93x XLA at
2048 rows and 0.82x at 16384 on an H100; 0.82x / 0.71x on the H200; BENCHMARKS.md "thirty-fourth session").
GRNs with a context always run the reference. By default, off CUDA, or under :func:`jaxfox.use_reference`, the
reference runs and its gradients are JAX autodiff.
"""

from __future__ import annotations

import functools
import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from jaxfox._ffi import dispatch, ffi_call as _ffi_call, kernel_opted_in, psum_to_match
from jaxfox._validate import (check_array as _check_array, check_key, float32_param_dtype, positive_float32,
                              positive_int as _positive_int)
from jaxfox.gemm import _precision_is_highest, _type_witness
from jaxfox.reduce import _reduce_kernel, backward_tiling, reduce_chunks

__all__ = ["grn_init", "grn", "layer_norm"]

_INPUT_DTYPES = (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16))
_REQUIRED = ("w2", "b2", "w1", "b1", "w4", "b4", "w5", "b5", "gamma", "beta")


# ----------------------------------------------------------------------------------------------
# Parameters.
def grn_init(key, input_size, hidden_size, output_size, *, context_size=None, dtype=jnp.float32):
    """Parameters of a GRN, initialised as google-research TFT (Keras defaults).

    Every weight matrix is glorot (xavier) uniform, U(-b, b) with b = sqrt(6 / (fan_in + fan_out))
    (Keras ``Dense`` default ``kernel_initializer``); every bias is zero (``bias_initializer``);
    LayerNorm ``gamma`` = 1 and ``beta`` = 0.

    Args:
      key: a ``jax.random`` key.
      input_size: I, width of ``a``.  hidden_size: Hd.  output_size: O.
      context_size: C, width of the optional context; None for a GRN without context.
      dtype: float32 (:func:`grn` takes float32 parameters only).

    Returns:
      dict of arrays:
        ``w2`` [I, Hd], ``b2`` [Hd]      first layer (a -> hidden)
        ``w3`` [C, Hd]                  context layer, no bias (only when context_size is given)
        ``w1`` [Hd, Hd], ``b1`` [Hd]     second layer
        ``w4`` [Hd, O], ``b4`` [O]       GLU value path
        ``w5`` [Hd, O], ``b5`` [O]       GLU gate path (sigmoid)
        ``skip_w`` [I, O], ``skip_b`` [O]  skip Dense (only when I != O; identity skip otherwise)
        ``gamma`` [O], ``beta`` [O]     LayerNorm scale and shift

    Raises:
      ValueError: a size is not a positive int, or key is a batch of keys.
      TypeError: dtype is not float32, or key is not a jax.random key.
    """
    check_key(key, "grn_init: ")
    dtype = float32_param_dtype("grn_init", dtype)
    I = _positive_int("input_size", input_size)
    H = _positive_int("hidden_size", hidden_size)
    O = _positive_int("output_size", output_size)
    C = None if context_size is None else _positive_int("context_size", context_size)
    k2, k3, k1, k4, k5, ks = jax.random.split(key, 6)

    def glorot(k, shape):
        bound = math.sqrt(6.0 / (shape[0] + shape[1]))
        return jax.random.uniform(k, shape, dtype, -bound, bound)

    p = {
        "w2": glorot(k2, (I, H)), "b2": jnp.zeros((H,), dtype),
        "w1": glorot(k1, (H, H)), "b1": jnp.zeros((H,), dtype),
        "w4": glorot(k4, (H, O)), "b4": jnp.zeros((O,), dtype),
        "w5": glorot(k5, (H, O)), "b5": jnp.zeros((O,), dtype),
        "gamma": jnp.ones((O,), dtype), "beta": jnp.zeros((O,), dtype),
    }
    if C is not None:
        p["w3"] = glorot(k3, (C, H))
    if I != O:
        p["skip_w"] = glorot(ks, (I, O))
        p["skip_b"] = jnp.zeros((O,), dtype)
    return p


def _most_common(sizes):
    """The most frequent of `sizes` (the first one seen among equally frequent ones)."""
    return max(dict.fromkeys(sizes), key=sizes.count)


def _grn_sizes(params, name="params", lead=(), init="grn_init"):
    """Validates GRN params (each leaf with leading dims `lead`); returns (I, C, H, O), C = 0 without context.
    `init`: the function the error messages tell the user to create the params with."""
    if not isinstance(params, dict):
        raise TypeError(f"{name} must be the dict returned by {init}, got {type(params).__name__}")
    missing = [k for k in _REQUIRED if k not in params]
    if missing:
        raise ValueError(f"{name} is missing {missing} (create it with {init})")
    lead = tuple(lead)
    for k in ("w2", "w1", "w4", "w5"):
        _check_array(f"{name}['{k}']", params[k], lead + (None, None))
    for k in ("b2", "b1", "b4", "b5", "gamma", "beta"):
        _check_array(f"{name}['{k}']", params[k], lead + (None,))
    # Hd and O are the widths most leaves agree on, so that the error below names the leaf that differs
    # (taking Hd from w2 alone reported a wrong w2 as a w4 mismatch)
    H = _most_common([params["w2"].shape[-1], *params["w1"].shape[-2:], params["b1"].shape[-1],
                      params["b2"].shape[-1], params["w4"].shape[-2], params["w5"].shape[-2]])
    O = _most_common([params[k].shape[-1] for k in ("w4", "w5", "b4", "b5", "gamma", "beta")])
    I = params["w2"].shape[-2]
    _check_array(f"{name}['w2']", params["w2"], lead + (I, H))
    _check_array(f"{name}['w4']", params["w4"], lead + (H, O))
    _check_array(f"{name}['b2']", params["b2"], lead + (H,))
    _check_array(f"{name}['w1']", params["w1"], lead + (H, H))
    _check_array(f"{name}['b1']", params["b1"], lead + (H,))
    _check_array(f"{name}['b4']", params["b4"], lead + (O,))
    _check_array(f"{name}['w5']", params["w5"], lead + (H, O))
    _check_array(f"{name}['b5']", params["b5"], lead + (O,))
    _check_array(f"{name}['gamma']", params["gamma"], lead + (O,))
    _check_array(f"{name}['beta']", params["beta"], lead + (O,))
    C = 0
    if "w3" in params:
        _check_array(f"{name}['w3']", params["w3"], lead + (None, H))
        C = params["w3"].shape[-2]
        if C == 0:
            raise ValueError(f"{name}['w3'] must have at least one row (context_size >= 1)")
    if I != O:
        if "skip_w" not in params or "skip_b" not in params:
            raise ValueError(f"{name} has input width {I} != output width {O} and so needs 'skip_w' and "
                             f"'skip_b' (create it with {init})")
        _check_array(f"{name}['skip_w']", params["skip_w"], lead + (I, O))
        _check_array(f"{name}['skip_b']", params["skip_b"], lead + (O,))
    elif "skip_w" in params or "skip_b" in params:
        raise ValueError(f"{name} has equal input and output widths ({I}): the skip is the identity, "
                         "so 'skip_w'/'skip_b' must not be present")
    return I, C, H, O


def _check_input(name, x, ndim_min, last):
    """x: float32 or bfloat16 array of rank >= ndim_min whose trailing dims are `last` (tuple)."""
    if not hasattr(x, "shape") or not hasattr(x, "dtype"):
        raise TypeError(f"{name} must be an array, got {type(x).__name__}")
    if jnp.dtype(x.dtype) not in _INPUT_DTYPES:
        raise TypeError(f"{name} must be float32 or bfloat16, got {x.dtype}")
    if len(x.shape) < ndim_min or tuple(x.shape[len(x.shape) - len(last):]) != tuple(last):
        want = "[..., " + ", ".join(str(s) for s in last) + "]"
        raise ValueError(f"{name} must have shape {want}, got {tuple(x.shape)}")


def _check_context(context, C, lead, params_name="params"):
    """Validates the optional context against C (0: none) and the leading dims `lead` of the input."""
    if C == 0:
        if context is not None:
            raise ValueError(f"context was given but {params_name} has no context weight 'w3' "
                             "(create it with context_size=...)")
        return None
    if context is None:
        raise ValueError(f"{params_name} has a context weight 'w3' [{C}, Hd]: a context [..., {C}] is required")
    _check_input("context", context, 1, (C,))
    if context.ndim != len(lead) + 1:
        # NumPy's rank promotion would align a [B, C] context with the last leading dim of a [B, T, I] input, and
        # broadcast it along the wrong axis whenever B == T: one axis per leading dim is required (jax's
        # jax_numpy_rank_promotion="raise" convention).
        raise ValueError(f"context must have one axis per leading dim of the input plus C: rank {len(lead) + 1} "
                         f"for leading dims {tuple(lead)}, got shape {tuple(context.shape)} (a static context of a "
                         f"[B, T, ...] input is [B, 1, C]: context[:, None])")
    try:
        shape = jnp.broadcast_shapes(tuple(context.shape[:-1]), tuple(lead))
    except ValueError:
        shape = None
    if shape != tuple(lead):
        raise ValueError(f"context leading dims {tuple(context.shape[:-1])} must broadcast to the input's "
                         f"leading dims {tuple(lead)}")
    return context


def _common_dtype(x, c):
    """Both bfloat16 -> keep; otherwise compute from float32 copies (a lossless upcast)."""
    if c is None or x.dtype == c.dtype:
        return x, c
    return x.astype(jnp.float32), c.astype(jnp.float32)


# ----------------------------------------------------------------------------------------------
# Implementation (pure JAX).
def layer_norm(x, gamma, beta, eps=1e-5):
    """LayerNorm over the last axis in float32: (x - mu) / sqrt(var + eps) * gamma + beta.

    x [..., O] float32 (bfloat16/float16 x is upcast to float32 first, so the statistics are float32 whatever
    its dtype; float64 stays float64); gamma, beta [O]. Returns [..., O] in the promoted dtype (float32 for
    float32/bfloat16/float16 x and parameters). var = mean((x - mu)^2) (biased), never E[x^2] - E[x]^2,
    computed in passes over the row shifted by its first element: d = x - x0, dev = d - mean(d),
    then dev -= mean(dev) (zero up to the rounding of mean(d); it restores the digits when x0 is
    an outlier of a row with a large common offset), var = mean(dev^2). The same function as the
    textbook formula; the shift x0 and the correction mean(dev) are constants of the gradient,
    which is exact because the output does not depend on them. The derivative of dev * rsqrt(var + eps) is
    the textbook one, rstd (t - xhat mean(xhat t)) (:func:`_standardize`), not autodiff of rsqrt, whose factor
    (var + eps)^-1.5 overflows to inf for eps below ~2e-26 and made a constant row's gradient NaN.
    """
    x = x.astype(jnp.promote_types(x.dtype, jnp.float32))  # bfloat16 statistics were 1e-2 off, float16's overflowed
    x0 = jax.lax.stop_gradient(x[..., :1])
    d = x - x0
    dev = d - jnp.mean(d, axis=-1, keepdims=True)
    dev = dev - jax.lax.stop_gradient(jnp.mean(dev, axis=-1, keepdims=True))
    return _standardize(dev, eps)[0] * gamma + beta


@functools.partial(jax.custom_jvp, nondiff_argnums=(1,))
def _standardize(dev, eps):
    """(xhat, rstd) of rows ``dev`` [..., O]: rstd = rsqrt(mean(dev^2) + eps) [..., 1], xhat = dev * rstd."""
    rstd = jax.lax.rsqrt(jnp.mean(dev * dev, axis=-1, keepdims=True) + eps)
    return dev * rstd, rstd


@_standardize.defjvp
def _standardize_jvp(eps, primals, tangents):
    """d xhat = rstd (t - xhat mean(xhat t)), d rstd = -rstd^2 mean(xhat t): every factor bounded (rstd <= eps^-1/2,
    |xhat| <= sqrt(O)), so a constant row (dev = 0) gets rstd t and no 0 * inf. Written in JAX ops on the outputs
    of :func:`_standardize`, so higher derivatives go through this rule again."""
    (dev,), (t,) = primals, tangents
    xhat, rstd = _standardize(dev, eps)
    m = jnp.mean(xhat * t, axis=-1, keepdims=True)
    return (xhat, rstd), (rstd * (t - xhat * m), -(rstd * m) * rstd)


def _grn_reference(params, a, c, eps):
    """a [..., I] (float32 or bfloat16), c [..., C] or None -> [..., O] float32."""
    a = a.astype(jnp.float32)
    h2 = a @ params["w2"] + params["b2"]
    if c is not None:
        h2 = h2 + c.astype(jnp.float32) @ params["w3"]
    eta2 = jax.nn.elu(h2)
    eta1 = eta2 @ params["w1"] + params["b1"]
    glu = (eta1 @ params["w4"] + params["b4"]) * jax.nn.sigmoid(eta1 @ params["w5"] + params["b5"])
    skip = a @ params["skip_w"] + params["skip_b"] if "skip_w" in params else a
    return layer_norm(skip + glu, params["gamma"], params["beta"], eps)


# ----------------------------------------------------------------------------------------------
# Kernel path (ffi/grn.cu). The parameters travel as one flat float32 vector, the leaves of _FLAT_KEYS
# concatenated (each row-major; skip_w/skip_b only when I != O): the layout of ffi/common.h GrnParamLayout,
# also used per variable by jaxfox/vsn.py.
_FLAT_KEYS = ("w2", "b2", "w1", "b1", "w4", "b4", "w5", "b5", "skip_w", "skip_b", "gamma", "beta")
KERNEL_MAX_INPUT = 256
"""Widest input I the kernels take (ffi/grn.cu kMaxIn)."""
KERNEL_MAX_HIDDEN = 64
"""Widest hidden Hd the kernels take (kMaxHidden)."""
KERNEL_MAX_OUTPUT = 64
"""Widest output O the kernels take (kMaxOut)."""
_ROW_TILE = 32            # ffi/grn.cu kRowTile
_THREADS = 256            # ffi/grn.cu kThreads
_W_SLOTS = 6              # ffi/grn.cu kWSlots: 4 x 4 parameter-gradient tiles a thread
_MAX_SMEM = 160 * 1024    # the backward's shared memory, kept under sm_80's 163 KB opt-in limit
_TARGET_BWD_BLOCKS = 128  # backward CTAs aimed at (each sums `tiles_per_block` row tiles before writing a partial)


def _r4(n):
    return (n + 3) & ~3


def _smem_bytes(I, H, O, bwd):
    """ffi/grn.cu MakeSmemLayout's total, in bytes."""
    skip = I != O
    odd = lambda n: n | 1  # noqa: E731
    w = (_r4(I * odd(H)) + (_r4(I * odd(O)) if skip else 0) + _r4(H * odd(H)) + 2 * _r4(H * odd(O))
         + 2 * _r4(H) + (5 if skip else 4) * _r4(O))
    act = (_r4(I) + 2 * _r4(H)) * (_ROW_TILE + 4)
    if bwd:
        act += (3 * _r4(O) + 2 * _r4(H)) * (_ROW_TILE + 4) + _r4(2 * (_THREADS // 32) * O)
    return 4 * (w + act)


def _dw_tiles(I, H, O):
    """ffi/grn.cu DwTiles: the 4 x 4 tiles of dW2, dW1, dW4, dW5 (and dWs when I != O)."""
    t = lambda K, N: (_r4(K) // 4) * (_r4(N) // 4)  # noqa: E731
    return t(I, H) + t(H, H) + 2 * t(H, O) + (t(I, O) if I != O else 0)


def _kernel_fits(I, C, H, O):
    """Whether the kernels take a GRN of these widths: no context (C == 0), 1 <= I <= 256, Hd <= 64, O <= 64,
    at most 1536 parameter-gradient tiles (6 a thread) and the backward's shared memory <= 160 KB."""
    return (C == 0 and 1 <= I <= KERNEL_MAX_INPUT and 1 <= H <= KERNEL_MAX_HIDDEN and 1 <= O <= KERNEL_MAX_OUTPUT
            and _dw_tiles(I, H, O) <= _THREADS * _W_SLOTS and _smem_bytes(I, H, O, True) <= _MAX_SMEM)


class _KernelCfg(NamedTuple):
    hidden_size: int
    output_size: int
    eps: float
    softmax: bool


def _flat(p):
    return jnp.concatenate([p[k].reshape(-1) for k in _FLAT_KEYS if k in p])


def _attrs(cfg):
    return dict(hidden_size=np.int64(cfg.hidden_size), output_size=np.int64(cfg.output_size),
                eps=np.float32(cfg.eps), softmax=np.int64(cfg.softmax))


def _bwd_tiling(R):
    """(tiles_per_block, blocks) of the backward grid over ceil(R / 32) row tiles
    (:func:`jaxfox.reduce.backward_tiling`)."""
    return backward_tiling(R, _ROW_TILE, _TARGET_BWD_BLOCKS)


def _res_width(cfg):
    """ffi/grn.cu ResWidth: the forward's residuals a row,
    [e2 (H) | e1 (H) | g4 (O) | g5 (O) | zhat (O) | rstd]."""
    return 2 * cfg.hidden_size + 3 * cfg.output_size + 1


def _grn_kernel_call(cfg, wflat, a, save):
    """(out [R, O], res [R, W]) from jaxfox_grn_fwd; W = _res_width(cfg) when ``save`` (a backward follows), else 0."""
    R = a.shape[0]
    f32 = jnp.float32
    out = (jax.ShapeDtypeStruct((R, cfg.output_size), f32),
           jax.ShapeDtypeStruct((R, _res_width(cfg) if save else 0), f32))
    return _ffi_call("jaxfox_grn_fwd", out, vmap_method="broadcast_all")(wflat, a, **_attrs(cfg))


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _grn_kernel(cfg, wflat, a):
    return _grn_kernel_call(cfg, wflat, a, save=False)[0]


def _grn_kernel_fwd(cfg, wflat, a):
    out, res = _grn_kernel_call(cfg, wflat, a, save=True)
    return out, (wflat, a, res)


def _grn_kernel_bwd(cfg, res, g):
    wflat, a, fwd_res = res
    R, I = a.shape
    P = wflat.shape[0]
    per, blocks = _bwd_tiling(R)
    chunks = reduce_chunks(blocks, P)
    f32 = jnp.float32
    out = (jax.ShapeDtypeStruct((P,), f32),                                 # dw (reduced)
           jax.ShapeDtypeStruct((R, I), f32),                               # da
           jax.ShapeDtypeStruct((blocks, P), f32),                          # workspace: per-CTA partials
           jax.ShapeDtypeStruct((chunks * P if chunks > 1 else 0,), f32))   # workspace: reduce_axis0
    dw, da, *_ = _ffi_call("jaxfox_grn_bwd", out, vmap_method="broadcast_all")(
        wflat, a, g.astype(f32), fwd_res, tiles_per_block=np.int64(per), chunks=np.int64(chunks), **_attrs(cfg))
    return psum_to_match((dw, da), (wflat, a))


_grn_kernel.defvjp(_grn_kernel_fwd, _grn_kernel_bwd)


# ----------------------------------------------------------------------------------------------
# Tensor-core (TF32) kernel path (ffi/grn.cu namespace ``tc``): context-free GRNs of the widths below at
# default matmul precision. Operands: x and the parameters as separate buffers, the weights rounded to TF32 here
# (w45 = [w4 | w5]); the backward kernel returns the activation gradients, and the parameter gradients are XLA's
# GEMMs and column sums plus a reduce_axis0 of the per-tile LayerNorm partials.
_TC_ROWS = 32                 # ffi/grn.cu tc kRows: rows a tile (one CTA of 256 threads a tile and vmap instance)
_TC_CHUNK = 16                # ffi/grn.cu tc kChunk: rows of K a staged weight chunk holds (two in flight)
_TC_INPUTS = (16, 32, 64, 128)
_TC_WIDTHS = (32, 64, 128)    # Hd and O
_TC_MAX_SMEM = 227 * 1024     # sm_90's opt-in dynamic shared memory per block


def _tc_fits(I, C, H, O):
    """Whether the TF32 kernels take a GRN of these widths: no context, I in {16, 32, 64, 128}, Hd and O in
    {32, 64, 128}."""
    return C == 0 and I in _TC_INPUTS and H in _TC_WIDTHS and O in _TC_WIDTHS


def _tc_smem_bytes(I, H, O):
    """(forward, backward) dynamic shared memory of the TF32 kernels, bytes (ffi/grn.cu tc FwdSmem / BwdSmem):
    the 32-row activation tiles and the buffers of the staged weight chunks."""
    wide = max(H, O) + 4
    return (4 * (_TC_ROWS * ((I + 4) + wide + (2 * O + 4)) + 2 * _TC_CHUNK * (max(H, 2 * O) + 8)),
            4 * (_TC_ROWS * ((2 * O + 4) + wide + (O + 4)) + max(H, I) * 2 * (_TC_CHUNK + 4)))


def _tc_smem_fits(I, H, O):
    """Both kernels' shared memory <= 227 KB (sm_90; at most ~101 KB for the shapes of :func:`_tc_fits`)."""
    return max(_tc_smem_bytes(I, H, O)) <= _TC_MAX_SMEM


class _TcCfg(NamedTuple):
    hidden_size: int
    output_size: int
    eps: float


def _tf32(w):
    """w rounded to TF32 (10-bit mantissa, round to nearest even): the tensor cores' operand."""
    return jax.lax.reduce_precision(w, exponent_bits=8, mantissa_bits=10)


def _tc_operands(p):
    """(w2 [I, Hd], b2, w1 [Hd, Hd], b1, w45 [Hd, 2 O], b45 [2 O], ws [I, O] or [0, O], bs [O] or [0], gamma, beta):
    the parameter operands of jaxfox_grn_tc_fwd, weights TF32-rounded; ws/bs zero-size for the identity skip."""
    O = p["w4"].shape[-1]
    f32 = jnp.float32
    w45 = _tf32(jnp.concatenate([p["w4"], p["w5"]], axis=-1))
    b45 = jnp.concatenate([p["b4"], p["b5"]], axis=-1)
    if "skip_w" in p:
        ws, bs = _tf32(p["skip_w"]), p["skip_b"]
    else:
        ws, bs = jnp.zeros((0, O), f32), jnp.zeros((0,), f32)
    return _tf32(p["w2"]), p["b2"], _tf32(p["w1"]), p["b1"], w45, b45, ws, bs, p["gamma"], p["beta"]


def _grn_tc_call(cfg, ops, x, save):
    """jaxfox_grn_tc_fwd: x [R, I] -> (y [R, O], e2 [Rs, Hd], e1 [Rs, Hd], g [Rs, 2 O], zhat [Rs, O], rstd [Rs]),
    Rs = R when ``save`` (a backward follows), else 0."""
    R = x.shape[0]
    H, O = cfg.hidden_size, cfg.output_size
    Rs = R if save else 0
    sds = lambda *s: jax.ShapeDtypeStruct(s, jnp.float32)  # noqa: E731
    out = (sds(R, O), sds(Rs, H), sds(Rs, H), sds(Rs, 2 * O), sds(Rs, O), sds(Rs))
    return _ffi_call("jaxfox_grn_tc_fwd", out, vmap_method="broadcast_all")(
        x, *ops, hidden_size=np.int64(H), output_size=np.int64(O), eps=np.float32(cfg.eps), save=np.int64(save))


def _tc_params(p):
    """The GRN's own leaves of ``p`` (keys of _FLAT_KEYS) as a plain dict, the tree :func:`_grn_tc` takes: other
    leaves and the caller's mapping type stay outside the custom_vjp, where autodiff gives them zero gradients
    and keeps the caller's tree, as on the reference path."""
    return {k: p[k] for k in _FLAT_KEYS if k in p}


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _grn_tc(cfg, p, x):
    """GRN(x) by the TF32 kernels: p the params of :func:`grn_init` (no ``w3``), x [R, I] float32 -> [R, O]."""
    return _grn_tc_call(cfg, _tc_operands(p), x, save=False)[0]


def _grn_tc_fwd(cfg, p, x):
    ops = _tc_operands(p)
    y, e2, e1, g, zhat, rstd = _grn_tc_call(cfg, ops, x, save=True)
    w2, _, w1, _, w45, _, ws, _, gamma, _ = ops
    p_like = jax.tree.map(_type_witness, p)   # zero-size: only the types, for psum_to_match
    return y, (p_like, x, (w2, w1, w45, ws, gamma), e2, e1, g, zhat, rstd)


def _grn_tc_bwd(cfg, res, dy):
    """Activation gradients from jaxfox_grn_tc_bwd; dW = act^T d(pre-activation) and the bias gradients (column
    sums) from XLA (its TF32 dot at the default precision, as the reference's); [dgamma | dbeta] = the per-tile
    partials summed by reduce_axis0. The gradient of a TF32-rounded weight is passed to the unrounded one (as
    XLA's TF32 dot: straight-through)."""
    p_like, x, (w2, w1, w45, ws, gamma), e2, e1, g, zhat, rstd = res
    R, I = x.shape
    H, O = cfg.hidden_size, cfg.output_size
    T = -(-R // _TC_ROWS)
    sds = lambda *s: jax.ShapeDtypeStruct(s, jnp.float32)  # noqa: E731
    out = (sds(R, I), sds(R, 2 * O), sds(R, H), sds(R, H), sds(R, O), sds(T, 2 * O))
    dx, dg, de1, da2, dz, gb = _ffi_call("jaxfox_grn_tc_bwd", out, vmap_method="broadcast_all")(
        dy.astype(jnp.float32), e2, g, zhat, rstd, gamma, w45, w1, w2, ws,
        hidden_size=np.int64(H), output_size=np.int64(O))
    # dW = act^T d(pre-activation) and db = column sums: XLA's GEMMs and reductions (deterministic for a given
    # compilation; at 16384 rows 240 vs 293 us a step with jaxfox.gemm's grouped wgrad, H100)
    pairs = [(x, da2), (e2, de1), (e1, dg)] + ([(x, dz)] if "skip_w" in p_like else [])
    dW2, db2, dW1, db1, dW45, db45, *dskip = [
        t for a, d in pairs for t in (jnp.einsum("rk,rn->kn", a, d), jnp.sum(d, axis=0))]
    gsum = _reduce_kernel(gb)                                                 # [2 O]
    dp = {"w2": dW2, "b2": db2, "w1": dW1, "b1": db1, "w4": dW45[:, :O], "w5": dW45[:, O:],
          "b4": db45[:O], "b5": db45[O:], "gamma": gsum[:O], "beta": gsum[O:]}
    if dskip:
        dp["skip_w"], dp["skip_b"] = dskip
    leaves, tree = jax.tree.flatten(dp)
    assert tree == jax.tree.structure(p_like), (tree, jax.tree.structure(p_like))
    sums = psum_to_match(tuple(leaves) + (dx,), tuple(jax.tree.leaves(p_like)) + (x,))
    return jax.tree.unflatten(tree, sums[:-1]), sums[-1]


_grn_tc.defvjp(_grn_tc_fwd, _grn_tc_bwd)


def _tc_routed(I, C, H, O):
    """The TF32 kernels apply: widths of :func:`_tc_fits` (and their shared memory) at a default matmul precision
    (not "highest"/float32, where the kernels' TF32 products would be less exact than XLA's)."""
    return _tc_fits(I, C, H, O) and _tc_smem_fits(I, H, O) and not _precision_is_highest(None)


def _grn_apply(params, a, c, eps, softmax=False):
    """a [R, I] float32, c [R, C] or None -> [R, O] float32: GRN(a, c), or its softmax over O when ``softmax``
    (the VSN's selection weights). On CUDA when opted in (``JAXFOX_OPT_IN_KERNELS`` names ``grn``) and without
    context: the CUDA-core kernels where :func:`_kernel_fits`, else the TF32 kernels (:func:`_grn_tc`, no softmax)
    where :func:`_tc_routed`; otherwise (and off CUDA) :func:`_grn_reference`."""
    R, I = a.shape
    C = 0 if c is None else c.shape[-1]
    H, O = params["w1"].shape[-1], params["w4"].shape[-1]

    def reference(p, a, c=None):
        y = _grn_reference(p, a, c, eps)
        return jax.nn.softmax(y, axis=-1) if softmax else y

    if not kernel_opted_in("grn") or c is not None or not isinstance(R, int) or R == 0:
        return reference(params, a, c)  # (a symbolic R, jax.export shape polymorphism: no kernel grid for it)
    if _kernel_fits(I, C, H, O):      # the CUDA-core kernels keep the shapes they take
        def kernel(p, a):
            return _grn_kernel(_KernelCfg(H, O, float(eps), bool(softmax)), _flat(p), a)
    elif not softmax and _tc_routed(I, C, H, O):
        def kernel(p, a):
            return _grn_tc(_TcCfg(H, O, float(eps)), _tc_params(p), a)
    else:
        return reference(params, a, c)
    return dispatch(kernel, reference, params, a, batch=(False, True))


# ----------------------------------------------------------------------------------------------
def grn(params, a, context=None, *, eps=1e-5):
    """Gated residual network: a [..., I] (and context [..., C]) -> [..., O] float32.

    Math: the docstring of module ``jaxfox.grn`` (TFT eqs. 2-5, google-research ``gated_residual_network``;
    ``jaxfox.grn`` names this function, so read it as ``sys.modules["jaxfox.grn"].__doc__``).

    Args:
      params: from :func:`grn_init` (float32). The skip is the identity when I == O, else the
        learned ``skip_w``/``skip_b``; ``w3`` (context weight) present iff a context is used.
      a: [..., I] float32 or bfloat16 (any number of leading dims, e.g. [B, T, I]; they may be symbolic, as in
        ``jax.export`` shape polymorphism, and then the reference runs: the kernels need a concrete row count).
      context: [..., C] float32 or bfloat16 of a's rank whose leading dims broadcast to a's (e.g. a static
        context [B, 1, C] for a [B, T, I]; a [B, C] context is refused there: rank promotion would align B with
        T); required iff ``params`` has ``w3``.
      eps: LayerNorm epsilon (> 0). 1e-5 by default; google-research's Keras code effectively
        used 1e-3.

    Returns:
      [..., O] float32. With O = 1 the output is constant, ``beta``: the final LayerNorm over one feature
      gives 0 before its affine part (TFT's definition; the weights then get no gradient), so use a linear
      layer for a scalar head. bfloat16 inputs are promoted: every product, accumulation and statistic
      is float32 and the output is float32; the gradient with respect to a bfloat16 ``a`` (or
      context) is the float32 gradient rounded once to bfloat16. A float32/bfloat16 mix of ``a``
      and ``context`` is computed from float32 copies.

    Differentiable in params, a and context. By default XLA code with JAX autodiff on every platform.
    With ``JAXFOX_OPT_IN_KERNELS=grn`` on CUDA, a GRN without context and with small widths (I <= 256,
    Hd <= 64, O <= 64: module docstring) runs the fused kernels of ``ffi/grn.cu`` (forward and a
    ``jax.custom_vjp`` backward, parameter gradients summed in a fixed order: bitwise reproducible);
    they are not faster than XLA on the H200 so far, hence opt-in. Wider context-free GRNs (I in {16, 32, 64, 128},
    Hd and O in {32, 64, 128}) run TF32 tensor-core kernels there instead, at the default matmul precision only
    (module docstring). That kernel path is reverse mode of
    order 1 only: forward mode (``jax.jvp``, ``jax.jacfwd``) and higher derivatives raise there (trace them
    inside :func:`jaxfox.use_reference`).

    Raises:
      TypeError: ``params`` is not a dict, an input is not float32/bfloat16, a parameter is not a float32 array,
        or eps is not a concrete real scalar (a bool, a string, a traced value).
      ValueError: wrong shapes (the message names the argument), ``params`` missing a leaf of :func:`grn_init`
        (or having ``skip_w``/``skip_b`` with I == O), a context missing or unexpected for ``params``, or eps
        is not a positive normal float32 (0 < eps, float32(eps) neither 0, subnormal nor inf).
    """
    eps = positive_float32("eps", eps)
    I, C, H, O = _grn_sizes(params, "params")
    _check_input("a", a, 1, (I,))
    lead = tuple(a.shape[:-1])
    context = _check_context(context, C, lead)
    a, context = _common_dtype(a, context)
    R = math.prod(lead)  # symbolic under jax.export shape polymorphism (int(np.prod(lead)) raised there)
    a2 = a.reshape(R, I).astype(jnp.float32)  # once: a bfloat16 a gets its float32 gradient rounded once
    # float32 before the broadcast: a bfloat16 context's gradient is summed over the broadcast dims in float32
    c2 = jnp.broadcast_to(context.astype(jnp.float32), lead + (C,)).reshape(R, C) if C else None
    y = _grn_apply(params, a2, c2, eps)
    return y.reshape(lead + (O,))
