"""The recorded scenario corpus (tests/corpus.py): every source of steps crossed with the causes a CPU trace can
show. tfprofd must name each cause *and* say the numbers the trace holds: the step time and the share in the
sentence. ``RECORD_TRACES=1`` records the traces again first (on a quiet machine; the numbers below then move).
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from dataclasses import replace

import pytest
from corpus import CASES, Case, record, unpack

from helpers import analyze_json as analyze

pytestmark = pytest.mark.tf

# name: (bottleneck, step time in ms and the share in % that its sentence says, steps). The shares are far from
# the thresholds: input waits 69-95% of the step (threshold 20%), callbacks take 79-88% (30%), ops run 72-98% of
# a compute step (50%) and 5-24% of a small-batch one.
EXPECTED = {
    "hook_keras3-input": ("input", 80.8, 88, 10),
    "hook_keras3-callback": ("host", 14.4, 80, 10),
    "hook_keras3-compute": ("device", 24.8, 91, 36),
    "hook_keras3-small_batch": ("small_batch", 5.57, 12, 153),
    "hook_tf_keras-input": ("input", 81.8, 75, 10),
    "hook_tf_keras-callback": ("host", 76.9, 79, 9),  # callbacks inside tf_keras's step marker: 'all others'
    "hook_tf_keras-compute": ("device", 19.1, 91, 11),
    "hook_tf_keras-small_batch": ("small_batch", 21.96, 5, 42),
    "keras3_tensorboard-input": ("input", 81.6, 86, 10),
    "keras3_tensorboard-callback": ("host", 11.6, 83, 12),
    "keras3_tensorboard-compute": ("device", 32.6, 72, 16),
    "keras3_tensorboard-small_batch": ("small_batch", 1.82, 6, 340),
    "tf_keras_fit-input": ("input", 84.8, 78, 7),
    "tf_keras_fit-callback": ("host", 69.4, 88, 9),
    "tf_keras_fit-compute": ("device", 74.8, 91, 5),
    "tf_keras_fit-small_batch": ("small_batch", 4.19, 7, 201),
    "custom_unmarked-input": ("input", 12.7, 83, 11),
    "custom_unmarked-callback": ("host", 10.3, 85, 13),
    "custom_unmarked-compute": ("device", 39.5, 83, 11),
    "custom_unmarked-small_batch": ("small_batch", 0.55, 24, 222),
    "hook_keras3-spe8-input": ("input", 51.9, 93, 40),
    "hook_keras3-spe8-compute": ("device", 8.0, 96, 184),
    "hook_tf_keras-spe8-input": ("input", 51.6, 69, 40),
    "hook_tf_keras-spe8-compute": ("device", 11.1, 98, 80),
    "keras3_tensorboard-spe8-input": ("input", 51.1, 95, 40),
    "keras3_tensorboard-spe8-compute": ("device", 10.2, 97, 216),
    "tf_keras_fit-spe8-input": ("input", 50.6, 80, 16),
    "tf_keras_fit-spe8-compute": ("device", 11.7, 98, 112),
    # recorded beside a CPU hog per CPU: the trace alone sees CPU compute; its host samples see the starvation
    "hook_keras3-compute-contended": ("device", 14.9, 90, 32),
    "tf_keras_fit-compute-contended": ("device", 19.8, 86, 21),
    "custom_unmarked-compute-contended": ("device", 23.4, 96, 17),
}
# The contended cases' host samples over the capture window: (other processes' CPUs, of the host's CPUs, the share
# of the time the job's threads were ready to run that they waited for a CPU, in %).
CONTENDED = {
    "hook_keras3-compute-contended": (1.2, 2, 55),
    "tf_keras_fit-compute-contended": (1.5, 2, 74),
    "custom_unmarked-compute-contended": (1.6, 2, 77),
}


@pytest.fixture(scope="module")
def logdirs(tmp_path_factory):
    """{case name: a log directory holding its trace}, recorded first with RECORD_TRACES=1."""
    tmp = tmp_path_factory.mktemp("corpus")
    out = {}
    for case in CASES:
        if os.environ.get("RECORD_TRACES"):
            record(case)
        out[case.name] = unpack(case, tmp)
    return out


def sentence_numbers(why: str) -> tuple[float, int]:
    """(step time in ms, the first share in %) that a verdict's sentence says."""
    step = re.search(r"([\d.]+) ms step", why) or re.search(r"steps take ([\d.]+) ms", why)
    share = re.search(r"(\d+)%", why)
    assert step and share, why
    return float(step.group(1)), int(share.group(1))


def test_every_case_has_its_trace_and_the_corpus_stays_small():
    assert sorted(EXPECTED) == sorted(c.name for c in CASES)
    sizes = {c.name: c.path.stat().st_size for c in CASES}
    assert sum(sizes.values()) < 4_000_000, sizes


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_each_trace_is_named_with_its_numbers(logdirs, case: Case):
    kind, step_ms, share, steps = EXPECTED[case.name]
    result = analyze(str(logdirs[case.name]))
    assert result["bottleneck"] == kind, result["summary"]
    said_step, said_share = sentence_numbers(result["why"])
    assert said_step == pytest.approx(step_ms, rel=0.05), result["why"]
    assert abs(said_share - share) <= 3, result["why"]
    assert result["step_time_ms"]["mean"] == pytest.approx(said_step, rel=0.01)  # the sentence says the record's
    assert result["steps"] == steps, result["steps_found"]
    assert result["evidence"]["sufficient"], result["evidence"]
    # a step and the time after it: the step and what is between steps, nothing else (a straggler's measure)
    between = sum(result["between_ms"].values())
    assert result["cycle_ms"] == pytest.approx(result["step_time_ms"]["mean"] + between, rel=1e-9)


@pytest.mark.parametrize("case", [c for c in CASES if c.source == "keras3_tensorboard"],
                         ids=[c.name for c in CASES if c.source == "keras3_tensorboard"])
def test_keras3_profiled_batch_markers_are_the_steps(logdirs, case: Case):
    result = analyze(str(logdirs[case.name]))
    assert "'Profiled batch', without _r=1" in result["steps_found"] and not result["steps_inferred"], result


@pytest.mark.parametrize("case", [c for c in CASES if c.source == "custom_unmarked"],
                         ids=[c.name for c in CASES if c.source == "custom_unmarked"])
def test_a_custom_loop_without_markers_gets_inferred_steps_and_says_so(logdirs, case: Case):
    result = analyze(str(logdirs[case.name]))
    assert result["steps_inferred"] is True
    assert "tf.function 'train_step'" in result["steps_found"], result["steps_found"]
    text = subprocess.run([sys.executable, "-m", "tfprofd.daemon", "analyze", str(logdirs[case.name])],
                          capture_output=True, text=True, timeout=300).stdout
    assert "the steps are inferred: no step markers in the trace" in text, text


SPE = [c for c in CASES if c.steps_per_execution > 1]


@pytest.mark.parametrize("case", SPE, ids=[c.name for c in SPE])
def test_steps_per_execution_is_found_in_the_trace(logdirs, case: Case):
    """8 steps per marker, from the hook's ``steps`` stat or, without it, from the iterator's calls in the loop."""
    result = analyze(str(logdirs[case.name]))
    assert result["executions"] and result["steps"] == 8 * result["executions"], result
    if not case.source.startswith("hook_"):
        assert "8 steps per marker, counted from the input iterator's calls" in result["steps_found"], result


PAIRS = [(f"{source}-compute", f"{source}-{cause}")
         for source in ("hook_keras3", "hook_tf_keras", "keras3_tensorboard", "tf_keras_fit", "custom_unmarked")
         for cause in ("input", "callback")] + [
    (f"{source}-spe8-compute", f"{source}-spe8-input")
    for source in ("hook_keras3", "hook_tf_keras", "keras3_tensorboard", "tf_keras_fit")]


@pytest.mark.parametrize("pair", PAIRS, ids=[p[1] for p in PAIRS])
def test_the_same_model_slowed_is_compared_with_its_healthy_trace(logdirs, pair):
    """Input, callback and compute cases share one model: compute is the others' healthy baseline."""
    base, incident = pair
    result = analyze("--baseline", str(logdirs[base]), str(logdirs[incident]))
    comparison = result["comparison"]
    assert comparison, result["summary"]
    before, after, _ = comparison["step_ms"]
    assert before == pytest.approx(EXPECTED[base][1], rel=0.05), comparison
    assert after == pytest.approx(EXPECTED[incident][1], rel=0.05), comparison
    assert comparison["summary"].endswith(f": {EXPECTED[incident][0]}"), comparison["summary"]


HOGGED = [c for c in CASES if c.hogs]


@pytest.mark.parametrize("case", HOGGED, ids=[c.name for c in HOGGED])
def test_a_trace_recorded_beside_cpu_hogs_joined_with_its_host_samples_is_host_contention(logdirs, case: Case):
    """The trace's verdict (CPU compute) joined with the host context measured over its capture window: other
    processes took the CPUs, with the numbers; the same trace without its host samples keeps its own verdict."""
    from tfprofd.daemon.analysis import CaptureAnalysis
    from tfprofd.daemon.hostcontext import CONTENTION_RECOMMENDATION, apply, contention

    trace = CaptureAnalysis.from_json(analyze(str(logdirs[case.name])))
    kind, step_ms, _, _ = EXPECTED[case.name]
    assert trace.bottleneck == kind and trace.lead.hardware == "CPU_ONLY", trace.summary
    host = case.host()
    assert host.job_processes == 1 and host.job_threads > 1, host  # the recording process and its threads
    assert contention(replace(host, contention=None)) == host.contention  # the verdict is the samples' own

    joined, cause = apply(trace, host)
    assert cause is not None and joined.bottleneck == "host_contention", joined.summary
    found = re.match(r"host_contention: other processes used (\d+\.\d) of (\d+) CPUs; the job's threads were ready "
                     r"to run on (\d+\.\d) CPUs but ran on (\d+\.\d), waiting for a CPU (\d+)% of the time",
                     joined.summary)
    assert found, joined.summary
    others, cpus, wanted, got, waited = (float(g) for g in found.groups())
    expected_others, expected_cpus, expected_waited = CONTENDED[case.name]
    assert others == pytest.approx(expected_others, abs=0.1) and cpus == expected_cpus, joined.summary
    assert abs(waited - expected_waited) <= 3 and got < wanted <= cpus, joined.summary
    assert others == pytest.approx(host.other_cores + host.tfprofd_cores, abs=0.06)
    assert f"; the trace alone says {trace.summary}" in joined.summary
    said_step, _ = sentence_numbers(joined.summary.partition("the trace alone says ")[2])
    assert said_step == pytest.approx(step_ms, rel=0.05), joined.summary
    record = joined.to_json()  # as the agent stores it: the host's cause leads, the trace's verdict beside it
    assert (record["bottleneck"], record["trace_bottleneck"]) == ("host_contention", kind), record["summary"]
    assert record["recommendation"] == CONTENTION_RECOMMENDATION
    assert CaptureAnalysis.from_json(record).host_verdict == joined.host_verdict

    alone, no_cause = apply(trace, None)
    assert no_cause is None and alone == trace and alone.bottleneck == kind


def _space(calls: int, marker: str | None = None):
    """A host plane whose Python thread runs tf.function 'train_step' ``calls`` times (inside a step marker named
    ``marker`` without _r=1, if given) and one 'evaluate' call."""
    from tfprofd.daemon.protos import xplane_pb2

    space = xplane_pb2.XSpace()
    plane = space.planes.add(name="/host:CPU")
    for i, name in enumerate(("tf_function_call", "step_num")):
        plane.stat_metadata[i + 1].id, plane.stat_metadata[i + 1].name = i + 1, name
    for i, name in enumerate(("train_step", "evaluate", marker or "unused")):
        plane.event_metadata[i + 1].id, plane.event_metadata[i + 1].name = i + 1, name
    line = plane.lines.add(name="python", timestamp_ns=1000)
    for n in range(calls):
        if marker:
            line.events.add(metadata_id=3, offset_ps=n * 10**9, duration_ps=9 * 10**8).stats.add(metadata_id=2,
                                                                                                 int64_value=n)
        line.events.add(metadata_id=1, offset_ps=n * 10**9 + 10**6, duration_ps=8 * 10**8).stats.add(
            metadata_id=1, str_value="")
    line.events.add(metadata_id=2, offset_ps=calls * 10**9, duration_ps=10**6).stats.add(metadata_id=1, str_value="")
    return space


def test_steps_are_inferred_only_from_a_repeated_tf_function_and_only_those_are_marked_for_xprof(tmp_path):
    from tfprofd.daemon.analysis.timeline import find_steps, load, read_events
    from tfprofd.daemon.analysis.xprof import StepHints, _rewritten
    from tfprofd.daemon.protos import xplane_pb2

    for calls, source in ((2, "none"), (3, "inferred")):
        trace = tmp_path / f"{calls}.xplane.pb"
        trace.write_bytes(_space(calls).SerializeToString())
        steps = find_steps(read_events(load(trace)))
        assert (steps.source, len(steps.markers)) == (source, calls if source == "inferred" else 0), steps
    assert steps.function == "train_step" and "3 executions of tf.function 'train_step'" in steps.found
    marked = xplane_pb2.XSpace.FromString(_rewritten(trace.read_bytes(), StepHints(step_function="train_step")))
    plane = marked.planes[0]
    stat = {m.name: i for i, m in plane.stat_metadata.items()}
    events = plane.lines[0].events
    assert [{plane.stat_metadata[s.metadata_id].name: s.int64_value for s in e.stats if s.metadata_id != stat[
        "tf_function_call"]} for e in events] == [{"_r": 1, "step_num": 1}, {"_r": 1, "step_num": 2},
                                                  {"_r": 1, "step_num": 3}, {}]  # 'evaluate' stays as it was
    assert [e.offset_ps for e in events] == [e.offset_ps for e in _space(3).planes[0].lines[0].events]


def test_markers_without_r_are_steps_and_get_it_for_xprof(tmp_path):
    from tfprofd.daemon.analysis.timeline import find_steps, load, read_events
    from tfprofd.daemon.analysis.xprof import StepHints, _rewritten
    from tfprofd.daemon.protos import xplane_pb2

    trace = tmp_path / "pb.xplane.pb"
    trace.write_bytes(_space(4, marker="Profiled batch").SerializeToString())
    steps = find_steps(read_events(load(trace)))
    assert steps.source == "host markers" and steps.unrooted and len(steps.markers) == 4, steps
    assert steps.found == "step markers ('Profiled batch', without _r=1)"
    plane = xplane_pb2.XSpace.FromString(_rewritten(trace.read_bytes(), StepHints(root_markers=True))).planes[0]
    names = {i: m.name for i, m in plane.event_metadata.items()}
    rooted = [names[e.metadata_id] for e in plane.lines[0].events
              if any(plane.stat_metadata[s.metadata_id].name == "_r" for s in e.stats)]
    assert rooted == ["Profiled batch"] * 4
