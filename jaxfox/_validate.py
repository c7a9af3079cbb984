"""Argument checks shared by the ops (errors name the argument, raised before anything is traced)."""

from __future__ import annotations

import math

import os
import tempfile

import jax
import jax.numpy as jnp
import numpy as np

__all__ = ["check_array", "float32_param_dtype", "in_open_unit_float32", "is_concrete", "no_float64_without_x64",
           "positive_float32", "positive_int", "real_scalar", "unwritable_reason"]

_F32_TINY = float(np.finfo(np.float32).tiny)  # 2^-126, the smallest normal float32


def is_concrete(x) -> bool:
    """True unless ``x`` is a tracer (a value known only when the jitted function runs)."""
    return not isinstance(x, jax.core.Tracer)


def check_array(name, x, shape, dtype=jnp.float32):
    """`shape` entries of None match any size. Raises TypeError/ValueError naming `name`."""
    if not hasattr(x, "shape") or not hasattr(x, "dtype"):
        raise TypeError(f"{name} must be an array, got {type(x).__name__}")
    if x.dtype != dtype:
        raise TypeError(f"{name} must be {jnp.dtype(dtype).name}, got {x.dtype}")
    if len(x.shape) != len(shape) or any(w is not None and w != s for w, s in zip(shape, x.shape)):
        want = "[" + ", ".join("?" if w is None else str(w) for w in shape) + "]"
        raise ValueError(f"{name} must have shape {want}, got {tuple(x.shape)}")


def check_key(key, prefix="", batch_hint="vmap over keys for several draws"):
    """Refuses anything but a single PRNG key: a typed key of shape [] (``jax.random.key``) or a raw uint32 key
    [n] (``jax.random.PRNGKey``; JAX checks n against the PRNG implementation). ``prefix`` starts the message
    (e.g. "cfc_init: "); ``batch_hint`` says what to do with a batch of keys.

    Raises:
      TypeError: key is not a jax.random key (an int seed, None, an array of another dtype).
      ValueError: key is a batch of keys.
    """
    dt = getattr(key, "dtype", None)
    if dt is not None and jnp.issubdtype(dt, jax.dtypes.prng_key):
        if tuple(key.shape) != ():
            raise ValueError(f"{prefix}key must be a single jax.random key (shape []), got a key array of shape "
                             f"{tuple(key.shape)} ({batch_hint})")
    elif dt is None or jnp.dtype(dt) != jnp.uint32:
        what = f"an array of dtype {jnp.dtype(dt)}" if dt is not None else type(key).__name__
        raise TypeError(f"{prefix}key must be a single jax.random key (jax.random.key(seed), or a uint32 [2] "
                        f"jax.random.PRNGKey), got {what}")
    elif len(key.shape) != 1:
        raise ValueError(f"{prefix}key must be a single jax.random key (a raw uint32 key has shape [2]), got shape "
                         f"{tuple(key.shape)}")


def check_rngs(rngs) -> None:
    """Refuses anything but an ``nnx.Rngs`` as a flax.nnx module's ``rngs`` (None or an int seed failed with an
    AttributeError on ``rngs.params``).

    Raises:
      TypeError: rngs is not an ``nnx.Rngs``.
    """
    from flax import nnx  # here, not at import: the functional ops do not need flax

    if not isinstance(rngs, nnx.Rngs):
        raise TypeError(f"rngs must be an nnx.Rngs (e.g. nnx.Rngs(0); its 'params' stream draws the parameters), got "
                        f"{type(rngs).__name__}")


def float32_param_dtype(fn, dtype, inputs="cast activations, not parameters, to bfloat16"):
    """The ``dtype`` argument of an ``*_init`` whose op takes float32 parameters only: TypeError unless float32, so
    that a bfloat16 init fails where it is asked for, not at the op's first call. ``inputs`` ends the message with
    what the op takes as inputs (the default suits ops that take bfloat16 activations)."""
    try:
        dt = jnp.dtype(dtype)
    except TypeError:
        dt = None
    if dt != jnp.float32:
        raise TypeError(f"{fn}: dtype must be float32 (the op takes float32 parameters; {inputs}), got {dtype!r}")
    return dt


def no_float64_without_x64(name, dtype, result) -> None:
    """TypeError when ``dtype`` is float64 while ``jax_enable_x64`` is off: JAX would compute in float32 and return
    ``result`` as float32, not in the caller's dtype. ``name`` names the array, ``result`` what comes back."""
    if dtype == np.float64 and not jax.config.jax_enable_x64:
        raise TypeError(f"{name} is float64 but jax_enable_x64 is off: {result} would come back float32, not "
                        "float64; pass float32 (or enable x64)")


def positive_int(name, value, minimum=1):
    """``value`` as an int; ValueError naming ``name`` unless it is an int (not a bool) >= ``minimum``."""
    if not isinstance(value, (int, np.integer)) or isinstance(value, bool) or value < minimum:
        raise ValueError(f"{name} must be an int >= {minimum}, got {value!r}")
    return int(value)


def real_scalar(name, value, lo=None, hi=None, *, lo_open=False, hi_open=False, traced=True):
    """A real scalar hyperparameter (a mixing weight, an exponent, a learning rate, ...), checked before anything runs.

    Accepts a Python or NumPy int/float, or a 0-d integer/floating array (NumPy or JAX; a tracer when ``traced``,
    e.g. a schedule's value inside ``jax.jit`` or what ``optax.inject_hyperparams`` passes).

    Returns:
      a concrete value as a Python float, after checking it is finite and within [lo, hi] (``lo_open`` /
      ``hi_open``: that end excluded; None: unbounded); a tracer unchanged (its value is unknown: not checked).

    Raises:
      TypeError: ``value`` is a bool (Python's, NumPy's, or a bool array: True is not a weight of 1.0), not a
        number or array, of a non-real dtype, or traced when ``traced`` is False.
      ValueError: an array of shape other than [], or a concrete value that is not finite or out of range.
    """
    is_array = hasattr(value, "dtype") and hasattr(value, "shape")
    if isinstance(value, (bool, np.bool_)) or (is_array and jnp.dtype(value.dtype) == jnp.dtype(bool)):
        raise TypeError(f"{name} must be a real scalar, got a bool ({value!r})")
    if is_array:
        dt = jnp.dtype(value.dtype)
        if not (jnp.issubdtype(dt, jnp.floating) or jnp.issubdtype(dt, jnp.integer)):
            raise TypeError(f"{name} must be a real scalar, got an array of dtype {dt}")
        if tuple(value.shape) != ():
            raise ValueError(f"{name} must be a scalar (shape []), got shape {tuple(value.shape)}")
        if not is_concrete(value):
            if not traced:
                raise TypeError(f"{name} must be a concrete real scalar (it is used at trace time), got a traced "
                                f"value")
            return value
    elif not isinstance(value, (int, float, np.integer, np.floating)):
        raise TypeError(f"{name} must be a real scalar, got {type(value).__name__}")
    try:
        v = float(np.asarray(value, np.float64))
    except OverflowError:  # a Python int beyond float64's range (10**400): not finite
        v = math.inf
    ok = math.isfinite(v) and (lo is None or (v > lo if lo_open else v >= lo)) and (
        hi is None or (v < hi if hi_open else v <= hi))
    if not ok:
        rng = (("(" if lo_open else "[") + _number(lo) if lo is not None else "(-inf") + ", " + (
            _number(hi) + (")" if hi_open else "]") if hi is not None else "inf)")
        raise ValueError(f"{name} must be finite and in {rng}, got {v if is_array else value!r}")
    return v


def _number(x):
    """A bound as written: 0 and 1 for 0.0 and 1.0, every digit otherwise (0.9999999 is not rounded to 1)."""
    return str(int(x)) if float(x).is_integer() and abs(x) < 2 ** 53 else repr(float(x))


def positive_float32(name, value):
    """A static positive constant of float32 arithmetic (a LayerNorm eps, a Huber threshold) as a Python float.

    Raises:
      TypeError: as :func:`real_scalar` (also for a traced value: the constant is baked into the computation).
      ValueError: not finite and > 0, or not a normal float32 (1e-46 would be 0 there, 1e39 inf, and a subnormal
        such as 1e-40 is flushed to 0 by XLA: a LayerNorm eps of 1e-44 gave NaN on a constant row on CPU).
    """
    v = real_scalar(name, value, 0.0, lo_open=True, traced=False)
    with np.errstate(over="ignore", under="ignore"):
        v32 = float(np.float32(v))
    if not (math.isfinite(v32) and v32 >= _F32_TINY):
        raise ValueError(f"{name} must be a positive finite normal float32 (about 1.2e-38 to 3.4e38), got {value!r}")
    return v


def in_open_unit_float32(value) -> bool:
    """True when every element of ``value`` (a concrete real number or array) is in (0, 1) both as given and after
    rounding to float32, the precision the ops compute in, and not subnormal there: an expectile of 1 - 1e-9 (or
    1e-50) would otherwise become exactly 1.0 (or 0.0) there, and XLA flushes a subnormal one (1e-40) to 0, silently
    turning the asymmetric loss one-sided. NaN is not in (0, 1)."""
    with np.errstate(over="ignore", under="ignore", invalid="ignore"):
        v = np.asarray(value, np.float64)
        v32 = v.astype(np.float32)
    return bool(np.all((v > 0) & (v < 1) & (v32 >= _F32_TINY) & (v32 < 1)))


def unwritable_reason(path, *, folder: bool) -> str | None:
    """Why a command's results could not be written to ``path`` at the end of its run, or None; checked before it.

    ``folder``: ``path`` is an output folder (made later when missing); else an output file (its folder made later
    when missing), which must not be an existing folder. The deepest existing folder on the way must be a folder in
    which a file can be created (a read-only or pseudo file system such as /proc is not, whatever the permissions
    say to root): one temporary file is written and removed there, and nothing else is created. Used by the
    command-line checks (``python -m jaxfox.bench``'s --json / --plot, the example scripts' --out).
    """
    if not folder and os.path.isdir(path):
        return "is a folder; name a file"
    probe = os.path.abspath(path)
    probe = probe if folder else os.path.dirname(probe)
    while not os.path.exists(probe):
        probe = os.path.dirname(probe)
    if not os.path.isdir(probe):
        return f"{probe} exists and is not a folder"
    try:
        with tempfile.TemporaryFile(dir=probe):
            pass
    except OSError as e:
        return f"cannot write files in {probe} ({e.strerror or e})"
    return None
