"""Argument checks shared by the ops (errors name the argument, raised before anything is traced)."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np

__all__ = ["check_array", "positive_int"]


def check_array(name, x, shape, dtype=jnp.float32):
    """`shape` entries of None match any size. Raises TypeError/ValueError naming `name`."""
    if not hasattr(x, "shape") or not hasattr(x, "dtype"):
        raise TypeError(f"{name} must be an array, got {type(x).__name__}")
    if x.dtype != dtype:
        raise TypeError(f"{name} must be {jnp.dtype(dtype).name}, got {x.dtype}")
    if len(x.shape) != len(shape) or any(w is not None and w != s for w, s in zip(shape, x.shape)):
        want = "[" + ", ".join("?" if w is None else str(w) for w in shape) + "]"
        raise ValueError(f"{name} must have shape {want}, got {tuple(x.shape)}")


def positive_int(name, value, minimum=1):
    """``value`` as an int; ValueError naming ``name`` unless it is an int (not a bool) >= ``minimum``."""
    if not isinstance(value, (int, np.integer)) or isinstance(value, bool) or value < minimum:
        raise ValueError(f"{name} must be an int >= {minimum}, got {value!r}")
    return int(value)
