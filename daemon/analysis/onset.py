"""The onset of a drop: where step time jumps, and the steps before it against the steps after.

``split_at_drop`` is a pure function on a sequence of step (or cycle) times; ``drop_time`` applies it to a
signal's samples (the agent's estimate of when a job's steps slowed). Run as a worker (``python -m
tfprofd.daemon.analysis.onset CAPTURE_DIR --json``) it analyses a capture taken on pending: each snapshot of
a ring (one run directory each, in time order) or the one trace of a capture started at pending, splits
the snapshots where the step time jumps, compares the last one before with the slowest one after (the
baseline comparison's ``compare``), and says how long after the drop the trace begins, or that it holds
the drop itself. The split is per snapshot (a few seconds each).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path

from .compare import compare
from .model import CaptureAnalysis, Onset, OnsetWindow

DROP_RATIO = 1.5  # a step this much slower than the median of the steps before it starts a drop


def split_at_drop(times: Sequence[float], ratio: float = DROP_RATIO, last: bool = False,
                  min_before: int = 1, lookback: int = 30) -> int | None:
    """Index where a slow streak starts: the value and the next one at least ``ratio`` x the median of the (up to
    ``lookback``) values before it, which itself was not (one long step is no drop). The first such index, or
    the ``last``; None when there is none (a series slow from its start has no before)."""
    found = None
    for i in range(max(1, min_before), len(times)):
        before = statistics.median(times[max(0, i - lookback):i])
        if before > 0 and all(t >= ratio * before for t in times[i:i + 2]) and times[i - 1] < ratio * before:
            if not last:
                return i
            found = i
    return found


def drop_time(points: Sequence[tuple[float, float]], ratio: float = DROP_RATIO) -> float | None:
    """Time of the first slow sample of the latest drop in a (time, step seconds) series, or None."""
    i = split_at_drop([v for _, v in points], ratio, last=True, min_before=5)
    return None if i is None else points[i][0]


def run_dirs(capture_dir: Path) -> list[Path]:
    """A capture's run directories in time order (a ring's snapshots are numbered)."""
    return sorted({p.parent for p in capture_dir.glob("plugins/profile/*/*.xplane.pb")})


def onset(windows: list[CaptureAnalysis], drop_at: float | None) -> CaptureAnalysis:
    """The capture's analysis from its analysed snapshots in time order: the slowest snapshot after the drop leads,
    with where the trace stands against the drop. ``drop_at``: the agent's estimate (Unix s), if it has one."""
    seen = tuple(OnsetWindow(Path(w.trace).parent.name, w.lead.window, w.steps, w.lead.cycle_ms, w.bottleneck)
                 for w in windows)
    timed = [w for w in windows if w.steps and w.lead.cycle_ms]
    if not timed:
        return replace(windows[-1], onset=Onset(len(windows), False, drop_at=drop_at, windows=seen))
    split = split_at_drop([w.lead.cycle_ms or 0.0 for w in timed])
    first = timed[0].lead.window
    begins = first[0] / 1e9 if first else None
    if split:  # the trace holds steps from before the drop
        before, after = timed[split - 1], max(timed[split:], key=lambda w: w.lead.cycle_ms or 0.0)
        window = timed[split].lead.window
        comparison = compare(before, after)
        summary = f"the trace holds the drop: {comparison.summary}" if comparison else "the trace holds the drop"
        section = Onset(len(windows), True, begins, window[0] / 1e9 if window else drop_at, 0.0, summary,
                        comparison, seen)
        return replace(after, onset=section, summary=f"{after.summary}; {summary}")
    lead = max(timed, key=lambda w: w.lead.cycle_ms or 0.0)
    after_s = max(0.0, begins - drop_at) if drop_at is not None and begins is not None else None
    summary = f"the trace begins {after_s:.1f} s after the drop" if after_s is not None else None
    section = Onset(len(windows), False, begins, drop_at, after_s, summary, None, seen)
    return replace(lead, onset=section, summary=f"{lead.summary}; {summary}" if summary else lead.summary)


def analyse(capture_dir: Path, drop_at: float | None, max_memory: int | None = None) -> CaptureAnalysis:
    """Analyse every snapshot of a capture taken on pending; raises AnalysisError if none can be read, TooLarge
    if a snapshot's analysis would need more than ``max_memory`` bytes."""
    from .capture import analyze
    from .memory import TooLarge
    from .xprof import AnalysisError

    windows, errors = [], []
    for run in run_dirs(capture_dir):
        try:
            windows.append(analyze(run, max_memory=max_memory))
        except TooLarge:
            raise
        except AnalysisError as exc:  # one idle or broken snapshot does not lose the others
            errors.append(f"{run.name}: {exc}")
    if not windows:
        raise AnalysisError("; ".join(errors) or f"no .xplane.pb under {capture_dir}")
    return onset(windows, drop_at)


def main(argv: list[str] | None = None) -> int:
    from ..workers import die_with_parent
    from .memory import TooLarge
    from .xprof import AnalysisError

    die_with_parent()
    parser = argparse.ArgumentParser(prog="tfprofd-onset")
    parser.add_argument("path", type=Path)
    parser.add_argument("--drop-at", type=float, default=None, help="the drop's estimated Unix time")
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--max-memory", type=int, metavar="BYTES",
                        help="refuse a snapshot whose analysis would need more memory than this")
    args = parser.parse_args(argv)
    try:
        result = analyse(args.path, args.drop_at, args.max_memory)
    except (AnalysisError, OSError) as exc:
        print(json.dumps({"error": str(exc), "reason": "too_large" if isinstance(exc, TooLarge) else "error"}))
        return 1
    print(json.dumps(result.to_json()), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
