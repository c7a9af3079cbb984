"""Command-line checks shared by the example scripts: the ones argparse does not make.

Each script puts this folder on ``sys.path`` (however it is loaded: run as a script, or by path from a test or a
notebook) and calls these from its ``parse_args``, so bad input stops with argparse's usage error (status 2)
before any data loads or anything trains.
"""

from __future__ import annotations

import argparse
import math
import os
import sys


def check_output_folder(parser: argparse.ArgumentParser, out: str, flag: str = "--out") -> str:
    """Refuses an output folder the script could not write its results into at the end of the run.

    A path through an existing file, or one under a folder where no file can be created (read-only, or a
    pseudo file system such as /proc), is a usage error naming ``flag``. The check writes and removes one
    temporary file in the deepest existing folder of the path and creates nothing else: the script makes the
    folder when it saves. A relative path is taken from the current directory.
    """
    from jaxfox._validate import unwritable_reason

    why = unwritable_reason(out, folder=True)
    if why:
        parser.error(f"{flag} {out!r}: {why}")
    return out


def check_finite(parser: argparse.ArgumentParser, args: argparse.Namespace, names, *, low: float,
                 strict: bool = False) -> None:
    """Each ``args.<name>`` must be finite and ``>= low`` (``> low`` with ``strict``); else a usage error naming
    ``--<name>`` (NaN and infinities fail too: ``float`` parses "nan" and "inf")."""
    for name in names:
        v = getattr(args, name)
        if not (math.isfinite(v) and (v > low if strict else v >= low)):
            parser.error(f"--{name.replace('_', '-')} must be a finite number {'>' if strict else '>='} {low:g}, "
                         f"got {v}")


def usage_error(message: str) -> None:
    """Exits as argparse's ``parser.error`` does (one line on stderr, status 2), for the checks that need data a
    script loads after parsing (a window or an episode longer than the series)."""
    print(f"{os.path.basename(sys.argv[0] or 'python')}: error: {message}", file=sys.stderr)
    sys.exit(2)
