"""Benchmark harness: every jaxfox op and training step, kernel path against the pure-XLA reference.

Run it as ``python -m jaxfox.bench`` (see ``__main__.py`` for the options). For each case the same
function is built and compiled twice in one process:

* the **jaxfox** path: traced normally, so on a GPU with the extension built the ops lower to the
  CUDA kernels (``jaxfox._ffi.dispatch``);
* the **reference** path: traced and compiled inside ``jaxfox.use_reference()`` (kernel choice is
  made at trace time, so the function is lowered and compiled inside the context).

Timing is on the device, not in Python: one compiled call runs the op ``n_inner`` times inside a
``lax.fori_loop`` (``unroll`` op calls per trip for tiny ops). Before each op call the first element
of every input (of a PRNG key: of its key data) is set to its original value + ``0 * (an element of
the previous outputs)`` (an in-place one-element
``dynamic_update_slice``; XLA does not fold float ``a * 0``), so XLA can neither hoist the op out of
the loop nor merge iterations, and the outputs of every op call (all ``unroll`` of a trip) are
carried, so none is dead code. (An
``optimization_barrier`` is not enough: XLA removes it before loop-invariant code motion.)
Stateful cases (a training step) carry their state and perturb only the other inputs. Inputs are
donated on GPU and the loop's final inputs are fed to the next call, so no copy enters the timing.
``n_inner`` is calibrated so that one call takes at least ``min_call_ms`` (default 20 ms, so the
~44 us Python dispatch is amortised): on accelerators the trip count is static (known to XLA, so no
host round trip per trip; a new count means a new compilation, usually 2 in all per path), on CPU
it is an argument of one compiled program. One warm-up call follows compilation; then ``repeats``
calls are timed with ``time.perf_counter`` around ``block_until_ready`` and the median per op call
is reported. The loop's own cost per op call (the same loop around a null op: the one-element
updates and the loop counter) is measured too and reported as "loop ovh"; it is included in, not
subtracted from, the op times. The carried outputs start as constant fills (one memset each per timed
call).
Both paths are compiled and calibrated first, then their timed calls alternate, so a change in
the machine's load hits both alike; a path whose program is identical to the other's (the jaxfox
path where the kernels are unavailable) reuses the compiled program.

Adding a row: write a function ``case(size) -> list[Variant]`` in :mod:`jaxfox.bench.cases` and
decorate it with ``@register("name")``. A :class:`Variant`'s ``setup()`` returns a :class:`CaseSpec`
``(kernel_builder, reference_builder, inputs, bytes, flops)``; a builder is a zero-argument callable
returning the op ``f(*inputs)``, called inside the path's context. A case function may carry a
``summarize`` attribute, ``rows -> str``: called with the case's rows after they ran, its text is
printed (before the table) and it may add fields to the rows (e.g. the aux_step timing breakdown).
"""

from __future__ import annotations

import dataclasses
import datetime
import math
import os
import platform
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

__all__ = [
    "CaseSpec", "Variant", "SkipCase", "REGISTRY", "register", "SIZES",
    "run_variant", "run_cases", "environment", "format_table", "save_json", "save_plot",
]

SIZES = ("small", "default", "large")


class CaseSpec(NamedTuple):
    """What a case's ``setup()`` returns.

    kernel_builder: zero-arg callable returning the op ``f(*inputs)`` (traced on the jaxfox path).
    reference_builder: the same for the reference path (called inside ``use_reference()``), or None
      to call ``kernel_builder`` again there (the usual case: the context alone picks the path).
    inputs: tuple of arrays / pytrees passed to the op (device arrays; they become jit arguments).
    bytes: bytes read + written once per op call (for GB/s), or None when not meaningful.
    flops: floating-point operations per op call (for GFLOP/s), or None.
    """

    kernel_builder: Callable[[], Callable]
    reference_builder: Callable[[], Callable] | None
    inputs: tuple
    bytes: float | None
    flops: float | None


@dataclasses.dataclass
class Variant:
    """One row of the table.

    case: registry name; label: shape description; setup: zero-arg callable -> CaseSpec (may raise
    SkipCase). stateful: the op is ``f(state, *rest) -> (state, aux)`` and the loop carries the state
    (a training step); otherwise ``f(*inputs) -> outputs``. reference_only: time the reference path
    only (the copy-bandwidth ceiling). unroll: ``fori_loop`` unroll factor (several ops per loop
    iteration for tiny ops, so the loop counter and launch overhead are amortised).
    """

    case: str
    label: str
    setup: Callable[[], CaseSpec]
    stateful: bool = False
    reference_only: bool = False
    unroll: int = 1
    params: dict = dataclasses.field(default_factory=dict)


class SkipCase(Exception):
    """Raised by a case's setup when it cannot run here (e.g. a module it needs is missing)."""


REGISTRY: dict[str, Callable[[str], list[Variant]]] = {}


def register(name: str):
    """Decorator: adds ``fn(size) -> list[Variant]`` to the registry under ``name``."""

    def deco(fn):
        REGISTRY[name] = fn
        return fn

    return deco


# ----------------------------------------------------------------------------------------------
# Timing machinery.
def _opaque_zero(out) -> jax.Array:
    """A float32 scalar that is always 0 but that XLA cannot prove is 0: 0 * (an element of ``out``),
    with NaN/Inf mapped to 0 (XLA does not fold float ``a * 0``, because of NaN)."""
    leaves = [l for l in jax.tree.leaves(out) if _perturbable(l)]
    if not leaves:
        return jnp.float32(0.0)
    leaf = leaves[0]
    s = leaf[(0,) * leaf.ndim].astype(jnp.float32)
    return jnp.nan_to_num(s * jnp.float32(0.0), nan=0.0, posinf=0.0, neginf=0.0)


def _perturbable(a) -> bool:
    return hasattr(a, "dtype") and a.size > 0 and (
        jnp.issubdtype(a.dtype, jnp.floating) or jnp.issubdtype(a.dtype, jnp.integer))


def _is_key(a) -> bool:
    return hasattr(a, "dtype") and jnp.issubdtype(a.dtype, jax.dtypes.prng_key) and a.size > 0


def _first(a):
    """The first element of ``a`` as an array of shape (1,) * ndim (or ``a`` itself for a scalar).

    For a typed PRNG key array, the first element of its key data (uint32)."""
    if _is_key(a):
        return _first(jax.random.key_data(a))
    if not _perturbable(a) or a.ndim == 0:
        return a
    return jax.lax.slice(a, (0,) * a.ndim, (1,) * a.ndim)


def _perturb(a, first, c):
    """``a`` with its first element set to ``first + c`` (``first`` its value before the loop, c == 0).

    An in-place one-element ``dynamic_update_slice`` on the loop carry: ``a`` becomes loop-variant at
    the cost of a tiny kernel. The new value is not read from ``a`` itself, so the only reader of the
    old ``a`` is the update (a second reader would make XLA copy ``a`` every iteration). A typed PRNG
    key is perturbed through its key data, so random draws from an input key are made every op call,
    not hoisted out of the loop.
    """
    if _is_key(a):
        return jax.random.wrap_key_data(_perturb(jax.random.key_data(a), first, c), impl=jax.random.key_impl(a))
    if not _perturbable(a):
        return a
    if a.ndim == 0:
        return first + c.astype(a.dtype)
    return jax.lax.dynamic_update_slice(a, first + c.astype(a.dtype), (0,) * a.ndim)


def _make_loop(op: Callable, trips: int | None, unroll: int, stateful: bool) -> Callable:
    """A function that runs ``op`` ``trips * unroll`` times on the device, ``unroll`` per loop trip.

    ``trips`` is static (an int: the trip count is known to XLA, so an accelerator runs the loop
    without a host round trip per trip) or None: then the function takes the trip count as a
    leading int32 argument (one compilation for any count; used on CPU, where a dynamic trip count
    costs nothing).

    Every op call depends on the previous one: the first element of each (non-state) input is set
    to its original value + an opaque zero computed from the previous outputs, so XLA can neither
    hoist the op out of the loop nor merge calls, and the outputs are carried, so none is dead.
    Returns the final inputs with the outputs (stateless: ``(inputs, outs)``; stateful:
    ``(state, auxs, rest)``; ``outs``/``auxs``: a tuple of the ``unroll`` op calls' outputs of the last
    trip, all carried so that none is dead code) so donated inputs can be fed to the next call.
    """
    if trips is not None and trips < 1:
        raise ValueError(f"the loop trip count must be >= 1, got {trips}")
    unroll = max(1, unroll)

    def perturb(tree, firsts, prev_out):
        c = _opaque_zero(prev_out)
        return jax.tree.map(lambda a, f: _perturb(a, f, c), tree, firsts)

    def init_outs(f, *args):
        # `unroll` initial outputs (only their values' shapes matter): each filled with its own value, so
        # that XLA does not merge them into one buffer and copy it into every carry slot on each call
        shapes = jax.eval_shape(f, *args)
        fill = lambda s, k: (jnp.full(s.shape, k, s.dtype)  # noqa: E731
                             if jnp.issubdtype(s.dtype, jnp.number) else jnp.zeros(s.shape, s.dtype))
        return tuple(jax.tree.map(lambda s: fill(s, k), shapes) for k in range(unroll))

    # The op is traced `unroll` times, all inside the loop (the carry starts from placeholders), so the
    # program holds `unroll` copies of it and compile time does not grow with the trip count.
    # The outputs of EVERY copy are carried (a tuple of `unroll` outputs): were only the last copy's
    # carried, the other copies' outputs would be read only through the one element of the opaque zero,
    # and XLA would remove what that element does not need (e.g. the whole backward of a value_and_grad
    # op, whose first output is the loss).
    if stateful:
        def body(_, carry, firsts):
            state, auxs, rest = carry
            aux, new = auxs[-1], []
            for _ in range(unroll):
                rest = perturb(rest, firsts, aux)
                state, aux = op(state, *rest)
                new.append(aux)
            return state, tuple(new), rest

        def loop(trips, state, *rest):
            firsts = jax.tree.map(_first, rest)
            auxs = init_outs(lambda s, *r: op(s, *r)[1], state, *rest)
            return jax.lax.fori_loop(0, trips, lambda i, c: body(i, c, firsts), (state, auxs, rest))
    else:
        def body(_, carry, firsts):
            inputs, outs = carry
            out, new = outs[-1], []
            for _ in range(unroll):
                inputs = perturb(inputs, firsts, out)
                out = op(*inputs)
                new.append(out)
            return inputs, tuple(new)

        def loop(trips, *inputs):
            firsts = jax.tree.map(_first, inputs)
            return jax.lax.fori_loop(0, trips, lambda i, c: body(i, c, firsts),
                                     (inputs, init_outs(op, *inputs)))

    if trips is None:
        return loop
    return lambda *args: loop(trips, *args)


def _null_builder(stateful: bool) -> Callable[[], Callable]:
    """An op that does (almost) nothing, to measure the loop's own cost per iteration."""
    def first_elements(tree):
        return [l[(0,) * l.ndim] for l in jax.tree.leaves(tree) if hasattr(l, "size") and l.size]

    if stateful:
        return lambda: (lambda state, *rest: (state, first_elements(rest)))
    return lambda: (lambda *inputs: first_elements(inputs))


def _count_ffi_calls(hlo_text: str) -> int:
    return hlo_text.count('custom_call_target="jaxfox_')


_COPY_RE = re.compile(r"= [a-z0-9]+\[([0-9,]*)\]\S* copy\(")


def _count_big_copies(hlo_text: str, min_elements: int = 1 << 16) -> int:
    """Copy instructions of >= min_elements elements in the compiled HLO (a diagnostic: the loop
    itself should add none when inputs are donated; XLA also uses copies for transposes)."""
    n = 0
    for m in _COPY_RE.finditer(hlo_text):
        dims = [int(d) for d in m.group(1).split(",") if d]
        if math.prod(dims) >= min_elements:
            n += 1
    return n


class _Compiled(NamedTuple):
    fn: Any
    compile_s: float
    ffi_calls: int
    big_copies: int
    reused: bool


def _on_cpu() -> bool:
    return jax.devices()[0].platform == "cpu"


def _donate() -> bool:
    return not _on_cpu()   # the CPU backend ignores donation (with a warning)


def _compile(builder: Callable, inputs: tuple, trips: int | None, unroll: int, stateful: bool,
             reference: bool, cache: dict | None = None) -> _Compiled:
    """Builds the op and lowers + compiles the loop, all inside ``use_reference()`` if asked.

    ``cache`` maps lowered program text to a compiled program: a path whose program is identical
    to one already compiled (the jaxfox path where the kernels are unavailable) reuses it.
    """
    import contextlib

    from jaxfox import use_reference

    ctx = use_reference() if reference else contextlib.nullcontext()
    lead = (np.int32(1),) if trips is None else ()
    donate = tuple(range(len(lead), len(lead) + len(inputs))) if _donate() else ()
    t0 = time.perf_counter()
    with ctx:
        op = builder()
        loop = _make_loop(op, trips, unroll, stateful)
        lowered = jax.jit(loop, donate_argnums=donate).lower(*lead, *inputs)
    key = lowered.as_text() if cache is not None else None
    if key is not None and key in cache:
        c = cache[key]
        return c._replace(compile_s=time.perf_counter() - t0, reused=True)
    compiled = lowered.compile()
    compile_s = time.perf_counter() - t0
    try:
        text = compiled.as_text() or ""
    except Exception:  # as_text is best-effort on some backends
        text = ""
    c = _Compiled(compiled, compile_s, _count_ffi_calls(text), _count_big_copies(text), False)
    if key is not None:
        cache[key] = c
    return c


class _Runner:
    """Calls a compiled loop, feeding its returned (donated) inputs to the next call."""

    def __init__(self, inputs: tuple, stateful: bool):
        self.stateful = stateful
        self.inputs = jax.tree.map(jnp.copy, inputs) if _donate() else inputs

    def __call__(self, fn, *lead) -> float:
        t0 = time.perf_counter()
        res = jax.block_until_ready(fn(*lead, *self.inputs))
        dt = time.perf_counter() - t0
        if _donate():
            self.inputs = (res[0], *res[2]) if self.stateful else tuple(res[0])
        return dt


class _Path:
    """One path of one variant, compiled and calibrated: ``call()`` times one call of n op calls."""

    def __init__(self, builder, inputs, *, unroll, stateful, reference, min_call_s, max_inner, log,
                 cache=None):
        """Calibrates n_inner and compiles. The calibration probes take the fastest of 3 calls
        (robust to a busy host). With a static trip count (accelerators) each new count is a new
        compilation (usually 2 in all); on CPU the count is an argument of one compiled program."""
        self.runner = _Runner(inputs, stateful)
        self.dynamic = _on_cpu()
        self.unroll = unroll
        max_trips = max(1, max_inner // unroll)
        trips, self.compile_s, self.compiles, c = 1, 0.0, 0, None
        for attempt in range(12 if self.dynamic else 4):
            if c is None or not self.dynamic:
                c = _compile(builder, self.runner.inputs, None if self.dynamic else trips, unroll,
                             stateful, reference, cache)
                self.compile_s += c.compile_s
                self.compiles += 0 if c.reused else 1
            self.lead = (np.int32(trips),) if self.dynamic else ()
            self.runner(c.fn, *self.lead)                  # warm-up (first run after compile)
            probe = min(self.runner(c.fn, *self.lead) for _ in range(3))
            if probe >= 0.8 * min_call_s or trips >= max_trips or attempt == (11 if self.dynamic else 3):
                break
            new = min(max_trips, max(trips + 1, math.ceil(trips * min_call_s / max(probe, 1e-7) * 1.2)))
            if self.dynamic:
                new = min(new, trips * 64)
            log(f"    n_inner {trips * unroll} -> {new * unroll} (a call took {probe * 1e3:.2f} ms)")
            trips = new
        self.compiled = c
        self.n = trips * unroll
        self.times: list[float] = []

    def call(self) -> None:
        self.times.append(self.runner(self.compiled.fn, *self.lead))

    def result(self) -> dict:
        per_iter = [t / self.n for t in self.times]
        return {
            "median_s": statistics.median(per_iter),
            "min_s": min(per_iter),
            "max_s": max(per_iter),
            "call_median_s": statistics.median(self.times),
            "times_per_iter_s": per_iter,
            "n_inner": self.n,
            "unroll": self.unroll,
            "trip_count": "dynamic" if self.dynamic else "static",
            "compile_s": self.compile_s,
            "compiles": self.compiles,
            "reused_program": self.compiled.reused,
            "ffi_calls": self.compiled.ffi_calls,
            "hlo_big_copies": self.compiled.big_copies,
        }


def run_variant(v: Variant, *, repeats: int = 20, min_call_ms: float = 20.0, max_inner: int = 100_000,
                unroll: int | None = None, overhead: bool = True,
                log: Callable[[str], None] = print) -> dict:
    """Times one variant on both paths. Returns a row dict (raises SkipCase from setup).

    Both paths are compiled and calibrated first; their timed calls then alternate (reference,
    jaxfox, reference, ...) so that a change in the machine's load affects both alike.
    """
    spec = v.setup()
    inputs = tuple(spec.inputs)
    un = max(1, unroll if unroll is not None else v.unroll)
    kw = dict(unroll=un, stateful=v.stateful, min_call_s=min_call_ms / 1e3, max_inner=max_inner, log=log)
    ref_builder = spec.reference_builder or spec.kernel_builder
    row: dict[str, Any] = {"case": v.case, "shape": v.label, "params": dict(v.params),
                           "bytes": spec.bytes, "flops": spec.flops}
    cache: dict = {}
    log(f"  {v.case} {v.label}: reference path")
    paths = {"reference": _Path(ref_builder, inputs, reference=True, cache=cache, **kw)}
    if not v.reference_only:
        log(f"  {v.case} {v.label}: jaxfox path")
        paths["jaxfox"] = _Path(spec.kernel_builder, inputs, reference=False, cache=cache, **kw)
        if paths["jaxfox"].compiled.reused:
            log("    (same program as the reference path: compiled once)")
    log(f"  {v.case} {v.label}: timing {repeats} calls per path")
    for _ in range(repeats):
        for p in paths.values():
            p.call()
    row["reference"] = paths["reference"].result()
    row["jaxfox"] = paths["jaxfox"].result() if "jaxfox" in paths else None
    del paths, cache
    row["loop_overhead_s"] = None
    if overhead:
        log(f"  {v.case} {v.label}: loop overhead (null op)")
        ov = _Path(_null_builder(v.stateful), inputs, reference=True, **kw)
        for _ in range(max(3, repeats // 4)):
            ov.call()
        row["loop_overhead_s"] = ov.result()["median_s"]
        if ov.compiled.big_copies and _donate():
            log(f"  WARNING: {v.case} {v.label}: the timing loop itself copies "
                f"{ov.compiled.big_copies} large buffers; times include those copies")
    ref_t = row["reference"]["median_s"]
    k_t = row["jaxfox"]["median_s"] if row["jaxfox"] else None
    row["speedup"] = (ref_t / k_t) if k_t else None
    # the row's result as soon as it is known (the table comes at the end; a run cut short keeps these lines)
    log(f"  {v.case} {v.label}: reference {_fmt_time(ref_t)}"
        + (f", jaxfox {_fmt_time(k_t)}, {row['speedup']:.2f}x" if k_t else ""))
    for path in ("reference", "jaxfox"):
        r = row[path]
        if r is None:
            continue
        r["gbps"] = spec.bytes / r["median_s"] / 1e9 if spec.bytes else None
        r["gflops"] = spec.flops / r["median_s"] / 1e9 if spec.flops else None
    for path in ("reference", "jaxfox"):
        r = row[path]
        if r is not None and r["hlo_big_copies"] and _donate():
            log(f"  note: {v.case} {v.label} ({path}): the compiled program has {r['hlo_big_copies']} "
                "copy instructions of >= 64Ki elements (loop-carry copies would inflate the time)")
    import jaxfox

    if (row["jaxfox"] is not None and row["jaxfox"]["ffi_calls"] == 0 and jaxfox.kernels_available()):
        log(f"  WARNING: {v.case} {v.label}: kernels are available but the jaxfox path compiled "
            "without any jaxfox FFI call (it ran the reference)")
    if row["reference"]["ffi_calls"]:
        log(f"  WARNING: {v.case} {v.label}: the reference path contains "
            f"{row['reference']['ffi_calls']} jaxfox FFI calls")
    return row


def run_cases(names: list[str], size: str, **kw) -> tuple[list[dict], list[dict]]:
    """Runs the named cases. Returns (rows, skipped/failed entries)."""
    from jaxfox.bench import cases  # noqa: F401  (fills REGISTRY)

    log = kw.get("log", print)
    rows, skipped = [], []
    for name in names:
        if name not in REGISTRY:
            raise ValueError(f"--ops: unknown case {name!r}; known: {', '.join(REGISTRY)}")
        first_row = len(rows)
        for v in REGISTRY[name](size):
            try:
                rows.append(run_variant(v, **kw))
            except SkipCase as e:
                msg = f"{v.case}: skipped ({e})"
                log(msg)
                print(msg, flush=True)
                skipped.append({"case": v.case, "shape": v.label, "status": "skipped", "reason": str(e)})
            except Exception as e:  # keep going; the caller exits non-zero
                msg = f"{v.case} {v.label}: FAILED ({type(e).__name__}: {e})"
                log(msg)
                print(msg, flush=True)
                skipped.append({"case": v.case, "shape": v.label, "status": "failed",
                                "reason": f"{type(e).__name__}: {e}"})
        summarize = getattr(REGISTRY[name], "summarize", None)   # optional: rows -> text (may annotate rows)
        if summarize is not None and len(rows) > first_row:
            text = summarize(rows[first_row:])
            log(text)
            print(text, flush=True)
    copy_gbps = next((r["reference"]["gbps"] for r in rows if r["case"] == "copy"), None)
    for r in rows:
        r["copy_gbps"] = copy_gbps
        k = r["jaxfox"] or r["reference"]
        r["pct_of_copy"] = (100.0 * k["gbps"] / copy_gbps) if (copy_gbps and k.get("gbps")
                                                              and r["case"] != "copy") else None
    return rows, skipped


# ----------------------------------------------------------------------------------------------
# Environment header, table, JSON, plot.
def _git_commit() -> str:
    root = Path(__file__).resolve().parents[2]
    try:
        out = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=root, capture_output=True,
                             text=True, timeout=10)
        if out.returncode != 0:
            return "unknown (no git commit)"
        commit = out.stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=root,
                               capture_output=True, text=True, timeout=10).stdout.strip()
        return commit + ("-dirty" if dirty else "")
    except (OSError, subprocess.SubprocessError):
        return "unknown (git not available)"


def environment() -> dict:
    import jaxlib

    import jaxfox

    dev = jax.devices()[0]
    return {
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M:%S UTC"),
        "commit": _git_commit(),
        "command": " ".join([Path(sys.executable).name, "-m", "jaxfox.bench", *sys.argv[1:]]),
        "device": f"{dev.platform}: {getattr(dev, 'device_kind', str(dev))}",
        "device_count": jax.device_count(),
        "jax": jax.__version__,
        "jaxlib": jaxlib.__version__,
        "jaxfox": getattr(jaxfox, "__version__", "?"),
        "python": platform.python_version(),
        "kernels_available": jaxfox.kernels_available(),
        "kernels_unavailable_reason": jaxfox.kernels_unavailable_reason(),
        "xla_flags": os.environ.get("XLA_FLAGS", ""),
        "host": platform.node(),
    }


def format_header(env: dict) -> str:
    ka = "yes" if env["kernels_available"] else f"no ({env['kernels_unavailable_reason']})"
    lines = [
        f"jaxfox.bench  {env['date']}  commit {env['commit']}",
        f"device: {env['device']} (x{env['device_count']})  jax {env['jax']}  jaxlib {env['jaxlib']}  "
        f"python {env['python']}",
        f"kernels available: {ka}",
        f"command: {env['command']}",
    ]
    if env["xla_flags"]:
        lines.append(f"XLA_FLAGS: {env['xla_flags']}")
    return "\n".join(lines)


def _fmt_time(s: float | None) -> str:
    if s is None:
        return "-"
    if s >= 1.0:
        return f"{s:.3f} s"
    if s >= 1e-3:
        return f"{s * 1e3:.3f} ms"
    return f"{s * 1e6:.2f} us"


def _fmt_rate(r: dict | None) -> str:
    if r is None:
        return "-"
    if r.get("gbps"):
        return f"{r['gbps']:.1f} GB/s"
    if r.get("gflops"):
        g = r["gflops"]
        return f"{g / 1e3:.2f} TFLOP/s" if g >= 1e3 else f"{g:.2f} GFLOP/s"
    return "-"


def format_table(rows: list[dict]) -> str:
    head = ("case", "shape", "XLA ref", "jaxfox", "speed-up", "jaxfox rate", "ref rate", "% copy",
            "loop ovh", "n_inner", "ffi")
    body = []
    for r in rows:
        k, ref = r["jaxfox"], r["reference"]
        body.append((
            r["case"], r["shape"], _fmt_time(ref["median_s"]), _fmt_time(k["median_s"] if k else None),
            f"{r['speedup']:.2f}x" if r["speedup"] else "-",
            _fmt_rate(k), _fmt_rate(ref),
            f"{r['pct_of_copy']:.1f}%" if r.get("pct_of_copy") else "-",
            _fmt_time(r.get("loop_overhead_s")),
            f"{ref['n_inner']}/{k['n_inner']}" if k else f"{ref['n_inner']}",
            f"{k['ffi_calls']}" if k else "-",
        ))
    widths = [max(len(h), *(len(b[i]) for b in body)) if body else len(h) for i, h in enumerate(head)]
    fmt = "  ".join(f"{{:<{w}}}" if i < 2 else f"{{:>{w}}}" for i, w in enumerate(widths))
    lines = [fmt.format(*head), "  ".join("-" * w for w in widths)]
    lines += [fmt.format(*b) for b in body]
    lines.append("times: median per op call over the timed calls, each an in-graph loop of n_inner "
                 "(ref/jaxfox) op calls; loop ovh: the loop's own cost per op call (included in the "
                 "times); rate: bytes read + written once, or model FLOPs; % copy: jaxfox GB/s over the "
                 "copy row's; ffi: jaxfox FFI calls in the compiled jaxfox-path program (0: no jaxfox kernel "
                 "ran; where the JSON's reused_program is true the two paths were one program).")
    return "\n".join(lines)


def save_json(path: str | os.PathLike, env: dict, rows: list[dict], skipped: list[dict]) -> None:
    import json

    Path(path).parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as f:
        json.dump({"environment": env, "rows": rows, "skipped": skipped}, f, indent=1, allow_nan=False,
                  default=float)


def save_plot(path: str | os.PathLike, env: dict, rows: list[dict]) -> None:
    """Bar chart of jaxfox speed-ups over the XLA reference (log scale); PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import matplotlib.ticker

    rs = [r for r in rows if r["speedup"]]
    labels = [f"{r['case']}\n{r['shape']}" for r in rs]
    vals = [r["speedup"] for r in rs]
    fig, ax = plt.subplots(figsize=(max(6.0, 1.1 * len(rs) + 2), 4.8))
    colors = ["tab:green" if round(v, 2) >= 1 else "tab:red" for v in vals]  # as the label rounds
    # bars grow from 1x (a slow-down downwards): from the axis bottom a 0.66x bar looked like a gain
    bars = ax.bar(range(len(rs)), [v - 1.0 for v in vals], bottom=1.0, color=colors)
    ax.set_yscale("log")
    fmt = matplotlib.ticker.FuncFormatter(lambda y, _: f"{y:g}x")
    ax.yaxis.set_major_formatter(fmt)
    ax.yaxis.set_minor_formatter(fmt)
    ax.axhline(1.0, color="k", lw=0.8)
    for b, v in zip(bars, vals):
        ax.annotate(f"{v:.2f}x", (b.get_x() + b.get_width() / 2, v), ha="center", va="bottom" if v >= 1 else "top",
                    fontsize=8)
    ax.set_xticks(range(len(rs)), labels, fontsize=7, rotation=30, ha="right")
    ax.set_ylabel("speed-up over XLA reference (log)")
    same = "" if env.get("kernels_available") else " (kernels unavailable: both paths XLA)"
    ax.set_title(f"jaxfox vs XLA{same}: {env['device']}, jax {env['jax']}, {env['commit']}\n{env['date']}",
                 fontsize=9)
    if not rs:
        ax.text(0.5, 0.5, "no row with a speed-up (e.g. only the copy row ran)", ha="center",
                transform=ax.transAxes)
    if vals:
        lo, hi = min(vals + [1.0]), max(vals + [1.0])
        ax.set_ylim(lo / 1.6, hi * 1.6)
    fig.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
