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

LayerNorm statistics are float32 and multi-pass (never E[x^2] - E[x]^2), computed on the row
shifted by its first element with a correction pass (:func:`layer_norm`; mathematically
identical, and rows with a large common offset such as 1449 +- 1 keep their digits). Dropout (used in the paper before the gate) is not part of the op.

On CUDA the whole chain runs per tile of rows in one kernel launch forward and one backward
(``ffi/grn.cu``): activations stay in shared memory, parameter gradients are per-row-chunk partials
summed by ``reduce_axis0`` in a fixed order (bitwise reproducible, no atomics). Elsewhere, and for
sizes the kernel's shared-memory buffers cannot hold, a pure-JAX reference runs.
"""

from __future__ import annotations

import functools
import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from jaxfox._ffi import dispatch, ffi_call as _ffi_call, psum_to_match
from jaxfox._validate import check_array as _check_array
from jaxfox.reduce import reduce_chunks

# The CUDA kernels for this op (ffi/grn.cu, ffi/vsn.cu) are not part of the package yet: on the H200
# they were slower than XLA (BENCHMARKS.md) and their GPU tests have not all passed. Until then every
# platform runs the reference implementation below.
_KERNELS_ENABLED = False

__all__ = ["grn_init", "grn", "layer_norm"]

_INPUT_DTYPES = (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16))
_REQUIRED = ("w2", "b2", "w1", "b1", "w4", "b4", "w5", "b5", "gamma", "beta")


# ----------------------------------------------------------------------------------------------
# Parameters.
def _positive_int(name, value):
    if not isinstance(value, (int, np.integer)) or isinstance(value, bool) or value < 1:
        raise ValueError(f"{name} must be an int >= 1, got {value!r}")
    return int(value)


def grn_init(key, input_size, hidden_size, output_size, *, context_size=None, dtype=jnp.float32):
    """Parameters of a GRN, initialised as google-research TFT (Keras defaults).

    Every weight matrix is glorot (xavier) uniform, U(-b, b) with b = sqrt(6 / (fan_in + fan_out))
    (Keras ``Dense`` default ``kernel_initializer``); every bias is zero (``bias_initializer``);
    LayerNorm ``gamma`` = 1 and ``beta`` = 0.

    Args:
      key: a ``jax.random`` key.
      input_size: I, width of ``a``.  hidden_size: Hd.  output_size: O.
      context_size: C, width of the optional context; None for a GRN without context.
      dtype: float32 (the kernels' parameter dtype).

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
      ValueError: a size is not a positive int.
    """
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


def _grn_sizes(params, name="params", lead=()):
    """Validates GRN params (each leaf with leading dims `lead`); returns (I, C, H, O), C = 0 without context."""
    if not isinstance(params, dict):
        raise TypeError(f"{name} must be the dict returned by grn_init, got {type(params).__name__}")
    missing = [k for k in _REQUIRED if k not in params]
    if missing:
        raise ValueError(f"{name} is missing {missing} (create it with grn_init)")
    lead = tuple(lead)
    w2 = params["w2"]
    _check_array(f"{name}['w2']", w2, lead + (None, None))
    I, H = w2.shape[-2:]
    _check_array(f"{name}['w4']", params["w4"], lead + (H, None))
    O = params["w4"].shape[-1]
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
                             "'skip_b' (create it with grn_init)")
        _check_array(f"{name}['skip_w']", params["skip_w"], lead + (I, O))
        _check_array(f"{name}['skip_b']", params["skip_b"], lead + (O,))
    elif "skip_w" in params or "skip_b" in params:
        raise ValueError(f"{name} has equal input and output widths ({I}): the skip is the identity, "
                         "so 'skip_w'/'skip_b' must not be present")
    return I, C, H, O


def _check_eps(eps):
    if isinstance(eps, bool) or not isinstance(eps, (int, float, np.integer, np.floating)):
        raise TypeError(f"eps must be a Python float, got {type(eps).__name__}")
    if not (math.isfinite(float(eps)) and float(eps) > 0.0):
        raise ValueError(f"eps must be a finite float > 0, got {eps!r}")
    return float(eps)


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
# Reference (pure JAX).
def layer_norm(x, gamma, beta, eps=1e-5):
    """LayerNorm over the last axis in float32: (x - mu) / sqrt(var + eps) * gamma + beta.

    x [..., O] float32; gamma, beta [O]. var = mean((x - mu)^2) (biased), never E[x^2] - E[x]^2,
    computed in passes over the row shifted by its first element: d = x - x0, dev = d - mean(d),
    then dev -= mean(dev) (zero up to the rounding of mean(d); it restores the digits when x0 is
    an outlier of a row with a large common offset), var = mean(dev^2). The same function as the
    textbook formula; the shift x0 and the correction mean(dev) are constants of the gradient,
    which is exact because the output does not depend on them. ffi/grn.cu computes the same way.
    """
    x0 = jax.lax.stop_gradient(x[..., :1])
    d = x - x0
    dev = d - jnp.mean(d, axis=-1, keepdims=True)
    dev = dev - jax.lax.stop_gradient(jnp.mean(dev, axis=-1, keepdims=True))
    var = jnp.mean(dev * dev, axis=-1, keepdims=True)
    return dev * jax.lax.rsqrt(var + eps) * gamma + beta


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
# Kernel path. Flat parameter vector (float32), segments in this order, every matrix row-major
# and zero padded to [K4, N4] (sizes rounded up to multiples of 4), every vector to N4:
#   wa [I4, NA] = [w2 | skip_w], ba [NA] = [b2 | skip_b]   (NA = H4 + O4 with a skip Dense, else H4)
#   wc [C4, H4] = w3 (absent: C4 = 0);  w1 [H4, H4], b1 [H4]
#   wg [H4, 2*O4] = [w4 | w5], bg [2*O4] = [b4 | b5];  gamma [O4], beta [O4]
# The backward also gets the "transposed" vector: same offsets, each matrix stored transposed.
_SMEM_BUDGET = 160 * 1024  # bytes of shared memory per block the kernels may use (A100: 163 KB)
_WAVE_BLOCKS = 132         # blocks per wave assumed when splitting rows (SMs of an H100 / H200)


def _r4(n):
    return (int(n) + 3) // 4 * 4


def _ld(n4):
    return n4 if (n4 // 4) % 2 == 1 else n4 + 4


class _Layout(NamedTuple):
    I: int
    C: int
    H: int
    O: int
    I4: int
    C4: int
    H4: int
    O4: int
    NA: int
    dense: bool
    segments: tuple  # ((name, offset, shape), ...)
    P: int


def _layout(I, C, H, O) -> _Layout:
    I4, C4, H4, O4 = _r4(I), _r4(C), _r4(H), _r4(O)
    dense = I != O
    NA = H4 + (O4 if dense else 0)
    shapes = (("wa", (I4, NA)), ("ba", (NA,)), ("wc", (C4, H4)), ("w1", (H4, H4)), ("b1", (H4,)),
              ("wg", (H4, 2 * O4)), ("bg", (2 * O4,)), ("gamma", (O4,)), ("beta", (O4,)))
    segs, off = [], 0
    for name, shape in shapes:
        segs.append((name, off, shape))
        off += int(np.prod(shape))
    return _Layout(I, C, H, O, I4, C4, H4, O4, NA, dense, tuple(segs), off)


def _smem_bytes(lay, TR, kind):
    """Shared memory of one block (ffi/grn.cu MakePlan): kind "fwd", "fwd_var" or "bwd"."""
    ldI, ldC = _ld(lay.I4), (_ld(lay.C4) if lay.C4 else 0)
    ldNA, ldH, ld2O, ldO = _ld(lay.NA), _ld(lay.H4), _ld(2 * lay.O4), _ld(lay.O4)
    per_row = ldI + ldC + ldNA + ldH + ld2O
    if kind == "bwd":  # xhat; dy (in the skip columns with a dense skip); deta2 (in g's buffer if it fits)
        per_row += ldO + (0 if lay.dense else ldO) + (0 if ld2O >= ldH else ldH)
    else:              # x (in the skip columns with a dense skip); the VSN accumulator
        per_row += (0 if lay.dense else ldO) + (ldO if kind == "fwd_var" else 0)
    return 4 * (TR * per_row + 2 * TR)


def _tile_rows(lay, R, kinds, min_rows_for_32=4096):
    """Rows per tile: 32 (weights read from L2 once per 32 rows) when R >= min_rows_for_32 and the
    buffers fit, else 16; None when not even 16 rows fit (the reference path runs then)."""
    for TR in ((32, 16) if R >= min_rows_for_32 else (16,)):
        if all(_smem_bytes(lay, TR, k) <= _SMEM_BUDGET for k in kinds):
            return TR
    return None


def _wave(smem_bytes):
    """Blocks the GPU runs at once (two per SM when two blocks' shared memory fits an H100/H200 SM)."""
    return _WAVE_BLOCKS * (2 if smem_bytes <= 110 * 1024 else 1)


def _best_split(items, blocks_per_part, wave, max_parts=None):
    """Splits `items` (tiles or variables) into p contiguous ranges of ceil(items / p).

    Estimated time of p parts: ceil(p * blocks_per_part / wave) * ceil(items / p) (waves of
    blocks times work per block). Picks the smallest p within 10% of the best estimate (fewer
    parts: smaller partial buffers), with no empty range. A fixed function of the shapes, so the
    summation order never depends on the device or the run.
    """
    items = int(items)
    top = items if max_parts is None else max(1, min(items, int(max_parts)))
    est = [-(-(p * blocks_per_part) // wave) * -(-items // p) for p in range(1, top + 1)]
    best_p = next(p for p, t in enumerate(est, 1) if t <= 1.1 * min(est))
    per = -(-items // best_p)
    return -(-items // per)


_MAX_PARTIAL_FLOATS = 1 << 26  # cap on a parameter-gradient partial buffer (256 MB)


def _flatten(lay, p):
    """GRN params (one GRN) -> the flat float32 vector [P] of the kernels (layout above)."""
    def m2(x, K4, N4):
        return jnp.pad(x, ((0, K4 - x.shape[0]), (0, N4 - x.shape[1])))

    def v1(x, N4):
        return jnp.pad(x, (0, N4 - x.shape[0]))

    wa, ba = m2(p["w2"], lay.I4, lay.H4), v1(p["b2"], lay.H4)
    if lay.dense:
        wa = jnp.concatenate([wa, m2(p["skip_w"], lay.I4, lay.O4)], axis=1)
        ba = jnp.concatenate([ba, v1(p["skip_b"], lay.O4)])
    wc = m2(p["w3"], lay.C4, lay.H4) if lay.C else jnp.zeros((0,), jnp.float32)
    wg = jnp.concatenate([m2(p["w4"], lay.H4, lay.O4), m2(p["w5"], lay.H4, lay.O4)], axis=1)
    bg = jnp.concatenate([v1(p["b4"], lay.O4), v1(p["b5"], lay.O4)])
    pieces = [wa, ba, wc, m2(p["w1"], lay.H4, lay.H4), v1(p["b1"], lay.H4), wg, bg,
              v1(p["gamma"], lay.O4), v1(p["beta"], lay.O4)]
    return jnp.concatenate([x.reshape(-1) for x in pieces])


def _transpose_flat(lay, w):
    """Flat vector [P] -> the same with every matrix segment transposed ([K4, N4] -> [N4, K4])."""
    pieces = []
    for _, off, shape in lay.segments:
        seg = w[off:off + int(np.prod(shape))]
        if len(shape) == 2:
            seg = seg.reshape(shape).T.reshape(-1)
        pieces.append(seg)
    return jnp.concatenate(pieces)


class _GrnCfg(NamedTuple):
    lay: _Layout
    eps: float
    tile_rows: int
    chunks: int


def _grn_attrs(cfg):
    lay = cfg.lay
    return dict(input_size=np.int64(lay.I), context_size=np.int64(lay.C), hidden_size=np.int64(lay.H),
                output_size=np.int64(lay.O), tile_rows=np.int64(cfg.tile_rows))


def _grn_fwd_call(cfg, w, a, c):
    lay, R, f32 = cfg.lay, a.shape[0], jnp.float32
    out = (jax.ShapeDtypeStruct((R, lay.O), f32),          # y
           jax.ShapeDtypeStruct((R, lay.H4), f32),         # eta2
           jax.ShapeDtypeStruct((R, lay.H4), f32),         # eta1
           jax.ShapeDtypeStruct((R, 2 * lay.O4), f32),     # g = [g4 | g5]
           jax.ShapeDtypeStruct((R, lay.O4), f32),         # xhat
           jax.ShapeDtypeStruct((R,), f32))                # rstd
    return _ffi_call("jaxfox_grn_fwd", out, vmap_method="broadcast_all")(
        w, a, c, eps=np.float32(cfg.eps), **_grn_attrs(cfg))


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _grn_kernel(cfg, w, a, c):
    return _grn_fwd_call(cfg, w, a, c)[0]


def _grn_kernel_fwd(cfg, w, a, c):
    y, *saved = _grn_fwd_call(cfg, w, a, c)
    return y, (w, a, c, *saved)


def _grn_kernel_bwd(cfg, res, dy):
    w, a, c, eta2, eta1, g, xhat, rstd = res
    lay, P, S = cfg.lay, cfg.lay.P, cfg.chunks
    rc = reduce_chunks(S, P)
    f32 = jnp.float32
    out = (jax.ShapeDtypeStruct((P,), f32),                          # dw
           jax.ShapeDtypeStruct(a.shape, a.dtype),                   # da
           jax.ShapeDtypeStruct(c.shape, c.dtype),                   # dc
           jax.ShapeDtypeStruct((S, P), f32),                        # workspace: chunk partials
           jax.ShapeDtypeStruct((rc * P if rc > 1 else 0,), f32))    # workspace: reduce_axis0
    dw, da, dc, _, _ = _ffi_call("jaxfox_grn_bwd", out, vmap_method="broadcast_all")(
        w, _transpose_flat(lay, w), a, c, eta2, eta1, g, xhat, rstd, dy.astype(f32),
        chunks=np.int64(S), reduce_chunks=np.int64(rc), **_grn_attrs(cfg))
    return psum_to_match((dw, da, dc), (w, a, c))


_grn_kernel.defvjp(_grn_kernel_fwd, _grn_kernel_bwd)


def _grn_config(lay, R, eps):
    """Kernel configuration for R rows, or None when the kernel cannot take these sizes."""
    if R == 0:
        return None
    TR = _tile_rows(lay, R, ("fwd", "bwd"))
    if TR is None:
        return None
    tiles = -(-R // TR)
    chunks = _best_split(tiles, 1, _wave(_smem_bytes(lay, TR, "bwd")), _MAX_PARTIAL_FLOATS // lay.P)
    return _GrnCfg(lay, eps, TR, chunks)


# ----------------------------------------------------------------------------------------------
def grn(params, a, context=None, *, eps=1e-5):
    """Gated residual network: a [..., I] (and context [..., C]) -> [..., O] float32.

    Math: module docstring (TFT eqs. 2-5, google-research ``gated_residual_network``).

    Args:
      params: from :func:`grn_init` (float32). The skip is the identity when I == O, else the
        learned ``skip_w``/``skip_b``; ``w3`` (context weight) present iff a context is used.
      a: [..., I] float32 or bfloat16 (any number of leading dims, e.g. [B, T, I]).
      context: [..., C] float32 or bfloat16 whose leading dims broadcast to a's (e.g. a static
        context [B, 1, C] for a [B, T, I]); required iff ``params`` has ``w3``.
      eps: LayerNorm epsilon (> 0). 1e-5 by default; google-research's Keras code effectively
        used 1e-3.

    Returns:
      [..., O] float32. bfloat16 inputs are promoted: every product, accumulation and statistic
      is float32 and the output is float32; the gradient with respect to a bfloat16 ``a`` (or
      context) is the float32 gradient rounded once to bfloat16. A float32/bfloat16 mix of ``a``
      and ``context`` is computed from float32 copies.

    Differentiable in params, a and context (``jax.custom_vjp`` over the forward and backward
    kernels on CUDA; autodiff of the reference elsewhere).

    Raises:
      TypeError: an input is not float32/bfloat16, a parameter is not float32, or eps is not a number.
      ValueError: wrong shapes (the message names the argument), a context missing or unexpected
        for ``params``, or eps <= 0.
    """
    eps = _check_eps(eps)
    I, C, H, O = _grn_sizes(params, "params")
    _check_input("a", a, 1, (I,))
    lead = tuple(a.shape[:-1])
    context = _check_context(context, C, lead)
    a, context = _common_dtype(a, context)
    R = int(np.prod(lead, dtype=np.int64))
    lay = _layout(I, C, H, O)
    cfg = _grn_config(lay, R, eps)
    a2 = a.reshape(R, I)
    c2 = (jnp.broadcast_to(context, lead + (C,)).reshape(R, C) if C else jnp.zeros((R, 0), a.dtype))

    def reference(params, a2, c2):
        return _grn_reference(params, a2, c2 if C else None, eps)

    def kernel(params, a2, c2):
        return _grn_kernel(cfg, _flatten(lay, params), a2, c2)

    use_kernel = cfg is not None and _KERNELS_ENABLED
    y = dispatch(kernel if use_kernel else reference, reference, params, a2, c2, batch=(False, True, True))
    return y.reshape(lead + (O,))
