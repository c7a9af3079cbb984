"""Where a jitted step's device time goes: each kernel's total time per step, from a jax.profiler trace.

    python3 tools/gpu_profile.py perception [--steps 50] [--top 25]
    python3 tools/gpu_profile.py perception_v0

Runs the step of ``jaxfox.models.<module>.benchmark_step`` (the bench's ``perception_step`` rows) on the
kernel path and under ``jaxfox.use_reference()``, traces ``--steps`` calls of each after a warm-up, and
prints, per path, the device kernels by total time per step (the GPU planes of the XSpace that
``jax.profiler.trace`` writes, read with ``jax.profiler.ProfileData``). A diagnosis tool for GPU visits,
not a benchmark: the profiler adds its own cost, so compare shares, and time with ``python -m jaxfox.bench``.
"""

from __future__ import annotations

import argparse
import collections
import glob
import importlib
import os
import tempfile

import jax

import jaxfox


def _kernel_times(trace_dir):
    """{kernel name: (total us, count)} over the device planes of the newest .xplane.pb under trace_dir."""
    files = sorted(glob.glob(os.path.join(trace_dir, "**", "*.xplane.pb"), recursive=True), key=os.path.getmtime)
    if not files:
        raise RuntimeError(f"no .xplane.pb under {trace_dir}")
    data = jax.profiler.ProfileData.from_file(files[-1])
    out = collections.defaultdict(lambda: [0.0, 0])
    for plane in data.planes:
        if not plane.name.startswith("/device:GPU"):
            continue
        for line in plane.lines:
            if "stream" not in line.name.lower() or "memcpy" in line.name.lower():
                continue
            for ev in line.events:
                rec = out[ev.name]
                rec[0] += ev.duration_ns / 1e3
                rec[1] += 1
    return out


def profile(step_fn, state, batch, steps):
    f = jax.jit(step_fn)
    for _ in range(3):
        state, loss = f(state, batch)
    jax.block_until_ready(loss)
    with tempfile.TemporaryDirectory() as d:
        with jax.profiler.trace(d):
            for _ in range(steps):
                state, loss = f(state, batch)
            jax.block_until_ready(loss)
        return _kernel_times(d)


def report(title, times, steps, top):
    total = sum(t for t, _ in times.values())
    print(f"\n== {title}: {total / steps:.1f} us of kernels per step, {sum(c for _, c in times.values()) / steps:.0f} "
          f"kernel launches per step")
    for name, (t, c) in sorted(times.items(), key=lambda kv: -kv[1][0])[:top]:
        print(f"{t / steps:9.1f} us {100 * t / max(total, 1e-9):5.1f}%  x{c / steps:4.1f}  {name[:110]}")


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("module", help="jaxfox.models.<module> with a benchmark_step (perception, perception_v0)")
    p.add_argument("--steps", type=int, default=50)
    p.add_argument("--top", type=int, default=25)
    args = p.parse_args()
    make = importlib.import_module(f"jaxfox.models.{args.module}").benchmark_step
    one = jaxfox.sharding.batch_mesh(jax.local_devices()[:1])
    print(f"kernels available: {jaxfox.kernels_available()}")
    step_fn, state, batch = make(mesh=one)
    report(f"{args.module}, jaxfox path", profile(step_fn, state, batch, args.steps), args.steps, args.top)
    with jaxfox.use_reference():
        step_fn, state, batch = make(mesh=one)
        report(f"{args.module}, reference path", profile(step_fn, state, batch, args.steps), args.steps, args.top)


if __name__ == "__main__":
    main()
