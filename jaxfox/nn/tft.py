"""flax.nnx modules of the Temporal Fusion Transformer blocks: ``GRN``, ``VSN``, ``AttentionPool``.

Each module only holds its parameters (``nnx.Param``, initialised by the functional op's ``*_init``
from the ``params`` stream of the ``nnx.Rngs`` it is given) and calls the functional op, so it runs
the CUDA kernels on a GPU and the pure-JAX reference elsewhere, exactly like the op:

    GRN            -> :func:`jaxfox.grn.grn`              (params of :func:`jaxfox.grn.grn_init`)
    VSN            -> :func:`jaxfox.vsn.vsn`              (params of :func:`jaxfox.vsn.vsn_init`)
    AttentionPool  -> :func:`jaxfox.attention.attention_pool`
                                                          (params of :func:`jaxfox.attention.attention_pool_init`)

The math (Lim et al. 2021, TFT eqs. 2-8; Set Transformer PMA for the pooling) is in those modules and
in OPS.md. ``module.params`` returns the current values as the plain dict pytree the op takes, so
``module(x) == op(module.params, x)`` bit for bit.
"""

from __future__ import annotations

import jax.numpy as jnp
from flax import nnx

from jaxfox.attention import attention_pool, attention_pool_init
from jaxfox._validate import check_rngs, positive_float32
from jaxfox.grn import grn, grn_init
from jaxfox.vsn import vsn, vsn_init

__all__ = ["GRN", "VSN", "AttentionPool"]


def _values(d) -> dict:
    """nnx.Dict of nnx.Param -> plain dict of arrays (same keys)."""
    return {k: d[k][...] for k in sorted(d.keys())}


class GRN(nnx.Module):
    """Gated residual network: a [..., I] (context [..., C]) -> [..., O] float32 (:func:`jaxfox.grn.grn`).

    Args:
      input_size: I.  hidden_size: Hd.  output_size: O.
      context_size: C of the optional context (None: no context weight ``w3``).
      eps: LayerNorm epsilon (> 0), passed to :func:`jaxfox.grn.grn` on every call.
      rngs: ``nnx.Rngs``; the ``params`` stream seeds :func:`jaxfox.grn.grn_init`.

    Attributes:
      p: ``nnx.Dict`` of ``nnx.Param`` (float32), the arrays of :func:`jaxfox.grn.grn_init`:
        ``w2`` [I, Hd], ``b2`` [Hd], (``w3`` [C, Hd]), ``w1`` [Hd, Hd], ``b1`` [Hd], ``w4``/``w5`` [Hd, O],
        ``b4``/``b5`` [O], (``skip_w`` [I, O], ``skip_b`` [O] when I != O), ``gamma``/``beta`` [O].

    Raises:
      ValueError: a size is not a positive int (as :func:`jaxfox.grn.grn_init`), or eps is not a positive
        finite float32.
      TypeError: eps is not a number.
    """

    def __init__(self, input_size: int, hidden_size: int, output_size: int, *, context_size: int | None = None,
                 eps: float = 1e-5, rngs: nnx.Rngs):
        check_rngs(rngs)
        eps = positive_float32("eps", eps)
        p = grn_init(rngs.params(), input_size, hidden_size, output_size, context_size=context_size,
                     dtype=jnp.float32)
        self.input_size, self.hidden_size, self.output_size = int(input_size), int(hidden_size), int(output_size)
        self.context_size = None if context_size is None else int(context_size)
        self.eps = eps
        self.p = nnx.Dict({k: nnx.Param(v) for k, v in p.items()})

    @property
    def params(self) -> dict:
        """Current parameter values as the dict :func:`jaxfox.grn.grn` takes."""
        return _values(self.p)

    def __call__(self, a, context=None):
        """a [..., I] float32/bfloat16, context [..., C] or None -> [..., O] float32.

        Raises: what :func:`jaxfox.grn.grn` raises (TypeError/ValueError naming the argument).
        """
        return grn(self.params, a, context, eps=self.eps)


class VSN(nnx.Module):
    """Variable selection network: xs [..., m, d] -> (out [..., O], weights [..., m]) (:func:`jaxfox.vsn.vsn`).

    Args:
      num_vars: m.  var_size: d (embedding width of each variable).
      hidden_size: Hd of every GRN.  output_size: O.
      context_size: C of the optional context of the selection GRN (None: none).
      eps: LayerNorm epsilon of every GRN.
      rngs: ``nnx.Rngs``; the ``params`` stream seeds :func:`jaxfox.vsn.vsn_init`.

    Attributes:
      selection: ``nnx.Dict`` of ``nnx.Param``: GRN_v (input m*d, output m), keys as :class:`GRN`.
      variables: ``nnx.Dict`` of ``nnx.Param``: the m per-variable GRNs (input d, output O), every leaf
        stacked along a leading axis m (``w2`` [m, d, Hd] ...).

    Raises:
      ValueError: a size is not a positive int (as :func:`jaxfox.vsn.vsn_init`), or eps is not a positive
        finite float32.
      TypeError: eps is not a number.
    """

    def __init__(self, num_vars: int, var_size: int, hidden_size: int, output_size: int, *,
                 context_size: int | None = None, eps: float = 1e-5, rngs: nnx.Rngs):
        check_rngs(rngs)
        eps = positive_float32("eps", eps)
        p = vsn_init(rngs.params(), num_vars, var_size, hidden_size, output_size, context_size=context_size,
                     dtype=jnp.float32)
        self.num_vars, self.var_size = int(num_vars), int(var_size)
        self.hidden_size, self.output_size = int(hidden_size), int(output_size)
        self.context_size = None if context_size is None else int(context_size)
        self.eps = eps
        self.selection = nnx.Dict({k: nnx.Param(v) for k, v in p["selection"].items()})
        self.variables = nnx.Dict({k: nnx.Param(v) for k, v in p["variables"].items()})

    @property
    def params(self) -> dict:
        """Current parameter values as the dict :func:`jaxfox.vsn.vsn` takes."""
        return {"selection": _values(self.selection), "variables": _values(self.variables)}

    def __call__(self, xs, context=None):
        """xs [..., m, d] float32/bfloat16 (context [..., C]) -> (out [..., O], weights [..., m]) float32.

        The weights are the softmax selection weights (sum to 1 over the m variables).

        Raises: what :func:`jaxfox.vsn.vsn` raises (TypeError/ValueError naming the argument).
        """
        return vsn(self.params, xs, context, eps=self.eps)


class AttentionPool(nnx.Module):
    """Multi-head attention pooling from one learned query: hs [B, T, H] -> (pooled [B, H], alpha [B, n, T]).

    :func:`jaxfox.attention.attention_pool` (Set Transformer PMA with one seed vector, PyTorch
    ``nn.MultiheadAttention`` semantics; masking as ``jax.nn.softmax(where=mask)``).

    Args:
      hidden_size: H.  num_heads: n (must divide H).
      rngs: ``nnx.Rngs``; the ``params`` stream seeds :func:`jaxfox.attention.attention_pool_init`.

    Attributes (``nnx.Param``, float32): ``q`` [n, H / n] (the query, a row per head), ``w_k``/``w_v``/``w_o``
    [H, H] ([in, out]), ``b_o`` [H].

    Raises:
      ValueError: hidden_size / num_heads not positive ints, or num_heads does not divide H.
    """

    def __init__(self, hidden_size: int, *, num_heads: int = 4, rngs: nnx.Rngs):
        check_rngs(rngs)
        p = attention_pool_init(rngs.params(), hidden_size, num_heads=num_heads, dtype=jnp.float32)
        self.hidden_size, self.num_heads = int(hidden_size), int(num_heads)
        self.q = nnx.Param(p["q"])
        self.w_k = nnx.Param(p["w_k"])
        self.w_v = nnx.Param(p["w_v"])
        self.w_o = nnx.Param(p["w_o"])
        self.b_o = nnx.Param(p["b_o"])

    @property
    def params(self) -> dict:
        """Current parameter values as the dict :func:`jaxfox.attention.attention_pool` takes."""
        return {k: getattr(self, k)[...] for k in ("q", "w_k", "w_v", "w_o", "b_o")}

    def __call__(self, hs, mask=None):
        """hs [B, T, H] float32/bfloat16, mask [B, T] bool or None -> (pooled [B, H], alpha [B, n, T]) float32.

        Raises:
          ValueError: hs is not [B, T, hidden_size] (checked here, so the message names hs rather than
            num_heads or a parameter); otherwise what :func:`jaxfox.attention.attention_pool` raises.
        """
        shape = getattr(hs, "shape", None)
        if shape is not None and (len(shape) != 3 or shape[-1] != self.hidden_size):
            raise ValueError(f"hs must have shape [B, T, {self.hidden_size}], got {tuple(shape)}")
        return attention_pool(self.params, hs, mask, num_heads=self.num_heads)
