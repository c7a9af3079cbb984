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

The op is pure JAX, compiled by XLA, on every platform (CPU and GPU alike); gradients are JAX autodiff
of it. jaxfox has no CUDA kernel for it: a fused VSN kernel was measured slower than XLA on the H200
(BENCHMARKS.md, "2026-11-29 — attention_pool, GRN and VSN kernels": 0.35x at 2048 rows, 0.25x at
16384, m = 48, d = 16, Hd = O = 128) and is not part of the package.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from jaxfox.grn import (
    _check_context, _check_eps, _check_input, _common_dtype, _grn_reference, _grn_sizes, _positive_int, grn_init,
    layer_norm,
)

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


def _vsn_reference(params, xs, c, eps):
    """xs [..., m, d], c [..., C] or None -> (out [..., O], v [..., m]) float32."""
    m, d = xs.shape[-2:]
    xs = xs.astype(jnp.float32)  # once: a bfloat16 xs gets its float32 gradient rounded once
    logits = _grn_reference(params["selection"], xs.reshape(xs.shape[:-2] + (m * d,)), c, eps)
    v = jax.nn.softmax(logits, axis=-1)
    y = _grn_stacked_reference(params["variables"], xs, eps)
    return jnp.sum(v[..., None] * y, axis=-2), v


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

    Differentiable in params, xs and context (JAX autodiff). Pure JAX (XLA) on every platform:
    there is no CUDA kernel for this op (module docstring).

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
    c2 = jnp.broadcast_to(context, lead + (C,)).reshape(R, C) if C else None
    out, v = _vsn_reference(params, xs.reshape((R, m, d)), c2, eps)
    return out.reshape(lead + (O,)), v.reshape(lead + (m,))
