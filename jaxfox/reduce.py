"""Deterministic reduction over the batch axis (the last step of every jaxfox backward pass)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from jaxfox._ffi import dispatch, ffi_call as _ffi_call

__all__ = ["reduce_axis0", "reduce_chunks"]


def reduce_chunks(batch: int, size: int) -> int:
    """How many contiguous row ranges the kernel splits ``batch`` rows into for ``size`` columns.

    A fixed function of the shape, so the summation order (and the result, bitwise) depends on
    the shape only. Wide inputs use one range; narrow ones more, to fill the GPU.
    """
    col_blocks = -(-max(size, 1) // 1024)  # blocks of 256 threads x 4 columns
    if batch <= 64 or col_blocks >= 256:
        return 1
    return int(max(1, min(-(-batch // 64), 512 // col_blocks, 65535)))


def backward_tiling(rows: int, row_tile: int, target_blocks: int, work_per_tile: int = 1) -> tuple[int, int]:
    """(tiles_per_block, blocks) of a backward grid over ceil(rows / row_tile) row tiles, each CTA summing
    ``tiles_per_block`` consecutive tiles into one parameter-gradient partial row: about ``target_blocks`` CTAs
    counting ``work_per_tile`` CTAs a tile (e.g. one per VSN variable). A function of the shape only, so the
    summation order of the parameter gradient (and its bits) is fixed by the shape."""
    tiles = -(-rows // row_tile)
    per = max(1, -(-tiles * work_per_tile // target_blocks))
    return per, -(-tiles // per)


def _reduce_kernel(x):
    batch, size = x.shape[-2:]
    chunks = reduce_chunks(batch, size)
    out, _ = _ffi_call(
        "jaxfox_reduce_axis0",
        (jax.ShapeDtypeStruct((size,), jnp.float32),
         jax.ShapeDtypeStruct((chunks * size if chunks > 1 else 0,), jnp.float32)),
        vmap_method="broadcast_all",
    )(x, chunks=np.int64(chunks))
    return out


def _reduce_reference(x):
    return jnp.sum(x, axis=0)


@jax.custom_jvp
def _reduce(x):
    return dispatch(_reduce_kernel, _reduce_reference, x)


@_reduce.defjvp
def _reduce_jvp(primals, tangents):
    # The op is linear: its tangent is the plain sum, which JAX transposes to a broadcast for reverse mode
    # (the FFI call itself is neither differentiable nor transposable, so it only computes the primal).
    (x,), (t,) = primals, tangents
    return _reduce(x), jnp.sum(t, axis=0)


def reduce_axis0(x: jax.Array) -> jax.Array:
    """Sum over the batch axis in a fixed order: x [B, P] float32 -> [P] float32.

    On CUDA the ``jaxfox_reduce_axis0`` kernel sums contiguous row ranges in groups of four,
    ((r0 + r1) + (r2 + r3)), left to right, and adds range partials in order (``ffi/reduce.cu``);
    no atomics, so the result is bitwise identical from run to run for a given shape. NaN and Inf
    propagate. Elsewhere it is ``jnp.sum(x, axis=0)``. Differentiable in forward and reverse mode (and to any
    order; the op is linear): tangents are summed by ``jnp.sum``, cotangents broadcast.

    Raises:
      TypeError: ``x`` is not float32.
      ValueError: ``x`` is not 2-D.
    """
    dtype = getattr(x, "dtype", None)
    if dtype is None or jnp.dtype(dtype) != jnp.float32:  # checked before any conversion
        raise TypeError(f"reduce_axis0: x must be a float32 array, got {dtype if dtype is not None else type(x).__name__}")
    x = jnp.asarray(x)
    if x.ndim != 2:
        raise ValueError(f"reduce_axis0: x must be 2-D [B, P], got shape {x.shape}")
    return _reduce(x)
