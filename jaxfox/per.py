"""Prioritized experience replay with a prefix-sum sampler (proportional variant).

Schaul et al. 2015, "Prioritized Experience Replay" (ICLR 2016), section 3.3, proportional
prioritization, with the stratified sampling of their appendix B.2.1. Math and edge rules:
OPS.md "Prioritized replay".

    q_i  = p_i^alpha  for filled slots (i < size) with p_i > 0, else 0        [C]
    S    = sum_i q_i,   P(i) = q_i / S
    c_i  = q_0 + ... + q_i   (inclusive prefix sum)                         [C]
    u_k  = (k + r_k) / B * S,   r_k ~ U[0, 1),   k = 0 .. B-1                (stratified)
    idx_k = first i with c_i > u_k  (searchsorted side="right")
    w_k  = (n P(idx_k))^(-beta) / max_j (n P(idx_j))^(-beta),   n = size

Everything is a pure function of a :class:`PERState` pytree (jit, vmap and donation friendly). The
sampler recomputes the prefix sum from the stored priorities at every call (no incremental sum
tree), so no error accumulates over updates. The prefix sum runs in float64 when ``jax_enable_x64``
is on, otherwise in compensated float32 (a blocked scan over double-float (hi, lo) pairs, see
:func:`prefix_sum`): a plain sequential float32 cumsum over 1e6 items is off by ~3e-5 relative.

Deviations from the textbook formulas, all chosen so a zero-priority slot can never be drawn:

* q_i = 0 whenever p_i = 0, also for alpha = 0 (where 0^0 = 1 would make empty slots eligible);
  p_i^alpha that underflows to 0 counts as a zero priority.
* The searched prefix is made exactly flat over zero slots (c_i := c_{i-1} where q_i = 0, then a
  running max), so rounding in the scan cannot open a sliver for them; a draw past the last
  prefix (u_k rounding up to S) is clamped to the last slot with q > 0, which is ``size - 1``
  whenever that slot has a positive priority.
* IS weights are computed as (q_min / q_k)^beta with q_min the smallest sampled q: the same value
  as the formula above (n and S cancel), no overflow, and the largest weight is exactly 1.

Range: q_i and S must be finite in the work dtype. In float32 that holds for alpha <= 1 and any finite
priorities unless S itself passes ~3.4e38; with alpha > 1 a priority above float32 max^(1/alpha) (1e19 at
alpha = 2) makes q_i = inf (in float64, under ``jax_enable_x64``, the bound is float64 max^(1/alpha)). When q_i
or S is not finite, every path (the float32 and float64 references and the CUDA sampler, ``ffi/per.cu``) falls
back to uniform draws over the filled slots (zero-priority ones included) with weights of 1, and
:func:`probabilities` to 1/size. Keep priorities (e.g. |TD error| + eps) far below the bound.

On CUDA (float32 work dtype, i.e. ``jax_enable_x64`` off) the prefix sum and the draws run in
``ffi/per.cu``: a multi-block scan (tiles of 2048 items, float64 accumulation, each prefix rounded to
float32 once; targets ``jaxfox_prefix_sum`` and ``jaxfox_per_sample``) that builds the same
searchable prefix, then one block for the stratified draws and the weights. The uniforms r_k come
from ``jax.random`` in Python on both paths, so kernel and reference draw the same indices (up to
float32 rounding ties of the prefix sums). With ``jax_enable_x64`` on the reference runs.
"""

from __future__ import annotations

import functools
import math
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

from jaxfox._ffi import dispatch, ffi_call as _ffi_call
from jaxfox._validate import (check_key, is_concrete as _is_concrete, no_float64_without_x64,
                              positive_int as _positive_int, real_scalar as _real_scalar)

__all__ = [
    "PERState", "init", "add", "sample", "sample_items", "update", "probabilities", "prefix_sum",
    "beta_schedule", "linear_beta",
]


class PERState(NamedTuple):
    """State of a prioritized replay buffer of capacity C (a pytree; C is static, the shape).

    Attributes:
      priorities: [C] float32, raw priorities p_i (alpha is applied at sampling time). Slots
        i >= size hold 0 until filled.
      max_priority: [] float32, the running maximum of all stored priorities (1.0 initially);
        new items get it.
      size: [] int32, number of filled slots (<= C).
      pos: [] int32, next ring-buffer write position in [0, C).
      items: None, or a pytree of arrays [C, ...] (one leaf per ``item_spec`` leaf).
    """

    priorities: jax.Array
    max_priority: jax.Array
    size: jax.Array
    pos: jax.Array
    items: Any = None


# ----------------------------------------------------------------------------------------------
# Validation helpers (raise before anything runs; messages name the argument).
def _check_state(state, name="state"):
    if not isinstance(state, PERState):
        raise TypeError(f"{name} must be a PERState (from jaxfox.per.init), got {type(state).__name__}")
    p = state.priorities
    if not hasattr(p, "shape") or len(p.shape) != 1 or p.shape[0] < 1:
        raise ValueError(f"{name}.priorities must have shape [C] with C >= 1, got {getattr(p, 'shape', None)}")
    if p.dtype != jnp.float32:
        raise TypeError(f"{name}.priorities must be float32, got {p.dtype}")
    C = int(p.shape[0])
    if _is_concrete(state.size):
        size = int(np.asarray(state.size))
        if not 0 <= size <= C:
            # a negative size drew slot 0 with weight 0 silently; a size above C let the uniform fallback index past C
            raise ValueError(f"{name}.size must be in [0, C] = [0, {C}], got {size}")
    return C


# ----------------------------------------------------------------------------------------------
def init(capacity: int, item_spec=None) -> PERState:
    """An empty buffer of ``capacity`` slots.

    Args:
      capacity: C >= 1 (any int; no power of two needed).
      item_spec: None (the buffer keeps priorities only; store items elsewhere, indexed by slot),
        or a pytree of ``jax.ShapeDtypeStruct`` (anything with ``.shape`` and ``.dtype``) giving
        the shape of ONE item per leaf; storage of shape [C, *leaf.shape] is allocated (zeros).

    Returns:
      A :class:`PERState` with priorities zeros [C] float32, max_priority 1.0, size 0, pos 0.

    Raises:
      ValueError: capacity is not an int >= 1.
      TypeError: an item_spec leaf has no shape/dtype, or a 64-bit dtype (float64, int64, ...) while
        ``jax_enable_x64`` is off (JAX would store it as the 32-bit type).
    """
    C = _positive_int("capacity", capacity)
    items = None
    if item_spec is not None:
        def alloc(path, spec):
            where = f"item_spec{jax.tree_util.keystr(path)}"
            if not hasattr(spec, "shape") or not hasattr(spec, "dtype"):
                raise TypeError(f"{where} must be a jax.ShapeDtypeStruct, got {type(spec).__name__}")
            dt = jnp.dtype(spec.dtype)
            canon = jax.dtypes.canonicalize_dtype(dt)
            if canon != dt:  # JAX would allocate the narrower dtype, and add() would then refuse items of `dt`
                raise TypeError(f"{where} is {dt} but jax_enable_x64 is off: the storage would be {canon}; "
                                f"pass {canon} (or enable x64)")
            return jnp.zeros((C,) + tuple(spec.shape), dt)

        items = jax.tree_util.tree_map_with_path(alloc, item_spec)
    return PERState(priorities=jnp.zeros((C,), jnp.float32), max_priority=jnp.ones((), jnp.float32),
                    size=jnp.zeros((), jnp.int32), pos=jnp.zeros((), jnp.int32), items=items)


def add(state: PERState, items) -> PERState:
    """Ring-buffer insert of a batch of n items; each new slot gets priority ``state.max_priority``.

    Slots pos, pos+1, ... (mod C) are written; when n > C only the last C items are kept (the
    result equals inserting one at a time). size <- min(size + n, C), pos <- (pos + n) mod C.

    Args:
      state: a :class:`PERState`.
      items: a pytree with the structure of the ``item_spec`` given to :func:`init`, each leaf
        [n, *item_shape] with the storage dtype; or, for a buffer without item storage, the int
        n >= 0 (slots are then reserved for items kept elsewhere: the k-th gets slot (pos + k) % C).

    Returns:
      The new state.

    Raises:
      TypeError: state is not a PERState; an item leaf has the wrong dtype; items given as an int
        to a buffer with storage or as arrays to one without.
      ValueError: items' structure or leaf shapes do not match the storage, or leaves disagree on n; a count
        (buffer without storage) below 0; state.size outside [0, C].
    """
    C = _check_state(state)
    if state.items is None:
        if isinstance(items, bool) or not isinstance(items, (int, np.integer)):
            raise TypeError("this buffer has no item storage (init(capacity) without item_spec): pass the "
                            f"number of items n as an int, got {type(items).__name__}")
        n = _positive_int("items (count)", items, minimum=0)
        new_items = None
    else:
        if isinstance(items, (int, np.integer)):
            raise TypeError("this buffer stores items: pass a pytree of arrays [n, ...], not a count")
        want, got = jax.tree.structure(state.items), jax.tree.structure(items)
        if want != got:
            raise ValueError(f"items must have the structure of item_spec {want}, got {got}")
        ns = set()
        for (path, leaf), store in zip(jax.tree_util.tree_leaves_with_path(items), jax.tree.leaves(state.items)):
            where = f"items{jax.tree_util.keystr(path)}"
            if not hasattr(leaf, "shape") or not hasattr(leaf, "dtype"):
                raise TypeError(f"{where} must be an array, got {type(leaf).__name__}")
            if leaf.dtype != store.dtype:
                raise TypeError(f"{where} must be {store.dtype}, got {leaf.dtype}")
            if len(leaf.shape) != store.ndim or tuple(leaf.shape[1:]) != tuple(store.shape[1:]):
                want_s = "[n, " + ", ".join(map(str, store.shape[1:])) + "]" if store.ndim > 1 else "[n]"
                raise ValueError(f"{where} must have shape {want_s}, got {tuple(leaf.shape)}")
            ns.add(int(leaf.shape[0]))
        if len(ns) > 1:
            raise ValueError(f"all item leaves must have the same leading size n, got {sorted(ns)}")
        n = ns.pop() if ns else 0
        new_items = state.items
    if n == 0:
        return state
    # a state restored from a checkpoint (flax.serialization) holds NumPy arrays, which have no .at: jax arrays once
    state = jax.tree.map(jnp.asarray, state)
    m = min(n, C)  # only the last m of the n items survive
    start = (state.pos + (n - m)) % C
    slots = ((start + jnp.arange(m, dtype=jnp.int32)) % C).astype(jnp.int32)  # distinct: deterministic scatter
    if state.items is not None:
        new_items = jax.tree.map(lambda store, x: store.at[slots].set(x[n - m:]), state.items, items)
    return PERState(
        priorities=state.priorities.at[slots].set(state.max_priority),
        max_priority=state.max_priority,
        size=jnp.minimum(state.size + m, C).astype(jnp.int32),
        pos=((state.pos + n % C) % C).astype(jnp.int32),
        items=new_items,
    )


# ----------------------------------------------------------------------------------------------
# Prefix sum.
def _two_sum(a, b):
    """Knuth's TwoSum: s + e == a + b exactly (round-to-nearest)."""
    s = a + b
    bb = s - a
    e = (a - (s - bb)) + (b - bb)
    return s, e


def _df_add(x, y):
    """Double-float addition (hi, lo) + (hi, lo) -> normalised (hi, lo); relative error ~ eps^2."""
    s, e = _two_sum(x[0], y[0])
    e = e + (x[1] + y[1])
    hi = s + e
    lo = e - (hi - s)
    return hi, lo


def prefix_sum(x: jax.Array) -> jax.Array:
    """Inclusive prefix sum c_i = x_0 + ... + x_i of a 1-D float array, accurately.

    float64 input (``jax_enable_x64`` on): ``jnp.cumsum`` in float64. float32 input: a blocked
    two-level scan (blocks of ~sqrt(n) items: running sums inside every block, a scan of the block
    totals, then the block offset added) in which every addition is a double-float (hi, lo) addition
    built on Knuth's TwoSum, returning hi. For non-negative inputs each c_i is then within 0.5 ulp
    (plus ~n^(1/2) * 2^-48 relative) of the exact sum, for any n; a sequential float32 cumsum over
    1e6 uniform items is off by ~3e-5 relative (hundreds of ulp), XLA CPU's cumsum by ~3e-7.

    Args:
      x: [n] float32 or float64.

    Returns:
      [n], same dtype. Differentiable in forward and reverse mode, to any order, on every path (the op is
      linear: tangents go through ``jnp.cumsum``, cotangents through its transpose, a reversed cumsum).

    Raises:
      TypeError: x is not a float32/float64 array, or is float64 with ``jax_enable_x64`` off (JAX would make it
        float32, so the result would not have x's dtype).  ValueError: x is not 1-D.
    """
    if not hasattr(x, "dtype") or x.dtype not in (jnp.float32, jnp.float64):
        raise TypeError(f"x must be a float32 or float64 array, got {getattr(x, 'dtype', type(x).__name__)}")
    no_float64_without_x64("x", x.dtype, "the prefix sum")
    if len(x.shape) != 1:
        raise ValueError(f"x must be 1-D [n], got shape {tuple(x.shape)}")
    x = jnp.asarray(x)
    if x.dtype == jnp.float64:
        return jnp.cumsum(x)
    if x.shape[0] == 0:
        return x
    return _prefix_sum_f32(x)


@jax.custom_jvp
def _prefix_sum_f32(x):
    return dispatch(_prefix_sum_kernel, _prefix_sum_df32, x)


@_prefix_sum_f32.defjvp
def _prefix_sum_f32_jvp(primals, tangents):
    # The op is linear: its tangent is a plain cumsum, which JAX transposes for reverse mode (the FFI call
    # jaxfox_prefix_sum is neither differentiable nor transposable, so it only computes the primal).
    (x,), (t,) = primals, tangents
    return _prefix_sum_f32(x), jnp.cumsum(t)


_TILE = 2048      # items per block of the kernels in ffi/per.cu
_REC_FLOATS = 10  # float32 words per tile record of their workspace


def _workspace_size(n):
    return (-(-n // _TILE) + 1) * _REC_FLOATS


def _prefix_sum_kernel(x):
    n = x.shape[0]
    out = (jax.ShapeDtypeStruct((n,), jnp.float32),
           jax.ShapeDtypeStruct((_workspace_size(n),), jnp.float32))
    return _ffi_call("jaxfox_prefix_sum", out, vmap_method="broadcast_all")(x)[0]


@jax.jit
def _prefix_sum_df32(x):
    """Two-level blocked scan with double-float (hi, lo) accumulation (the planned kernel's layout):
    x is cut into nb blocks of bs ~ sqrt(n); a compensated running sum along each block (all blocks
    in parallel), a compensated exclusive scan of the block totals, then offset + in-block prefix."""
    n = x.shape[0]
    bs = math.isqrt(n - 1) + 1
    nb = -(-n // bs)
    X = jnp.pad(x, (0, nb * bs - n)).reshape(nb, bs).T  # [bs, nb]: row j holds element j of every block
    zero = jnp.zeros((nb,), x.dtype)

    def within(carry, xj):
        carry = _df_add(carry, (xj, jnp.zeros_like(xj)))
        return carry, carry

    totals, (in_hi, in_lo) = jax.lax.scan(within, (zero, zero), X)

    def across(carry, t):
        return _df_add(carry, t), carry

    z = jnp.zeros((), x.dtype)
    _, (off_hi, off_lo) = jax.lax.scan(across, (z, z), totals)
    hi, _ = _df_add((off_hi[None, :], off_lo[None, :]), (in_hi, in_lo))
    return hi.T.reshape(-1)[:n]


def _work_dtype():
    return jnp.float64 if jax.config.jax_enable_x64 else jnp.float32


def _scores(state, alpha):
    """q [C] in the work dtype: p^alpha on filled slots with p > 0, else 0."""
    C = state.priorities.shape[0]
    dt = _work_dtype()
    p = state.priorities.astype(dt)
    filled = jnp.arange(C, dtype=jnp.int32) < state.size
    pos = filled & (p > 0)
    q = jnp.where(pos, jnp.power(jnp.where(pos, p, 1), jnp.asarray(alpha, dt)), 0)
    return q


def _searchable_prefix(q):
    """Prefix sum made exactly flat over zero slots and non-decreasing (see module docstring)."""
    c = prefix_sum(q)
    return jax.lax.cummax(jnp.where(q > 0, c, 0))


def _prioritized(total):
    """Whether draws follow the priorities (else uniform over the filled slots, module docstring "Range"): the
    score total S is > 0 and finite. A non-finite S (q_i or S overflowed the work dtype: NaN from the float32
    double-float scan, inf from the float64 cumsum) falls back to uniform, as ffi/per.cu's sampler does."""
    return (total > 0) & jnp.isfinite(total)


def probabilities(state: PERState, *, alpha) -> jax.Array:
    """P(i) [C] float32 as :func:`sample` draws them: q_i / S (S from the same prefix sum), 0 for
    unfilled or zero-priority slots; 1/size on every filled slot when all filled priorities are 0
    (or q or S overflows, module docstring "Range"); all zeros for an empty buffer.

    P(i) = p_i^alpha / sum_k p_k^alpha, Schaul et al. 2015, eq. 1 (section 3.3).

    Args:
      state: a :class:`PERState` of capacity C.
      alpha: priority exponent >= 0 (scalar, may be traced).

    Returns:
      [C] float32, summing to 1 (up to rounding) over the filled slots unless the buffer is empty.

    Raises:
      TypeError/ValueError: as :func:`sample` for state and alpha.
    """
    _check_state(state)
    _real_scalar("alpha", alpha, 0.0)
    return _probabilities_impl(state.priorities, state.size, alpha)


@jax.jit
def _probabilities_impl(priorities, size, alpha):
    state = PERState(priorities, None, size, None)
    q = _scores(state, alpha)
    total = _searchable_prefix(q)[-1]
    filled = jnp.arange(priorities.shape[0]) < size
    uniform = jnp.where(filled, 1.0 / jnp.maximum(size, 1).astype(q.dtype), 0.0)
    prioritized = _prioritized(total)
    return jnp.where(prioritized, q / jnp.where(prioritized, total, 1), uniform).astype(jnp.float32)


def sample(state: PERState, key, batch_size: int, *, alpha, beta):
    """Stratified proportional sampling of ``batch_size`` slots with importance weights.

    Stratum k draws u_k = (k + r_k) / B * S and takes idx_k = first i with c_i > u_k over the
    prefix sum c of q = p^alpha on the filled slots (module docstring). A slot with priority 0 is
    never drawn. When every filled priority is 0 (or q overflows, module docstring "Range") the draw is
    uniform and stratified over the filled slots, idx_k = floor((k + r_k) / B * size), with weights 1.
    On an empty buffer (traced size 0) the indices are 0 and the weights 0.

    Args:
      state: a :class:`PERState`.
      key: one ``jax.random`` key: ``jax.random.key(seed)`` (shape []) or a uint32 [2] ``PRNGKey``.
      batch_size: B >= 1 (static).
      alpha: priority exponent >= 0 (scalar, may be traced).
      beta: importance-sampling exponent in [0, 1] (scalar, may be traced; see :func:`beta_schedule`).

    Returns:
      (indices [B] int32 in [0, size), weights [B] float32 in [0, 1] with max exactly 1).
      w_k = (n P(idx_k))^(-beta) / max_j (n P(idx_j))^(-beta), n = size, computed as (q_min/q_k)^beta
      (Schaul et al. 2015, section 3.4, normalised over the sampled batch). Every weight is > 0 unless it is
      below float32's smallest subnormal (a sampled ratio (q_k / q_min)^beta above ~1e45): then it rounds to 0.

    Raises:
      TypeError: state is not a PERState, key is not a PRNG key, alpha/beta are not numeric scalars (a bool or
        bool array is refused).
      ValueError: a key array of shape other than []; batch_size is not an int >= 1; alpha/beta arrays of shape
        other than []; concrete alpha < 0 or beta outside [0, 1]; the buffer is empty (concrete size 0).
    """
    _check_state(state)
    check_key(key)
    B = _positive_int("batch_size", batch_size)
    _real_scalar("alpha", alpha, 0.0)
    _real_scalar("beta", beta, 0.0, 1.0)
    if _is_concrete(state.size) and int(np.asarray(state.size)) == 0:
        raise ValueError("sample: the buffer is empty (state.size == 0); add items first")
    return _sample_impl(state.priorities, state.size, key, B, alpha, beta)


@functools.partial(jax.jit, static_argnums=(3,))
def _sample_impl(priorities, size, key, B, alpha, beta):
    dt = _work_dtype()
    r = jax.random.uniform(key, (B,), dt)
    if dt == jnp.float64:
        return _sample_reference(priorities, size, r, alpha, beta)
    f32 = jnp.float32
    return dispatch(_sample_kernel, _sample_reference, priorities, jnp.asarray(size, jnp.int32), r,
                    jnp.asarray(alpha, f32), jnp.asarray(beta, f32))


def _sample_kernel(priorities, size, r, alpha, beta):
    C, B = priorities.shape[0], r.shape[0]
    out = (jax.ShapeDtypeStruct((B,), jnp.int32),                    # indices
           jax.ShapeDtypeStruct((B,), jnp.float32),                  # weights
           jax.ShapeDtypeStruct((C,), jnp.float32),                  # workspace: searchable prefix
           jax.ShapeDtypeStruct((_workspace_size(C),), jnp.float32))  # workspace: tile records
    idx, w, _, _ = _ffi_call("jaxfox_per_sample", out, vmap_method="broadcast_all")(
        priorities, size, alpha, beta, r)
    return idx, w


def _sample_reference(priorities, size, r, alpha, beta):
    state = PERState(priorities, None, size, None)
    C = priorities.shape[0]
    B = r.shape[0]
    dt = _work_dtype()
    q = _scores(state, alpha)
    c = _searchable_prefix(q)
    total = c[-1]
    slots = jnp.arange(C, dtype=jnp.int32)
    last_pos = jnp.max(jnp.where(q > 0, slots, 0))
    frac = (jnp.arange(B, dtype=dt) + r) / B  # in [k/B, (k+1)/B)
    idx_p = jnp.minimum(jnp.searchsorted(c, frac * total, side="right").astype(jnp.int32), last_pos)
    n = state.size.astype(dt)
    idx_u = jnp.clip(jnp.floor(frac * n).astype(jnp.int32), 0, jnp.maximum(state.size - 1, 0))
    prioritized = _prioritized(total)
    idx = jnp.where(prioritized, idx_p, idx_u).astype(jnp.int32)
    q_sel = q[idx]
    q_min = jnp.min(q_sel)
    safe = jnp.where(prioritized, q_sel, 1)
    w_p = jnp.power(jnp.where(prioritized, q_min, 1) / safe, jnp.asarray(beta, dt))
    w = jnp.where(prioritized, w_p, jnp.where(state.size > 0, 1, 0)).astype(jnp.float32)
    return idx, w


def sample_items(state: PERState, indices):
    """Gathers stored items: a pytree like ``item_spec`` with leaves [K, *item_shape].

    Args:
      state: a :class:`PERState` built with an ``item_spec``.
      indices: [K] integer slots (from :func:`sample`), each in [0, size). Concrete (non-traced) indices are
        checked; traced ones cannot raise and follow JAX indexing (a negative index counts from slot C, then
        the index is clamped into [0, C)).

    Raises:
      TypeError: the buffer has no item storage; indices are not integer.
      ValueError: indices are not 1-D; concrete indices outside [0, C) (or outside [0, size) when size is
        concrete).
    """
    C = _check_state(state)
    if state.items is None:
        raise TypeError("sample_items: this buffer has no item storage (init(capacity) without item_spec)")
    if not hasattr(indices, "dtype") or not jnp.issubdtype(indices.dtype, jnp.integer):
        raise TypeError(f"indices must be an integer array, got {getattr(indices, 'dtype', type(indices).__name__)}")
    if len(indices.shape) != 1:
        raise ValueError(f"indices must have shape [K], got {tuple(indices.shape)}")
    if _is_concrete(indices):  # a gather would silently clamp (or wrap) a bad slot to another slot's item
        iv = np.asarray(indices, np.int64)
        limit = int(np.asarray(state.size)) if _is_concrete(state.size) else C
        bad = (iv < 0) | (iv >= limit)
        if bad.any():
            k = int(np.argmax(bad))
            raise ValueError(f"indices must be in [0, {limit}) (filled slots); got {iv[k]} at position {k}")
    return jax.tree.map(lambda store: store[indices], state.items)


def update(state: PERState, indices, priorities) -> PERState:
    """Sets p[indices[k]] = priorities[k]; with duplicate indices the LAST occurrence wins.

    Deterministic for duplicates: the (index, position) pairs are stably sorted by index and only
    the last of each run is scattered, so every written slot has exactly one writer. The running
    ``max_priority`` becomes the max of itself and the written priorities.

    Invalid values: concrete (non-traced) inputs raise. Under ``jit`` they cannot raise; then a
    priority that is negative, NaN or +-Inf (also a float64 value beyond float32's range, Inf once
    stored) is stored as 0 (that slot is never sampled again until it is overwritten or updated, and
    ``max_priority`` stays finite), and an index outside [0, C) is ignored.

    Args:
      state: a :class:`PERState`.
      indices: [K] integer slots, each in [0, size).
      priorities: [K] float, each finite and >= 0 (e.g. the per-sample loss or |TD error|; add
        a small epsilon yourself if every transition should stay sampleable).

    Returns:
      The new state.

    Raises:
      TypeError: indices not integer or priorities not float.
      ValueError: not 1-D or lengths differ; concrete priorities negative, NaN or infinite (in float32); concrete
        indices outside [0, C) (or outside [0, size) when size is concrete).
    """
    C = _check_state(state)
    if not hasattr(indices, "dtype") or not jnp.issubdtype(indices.dtype, jnp.integer):
        raise TypeError(f"indices must be an integer array, got {getattr(indices, 'dtype', type(indices).__name__)}")
    if not hasattr(priorities, "dtype") or not jnp.issubdtype(priorities.dtype, jnp.floating):
        raise TypeError(f"priorities must be a float array, got "
                        f"{getattr(priorities, 'dtype', type(priorities).__name__)}")
    if len(indices.shape) != 1:
        raise ValueError(f"indices must have shape [K], got {tuple(indices.shape)}")
    if tuple(priorities.shape) != tuple(indices.shape):
        raise ValueError(f"priorities must have shape [K]=[{indices.shape[0]}] like indices, "
                         f"got {tuple(priorities.shape)}")
    K = indices.shape[0]
    if _is_concrete(priorities):
        pv = np.asarray(priorities, np.float64)
        with np.errstate(over="ignore"):
            bad = ~(np.isfinite(pv.astype(np.float32)) & (pv >= 0))  # finite as stored (float32)
        if bad.any():
            k = int(np.argmax(bad))
            why = " (beyond the float32 range they are stored in)" if np.isfinite(pv[k]) and pv[k] > 0 else ""
            raise ValueError(f"priorities must be finite and >= 0; got {pv[k]} at position {k}{why}")
    if _is_concrete(indices):
        iv = np.asarray(indices, np.int64)
        limit = C
        if _is_concrete(state.size):
            limit = int(np.asarray(state.size))
        bad = (iv < 0) | (iv >= limit)
        if bad.any():
            k = int(np.argmax(bad))
            raise ValueError(f"indices must be in [0, {limit}) (filled slots); got {iv[k]} at position {k}")
    if K == 0:
        return state
    new_p, new_max = _update_impl(state.priorities, state.max_priority, indices, priorities)
    return state._replace(priorities=new_p, max_priority=new_max)


@jax.jit
def _update_impl(old_priorities, max_priority, indices, priorities):
    C = old_priorities.shape[0]
    idx = jnp.asarray(indices)
    if jnp.iinfo(idx.dtype).bits < 32:
        idx = idx.astype(jnp.int32)  # widen so that C fits the dtype of the check below
    p = jnp.asarray(priorities).astype(jnp.float32)
    p = jnp.where(jnp.isfinite(p) & (p >= 0), p, 0.0)
    # range check in the indices' own dtype, before narrowing (an int64 2**32 + 1 must not wrap to slot 1)
    idx = jnp.where((idx >= 0) & (idx < C), idx, C).astype(jnp.int32)  # C is out of bounds: dropped below
    order = jnp.argsort(idx, stable=True)
    s_idx, s_p = idx[order], p[order]
    is_last = jnp.concatenate([s_idx[1:] != s_idx[:-1], jnp.ones((1,), bool)])
    write = is_last & (s_idx < C)
    target = jnp.where(write, s_idx, C)
    new_p = old_priorities.at[target].set(s_p, mode="drop", unique_indices=False)
    new_max = jnp.maximum(max_priority, jnp.max(jnp.where(write, s_p, 0.0)))
    return new_p, new_max


# ----------------------------------------------------------------------------------------------
def beta_schedule(total_steps: int, beta0: float = 0.4, beta1: float = 1.0):
    """The IS exponent annealed linearly from beta0 (step 0) to beta1 (step ``total_steps`` and after).

    ``optax.linear_schedule(beta0, beta1, total_steps)``; Schaul et al. 2015 anneal 0.4 -> 1.

    Returns:
      An optax schedule: step (int, may be traced) -> beta (float32 scalar).

    Raises:
      ValueError: total_steps is not an int >= 1; beta0/beta1 outside [0, 1] or an array of shape other than [].
      TypeError: beta0/beta1 is not a real scalar (a bool, a non-numeric value, a traced value).
    """
    T = _positive_int("total_steps", total_steps)
    b0 = _real_scalar("beta0", beta0, 0.0, 1.0, traced=False)
    b1 = _real_scalar("beta1", beta1, 0.0, 1.0, traced=False)
    sched = optax.linear_schedule(b0, b1, T)
    # float32 also under jax_enable_x64 (optax's schedule is float64 there)
    return lambda step: jnp.asarray(sched(step), jnp.float32)


def linear_beta(step, total_steps: int, beta0: float = 0.4, beta1: float = 1.0):
    """``beta_schedule(total_steps, beta0, beta1)(step)``: beta at ``step`` (float32 scalar)."""
    return beta_schedule(total_steps, beta0, beta1)(step)
