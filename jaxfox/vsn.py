"""Variable selection network (VSN) of the Temporal Fusion Transformer.

Lim et al. 2021 (Int. J. Forecasting), eqs. (6)-(8), in the form of google-research
``tft/libs/tft_model.py`` (``lstm_combine_and_mask`` / ``static_combine_and_mask``): with m input
variables, each already embedded to width d,

    Xi   = flatten(xi_1, ..., xi_m)                 [..., m*d]
    v    = softmax_m(GRN_v(Xi, c))                  [..., m]    GRN_v: input m*d, output m
    xi~_j = GRN_j(xi_j)                             [..., O]    one GRN per variable, no context
    out  = sum_j v_j xi~_j                          [..., O]

GRN as in :mod:`jaxfox.grn` (skip Dense when input and output widths differ, identity otherwise;
so GRN_v uses a Dense skip unless d = 1, and GRN_j unless d = O). The m per-variable GRNs have
stacked parameters (leading axis m) and run as one batched computation. With m = 1 the weight is
exactly 1.

Kernels (``ffi/vsn.cu``): on a CUDA device the m per-variable GRNs, the bulk of the op, run as one fused
forward kernel (``jaxfox_vsn_grn_fwd``) and one fused backward kernel (``jaxfox_vsn_grn_bwd``, which
recomputes the forward of its rows and writes per-row-range parameter partials that ``LaunchReduceAxis0``
sums in a fixed order: no atomics) when every GRN width is small, d, Hd, O <= 32 (the main job's
m = 48, d = 4, Hd = O = 32: fwd+bwd 1.24x the XLA reference at 2048 rows, 1.03x at 16384 on the H200,
BENCHMARKS.md "eleventh session"). The selection GRN with its softmax is XLA code by default; with
``JAXFOX_OPT_IN_KERNELS=grn`` it runs :mod:`jaxfox.grn`'s opt-in kernels (``ffi/grn.cu``, softmax fused) when
it has no context and its widths fit (input m d <= 256, Hd <= 64, output m <= 64; the main job's 192, 32, 48;
slower than XLA so far, see :mod:`jaxfox.grn`). The forward's weighted sum is XLA code. The weighted sum's
backward is in the backward kernel: it takes v [R, m] and d out [R, O] instead of the [R, m, O] cotangent of the
GRNs' outputs (dy = v * d out, formed in registers) and returns d v [R, m] (sum_o d out * y, from its recomputed
y). Wider GRNs (the issue's bench shape d = 16, Hd = O = 128) run the pure-JAX reference by default: there XLA's
TF32 tensor-core matmuls beat the CUDA-core kernels (a fused VSN kernel measured 0.35x at 2048 rows,
BENCHMARKS.md "2026-11-29"). With ``JAXFOX_OPT_IN_KERNELS=grn``, at the default matmul precision, per-variable
GRNs of the widths d in {16, 32, 64, 128}, Hd and O in {32, 64, 128} (the bench shape among them) run
:mod:`jaxfox.grn`'s TF32 tensor-core kernels vmapped over the m variables (:func:`_combine_tc`; slower than XLA so
far: 0.97x at m = 48, d = 16, Hd = O = 128, 2048 rows, 0.90x at 16384, on an H100, BENCHMARKS.md
"thirty-fourth session").
Off CUDA, or under :func:`jaxfox.use_reference`, the reference runs and its gradients are JAX autodiff.
"""

from __future__ import annotations

import functools
import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from jaxfox._ffi import dispatch, ffi_call as _ffi_call, kernel_opted_in, psum_to_match
from jaxfox._validate import check_key, float32_param_dtype, positive_float32, positive_int as _positive_int
from jaxfox.grn import (
    _FLAT_KEYS, _TcCfg, _check_context, _check_input, _common_dtype, _grn_apply, _grn_sizes, _grn_tc, _tc_params,
    _tc_routed, grn_init, layer_norm,
)
from jaxfox.reduce import backward_tiling, reduce_chunks

__all__ = ["vsn_init", "vsn"]


def vsn_init(key, num_vars, var_size, hidden_size, output_size, *, context_size=None, dtype=jnp.float32):
    """Parameters of a VSN (google-research TFT initialisation, see :func:`jaxfox.grn_init`).

    Args:
      key: a ``jax.random`` key.
      num_vars: m, number of input variables.  var_size: d, embedding width of each variable.
      hidden_size: Hd of every GRN.  output_size: O, width of the combined output.
      context_size: C of the optional (static) context fed to the selection GRN; None for none.
      dtype: float32.

    Returns:
      dict with
        ``"selection"``: :func:`jaxfox.grn_init` params of GRN_v (input m*d, hidden Hd, output m,
          context C; skip Dense ``skip_w`` [m*d, m] unless d = 1);
        ``"variables"``: the m per-variable GRNs (input d, hidden Hd, output O, no context) with
          every leaf stacked along a leading axis of size m: ``w2`` [m, d, Hd], ``b2`` [m, Hd],
          ``w1`` [m, Hd, Hd], ``b1`` [m, Hd], ``w4``/``w5`` [m, Hd, O], ``b4``/``b5`` [m, O],
          ``skip_w`` [m, d, O] and ``skip_b`` [m, O] (unless d = O), ``gamma``/``beta`` [m, O].

    Raises:
      ValueError: a size is not a positive int, or key is a batch of keys.
      TypeError: dtype is not float32, or key is not a jax.random key.
    """
    check_key(key, "vsn_init: ")
    dtype = float32_param_dtype("vsn_init", dtype)
    m = _positive_int("num_vars", num_vars)
    d = _positive_int("var_size", var_size)
    H = _positive_int("hidden_size", hidden_size)
    O = _positive_int("output_size", output_size)
    ks, kv = jax.random.split(key)
    sel = grn_init(ks, m * d, H, m, context_size=context_size, dtype=dtype)
    var = jax.vmap(lambda k: grn_init(k, d, H, O, dtype=dtype))(jax.random.split(kv, m))
    return {"selection": sel, "variables": var}


def _vsn_sizes(params):
    """Validates VSN params; returns (m, d, H, O, C)."""
    if not isinstance(params, dict) or "selection" not in params or "variables" not in params:
        raise ValueError("params must be the dict returned by vsn_init (keys 'selection', 'variables'), got "
                         f"{sorted(map(str, params)) if isinstance(params, dict) else type(params).__name__}")
    var = params["variables"]
    if not isinstance(var, dict) or "w2" not in var or not hasattr(var["w2"], "shape") or len(var["w2"].shape) != 3:
        raise ValueError("params['variables'] must hold the stacked per-variable GRNs of vsn_init "
                         "('w2' of shape [m, d, Hd])")
    m = var["w2"].shape[0]
    d, C0, H, O = _grn_sizes(var, "params['variables']", lead=(m,), init="vsn_init")
    if C0:
        raise ValueError("params['variables'] must not have a context weight 'w3' (the per-variable GRNs "
                         "take no context)")
    I_s, C, H_s, O_s = _grn_sizes(params["selection"], "params['selection']", init="vsn_init")
    if I_s != m * d or O_s != m or H_s != H:
        raise ValueError(f"params['selection'] and params['variables'] do not match: params['variables'] holds "
                         f"m={m} GRNs of input d={d} and hidden {H}, so the selection GRN must have input m*d={m * d}, "
                         f"hidden {H} and output m={m}; params['selection'] has input {I_s}, hidden {H_s}, output "
                         f"{O_s} (pass the dict of one vsn_init call)")
    return m, d, H, O, C


# ----------------------------------------------------------------------------------------------
# Implementation (pure JAX).
def _grn_stacked_reference(p, x, eps):
    """m GRNs with stacked params (leading m) on x [..., m, I] -> [..., m, O], float32.

    Computed variable-major ([m, R, .] with R the flattened leading dims): one transpose in and one out,
    and every product a matmul batched over m. (The row-major einsum form had XLA transpose around each of
    the five products; on the 2-core CPU this form is 3.7x faster forward and 2.9x forward + backward at
    R = 2048, m = 48, I = 4, H = O = 32.)"""
    x = x.astype(jnp.float32)
    *lead, m, i = x.shape
    xt = jnp.moveaxis(x.reshape(-1, m, i), 1, 0)                                   # [m, R, I]

    def dense(a, w, b):  # a [m, R, K] @ w [m, K, N] + b [m, N]
        return jnp.matmul(a, p[w]) + p[b][:, None, :]

    eta2 = jax.nn.elu(dense(xt, "w2", "b2"))
    eta1 = dense(eta2, "w1", "b1")
    glu = dense(eta1, "w4", "b4") * jax.nn.sigmoid(dense(eta1, "w5", "b5"))
    skip = dense(xt, "skip_w", "skip_b") if "skip_w" in p else xt
    y = layer_norm(skip + glu, p["gamma"][:, None, :], p["beta"][:, None, :], eps)   # [m, R, O]
    return jnp.moveaxis(y, 0, 1).reshape(*lead, m, y.shape[-1])


# ----------------------------------------------------------------------------------------------
# Kernel path of the stacked per-variable GRNs (ffi/vsn.cu). Per variable, the parameters travel as one
# row of a [m, P] float32 matrix, in the order of jaxfox.grn._FLAT_KEYS (each leaf row-major; skip_w/skip_b
# only when d != O), the layout ffi/common.h's GrnParamLayout describes.
KERNEL_MAX_WIDTH = 32
"""The kernel path runs when d, Hd and O are all <= this (ffi/vsn.cu kMaxWidth); wider GRNs run the reference."""
_ROW_TILE = 64           # ffi/vsn.cu kRowTile: rows per tile
_TARGET_BWD_BLOCKS = 512  # backward CTAs aimed at (each sums `tiles_per_block` row tiles before writing a partial)


class _StackCfg(NamedTuple):
    hidden_size: int
    output_size: int
    eps: float


def _stack_flat(p):
    m = p["w2"].shape[0]
    return jnp.concatenate([p[k].reshape(m, -1) for k in _FLAT_KEYS if k in p], axis=1)


def _stack_attrs(cfg):
    return dict(hidden_size=np.int64(cfg.hidden_size), output_size=np.int64(cfg.output_size),
                eps=np.float32(cfg.eps))


def _bwd_tiling(R, m):
    """(tiles_per_block, blocks) of the backward grid over ceil(R / 64) row tiles, m CTAs (one a variable) a tile
    (:func:`jaxfox.reduce.backward_tiling`)."""
    return backward_tiling(R, _ROW_TILE, _TARGET_BWD_BLOCKS, m)


def _weighted_sum(v, y):
    """sum_j v[..., j] y[..., j, :]: v [..., m], y [..., m, O] -> [..., O] (TFT eq. 8), on both paths."""
    return jnp.sum(v[..., None] * y, axis=-2)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _combine_kernel(cfg, wflat, x, v):
    """sum_j v[r, j] GRN_j(x[r, j]): the forward kernel's y [R, m, O], then XLA's weighted sum -> [R, O]."""
    R, m, _ = x.shape
    y = _ffi_call("jaxfox_vsn_grn_fwd", jax.ShapeDtypeStruct((R, m, cfg.output_size), jnp.float32),
                  vmap_method="broadcast_all")(wflat, x, **_stack_attrs(cfg))
    return _weighted_sum(v, y)


def _combine_kernel_fwd(cfg, wflat, x, v):
    return _combine_kernel(cfg, wflat, x, v), (wflat, x, v)


def _combine_kernel_bwd(cfg, res, dout):
    wflat, x, v = res
    R, m, d = x.shape
    P = wflat.shape[1]
    per, blocks = _bwd_tiling(R, m)
    chunks = reduce_chunks(blocks, m * P)
    f32 = jnp.float32
    out = (jax.ShapeDtypeStruct((m, P), f32),                               # dw (reduced)
           jax.ShapeDtypeStruct((R, m, d), x.dtype),                        # dx
           jax.ShapeDtypeStruct((R, m), f32),                               # dv
           jax.ShapeDtypeStruct((blocks, m * P), f32),                      # workspace: per-block partials
           jax.ShapeDtypeStruct((chunks * m * P if chunks > 1 else 0,), f32))  # workspace: reduce_axis0
    dw, dx, dv, *_ = _ffi_call("jaxfox_vsn_grn_bwd", out, vmap_method="broadcast_all")(
        wflat, x, v, dout.astype(f32), tiles_per_block=np.int64(per), chunks=np.int64(chunks), **_stack_attrs(cfg))
    return psum_to_match((dw, dx, dv), (wflat, x, v))


_combine_kernel.defvjp(_combine_kernel_fwd, _combine_kernel_bwd)


def _kernel_fits(m, d, H, O):
    """Widths the kernels take (<= KERNEL_MAX_WIDTH) and a variable count that fits the grid (<= 65535). A jax.vmap
    over more than 65535 instances is refused by the kernels at run time (an XLA error naming the limit)."""
    return max(d, H, O) <= KERNEL_MAX_WIDTH and m <= 65535


def _combine_tc(cfg, p, x, v):
    """sum_j v[r, j] GRN_j(x[r, j]) by :mod:`jaxfox.grn`'s TF32 kernels (``jaxfox_grn_tc_fwd``/``_bwd``), vmapped
    over the m variables (one call each way with a leading instance axis m; the weight gradients XLA's batched
    GEMMs over the m instances): p stacked (leading m), x [R, m, d], v [R, m] float32 -> [R, O] float32."""
    y = jax.vmap(lambda q, xt: _grn_tc(cfg, q, xt))(_tc_params(p), jnp.moveaxis(x, 1, 0))     # [m, R, O]
    return _weighted_sum(v, jnp.moveaxis(y, 0, 1))


def _grn_combined(p, x, v, eps):
    """The m per-variable GRNs combined by the selection weights: x [R, m, d], v [R, m] float32 -> [R, O]
    float32, sum_j v[r, j] GRN_j(x[r, j]): the fused kernels on CUDA when the widths fit
    (:data:`KERNEL_MAX_WIDTH`); else, when ``JAXFOX_OPT_IN_KERNELS`` names ``grn`` and at the default matmul
    precision, :func:`_combine_tc` for the widths of :func:`jaxfox.grn._tc_fits` (d in {16, 32, 64, 128}, Hd and O
    in {32, 64, 128}); else (and off CUDA) :func:`_grn_stacked_reference` and the weighted sum."""
    R, m, d = x.shape
    H, O = p["w1"].shape[-1], p["w4"].shape[-1]

    def reference(p, x, v):
        return _weighted_sum(v, _grn_stacked_reference(p, x, eps))

    if not isinstance(R, int) or R == 0:  # (a symbolic R, jax.export shape polymorphism: no kernel grid for it)
        return reference(p, x, v)
    if _kernel_fits(m, d, H, O):
        def kernel(p, x, v):
            return _combine_kernel(_StackCfg(H, O, float(eps)), _stack_flat(p), x, v)
    elif kernel_opted_in("grn") and m <= 65535 and _tc_routed(d, 0, H, O):
        def kernel(p, x, v):
            return _combine_tc(_TcCfg(H, O, float(eps)), p, x, v)
    else:
        return reference(p, x, v)
    return dispatch(kernel, reference, p, x, v, batch=(False, True, True))


def _vsn_apply(params, xs, c, eps):
    """xs [..., m, d], c [..., C] or None -> (out [..., O], v [..., m]) float32 (the per-variable GRNs by
    :func:`_grn_combined`: the kernels where they apply, else the reference)."""
    m, d = xs.shape[-2:]
    xs = xs.astype(jnp.float32)  # once: a bfloat16 xs gets its float32 gradient rounded once
    # the selection GRN and its softmax: ffi/grn.cu's kernels (softmax fused) when opted in and they apply
    v = _grn_apply(params["selection"], xs.reshape(xs.shape[:-2] + (m * d,)), c, eps, softmax=True)
    return _grn_combined(params["variables"], xs, v, eps), v


# ----------------------------------------------------------------------------------------------
def vsn(params, xs, context=None, *, eps=1e-5):
    """Variable selection network: xs [..., m, d] -> (out [..., O], weights [..., m]), float32.

    Math: the docstring of module ``jaxfox.vsn`` (TFT eqs. 6-8, google-research ``lstm_combine_and_mask``;
    ``jaxfox.vsn`` names this function, so read it as ``sys.modules["jaxfox.vsn"].__doc__``).

    Args:
      params: from :func:`vsn_init` (float32).
      xs: [..., m, d] float32 or bfloat16: the m variables, each embedded to width d
        (e.g. [B, T, m, d]; the leading dims may be symbolic, as in ``jax.export`` shape polymorphism, and then
        the reference runs: the kernels need a concrete row count).
      context: [..., C] (one axis per dim of xs.shape[:-2], each broadcasting to it, e.g. [B, 1, C] for a static
        context of [B, T, m, d] inputs; [B, C] is refused there), fed to the selection GRN only; required iff
        ``params['selection']`` has ``w3``.
      eps: LayerNorm epsilon of every GRN (> 0).

    Returns:
      out [..., O] float32: sum_j weights_j * GRN_j(xs[..., j, :]).
      weights [..., m] float32: softmax selection weights (they sum to 1; exactly 1 when m = 1).
      bfloat16 inputs: float32 products, accumulation and statistics, float32 outputs; the
      gradient with respect to bfloat16 xs is the float32 gradient rounded once.

    Differentiable in params, xs and context. On CUDA with d, Hd, O <= 32 the per-variable GRNs run the
    fused kernels of ``ffi/vsn.cu`` (forward and a ``jax.custom_vjp`` backward, parameter gradients summed
    in a fixed order: bitwise reproducible); everything else is XLA code with JAX autodiff (module
    docstring). Reverse mode of order 1 (``jax.grad``, ``jax.vjp``) everywhere; forward mode (``jax.jvp``,
    ``jax.jacfwd``) and higher derivatives (``jax.hessian``) only off the kernel path: on CUDA with those
    widths (the default there, not an opt-in) they raise (e.g. "can't apply forward-mode autodiff (jvp) to
    a custom_vjp function"); trace them inside :func:`jaxfox.use_reference` for the XLA path.

    Raises:
      TypeError: an input is not float32/bfloat16, a parameter is not float32, eps not a concrete real scalar.
      ValueError: wrong shapes (the message names the argument), a context missing or unexpected,
        inconsistent params, or eps is not a positive finite float32 (0 < eps, float32(eps) neither 0 nor inf).
    """
    eps = positive_float32("eps", eps)
    m, d, H, O, C = _vsn_sizes(params)
    _check_input("xs", xs, 2, (m, d))
    lead = tuple(xs.shape[:-2])
    context = _check_context(context, C, lead, "params['selection']")
    xs, context = _common_dtype(xs, context)
    R = math.prod(lead)  # symbolic under jax.export shape polymorphism (int(np.prod(lead)) raised there)
    # float32 before the broadcast: a bfloat16 context's gradient is summed over the broadcast dims in float32
    c2 = jnp.broadcast_to(context.astype(jnp.float32), lead + (C,)).reshape(R, C) if C else None
    out, v = _vsn_apply(params, xs.reshape((R, m, d)), c2, eps)
    return out.reshape(lead + (O,)), v.reshape(lead + (m,))
