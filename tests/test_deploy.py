"""Deployment artefacts checked with the real tools: promtool, amtool, systemd-analyze, Grafana's SDK and
pip (the Helm chart has its own tests in test_helm.py)."""

from __future__ import annotations

import json
import re
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from helpers import ROOT

PROMETHEUS = ROOT / "prometheus"
CHART = ROOT / "helm" / "tfprofd"


def tool(name: str) -> str:
    path = shutil.which(name)
    if not path:
        pytest.fail(f"{name} not found: run `make test`, which installs Debian's packages")
    return path


def run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(args, capture_output=True, text=True, timeout=120)


def test_committed_dashboard_is_what_the_builder_makes():
    result = run(sys.executable, str(ROOT / "dashboards" / "build.py"), "--check")
    assert result.returncode == 0, result.stderr


def test_dashboard_is_modern_and_every_panel_has_a_unit():
    board = json.loads((ROOT / "dashboards" / "tfprofd.json").read_text())
    assert board["schemaVersion"] >= 39
    assert {v["name"] for v in board["templating"]["list"]} == {"datasource", "instance", "gpu", "training_job"}
    panels = [p for p in board["panels"] if p["type"] != "row"]
    assert {p["type"] for p in panels} <= {"timeseries", "table", "stat", "barchart"}
    for panel in panels:
        assert panel["fieldConfig"]["defaults"].get("unit"), panel["title"]
        assert set(panel["gridPos"]) == {"h", "w", "x", "y"}, panel["title"]
        assert all(t["refId"] for t in panel["targets"]), panel["title"]
    assert any(a.get("name") == "Captures" for a in board["annotations"]["list"])


def test_alert_rules_pass_promtool_check_and_unit_tests():
    promtool = tool("promtool")
    check = run(promtool, "check", "rules", str(PROMETHEUS / "tfprofd-alerts.yaml"))
    assert check.returncode == 0 and "SUCCESS: 16 rules found" in check.stdout, check.stdout + check.stderr
    tests = run(promtool, "test", "rules", str(PROMETHEUS / "tfprofd-alerts.test.yaml"))
    assert tests.returncode == 0 and "SUCCESS" in tests.stdout, tests.stdout + tests.stderr


def test_every_alert_has_a_firing_and_a_quiet_case():
    rules = [r for g in yaml.safe_load((PROMETHEUS / "tfprofd-alerts.yaml").read_text())["groups"] for r in g["rules"]]
    cases = [c for t in yaml.safe_load((PROMETHEUS / "tfprofd-alerts.test.yaml").read_text())["tests"]
             for c in t.get("alert_rule_test", [])]
    for rule in (r for r in rules if "alert" in r):
        mine = [c for c in cases if c["alertname"] == rule["alert"]]
        assert any(c["exp_alerts"] for c in mine) and any(not c["exp_alerts"] for c in mine), rule["alert"]
        assert {"summary", "description"} <= set(rule["annotations"]), rule["alert"]


def test_the_dashboard_marks_stragglers_at_the_alerts_threshold():
    rules = [r for g in yaml.safe_load((PROMETHEUS / "tfprofd-alerts.yaml").read_text())["groups"] for r in g["rules"]]
    expr = next(r["expr"] for r in rules if r.get("alert") == "TfprofdStraggler")
    assert expr.split(" or ")[0] == "tfprofd:training_step_seconds:ratio_to_job_median5m - 1 >= 0.2", expr  # 1.2x
    board = json.loads((ROOT / "dashboards" / "tfprofd.json").read_text())
    panel = next(p for p in board["panels"] if p["title"] == "Step time per worker")
    marked = next(t["expr"] for t in panel["targets"] if t["refId"] == "C")
    assert ">= 1.2)" in marked, marked
    # The GPU signal (synchronous jobs): 0.2 under the job's median worker, in the alert and in its panel.
    assert expr.split(" or ")[1] == "tfprofd:training_worker_gpu_utilization:below_job_median5m >= 0.2", expr
    panel = next(p for p in board["panels"] if p["title"] == "GPU busy per worker")
    marked = next(t["expr"] for t in panel["targets"] if t["refId"] == "C")
    assert ">= 0.2)" in marked, marked


def test_example_alertmanager_config_passes_amtool():
    result = run(tool("amtool"), "check-config", str(PROMETHEUS / "alertmanager-example.yml"))
    assert result.returncode == 0 and "SUCCESS" in result.stdout, result.stdout + result.stderr


@pytest.mark.parametrize("alert", ["TfprofdGpuUnderutilized", "TfprofdThroughputDrop", "TfprofdStraggler"])
def test_example_alertmanager_config_sends_the_slowdown_alerts_to_the_agents(alert):
    result = run(tool("amtool"), "config", "routes", "test", f"--config.file={PROMETHEUS / 'alertmanager-example.yml'}",
                 f"alertname={alert}", "instance=gpu-node-2:9847", "training_job=bert", "worker=worker-1")
    assert result.returncode == 0 and result.stdout.split() == ["tfprofd-capture"], result.stdout + result.stderr


def test_example_prometheus_config_passes_promtool_and_gives_the_alerts_their_job():
    config = PROMETHEUS / "prometheus-example.yml"
    result = run(tool("promtool"), "check", "config", str(config))
    assert result.returncode == 0 and "SUCCESS: 16 rules found" in result.stdout, result.stdout + result.stderr
    example = yaml.safe_load(config.read_text())
    jobs = {c["job_name"]: c for c in example["scrape_configs"]}
    rules = [r for g in yaml.safe_load((PROMETHEUS / "tfprofd-alerts.yaml").read_text())["groups"] for r in g["rules"]]
    selected = {job for r in rules for job in re.findall(r'\bjob="([^"]+)"', r["expr"])}
    assert selected == {"tfprofd"} and selected <= set(jobs), (selected, set(jobs))
    # The Alertmanager example posts to the control API of exactly the hosts this job scrapes.
    scraped = {t for c in jobs["tfprofd"]["static_configs"] for t in c["targets"]}
    receivers = yaml.safe_load((PROMETHEUS / "alertmanager-example.yml").read_text())["receivers"]
    hooks = {w["url"] for r in receivers for w in r.get("webhook_configs", [])}
    assert {t.replace(":9847", ":9848") for t in scraped} == {u.split("/")[2] for u in hooks}, (scraped, hooks)


def test_systemd_unit_passes_systemd_analyze_verify(tmp_path):
    unit = (ROOT / "systemd" / "tfprofd.service").read_text()
    assert "EnvironmentFile=-/etc/default/tfprofd" in unit and "User=tfprofd" in unit
    for option in ("NoNewPrivileges=yes", "ProtectSystem=strict", "ProtectHome=yes", "PrivateTmp=yes",
                   "DeviceAllow=/dev/nvidiactl rw", "Restart=on-failure", "StateDirectoryMode=2750",
                   "RestrictSUIDSGID=yes", "LimitNOFILE=", "RuntimeDirectory=tfprofd",
                   "TFPROFD_HOOK_SOCKET=/run/tfprofd/hook.sock"):
        assert option in unit, option
    assert "DIR_MODE" not in unit  # the agent never needs a setgid chmod, so nothing asks for one
    # The unit runs /opt/tfprofd/bin/tfprofd (README's install); verify it against this checkout's tfprofd.
    installed = shutil.which("tfprofd", path=str(Path(sys.executable).parent))
    copy = tmp_path / "tfprofd.service"
    copy.write_text(unit.replace("/opt/tfprofd/bin/tfprofd", installed))
    result = run(tool("systemd-analyze"), "verify", str(copy))
    assert result.returncode == 0, result.stdout + result.stderr
    assert result.stderr.strip() == "", result.stderr


def test_systemd_unit_exposure_stays_as_low_as_recorded(tmp_path):
    """`systemd-analyze security` rates the unit 1.7 (README, Security); a change that loosens it fails here."""
    copy = tmp_path / "tfprofd.service"
    copy.write_text((ROOT / "systemd" / "tfprofd.service").read_text())
    result = run(tool("systemd-analyze"), "security", "--offline=yes", "--threshold=17", str(copy))
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr
    assert "Overall exposure level for tfprofd.service: 1.7" in result.stdout, result.stdout[-300:]


def test_the_hook_installs_alone_without_the_agents_dependencies(tmp_path):
    wheels = tmp_path / "wheels"
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--quiet", "--disable-pip-version-check",
                    "-w", str(wheels), str(ROOT)], check=True, capture_output=True, timeout=300)
    venv = tmp_path / "training-env"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=120)
    python = venv / "bin" / "python"
    # No index to fetch from: the install fails if the distribution needs anything but itself.
    subprocess.run([sys.executable, "-m", "pip", "--python", str(python), "install", "--quiet", "--no-index",
                    "--disable-pip-version-check", *map(str, wheels.glob("*.whl"))], check=True, timeout=300)
    site = next((venv / "lib").glob("python3*/site-packages"))
    installed = sorted(p.name.split("-")[0] for p in site.glob("*.dist-info"))
    assert installed == ["tfprofd"], installed
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as agent:
        agent.bind(("127.0.0.1", 0))
        agent.settimeout(30)
        code = ("from tfprofd.exporter.hook import Reporter; "
                f"r = Reporter(job='alone', profiler=False, addr='127.0.0.1:{agent.getsockname()[1]}'); "
                "r.record(1, 32, 0.01); assert r.flush()")
        subprocess.run([str(python), "-c", code], check=True, timeout=60)
        assert json.loads(agent.recv(65536))["samples"] == 32
    run_agent = subprocess.run([str(venv / "bin" / "tfprofd"), "run"], capture_output=True, text=True, timeout=60)
    assert run_agent.returncode == 2 and "pip install 'tfprofd[agent]'" in run_agent.stderr, run_agent.stderr
    # The capture client needs nothing but the standard library; the callback says in one line what it needs.
    with socket.socket() as closed:
        closed.bind(("127.0.0.1", 0))
        api = f"http://127.0.0.1:{closed.getsockname()[1]}"
        capture = subprocess.run([str(venv / "bin" / "tfprofd"), "capture", "--api", api], capture_output=True,
                                 text=True, timeout=60)
    assert capture.returncode == 1 and capture.stderr.startswith(f"tfprofd: cannot reach the agent at {api}"), \
        capture.stderr
    callback = subprocess.run([str(python), "-c", "from tfprofd.exporter.hook import TfprofdCallback"],
                              capture_output=True, text=True, timeout=60)
    assert callback.stderr.splitlines()[-1].startswith("ImportError: TfprofdCallback needs Keras"), callback.stderr
    assert "During handling of the above exception" not in callback.stderr
