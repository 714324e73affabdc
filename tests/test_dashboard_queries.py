"""Every panel, annotation and variable query of the Grafana dashboard, run against the real Debian
Prometheus scraping the real agent (simulated GPUs, a Keras job with the hook, one analysed capture)."""

from __future__ import annotations

import json
import re
import shutil
import urllib.parse

import pytest
from fake_kubelet import FakeKubelet

from helpers import (
    ROOT,
    AgentProcess,
    GpuState,
    build_fakenvml,
    gpu,
    hopper,
    http,
    job_reporting,
    mig_hopper,
    start_prometheus,
    start_training,
    wait_capture,
    wait_for,
)

pytestmark = [pytest.mark.tf, pytest.mark.servers]

SUBSTITUTIONS = {"$instance": ".*", "$gpu": ".*", "$training_job": ".*", "$__rate_interval": "1m"}


def substitute(expr: str) -> str:
    for variable, value in SUBSTITUTIONS.items():
        expr = expr.replace(variable, value)
    assert "$" not in expr, expr
    return expr


def dashboard_queries() -> list[tuple[str, str]]:
    board = json.loads((ROOT / "dashboards" / "tfprofd.json").read_text())
    queries = [(f"panel {p['title']!r} {t['refId']}", t["expr"]) for p in board["panels"] for t in p.get("targets", [])]
    queries += [(f"annotation {a['name']!r}", a["expr"]) for a in board["annotations"]["list"] if a.get("expr")]
    for v in board["templating"]["list"]:
        if v["type"] == "query":  # label_values(metric{...}, label): the metric must have that label
            metric, label = re.fullmatch(r"label_values\((.+), (\w+)\)", v["query"]["query"]).groups()
            queries.append((f"variable ${v['name']}", f"count by ({label}) ({metric})"))
    return queries


def test_every_dashboard_query_parses_and_returns_data(tmp_path):
    if not shutil.which("prometheus"):
        pytest.fail("prometheus not found: run `make test`, which installs Debian's packages")
    build_fakenvml()
    state = GpuState(tmp_path / "nvml.json", [hopper(0), mig_hopper(1)])  # GPM for the SM activity panel
    # The shipped rules (for the rules panel) and the real /proc (for utilization ratios, which a static
    # fixture /proc cannot give).
    # A kubelet holding GPU 0 for the job's pod (the pod panels).
    kubelet = FakeKubelet(tmp_path / "kubelet.sock",
                          {"vit-0": ("ml", {"trainer": {"nvidia.com/gpu": [gpu(0)["uuid"]]}})})
    kubelet.__enter__()
    agent = AgentProcess(tmp_path, args=["--captures.duration", "1s", "--captures.baseline-after", "10s",
                                         "--captures.baseline-duration", "500ms", "--collectors.kubernetes.enabled",
                                         "true", "--collectors.kubernetes.socket", str(kubelet.socket_path)],
                         env=state.env(), fixtures=False).start()
    job = start_training(agent.hook_port, "--job", "vit", "--seconds", "200", "--map-delay", "0.0002")
    prometheus = None
    try:
        prometheus, prom_port = start_prometheus(tmp_path, agent.port)
        state.update_gpu(0, processes=[{"pid": job.pid, "used_memory_bytes": 2**30}])
        wait_for(lambda: job_reporting(agent, "vit"), 90, message="the Keras job to report")
        wait_for(lambda: any(c["trigger"] == "baseline" and c["status"] == "done"
                             for c in agent.call("GET", "/captures")[1]["captures"]), 120,
                 message="the job's baseline capture")
        status, answer = agent.call("POST", "/captures", {"job": "vit"})
        assert status == 202, answer
        assert wait_capture(agent, answer["id"], timeout=120)["status"] == "done"

        def failures() -> list[str]:
            found = []
            for name, expr in dashboard_queries():
                url = (f"http://127.0.0.1:{prom_port}/api/v1/query?"
                       + urllib.parse.urlencode({"query": substitute(expr)}))
                status, body = http("GET", url)
                if status != 200 or body.get("status") != "success":
                    found.append(f"{name}: does not parse: {body}")
                elif not body["data"]["result"]:
                    found.append(f"{name}: no data for {substitute(expr)}")
            return found

        # Rates and the capture annotation need a few scrapes after the capture: wait until every query has data.
        try:
            wait_for(lambda: not failures(), 60, 1.0, message="every dashboard query to return data")
        except AssertionError:
            pytest.fail("\n".join(failures()))
    finally:
        job.kill()
        job.wait()
        if prometheus:
            prometheus.stop()
        agent.stop()
        kubelet.__exit__()
