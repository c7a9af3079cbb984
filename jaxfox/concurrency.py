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


_WS = " \t\r\n"


def _flag_spans(flags: str) -> list[tuple[int, int, str, str | None]]:
    """(start, end, name, value) of each flag of an ``XLA_FLAGS`` string, read as XLA's ``ParseArgvFromString``
    (xla/parse_flags_from_env.cc) reads it: ``--name=value`` up to the next whitespace, or ``--name="v a l"`` /
    ``--name='v a l'`` (quotes removed from the value; backslash escapes in double quotes); value None for a
    flag without ``=``. Stops, as XLA does, at the first token that does not start with '-'."""
    spans, n = [], len(flags)
    b = len(flags) - len(flags.lstrip(_WS))
    while b < n and flags[b] == "-":
        e = b
        while e < n and flags[e].isascii() and (flags[e] in "-_" or flags[e].isalnum()):
            e += 1
        name = flags[b:e]
        if e + 1 < n and flags[e] == "=" and flags[e + 1] in "'\"":
            quote, e, chars = flags[e + 1], e + 2, []
            while e < n and flags[e] != quote:
                if quote == '"' and flags[e] == "\\" and e + 1 < n:
                    e += 1
                chars.append(flags[e])
                e += 1
            e = min(e + 1, n)  # past the closing quote
            value = "".join(chars)
        else:
            s = e
            while e < n and flags[e] not in _WS:
                e += 1
            value = flags[s + 1:e] if flags[s:s + 1] == "=" else None
        spans.append((b, e, name, value))
        b = e + len(flags[e:]) - len(flags[e:].lstrip(_WS))
    return spans


def _read_flags() -> tuple[str, str | None]:
    """(the flags XLA will parse, the file they are read from or None). XLA takes an ``XLA_FLAGS`` value whose first
    non-blank character is not '-' as the name of a file holding the flags; raises OSError if it cannot be read."""
    env = os.environ.get("XLA_FLAGS", "")
    if env.strip(_WS) == "" or env.lstrip(_WS).startswith("-"):
        return env, None
    with open(env) as f:
        return f.read(), env


def _current_mode(flags: str) -> str | None:
    mode = None
    for _, _, name, value in _flag_spans(flags):
        if name == COMMAND_BUFFER_SCHEDULING_FLAG and value is not None:
            mode = value       # XLA takes the last occurrence
    return mode


def concurrent_command_buffers_enabled() -> bool:
    """True when ``XLA_FLAGS`` (as of now) selects CONCURRENT command-buffer scheduling.

    Only meaningful for backends created after the flag was set (see the module docstring).
    """
    try:
        flags, _ = _read_flags()
    except OSError:  # XLA_FLAGS names a file that cannot be read (XLA itself would stop at start-up)
        return False
    return _current_mode(flags) == "CONCURRENT"


def enable_concurrent_command_buffers(mode: str = "CONCURRENT") -> None:
    """Makes XLA build CUDA graphs whose independent commands run concurrently.

    Sets ``--xla_gpu_command_buffer_scheduling_mode=<mode>`` in ``XLA_FLAGS`` (replacing an earlier value
    of that flag, keeping every other flag verbatim, quoted values included; when ``XLA_FLAGS`` is the name of a
    file of flags, which XLA also accepts, the file's flags are written into ``XLA_FLAGS`` with this one). Call it
    before JAX initialises its backends (before the
    first computation, ``jax.devices()`` or compilation): XLA parses ``XLA_FLAGS`` once, at backend
    creation. Calling it when the flag is already set to ``mode`` is a no-op at any time.

    Args:
      mode: ``"CONCURRENT"`` (default; graph edges follow data dependencies), ``"SERIALIZE"`` (XLA's
        default: a chain) or ``"CONCURRENT_REGIONS"``.

    Raises:
      ValueError: mode is not one of the three; ``XLA_FLAGS`` names a file of flags that cannot be read or does
        not start with a flag.
      RuntimeError: the backends are already initialised and ``XLA_FLAGS`` does not already hold the
        flag with this mode (setting it now would silently do nothing).
    """
    if mode not in _MODES:
        raise ValueError(f"mode must be one of {_MODES}, got {mode!r}")
    try:
        flags, path = _read_flags()
    except OSError as e:
        raise ValueError(f"XLA_FLAGS={os.environ['XLA_FLAGS']!r} does not start with '-', so XLA reads it as the name "
                         f"of a file of flags, and that file cannot be read ({e}); set XLA_FLAGS to the flags "
                         "themselves") from None
    if _current_mode(flags) == mode:
        return
    if _backends_initialized():
        raise RuntimeError(
            f"enable_concurrent_command_buffers(): JAX's backends are already initialised, so setting "
            f"{COMMAND_BUFFER_SCHEDULING_FLAG}={mode} now would have no effect. Call it before the first JAX "
            f"computation, or start the process with XLA_FLAGS='{COMMAND_BUFFER_SCHEDULING_FLAG}={mode}'.")
    if path is not None and flags.strip(_WS) and not flags.lstrip(_WS).startswith("-"):
        raise ValueError(f"XLA_FLAGS names the file {path!r}, whose contents do not start with a flag ('-'): "
                         "add the flag to XLA_FLAGS or to that file by hand")
    # Cut the earlier values of the flag out of the string as XLA tokenises it, keeping everything else verbatim
    # (quoted values with their whitespace); a file of flags (XLA_FLAGS = its name) is inlined, as appending to
    # the name would make XLA look for a file of that longer name and stop the process at start-up.
    kept, pos = [], 0
    for start, end, name, value in _flag_spans(flags):
        if name == COMMAND_BUFFER_SCHEDULING_FLAG and value is not None:
            kept.append(flags[pos:start])
            pos = end
    kept.append(flags[pos:])
    rest = "".join(kept).strip(_WS)
    os.environ["XLA_FLAGS"] = (rest + " " if rest else "") + f"{COMMAND_BUFFER_SCHEDULING_FLAG}={mode}"
