"""Shared test helpers: the simulated GPU, free ports, and the real agent run as a subprocess."""

from __future__ import annotations

import contextlib
import functools
import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from tfprofd.exporter.base import Clock

TESTS = Path(__file__).resolve().parent
ROOT = TESTS.parent
FAKENVML = TESTS / "fakenvml"
FIXTURES = TESTS / "fixtures"


def build_fakenvml() -> Path:
    subprocess.run(["make", "-s", "-C", str(FAKENVML)], check=True)
    return FAKENVML


_HANDED_OUT: set[tuple[int, int]] = set()


def free_port(kind: int = socket.SOCK_STREAM) -> int:
    """A loopback port free now, and never one this process handed out before: the kernel picks a port at random
    and may pick one just closed again, so an agent's /metrics and control API were once given the same port
    (the agent refused to start: "api.listen: must differ from listen")."""
    while True:
        with socket.socket(socket.AF_INET, kind) as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        if (kind, port) not in _HANDED_OUT:
            _HANDED_OUT.add((kind, port))
            return port


def gpu(index: int, **overrides: Any) -> dict[str, Any]:
    """One simulated GPU with deterministic readings."""
    state = {
        "name": "NVIDIA H100 80GB HBM3",
        "uuid": f"GPU-{index:08d}-1111-2222-3333-444444444444",
        "pci_bus_id": f"00000000:{0x18 + index:02X}:00.0",
        "utilization_gpu": 95,
        "utilization_memory": 41,
        "memory_total_bytes": 85899345920,
        "memory_used_bytes": 40 * 2**30 + index,
        "temperature_celsius": 61 + index,
        "power_milliwatts": 350125,
        "energy_millijoules": 123456789 + index,
        "sm_clock_mhz": 1980,
        "memory_clock_mhz": 2619,
        "clocks_event_reasons": 0x4 if index == 1 else 0,
        "pcie_tx_kbps": 1000 + index,
        "pcie_rx_kbps": 2000 + index,
        "ecc_corrected": 3,
        "ecc_uncorrected": 0,
        "processes": [],
        "xid_events": [],
    }
    state.update(overrides)
    return state


def hopper(index: int, **overrides: Any) -> dict[str, Any]:
    """A simulated GPU with everything a Hopper has: GPM, NVLinks, remapped rows, a recovery action."""
    state = gpu(index, gpm={"sm_activity": 12.5, "sm_occupancy": 8, "tensor_activity": 3, "dram_bandwidth": 20,
                           "graphics_activity": 97},
                nvlinks=[{"active": 1, "tx_kib": 1000 * (link + 1), "rx_kib": 2000 * (link + 1)} for link in range(2)]
                + [{"active": 0, "tx_kib": 0, "rx_kib": 0}],
                nvlink_errors={"crc_flit": 1, "crc_data": 0, "replay": 2, "recovery": 0},
                remapped_rows={"correctable": 1, "uncorrectable": 0, "pending": 0, "failure": 0},
                recovery_action=0, mig={"mode": 0})
    state.update(overrides)
    return state


def mig_hopper(index: int, **overrides: Any) -> dict[str, Any]:
    """A Hopper in MIG mode: two GPU instances (one with two compute instances), GPM per instance."""
    instances = [
        {"gpu_instance_id": 1, "compute_instance_id": 0, "uuid": f"MIG-{index:08d}-aaaa-0001-0000-000000000000",
         "profile": "3g.40gb", "memory_total_bytes": 40 * 2**30, "memory_used_bytes": 2**30,
         "gpm": {"sm_activity": 65, "sm_occupancy": 30, "tensor_activity": 40, "dram_bandwidth": 35,
                 "graphics_activity": 90}},
        {"gpu_instance_id": 2, "compute_instance_id": 0, "uuid": f"MIG-{index:08d}-aaaa-0002-0000-000000000000",
         "profile": "1c.3g.40gb", "memory_total_bytes": 40 * 2**30, "memory_used_bytes": 2 * 2**30,
         "gpm": {"sm_activity": 5, "sm_occupancy": 2, "tensor_activity": 0, "dram_bandwidth": 1,
                 "graphics_activity": 30}},
        {"gpu_instance_id": 2, "compute_instance_id": 1, "uuid": f"MIG-{index:08d}-aaaa-0002-0001-000000000000",
         "profile": "1c.3g.40gb", "memory_total_bytes": 40 * 2**30, "memory_used_bytes": 2 * 2**30},
    ]
    state = hopper(index, mig={"mode": 1, "instances": instances},
                   processes=[{"pid": 4242, "used_memory_bytes": 2**30, "gpu_instance_id": 2,
                               "compute_instance_id": 0}])
    state.update(overrides)
    return state


def volta(index: int, **overrides: Any) -> dict[str, Any]:
    """A simulated V100: retired pages instead of remapped rows, no GPM, no MIG."""
    return gpu(index, name="Tesla V100-SXM2-16GB", memory_total_bytes=16 * 2**30,
               retired_pages={"single_bit": 2, "double_bit": 1, "pending": 1}, **overrides)


class GpuState:
    """The JSON file the simulated libnvidia-ml.so.1 reads; rewrite it to script the GPUs."""

    def __init__(self, path: Path, gpus: list[dict[str, Any]] | None = None, driver: str = "550.54.15"):
        self.path = path
        self.state: dict[str, Any] = {"driver_version": driver, "gpus": gpus if gpus is not None else []}
        self.write()

    def write(self) -> None:
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text(json.dumps(self.state))
        os.replace(tmp, self.path)

    def update_gpu(self, index: int, **fields: Any) -> None:
        self.state["gpus"][index].update(fields)
        self.write()

    def env(self) -> dict[str, str]:
        return {"FAKE_NVML_STATE": str(self.path), "LD_LIBRARY_PATH": str(FAKENVML)}


def http(method: str, url: str, body: Any = None, token: str | None = None,
         timeout: float = 10, headers: dict[str, str] | None = None) -> tuple[int, Any]:
    """(status, parsed JSON or text) of one request; HTTP errors are returned, not raised."""
    data = None if body is None else (body if isinstance(body, bytes) else json.dumps(body).encode())
    request = urllib.request.Request(url, data=data, method=method)
    if data is not None:
        request.add_header("Content-Type", "application/json")
    if token:
        request.add_header("Authorization", f"Bearer {token}")
    for name, value in (headers or {}).items():
        request.add_header(name, value)
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            status, raw, ctype = response.status, response.read(), response.headers.get("Content-Type", "")
    except urllib.error.HTTPError as exc:
        status, raw, ctype = exc.code, exc.read(), exc.headers.get("Content-Type", "")
    return status, json.loads(raw) if "json" in ctype else raw.decode()


def proc_state(stat: Path) -> str | None:
    """The state letter (R, S, T, Z, ...) in a /proc ``<pid>/stat`` or ``task/<tid>/stat`` file; None once it is
    gone. The name before it is in parentheses and may hold any character, ")" too."""
    try:
        return stat.read_text().rpartition(")")[2].split()[0]
    except OSError:
        return None


def wait_for(predicate, timeout: float, interval: float = 0.1, message: str = "condition") -> Any:
    deadline = time.monotonic() + timeout
    while True:
        result = predicate()
        if result:
            return result
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {message}")
        time.sleep(interval)


@functools.cache
def _reports_socket() -> socket.socket:
    return socket.socket(socket.AF_INET, socket.SOCK_DGRAM)


@contextlib.contextmanager
def reports_socket() -> Iterator[socket.socket]:
    """A UDP socket for hand-made hook reports that stays open (as the hook's does): the agent learns a loopback
    sender's uid from its socket in /proc/net/udp, so a socket closed before the report is read is refused."""
    yield _reports_socket()


class AgentProcess:
    """``tfprofd run`` as a real subprocess on free loopback ports."""

    def __init__(self, tmp: Path, args: list[str] | None = None, env: dict[str, str] | None = None,
                 fixtures: bool = True):
        self.tmp = tmp
        self.port, self.api_port, self.hook_port = free_port(), free_port(), free_port(socket.SOCK_DGRAM)
        self.hook_socket = tmp / f"hook-{self.port}.sock"
        self.args = [
            "--listen", f"127.0.0.1:{self.port}",
            "--api.listen", f"127.0.0.1:{self.api_port}",
            "--hook.listen", f"127.0.0.1:{self.hook_port}",
            "--hook.socket", str(self.hook_socket),
            "--state-dir", str(tmp / "state"),
            "--interval", "0.2",
        ]
        if fixtures:
            self.args += ["--procfs-path", str(FIXTURES / "proc"), "--sysfs-path", str(FIXTURES / "sys")]
        self.args += args or []
        self.env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
        self.env.pop("TFPROFD_CONFIG", None)
        self.log_path = tmp / f"agent-{self.port}.log"
        self.proc: subprocess.Popen | None = None
        self.start_prefix: list[str] = []  # e.g. ["prlimit", "--nofile=1024:1024"]

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def api(self) -> str:
        return f"http://127.0.0.1:{self.api_port}/api/v1"

    def start(self, wait: bool = True) -> AgentProcess:
        self.log_file = open(self.log_path, "ab")
        self.proc = subprocess.Popen([*self.start_prefix, sys.executable, "-m", "tfprofd.daemon", "run", *self.args],
                                     env=self.env, stdout=self.log_file, stderr=subprocess.STDOUT)
        if wait:
            try:
                wait_for(self._ready, 20, message="agent to serve")
            except AssertionError as exc:
                self.proc.kill()
                self.proc.wait()
                raise AssertionError(f"{exc}; log: {self.log()}") from None
        return self

    def _ready(self) -> bool:
        if self.proc and self.proc.poll() is not None:
            raise AssertionError(f"agent exited with {self.proc.returncode}: {self.log()}")
        try:
            return http("GET", self.url + "/healthz", timeout=1)[0] in (200, 503)
        except OSError:
            return False

    def scrape(self) -> str:
        status, text = http("GET", self.url + "/metrics")
        assert status == 200, text
        return text

    @property
    def token(self) -> str:
        """The control API token the agent generated in its state directory."""
        return (self.tmp / "state" / "api.token").read_text().strip()

    def call(self, method: str, path: str, body: Any = None, timeout: float = 10) -> tuple[int, Any]:
        """A control API request with the agent's token; ``path`` is under /api/v1."""
        return http(method, self.api + path, body, token=self.token, timeout=timeout)

    def log(self) -> str:
        return self.log_path.read_text() if self.log_path.exists() else ""

    def signal(self, sig: signal.Signals) -> None:
        assert self.proc is not None
        self.proc.send_signal(sig)

    def stop(self, timeout: float = 5) -> float:
        """SIGTERM, wait up to ``timeout`` seconds, then SIGKILL (returncode -9); returns the seconds it took."""
        if not self.proc or self.proc.poll() is not None:
            return 0.0
        started = time.monotonic()
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self.log_file.close()
        return time.monotonic() - started


def metric_value(text: str, name: str, **labels: str) -> float | None:
    """The value of one series in an exposition text, or None if absent."""
    for line in text.splitlines():
        if line.startswith("#") or not line.startswith(name):
            continue
        series, _, value = line.rpartition(" ")
        metric, _, label_text = series.partition("{")
        if metric != name:
            continue
        found = dict(part.split("=", 1) for part in _split_labels(label_text.rstrip("}")))
        if all(found.get(k) == f'"{v}"' for k, v in labels.items()):
            return float(value)
    return None


def _split_labels(text: str) -> list[str]:
    parts, current, quoted = [], "", False
    for ch in text:
        if ch == '"' and not current.endswith("\\"):
            quoted = not quoted
        if ch == "," and not quoted:
            parts.append(current)
            current = ""
        else:
            current += ch
    if current:
        parts.append(current)
    return parts


def start_training(hook_port: int, *args: str) -> subprocess.Popen:
    """tfprofd.daemon.demo_job as a subprocess reporting to an agent's hook port."""
    env = {**os.environ, "TFPROFD_ADDR": f"127.0.0.1:{hook_port}", "PYTHONUNBUFFERED": "1"}
    return subprocess.Popen([sys.executable, "-m", "tfprofd.daemon.demo_job", *args], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def job_reporting(agent: AgentProcess, job: str) -> bool:
    return metric_value(agent.scrape(), "tfprofd_training_up", training_job=job) == 1


# The agent ends every capture within captures.timeout (90 s) + its duration, and its analysis within
# captures.analysis_timeout (180 s): a wait on a record covers both, however busy the machine.
RECORD_FINAL_WITHIN_S = 90 + 60 + 180


def wait_capture(agent: AgentProcess, capture_id: str, timeout: float = RECORD_FINAL_WITHIN_S) -> dict[str, Any]:
    def finished():
        status, record = agent.call("GET", f"/captures/{capture_id}")
        assert status == 200, record
        return record if record["status"] not in ("running", "analyzing") else None

    return wait_for(finished, timeout, 0.2, message=f"capture {capture_id} to finish")


def wait_traced(agent: AgentProcess, capture_id: str, timeout: float = 90 + 60) -> dict[str, Any]:
    """The capture's record once its trace is taken or it failed (its analysis may still run)."""
    def traced():
        status, record = agent.call("GET", f"/captures/{capture_id}")
        assert status == 200, record
        return record if record["status"] != "running" else None

    return wait_for(traced, timeout, 0.2, message=f"capture {capture_id} to be traced")


class Server:
    """A real server binary (Prometheus, Alertmanager, node_exporter) on loopback, stopped by ``stop()``."""

    def __init__(self, args: list[str], ready_url: str, log_path: Path):
        self.log_path = log_path
        self.log_file = open(log_path, "ab")
        self.proc = subprocess.Popen(args, stdout=self.log_file, stderr=subprocess.STDOUT)
        wait_for(lambda: self._ready(ready_url), 30, message=f"{args[0]} to start (log {log_path})")

    def _ready(self, url: str) -> bool:
        if self.proc.poll() is not None:
            raise AssertionError(f"server exited: {self.log_path.read_text()[-2000:]}")
        try:
            return http("GET", url, timeout=1)[0] == 200
        except OSError:
            return False

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
        self.log_file.close()


def start_prometheus(tmp: Path, scrape_port: int | list[int | str], rule_files: list[Path] | None = None,
                     alertmanager_port: int | None = None,
                     extra_targets: dict[str, int] | None = None) -> tuple[Server, int]:
    """Debian's prometheus on a free loopback port, scraping the agent (job tfprofd; several agents: a list
    of ports, or of ``host:port`` for agents on other loopback addresses) every second."""
    port = free_port()
    alerting = (f"alerting: {{alertmanagers: [{{static_configs: [{{targets: ['127.0.0.1:{alertmanager_port}']}}]}}]}}"
                if alertmanager_port else "")
    jobs = {"tfprofd": scrape_port, **(extra_targets or {})}
    scrape_configs = "".join(f"""
  - job_name: {job}
    static_configs: [{{targets: {json.dumps([t if isinstance(t, str) else f"127.0.0.1:{t}"
                                             for t in ([target] if isinstance(target, int) else target)])}}}]"""
                             for job, target in jobs.items())
    (tmp / "prometheus.yml").write_text(f"""
global: {{scrape_interval: 1s, evaluation_interval: 1s}}
rule_files: {json.dumps([str(f) for f in rule_files or []])}
{alerting}
scrape_configs:{scrape_configs}
""")
    server = Server(["prometheus", f"--config.file={tmp / 'prometheus.yml'}", f"--storage.tsdb.path={tmp / 'prom'}",
                     f"--web.listen-address=127.0.0.1:{port}"],
                    f"http://127.0.0.1:{port}/-/ready", tmp / "prometheus.log")
    return server, port


class FakeClock(Clock):
    """Wall time and monotonic time that a test moves separately (an NTP step moves only wall time)."""

    def __init__(self) -> None:
        self.wall, self.mono = 1_800_000_000.0, 5_000.0

    def time(self) -> float:
        return self.wall

    def monotonic(self) -> float:
        return self.mono


def analyze_json(*args: str) -> dict:
    """``tfprofd analyze --json ARGS`` in a fresh process: its JSON (it must exit 0)."""
    result = subprocess.run([sys.executable, "-m", "tfprofd.daemon", "analyze", "--json", *args], capture_output=True,
                            text=True, timeout=300)
    assert result.returncode == 0, result.stdout + result.stderr
    return json.loads(result.stdout)
