"""The onset of a drop: where step time jumps, and the steps before it against the steps after.

``split_at_drop`` is a pure function on a sequence of step (or cycle) times; ``drop_time`` applies it to a
signal's samples. Run as a worker (``python -m tfprofd.daemon.onset CAPTURE_DIR --json``) it analyses a
capture taken on pending: each snapshot of a ring (one run directory each, in time order) or the one
trace of a capture started at pending, splits the snapshots at the drop, compares the last one before
with the slowest one after (the baseline comparison's ``compare``), and says how long after the drop the
trace begins, or that it holds the drop itself.

Note: the split works on per-snapshot step times because the analysis module does not expose per-step
rows yet (a refactor into a package is under way); the function itself takes any time series.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

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


def onset(windows: list[dict[str, Any]], drop_at: float | None) -> tuple[dict[str, Any], dict[str, Any]]:
    """(the facts that lead the record, the onset section) from the analysed snapshots in time order.
    ``drop_at``: the agent's estimate of the drop (Unix s, from the hook's step times), if it has one."""
    from .analysis import compare

    timed = [w for w in windows if w.get("steps") and w.get("cycle_ms")]
    if not timed:
        return windows[-1], {"snapshots": len(windows), "holds_drop": False, "drop_at": drop_at}
    split = split_at_drop([w["cycle_ms"] for w in timed])
    first = timed[0].get("window")
    begins = first[0] / 1e9 if first else None
    out: dict[str, Any] = {"snapshots": len(windows), "trace_begins_at": begins, "holds_drop": bool(split)}
    if split:  # the trace holds steps from before the drop
        before, after = timed[split - 1], max(timed[split:], key=lambda w: w["cycle_ms"])
        window = timed[split].get("window")
        out["drop_at"] = window[0] / 1e9 if window else drop_at  # within a snapshot of the split
        out["first_slow_step_after_drop_s"] = 0.0
        out["comparison"] = compare(before, after)
        if out["comparison"]:
            out["summary"] = f"at the drop: {out['comparison']['summary']}"
        return after, out
    lead = max(timed, key=lambda w: w["cycle_ms"])
    out["drop_at"] = drop_at
    if drop_at is not None and begins is not None:
        out["first_slow_step_after_drop_s"] = max(0.0, begins - drop_at)
        out["summary"] = f"the trace begins {max(0.0, begins - drop_at):.1f} s after the drop"
    return lead, out


def analyse(capture_dir: Path, drop_at: float | None) -> dict[str, Any]:
    """Analyse every snapshot of a capture taken on pending; raises AnalysisError if none can be read."""
    from .analysis import AnalysisError, analyze

    windows, errors = [], []
    for run in run_dirs(capture_dir):
        try:
            windows.append(analyze(run))
        except AnalysisError as exc:  # one idle or broken snapshot does not lose the others
            errors.append(f"{run.name}: {exc}")
    if not windows:
        raise AnalysisError("; ".join(errors) or f"no .xplane.pb under {capture_dir}")
    lead, section = onset(windows, drop_at)
    section["windows"] = [{"run": Path(w["trace"]).parent.name, "window": w.get("window"), "steps": w.get("steps"),
                           "cycle_ms": w.get("cycle_ms"), "bottleneck": w.get("bottleneck")} for w in windows]
    if errors:
        section["unreadable"] = errors
    result = {**lead, "onset": section}
    if section.get("summary"):
        result["summary"] = f"{lead['summary']}; {section['summary']}"
    return result


def main(argv: list[str] | None = None) -> int:
    from .analysis import AnalysisError, quiet, write_viewer_cache
    from .workers import die_with_parent

    die_with_parent()
    parser = argparse.ArgumentParser(prog="tfprofd-onset")
    parser.add_argument("path", type=Path)
    parser.add_argument("--drop-at", type=float, default=None, help="the drop's estimated Unix time")
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--viewer-cache", action="store_true")
    args = parser.parse_args(argv)
    try:
        result = analyse(args.path, args.drop_at)
        if args.viewer_cache:
            with quiet(False):
                write_viewer_cache(args.path)
    except (AnalysisError, OSError) as exc:
        print(json.dumps({"error": str(exc)}))
        return 1
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
