"""Every panel, annotation and variable query of the Grafana dashboard, run against the real Debian
Prometheus scraping the real agent (simulated GPUs, a Keras job with the hook, one analysed capture)."""

from __future__ import annotations

import json
import re
import shutil
import threading
import urllib.parse

import pytest
from fake_kubelet import FakeKubelet

from tfprofd.exporter.hook import Reporter

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

# Queries that return data only where the scenario has it: stragglers (test_step_time_per_worker_...).
NEEDS_A_STRAGGLER = {"panel 'Step time per worker' C", "panel 'GPU busy per worker' C"}
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
                elif not body["data"]["result"] and name not in NEEDS_A_STRAGGLER:
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


def prometheus_query(port: int, expr: str) -> list[dict]:
    status, body = http("GET", f"http://127.0.0.1:{port}/api/v1/query?" + urllib.parse.urlencode({"query": expr}))
    assert status == 200 and body.get("status") == "success", (expr, body)
    return body["data"]["result"]


class Worker:
    """One worker of a job reporting through the real hook (a Reporter) steps of ``seconds`` each."""

    def __init__(self, agent: AgentProcess, job: str, worker: str, seconds: float):
        self.reporter = Reporter(job=job, worker=worker, profiler=False, addr=f"127.0.0.1:{agent.hook_port}",
                                 interval=0.2)
        self.reporter.phase = "train"
        self.reporter.start()
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._steps, args=(seconds,), daemon=True)
        self.thread.start()

    def _steps(self, seconds: float) -> None:
        while not self.stop.wait(0.05):
            self.reporter.record(5, 5 * 32, 5 * seconds)

    def close(self) -> None:
        self.stop.set()
        self.thread.join()
        self.reporter.close()


def test_step_time_per_worker_marks_the_straggler_and_the_alert_names_its_host(tmp_path):
    """A job of three workers on two hosts (agents), worker-1 twice as slow as the others, and a slow job of
    one worker: the panel draws every worker, marks worker-1 alone, and the shipped rules put a
    TfprofdStraggler alert on worker-1's host (pending: it fires after 5 minutes)."""
    board = json.loads((ROOT / "dashboards" / "tfprofd.json").read_text())
    panel = next(p for p in board["panels"] if p["title"] == "Step time per worker")
    expr = {t["refId"]: substitute(t["expr"]) for t in panel["targets"]}
    hosts = []
    for name in ("a", "b"):
        (tmp_path / name).mkdir()
        hosts.append(AgentProcess(tmp_path / name).start())
    workers, prometheus = [], None
    try:
        workers = [Worker(hosts[0], "ring", "worker-0", 0.05), Worker(hosts[1], "ring", "worker-1", 0.1),
                   Worker(hosts[0], "ring", "worker-2", 0.05), Worker(hosts[1], "solo", "worker-0", 0.4)]
        prometheus, port = start_prometheus(tmp_path, [h.port for h in hosts],
                                            rule_files=[ROOT / "prometheus" / "tfprofd-alerts.yaml"])
        straggler_host = f"127.0.0.1:{hosts[1].port}"

        def drawn() -> set[tuple[str, str, str]]:
            return {(r["metric"]["training_job"], r["metric"]["worker"], r["metric"]["instance"])
                    for r in prometheus_query(port, expr["A"])}

        wait_for(lambda: len(drawn()) == 4, 60, 0.5, message="every worker's step time in the panel")
        assert drawn() == {("ring", "worker-0", f"127.0.0.1:{hosts[0].port}"), ("ring", "worker-1", straggler_host),
                           ("ring", "worker-2", f"127.0.0.1:{hosts[0].port}"), ("solo", "worker-0", straggler_host)}
        medians = {r["metric"]["training_job"]: float(r["value"][1]) for r in prometheus_query(port, expr["B"])}
        assert medians == {"ring": pytest.approx(0.05), "solo": pytest.approx(0.4)}
        marked = prometheus_query(port, expr["C"])
        assert [(r["metric"]["training_job"], r["metric"]["worker"], r["metric"]["instance"]) for r in marked] == \
            [("ring", "worker-1", straggler_host)]
        assert float(marked[0]["value"][1]) == pytest.approx(0.1)

        def alerts() -> list[dict[str, str]]:
            return [r["metric"] for r in prometheus_query(port, 'ALERTS{alertname="TfprofdStraggler"}')]

        wait_for(lambda: alerts(), 30, 0.5, message="the straggler alert (pending)")
        assert alerts() == [{"__name__": "ALERTS", "alertname": "TfprofdStraggler", "alertstate": "pending",
                             "severity": "warning", "job": "tfprofd", "instance": straggler_host,
                             "training_job": "ring", "worker": "worker-1"}]
    finally:
        for worker in workers:
            worker.close()
        if prometheus:
            prometheus.stop()
        for host in hosts:
            host.stop()
