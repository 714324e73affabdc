"""The copy of a trace xprof converts, made while the timeline is read beside it: the same copy and the same
timeline as reading the whole trace first, for every recorded trace; and the ops a while loop runs all counted."""

from __future__ import annotations

import lzma

import pytest

from helpers import FIXTURES

TRACES = sorted((FIXTURES / "traces").glob("**/*.xplane.pb.xz"))
MS = 10**9  # picoseconds


def _loop_space():
    """A host plane: one step marker of 10 ms; on an executor thread, a while loop's first two iterations, one
    op each (5 ms, then 1 ms)."""
    from tfprofd.daemon.protos import xplane_pb2

    space = xplane_pb2.XSpace()
    plane = space.planes.add(name="/host:CPU")
    for i, name in enumerate(("step_num", "_r", "iter_num"), start=1):
        plane.stat_metadata[i].id, plane.stat_metadata[i].name = i, name
    for i, name in enumerate(("train", "while/body/dense/MatMul:MatMul", "while/body/add:AddV2"), start=1):
        plane.event_metadata[i].id, plane.event_metadata[i].name = i, name
    marker = plane.lines.add(name="python", timestamp_ns=1000).events.add(metadata_id=1, duration_ps=10 * MS)
    marker.stats.add(metadata_id=1, int64_value=1)
    marker.stats.add(metadata_id=2, int64_value=1)
    executor = plane.lines.add(name="tf_Compute/1", timestamp_ns=1000)
    for metadata_id, offset, duration, iteration in ((2, 0, 5 * MS, 1), (3, 5 * MS, MS, 2)):
        executor.events.add(metadata_id=metadata_id, offset_ps=offset, duration_ps=duration).stats.add(
            metadata_id=3, int64_value=iteration)
    return space


def test_the_op_that_shows_a_while_loop_ran_counts_in_how_busy_ops_keep_the_cpu():
    """The first loop iteration's op said "a loop ran" and was then left out of the ops: 10% busy, not 60%."""
    from tfprofd.daemon.analysis.timeline import read_events, timeline

    line = timeline(read_events(_loop_space()))
    assert line.loops and line.ops_busy == pytest.approx(0.6)


@pytest.mark.parametrize("trace", TRACES, ids=[t.name.removesuffix(".xplane.pb.xz") for t in TRACES])
def test_the_copy_and_timeline_made_beside_xprof_are_the_whole_traces(trace, tmp_path, monkeypatch):
    """The analysis's own read (xprof's conversion left out): one conversion, of the copy the whole trace asks
    for, byte for byte; and the timeline of one pass over the whole trace."""
    from tfprofd.daemon.analysis import worker
    from tfprofd.daemon.analysis.timeline import read_events, timeline
    from tfprofd.daemon.analysis.xprof import _rewritten
    from tfprofd.daemon.protos import xplane_pb2

    data = lzma.decompress(trace.read_bytes())
    whole = timeline(read_events(xplane_pb2.XSpace.FromString(data)))
    local = tmp_path / "localhost.xplane.pb"
    local.write_bytes(data)
    converted = []
    monkeypatch.setattr(worker, "_convert", lambda linked, verbose: converted.append(linked.read_bytes()))
    line, _ = worker._read(local, verbose=False)
    assert line == whole
    assert converted == [_rewritten(data, whole.hints) if whole.hints.needed else data]


def _copies(monkeypatch) -> list[tuple[int, bool]]:
    """Of each copy xprof converts from now on: its events marked ``_r``, and whether loop ids are hidden."""
    from tfprofd.daemon.analysis import worker
    from tfprofd.daemon.protos import xplane_pb2

    converted, convert = [], worker._convert

    def spy(linked, verbose):
        plane = xplane_pb2.XSpace.FromString(linked.read_bytes()).planes[0]
        rooted = {i for i, m in plane.stat_metadata.items() if m.name == "_r"}
        converted.append((sum(any(s.metadata_id in rooted for s in e.stats) for line in plane.lines
                              for e in line.events),
                          "iter_num_hidden_by_tfprofd" in {m.name for m in plane.stat_metadata.values()}))
        return convert(linked, verbose)

    monkeypatch.setattr(worker, "_convert", spy)
    return converted


def test_step_markers_on_a_tf_data_thread_are_marked_in_the_copy_xprof_converts(tmp_path, monkeypatch):
    """Keras 3 markers (no _r=1) on the Python thread and on a tf.data thread: the copy made from the deciding
    lines leaves the latter unmarked, so xprof converts the whole trace's copy again."""
    from tfprofd.daemon.analysis import worker
    from tfprofd.daemon.protos import xplane_pb2

    space = xplane_pb2.XSpace()
    plane = space.planes.add(name="/host:CPU")
    plane.stat_metadata[1].id, plane.stat_metadata[1].name = 1, "step_num"
    plane.event_metadata[1].id, plane.event_metadata[1].name = 1, "Profiled batch"
    for index, name in enumerate(("python", "tf_data_iterator_get_next/1")):
        line = plane.lines.add(name=name, timestamp_ns=1000)
        for n in range(30 * index, 30 * index + 30):
            line.events.add(metadata_id=1, offset_ps=n * 10 * MS, duration_ps=9 * MS).stats.add(metadata_id=1,
                                                                                             int64_value=n)
    trace = tmp_path / "localhost.xplane.pb"
    trace.write_bytes(space.SerializeToString())
    converted = _copies(monkeypatch)
    analysis = worker.analyze_worker(trace)
    assert converted == [(30, False), (60, False)]  # the deciding lines' copy, then the whole trace's
    assert analysis.steps_found == "step markers ('Profiled batch', without _r=1)"


def test_a_while_loop_seen_late_on_the_executors_still_gets_its_ids_hidden_from_xprof(tmp_path, monkeypatch):
    """The executors' lines are read beside xprof; only their start is looked at first. A loop that shows only
    later gets xprof the copy without loop ids all the same (converted again), and the timeline says it ran."""
    from tfprofd.daemon.analysis import worker

    space = _loop_space()
    executor = space.planes[0].lines[1]
    loop_ops = list(executor.events)
    del executor.events[:]
    for n in range(2000):  # before the loop: ops outside it (iteration 0)
        executor.events.add(metadata_id=3, offset_ps=n * 1000, duration_ps=500).stats.add(metadata_id=3)
    executor.events.extend(loop_ops)
    trace = tmp_path / "localhost.xplane.pb"
    trace.write_bytes(space.SerializeToString())
    converted = _copies(monkeypatch)
    analysis = worker.analyze_worker(trace)
    assert converted == [(1, False), (1, True)]  # read as it is, then without loop ids
    assert analysis.loops_hidden


def test_a_bookkeeping_event_with_a_step_number_is_no_step_in_either_copy(tmp_path, monkeypatch):
    """tf.data's iterator events are bookkeeping, whose stats are never read for a step: one that carries a
    step number is marked neither in the copy made beside xprof nor in the one made from the whole trace (the
    latter marked it, so the two copies of one trace differed)."""
    from tfprofd.daemon.analysis import worker
    from tfprofd.daemon.analysis.timeline import read_events, timeline
    from tfprofd.daemon.analysis.xprof import _rewritten
    from tfprofd.daemon.protos import xplane_pb2

    space = xplane_pb2.XSpace()
    plane = space.planes.add(name="/host:CPU")
    plane.stat_metadata[1].id, plane.stat_metadata[1].name = 1, "step_num"
    plane.event_metadata[1].id, plane.event_metadata[1].name = 1, "Profiled batch"
    plane.event_metadata[2].id, plane.event_metadata[2].name = 2, "Iterator::Prefetch"
    python, data_thread = plane.lines.add(name="python", timestamp_ns=1000), plane.lines.add(name="tf_data/1")
    for n in range(30):
        python.events.add(metadata_id=1, offset_ps=n * 10 * MS, duration_ps=9 * MS).stats.add(metadata_id=1,
                                                                                          int64_value=n)
    data_thread.events.add(metadata_id=2, offset_ps=5 * MS, duration_ps=MS).stats.add(metadata_id=1, int64_value=7)
    data = space.SerializeToString()
    whole = timeline(read_events(xplane_pb2.XSpace.FromString(data)))
    assert whole.hints.needed
    local = tmp_path / "localhost.xplane.pb"
    local.write_bytes(data)
    converted = []
    monkeypatch.setattr(worker, "_convert", lambda linked, verbose: converted.append(linked.read_bytes()))
    worker._read(local, verbose=False)
    copy = xplane_pb2.XSpace.FromString(converted[0]).planes[0]
    rooted = {i for i, m in copy.stat_metadata.items() if m.name == "_r"}
    assert [sum(any(s.metadata_id in rooted for s in e.stats) for e in line.events) for line in copy.lines] == [30, 0]
    assert converted == [_rewritten(data, whole.hints)]
