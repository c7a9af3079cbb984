"""Loading and registering the CUDA extension, and choosing the kernel or the reference path.

The extension ``jaxfox._jaxfox_cuda`` is loaded once, on first use. Every handler it exports is
registered with XLA for the CUDA platform. Ops call :func:`dispatch`, which uses
``jax.lax.platform_dependent`` so that one traced function runs the kernels when compiled for a GPU
and the pure-JAX reference anywhere else.

Kernel use is decided when a function is *traced*. :func:`use_reference` is a JAX configuration
state that is part of JAX's trace context and jit cache key (like ``jax.default_matmul_precision``),
so calling an already-jitted function inside it traces it again with the reference path, and
traced ``lax.scan``/``fori_loop`` bodies are not reused across the two modes.
``JAXFOX_DISABLE_KERNELS=1`` (read when a function is traced) forces the reference path for the process.
"""

from __future__ import annotations

import contextlib
import functools
import os
import threading

import jax

__all__ = ["kernels_available", "kernels_unavailable_reason", "use_reference", "dispatch"]


def _make_reference_state():
    """A thread-local JAX config state included in the jit key and trace context.

    Uses ``jax._src.config.bool_state``, the mechanism behind ``jax.default_matmul_precision``.
    Should that internal API change, falls back to a plain thread-local flag (then a function
    jitted outside ``use_reference()`` keeps its kernels inside it: jit it anew there).
    """
    try:
        from jax._src import config as jax_config

        return jax_config.bool_state(
            name="jaxfox_use_reference", default=False,
            help="Trace jaxfox ops with their pure-JAX reference implementations instead of the CUDA kernels.",
            include_in_jit_key=True, include_in_trace_context=True)
    except Exception:  # pragma: no cover - depends on JAX internals
        return None


_reference_state = _make_reference_state()
_local = threading.local()


def _reference_forced() -> bool:
    if _reference_state is not None:
        return bool(_reference_state.value)
    return bool(getattr(_local, "reference", 0))


@functools.cache
def _load() -> tuple[bool, str | None]:
    """Imports the extension and registers its FFI targets. Returns (ok, reason-if-not)."""
    try:
        from jaxfox import _jaxfox_cuda  # type: ignore[attr-defined]
    except ImportError as e:
        return False, f"the CUDA extension jaxfox._jaxfox_cuda is not built ({e}); reference path only"
    built_api = tuple(_jaxfox_cuda.ffi_api_version)
    try:
        for name, capsule in _jaxfox_cuda.targets().items():
            jax.ffi.register_ffi_target(name, capsule, platform="CUDA")
    except Exception as e:  # registration failures name the versions involved
        import jaxlib

        return False, (
            f"registering jaxfox's FFI targets failed ({e}); the extension was built against XLA FFI API "
            f"{built_api[0]}.{built_api[1]} and this runtime is jaxlib {jaxlib.__version__}. "
            "Rebuild jaxfox against the oldest jaxlib you run (see pyproject.toml)."
        )
    return True, None


def _has_cuda_backend() -> bool:
    try:
        return len(jax.devices("cuda")) > 0
    except RuntimeError:
        return False


@functools.cache
def cuda_compute_capability() -> tuple[int, int] | None:
    """Lowest compute capability among the local CUDA devices (None without any)."""
    try:
        caps = [tuple(int(v) for v in str(d.compute_capability).split(".")[:2]) for d in jax.devices("cuda")]
    except (RuntimeError, AttributeError, ValueError):
        return None
    return min(caps) if caps else None


def kernels_unavailable_reason() -> str | None:
    """Why the CUDA kernels are not used on this machine right now, or None when they are."""
    if os.environ.get("JAXFOX_DISABLE_KERNELS", "0") not in ("", "0"):
        return "JAXFOX_DISABLE_KERNELS is set"
    if _reference_forced():
        return "inside jaxfox.use_reference()"
    ok, reason = _load()
    if not ok:
        return reason
    if not _has_cuda_backend():
        return "no CUDA device is visible to JAX; reference path only"
    return None


def kernels_available() -> bool:
    """True when jaxfox ops traced now will run their CUDA kernels on GPU inputs.

    The reason when False is given by :func:`kernels_unavailable_reason`.
    """
    return kernels_unavailable_reason() is None


@contextlib.contextmanager
def use_reference():
    """Context manager: jaxfox ops traced inside it use the pure-JAX reference path (A/B tests, debugging).

    Part of JAX's jit cache key, so ``f = jax.jit(g)`` called inside and outside the context runs
    the reference and the kernel path respectively.
    """
    if _reference_state is not None:
        with _reference_state(True):
            yield
        return
    _local.reference = getattr(_local, "reference", 0) + 1
    try:
        yield
    finally:
        _local.reference -= 1


def dispatch(kernel_fn, reference_fn, *args):
    """``kernel_fn(*args)`` when compiled for CUDA with kernels available, else ``reference_fn(*args)``.

    Both must return the same pytree of shapes and dtypes.
    """
    if not kernels_available():
        return reference_fn(*args)
    return jax.lax.platform_dependent(*args, cuda=kernel_fn, default=reference_fn)
