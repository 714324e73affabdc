"""Issue 2: /metrics latency, resident memory and CPU use of tfprofd (8 simulated GPUs, 1 s interval)
against Debian's node_exporter, measured side by side in one run.

Targets: tfprofd's p99 at most 1/5 of node_exporter's; RSS under 60 MB; CPU under 1% of one core.
"""

from __future__ import annotations

import http.client
import tempfile
import time
from pathlib import Path

from common import cpu_seconds, percentile, rss_bytes, start_agent, start_node_exporter, stop

SCRAPES = 500
IDLE_SECONDS = 30


def scrape_times(port: int) -> float:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    started = time.perf_counter()
    conn.request("GET", "/metrics")
    response = conn.getresponse()
    body = response.read()
    elapsed = time.perf_counter() - started
    conn.close()
    assert response.status == 200 and body
    return elapsed


def main() -> dict[str, float]:
    with tempfile.TemporaryDirectory() as tmp:
        agent, agent_port = start_agent(Path(tmp), gpus=8)
        node, node_port = start_node_exporter()
        try:
            time.sleep(3)
            # Idle cost first: no scrapes, only the 1 s sampling loop.
            a0, n0 = cpu_seconds(agent.pid), cpu_seconds(node.pid)
            time.sleep(IDLE_SECONDS)
            agent_cpu = (cpu_seconds(agent.pid) - a0) / IDLE_SECONDS
            node_cpu = (cpu_seconds(node.pid) - n0) / IDLE_SECONDS
            for _ in range(20):  # warm-up
                scrape_times(agent_port)
                scrape_times(node_port)
            agent_lat, node_lat = [], []
            for _ in range(SCRAPES):  # alternate so both see the same machine state
                agent_lat.append(scrape_times(agent_port))
                node_lat.append(scrape_times(node_port))
            agent_rss, node_rss = rss_bytes(agent.pid), rss_bytes(node.pid)
        finally:
            stop(agent)
            stop(node)
    r = {
        "tfprofd_p50_ms": percentile(agent_lat, 50) * 1000, "tfprofd_p99_ms": percentile(agent_lat, 99) * 1000,
        "node_p50_ms": percentile(node_lat, 50) * 1000, "node_p99_ms": percentile(node_lat, 99) * 1000,
        "tfprofd_rss_mb": agent_rss / 2**20, "node_rss_mb": node_rss / 2**20,
        "tfprofd_cpu_pct": agent_cpu * 100, "node_cpu_pct": node_cpu * 100,
    }
    r["p99_ratio"] = r["tfprofd_p99_ms"] / r["node_p99_ms"]
    print(f"scrape latency over {SCRAPES} scrapes (8 simulated GPUs):")
    print(f"  tfprofd        p50 {r['tfprofd_p50_ms']:.2f} ms  p99 {r['tfprofd_p99_ms']:.2f} ms")
    print(f"  node_exporter  p50 {r['node_p50_ms']:.2f} ms  p99 {r['node_p99_ms']:.2f} ms")
    print(f"  p99 ratio tfprofd/node_exporter = {r['p99_ratio']:.3f}  (target <= 0.2)")
    print(f"resident memory: tfprofd {r['tfprofd_rss_mb']:.1f} MB (target < 60), "
          f"node_exporter {r['node_rss_mb']:.1f} MB")
    print(f"CPU at a 1 s interval, idle {IDLE_SECONDS}s: tfprofd {r['tfprofd_cpu_pct']:.2f}% of one core "
          f"(target < 1%), node_exporter {r['node_cpu_pct']:.2f}%")
    return r


if __name__ == "__main__":
    main()
