"""Running xprof headlessly on one trace: finding a capture's traces, a private session for xprof's cache,
its C++ logging kept quiet, its tools' tables, its per-step breakdown (OpStats), and its viewer cache."""

from __future__ import annotations

import contextlib
import json
import os
import sys
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import TYPE_CHECKING, Any

from .model import PART_TYPES

if TYPE_CHECKING:
    from ..protos.xplane_pb2 import XEvent, XSpace


# Bookkeeping of TF's allocator, tf.data's iterators and TF's thread pools, by event name: never a step marker, a
# tf.function call or a loop iteration (those are the stepping thread's, the function's own and the executors'
# events), so their stats are not read for one. They are most of the stats: a demo capture's 89,000 iterator
# events have 5 each, allocations 11-14; reading them was a third of the time the lines beside xprof took.
BOOKKEEPING_EVENTS = frozenset({"MemoryAllocation", "MemoryDeallocation"})
BOOKKEEPING_PREFIXES = ("Iterator::", "ThreadpoolListener::")


def bookkeeping(names: dict[int, str]) -> set[int]:
    """The ids of a plane's bookkeeping events (``BOOKKEEPING_EVENTS``, or named with a ``BOOKKEEPING_PREFIXES``)."""
    return {i for i, name in names.items() if name in BOOKKEEPING_EVENTS or name.startswith(BOOKKEEPING_PREFIXES)}


class AnalysisError(Exception):
    """The trace could not be analysed (unreadable, corrupt or truncated)."""


def find_traces(path: Path) -> list[Path]:
    """The traces of one capture: the file itself, or every ``.xplane.pb`` of the newest run directory."""
    if not path.exists():
        raise AnalysisError(f"{path} does not exist")
    if path.is_file():
        return [path]
    traces = [p for p in path.glob("**/*.xplane.pb") if p.is_file()]
    if not traces:
        raise AnalysisError(f"no .xplane.pb under {path}")
    newest_run = max({t.parent for t in traces}, key=lambda d: (max(t.stat().st_mtime for t in d.glob("*.xplane.pb")),
                                                                 d.name))
    return sorted(t for t in traces if t.parent == newest_run)


def host_of(trace: Path) -> str:
    return trace.name.removesuffix(".xplane.pb")


@contextlib.contextmanager
def quiet(verbose: bool) -> Iterator[list[str]]:
    """Send xprof's C++ logging (written to the process's stdout and stderr) to a file; its tail is kept
    for error messages."""
    tail: list[str] = []
    if verbose:
        yield tail
        return
    sys.stdout.flush()
    sys.stderr.flush()
    saved = os.dup(1), os.dup(2)
    with tempfile.TemporaryFile() as sink:
        os.dup2(sink.fileno(), 1)
        os.dup2(sink.fileno(), 2)
        try:
            yield tail
        finally:
            os.dup2(saved[0], 1)
            os.dup2(saved[1], 2)
            os.close(saved[0])
            os.close(saved[1])
            sink.seek(max(0, sink.seek(0, 2) - 4000))
            tail.extend(sink.read().decode(errors="replace").splitlines()[-5:])


@dataclass(frozen=True)
class StepHints:
    """What xprof's copy of a trace must say for xprof to find the steps the timeline finds (see private_session);
    none: xprof reads the trace itself."""

    hide_loops: bool = False
    root_markers: bool = False
    step_function: str | None = None

    @property
    def needed(self) -> bool:
        return self.hide_loops or self.root_markers or self.step_function is not None


@contextlib.contextmanager
def private_session(trace: Path, hints: StepHints, parsed: bool = False) -> Iterator[Path]:
    """A fresh directory holding only a link to the trace: xprof caches per directory, so a folder of
    several traces would give every one the first one's answers, and the user's folder stays as it was.

    Where xprof would not find the steps the timeline found, it gets a copy it can read them from (``hints``):
    ``hide_loops``: without the loop-iteration ids of TensorFlow's executor events. Where a trace has any TF
    while loop (Keras's steps_per_execution > 1 runs its steps in one, and so do some models), xprof takes
    every loop iteration for a step and ignores the step markers, finding no steps at all; without those
    ids it groups the trace by its step markers. ``root_markers``: with ``_r=1`` on step markers that lack it
    (Keras 3's "Profiled batch"), which xprof otherwise ignores. ``step_function``: with each execution of
    that tf.function marked as a step (``_r=1``, ``step_num``), for traces without markers. ``parsed``: the
    caller writes that copy at the path, from the trace it parsed already (``mark_steps``); else it is made here."""
    with tempfile.TemporaryDirectory(prefix="tfprofd-analysis-") as tmp:
        linked = Path(tmp) / trace.name
        if not hints.needed:
            linked.symlink_to(trace.resolve())
        elif not parsed:
            linked.write_bytes(_rewritten(trace.read_bytes(), hints))
        yield linked


def _rewritten(data: bytes, hints: StepHints) -> bytes:
    """The trace's copy for xprof (see private_session)."""
    from ..protos import xplane_pb2

    space = xplane_pb2.XSpace.FromString(data)
    mark_steps(space, hints)
    return space.SerializeToString()


def mark_steps(space: XSpace, hints: StepHints, marked: list[tuple[int, int, XEvent]] | None = None) -> None:
    """Make the trace xprof's copy (see private_session), in place: its ``iter_num`` stat renamed, and ``_r=1``
    (and ``step_num``) added to the events that are steps; every event and value is kept. ``marked``: the host
    events with a step_num or tf_function_call stat, bookkeeping aside, by plane and line index
    (``timeline.Events.marked``), the only ones it can change: the others are not looked at; without it, every
    host event but bookkeeping is."""
    by_plane: dict[int, list[XEvent]] = {}
    for plane_index, _, event in sorted(marked or [], key=lambda m: m[:2]):  # each line's events stay in order
        by_plane.setdefault(plane_index, []).append(event)
    for plane_index, plane in enumerate(space.planes):
        stats = {m.name: i for i, m in plane.stat_metadata.items()}
        if hints.hide_loops and "iter_num" in stats:
            plane.stat_metadata[stats["iter_num"]].name = "iter_num_hidden_by_tfprofd"
        if not plane.name.startswith("/host") or not (hints.root_markers or hints.step_function):
            continue
        for name in ("_r", "step_num"):
            if name not in stats:
                stats[name] = max([*plane.stat_metadata, *(m.id for m in plane.stat_metadata.values()), 0]) + 1
                plane.stat_metadata[stats[name]].id = stats[name]
                plane.stat_metadata[stats[name]].name = name
        step = hints.step_function
        functions = {i for i, m in plane.event_metadata.items() if step and m.name == step}
        called = stats.get("tf_function_call")
        if marked is None:  # as timeline.read_events finds them: never a bookkeeping event
            skipped = bookkeeping({i: m.name for i, m in plane.event_metadata.items()})
            events = (e for line in plane.lines for e in line.events if e.metadata_id not in skipped)
        else:
            events = iter(by_plane.get(plane_index, []))
        n = 0
        for event in events:
            has = {st.metadata_id for st in event.stats}
            if stats["_r"] in has:
                continue
            if hints.root_markers and stats["step_num"] in has:
                event.stats.add(metadata_id=stats["_r"], int64_value=1)
            elif event.metadata_id in functions and called in has and stats["step_num"] not in has:
                n += 1
                event.stats.add(metadata_id=stats["_r"], int64_value=1)
                event.stats.add(metadata_id=stats["step_num"], int64_value=n)


def converter() -> ModuleType:
    """xprof's converter, imported on first use (the agent itself never loads xprof)."""
    from xprof.convert import raw_to_tool_data

    return raw_to_tool_data


def tool(trace: Path, name: str) -> Any:
    """One xprof tool's data for the trace (its JSON)."""
    try:
        data, _ = converter().xspace_to_tool_data([str(trace)], name, {})
    except Exception as exc:  # xprof raises plain exceptions for some corrupt protobufs
        raise AnalysisError(f"cannot analyse {trace.name}: not a readable profile, corrupt or truncated "
                            f"({name}: {exc})") from None
    if not data:
        if name == "kernel_stats":
            return {}
        raise AnalysisError(f"cannot analyse {trace.name}: not a readable profile, corrupt or truncated "
                            f"({name} returned nothing)")
    return json.loads(data)


def rows(table: dict[str, Any]) -> list[dict[str, Any]]:
    """The rows of one of xprof's data tables, as dicts by column id."""
    ids = [c.get("id") for c in table.get("cols", [])]
    return [dict(zip(ids, (cell.get("v") if cell else None for cell in row["c"]), strict=False))
            for row in table.get("rows", [])]


def num(value: Any) -> float:
    try:
        return float(value or 0)
    except (TypeError, ValueError):
        return 0.0


def steps_from_opstats(session_dir: Path) -> list[dict[str, float]] | None:
    """Per step: its duration and parts in ms, from the OpStats xprof wrote (None if it wrote none)."""
    from xprof.protobuf import op_stats_pb2, steps_db_pb2

    path = session_dir / "ALL_HOSTS.op_stats_v2.pb"
    if not path.exists():
        return None
    stats = op_stats_pb2.OpStats.FromString(path.read_bytes())
    steps = []
    for step in stats.step_db.step_sequence:
        infos = [info for _, info in sorted(step.step_info_per_core.items())]
        if not infos:
            continue
        info = infos[0]  # generic hardware keeps every step under one core
        breakdown = steps_db_pb2.GenericStepBreakdown()
        if not info.step_breakdown.Unpack(breakdown):
            continue
        row = {"begin_ms": info.begin_ps / 1e9, "step_ms": info.duration_ps / 1e9}
        accounted = 0.0
        for part, types in PART_TYPES.items():
            row[part] = sum(breakdown.type_ps.get(t, 0) for t in types) / 1e9
            accounted += row[part]
        row["other"] += max(0.0, row["step_ms"] - accounted)  # types no part holds, and untraced time
        if row["step_ms"] > 0:
            steps.append(row)
    return steps


def steps_from_table(pipeline: list[dict[str, Any]]) -> list[dict[str, float]]:
    """Per step, from input_pipeline_analyzer's table (input wait and host-to-device come as one there)."""
    columns = {"device_compute": "deviceComputeTimeMs", "device_to_device": "deviceToDeviceTimeMs",
               "device_collectives": "deviceCollectivesTimeMs", "host_compute": "hostComputeTimeMs",
               "kernel_launch": "kernelLaunchTimeMs", "input_wait": "infeedTimeMs", "output": "outfeedTimeMs",
               "compile": "compileTimeMs", "other": "otherTimeMs"}
    steps = []
    for row in rows(pipeline[1]) if len(pipeline) > 1 else []:
        step = {"begin_ms": 0.0, "step_ms": num(row.get("stepTimeMs")), "host_to_device": 0.0}
        step.update({part: num(row.get(column)) for part, column in columns.items()})
        if step["step_ms"] > 0:
            steps.append(step)
    return steps


def write_viewer_cache(capture_dir: Path) -> None:
    """Leave in each run directory what xprof's viewer writes on first open (its tool list, OpStats, trace
    viewer tables, cache_version.txt), made by xprof's own plugin code, so a user who cannot write into
    the capture still opens it."""
    from werkzeug.test import EnvironBuilder
    from werkzeug.wrappers import Request
    from xprof.server import DataProvider, ProfilePluginLoader, TBContext

    context = TBContext(str(capture_dir), DataProvider(str(capture_dir)), TBContext.Flags(False))
    context.hide_capture_profile_button, context.enable_tab_name_label, context.src_prefix = True, False, None
    plugin = ProfilePluginLoader().load(context)

    def request(**args: str) -> Request:
        return Request(EnvironBuilder(path="/data", query_string=args).get_environ())

    for run in plugin.runs_imp(request()):
        run_dir = plugin._run_dir(run, request(run=run))
        for name in plugin.run_tools_imp(run, request(run=run)):
            if name in ("memory_profile", "op_profile", "roofline_model", "hlo_stats"):
                continue  # opened rarely and cheap to make; not worth their share of the disk budget
            for host in plugin._run_host_impl(run, run_dir, name) or [{"hostname": ""}]:
                with contextlib.suppress(Exception):
                    plugin.data_impl(request(run=run, tag=name, host=host["hostname"]))
