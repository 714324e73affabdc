"""The analysis on a real GPU trace (tests/fixtures/traces/v100-bert-mirrored.xplane.pb.xz: BERT fine-tuning
under MirroredStrategy on 8 × V100, from the public tensorflow/profiler repository; provenance in
tests/fixtures/traces/README.md): coherent numbers, device ops with their kernels, a verdict with its
numbers and the strength of its evidence, each GPU's own results, and why it differs from xprof's own
conclusion."""

from __future__ import annotations

import json
import lzma
import math
import shutil
import subprocess
import sys
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from tfprofd.daemon.analysis import CaptureAnalysis, WorkerAnalysis, report
from tfprofd.daemon.analysis.classify import conclude
from tfprofd.daemon.protos import xplane_pb2

from helpers import FIXTURES

RECORDED = FIXTURES / "traces" / "v100-bert-mirrored.xplane.pb.xz"


def analyze(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "tfprofd.daemon", "analyze", *args], capture_output=True, text=True,
                          timeout=180)


@pytest.fixture(scope="module")
def trace_dir(tmp_path_factory) -> Path:
    """The trace in the layout TensorBoard writes (``plugins/profile/<run>/<host>.xplane.pb``)."""
    run = tmp_path_factory.mktemp("v100") / "plugins" / "profile" / "2020_12_23_demo"
    run.mkdir(parents=True)
    (run / "34.83.195.179_6003.xplane.pb").write_bytes(lzma.decompress(RECORDED.read_bytes()))
    return run.parent.parent.parent


@pytest.fixture(scope="module")
def v100(trace_dir) -> dict:
    result = analyze(str(trace_dir), "--json")
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout)


def test_the_real_gpu_trace_gives_a_coherent_step(v100):
    assert v100["hardware"] == "GPU" and v100["steps"] == 1
    step = v100["step_time_ms"]["mean"]
    assert math.isclose(step, 21.31, abs_tol=0.05)
    # The parts of the step add up to the step, and their shares to 100%.
    assert math.isclose(sum(v100["breakdown_ms"].values()), step, rel_tol=1e-6)
    assert math.isclose(sum(v100["breakdown"].values()), 1.0, rel_tol=1e-6)
    assert math.isclose(v100["breakdown"]["device_compute"], 0.698, abs_tol=0.01)
    assert v100["breakdown"]["host_to_device"] == 0 and v100["breakdown"]["input_wait"] == 0
    # Device idle is what the device parts leave of the step: 30%, not 100% beside 70% compute.
    device = sum(v100["breakdown"][p] for p in ("device_compute", "device_to_device", "device_collectives",
                                                "host_to_device", "output"))
    assert math.isclose(v100["ratios"]["device_idle"], 1 - device, abs_tol=1e-9)
    assert math.isclose(v100["ratios"]["device_idle"], 0.302, abs_tol=0.01)
    assert v100["ratios"]["between_steps"] is None  # one step: not measurable, and said so
    assert v100["ratios"]["steps_cover"] < 0.02


def test_device_ops_carry_their_kernels(v100):
    ops = {o["name"]: o for o in v100["ops"]["device"]}
    assert {"Cast", "RandomUniform", "GreaterEqual", "Mul"} <= set(ops)
    assert all(o["kernels"] for o in ops.values())
    assert ops["RandomUniform"]["kernels"][0]["kernel"].startswith("void tensorflow::functor::FillPhiloxRandom")
    assert math.isclose(sum(o["ms_total"] for o in ops.values()), 29.7, abs_tol=0.5)  # ~14.9 ms on each of 2 GPUs
    assert v100["copies_ms"]["H2D"] > 0 and v100["copies_ms"]["D2H"] > 0


def test_the_verdict_names_launch_bound_with_its_numbers_and_says_why_it_differs_from_xprof(v100):
    # The GPU idles 30% of the step, but not in untraced host time: the thread launching GPU:6's kernels runs
    # through the step, launching 665 kernels of ~22 µs each. gpu_private is set (its threads are in the trace).
    assert v100["bottleneck"] == "host"
    summary = v100["summary"]
    assert ("launch-bound: the thread launching GPU:6's kernels (tf_gpu_private_6) runs 86% of each 21.3 ms step "
            "to launch 665 kernels of 22 µs each on average, so the GPU computes 70% (14.9 ms) and waits 30% "
            "(6.4 ms) for the next kernel (TF_GPU_THREAD_MODE=gpu_private is already set") in summary, summary
    assert "untraced host time" not in summary
    assert v100["launch"]["gpu_private"] and v100["launch"]["kernels_per_step"] == 665
    assert "POTENTIALLY input-bound" in v100["xprof_conclusion"]
    assert "no wait for input" in v100["xprof_differs"] and "input wait 0.0 ms" in v100["xprof_differs"]


def test_one_step_in_a_long_capture_is_too_little_to_conclude(v100):
    evidence = v100["evidence"]
    assert evidence["steps"] == 1 and not evidence["sufficient"] and evidence["span_share"] < 0.01
    assert "host (too little to conclude from 1 step spanning 1% of a 2.65 s capture): launch-bound" in v100["summary"]
    assert v100["recommendation"].startswith("Too little to conclude from 1 step spanning 1% of a 2.65 s capture: "
                                             "capture again for longer"), v100["recommendation"]
    assert "TF_GPU_THREAD_MODE" not in v100["recommendation"] and "XLA" not in v100["recommendation"]


def test_with_enough_steps_the_launch_bound_advice_leaves_out_what_is_set(v100):
    worker = WorkerAnalysis.from_json(v100)
    enough = replace(worker, evidence=replace(worker.evidence, steps=50, span_share=0.9, sufficient=True))
    verdict, summary = conclude(enough)
    assert verdict.kind == "host" and summary.startswith("host: launch-bound")
    assert "jit_compile=True" in verdict.recommendation and "Set TF_GPU_THREAD_MODE" not in verdict.recommendation
    private_unset = replace(enough, launch=replace(enough.launch, gpu_private=False))
    assert "Set TF_GPU_THREAD_MODE=gpu_private" in conclude(private_unset)[0].recommendation


def test_each_gpu_is_reported_and_the_idle_ones_named(v100):
    devices = {d["name"]: d for d in v100["devices"]}
    assert sorted(devices) == [f"GPU:{i}" for i in range(8)]
    assert math.isclose(devices["GPU:4"]["step_ms"], 19.87, abs_tol=0.01)
    assert math.isclose(devices["GPU:6"]["step_ms"], 21.31, abs_tol=0.01)
    assert math.isclose(devices["GPU:4"]["busy"], 0.746, abs_tol=0.005)
    assert math.isclose(devices["GPU:6"]["idle"], 0.302, abs_tol=0.005)
    assert devices["GPU:4"]["kernels"] == devices["GPU:6"]["kernels"] == 665
    assert v100["idle_devices"] == ["GPU:0", "GPU:1", "GPU:2", "GPU:3", "GPU:5", "GPU:7"]
    assert v100["straggling_device"] is None
    assert v100["devices_summary"] == (
        "8 GPUs, 2 ran kernels: GPU:6 21.3 ms per step (1 step; kernels busy 70%, idle 30%; copies D2H 0.0 ms, "
        "H2D 0.2 ms), GPU:4 19.9 ms per step (1 step; kernels busy 75%, idle 25%; copies D2H 0.0 ms, H2D 0.2 ms); "
        "idle (no kernels): GPU:0, GPU:1 (copies only), GPU:2, GPU:3, GPU:5, GPU:7; no straggling GPU (GPU:6's steps "
        "are 7% longer than the others' 19.9 ms, under 10%)")
    assert v100["summary"].endswith("; 6 of 8 GPUs ran no kernels (GPU:0, GPU:1, GPU:2, GPU:3, GPU:5, GPU:7)")
    assert f"GPUs: {v100['devices_summary']}" in report(CaptureAnalysis.from_json(v100)).splitlines()


def _edited(trace: Path, out: Path) -> Path:
    """The V100 trace with GPU:6's step 30 ms long, its device-to-host copies made device-to-device copies on
    a stream line that also computes, and its Mul and GreaterEqual ops named as junk rows are."""
    space = xplane_pb2.XSpace.FromString(trace.read_bytes())
    for plane in space.planes:
        if plane.name != "/device:GPU:6":
            continue
        for meta in plane.event_metadata.values():
            if meta.name == "MemcpyD2H":
                meta.name = "MemcpyD2D"
            elif meta.name.split("#")[0].endswith(":Mul"):
                meta.name = "dummy"
            elif meta.name.split("#")[0].endswith(":GreaterEqual"):
                meta.name = "(null)"
        for line in plane.lines:
            if line.name == "Stream #144(MemcpyD2H)":
                line.name = line.display_name = "Stream #144(Compute,MemcpyH2D,MemcpyD2D)"
            if line.name == "Steps":
                line.events[0].duration_ps = 30_000_000_000
    out.write_bytes(space.SerializeToString())
    return out


def test_a_straggling_gpu_device_copies_and_junk_rows(trace_dir, tmp_path):
    edited = _edited(next(trace_dir.glob("**/*.xplane.pb")), tmp_path / "edited.xplane.pb")
    result = analyze(str(edited), "--json")
    assert result.returncode == 0, result.stderr
    a = json.loads(result.stdout)
    assert a["straggling_device"] == "GPU:6"
    assert "GPU:6 straggles: 30.0 ms per step against 19.9 ms on the others (+51%)" in a["devices_summary"]
    gpu6 = next(d for d in a["devices"] if d["name"] == "GPU:6")
    assert set(gpu6["copies_ms"]) == {"D2D", "H2D"} and math.isclose(gpu6["copies_ms"]["D2D"], 0.04, abs_tol=0.01)
    assert "D2D" in a["copies_ms"] and "other" not in a["copies_ms"]
    names = [o["name"] for kind in ("input", "host", "device") for o in a["ops"][kind]]
    assert not {"dummy", "(null)"} & set(names), names
    assert {"Cast", "RandomUniform", "Mul"} <= set(names)  # GPU:4 still runs its Mul ops


def test_the_report_reads_well_and_xprof_stays_quiet(trace_dir, tmp_path):
    alone = tmp_path / "just-a-file.xplane.pb"  # a standalone trace, outside any plugins/profile layout
    shutil.copy(next(trace_dir.glob("**/*.xplane.pb")), alone)
    result = analyze(str(alone))
    assert result.returncode == 0, result.stderr
    assert result.stderr == "", result.stderr[:500]  # xprof's C++ log lines go nowhere without --verbose
    lines = result.stdout.splitlines()
    assert lines[0] == "bottleneck: host"
    assert "step breakdown (parts of the step, adding up to it):" in lines
    assert "other ratios (not parts of the step):" in lines
    assert not any(line.startswith("open in the viewer") for line in lines)
    verbose = analyze(str(alone), "--verbose")
    assert "I0000" in verbose.stderr or "W0000" in verbose.stderr or "E0000" in verbose.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["just-a-file.xplane.pb"]  # nothing written beside it


def test_report_takes_an_analysis_of_a_standalone_trace(v100):
    moved = {**v100, "trace": "/tmp/x.xplane.pb", "workers": [{**w, "trace": "/tmp/x.xplane.pb"}
                                                                 for w in v100["workers"]]}
    text = report(CaptureAnalysis.from_json(moved))
    assert "bottleneck: host" in text and "open in the viewer" not in text
    assert Path(v100["trace"]).name in report(CaptureAnalysis.from_json(v100))


def h100(name: str, tmp_path: Path, edit: Callable[[Any, Any], None] | None = None) -> dict:
    """One of the JAX traces captured by the agent on an H100 (tests/fixtures/traces/README.md), analysed;
    ``edit(plane, line)`` changes its host plane's Python thread first."""
    path = tmp_path / f"h100-jax-mlp-{name}.xplane.pb"
    data = lzma.decompress((FIXTURES / "traces" / f"{path.name}.xz").read_bytes())
    if edit is not None:
        space = xplane_pb2.XSpace.FromString(data)
        plane = next(p for p in space.planes if p.name == "/host:CPU")
        edit(plane, next(line for line in plane.lines if line.name == "python3"))
        data = space.SerializeToString()
    path.write_bytes(data)
    result = analyze(str(path), "--json")
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout)


def markers(plane, line) -> list:
    return [e for e in line.events if plane.event_metadata[e.metadata_id].name == "train"]


def add_edge_marker(plane, line) -> None:
    """One more step marker before the first, as a capture that begins inside a step has (xprof leaves such a
    marker out of its steps)."""
    first = markers(plane, line)[0]
    edge = xplane_pb2.XEvent()
    edge.CopyFrom(first)
    edge.offset_ps, edge.duration_ps = 5_000_000_000, 9_000_000_000  # 5 ms in, 9 ms long
    for stat in edge.stats:
        if plane.stat_metadata[stat.metadata_id].name == "step_num":
            stat.int64_value -= 1
    events = sorted([*line.events, edge], key=lambda e: e.offset_ps)
    del line.events[:]
    line.events.extend(events)


@pytest.mark.parametrize("edge_marker", [False, True], ids=["markers_as_steps", "one_marker_more"])
def test_steps_on_an_h100_with_their_input_made_between_them_are_their_markers_and_the_rest_is_between(
        tmp_path, edge_marker):
    """Each 14 ms step marker waits for its batch's copy and computes 4.8 ms; NumPy makes the next batch in the
    636 ms after it. xprof stretches its GPU steps from one step's device start to the next (650, 652, 3.8 ms):
    taken as they were, the steps were 435 ms and the time between them 12.8 s in a 1.3 s capture. Its steps
    are matched to the markers they begin in, so a marker it leaves out changes nothing."""
    a = h100("input", tmp_path, add_edge_marker if edge_marker else None)
    assert a["hardware"] == "GPU" and a["steps"] == 3
    step = a["step_time_ms"]
    assert math.isclose(step["mean"], 14.43, abs_tol=0.05) and step["max"] < 15, step
    assert math.isclose(sum(a["breakdown_ms"].values()), step["mean"], rel_tol=1e-6)
    assert math.isclose(a["breakdown_ms"]["device_compute"], 4.82, abs_tol=0.05)
    assert math.isclose(a["cycle_ms"], 650.4, abs_tol=0.5)  # start to start, as the hook's own step time
    assert math.isclose(step["mean"] + sum(a["between_ms"].values()), a["cycle_ms"], rel_tol=1e-9)
    assert a["bottleneck"] == "host" and "636.0 ms after each" in a["why"] and "steps take 14.4 ms" in a["why"]


def test_steps_on_an_h100_with_their_batch_on_the_gpu_are_compute_bound(tmp_path):
    """xprof's GPU step is the device's 4.17 ms; between one and the next the GPU waits 0.67 ms for the host to
    dispatch the next step (the markers hold that wait, so they leave almost nothing between them)."""
    a = h100("compute", tmp_path)
    assert a["hardware"] == "GPU" and a["steps"] == 410
    assert math.isclose(a["step_time_ms"]["mean"], 4.17, abs_tol=0.05)
    assert a["breakdown"]["device_compute"] > 0.95 and a["ratios"]["between_steps"] < 0.05
    assert math.isclose(a["cycle_ms"], a["capture_seconds"] * 1000 / a["steps"], rel_tol=0.03)
    assert math.isclose(a["step_time_ms"]["mean"] + sum(a["between_ms"].values()), a["cycle_ms"], rel_tol=1e-9)
    assert a["bottleneck"] == "device" and "compute-bound" in a["why"]


def test_step_markers_of_no_length_give_a_clear_unknown_not_a_crash(tmp_path):
    """Markers that last nothing time no step: the analysis says there are no steps to measure."""
    def no_length(plane, line) -> None:
        for event in markers(plane, line):
            event.duration_ps = 0

    a = h100("input", tmp_path, no_length)
    assert a["bottleneck"] == "unknown" and "step time cannot be measured" in a["why"], a["why"]
    assert "step_time_ms" not in a and a["steps"] == 0
