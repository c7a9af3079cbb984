"""``python -m jaxfox.bench``: time jaxfox's kernel path against the pure-XLA reference path.

Usage:
  python -m jaxfox.bench [--ops copy,reduce_axis0,cfc_scan,perception_step]
                         [--shapes small|default|large] [--repeats 20] [--min-call-ms 20]
                         [--json PATH] [--plot PATH]

Prints an environment header (date, commit, device, jax version, whether the kernels are in use
and why not) and a table: case, shape, XLA reference time, jaxfox time, speed-up, achieved
bandwidth (bytes read + written once) or FLOP rate, and % of the measured copy bandwidth.
Exit status 1 when a case failed (a skipped case, e.g. a missing module, is not a failure).
"""

from __future__ import annotations

import argparse
import os
import sys
import time

DEFAULT_OPS = "copy,reduce_axis0,cfc_scan,perception_step"


def _parse(argv):
    from jaxfox.bench import SIZES

    p = argparse.ArgumentParser(prog="python -m jaxfox.bench", description=__doc__.split("\n\n")[0])
    p.add_argument("--ops", default=DEFAULT_OPS,
                   help=f"comma-separated cases (default: {DEFAULT_OPS})")
    p.add_argument("--shapes", default="default", choices=SIZES,
                   help="problem sizes: small (quick, CPU), default (the issues' targets), large")
    p.add_argument("--repeats", type=int, default=20, help="timed calls per path (median reported)")
    p.add_argument("--min-call-ms", type=float, default=20.0,
                   help="calibrate the in-graph loop so that one call takes about this long (a probe of at least "
                        "80%% of it is accepted; at most 4 calibration compiles on a GPU, 12 probes on a CPU)")
    p.add_argument("--max-inner", type=int, default=100_000,
                   help="upper bound on n_inner (op calls per timed call; a case's unroll calls at least)")
    p.add_argument("--unroll", type=int, default=None, help="override every case's fori_loop unroll")
    p.add_argument("--json", metavar="PATH", help="write all rows with raw numbers as JSON (checked before any case "
                   "runs: a folder, or a place no file can be written, is a usage error)")
    p.add_argument("--plot", metavar="PATH.png", help="write a PNG bar chart of the speed-ups (checked as --json)")
    p.add_argument("--quiet", action="store_true", help="no progress lines (stderr)")
    p.add_argument("--concurrent", action="store_true",
                   help="set --xla_gpu_command_buffer_scheduling_mode=CONCURRENT (jaxfox.enable_concurrent_command_buffers; "
                        "a GPU flag: no effect on a CPU)")
    args = p.parse_args(argv)
    if args.repeats < 1:
        p.error(f"--repeats must be >= 1, got {args.repeats}")
    if not (0 < args.min_call_ms < float("inf")):
        p.error(f"--min-call-ms must be a finite number > 0, got {args.min_call_ms}")
    if not 1 <= args.max_inner <= 2**31 - 1:  # the loop's trip count is an int32
        p.error(f"--max-inner must be in [1, 2^31 - 1], got {args.max_inner}")
    if args.unroll is not None and not 1 <= args.unroll <= args.max_inner:
        p.error(f"--unroll must be in [1, --max-inner ({args.max_inner})], got {args.unroll}")
    if args.plot is not None and not args.plot.lower().endswith(".png"):
        p.error(f"--plot must name a .png file, got {args.plot!r}")
    from jaxfox._validate import unwritable_reason

    for flag in ("json", "plot"):  # checked now: they are first written after every case has run
        path = getattr(args, flag)
        if path is not None and (why := unwritable_reason(path, folder=False)):
            p.error(f"--{flag} {path!r}: {why}")
    if args.json and args.plot and os.path.abspath(args.json) == os.path.abspath(args.plot):
        p.error(f"--json and --plot name the same file ({args.json!r}): the plot would replace the JSON")
    # a case named twice ran twice
    args.ops = list(dict.fromkeys(o.strip() for o in args.ops.split(",") if o.strip()))
    if not args.ops:
        p.error("--ops: no case named (give a comma-separated list of cases)")
    from jaxfox.bench import REGISTRY, cases  # noqa: F401

    unknown = [o for o in args.ops if o not in REGISTRY]
    if unknown:
        p.error(f"--ops: unknown case(s) {', '.join(unknown)}; known: {', '.join(REGISTRY)}")
    return args


def main(argv=None) -> int:
    args = _parse(sys.argv[1:] if argv is None else argv)
    from jaxfox.bench import environment, format_header, format_table, run_cases, save_json, save_plot

    def log(msg):
        if not args.quiet:
            print(msg, file=sys.stderr, flush=True)

    if args.concurrent:
        import jaxfox

        try:
            jaxfox.enable_concurrent_command_buffers()
        except (ValueError, RuntimeError) as e:  # e.g. XLA_FLAGS with a value it cannot parse
            print(f"python -m jaxfox.bench: error: --concurrent: {e}", file=sys.stderr)
            return 2
    env = environment()
    print(format_header(env), flush=True)
    t0 = time.perf_counter()
    rows, skipped = run_cases(args.ops, args.shapes, repeats=args.repeats, min_call_ms=args.min_call_ms,
                              max_inner=args.max_inner, unroll=args.unroll, log=log)
    env["total_s"] = time.perf_counter() - t0
    env["shapes"] = args.shapes
    env["repeats"] = args.repeats
    print()
    print(format_table(rows))
    for s in skipped:
        print(f"{s['case']} {s['shape']}: {s['status']} ({s['reason']})")
    print(f"total {env['total_s']:.1f} s")
    if args.json:
        save_json(args.json, env, rows, skipped)
        print(f"wrote {args.json}")
    if args.plot:
        save_plot(args.plot, env, rows)
        print(f"wrote {args.plot}")
    return 1 if any(s["status"] == "failed" for s in skipped) else 0


if __name__ == "__main__":
    sys.exit(main())
