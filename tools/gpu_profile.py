"""Where a jitted step's device time goes: each kernel's total time per step, from a jax.profiler trace.

    python3 tools/gpu_profile.py perception [--steps 50] [--top 25]
    python3 tools/gpu_profile.py perception_v0
    python3 tools/gpu_profile.py case:grn [--size default]     # every variant of a `python -m jaxfox.bench` case

Runs the step of ``jaxfox.models.<module>.benchmark_step`` (the bench's ``perception_step`` rows) on the
kernel path and under ``jaxfox.use_reference()``, traces ``--steps`` calls of each after a warm-up, and
prints, per path, the device kernels by total time per step (the GPU planes of the XSpace that
``jax.profiler.trace`` writes, read with ``jax.profiler.ProfileData``), then the same time grouped by the
Python source file of the operation each XLA kernel computes (the stack frames of the compiled HLO
instruction that launched it: the trace event's ``hlo_op``, else the instruction whose name XLA:GPU turned
into the kernel's name, "." and "-" to "_"; the file is the outermost jaxfox op module on the stack, vsn.py,
attention.py, cfc.py, ..., else the innermost frame, optax's transforms, ...; the jaxfox CUDA kernels are
one group; ``--by-line`` adds the line). A diagnosis tool for GPU visits,
not a benchmark: the profiler adds its own cost, so compare shares, and time with ``python -m jaxfox.bench``.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import glob
import importlib
import os
import re
import tempfile

import jax

import jaxfox


def kernel_events(trace_dir):
    """The kernel events of the GPU stream lines (not the memcpy lines) of the newest .xplane.pb under trace_dir
    (``jax.profiler.ProfileData`` events: name, start_ns, end_ns, duration_ns, stats). Also used by
    tools/gpu_timeline.py."""
    files = sorted(glob.glob(os.path.join(trace_dir, "**", "*.xplane.pb"), recursive=True), key=os.path.getmtime)
    if not files:
        raise RuntimeError(f"no .xplane.pb under {trace_dir}")
    for plane in jax.profiler.ProfileData.from_file(files[-1]).planes:
        if not plane.name.startswith("/device:GPU"):
            continue
        for line in plane.lines:
            if "stream" in line.name.lower() and "memcpy" not in line.name.lower():
                yield from line.events


def _kernel_times(trace_dir):
    """{(kernel name, HLO op or None): [total us, count]} over :func:`kernel_events`; the HLO op is the event's
    ``hlo_op`` stat (the instruction that launched the kernel), when the trace has it."""
    out = collections.defaultdict(lambda: [0.0, 0])
    for ev in kernel_events(trace_dir):
        rec = out[(ev.name, dict(ev.stats).get("hlo_op"))]
        rec[0] += ev.duration_ns / 1e3
        rec[1] += 1
    return out


_META = re.compile(r"^\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=.*?metadata=\{([^}]*)\}")
_FRAME = re.compile(r"stack_frame_id=(\d+)")
_SOURCE = re.compile(r'source_file="([^"]+)"')
_OP_MODULE = re.compile(r"(?:^|/)jaxfox/(?!sharding\.py|_ffi\.py|_validate\.py|__init__\.py)\w+\.py$")


def _sanitized(name):
    """An HLO instruction name as XLA:GPU names its kernel (llvm_ir::SanitizeFunctionName: every character
    but [A-Za-z0-9_$] becomes '_', so fusion "loop_add_fusion.3" launches kernel "loop_add_fusion_3")."""
    name = re.sub(r"[^A-Za-z0-9_$]", "_", name)
    return "_" + name if name[:1].isdigit() else name


def _sources(hlo_text, by_line=False):
    """{HLO instruction name: "package/file.py" (or "...py:line")} for the instructions of compiled HLO text.

    The file is read from the instruction's stack_frame_id in the module's FileNames / FileLocations /
    StackFrames tables: of the chain of frames from the innermost outwards, the OUTERMOST frame in a jaxfox
    op module (jaxfox/<family>.py, not sharding.py / _ffi.py), so that a GRN inside jaxfox/vsn.py counts as
    vsn.py and a dispatch through _ffi.py as its op; with no such frame (optax, flax), the innermost frame.
    HLO text of the older form without the tables: the instruction's source_file metadata.
    (The text prints a frame's parent_frame_id one above the parent's id, 1 meaning none: frame 1, always
    a root, shows parent 1; where it shows 0 the ids are taken as they are.)"""
    tables = {"FileNames": {}, "FileLocations": {}, "StackFrames": {}}
    current = None
    for line in hlo_text.splitlines():
        t = line.strip()
        if t in tables or t == "FunctionNames":
            current = tables.get(t)
            continue
        if current is not None:
            m = re.match(r'^(\d+)\s+(.*)$', t)
            if m:
                current[int(m.group(1))] = m.group(2)
                continue
            current = None

    def field(text, key):
        m = re.search(rf"(?<![\w]){key}=(\d+)", text or "")
        return int(m.group(1)) if m else None

    def short(path):
        return "/".join(path.strip('"').split(os.sep)[-2:])

    frames = tables["StackFrames"]
    offset = 1 if field(frames.get(1), "parent_frame_id") == 1 else 0

    def chain(frame_id):
        """(file name, line) of frame_id and its callers, innermost first."""
        out, seen = [], set()
        while frame_id and frame_id in frames and frame_id not in seen:
            seen.add(frame_id)
            loc = tables["FileLocations"].get(field(frames[frame_id], "file_location_id"))
            name = tables["FileNames"].get(field(loc, "file_name_id"))
            if name is not None:
                out.append((name.strip('"'), field(loc, "line")))
            parent = field(frames[frame_id], "parent_frame_id")
            frame_id = None if parent is None else parent - offset
        return out

    cache = {}
    out = {}
    for line in hlo_text.splitlines():
        m = _META.match(line)
        if not m:
            continue
        meta = m.group(2)
        frame = _FRAME.search(meta)
        if frame and int(frame.group(1)) in frames:
            fid = int(frame.group(1))
            if fid not in cache:
                files = chain(fid)
                ops = [f for f in files if _OP_MODULE.search(f[0].replace(os.sep, "/"))]
                pick = ops[-1] if ops else (files[0] if files else None)
                cache[fid] = None if pick is None else (
                    f"{short(pick[0])}:{pick[1]}" if by_line else short(pick[0]))
            if cache[fid] is not None:
                out[m.group(1)] = cache[fid]
                continue
        src = _SOURCE.search(meta)
        if src:
            out[m.group(1)] = short(src.group(1))
    return out


def profile(step_fn, state, batch, steps, by_line=False):
    """(kernel times as :func:`_kernel_times`, {HLO instruction name: source} of the executable traced)."""
    # the state donated, as a training loop carries it (the optimizer's kernel updates its leaves in place; without
    # donation XLA copies each aliased buffer first, a memcpy per parameter leaf that a loop does not pay)
    state = jax.tree.map(lambda x: x.copy() if hasattr(x, "copy") else x, state)
    f = jax.jit(step_fn, donate_argnums=0).lower(state, batch).compile()  # the executable whose HLO names the kernels
    sources = _sources(f.as_text(), by_line=by_line)
    for _ in range(3):
        state, loss = f(state, batch)
    jax.block_until_ready(loss)
    with tempfile.TemporaryDirectory() as d:
        with jax.profiler.trace(d):
            for _ in range(steps):
                state, loss = f(state, batch)
            jax.block_until_ready(loss)
        return _kernel_times(d), sources


def report(title, by_op, sources, steps, top):
    times = collections.defaultdict(lambda: [0.0, 0])
    for (name, _), (t, c) in by_op.items():
        times[name][0] += t
        times[name][1] += c
    total = sum(t for t, _ in times.values())
    print(f"\n== {title}: {total / steps:.1f} us of kernels per step, {sum(c for _, c in times.values()) / steps:.0f} "
          f"kernel launches per step")
    for name, (t, c) in sorted(times.items(), key=lambda kv: -kv[1][0])[:top]:
        print(f"{t / steps:9.1f} us {100 * t / max(total, 1e-9):5.1f}%  x{c / steps:4.1f}  {name[:110]}")
    kernel_sources = {_sanitized(k): v for k, v in sources.items()}
    groups = collections.defaultdict(lambda: [0.0, 0])
    for (name, op), (t, c) in by_op.items():
        if "jaxfox::" in name:
            key = "jaxfox CUDA kernels"
        else:  # the launching HLO op from the trace, else the kernel named after its fusion
            key = sources.get(op) or kernel_sources.get(name) or sources.get(name)
            key = key or "(no source metadata)"
        groups[key][0] += t
        groups[key][1] += c
    print(f"-- by source file of the kernel's operation")
    for key, (t, c) in sorted(groups.items(), key=lambda kv: -kv[1][0]):
        print(f"{t / steps:9.1f} us {100 * t / max(total, 1e-9):5.1f}%  x{c / steps:5.1f}  {key}")


def _case_steps(name, size):
    """(label, path -> (step_fn, state, batch)) for each variant of the bench case ``name``: the op on the case's
    inputs as a step that carries the inputs through unchanged, traced on each path as the bench traces it."""
    from jaxfox.bench import REGISTRY, SkipCase
    from jaxfox.bench import cases  # noqa: F401  (fills the registry)

    for v in REGISTRY[name](size):
        try:
            spec = v.setup()
        except SkipCase as e:
            print(f"{v.label}: skipped ({e})")
            continue

        def make(path, spec=spec, v=v):
            builder = spec.reference_builder if path == "reference" and spec.reference_builder else spec.kernel_builder
            op = builder()
            if v.stateful:
                return (lambda state, rest: op(state, *rest)), spec.inputs[0], spec.inputs[1:]
            return (lambda inputs, _: (inputs, op(*inputs))), spec.inputs, ()

        yield f"{name} {v.label}", make


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("module", help="jaxfox.models.<module> with a benchmark_step (perception, perception_v0), "
                                  "or case:<name> for a bench case")
    p.add_argument("--size", default="default", help="bench case size (case:<name> only)")
    p.add_argument("--steps", type=int, default=50)
    p.add_argument("--top", type=int, default=25)
    p.add_argument("--by-line", action="store_true", help="group by source file and line, not by file")
    args = p.parse_args()
    print(f"kernels available: {jaxfox.kernels_available()}")
    if args.module.startswith("case:"):
        steps = list(_case_steps(args.module[len("case:"):], args.size))
    else:
        bench_step = importlib.import_module(f"jaxfox.models.{args.module}").benchmark_step
        one = jaxfox.sharding.batch_mesh(jax.local_devices()[:1])
        steps = [(args.module, lambda path: bench_step(mesh=one))]
    for title, make in steps:
        for path in ("jaxfox", "reference"):
            with jaxfox.use_reference() if path == "reference" else contextlib.nullcontext():
                step_fn, state, batch = make(path)
                times, sources = profile(step_fn, state, batch, args.steps, by_line=args.by_line)
                report(f"{title}, {path} path", times, sources, args.steps, args.top)


if __name__ == "__main__":
    main()
