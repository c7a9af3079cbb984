"""Concurrent execution of independent work inside one jitted step (XLA CUDA graphs).

Measured on the H200 with jax 0.11.2 (DESIGN.md, issue 5): independent ops of one jitted program
overlap on the GPU only inside XLA command buffers (CUDA graphs) built with
``--xla_gpu_command_buffer_scheduling_mode=CONCURRENT`` -- two independent chains then took 1.3x the time
of one, against 1.9-2.0x with the default (``SERIALIZE``: every command depends on the previous one), and
``compute_on("gpu_stream:N")`` gave no overlap. In CONCURRENT mode the graph's edges follow the data
dependencies of the HLO schedule, so independent trainers of one step (the aux step of
:mod:`jaxfox.models.aux`) run side by side. Command buffers must be on (the default; the flag has no
effect with ``--xla_gpu_enable_command_buffer=``).

XLA reads ``XLA_FLAGS`` once, when the first backend is created (the first ``jax.devices()``, array or
compilation), so :func:`enable_concurrent_command_buffers` must run before that: at the top of a script,
before any JAX computation. The flag name and its values (``SERIALIZE``, ``CONCURRENT``,
``CONCURRENT_REGIONS``) are those of ``xla.DebugOptions.CommandBufferSchedulingMode`` in jaxlib 0.11.2.
The flag is a no-op on CPU (the CPU backend accepts and ignores it).
"""

from __future__ import annotations

import os

__all__ = ["COMMAND_BUFFER_SCHEDULING_FLAG", "enable_concurrent_command_buffers",
           "concurrent_command_buffers_enabled"]

COMMAND_BUFFER_SCHEDULING_FLAG = "--xla_gpu_command_buffer_scheduling_mode"
_MODES = ("SERIALIZE", "CONCURRENT", "CONCURRENT_REGIONS")


def _backends_initialized() -> bool:
    try:
        from jax._src import xla_bridge

        return bool(xla_bridge.backends_are_initialized())
    except Exception:  # pragma: no cover - depends on JAX internals
        return False


def _current_mode(flags: str) -> str | None:
    mode = None
    for f in flags.split():
        if f.startswith(COMMAND_BUFFER_SCHEDULING_FLAG + "="):
            mode = f.split("=", 1)[1]       # XLA takes the last occurrence
    return mode


def concurrent_command_buffers_enabled() -> bool:
    """True when ``XLA_FLAGS`` (as of now) selects CONCURRENT command-buffer scheduling.

    Only meaningful for backends created after the flag was set (see the module docstring).
    """
    return _current_mode(os.environ.get("XLA_FLAGS", "")) == "CONCURRENT"


def enable_concurrent_command_buffers(mode: str = "CONCURRENT") -> None:
    """Makes XLA build CUDA graphs whose independent commands run concurrently.

    Sets ``--xla_gpu_command_buffer_scheduling_mode=<mode>`` in ``XLA_FLAGS`` (replacing an earlier value
    of that flag, keeping every other flag). Call it before JAX initialises its backends (before the
    first computation, ``jax.devices()`` or compilation): XLA parses ``XLA_FLAGS`` once, at backend
    creation. Calling it when the flag is already set to ``mode`` is a no-op at any time.

    Args:
      mode: ``"CONCURRENT"`` (default; graph edges follow data dependencies), ``"SERIALIZE"`` (XLA's
        default: a chain) or ``"CONCURRENT_REGIONS"``.

    Raises:
      ValueError: mode is not one of the three.
      RuntimeError: the backends are already initialised and ``XLA_FLAGS`` does not already hold the
        flag with this mode (setting it now would silently do nothing).
    """
    if mode not in _MODES:
        raise ValueError(f"mode must be one of {_MODES}, got {mode!r}")
    flags = os.environ.get("XLA_FLAGS", "")
    if _current_mode(flags) == mode:
        return
    if _backends_initialized():
        raise RuntimeError(
            f"enable_concurrent_command_buffers(): JAX's backends are already initialised, so setting "
            f"{COMMAND_BUFFER_SCHEDULING_FLAG}={mode} now would have no effect. Call it before the first JAX "
            f"computation, or start the process with XLA_FLAGS='{COMMAND_BUFFER_SCHEDULING_FLAG}={mode}'.")
    kept = [f for f in flags.split() if not f.startswith(COMMAND_BUFFER_SCHEDULING_FLAG + "=")]
    os.environ["XLA_FLAGS"] = " ".join(kept + [f"{COMMAND_BUFFER_SCHEDULING_FLAG}={mode}"])
