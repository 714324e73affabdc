"""The Alertmanager path with the real Debian prometheus and prometheus-alertmanager on loopback.

Prometheus scrapes the agent and evaluates the shipped alert rules; Alertmanager posts to the agent's
webhook; the agent captures the training job. A repeated notification does not capture twice.
"""

from __future__ import annotations

import shutil

import pytest

from helpers import (
    ROOT,
    AgentProcess,
    GpuState,
    Server,
    build_fakenvml,
    free_port,
    gpu,
    job_reporting,
    start_prometheus,
    start_training,
    wait_capture,
    wait_for,
)

pytestmark = [pytest.mark.tf, pytest.mark.servers]

AGENT_RULES = """
rules:
  - name: low_gpu_utilization
    description: test copy of the shipped rule with a short for; the alert captures, not the rule
    signal: gpu_utilization
    below: 0.5
    for: 2s
    capture: false
"""


def test_alert_from_prometheus_through_alertmanager_captures_once(tmp_path):
    for binary in ("prometheus", "prometheus-alertmanager"):
        if not shutil.which(binary):
            pytest.fail(f"{binary} not found: run `make test`, which installs Debian's packages")
    build_fakenvml()
    state = GpuState(tmp_path / "nvml.json", [gpu(0)])
    config = tmp_path / "tfprofd.yaml"
    config.write_text(AGENT_RULES)
    agent = AgentProcess(tmp_path, args=["--config", str(config), "--alerts.host-value", "127.0.0.1",
                                         "--captures.duration", "1s"], env=state.env()).start()
    am_port = free_port()
    (tmp_path / "alertmanager.yml").write_text(f"""
route:
  receiver: tfprofd
  group_by: [alertname, instance, gpu]
  group_wait: 1s
  group_interval: 2s
  repeat_interval: 3s
receivers:
  - name: tfprofd
    webhook_configs:
      - url: http://127.0.0.1:{agent.api_port}/api/v1/alerts
        send_resolved: true
        http_config:
          authorization:
            credentials_file: {tmp_path / "state" / "api.token"}
""")
    servers = []
    job = start_training(agent.hook_port, "--job", "bert", "--seconds", "300", "--map-delay", "0.0002")
    try:
        servers.append(Server(["prometheus-alertmanager", f"--config.file={tmp_path / 'alertmanager.yml'}",
                               f"--storage.path={tmp_path / 'am'}", f"--web.listen-address=127.0.0.1:{am_port}",
                               "--cluster.listen-address="],
                              f"http://127.0.0.1:{am_port}/-/ready", tmp_path / "alertmanager.log"))
        servers.append(start_prometheus(tmp_path, agent.port, [ROOT / "prometheus" / "tfprofd-alerts.yaml"],
                                        am_port)[0])
        state.update_gpu(0, processes=[{"pid": job.pid, "used_memory_bytes": 2**30}])
        wait_for(lambda: job_reporting(agent, "bert"), 90, message="the Keras job to report")
        state.update_gpu(0, utilization_gpu=10)

        def alert_capture():
            captures = agent.call("GET", "/captures")[1]["captures"]
            return next((c for c in captures if c["trigger"] == "alert"), None)

        record = wait_for(alert_capture, 60, 0.5, message="a capture triggered by Alertmanager")
        assert record["alert"] == "TfprofdGpuUnderutilized" and record["gpu"] == "0" and record["job"] == "bert"
        assert wait_capture(agent, record["id"])["status"] == "done"
        # Alertmanager repeats the notification every 3 s while the alert fires: no second capture.
        wait_for(lambda: agent.log().count("alert TfprofdGpuUnderutilized already handled") >= 2, 30, 0.5,
                 message="repeated notifications")
        captures = agent.call("GET", "/captures")[1]["captures"]
        assert [c["trigger"] for c in captures] == ["alert"], captures
    finally:
        job.kill()
        job.wait()
        for server in servers:
            server.stop()
        agent.stop()
