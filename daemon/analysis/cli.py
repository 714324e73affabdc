"""``tfprofd analyze`` (and ``python -m tfprofd.daemon.analysis``): analyse a capture, print a report or JSON.

The agent runs this in its own process (``PATH --json``): xprof needs 200-450 MB the agent must not hold.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

from .capture import analyze
from .compare import compare, with_comparison
from .memory import TooLarge
from .report import report
from .xprof import AnalysisError, quiet, write_viewer_cache


def main(argv: list[str] | None = None) -> int:
    from ..workers import die_with_parent

    die_with_parent()
    parser = argparse.ArgumentParser(prog="tfprofd analyze",
                                     description="Say what bound the training step in a TensorFlow profile.")
    parser.add_argument("path", type=Path, help="a capture or TensorBoard log directory, or an .xplane.pb")
    parser.add_argument("--baseline", type=Path, help="a capture of the same job while it ran well: say what changed")
    parser.add_argument("--json", action="store_true", help="print JSON for machines")
    parser.add_argument("--verbose", action="store_true", help="show xprof's own log lines")
    parser.add_argument("--viewer-cache", action="store_true",
                        help="also leave xprof's viewer cache in the capture, for readers who cannot write to it")
    parser.add_argument("--max-memory", type=int, metavar="BYTES",
                        help="refuse a trace whose analysis would need more memory than this")
    args = parser.parse_args(argv)
    try:
        result = analyze(args.path, args.verbose, args.max_memory)
        if args.baseline:
            result = with_comparison(result, compare(analyze(args.baseline, args.verbose), result))
        if args.viewer_cache:
            with quiet(args.verbose):
                write_viewer_cache(args.path)
    except (AnalysisError, OSError) as exc:
        if args.json:
            print(json.dumps({"error": str(exc), "reason": "too_large" if isinstance(exc, TooLarge) else "error"}))
        else:
            print(f"tfprofd analyze: {exc}", file=sys.stderr)
        return 1
    try:
        print(json.dumps(result.to_json(), indent=1) if args.json else report(result), flush=True)
    except BrokenPipeError:  # the reader went away (`tfprofd analyze ... | head`): nothing left to say
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # no second error at exit's flush
        return 141  # as a shell reports a process killed by SIGPIPE
    return 0
