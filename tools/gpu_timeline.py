"""The kernel sequence of a bench case's timed loop, with each kernel's start, duration and the gap before it.

    python3 tools/gpu_timeline.py iql_pair [--size default] [--trips 40] [--show 2]

Compiles the first variant of ``python -m jaxfox.bench``'s case on both paths exactly as the bench does (its
in-graph loop of ``--trips`` op calls, inputs perturbed and donated: ``jaxfox.bench._compile``), times a few calls
untraced, traces one call with ``jax.profiler`` and prints, per path: the loop's time per op call (untraced: with
few trips it includes each call's own start-up, which the bench amortises over 20 ms calls; and traced), the
device kernels' busy time per op call, and the kernels of ``--show`` op calls from the middle of the
trace in launch order (start in us from the first kernel, duration, gap to the previous kernel's end; a negative gap
is an overlap). Where :mod:`tools.gpu_profile` sums each kernel's time over a step, this shows the order, the idle
gaps and the loop's own kernels (the one-element input updates, ``loop_dynamic_update_slice_fusion*``), which the
bench's "loop ovh" column includes. A diagnosis tool for GPU visits, not a benchmark (the profiler adds its cost).
Its compiled programs' HLO goes to ``$OUT/hlo_<case>_<path>.txt`` when ``$OUT`` is set.
"""

from __future__ import annotations

import argparse
import os
import tempfile

import jax
import numpy as np

import jaxfox
from jaxfox import bench
from jaxfox.bench import cases  # noqa: F401  (fills the registry)

from gpu_profile import kernel_events  # tools/ is sys.path[0] when this file runs as a script


def _events(trace_dir):
    """[(start ns, end ns, kernel name)] of the GPU kernels in the trace under trace_dir, in start order."""
    return sorted((ev.start_ns, ev.end_ns, ev.name) for ev in kernel_events(trace_dir))


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("case", help="a python -m jaxfox.bench case (its first variant)")
    p.add_argument("--size", default="default")
    p.add_argument("--trips", type=int, default=40, help="op calls in the compiled loop")
    p.add_argument("--show", type=float, default=2.0, help="op calls from the middle of the trace to list")
    args = p.parse_args()
    print(f"kernels available: {jaxfox.kernels_available()}")
    v = bench.REGISTRY[args.case](args.size)[0]
    spec = v.setup()
    out = os.environ.get("OUT")
    for path in ("jaxfox", "reference"):
        ref = path == "reference"
        builder = (spec.reference_builder or spec.kernel_builder) if ref else spec.kernel_builder
        c = bench._compile(builder, spec.inputs, args.trips, 1, v.stateful, ref)
        if out:
            with open(os.path.join(out, f"hlo_{args.case}_{path}.txt"), "w") as f:
                f.write(c.fn.as_text())
        runner = bench._Runner(spec.inputs, v.stateful)
        for _ in range(3):
            runner(c.fn)
        t = np.median([runner(c.fn) for _ in range(5)]) / args.trips * 1e6
        with tempfile.TemporaryDirectory() as d:
            with jax.profiler.trace(d):
                runner(c.fn)
            evs = _events(d)
        print(f"\n== {v.case} {v.label}, {path} path: {t:.2f} us an op call untraced; jaxfox FFI calls {c.ffi_calls}")
        if not evs:
            print("   no device kernels in the trace")
            continue
        t0, t1 = evs[0][0], max(e for _, e, _ in evs)
        per = (t1 - t0) / args.trips
        busy = sum(e - s for s, e, _ in evs) / args.trips
        print(f"   traced: {per / 1e3:.2f} us an op call, kernels busy {busy / 1e3:.2f} us of it, "
              f"{len(evs) / args.trips:.1f} kernels")
        mid = t0 + (t1 - t0) // 2
        prev = None
        for s, e, name in (x for x in evs if mid <= x[0] < mid + args.show * per):
            gap = "" if prev is None else f"gap {(s - prev) / 1e3:6.2f}"
            print(f"   {(s - t0) / 1e3:9.2f}  dur {(e - s) / 1e3:6.2f}  {gap:11s}  {name[:100]}")
            prev = e


if __name__ == "__main__":
    main()
