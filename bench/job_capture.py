"""Issue 23: the cost of a job-wide capture as the number of peers grows. A real agent coordinates; its
peers are lightweight fake agents (tests/fake_agent.py: tiny HTTP servers speaking the peer API, each with
one worker whose capture is done at once), so what is measured is the coordination itself:

- request -> start instant: the lead the agent picks (1 s for a peer to start its capture worker, plus 3x
  the slowest measured round trip): when every worker's profiling starts;
- request -> last peer asked (must come before the instant, or that peer is named late);
- request -> job record final (with real peers, add the capture's duration and the peers' analysis).

Usage: python bench/job_capture.py [--quick]
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request

from common import free_port, wait_http  # puts tests/ on the path

# isort: split
from fake_agent import FakeAgent, FakeWorker

TOKEN = "bench-token"


def call(method: str, url: str, body: dict | None = None) -> dict:
    request = urllib.request.Request(url, data=json.dumps(body).encode() if body is not None else None, method=method,
                                     headers={"Authorization": f"Bearer {TOKEN}", "Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=30) as response:
        return json.loads(response.read())


def one_size(peers: int, trials: int) -> dict[str, float]:
    fakes = [FakeAgent("127.0.0.1", free_port(), TOKEN, [FakeWorker(f"worker-{i}")]).start() for i in range(peers)]
    with tempfile.TemporaryDirectory() as tmp:
        port, api = free_port(), free_port()
        proc = subprocess.Popen(
            [sys.executable, "-m", "tfprofd.daemon", "run", "--listen", f"127.0.0.1:{port}",
             "--api.listen", f"127.0.0.1:{api}", "--hook.listen", f"127.0.0.1:{free_port(socket.SOCK_DGRAM)}",
             "--hook.socket", f"{tmp}/hook.sock", "--state-dir", f"{tmp}/state", "--captures.baseline", "false",
             "--cluster.peers", ",".join(f"{f.host}:{f.port}" for f in fakes)],
            env={**os.environ, "TFPROFD_API_TOKEN": TOKEN}, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        try:
            wait_http(f"http://127.0.0.1:{port}/healthz")
            leads, asked, final = [], [], []
            for trial in range(trials + 1):  # the first warms up the agent (imports, connections)
                for f in fakes:
                    f.asked.clear()
                t0 = time.time()
                answer = call("POST", f"http://127.0.0.1:{api}/api/v1/captures", {"job": "ring", "scope": "job"})
                while (record := call("GET", f"http://127.0.0.1:{api}{answer['url']}"))["status"] == "running":
                    time.sleep(0.02)
                assert record["status"] == "done" and len(record["workers"]) == peers, record
                if trial == 0:
                    continue
                leads.append(record["start_at_ns"] / 1e9 - t0)
                asked.append(max(when for f in fakes for when, _ in f.asked) - t0)
                final.append(record["finished_at"] - t0)
        finally:
            proc.terminate()
            proc.wait(10)
            for f in fakes:
                f.stop()
    return {"peers": peers, "to_instant_s": statistics.median(leads), "to_last_asked_s": statistics.median(asked),
            "to_record_s": statistics.median(final)}


def main() -> list[dict[str, float]]:
    parser = argparse.ArgumentParser()
    parser.add_argument("--quick", action="store_true", help="tiny sizes (3 and 5 peers, 1 trial)")
    args = parser.parse_args()
    sizes, trials = ((3, 5), 1) if args.quick else ((3, 10, 25, 50), 3)
    rows = [one_size(n, trials) for n in sizes]
    print(f"{'peers':>5}  {'-> instant':>10}  {'-> last asked':>13}  {'-> record':>9}")
    for r in rows:
        print(f"{r['peers']:>5}  {r['to_instant_s']:>9.3f}s  {r['to_last_asked_s']:>12.3f}s  {r['to_record_s']:>8.3f}s")
    print(json.dumps(rows))
    return rows


if __name__ == "__main__":
    main()
