"""Hostile input against a real agent, counted: datagrams, HTTP requests, config files and records.

Runs one agent (2 simulated GPUs) and throws at it: 100,000 report datagrams each naming a new job (more
than ``hook.max_jobs``), malformed datagrams, malformed and ambiguous HTTP requests with and without the
token, and corrupt capture records and config files. Afterwards: the agent still runs, /healthz is 200
(no collector or thread died), every collector succeeds, RSS and the scrape are within their normal
bounds, and no file outside the state directory changed. Prints one line per figure. ``--quick``: 2,000
datagrams, one round of requests and three config files (CI: the bench runs).
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

from common import free_port, percentile, rss_bytes, start_agent, stop

QUICK = "--quick" in sys.argv
DISTINCT_JOBS = 2_000 if QUICK else 100_000  # either way more than hook.max_jobs
HTTP_ROUNDS = 1 if QUICK else 20


def datagrams(sock_path: Path) -> tuple[int, int]:
    """(job-name flood, malformed) datagrams sent over the hook's unix socket."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    base = {"v": 1, "worker": "0", "pid": os.getpid(), "process_start": 1.0, "seq": 1, "time": time.time(),
            "phase": "train", "epoch": 0, "steps": 1, "samples": 8, "batch_size": 8,
            "step_seconds": {"count": 1, "sum": 0.01, "buckets": [0] * 15}, "first_step_seconds": 1.0,
            "profiler": None}
    flood = 0
    for i in range(DISTINCT_JOBS):
        payload = json.dumps({**base, "job": f"flood-{i}"}).encode()
        while True:
            try:
                sock.sendto(payload, str(sock_path))
                break
            except BlockingIOError:
                time.sleep(0.001)
            except OSError as exc:  # the agent's receive queue is full: wait for it to drain
                if exc.errno not in (11, 105):
                    raise
                time.sleep(0.001)
        flood += 1
    bad = [b"", b"\x00" * 9000, b"{", b"[]", b"null", b'{"v": 2}', b"\xff\xfe", b"{" * 5000 + b"}" * 5000,
           json.dumps({**base, "job": "x" * 200}).encode(), json.dumps({**base, "job": "a", "steps": -1}).encode(),
           b'{"v":1,"job":"a","samples":NaN}']
    for payload in bad * 100:
        try:
            sock.sendto(payload, str(sock_path))
        except OSError:
            pass  # too large for the socket: refused by the kernel, which is the point
    sock.close()
    return flood, len(bad) * 100


def raw_http(port: int, request: bytes) -> bytes:
    with socket.create_connection(("127.0.0.1", port), timeout=5) as s:
        s.sendall(request)
        s.shutdown(socket.SHUT_WR)
        chunks = []
        try:
            while chunk := s.recv(65536):
                chunks.append(chunk)
        except OSError:
            pass
        return b"".join(chunks)


def http_requests(metrics_port: int, api_port: int, token: str) -> tuple[int, int]:
    """(requests sent, answered with a 5xx) of hostile HTTP requests to both ports."""
    auth = f"Authorization: Bearer {token}\r\n".encode()
    cases = [
        b"GET /metrics HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n0\r\n\r\n",
        b"POST /api/v1/captures HTTP/1.1\r\nHost: x\r\n" + auth + b"Content-Length: 1_0\r\n\r\n0123456789",
        b"POST /api/v1/captures HTTP/1.1\r\nHost: x\r\n" + auth + b"Content-Length: 2\r\nContent-Length: 3\r\n\r\n{}",
        b"POST /api/v1/captures HTTP/1.1\r\nHost: x\r\n" + auth + b"Content-Length: 100\r\n\r\n{\"job\":",
        b"POST /api/v1/alerts HTTP/1.1\r\nHost: x\r\n" + auth + b"Content-Length: 20001\r\n\r\n" + b"[" * 10000
        + b"]" * 10000 + b" ",
        b"POST /api/v1/alerts HTTP/1.1\r\nHost: x\r\n" + auth + b"Content-Length: 12\r\n\r\n{\"alerts\":1}",
        b"POST /api/v1/captures HTTP/1.1\r\nHost: x\r\nContent-Length: 2\r\n\r\n{}",
        b"GET /api/v1/captures/../../etc/passwd HTTP/1.1\r\nHost: x\r\n" + auth + b"\r\n",
        b"GET /api/v1/captures/%2e%2e%2fstate HTTP/1.1\r\nHost: x\r\n" + auth + b"\r\n",
        b"DELETE /metrics HTTP/1.1\r\nHost: x\r\n\r\n",
        b"GET /" + b"a" * 70000 + b" HTTP/1.1\r\n\r\n",
        b"GET /metrics HTTP/1.1\r\n" + b"X: y\r\n" * 2000 + b"\r\n",
        b"\x16\x03\x01\x02\x00\x01\x00\x01\xfc\x03\x03" + os.urandom(200),
        b"GET /metrics HTTP/9.9\r\n\r\n",
        b"POST /api/v1/captures HTTP/1.1\r\nHost: x\r\n" + auth + b"Content-Length: 40\r\n\r\n"
        + b'{"job": "a", "duration_ms": 1e999999999}',
    ]
    sent = errors = 0
    for _ in range(HTTP_ROUNDS):
        for request in cases:
            for port in (metrics_port, api_port):
                answer = raw_http(port, request)
                sent += 1
                errors += answer.startswith(b"HTTP/1.1 5")
    return sent, errors


def scrape_ms(port: int, n: int = 50) -> tuple[float, int]:
    times, size = [], 0
    for _ in range(n):
        t0 = time.perf_counter()
        size = len(urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read())
        times.append((time.perf_counter() - t0) * 1000)
    return percentile(times, 99), size


def snapshot_tree(root: Path, skip: Path) -> dict[str, tuple[int, int]]:
    return {str(p): (p.stat().st_mtime_ns, p.stat().st_size) for p in root.rglob("*")
            if p.is_file() and skip not in p.parents}


def main() -> None:
    with tempfile.TemporaryDirectory() as tmp_name:
        tmp = Path(tmp_name)
        api_port = free_port()
        agent, port = start_agent(tmp, gpus=2, extra=["--api.listen", f"127.0.0.1:{api_port}"])
        state = tmp / "state"
        try:
            time.sleep(2)
            before_files = snapshot_tree(tmp, state)
            rss_before = rss_bytes(agent.pid)
            p99_before, size_before = scrape_ms(port)
            flood, bad = datagrams(tmp / "hook.sock")
            sent, errors = http_requests(port, api_port, (state / "api.token").read_text().strip())
            # Corrupt records and config files: the agent's own loaders read them (a restart, a reload).
            records = state / "records"
            for i, content in enumerate([b"", b"{", b"null", b"[1]", b'{"id": 5}', b"\xff" * 100, b"{" * 5000]):
                (records / f"20261121T0000{i:02d}Z-bad{i:03d}.json").write_bytes(content)
            configs = [b"\x00\x01binary", b"\xff\xfe\x00i", b"interval: .nan\n", b"a:\n" + b"  " * 5000 + b"b: 1",
                       b"rules: [{signal: [1]}]\n", b"captures: {dir_mode: 777}\n", b"interval: -1\n",
                       b"listen: 'nope'\n", b"x" * 1_000_000, b"- just\n- a list\n"][:3 if QUICK else None]
            config_path = tmp / "tfprofd.yaml"
            config_errors = 0
            for content in configs:
                config_path.write_bytes(content)
                result = subprocess.run([sys.executable, "-m", "tfprofd.daemon", "check-config", str(config_path)],
                                        capture_output=True, text=True, timeout=60)
                config_errors += result.returncode == 1 and "Traceback" not in result.stderr
            config_path.unlink()
            time.sleep(3)  # a few sampling intervals after the flood
            health = urllib.request.urlopen(f"http://127.0.0.1:{port}/healthz", timeout=5).status
            text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
            failing = [line for line in text.splitlines()
                       if line.startswith("tfprofd_collector_success{") and line.endswith(" 0")]
            p99_after, size_after = scrape_ms(port)
            rss_after = rss_bytes(agent.pid)
            jobs = sum(1 for line in text.splitlines() if line.startswith("tfprofd_training_up{"))
            changed = {k for k, v in snapshot_tree(tmp, state).items() if before_files.get(k) != v}
            changed.discard(str(config_path))
            alive = agent.poll() is None
        finally:
            stop(agent)
        # The corrupt records meet the agent's loader at its next start.
        agent, port = start_agent(tmp, gpus=2)
        try:
            restarted = urllib.request.urlopen(f"http://127.0.0.1:{port}/healthz", timeout=5).status
            set_aside = len(list(records.glob("*.bad-*")))
        finally:
            stop(agent)
    print(f"datagrams: {flood} naming distinct jobs + {bad} malformed; jobs kept {jobs} (hook.max_jobs)")
    print(f"HTTP: {sent} hostile requests, {errors} answered 5xx")
    print(f"config files: {len(configs)} broken, {config_errors} reported as file:line errors without a traceback")
    print(f"records: 7 corrupt record files, {set_aside} set aside at the next start (/healthz {restarted})")
    print(f"agent alive: {alive}; /healthz {health}; collectors failing: {len(failing)}; "
          f"files changed outside the state dir: {len(changed)}")
    print(f"RSS {rss_before / 1e6:.1f} MB before, {rss_after / 1e6:.1f} MB after; /metrics p99 {p99_before:.2f} ms "
          f"({size_before} bytes) before, {p99_after:.2f} ms ({size_after} bytes) after")


if __name__ == "__main__":
    main()
