"""The seed's case studies reproduced on CPU: tfprofd must name each bottleneck, say what changed against the
job's healthy baseline, and do the same on traces made without tfprofd (TensorFlow's own profiler APIs).

Record the traces made without tfprofd again after a change to how they are made with
``RECORD_TRACES=1 .venv/bin/pytest tests/test_scenarios.py`` on a quiet machine."""

from __future__ import annotations

import lzma
import math
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tfprofd.daemon.analysis import PART_WORDS, CaptureAnalysis, compare
from tfprofd.daemon.protos import xplane_pb2

from helpers import AgentProcess
from helpers import analyze_json as analyze
from scenarios import PAUSE, SCENARIOS, capture, plain_trace

pytestmark = pytest.mark.tf


@pytest.fixture(scope="module")
def agent(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("scenarios")
    config = tmp / "tfprofd.yaml"
    config.write_text("rules: []\n")  # only the captures the test asks for
    a = AgentProcess(tmp, args=["--config", str(config), "--captures.max-per-hour", "100",
                                "--captures.baseline", "false"]).start()
    yield a
    a.stop()


@pytest.fixture(scope="module")
def healthy(agent):
    """The healthy job of each distinct configuration, captured once: {args: (record, samples/s)}."""
    cache: dict[tuple[str, ...], tuple[dict, float]] = {}

    def get(args: tuple[str, ...]) -> tuple[dict, float]:
        if args not in cache:
            cache[args] = capture(agent, f"healthy{len(cache)}", args, warmup=3.0)
        return cache[args]

    return get


@pytest.mark.parametrize("scenario", SCENARIOS, ids=[s.name for s in SCENARIOS])
def test_scenario_is_named_and_compared_with_its_baseline(agent, healthy, scenario):
    base_record, base_rate = healthy(scenario.healthy)
    assert base_record["analysis"]["bottleneck"] == "device", base_record["analysis"]["summary"]
    record, rate = capture(agent, scenario.name, scenario.args, warmup=3.0)
    assert record["status"] == "done", record
    assert record["analysis"]["bottleneck"] == scenario.expected, record["analysis"]["summary"]
    if scenario.args == scenario.healthy:
        return
    assert rate < base_rate, (rate, base_rate)  # the slowdown the case study is about
    result = analyze("--baseline", base_record["directory"], record["directory"])
    comparison = result["comparison"]
    assert comparison["summary"].endswith(f"cause: {scenario.expected}"), comparison["summary"]
    if scenario.grew:
        grew = {d["part"]: d["delta_ms"] for d in comparison["parts"]}[scenario.grew]
        assert grew >= 0.25 * comparison["step_ms"][2], comparison  # a good share of the slowdown
        named = comparison["summary"].split(": ", 1)[1]
        assert named.startswith(f"{grew:+.1f} ms {PART_WORDS[scenario.grew]}"), comparison["summary"]
        assert comparison["ops"] and comparison["ops"][0]["kind"] == "input", comparison["ops"]
    if scenario.expected == "host":
        before, after = comparison["between_steps"]
        assert after - before >= 0.2 and "time between steps" in comparison["summary"], comparison
    if scenario.expected == "small_batch":
        before, after = comparison["ops_busy"]
        assert before >= 0.5 > after and "ops busy" in comparison["summary"], comparison


RECORDED = Path(__file__).parent / "fixtures" / "traces"


@pytest.fixture(scope="module")
def plain(tmp_path_factory):
    """Traces made with TensorFlow's own APIs in a custom loop, one per scenario and a pause between steps:
    recorded once on a quiet machine (``RECORD_TRACES=1`` makes them again), since a loop profiled beside
    other load really is host-bound, whatever its scenario. {scenario: its log directory}."""
    tmp = tmp_path_factory.mktemp("plain")
    logdirs = {}
    for scenario in (*SCENARIOS, PAUSE):
        recorded = RECORDED / f"plain-{scenario.name}.xplane.pb.xz"
        if os.environ.get("RECORD_TRACES"):
            made = next(plain_trace(tmp, scenario, seconds=1.0).glob("**/*.xplane.pb"))
            recorded.parent.mkdir(exist_ok=True)
            recorded.write_bytes(lzma.compress(made.read_bytes(), preset=9 | lzma.PRESET_EXTREME))
        run = tmp / scenario.name / "plugins" / "profile" / "recorded"
        run.mkdir(parents=True)
        (run / "localhost.xplane.pb").write_bytes(lzma.decompress(recorded.read_bytes()))
        logdirs[scenario.name] = tmp / scenario.name
    return logdirs


@pytest.mark.parametrize("scenario", [*SCENARIOS, PAUSE], ids=[s.name for s in (*SCENARIOS, PAUSE)])
def test_traces_made_without_tfprofd_are_named_correctly(plain, scenario):
    result = analyze(str(plain[scenario.name]))
    assert result["bottleneck"] == scenario.expected, result["summary"]


def test_two_traces_in_one_folder_each_get_their_own_answer_and_the_folder_stays_as_it_was(plain, tmp_path):
    folder = tmp_path / "mine"
    folder.mkdir()
    a = next(plain["input_bottleneck"].glob("**/*.xplane.pb"))
    b = next(plain["small_batch"].glob("**/*.xplane.pb"))
    shutil.copy(a, folder / "a.xplane.pb")
    shutil.copy(b, folder / "b.xplane.pb")
    os.chmod(folder, 0o555)  # as for a reader without write access
    try:
        before = sorted(p.name for p in folder.iterdir())
        first = analyze(str(folder / "a.xplane.pb"))
        second = analyze(str(folder / "b.xplane.pb"))
        assert (first["bottleneck"], second["bottleneck"]) == ("input", "small_batch"), (first["summary"],
                                                                                           second["summary"])
        assert first["steps"] != second["steps"]
        assert sorted(p.name for p in folder.iterdir()) == before
    finally:
        os.chmod(folder, 0o755)


def test_every_worker_of_a_multi_worker_capture_is_analysed_and_the_straggler_named(plain, tmp_path):
    run = tmp_path / "job" / "plugins" / "profile" / "2026_11_21_12_00_00"
    run.mkdir(parents=True)
    shutil.copy(next(plain["baseline"].glob("**/*.xplane.pb")), run / "worker-0_6009.xplane.pb")
    start = _window(run / "worker-0_6009.xplane.pb")[0]
    _set_window(next(plain["input_bottleneck"].glob("**/*.xplane.pb")), run / "worker-1_6009.xplane.pb",
                start + 40_000_000)  # traced over one window, as the agent's capture of a job's workers is
    result = analyze(str(tmp_path / "job"))
    assert result["one_window"] and math.isclose(result["window_skew_ms"], 40.0)
    assert sorted(w["host"] for w in result["workers"]) == ["worker-0_6009", "worker-1_6009"]
    assert {w["host"]: w["bottleneck"] for w in result["workers"]} == {"worker-0_6009": "device",
                                                                       "worker-1_6009": "input"}
    straggler = result["straggler"]
    assert straggler["host"] == "worker-1_6009" and straggler["part"] == "between_steps_input", straggler
    assert result["summary"].startswith("straggler: worker worker-1_6009"), result["summary"]


def _window(trace: Path) -> tuple[int, int]:
    """The trace's profiling session (start, stop), Unix ns, from its Task Environment plane."""
    space = xplane_pb2.XSpace.FromString(trace.read_bytes())
    plane = next(p for p in space.planes if p.name == "Task Environment")
    stats = {plane.stat_metadata[st.metadata_id].name: st.int64_value or st.uint64_value for st in plane.stats}
    return stats["profile_start_time"], stats["profile_stop_time"]


def _set_window(trace: Path, out: Path, start: int) -> None:
    """A copy of the trace whose profiling session started at ``start`` (Unix ns), as long as before."""
    space = xplane_pb2.XSpace.FromString(trace.read_bytes())
    plane = next(p for p in space.planes if p.name == "Task Environment")
    names = {i: m.name for i, m in plane.stat_metadata.items()}
    old = {names[st.metadata_id]: st for st in plane.stats}
    length = (old["profile_stop_time"].int64_value or old["profile_stop_time"].uint64_value) - (
        old["profile_start_time"].int64_value or old["profile_start_time"].uint64_value)
    for key, value in (("profile_start_time", start), ("profile_stop_time", start + length)):
        field = "int64_value" if old[key].HasField("int64_value") else "uint64_value"
        setattr(old[key], field, value)
    out.write_bytes(space.SerializeToString())


def test_two_unrelated_traces_in_one_folder_are_separate_sessions_not_one_window(plain, tmp_path):
    run = tmp_path / "mixed" / "plugins" / "profile" / "run"
    run.mkdir(parents=True)
    shutil.copy(next(plain["baseline"].glob("**/*.xplane.pb")), run / "a.xplane.pb")
    start, stop = _window(run / "a.xplane.pb")
    _set_window(next(plain["input_bottleneck"].glob("**/*.xplane.pb")), run / "b.xplane.pb", start + 891_600_000)
    result = analyze(str(tmp_path / "mixed"))
    assert result["one_window"] is False and result["straggler"] is None, result["summary"]
    assert math.isclose(result["window_skew_ms"], 891.6)
    shared = (stop - start - 891_600_000) / (stop - start)  # of the shorter session (a's, 1012 ms)
    assert math.isclose(result["window_overlap"], shared) and 0.11 < shared < 0.13
    text = subprocess.run([sys.executable, "-m", "tfprofd.daemon", "analyze", str(tmp_path / "mixed")],
                          capture_output=True, text=True, timeout=180).stdout
    assert (f"workers: 2 traces from separate sessions, not one window (sessions started 891.6 ms apart, sharing "
            f"{shared:.0%} of the shortest): each analysed on its own, no straggler compared") in text, text
    assert "traced over one window" not in text and "straggler:" not in text


def test_a_faster_incident_is_an_improvement_and_says_what_disappeared(plain):
    result = analyze("--baseline", str(plain["input_bottleneck"]), str(plain["baseline"]))
    comparison = result["comparison"]
    before, after, delta = comparison["step_ms"]
    assert comparison["faster"] and delta < 0
    summary = comparison["summary"]
    cycles = analyze(str(plain["input_bottleneck"]))["cycle_ms"], result["cycle_ms"]  # a step and the time after it
    assert summary.startswith(f"faster than the baseline: step time {before:.1f} → {after:.1f} ms ({delta:+.1f} ms "
                              f"per step), step to step {cycles[0]:.1f} → {cycles[1]:.1f} ms: "), summary
    assert cycles[1] < 0.2 * cycles[0]
    assert summary.endswith("; now: device") and "cause:" not in summary, summary
    gone = {o["name"]: o["before_ms"] for o in comparison["gone"]}
    assert "Iterator::Root::Prefetch::MapAndBatch::Filter" in gone, gone
    assert (f"no longer among the top ops: Iterator::Root::Prefetch::MapAndBatch::Filter "
            f"({gone['Iterator::Root::Prefetch::MapAndBatch::Filter']:.2f} ms per step before)") in summary
    assert all(o["delta_ms"] < 0 for o in comparison["ops"]), comparison["ops"]  # what shrank, not what grew


def test_op_names_that_change_from_run_to_run_are_one_op_in_the_diff(plain):
    """tf.data's pass numbers (ForeverRepeat[28]) and Keras's layer numbers (dense_3, dense_7) are not new ops."""
    base = analyze(str(plain["baseline"]))
    incident = analyze(str(plain["heavy_preprocessing"]))

    def renamed(a: dict, names: dict[str, tuple[str, float]]) -> CaptureAnalysis:
        ops = {"host": [], "device": [], "input": [{"name": n, "ms_per_step": ms, "ms_total": ms, "kernels": []}
                                                   for n, ms in names.values()]}
        lead = {**a, "ops": ops}
        return CaptureAnalysis.from_json({**lead, "workers": [lead]})

    before = renamed(base, {"map": ("Iterator::Root::ForeverRepeat[3]::Map", 5.0),
                            "dense": ("sequential_1/dense_3/MatMul", 2.0)})
    after = renamed(incident, {"map": ("Iterator::Root::ForeverRepeat[28]::Map", 19.21),
                               "map2": ("Iterator::Root::ForeverRepeat[29]::Map", 1.0),
                               "dense": ("sequential_1/dense_7/MatMul", 2.5)})
    comparison = compare(before, after)
    ops = {o.name: (o.before_ms, o.after_ms) for o in comparison.ops}
    assert ops == {"Iterator::Root::ForeverRepeat::Map": (5.0, 20.21), "sequential/dense/MatMul": (2.0, 2.5)}, ops
    assert "Iterator::Root::ForeverRepeat::Map self time ×4 (5.00 → 20.21 ms per step)" in comparison.summary
    assert "new" not in comparison.summary and not comparison.gone, comparison.summary
    # Shorter steps with fewer samples/s (a smaller batch) are no improvement: throughput decides.
    smaller = compare(after, before, rates=(100.0, 80.0), batches=(64.0, 16.0))
    assert not smaller.faster and smaller.summary.startswith("samples/s 100 → 80 (-20%), batch 64 → 16, step time")
    assert smaller.summary.endswith(f"cause: {before.bottleneck}") and smaller.step_ms[2] < 0, smaller.summary
