"""Argument checks shared by the ops (errors name the argument, raised before anything is traced)."""

from __future__ import annotations

import jax.numpy as jnp

__all__ = ["check_array"]


def check_array(name, x, shape, dtype=jnp.float32):
    """`shape` entries of None match any size. Raises TypeError/ValueError naming `name`."""
    if not hasattr(x, "shape") or not hasattr(x, "dtype"):
        raise TypeError(f"{name} must be an array, got {type(x).__name__}")
    if x.dtype != dtype:
        raise TypeError(f"{name} must be {jnp.dtype(dtype).name}, got {x.dtype}")
    if len(x.shape) != len(shape) or any(w is not None and w != s for w, s in zip(shape, x.shape)):
        want = "[" + ", ".join("?" if w is None else str(w) for w in shape) + "]"
        raise ValueError(f"{name} must have shape {want}, got {tuple(x.shape)}")
