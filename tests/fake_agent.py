"""A lightweight stand-in for another host's agent: it speaks the peer side of the control API
(``GET /api/v1/peer``, ``POST /api/v1/captures`` with ``start_at_ns``, ``GET /api/v1/captures/<id>``) and
answers with capture records shaped as a real agent's, for fault tests and the job-capture benchmark."""

from __future__ import annotations

import json
import secrets
import threading
import time
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

PARTS = ("input_wait", "host_to_device", "device_compute", "device_collectives", "host_compute", "other")


@dataclass
class FakeWorker:
    name: str
    step_ms: float = 10.0
    input_wait_ms: float = 1.0
    collectives_ms: float = 0.0  # waiting in the all-reduce (a synchronous job's healthy workers)
    ops: tuple[tuple[str, str, float], ...] = ()  # (kind, name, self time per step in ms): its top ops


@dataclass
class FakeAgent:
    host: str
    port: int
    token: str
    workers: list[FakeWorker] = field(default_factory=list)
    answer_delay: float = 0.0  # seconds before answering a capture request (a late peer)
    outcome: str = "done"  # the capture's final status; "died": the job ended mid-capture
    asked: list[tuple[float, int]] = field(default_factory=list)  # (when asked, start_at_ns)
    triggers: list[str] = field(default_factory=list)  # the trigger each capture was asked with
    connections: int = 0

    def start(self) -> FakeAgent:
        agent = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args: Any) -> None:
                pass

            def _answer(self, status: int, body: dict[str, Any]) -> None:
                data = json.dumps(body).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def _allowed(self) -> bool:
                agent.connections += 1
                if self.headers.get("Authorization", "") != f"Bearer {agent.token}":
                    self._answer(401, {"error": "missing or wrong bearer token"})
                    return False
                return True

            def do_GET(self) -> None:
                if not self._allowed():
                    return
                if self.path == "/api/v1/peer":
                    self._answer(200, {"agent": f"fake-{agent.host}:{agent.port}", "time_ns": time.time_ns()})
                elif self.path.startswith("/api/v1/captures/"):
                    record = agent.records.get(self.path.rsplit("/", 1)[1])
                    self._answer(200, record) if record else self._answer(404, {"error": "no such capture"})
                else:
                    self._answer(404, {"error": "not found"})

            def do_POST(self) -> None:
                if not self._allowed():
                    return
                body = json.loads(self.rfile.read(int(self.headers.get("Content-Length", "0"))) or b"{}")
                if not agent.workers:  # as a real agent answers (api.http_error): a program reads the code
                    self._answer(404, {"error": f"no training job {body.get('job')!r} is reporting",
                                       "code": "no_training_job"})
                    return
                agent.asked.append((time.time(), int(body.get("start_at_ns", 0))))
                agent.triggers.append(str(body.get("trigger", "manual")))
                time.sleep(agent.answer_delay)
                record = agent.record(str(body.get("job")), int(body.get("start_at_ns", time.time_ns())))
                agent.records[record["id"]] = record
                self._answer(202, {"id": record["id"], "status": record["status"], "job": record["job"]})

        self.records: dict[str, dict[str, Any]] = {}
        self.server = ThreadingHTTPServer((self.host, self.port), Handler)
        self.server.daemon_threads = True
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()
        return self

    def record(self, job: str, start_ns: int) -> dict[str, Any]:
        """The capture record a real agent ends with: per worker its trace, window and parts of the step."""
        capture_id = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime()) + "-" + secrets.token_hex(3)
        workers, targets = [], []
        for i, w in enumerate(self.workers):
            address = f"{self.host}:{7000 + i}"
            targets.append({"job": job, "worker": w.name, "address": address})
            breakdown = {p: 0.0 for p in PARTS}
            breakdown["input_wait"] = w.input_wait_ms
            breakdown["device_collectives"] = w.collectives_ms
            breakdown["device_compute"] = w.step_ms - w.input_wait_ms - w.collectives_ms
            ops: dict[str, list[dict[str, Any]]] = {"input": [], "host": [], "device": []}
            for kind, name, ms in w.ops:
                ops[kind].append({"name": name, "ms_per_step": ms, "ms_total": 20 * ms, "kernels": []})
            workers.append({"host": self.host, "trace": f"/x/{self.host}_{7000 + i}.xplane.pb", "steps": 20,
                            "window": [start_ns + 1_000_000 * i, start_ns + 2_000_000_000], "cycle_ms": w.step_ms,
                            "breakdown_ms": breakdown, "breakdown": {p: ms / w.step_ms for p, ms in breakdown.items()},
                            "between_ms": {"between_steps_input": 0.0, "between_steps_other": 0.0},
                            "step_time_ms": {"mean": w.step_ms, "stdev": 0.0, "min": w.step_ms, "max": w.step_ms},
                            "ops": ops})
        if self.outcome == "died":
            return {"id": capture_id, "job": job, "status": "failed", "reason": "died", "targets": targets,
                    "analysis": None, "detail": f"the process at {targets[0]['address']} died during the capture"}
        return {"id": capture_id, "job": job, "status": "done", "reason": None, "detail": None, "targets": targets,
                "analysis": {"workers": workers}}

    def stop(self) -> None:
        self.server.shutdown()
        self.server.server_close()
