"""The seed's case studies reproduced on CPU: tfprofd must name each bottleneck, say what changed against the
job's healthy baseline, and do the same on traces made without tfprofd (TensorFlow's own profiler APIs).

Record the traces made without tfprofd again after a change to how they are made with
``RECORD_TRACES=1 .venv/bin/pytest tests/test_scenarios.py`` on a quiet machine."""

from __future__ import annotations

import json
import lzma
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tfprofd.daemon.analysis import PART_WORDS

from helpers import AgentProcess
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


def analyze(*args: str) -> dict:
    result = subprocess.run([sys.executable, "-m", "tfprofd.daemon", "analyze", "--json", *args], capture_output=True,
                            text=True, timeout=300)
    assert result.returncode == 0, result.stdout + result.stderr
    return json.loads(result.stdout)


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
    shutil.copy(next(plain["input_bottleneck"].glob("**/*.xplane.pb")), run / "worker-1_6009.xplane.pb")
    result = analyze(str(tmp_path / "job"))
    assert sorted(w["host"] for w in result["workers"]) == ["worker-0_6009", "worker-1_6009"]
    assert {w["host"]: w["bottleneck"] for w in result["workers"]} == {"worker-0_6009": "device",
                                                                       "worker-1_6009": "input"}
    straggler = result["straggler"]
    assert straggler["host"] == "worker-1_6009" and straggler["part"] == "between_steps_input", straggler
    assert result["summary"].startswith("straggler: worker worker-1_6009"), result["summary"]
