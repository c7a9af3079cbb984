"""Optimizer and parameter maintenance: flat parameter buffers, fused AdamW, EMA, float32 -> bfloat16.

Math and edge rules: OPS.md "Optimizer and parameter maintenance (flat buffers)".

* :class:`FlatParams` / :func:`flatten`: a parameter pytree as ONE flat float32 buffer [P] with a
  pytree view (the layout the CUDA kernels will read: leaves in ``jax.tree.leaves`` order, each
  row-major).
* :func:`fused_adamw`: ``optax.adamw`` semantics (Loshchilov & Hutter 2019, "Decoupled Weight Decay
  Regularization"), optionally preceded by ``optax.clip_by_global_norm`` (Pascanu et al. 2012), as
  one ``optax.GradientTransformation`` (a :class:`FusedAdamW`) whose ``step`` also applies the update.
* :func:`ema_update`: Polyak averaging of target weights.
* :func:`cast_bf16`: float32 -> bfloat16, round to nearest even, bit-exact against
  ``x.astype(jnp.bfloat16)`` on CPU.

EMA and the cast are XLA code over the flat buffer: single-launch CUDA kernels for them were written and
measured on the H200, and XLA's fused elementwise code was faster (EMA 0.51x and cast 0.9x at 10M parameters;
BENCHMARKS.md), so they were not landed. :meth:`FusedAdamW.step` runs ONE fused update-and-apply kernel
(``ffi/optim.cu``, target ``jaxfox_adamw_apply``: params, mu, nu updated in place, every leaf of the tree in
the same launch) for parameter trees of many small leaves, where XLA needs a kernel per leaf (a model's
weights, biases and norms: see :func:`fused_adamw` for the rule); on one flat buffer XLA's single fusion
was faster (the kernel 0.8x at 1M-16M parameters, BENCHMARKS.md fifth session), so there it is opt-in
(``JAXFOX_OPT_IN_KERNELS=adamw``).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

from jaxfox._ffi import dispatch, ffi_call as _ffi_call, kernel_opted_in
from jaxfox._validate import is_concrete, no_float64_without_x64, real_scalar as _real_scalar

__all__ = [
    "FlatParams", "flatten", "default_decay_mask", "FusedAdamWState", "FusedAdamW", "fused_adamw", "ema_update",
    "cast_bf16",
]

_FLOAT_PARAM_DTYPES = (jnp.float32, jnp.bfloat16, jnp.float16)


# ----------------------------------------------------------------------------------------------
# Flat parameter buffer.
@dataclasses.dataclass(frozen=True)
class _Layout:
    """Static layout of a flattened pytree: hashable (usable as jit static data / pytree aux)."""

    treedef: Any
    shapes: tuple
    dtypes: tuple

    @property
    def sizes(self):
        return tuple(math.prod(s) for s in self.shapes)

    @property
    def size(self) -> int:
        return sum(self.sizes)

    def unravel(self, flat):
        """[P] -> the pytree (each leaf sliced, reshaped and cast back to its own dtype)."""
        if not hasattr(flat, "shape") or tuple(flat.shape) != (self.size,):
            raise ValueError(f"flat must have shape [P]=[{self.size}], got {getattr(flat, 'shape', None)}")
        leaves, offset = [], 0
        for shape, dtype, n in zip(self.shapes, self.dtypes, self.sizes):
            leaves.append(flat[offset:offset + n].reshape(shape).astype(dtype))
            offset += n
        return jax.tree.unflatten(self.treedef, leaves)

    __call__ = unravel


def _layout_of(params, name="params") -> _Layout:
    leaves, treedef = jax.tree.flatten(params)
    for path, leaf in jax.tree_util.tree_leaves_with_path(params):
        dt = getattr(leaf, "dtype", None)
        if dt is None or jnp.dtype(dt) not in [jnp.dtype(d) for d in _FLOAT_PARAM_DTYPES]:
            raise TypeError(f"{name}{jax.tree_util.keystr(path)} must be a float32/bfloat16/float16 array, "
                            f"got {dt if dt is not None else type(leaf).__name__}")
    return _Layout(treedef, tuple(tuple(l.shape) for l in leaves), tuple(jnp.dtype(l.dtype) for l in leaves))


def _ravel(layout, params):
    leaves = jax.tree.leaves(params)
    if not leaves:
        return jnp.zeros((0,), jnp.float32)
    return jnp.concatenate([jnp.ravel(l).astype(jnp.float32) for l in leaves])


def flatten(params):
    """Ravels a parameter pytree into one flat float32 buffer.

    Leaves are taken in ``jax.tree.leaves`` order, each row-major (the order of
    ``jax.flatten_util.ravel_pytree``); bfloat16/float16 leaves are widened exactly.

    Args:
      params: a pytree of float32 (or bfloat16/float16) arrays.

    Returns:
      (flat [P] float32, unravel) where ``unravel(flat)`` rebuilds the pytree (original shapes and
      dtypes). ``unravel`` is hashable and has ``.size`` (P).

    Raises:
      TypeError: a leaf is not a float32/bfloat16/float16 array (float64 would be narrowed).
    """
    layout = _layout_of(params)
    return _ravel(layout, params), layout


@jax.tree_util.register_pytree_node_class
class FlatParams:
    """Parameters held as one flat float32 buffer ``flat`` [P] with a pytree view ``tree``.

    A pytree whose only leaf is ``flat`` (the layout is static aux data), so it can be passed
    through ``jit``, given to :func:`fused_adamw` (the optimizer then works on the flat buffer, with
    the elementwise decay mask of :func:`default_decay_mask`) and to :func:`ema_update`.
    Differentiate through the view: ``jax.grad(lambda fp: loss(fp.tree))(fp)`` is a FlatParams of
    the flat gradient.

    Build one with ``FlatParams.from_tree(params)`` (:func:`flatten`: leaves in ``jax.tree.leaves``
    order, each row-major, float32/bfloat16/float16 leaves; ``flat`` is float32 [P], P the total number
    of elements; ``tree`` gives back the original shapes and dtypes). ``from_tree`` raises TypeError
    when a leaf is not a float32/bfloat16/float16 array.
    """

    def __init__(self, flat, layout: _Layout):
        self.flat = flat
        self.layout = layout

    @classmethod
    def from_tree(cls, params) -> "FlatParams":
        flat, layout = flatten(params)
        return cls(flat, layout)

    @property
    def tree(self):
        """The pytree view (slices of ``flat``)."""
        return self.layout.unravel(self.flat)

    def tree_flatten(self):
        return (self.flat,), self.layout

    @classmethod
    def tree_unflatten(cls, layout, children):
        return cls(children[0], layout)

    def __repr__(self):
        return f"FlatParams(P={self.layout.size}, flat={self.flat!r})"


def default_decay_mask(params):
    """The default weight-decay mask: decay leaves with ndim >= 2 (weight matrices), not biases,
    LayerNorm scales/offsets or other vectors and scalars.

    For a :class:`FlatParams` (the whole of ``params`` or any subtree of it) the rule is applied to the
    leaves of its view and the result is a FlatParams whose ``flat`` is an elementwise bool mask [P]
    (its own ``flat`` is 1-D, which the rule would never decay). Other leaves get a Python bool.
    """
    def leaf(p):
        if not isinstance(p, FlatParams):
            return len(np.shape(p)) >= 2
        layout = p.layout
        parts = [np.full(n, len(shape) >= 2) for shape, n in zip(layout.shapes, layout.sizes)]
        flat = np.concatenate(parts) if parts else np.zeros((0,), bool)
        return FlatParams(jnp.asarray(flat), layout)

    return jax.tree.map(leaf, params, is_leaf=lambda x: isinstance(x, FlatParams))


# ----------------------------------------------------------------------------------------------
# AdamW.
class FusedAdamWState(NamedTuple):
    """count [] int32 (steps taken); mu, nu: first and second moments, float32, like params (or, with
    ``fused_adamw(..., flatten_moments=True)``, each one :class:`FlatParams` [P] of the params' layout)."""

    count: jax.Array
    mu: Any
    nu: Any


def _check_f32_tree(name, tree, like=None):
    for path, leaf in jax.tree_util.tree_leaves_with_path(tree):
        dt = getattr(leaf, "dtype", None)
        if dt is None or jnp.dtype(dt) != jnp.float32:
            raise TypeError(f"{name}{jax.tree_util.keystr(path)} must be a float32 array, got "
                            f"{dt if dt is not None else type(leaf).__name__}")
    if like is not None:
        s1, s2 = jax.tree.structure(tree), jax.tree.structure(like)
        if s1 != s2:
            raise ValueError(f"{name} must have the structure of params {s2}, got {s1}")
        for path, a, b in zip([p for p, _ in jax.tree_util.tree_leaves_with_path(tree)],
                              jax.tree.leaves(tree), jax.tree.leaves(like)):
            if tuple(a.shape) != tuple(b.shape):
                raise ValueError(f"{name}{jax.tree_util.keystr(path)} must have shape {tuple(b.shape)} "
                                 f"like params, got {tuple(a.shape)}")


def _full_mask(mask, updates, params):
    """Mask (pytree/prefix of bools or bool arrays, or a callable of the updates, as optax.masked)
    -> the structure of params with one bool or bool array per leaf."""
    tree = mask(updates) if callable(mask) else mask
    try:
        per_leaf = jax.tree.map(lambda m, sub: jax.tree.map(lambda _: m, sub), tree, params)
    except (ValueError, TypeError) as e:
        raise ValueError(f"mask must be a pytree with the structure of params (or a prefix of it): {e}") from None
    out = []
    for (path, m), p in zip(jax.tree_util.tree_leaves_with_path(per_leaf), jax.tree.leaves(params)):
        if isinstance(m, (bool, np.bool_)):
            out.append(bool(m))
        elif hasattr(m, "dtype") and m.dtype == jnp.bool_ and tuple(m.shape) in ((), tuple(p.shape)):
            out.append(m)
        else:
            raise ValueError(f"mask{jax.tree_util.keystr(path)} must be a bool or a bool array of shape "
                             f"{tuple(p.shape)}, got {getattr(m, 'dtype', type(m).__name__)} "
                             f"{getattr(m, 'shape', '')}")
    return jax.tree.unflatten(jax.tree.structure(params), out)


class FusedAdamW(optax.GradientTransformation):
    """What :func:`fused_adamw` returns: an ``optax.GradientTransformation`` (``init``, ``update``, usable
    in ``optax.chain``, ``flax.nnx.Optimizer`` and anywhere else one is expected) with :meth:`step`.

    A plain NamedTuple subclass (no extra fields): the fused step travels as an attribute of ``update``,
    so copies and pytree round trips (``type(tx)(init, update)``) keep it.
    """

    __slots__ = ()

    def step(self, grads, state, params):
        """One optimizer step with the update applied: ``(new_params, new_state)``.

        On the reference path exactly ``updates, new_state = self.update(grads, state, params)`` then
        ``new_params = optax.apply_updates(params, updates)`` (the same operations, so bitwise the same
        results). Compiled for CUDA with the kernels available (:func:`jaxfox.kernels_available`), and where
        the kernel rule of :func:`fused_adamw` picks it, it is one fused CUDA kernel (``ffi/optim.cu``,
        ``jaxfox_adamw_apply``) that reads every leaf's params, grads, mu, nu (float32) and decay mask and
        writes params, mu, nu in place (plus a norm pass over grads when clipping), agreeing with the
        reference to ~1 ulp per step (XLA may contract a * b + c into FMAs; the kernel rounds every
        operation) and bitwise repeatable. The kernel writes params, mu and nu in place (aliased outputs):
        donate them (``jax.jit(..., donate_argnums=...)``) or carry them through a ``lax.scan`` /
        ``fori_loop``, or XLA copies each buffer before the kernel runs (8 more bytes per parameter each).
        The kernel path is not differentiable (no JVP for the FFI call): to differentiate through an optimizer step
        (meta-learning), use ``update`` and ``optax.apply_updates``, which are plain JAX on every platform.

        Args:
          grads: gradients, the structure, shapes and float32 dtype of ``params``.
          state: the :class:`FusedAdamWState` from ``init`` or the previous step.
          params: the current parameters (float32 pytree or :class:`FlatParams`).

        Returns:
          (new_params like ``params``, new :class:`FusedAdamWState`).

        Raises:
          The errors of ``update`` (ValueError without params; TypeError/ValueError for non-float32
          leaves, mismatched structures or shapes, a state not from ``init``, a malformed mask).
        """
        fused = getattr(self.update, "_jaxfox_step", None)
        if fused is not None:
            return fused(grads, state, params)
        updates, state = self.update(grads, state, params)  # a transformation rebuilt around another update
        return optax.apply_updates(params, updates), state


_NORM_BLOCK_ELEMS = 4096   # elements per partial sum of the clip's norm pass (at least)
_MAX_NORM_BLOCKS = 1024    # ffi/optim.cu kMaxNormBlocks (per leaf)
_KERNEL_MAX_MEAN_LEAF = 1 << 16  # the kernel runs by default for trees whose mean leaf is at most this


def _norm_blocks(n: int) -> int:
    """Number of per-block partial sums of g^2 of a leaf of n elements (a function of n only, so the sum
    order is too; a tree's partials are its leaves', in leaf order)."""
    return max(1, min(_MAX_NORM_BLOCKS, -(-n // _NORM_BLOCK_ELEMS)))


def _kernel_by_default(sizes) -> bool:
    """The kernel rule of :func:`fused_adamw` for leaf sizes `sizes` (the kernel also runs when opted in)."""
    return len(sizes) > 1 and sum(sizes) <= _KERNEL_MAX_MEAN_LEAF * len(sizes)


def fused_adamw(learning_rate, b1: float = 0.9, b2: float = 0.999, eps: float = 1e-8,
                weight_decay: float = 1e-4, mask=None, max_grad_norm: float | None = None,
                flatten_moments: bool = False) -> FusedAdamW:
    """AdamW with optional global-norm clipping, as one ``optax.GradientTransformation``.

    Equals ``optax.chain(optax.clip_by_global_norm(max_grad_norm), optax.adamw(learning_rate, b1,
    b2, eps, weight_decay=weight_decay, mask=mask))`` (without the clip when max_grad_norm is None),
    with the same operation order, so results agree to ~1 ulp, for the same ``mask``. Note the default:
    ``mask=None`` decays only leaves with ndim >= 2 (weight matrices, not biases or LayerNorm scales; the
    usual AdamW practice), where ``optax.adamw(mask=None)`` decays every leaf: pass ``mask=True`` for optax's
    behaviour, or give optax :func:`default_decay_mask`. Per leaf, at step t = count + 1:

        g  <- g                          if ||g|| < max_norm or ||g|| == 0
              g / ||g|| * max_norm       otherwise          (||.|| = global L2 norm over all leaves)
        m  <- (1 - b1) g + b1 m,    v <- (1 - b2) g^2 + b2 v
        u  =  (m / (1 - b1^t)) / (sqrt(v / (1 - b2^t)) + eps)  [+ weight_decay * theta where masked]
        update = -lr(count) * u                  (apply with ``optax.apply_updates``)

    The one difference from optax: ||g|| == max_norm == 0 (all-zero gradients with max_norm 0)
    leaves g = 0 instead of computing 0/0 = NaN. NaN/Inf gradients propagate as in optax.

    Args:
      learning_rate: float, or an optax schedule count -> lr (called with the step count before
        the increment, 0 at the first update, like ``optax.scale_by_learning_rate``).
      b1, b2: moment decay rates in [0, 1), and < 1 as float32 (1 - 2^-25 <= b < 1 is 1 there).
      eps: >= 0, added to sqrt(v_hat). With eps = 0 an entry whose gradients have all been 0 gets
        0 / 0 = NaN (as in optax).
      weight_decay: decoupled decay rate >= 0, multiplied by the learning rate.
      (learning_rate, b1, b2, eps, weight_decay and max_grad_norm may also be 0-d float or integer arrays,
      traced ones included, so ``optax.inject_hyperparams(fused_adamw)(learning_rate=...)`` works; concrete values are
      range-checked, traced ones cannot be. With traced b1, b2, eps, weight_decay or max_grad_norm, ``step``
      runs XLA's update, never the kernel, whose attributes are compile-time constants.)
      mask: which parameters are decayed. None: :func:`default_decay_mask` (leaves with
        ndim >= 2). Else a pytree with the structure of params (or a prefix of it) whose leaves
        are bools or bool arrays of the leaf's shape (elementwise, e.g. for a flat buffer), or a
        callable params -> such a pytree (called with the updates in ``update``, like optax).
      max_grad_norm: None (no clipping) or the clipping threshold >= 0.
      flatten_moments: keep mu and nu as one :class:`FlatParams` [P] each (the params' leaves raveled in
        ``jax.tree.leaves`` order, as ``optax.flatten`` does) instead of trees like params. ``update`` then
        ravels the gradients and params, computes the update on one flat buffer and splits it back into the
        leaves (``optax.flatten(optax.chain(optax.clip_by_global_norm(max_grad_norm), optax.adamw(...)))``'s
        operations: XLA fuses the norm and the moments into a few kernels, not a set per leaf). ``mask`` still
        applies to the leaves of params (a callable gets the tree of updates), whereas optax.flatten hands
        its mask the flat vector.

    Returns:
      A :class:`FusedAdamW` (an ``optax.GradientTransformation``); ``init(params)`` gives a
      :class:`FusedAdamWState` (count int32 0, mu and nu float32 zeros like params, or flat);
      ``update(grads, state, params)`` requires params and float32 leaves everywhere;
      ``step(grads, state, params) -> (new_params, new_state)`` is ``update`` then
      ``optax.apply_updates`` (:meth:`FusedAdamW.step`). Compiled for CUDA with the kernels available, ``step``
      is ONE fused kernel over all leaves (the norm pass and the update-and-apply launches of
      ``ffi/optim.cu``, up to 56 leaves a launch) when the params have more than one leaf and at most 65536
      elements per leaf on average (a model's tree: XLA spends a launch per leaf there), or whenever
      ``JAXFOX_OPT_IN_KERNELS`` names ``adamw``; else (one flat buffer, or big leaves) XLA's fusion, which
      the kernel did not beat there (BENCHMARKS.md).

    Raises:
      TypeError/ValueError (at construction): a hyperparameter of the wrong type or out of range.
      TypeError/ValueError (in init/update): non-float32 leaves, mismatched structures or shapes,
        params missing, a malformed mask.
    """
    if not callable(learning_rate):
        learning_rate = _real_scalar("learning_rate", learning_rate, 0.0)
    b1 = _real_scalar("b1", b1, 0.0, 1.0, hi_open=True)
    b2 = _real_scalar("b2", b2, 0.0, 1.0, hi_open=True)
    for name, b in (("b1", b1), ("b2", b2)):  # 1 - 2**-25 <= b < 1 is 1 in float32: a bias correction 1 - b^t of 0
        if is_concrete(b) and np.float32(b) == 1.0:
            raise ValueError(f"{name} must be < 1 in float32 (1 - {name}^t is computed in float32: 0 there gives "
                             f"inf/NaN updates), got {b!r}")
    eps = _real_scalar("eps", eps, 0.0)
    weight_decay = _real_scalar("weight_decay", weight_decay, 0.0)
    if max_grad_norm is not None:
        max_grad_norm = _real_scalar("max_grad_norm", max_grad_norm, 0.0)
    # Traced hyperparameters (optax.inject_hyperparams inside jit) cannot be kernel attributes: XLA then. A traced
    # learning rate alone is fine for the kernel (it is one of its device scalars).
    traced_hypers = any(isinstance(h, jax.core.Tracer) for h in (b1, b2, eps, weight_decay, max_grad_norm))
    decay = isinstance(weight_decay, jax.core.Tracer) or weight_decay != 0.0
    if not isinstance(flatten_moments, (bool, np.bool_)):
        raise TypeError(f"flatten_moments must be a bool, got {type(flatten_moments).__name__}")
    flatten_moments = bool(flatten_moments)
    mask_fn = default_decay_mask if mask is None else mask

    def init_fn(params):
        _check_f32_tree("params", params)
        if flatten_moments:
            layout = _layout_of(params)
            zeros = FlatParams(jnp.zeros((layout.size,), jnp.float32), layout)
            return FusedAdamWState(count=jnp.zeros([], jnp.int32), mu=zeros,
                                   nu=FlatParams(jnp.copy(zeros.flat), layout))
        zeros = jax.tree.map(lambda p: jnp.zeros(p.shape, jnp.float32), params)
        return FusedAdamWState(count=jnp.zeros([], jnp.int32), mu=zeros, nu=jax.tree.map(jnp.copy, zeros))

    def check(updates, state, params, what):
        if params is None:
            raise ValueError(f"fused_adamw.{what} needs params (decoupled weight decay): "
                             f"call {what}(grads, state, params)")
        _check_f32_tree("params", params)
        _check_f32_tree("updates", updates, like=params)
        if not isinstance(state, FusedAdamWState):
            raise TypeError(f"state must be a FusedAdamWState (from init), got {type(state).__name__}")
        if flatten_moments:
            shapes = tuple(tuple(l.shape) for l in jax.tree.leaves(params))
            for name in ("mu", "nu"):
                m = getattr(state, name)
                if not isinstance(m, FlatParams) or m.layout.shapes != shapes:
                    raise ValueError(f"state.{name} must be the FlatParams of init(params) (flatten_moments=True): "
                                     f"leaf shapes {shapes}, got {getattr(getattr(m, 'layout', None), 'shapes', m)}")
        else:  # per-leaf moments: like params (other shapes would broadcast silently in the update)
            for name in ("mu", "nu"):
                _check_f32_tree(f"state.{name}", getattr(state, name), like=params)

    def step_scalars(count):
        """(count + 1, bias corrections 1 - b1^(count+1), 1 - b2^(count+1), -lr(count)): the scalar part of a
        step, shared by the reference and the kernel path so that both use the same bits."""
        count_inc = optax.safe_increment(count)
        lr_neg = -learning_rate(count) if callable(learning_rate) else -1 * learning_rate
        return count_inc, 1 - b1 ** count_inc, 1 - b2 ** count_inc, lr_neg

    def update_fn(updates, state, params=None):
        check(updates, state, params, "update")
        if not flatten_moments:
            return core(updates, state, params, _full_mask(mask_fn, updates, params) if decay else None)
        # optax.flatten: the update on the raveled tree, split back into the leaves.
        layout = state.mu.layout
        dmask = None
        if decay:
            masks = [m if isinstance(m, bool) else jnp.broadcast_to(m, p.shape).reshape(-1)
                     for m, p in zip(jax.tree.leaves(_full_mask(mask_fn, updates, params)), jax.tree.leaves(params))]
            if all(isinstance(m, bool) for m in masks) and len(set(masks)) <= 1:
                dmask = masks[0] if masks else False
            else:
                dmask = jnp.concatenate([jnp.full((math.prod(p.shape),), m) if isinstance(m, bool) else m
                                         for m, p in zip(masks, jax.tree.leaves(params))])
        flat_u, new_state = core(_ravel(layout, updates), state._replace(mu=state.mu.flat, nu=state.nu.flat),
                                 _ravel(layout, params), dmask)
        u = jax.tree.unflatten(jax.tree.structure(params), jax.tree.leaves(layout.unravel(flat_u)))
        return u, new_state._replace(mu=FlatParams(new_state.mu, layout), nu=FlatParams(new_state.nu, layout))

    def core(updates, state, params, dmask):
        """The update on trees of matching structure (or flat arrays); dmask: the decay mask, a tree like params
        of bools / bool arrays, or a bool / bool array for flat arrays (None when weight_decay == 0)."""
        g = updates
        if max_grad_norm is not None:
            # optax.clip_by_global_norm, plus the norm == 0 guard (0 / 0 * 0 would be NaN).
            g_norm = optax.tree.norm(g)
            keep = jnp.squeeze((g_norm < max_grad_norm) | (g_norm == 0))
            g = jax.tree.map(lambda t: jax.lax.select(keep, t, (t / g_norm.astype(t.dtype)) * max_grad_norm), g)
        # optax.scale_by_adam (eps_root = 0, nesterov = False), same expressions and order. The moments stay
        # float32 (the state's documented dtype) when traced hyperparameters are float64 (jax_enable_x64), so a
        # scan carry or the next update's check keeps its types; a no-op otherwise.
        mu = jax.tree.map(lambda t, m: ((1 - b1) * (t ** 1) + b1 * m).astype(m.dtype), g, state.mu)
        nu = jax.tree.map(lambda t, v: ((1 - b2) * (t ** 2) + b2 * v).astype(v.dtype), g, state.nu)
        count_inc, bc1, bc2, step = step_scalars(state.count)
        u = jax.tree.map(lambda m, v: (m / bc1.astype(m.dtype)) / (jnp.sqrt(v / bc2.astype(v.dtype)) + eps), mu, nu)
        # optax.add_decayed_weights under optax.masked.
        if decay:
            u = jax.tree.map(lambda x, p, m: (x + weight_decay * p) if m is True else
                             (x if m is False else jnp.where(m, x + weight_decay * p, x)), u, params, dmask)
        # optax.scale_by_learning_rate.
        if callable(learning_rate) or isinstance(learning_rate, jax.core.Tracer):
            u = jax.tree.map(lambda x: jnp.array(step, dtype=x.dtype) * x, u)
        else:
            u = jax.tree.map(lambda x: step * x, u)
        return u, FusedAdamWState(count=count_inc, mu=mu, nu=nu)

    def reference_step(grads, state, params):
        updates, state = update_fn(grads, state, params)
        return optax.apply_updates(params, updates), state

    def kernel_step(grads, state, params):
        """ffi/optim.cu jaxfox_adamw_apply over the leaves of params (each raveled; the moments per leaf, or the
        flat pair of flatten_moments); the scalar work (bias corrections, the learning rate) is the reference's
        own expressions, in JAX."""
        p_leaves, treedef = jax.tree.flatten(params)
        shapes = [tuple(p.shape) for p in p_leaves]
        sizes = [math.prod(sh) for sh in shapes]
        L = len(p_leaves)
        count_inc, bc1, bc2, lr_neg = step_scalars(state.count)
        scalars = jnp.stack([jnp.asarray(lr_neg, jnp.float32), bc1.astype(jnp.float32), bc2.astype(jnp.float32)])
        modes, masks = [0] * L, [jnp.zeros((0,), jnp.bool_)] * L
        if decay:
            for i, m in enumerate(jax.tree.leaves(_full_mask(mask_fn, grads, params))):
                if isinstance(m, bool):
                    modes[i] = 1 if m else 0
                else:
                    modes[i], masks[i] = 2, jnp.broadcast_to(m, shapes[i]).reshape(-1)
        if flatten_moments:
            mus, nus = [state.mu.flat], [state.nu.flat]
        else:
            mus = [m.reshape(-1) for m in jax.tree.leaves(state.mu)]
            nus = [v.reshape(-1) for v in jax.tree.leaves(state.nu)]
        S = len(mus)
        clip = max_grad_norm is not None
        parts = sum(_norm_blocks(n) for n in sizes) if clip else 0
        out = (jax.ShapeDtypeStruct((parts,), jnp.float32),
               *(jax.ShapeDtypeStruct((n,), jnp.float32) for n in sizes),
               *(jax.ShapeDtypeStruct(m.shape, jnp.float32) for m in mus + nus))
        aliases = {1 + i: 1 + i for i in range(L)}                               # params_i -> params'_i
        aliases.update({1 + 2 * L + k: 1 + L + k for k in range(2 * S)})          # mu, nu -> mu', nu'
        res = _ffi_call("jaxfox_adamw_apply", out, vmap_method="broadcast_all", input_output_aliases=aliases)(
            scalars, *(p.reshape(-1) for p in p_leaves), *(g.reshape(-1) for g in jax.tree.leaves(grads)),
            *mus, *nus, *masks,
            b1=np.float32(b1), one_minus_b1=np.float32(1 - b1), b2=np.float32(b2), one_minus_b2=np.float32(1 - b2),
            eps=np.float32(eps), weight_decay=np.float32(weight_decay),
            max_grad_norm=np.float32(max_grad_norm if clip else 0.0), clip=np.int64(clip),
            flat_moments=np.int64(flatten_moments), mask_modes=np.asarray(modes, np.int64))
        def like_params(flat_leaves):  # step_fn checked that per-leaf moments have the structure of params
            return jax.tree.unflatten(treedef, [r.reshape(sh) for r, sh in zip(flat_leaves, shapes, strict=True)])

        new_mu, new_nu = res[1 + L:1 + L + S], res[1 + L + S:]
        if flatten_moments:
            mu, nu = FlatParams(new_mu[0], state.mu.layout), FlatParams(new_nu[0], state.nu.layout)
        else:
            mu, nu = like_params(new_mu), like_params(new_nu)
        return like_params(res[1:1 + L]), FusedAdamWState(count=count_inc, mu=mu, nu=nu)

    def step_fn(grads, state, params):
        check(grads, state, params, "step")
        sizes = [math.prod(p.shape) for p in jax.tree.leaves(params)]
        like = flatten_moments or all(jax.tree.structure(m) == jax.tree.structure(params) and all(
            tuple(a.shape) == tuple(b.shape) for a, b in zip(jax.tree.leaves(m), jax.tree.leaves(params)))
            for m in (state.mu, state.nu))
        if not like or traced_hypers or sum(sizes) == 0 or not (_kernel_by_default(sizes) or kernel_opted_in("adamw")):
            return reference_step(grads, state, params)
        return dispatch(kernel_step, reference_step, grads, state, params)

    update_fn._jaxfox_step = step_fn
    return FusedAdamW(init_fn, update_fn)


# ----------------------------------------------------------------------------------------------
# EMA.
def ema_update(target, online, tau):
    """Polyak averaging: theta' <- tau * theta + (1 - tau) * theta' per leaf (theta = online,
    theta' = target), e.g. the target network of DQN.

    Source: the soft target update of Lillicrap et al. 2016 ("Continuous control with deep reinforcement
    learning", DDPG); reference implementation ``optax.incremental_update(online, target, tau)``, the same
    value ``tau * new + (1 - tau) * old`` (without the bitwise tau = 0 / 1 guarantees below).

    tau = 1 returns the online values bitwise (including NaN payloads and -0.0); tau = 0 returns
    the target values bitwise. Both hold for every input, finite or not, because they are selected
    with ``jnp.where`` on tau (for a concrete Python tau of exactly 0 or 1 the leaves are returned
    without computation). For 0 < tau < 1 the result is ``tau * online + (1 - tau) * target`` in the
    leaf dtype, computed in float32 for narrower leaves (bfloat16, float16) and rounded once, so tau is
    never rounded to the leaf dtype (two products and a sum, never ``target + tau * (online - target)``,
    which breaks the tau = 0 identity for target = -0.0 and overflows for opposite-sign values near
    the float max). Eagerly each operation is rounded; under ``jit`` XLA CPU contracts one product and the
    sum into an FMA, so jitted and eager results may differ by 1 ulp. NaN/Inf propagate there.

    Args:
      target: pytree of float arrays (theta').
      online: pytree with the same structure, shapes and dtypes (theta).
      tau: scalar in [0, 1] (a Python float or a 0-d array, may be traced; concrete values are
        range-checked, traced ones are not).

    Returns:
      The new target pytree.

    Raises:
      TypeError: non-float leaves, float64 leaves with ``jax_enable_x64`` off (they would come back float32), or
        tau not a scalar number (a bool, Python or array, is refused).
      ValueError: structures, shapes or dtypes differ (the message names the leaf), tau an array of shape other
        than [], concrete tau outside [0, 1] or NaN.
    """
    s1, s2 = jax.tree.structure(target), jax.tree.structure(online)
    if s1 != s2:
        raise ValueError(f"online must have the structure of target {s1}, got {s2}")
    for (path, a), b in zip(jax.tree_util.tree_leaves_with_path(target), jax.tree.leaves(online)):
        where = jax.tree_util.keystr(path)
        for nm, x in (("target", a), ("online", b)):
            if not hasattr(x, "dtype") or not jnp.issubdtype(x.dtype, jnp.floating):
                raise TypeError(f"{nm}{where} must be a float array, got {getattr(x, 'dtype', type(x).__name__)}")
        if tuple(a.shape) != tuple(b.shape) or a.dtype != b.dtype:
            raise ValueError(f"online{where} must match target{where} {tuple(a.shape)} {a.dtype}, "
                             f"got {tuple(b.shape)} {b.dtype}")
        no_float64_without_x64(f"target{where}", a.dtype, "the average")
    t = _real_scalar("tau", tau, 0.0, 1.0)
    if isinstance(tau, (int, float, np.integer, np.floating)):  # a Python/NumPy number (not an array): the ends exact
        if t == 0.0:
            return jax.tree.map(jnp.asarray, target)
        if t == 1.0:
            return jax.tree.map(jnp.asarray, online)

    def leaf(a, b):
        # at least float32: tau = 0.995 in bfloat16 is 0.99609375 (a 22 % error in 1 - tau), so narrow leaves are
        # mixed in float32 and rounded once
        ct = jnp.promote_types(a.dtype, jnp.float32)
        tt = jnp.asarray(tau, ct)
        mixed = (tt * b.astype(ct) + (1 - tt) * a.astype(ct)).astype(a.dtype)
        return jnp.where(tt == 1, b, jnp.where(tt == 0, a, mixed))

    return jax.tree.map(leaf, target, online)


# ----------------------------------------------------------------------------------------------
# float32 -> bfloat16.
def cast_bf16(x):
    """float32 -> bfloat16, round to nearest, ties to even, on the bit pattern.

    With u the float32 bits: bf16 bits = (u + 0x7FFF + ((u >> 16) & 1)) >> 16 for non-NaN x, which
    rounds finite values (normal and subnormal: bfloat16 has float32's exponent range, so subnormals
    stay subnormal, not flushed), keeps +-Inf and -0.0, and rounds values at or above
    bf16_max + half an ulp to +-Inf. NaN -> sign | 0x7FC0 (a quiet NaN keeping the sign), which is
    what XLA's CPU convert and ml_dtypes produce. Bit-exact against ``x.astype(jnp.bfloat16)`` on
    CPU for every input; on GPU XLA's convert may return a different NaN payload (NaN stays NaN).
    Differentiable as ``x.astype(jnp.bfloat16)``: the tangent (and the cotangent, back to float32) is cast.

    Args:
      x: float32 array, any shape.

    Returns:
      bfloat16 array, same shape.

    Raises:
      TypeError: x is not a float32 array.
    """
    if not hasattr(x, "dtype") or jnp.dtype(x.dtype) != jnp.float32:
        raise TypeError(f"x must be a float32 array, got {getattr(x, 'dtype', type(x).__name__)}")
    return _cast_bf16_bits(jnp.asarray(x))


@jax.custom_jvp
def _cast_bf16_bits(x):
    u = jax.lax.bitcast_convert_type(x, jnp.uint32)
    rounded = (u + jnp.uint32(0x7FFF) + ((u >> 16) & jnp.uint32(1))) >> 16
    nan = (u & jnp.uint32(0x7FFFFFFF)) > jnp.uint32(0x7F800000)
    bits = jnp.where(nan, (u >> 16) & jnp.uint32(0x8000) | jnp.uint32(0x7FC0), rounded)
    return jax.lax.bitcast_convert_type(bits.astype(jnp.uint16), jnp.bfloat16)


@_cast_bf16_bits.defjvp
def _cast_bf16_jvp(primals, tangents):
    # the derivative of x.astype(bfloat16) (the bit operations alone would give a zero gradient)
    return _cast_bf16_bits(primals[0]), tangents[0].astype(jnp.bfloat16)
