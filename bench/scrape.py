"""/metrics latency, resident memory and CPU use of tfprofd (8 simulated GPUs and 20 reporting jobs, 1 s
interval) against Debian's node_exporter, measured side by side in one run:

- latency with a new connection per scrape and on one kept-alive connection (as Prometheus scrapes),
  alternating between the two exporters so both see the same machine;
- a real Prometheus scraping both every second: its own ``scrape_duration_seconds``;
- RSS and CPU of the agent while it samples, receives the 20 jobs' reports and is scraped.

Targets: tfprofd's p99 at most 1/5 of node_exporter's (each way); RSS ≤ 35 MB; CPU < 1% of a core.
"""

from __future__ import annotations

import json
import socket
import tempfile
import threading
import time
import urllib.parse
import urllib.request
from http.client import HTTPConnection
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

from tfprofd.exporter.hook import Reporter

from common import cpu_seconds, percentile, rss_bytes, start_agent, start_node_exporter, stop
from helpers import free_port, start_prometheus

SCRAPES = 500
JOBS = 20
CPU_SECONDS = 30
PROMETHEUS_SECONDS = 40
# What Prometheus sends: it negotiates OpenMetrics and gzip.
HEADERS = {"Accept": "application/openmetrics-text;version=1.0.0,application/openmetrics-text;version=0.0.1;q=0.75,"
                     "text/plain;version=0.0.4;q=0.5,*/*;q=0.1", "Accept-Encoding": "gzip"}


def timed(conn: HTTPConnection) -> float:
    started = time.perf_counter()
    conn.request("GET", "/metrics", headers=HEADERS)
    response = conn.getresponse()
    body = response.read()
    elapsed = time.perf_counter() - started
    assert response.status == 200 and body
    return elapsed


def latencies(port_a: int, port_b: int, kept_alive: bool) -> tuple[list[float], list[float]]:
    a, b = [], []
    conns = [HTTPConnection("127.0.0.1", p, timeout=10) for p in (port_a, port_b)]
    for _ in range(20):  # warm-up
        timed(conns[0])
        timed(conns[1])
    for _ in range(SCRAPES):
        if not kept_alive:
            conns = [HTTPConnection("127.0.0.1", p, timeout=10) for p in (port_a, port_b)]
        a.append(timed(conns[0]))
        b.append(timed(conns[1]))
        if not kept_alive:
            for c in conns:
                c.close()
    return a, b


def report_forever(hook_port: int, stop_event: threading.Event) -> None:
    """20 jobs reporting once a second, as hooks do."""
    reporters = [Reporter(job=f"job{i:02d}", worker="0", profiler=False, addr=f"127.0.0.1:{hook_port}")
                 for i in range(JOBS)]
    for r in reporters:
        r.batch_size, r.phase = 64, "train"
    while not stop_event.is_set():
        for r in reporters:
            r.record(25, 25 * 64, 0.5)
            r.flush()
        stop_event.wait(1.0)


class Static(BaseHTTPRequestHandler):
    """Serves one fixed copy of tfprofd's scrape: what Prometheus itself spends on that many series."""

    body = b""
    content_type = ""

    def do_GET(self) -> None:
        self.send_response(200)
        self.send_header("Content-Type", self.content_type)
        self.send_header("Content-Encoding", "gzip")
        self.send_header("Content-Length", str(len(self.body)))
        self.end_headers()
        self.wfile.write(self.body)

    def log_message(self, *args: object) -> None:
        pass


def prometheus_durations(tmp: Path, agent_port: int, node_port: int) -> dict[str, list[float]]:
    request = urllib.request.Request(f"http://127.0.0.1:{agent_port}/metrics", headers=HEADERS)
    with urllib.request.urlopen(request) as response:
        Static.body, Static.content_type = response.read(), response.headers["Content-Type"]
    static = ThreadingHTTPServer(("127.0.0.1", 0), Static)
    threading.Thread(target=static.serve_forever, daemon=True).start()
    prometheus, prom_port = start_prometheus(tmp, agent_port, extra_targets={"node": node_port,
                                                                             "static": static.server_address[1]})
    try:
        time.sleep(PROMETHEUS_SECONDS)
        query = "scrape_duration_seconds[10m]"
        url = f"http://127.0.0.1:{prom_port}/api/v1/query?" + urllib.parse.urlencode({"query": query})
        result = json.loads(urllib.request.urlopen(url).read())["data"]["result"]
        # The first scrapes of each target meet cold caches on both sides: leave out the first five.
        return {r["metric"]["job"]: [float(v) for _, v in r["values"]][5:] for r in result}
    finally:
        prometheus.stop()
        static.shutdown()


def main() -> dict[str, float]:
    with tempfile.TemporaryDirectory() as tmp:
        hook_port = free_port(socket.SOCK_DGRAM)
        agent, agent_port = start_agent(Path(tmp), gpus=8, extra=["--hook.listen", f"127.0.0.1:{hook_port}"])
        node, node_port = start_node_exporter()
        stop_event = threading.Event()
        threading.Thread(target=report_forever, args=(hook_port, stop_event), daemon=True).start()
        try:
            time.sleep(3)
            a0, n0 = cpu_seconds(agent.pid), cpu_seconds(node.pid)
            time.sleep(CPU_SECONDS)  # sampling and the jobs' reports, no scrapes
            agent_cpu = (cpu_seconds(agent.pid) - a0) / CPU_SECONDS
            node_cpu = (cpu_seconds(node.pid) - n0) / CPU_SECONDS
            a0 = cpu_seconds(agent.pid)
            durations = prometheus_durations(Path(tmp), agent_port, node_port)
            agent_cpu_scraped = (cpu_seconds(agent.pid) - a0) / PROMETHEUS_SECONDS
            new_a, new_n = latencies(agent_port, node_port, kept_alive=False)
            kept_a, kept_n = latencies(agent_port, node_port, kept_alive=True)
            agent_rss, node_rss = rss_bytes(agent.pid), rss_bytes(node.pid)
            series = urllib.request.urlopen(f"http://127.0.0.1:{agent_port}/metrics").read().count(b"\n")
        finally:
            stop_event.set()
            stop(agent)
            stop(node)
    r: dict[str, float] = {"series_lines": series}
    for name, (a, n) in {"new": (new_a, new_n), "kept": (kept_a, kept_n),
                         "prometheus": (durations["tfprofd"], durations["node"])}.items():
        r[f"{name}_tfprofd_p50_ms"], r[f"{name}_tfprofd_p99_ms"] = percentile(a, 50) * 1000, percentile(a, 99) * 1000
        r[f"{name}_node_p50_ms"], r[f"{name}_node_p99_ms"] = percentile(n, 50) * 1000, percentile(n, 99) * 1000
        r[f"{name}_p99_ratio"] = r[f"{name}_tfprofd_p99_ms"] / r[f"{name}_node_p99_ms"]
    r["prometheus_floor_p50_ms"] = percentile(durations["static"], 50) * 1000
    r["prometheus_floor_p99_ms"] = percentile(durations["static"], 99) * 1000
    r.update({"tfprofd_rss_mb": agent_rss / 2**20, "node_rss_mb": node_rss / 2**20,
              "tfprofd_cpu_pct": agent_cpu * 100, "node_cpu_pct": node_cpu * 100,
              "tfprofd_cpu_scraped_pct": agent_cpu_scraped * 100})
    print(f"/metrics of tfprofd (8 simulated GPUs, {JOBS} reporting jobs: {series} lines) and node_exporter, "
          "as Prometheus asks for it (OpenMetrics, gzip):")
    for name, label in (("new", f"new connection per scrape, {SCRAPES} scrapes"),
                        ("kept", f"one kept-alive connection, {SCRAPES} scrapes"),
                        ("prometheus", f"real Prometheus every 1 s for {PROMETHEUS_SECONDS}s, "
                                       "scrape_duration_seconds")):
        print(f"  {label}:")
        print(f"    tfprofd        p50 {r[f'{name}_tfprofd_p50_ms']:.2f} ms  p99 {r[f'{name}_tfprofd_p99_ms']:.2f} ms")
        print(f"    node_exporter  p50 {r[f'{name}_node_p50_ms']:.2f} ms  p99 {r[f'{name}_node_p99_ms']:.2f} ms")
        print(f"    p99 ratio tfprofd/node_exporter = {r[f'{name}_p99_ratio']:.3f}  (target <= 0.2)")
    print(f"    (Prometheus's own part: the same body from a static server: p50 {r['prometheus_floor_p50_ms']:.2f} ms"
          f"  p99 {r['prometheus_floor_p99_ms']:.2f} ms; scrape_duration_seconds includes parsing and storing)")
    print(f"resident memory: tfprofd {r['tfprofd_rss_mb']:.1f} MB (target <= 35), "
          f"node_exporter {r['node_rss_mb']:.1f} MB")
    print(f"CPU while sampling at 1 s and receiving {JOBS} jobs' reports, {CPU_SECONDS}s: tfprofd "
          f"{r['tfprofd_cpu_pct']:.2f}% of one core (target < 1%), node_exporter {r['node_cpu_pct']:.2f}% "
          "(it samples only when scraped)")
    print(f"  the same while Prometheus scrapes every second: tfprofd {r['tfprofd_cpu_scraped_pct']:.2f}%")
    return r


if __name__ == "__main__":
    main()
