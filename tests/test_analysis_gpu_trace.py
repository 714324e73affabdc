"""The analysis on a real GPU trace (tests/fixtures/traces/v100-bert-mirrored.xplane.pb.xz: BERT fine-tuning
under MirroredStrategy on 8 × V100, from the public tensorflow/profiler repository; provenance in
tests/fixtures/traces/README.md): coherent numbers, device ops with their kernels, a verdict with its
numbers, and why it differs from xprof's own conclusion."""

from __future__ import annotations

import json
import lzma
import math
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tfprofd.daemon.analysis import CaptureAnalysis, report

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


def test_the_verdict_has_its_numbers_and_says_why_it_differs_from_xprof(v100):
    assert v100["bottleneck"] == "host"
    assert "30% of each 21.3 ms step (6.4 ms)" in v100["summary"] and "computes 70% (14.9 ms)" in v100["summary"]
    assert "POTENTIALLY input-bound" in v100["xprof_conclusion"]
    assert "no wait for input" in v100["xprof_differs"] and "input wait 0.0 ms" in v100["xprof_differs"]


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
