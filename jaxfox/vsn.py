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

On CUDA (``ffi/vsn.cu``) the forward is GRN_v's fused kernel with a softmax epilogue plus one
kernel that runs every tile of rows through the per-variable GRNs in shared memory and
accumulates v_j xi~_j; the backward recomputes each variable's activations per tile (nothing of
size [..., m, hidden] is stored) and reduces parameter-gradient partials with ``reduce_axis0``
in a fixed order.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from jaxfox._ffi import dispatch, ffi_call as _ffi_call, psum_to_match
from jaxfox.grn import (
    _check_context, _check_eps, _check_input, _common_dtype, _flatten, _grn_reference, _grn_sizes,
    _best_split, _layout, _Layout, _MAX_PARTIAL_FLOATS, _positive_int, _smem_bytes, _tile_rows, _transpose_flat, _wave,
    grn_init,
    layer_norm,
)
from jaxfox.reduce import reduce_chunks

# The CUDA kernels for this op (ffi/grn.cu, ffi/vsn.cu) are not part of the package yet: on the H200
# they were slower than XLA (BENCHMARKS.md) and their GPU tests have not all passed. Until then every
# platform runs the reference implementation below.
_KERNELS_ENABLED = False

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
      ValueError: a size is not a positive int.
    """
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
        raise ValueError("params must be the dict returned by vsn_init (keys 'selection', 'variables')")
    var = params["variables"]
    if not isinstance(var, dict) or "w2" not in var or not hasattr(var["w2"], "shape") or len(var["w2"].shape) != 3:
        raise ValueError("params['variables'] must hold the stacked per-variable GRNs of vsn_init "
                         "('w2' of shape [m, d, Hd])")
    m = var["w2"].shape[0]
    d, C0, H, O = _grn_sizes(var, "params['variables']", lead=(m,))
    if C0:
        raise ValueError("params['variables'] must not have a context weight 'w3' (the per-variable GRNs "
                         "take no context)")
    I_s, C, H_s, O_s = _grn_sizes(params["selection"], "params['selection']")
    if I_s != m * d or O_s != m or H_s != H:
        raise ValueError(f"params['selection'] must be a GRN with input m*d={m * d}, hidden {H} and output "
                         f"m={m}; got input {I_s}, hidden {H_s}, output {O_s}")
    return m, d, H, O, C


# ----------------------------------------------------------------------------------------------
# Reference (pure JAX).
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


def _vsn_reference(params, xs, c, eps):
    """xs [..., m, d], c [..., C] or None -> (out [..., O], v [..., m]) float32."""
    m, d = xs.shape[-2:]
    xs = xs.astype(jnp.float32)  # once: a bfloat16 xs gets its float32 gradient rounded once
    logits = _grn_reference(params["selection"], xs.reshape(xs.shape[:-2] + (m * d,)), c, eps)
    v = jax.nn.softmax(logits, axis=-1)
    y = _grn_stacked_reference(params["variables"], xs, eps)
    return jnp.sum(v[..., None] * y, axis=-2), v


# ----------------------------------------------------------------------------------------------
# Kernel path: selection params as one flat vector (jaxfox.grn layout), the m variable GRNs as m
# such vectors back to back ([m * Pv]).
class _VsnCfg(NamedTuple):
    sel: _Layout
    var: _Layout
    m: int
    eps: float
    tile_rows_sel: int
    tile_rows_var: int
    groups: int
    chunks_sel: int
    chunks_var: int


def _vsn_config(m, d, H, O, C, R, eps):
    if R == 0:
        return None
    sel, var = _layout(m * d, C, H, m), _layout(d, 0, H, O)
    TRs = _tile_rows(sel, R, ("fwd", "bwd"))
    # Per-variable kernels: 32-row tiles whenever they fit (each tile reads every variable's
    # weights from L2 and, backward, updates its gradient partial there: per row, half the
    # traffic of 16-row tiles); parallelism comes from the variable axis.
    TRv = _tile_rows(var, R, ("fwd_var", "bwd"), min_rows_for_32=0)
    if TRs is None or TRv is None:
        return None
    tiles_s, tiles_v = -(-R // TRs), -(-R // TRv)
    # forward: grid (row tiles, groups of variables); time ~ waves x variables per block
    groups = _best_split(m, tiles_v, _wave(_smem_bytes(var, TRv, "fwd_var")))
    chunks_sel = _best_split(tiles_s, 1, _wave(_smem_bytes(sel, TRs, "bwd")), _MAX_PARTIAL_FLOATS // sel.P)
    # backward: grid (row chunks, variables); time ~ waves x tiles per block
    chunks_var = _best_split(tiles_v, m, _wave(_smem_bytes(var, TRv, "bwd")), _MAX_PARTIAL_FLOATS // (m * var.P))
    return _VsnCfg(sel, var, m, eps, TRs, TRv, groups, chunks_sel, chunks_var)


def _flatten_vars(lay, p):
    return jax.vmap(lambda q: _flatten(lay, q))(p).reshape(-1)


def _vsn_attrs(cfg):
    return dict(num_vars=np.int64(cfg.m), var_size=np.int64(cfg.var.I), hidden_size=np.int64(cfg.var.H),
                output_size=np.int64(cfg.var.O), context_size=np.int64(cfg.sel.C),
                tile_rows_sel=np.int64(cfg.tile_rows_sel), tile_rows_var=np.int64(cfg.tile_rows_var),
                eps=np.float32(cfg.eps))


def _vsn_fwd_call(cfg, wsel, wvar, xs, c):
    R, f32 = xs.shape[0], jnp.float32
    sel, var = cfg.sel, cfg.var
    G = cfg.groups
    out = (jax.ShapeDtypeStruct((R, var.O), f32),               # out
           jax.ShapeDtypeStruct((R, cfg.m), f32),               # weights v
           jax.ShapeDtypeStruct((R, sel.H4), f32),              # GRN_v eta2
           jax.ShapeDtypeStruct((R, sel.H4), f32),              # GRN_v eta1
           jax.ShapeDtypeStruct((R, 2 * sel.O4), f32),          # GRN_v g
           jax.ShapeDtypeStruct((R, sel.O4), f32),              # GRN_v xhat
           jax.ShapeDtypeStruct((R,), f32),                     # GRN_v rstd
           jax.ShapeDtypeStruct((G * R * var.O if G > 1 else 0,), f32))  # workspace: group sums
    return _ffi_call("jaxfox_vsn_fwd", out, vmap_method="broadcast_all")(
        wsel, wvar, xs, c, groups=np.int64(G), **_vsn_attrs(cfg))


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _vsn_kernel(cfg, wsel, wvar, xs, c):
    out, v, *_ = _vsn_fwd_call(cfg, wsel, wvar, xs, c)
    return out, v


def _vsn_kernel_fwd(cfg, wsel, wvar, xs, c):
    out, v, eta2, eta1, g, xhat, rstd, _ = _vsn_fwd_call(cfg, wsel, wvar, xs, c)
    return (out, v), (wsel, wvar, xs, c, v, eta2, eta1, g, xhat, rstd)


def _vsn_kernel_bwd(cfg, res, cts):
    wsel, wvar, xs, c, v, eta2, eta1, g, xhat, rstd = res
    dout, dv = cts
    sel, var, m = cfg.sel, cfg.var, cfg.m
    R, f32 = xs.shape[0], jnp.float32
    Ps, Pv = sel.P, m * var.P
    Ss, Sv = cfg.chunks_sel, cfg.chunks_var
    rcs, rcv = reduce_chunks(Ss, Ps), reduce_chunks(Sv, Pv)
    wsel_t = _transpose_flat(sel, wsel)
    wvar_t = jax.vmap(lambda q: _transpose_flat(var, q))(wvar.reshape(m, var.P)).reshape(-1)
    bf16 = xs.dtype == jnp.bfloat16
    out = (jax.ShapeDtypeStruct((Ps,), f32),                              # dw_sel
           jax.ShapeDtypeStruct((Pv,), f32),                              # dw_var
           jax.ShapeDtypeStruct(xs.shape, xs.dtype),                      # dxs
           jax.ShapeDtypeStruct(c.shape, c.dtype),                        # dc
           jax.ShapeDtypeStruct((R, m), f32),                             # workspace: <dout, y_j>
           jax.ShapeDtypeStruct((R * xs.shape[1] if bf16 else 0,), f32),  # workspace: float32 dxs
           jax.ShapeDtypeStruct((Ss, Ps), f32),                           # workspace: partials (sel)
           jax.ShapeDtypeStruct((Sv, Pv), f32),                           # workspace: partials (var)
           jax.ShapeDtypeStruct((rcs * Ps if rcs > 1 else 0,), f32),      # workspace: reduce (sel)
           jax.ShapeDtypeStruct((rcv * Pv if rcv > 1 else 0,), f32))      # workspace: reduce (var)
    dwsel, dwvar, dxs, dc, *_ = _ffi_call("jaxfox_vsn_bwd", out, vmap_method="broadcast_all")(
        wsel, wsel_t, wvar, wvar_t, xs, c, v, eta2, eta1, g, xhat, rstd, dout.astype(f32), dv.astype(f32),
        chunks_sel=np.int64(Ss), chunks_var=np.int64(Sv), reduce_chunks_sel=np.int64(rcs),
        reduce_chunks_var=np.int64(rcv), **_vsn_attrs(cfg))
    return psum_to_match((dwsel, dwvar, dxs, dc), (wsel, wvar, xs, c))


_vsn_kernel.defvjp(_vsn_kernel_fwd, _vsn_kernel_bwd)


# ----------------------------------------------------------------------------------------------
def vsn(params, xs, context=None, *, eps=1e-5):
    """Variable selection network: xs [..., m, d] -> (out [..., O], weights [..., m]), float32.

    Math: module docstring (TFT eqs. 6-8, google-research ``lstm_combine_and_mask``).

    Args:
      params: from :func:`vsn_init` (float32).
      xs: [..., m, d] float32 or bfloat16: the m variables, each embedded to width d
        (e.g. [B, T, m, d]).
      context: [..., C] (leading dims broadcast to xs.shape[:-2], e.g. [B, 1, C] for a static
        context of [B, T, m, d] inputs), fed to the selection GRN only; required iff
        ``params['selection']`` has ``w3``.
      eps: LayerNorm epsilon of every GRN (> 0).

    Returns:
      out [..., O] float32: sum_j weights_j * GRN_j(xs[..., j, :]).
      weights [..., m] float32: softmax selection weights (they sum to 1; exactly 1 when m = 1).
      bfloat16 inputs: float32 products, accumulation and statistics, float32 outputs; the
      gradient with respect to bfloat16 xs is the float32 gradient rounded once.

    Differentiable in params, xs and context (custom_vjp over the CUDA kernels; autodiff of the
    reference elsewhere).

    Raises:
      TypeError: an input is not float32/bfloat16, a parameter is not float32, eps not a number.
      ValueError: wrong shapes (the message names the argument), a context missing or unexpected,
        inconsistent params, or eps <= 0.
    """
    eps = _check_eps(eps)
    m, d, H, O, C = _vsn_sizes(params)
    _check_input("xs", xs, 2, (m, d))
    lead = tuple(xs.shape[:-2])
    context = _check_context(context, C, lead, "params['selection']")
    xs, context = _common_dtype(xs, context)
    R = int(np.prod(lead, dtype=np.int64))
    cfg = _vsn_config(m, d, H, O, C, R, eps)
    c2 = (jnp.broadcast_to(context, lead + (C,)).reshape(R, C) if C else jnp.zeros((R, 0), xs.dtype))

    def reference(params, xs, c2):
        out, v = _vsn_reference(params, xs, c2 if C else None, eps)
        return out.reshape(-1, O), v.reshape(-1, m)  # -1: the local rows under shard_map

    def kernel(params, xs, c2):
        return _vsn_kernel(cfg, _flatten(cfg.sel, params["selection"]), _flatten_vars(cfg.var, params["variables"]),
                           xs.reshape(xs.shape[0], m * d), c2)

    xs_r = xs.reshape((R, m, d))
    use_kernel = cfg is not None and _KERNELS_ENABLED
    out, v = dispatch(kernel if use_kernel else reference, reference, params, xs_r, c2, batch=(False, True, True))
    return out.reshape(lead + (O,)), v.reshape(lead + (m,))
