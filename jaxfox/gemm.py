"""Grouped GEMM: several independent products y_g = x_g @ w_g (+ b_g) in one launch (OPS.md "Grouped GEMM").

Used to fuse the two IQL value networks (identical shapes, different expectiles) and other
same-step trainers whose layers have different shapes. Two entry points:

* :func:`grouped_matmul` -- lists of per-group arrays, shapes may differ per group.
* :func:`grouped_matmul_stacked` -- G groups of one shape stacked along a leading axis
  (``x`` [G, M, K] or one shared ``x`` [M, K], ``w`` [G, K, N]); no slicing or concatenation
  copies, and the output is stacked [G, M, N], ready for the next stacked layer (the IQL pair:
  layer 1 shares the states x between the two networks).

Arithmetic (both entry points, kernel and reference alike): products accumulate in float32; the bias
(cast to the output dtype first) is added to the float32 accumulator; the sum is rounded once to
the output dtype, ``jnp.result_type(x_g, w_g)`` (float32 or bfloat16; a float32/bfloat16 mix is
promoted to float32 as ``jnp.dot`` does).

Precision of float32 groups follows ``jnp.dot``: ``precision=None`` reads
``jax.default_matmul_precision``. "highest"/"float32" (or ``lax.Precision.HIGHEST``), and the
``lax.DotAlgorithmPreset`` s at least as accurate as float32 (``F32_F32_F32``, ``TF32_TF32_F32_X3``,
``BF16_BF16_F32_X6``/``_X9``, or their names): the CUDA kernel uses true float32 FMA (SIMT); anything
else ("default", "tensorfloat32", "bfloat16", None): TF32 tensor cores (10-bit mantissa inputs, float32
accumulation), as XLA's cuBLAS does for float32 dots on Ampere/Hopper by default. bfloat16 groups always use
bfloat16 tensor cores with float32 accumulation (bf16 x bf16 products are exact in float32). The reference path
(off CUDA, or under :func:`jaxfox.use_reference`) is per-group ``jnp.dot(..., preferred_element_type=float32)``.

The CUDA kernels are **opt-in** (``JAXFOX_OPT_IN_KERNELS=grouped_matmul``, read when the op is traced): measured
slower than XLA's cuBLAS calls (BENCHMARKS.md: the IQL pair 0.23x, a mixed 5-group forward 0.59x), so by default
both entry points run the reference on every platform, per-group ``jnp.dot`` differentiated by JAX's autodiff
(whose GPU reductions are XLA's). What follows describes the opted-in path.

CUDA (``ffi/grouped_gemm.cu``): one launch covers every group (a tile scheduler maps the block
index to (group, split, tile) through a per-group table built in Python from the static shapes and
passed as an int64 array attribute; the groups' buffers arrive as separate FFI buffers and their
device pointers are passed by value in the kernel's parameter struct: nothing is copied to the
device, no host sync, command-buffer safe). Backward: dx_g = dy_g w_g^T is a second grouped GEMM
(w read transposed); dw_g = x_g^T dy_g and db_g = sum_m dy_g (as one extra row of ones in x_g^T)
are a split-K grouped GEMM that writes per-split float32 partials to a workspace output, followed by
a kernel that adds the splits in split order (no atomics: bitwise reproducible for a given shape).

Kernel details: 64 x 64 output tiles, K steps of 32, register prefetch + double-buffered shared
memory. float32 "highest": 256 threads, 4 x 4 outputs per thread, fmaf in ascending k. TF32 and
bfloat16: WMMA (16x16x8 tf32 / 16x16x16 bf16) with float32 accumulators, 4 warps of 32 x 32.
Split-K of dw (:func:`wgrad_splits`): about 512 blocks in all, every split >= 512 rows, <= 64 splits,
split length a multiple of 32; the dw GEMM reads x transposed in place (no transpose copy).
Groups of zero size (M, N or K = 0) are produced outside the kernels (zeros, or the bias).

Not fused (XLA does them around the calls): activations, dtype casts of the inputs. With a shared
stacked x the dx of the groups are added in group order in float32 (XLA elementwise adds).
"""

from __future__ import annotations

import functools
from typing import NamedTuple, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from jaxfox._ffi import dispatch, ffi_call as _ffi_call, kernel_opted_in, psum_to_match

__all__ = ["grouped_matmul", "grouped_matmul_stacked", "wgrad_splits"]

_DTYPES = (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16))
_F32 = jnp.dtype(jnp.float32)

# Kernel tile constants (ffi/grouped_gemm.cu kTileM, kTileN, kTileK).
_TILE_M = 64
_TILE_N = 64
_TILE_K = 32
_WGRAD_TARGET_BLOCKS = 512   # split-K fills about this many blocks (a fixed function of shape)
_WGRAD_MIN_ROWS = 512        # each split reduces over at least this many rows (unless M is smaller)
_WGRAD_MAX_SPLITS = 64
_NCOL = 13                   # columns of the group table (ffi/grouped_gemm.cu kTableCols)


# ----------------------------------------------------------------------------------------------
# Validation.
def _check_2d(name, a, dims):
    if not hasattr(a, "shape") or not hasattr(a, "dtype"):
        raise TypeError(f"{name} must be an array, got {type(a).__name__}")
    if jnp.dtype(a.dtype) not in _DTYPES:
        raise TypeError(f"{name} must be float32 or bfloat16, got {a.dtype}")
    if len(a.shape) != len(dims):
        raise ValueError(f"{name} must have shape [{', '.join(dims)}], got {tuple(a.shape)}")


def _seq(name, v):
    if not isinstance(v, (list, tuple)):
        raise TypeError(f"{name} must be a list or tuple of arrays, got {type(v).__name__}")
    return list(v)


# Dot algorithm presets (jax.lax.DotAlgorithmPreset, or their names as jax.default_matmul_precision takes them)
# at least as accurate as float32 FMA: the kernel must not drop them to TF32.
_F32_PRESETS = ("F32_F32_F32", "F64_F64_F64", "TF32_TF32_F32_X3", "BF16_BF16_F32_X6", "BF16_BF16_F32_X9")


def _precision_is_highest(precision) -> bool:
    """True when float32 dots must be exact float32 (no TF32), as jnp.dot would decide."""
    if precision is None:
        from jax._src import config as jax_config

        precision = jax_config.default_matmul_precision.value
        if precision is None:
            return False
    if isinstance(precision, (tuple, list)):
        return all(_precision_is_highest(p) for p in precision)
    if isinstance(precision, jax.lax.Precision):
        return precision == jax.lax.Precision.HIGHEST
    if isinstance(precision, jax.lax.DotAlgorithmPreset):
        return precision.name in _F32_PRESETS
    s = str(precision)
    return s.lower() in ("highest", "float32", "precision.highest") or s.upper() in _F32_PRESETS


# ----------------------------------------------------------------------------------------------
# Pure-JAX reference (also the path off CUDA).
def _ref_one(x, w, b, precision):
    out_dtype = x.dtype
    y = jnp.dot(x, w, precision=precision, preferred_element_type=jnp.float32)
    if b is not None:
        y = y + b.astype(jnp.float32)
    return y.astype(out_dtype)


def _ref_list(precision, xs, ws, bs):
    return tuple(_ref_one(x, w, b, precision) for x, w, b in zip(xs, ws, bs))


def _ref_stacked(precision, x, w, b):
    out_dtype = x.dtype
    if x.ndim == 2:
        y = jnp.einsum("mk,gkn->gmn", x, w, precision=precision, preferred_element_type=jnp.float32)
    else:
        y = jnp.einsum("gmk,gkn->gmn", x, w, precision=precision, preferred_element_type=jnp.float32)
    if b is not None:
        y = y + b.astype(jnp.float32)[:, None, :]
    return y.astype(out_dtype)


# ----------------------------------------------------------------------------------------------
# Kernel path: table-driven FFI calls.
#
# Group table (int64, _NCOL per group), shared by both targets:
#   a_buf, a_off, b_buf, b_off, c_buf, c_off, d_buf, d_off, M, N, K, splits, split_len
# a/b/(d of jaxfox_grouped_gemm) index the operands, c/(d of the wgrad target) the results;
# offsets are in elements of one (un-vmapped) instance; d_buf = -1: no bias / no db.
# jaxfox_grouped_gemm:  C[M, N] = A[M, K] @ B (+ bias D[N]); B is [K, N], or [N, K] read
#                       transposed when transpose_b = 1.  splits = 1.
# jaxfox_grouped_wgrad: C[K, N] = A^T B with A [M, K], B [M, N] (reduction over M split into
#                       `splits` ranges of `split_len` rows), D[N] = sum_m B[m, :].
def wgrad_splits(groups: Sequence[tuple[int, int, int, bool]]) -> list[tuple[int, int]]:
    """Split-K rule of the weight gradient: (splits, split_len) per group (M, K, N, has_bias).

    The reduction over M of group g is cut into ``splits`` contiguous ranges of ``split_len`` rows
    (a multiple of the kernel's K tile, 32), so that all groups together fill about 512 blocks of
    64x64 output tiles, each range at least 512 rows long, at most 64 ranges. A fixed function of
    the static shapes: the summation order, and the result bitwise, depend on the shapes only.
    """
    tiles = [(-(-(K + hb) // _TILE_M)) * (-(-N // _TILE_N)) for (M, K, N, hb) in groups]
    total = max(1, sum(tiles))
    out = []
    for (M, K, N, hb) in groups:
        want = -(-_WGRAD_TARGET_BLOCKS // total)
        s = int(max(1, min(want, M // _WGRAD_MIN_ROWS, _WGRAD_MAX_SPLITS)))
        if M == 0:
            out.append((1, _TILE_K))
            continue
        length = -(-M // s)
        length = -(-length // _TILE_K) * _TILE_K
        s = -(-M // length)
        out.append((int(s), int(length)))
    return out


def _ranks(arrays):
    return np.asarray([a.ndim for a in arrays], np.int64)


def _gemm_call(args, rows, out_structs, transpose_b, tf32):
    """One jaxfox_grouped_gemm call. rows: per group (a, aoff, b, boff, c, coff, d, doff, M, N, K)."""
    table = np.asarray([list(r) + [1, _TILE_K] for r in rows], np.int64).reshape(-1)
    return _ffi_call("jaxfox_grouped_gemm", tuple(out_structs), vmap_method="broadcast_all")(
        *args, table=table, arg_ranks=_ranks(args),
        ret_ranks=np.asarray([len(s.shape) for s in out_structs], np.int64),
        transpose_b=np.int64(transpose_b), tf32=np.int64(tf32))


def _wgrad_call(args, rows, out_structs, tf32):
    """One jaxfox_grouped_wgrad call (the workspace is appended here and dropped from the result).

    rows: per group (a, aoff, b, boff, c, coff, d, doff, M, N, K) with C = A^T B [K, N].
    """
    splits = wgrad_splits([(r[8], r[10], r[9], r[6] >= 0) for r in rows])
    ws = sum(s * (r[10] + (r[6] >= 0)) * r[9] for (s, _), r in zip(splits, rows))
    structs = tuple(out_structs) + (jax.ShapeDtypeStruct((ws,), jnp.float32),)
    table = np.asarray([list(r) + [s, ln] for r, (s, ln) in zip(rows, splits)], np.int64).reshape(-1)
    outs = _ffi_call("jaxfox_grouped_wgrad", structs, vmap_method="broadcast_all")(
        *args, table=table, arg_ranks=_ranks(args),
        ret_ranks=np.asarray([len(s.shape) for s in structs], np.int64), tf32=np.int64(tf32))
    return outs[:-1]


class _ListPlan(NamedTuple):
    """Static description of a list-form call (hashable; nondiff argument of the custom_vjp)."""
    tf32: bool
    has_bias: tuple[bool, ...]


def _list_fwd_impl(plan, xs, ws, bs):
    G = len(xs)
    dtype = xs[0].dtype
    outs = [None] * G
    args = list(xs) + list(ws)
    bias_idx = {}
    for g in range(G):
        if plan.has_bias[g]:
            bias_idx[g] = len(args)
            args.append(bs[g])
    rows, structs, where = [], [], []
    for g in range(G):
        (M, K), N = xs[g].shape, ws[g].shape[1]
        if M == 0 or N == 0 or K == 0:
            y = jnp.zeros((M, N), dtype)
            outs[g] = y + bs[g].astype(dtype) if plan.has_bias[g] else y
            continue
        rows.append((g, 0, G + g, 0, len(structs), 0, bias_idx.get(g, -1), 0, M, N, K))
        structs.append(jax.ShapeDtypeStruct((M, N), dtype))
        where.append(g)
    if rows:
        res = _gemm_call(args, rows, structs, transpose_b=0, tf32=plan.tf32)
        for g, y in zip(where, res):
            outs[g] = y
    return tuple(outs)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _list_kernel(plan, xs, ws, bs):
    return _list_fwd_impl(plan, xs, ws, bs)


def _type_witness(a):
    """A zero-size slice of ``a`` (no memory) that keeps its type (varying mesh axes) for the backward pass."""
    return None if a is None else a.reshape(-1)[:0]


def _list_kernel_fwd(plan, xs, ws, bs):
    return _list_fwd_impl(plan, xs, ws, bs), (xs, ws, tuple(_type_witness(b) for b in bs))


def _list_kernel_bwd(plan, res, dys):
    xs, ws, b_like = res
    G = len(xs)
    dtype = xs[0].dtype
    dys = [dy.astype(dtype) for dy in dys]
    # dx_g = dy_g @ w_g^T: its own call, so XLA drops it when no x needs a gradient.
    dxs = [jnp.zeros(x.shape, dtype) for x in xs]
    rows, structs, where = [], [], []
    for g in range(G):
        (M, K), N = xs[g].shape, ws[g].shape[1]
        if M == 0 or K == 0 or N == 0:
            continue
        rows.append((g, 0, G + g, 0, len(structs), 0, -1, 0, M, K, N))
        structs.append(jax.ShapeDtypeStruct((M, K), dtype))
        where.append(g)
    if rows:
        res_dx = _gemm_call(list(dys) + list(ws), rows, structs, transpose_b=1, tf32=plan.tf32)
        for g, v in zip(where, res_dx):
            dxs[g] = v
    # dw_g = x_g^T dy_g, db_g = sum_m dy_g (split-K, deterministic).
    dws = [jnp.zeros(w.shape, dtype) for w in ws]
    dbs = [jnp.zeros((w.shape[1],), dtype) if hb else None for w, hb in zip(ws, plan.has_bias)]
    rows, structs, where = [], [], []
    for g in range(G):
        (M, K), N = xs[g].shape, ws[g].shape[1]
        if K + plan.has_bias[g] == 0 or N == 0:
            continue
        c = len(structs)
        structs.append(jax.ShapeDtypeStruct((K, N), dtype))
        d = -1
        if plan.has_bias[g]:
            d = len(structs)
            structs.append(jax.ShapeDtypeStruct((N,), dtype))
        rows.append((g, 0, G + g, 0, c, 0, d, 0, M, N, K))
        where.append((g, c, d))
    if rows:
        res_w = _wgrad_call(list(xs) + list(dys), rows, structs, plan.tf32)
        for g, c, d in where:
            dws[g] = res_w[c]
            if d >= 0:
                dbs[g] = res_w[d]
    G2 = len(xs)
    sums = psum_to_match(tuple(dxs) + tuple(dws) + tuple(dbs), tuple(xs) + tuple(ws) + tuple(b_like))
    return sums[:G2], sums[G2:2 * G2], sums[2 * G2:]


_list_kernel.defvjp(_list_kernel_fwd, _list_kernel_bwd)


class _StackPlan(NamedTuple):
    tf32: bool
    shared_x: bool
    has_bias: bool


def _stack_fwd_impl(plan, x, w, b):
    G, K, N = w.shape
    M = x.shape[-2]
    dtype = x.dtype
    if M == 0 or N == 0 or K == 0:
        y = jnp.zeros((G, M, N), dtype)
        return y + b.astype(dtype)[:, None, :] if plan.has_bias else y
    args = [x, w] + ([b] if plan.has_bias else [])
    rows = [(0, 0 if plan.shared_x else g * M * K, 1, g * K * N, 0, g * M * N,
             2 if plan.has_bias else -1, g * N, M, N, K) for g in range(G)]
    (y,) = _gemm_call(args, rows, [jax.ShapeDtypeStruct((G, M, N), dtype)], transpose_b=0, tf32=plan.tf32)
    return y


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _stack_kernel(plan, x, w, b):
    return _stack_fwd_impl(plan, x, w, b)


def _stack_kernel_fwd(plan, x, w, b):
    return _stack_fwd_impl(plan, x, w, b), (x, w, _type_witness(b))


def _stack_kernel_bwd(plan, res, dy):
    x, w, b_like = res
    G, K, N = w.shape
    M = x.shape[-2]
    dtype = x.dtype
    dy = dy.astype(dtype)
    if M == 0 or K == 0 or N == 0:
        dx = jnp.zeros(x.shape, dtype)
    else:
        rows = [(0, g * M * N, 1, g * K * N, 0, g * M * K, -1, 0, M, K, N) for g in range(G)]
        (dxg,) = _gemm_call([dy, w], rows, [jax.ShapeDtypeStruct((G, M, K), dtype)], transpose_b=1,
                            tf32=plan.tf32)
        if plan.shared_x:  # the groups' contributions added in group order, in float32
            acc = dxg[0].astype(jnp.float32)
            for g in range(1, G):
                acc = acc + dxg[g].astype(jnp.float32)
            dx = acc.astype(dtype)
        else:
            dx = dxg
    db = None
    if N == 0 or K + plan.has_bias == 0:
        dw = jnp.zeros(w.shape, dtype)
        if plan.has_bias:
            db = jnp.zeros((G, N), dtype)
    else:
        structs = [jax.ShapeDtypeStruct((G, K, N), dtype)]
        if plan.has_bias:
            structs.append(jax.ShapeDtypeStruct((G, N), dtype))
        rows = [(0, 0 if plan.shared_x else g * M * K, 1, g * M * N, 0, g * K * N,
                 1 if plan.has_bias else -1, g * N, M, N, K) for g in range(G)]
        res_w = _wgrad_call([x, dy], rows, structs, plan.tf32)
        dw = res_w[0]
        if plan.has_bias:
            db = res_w[1]
    return psum_to_match((dx, dw, db), (x, w, b_like))


_stack_kernel.defvjp(_stack_kernel_fwd, _stack_kernel_bwd)


def _kernel_opted_in() -> bool:
    """The grouped-GEMM kernels are opt-in (``JAXFOX_OPT_IN_KERNELS=grouped_matmul``, read at trace time).

    Measured on the H200 (BENCHMARKS.md, 2026-11-29) they are slower than XLA's cuBLAS calls: the IQL
    pair 0.23x and a mixed 5-group forward 0.59x. Until they win, grouped_matmul runs the per-group
    ``jnp.dot`` reference on every platform by default.
    """
    return kernel_opted_in("grouped_matmul")

# ----------------------------------------------------------------------------------------------
# Public API.
def grouped_matmul(xs, ws, bs=None, *, precision=None) -> list:
    """Grouped GEMM: ``[x_g @ w_g + b_g for g]`` with per-group shapes, one kernel launch on CUDA when opted in.

    By default this is per-group ``jnp.dot`` (+ b_g) on every platform, differentiated by JAX; the CUDA kernels
    run with ``JAXFOX_OPT_IN_KERNELS=grouped_matmul`` (module docstring: they measured slower than XLA's).

    Args:
      xs: list of G >= 1 arrays x_g [M_g, K_g] (M_g rows, K_g input features; M_g = 0 allowed).
      ws: list of G arrays w_g [K_g, N_g] (``x @ W`` convention, [in, out]).
      bs: None, or a list of G entries, each None or b_g [N_g] (cast to the group's output dtype).
      precision: as ``jnp.dot``'s; None reads ``jax.default_matmul_precision``. For float32
        groups on CUDA, "highest"/"float32" (or a float32-accurate ``lax.DotAlgorithmPreset`` such as
        ``F32_F32_F32``) run true float32 FMA; otherwise TF32 tensor cores.

    Dtypes: float32 or bfloat16. Group g's output dtype is ``jnp.result_type(x_g, w_g)`` (a mix
    is promoted to float32); products accumulate in float32, the bias is added in float32, and the
    result is rounded once. Groups of different dtypes run as one launch per dtype.

    Returns:
      list of G arrays y_g [M_g, N_g].

    Differentiable in xs, ws and bs (kernel path: ``jax.custom_vjp``, grouped dx = dy w^T, split-K grouped
    dw = x^T dy and db = sum over M of dy, summed in a fixed order: bitwise reproducible; by default JAX's
    autodiff of the per-group dots). Each
    gradient has its input's dtype. On CUDA, the dx GEMM is a separate launch that XLA removes
    when no x needs a gradient. Forward mode (``jax.jvp``) works only off the kernel path.

    Sharding: with the rows (M) of the x_g split over Explicit mesh axes (``jax.make_mesh``), the kernel
    path runs per device on its rows (``jax.shard_map``; the weights whole on each device, their gradients
    summed over the devices); rows that do not divide over those axes, or an x split along K, run the
    reference (:func:`jaxfox._ffi.dispatch`).

    Source: OPS.md "Grouped GEMM"; the math of ``jnp.dot(x_g, w_g) + b_g`` per group
    (cf. cuBLAS ``cublasGemmGroupedBatchedEx``, CUTLASS grouped GEMM).

    Raises:
      TypeError: xs/ws/bs are not lists or tuples, an entry is not a float32/bfloat16 array.
      ValueError: xs and ws (or bs) have different lengths, G = 0, or a shape does not match
        (the message names the argument and the group, e.g. ``ws[1]``, with expected and actual shape);
        a precision that ``jnp.dot`` does not take (its own message).
    """
    xs, ws = _seq("xs", xs), _seq("ws", ws)
    G = len(xs)
    if G == 0:
        raise ValueError("xs must hold at least one group, got an empty list")
    if len(ws) != G:
        raise ValueError(f"ws must have one entry per group of xs ({G}), got {len(ws)}")
    if bs is None:
        bs = [None] * G
    bs = _seq("bs", bs)
    if len(bs) != G:
        raise ValueError(f"bs must have one entry per group of xs ({G}), got {len(bs)}")
    for g in range(G):
        x, w, b = xs[g], ws[g], bs[g]
        _check_2d(f"xs[{g}]", x, ("M", "K"))
        _check_2d(f"ws[{g}]", w, ("K", "N"))
        if w.shape[0] != x.shape[1]:
            raise ValueError(f"ws[{g}] must have shape [K, N] with K = {x.shape[1]} (xs[{g}] is "
                             f"{tuple(x.shape)}), got {tuple(w.shape)}")
        if b is not None:
            _check_2d(f"bs[{g}]", b, ("N",))
            if tuple(b.shape) != (w.shape[1],):
                raise ValueError(f"bs[{g}] must have shape [{w.shape[1]}] (N of ws[{g}]), got {tuple(b.shape)}")
    highest = _precision_is_highest(precision)
    # Promote per group as jnp.dot; then one call per dtype class.
    xs_c, ws_c, bs_c = [], [], []
    for x, w, b in zip(xs, ws, bs):
        dt = jnp.result_type(x.dtype, w.dtype)
        xs_c.append(jnp.asarray(x, dt))
        ws_c.append(jnp.asarray(w, dt))
        bs_c.append(None if b is None else jnp.asarray(b, dt))
    out = [None] * G
    for dt in _DTYPES:
        idx = [g for g in range(G) if xs_c[g].dtype == dt]
        if not idx:
            continue
        plan = _ListPlan(tf32=bool(dt == _F32 and not highest),
                         has_bias=tuple(bs_c[g] is not None for g in idx))
        sx = tuple(xs_c[g] for g in idx)
        sw = tuple(ws_c[g] for g in idx)
        sb = tuple(bs_c[g] for g in idx)
        ref = functools.partial(_ref_list, precision)
        res = dispatch(functools.partial(_list_kernel, plan) if _kernel_opted_in() else ref, ref, sx, sw, sb,
                       batch=(True, False, False))
        for g, y in zip(idx, res):
            out[g] = y
    return out


def grouped_matmul_stacked(x, w, b=None, *, precision=None):
    """G same-shape groups stacked on a leading axis: y[g] = x[g] @ w[g] + b[g] (one launch on CUDA when opted in,
    as :func:`grouped_matmul`; by default batched ``jnp`` dots).

    The convenience for identical networks trained side by side (the IQL pair): no per-group
    slicing, stacked output for the next stacked layer, and a shared input without a copy.

    Args:
      x: [G, M, K], or [M, K] shared by every group (e.g. the states fed to both value networks).
      w: [G, K, N].
      b: None or [G, N].
      precision: as in :func:`grouped_matmul`.

    Dtypes, accumulation, precision and gradients as :func:`grouped_matmul`; the output dtype is
    ``jnp.result_type(x, w)``. With a shared x [M, K], dx = sum_g dy[g] w[g]^T (the per-group
    products are summed in group order). Sharding as :func:`grouped_matmul` (the rows are x's axis M).

    Returns:
      y [G, M, N].

    Raises:
      TypeError: an argument is not a float32/bfloat16 array.
      ValueError: a shape does not match (names the argument, the expected and the actual shape).
    """
    if not hasattr(w, "shape") or not hasattr(w, "dtype"):
        raise TypeError(f"w must be an array, got {type(w).__name__}")
    _check_2d("w", w, ("G", "K", "N"))
    G, K, N = w.shape
    if G < 1:
        raise ValueError(f"w must hold at least one group, got shape {tuple(w.shape)}")
    if not hasattr(x, "shape") or not hasattr(x, "dtype"):
        raise TypeError(f"x must be an array, got {type(x).__name__}")
    if len(x.shape) == 2:
        _check_2d("x", x, ("M", "K"))
        if x.shape[1] != K:
            raise ValueError(f"x must have shape [M, {K}] (K of w {tuple(w.shape)}), got {tuple(x.shape)}")
    else:
        _check_2d("x", x, ("G", "M", "K"))
        if x.shape[0] != G or x.shape[2] != K:
            raise ValueError(f"x must have shape [{G}, M, {K}] (w is {tuple(w.shape)}), got {tuple(x.shape)}")
    if b is not None:
        _check_2d("b", b, (str(G), str(N)))
        if tuple(b.shape) != (G, N):
            raise ValueError(f"b must have shape [{G}, {N}], got {tuple(b.shape)}")
    dt = jnp.result_type(x.dtype, w.dtype)
    x, w = jnp.asarray(x, dt), jnp.asarray(w, dt)
    if b is not None:
        b = jnp.asarray(b, dt)
    plan = _StackPlan(tf32=bool(dt == _F32 and not _precision_is_highest(precision)),
                      shared_x=x.ndim == 2, has_bias=b is not None)
    ref = functools.partial(_ref_stacked, precision)
    return dispatch(functools.partial(_stack_kernel, plan) if _kernel_opted_in() else ref, ref, x, w, b,
                    batch=(x.ndim - 2, False, False), out_batch=1)
