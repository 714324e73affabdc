"""/metrics latency, resident memory and CPU use of tfprofd (8 simulated GPUs, 1 s interval) against Debian's
node_exporter, measured side by side in one run, with 20 reporting jobs and with 1,000 (``hook.max_jobs``),
and scrape time and CPU against the number of jobs (10 to 1,000):

- latency with a new connection per scrape and on one kept-alive connection (as Prometheus scrapes),
  alternating between the two exporters so both see the same machine;
- a real Prometheus scraping both every second, and a static server that serves a copy of tfprofd's
  scrape (Prometheus's own part: parsing and storing that many series): its ``scrape_duration_seconds``
  and whether ``up`` ever read 0;
- RSS and CPU of the agent while it samples and receives the jobs' reports, unscraped and scraped.

The jobs report from another process (as training processes do), so the measuring process is not busy.

Targets: 20 jobs: tfprofd's p99 at most 1/5 of node_exporter's (each way); RSS ≤ 35 MiB; CPU < 1% of a
core unscraped. 1,000 jobs: Prometheus's scrape p99 ≤ 1.5× the static server's, ``up`` never 0, kept-alive
p99 ≤ node_exporter's, CPU ≤ 5% of a core. ``--quick``: tiny sizes and durations, no targets (CI);
``--spread``: the jobs report at their own phases over each second, as real ones do (one burst otherwise).
``--unix``: the jobs report over the agent's Unix socket, as jobs on the host do by default (UDP, as pods do,
otherwise); the socket rests between reads only where the kernel queues 512 datagrams for it
(``net.unix.max_dgram_qlen``, systemd's default; the kernel's own is 10), which the bench prints.
With 1,000 jobs the CPU is measured a third time, scraped every 15 s, a common Prometheus interval (the agent
renders ahead only near each scrape; at 1 s it renders every sample). ``--plot=PATH``: draw the
scaling table (scrape time and CPU against jobs, linear axes) as SVG for README.
"""

from __future__ import annotations

import json
import multiprocessing
import socket
import sys
import tempfile
import threading
import time
import urllib.parse
import urllib.request
from collections.abc import Callable
from html import escape
from http.client import HTTPConnection, HTTPException
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

from tfprofd.daemon.exposition import cadence_kept

from common import cpu_seconds, percentile, rss_bytes, seasoned, start_agent, start_node_exporter, stop
from helpers import free_port, metric_value, start_prometheus

QUICK = "--quick" in sys.argv
SPREAD = "--spread" in sys.argv  # the jobs report at their own phases over each second (as real ones do), not at once
UNIX = "--unix" in sys.argv  # over the agent's Unix socket (jobs on the host), not UDP (pods)
SCRAPES = 5 if QUICK else 300
FEW, MANY = (2, 4) if QUICK else (20, 1000)  # reporting jobs; 1,000 is hook.max_jobs
SCALING = () if QUICK else (10, 100)  # more sizes for the scaling table, beside FEW and MANY
CPU_SECONDS = 1 if QUICK else 20
PROMETHEUS_SECONDS = 2 if QUICK else 30
# a common Prometheus scrape interval: the agent renders ahead only near each scrape, so what a scrape costs at it
SLOW_SCRAPE_SECONDS = 1 if QUICK else 15
SLOW_SCRAPES = 2 if QUICK else 4  # scrapes in its CPU window
# scrapes before it: the agent learns a scraper's cadence as a moving mean of the gaps (``_Cadence.asked``), here from
# Prometheus's scrapes every second just before; fourteen gaps of 15 s bring it within 0.1 s of 15 s (eight left it at
# 13.8-14.6 s through the window, with half as many renderings again as a steady scraper gets)
SLOW_WARMUP = 3 if QUICK else 14
COLD_SCRAPES = 0 if QUICK else 5  # the first scrapes of each target meet cold caches on both sides
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


def scrape_every(ports: list[int], period: float, stop_event: threading.Event,
                 after_round: Callable[[int], bool] | None = None, source: str = "127.0.0.1",
                 durations: dict[int, list[float]] | None = None) -> None:
    """Ask each agent for /metrics every ``period`` seconds as Prometheus does (OpenMetrics, gzip, a kept-alive
    connection each, opened again where the agent closed it: it closes one idle for 30 s), until ``stop_event``, or
    until ``after_round(rounds so far)`` says to stop. ``source``: the loopback address to scrape from (an HA pair's
    replicas scrape from two); ``durations``: port -> each scrape's duration, appended to."""
    def connect(port: int) -> HTTPConnection:
        return HTTPConnection("127.0.0.1", port, timeout=30, source_address=(source, 0))

    conns = {port: connect(port) for port in ports}
    due, rounds = time.monotonic(), 0
    try:
        while not stop_event.wait(max(due - time.monotonic(), 0.0)):
            for port in ports:
                try:
                    took = timed(conns[port])
                except (HTTPException, ConnectionError):  # closed while idle: Prometheus connects again
                    conns[port].close()
                    conns[port] = connect(port)
                    took = timed(conns[port])
                if durations is not None:
                    durations.setdefault(port, []).append(took)
            rounds += 1
            if after_round is not None and after_round(rounds):
                return
            due += period
    finally:
        for conn in conns.values():
            conn.close()


def scraping(ports: list[int], period: float, stop_event: threading.Event,
             after_round: Callable[[int], bool] | None = None, source: str = "127.0.0.1",
             durations: dict[int, list[float]] | None = None) -> tuple[threading.Thread, list[BaseException]]:
    """``scrape_every`` on a thread of its own, started; the list holds what stopped it if that was an error."""
    errors: list[BaseException] = []

    def run() -> None:
        try:
            scrape_every(ports, period, stop_event, after_round, source, durations)
        except BaseException as exc:  # the caller raises it: a bench must not report a window nobody scraped
            errors.append(exc)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread, errors


def cpu_scraped_every(pid: int, port: int, period: float) -> float:
    """The agent's CPU (a fraction of a core) while it is scraped every ``period`` seconds (``scrape_every``), over
    ``SLOW_SCRAPES`` periods after ``SLOW_WARMUP`` scrapes: from right after one scrape to right after the last, so the
    window holds those scrapes and the renderings ahead of them."""
    marks: list[tuple[float, float]] = []  # (CPU seconds, clock) as the window opens and closes

    def after_round(rounds: int) -> bool:
        if rounds in (SLOW_WARMUP, SLOW_WARMUP + SLOW_SCRAPES):
            marks.append((cpu_seconds(pid), time.monotonic()))
        return rounds == SLOW_WARMUP + SLOW_SCRAPES

    stop_event = threading.Event()
    thread, errors = scraping([port], period, stop_event, after_round)
    thread.join(period * (SLOW_WARMUP + SLOW_SCRAPES) + 120)
    stop_event.set()
    thread.join(30)
    if errors:
        raise RuntimeError(f"a scrape every {period} s failed: {errors[0]!r}") from errors[0]
    if len(marks) != 2:
        raise RuntimeError(f"the scrapes every {period} s did not finish")
    (cpu0, t0), (cpu1, t1) = marks
    return (cpu1 - cpu0) / (t1 - t0)


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


def report_forever(addr: str, jobs: int, stop_event: threading.Event, spread: bool = False) -> None:
    """``jobs`` jobs reporting once a second, as hooks do (run in a process of its own): in one burst, or
    (``spread``) each at its own phase."""
    from tfprofd.exporter.hook import Reporter

    reporters = [Reporter(job=f"job{i:04d}", worker="0", profiler=False, addr=addr)
                 for i in range(jobs)]
    for r in reporters:
        r.batch_size, r.phase = 64, "train"
        seasoned(r)
    next_round = time.monotonic()
    while not stop_event.is_set():
        for i, r in enumerate(reporters):
            if spread:
                stop_event.wait(max(next_round + i / jobs - time.monotonic(), 0))
            r.record(25, 25 * 64, 0.5)
            r.flush()
        next_round += 1.0
        stop_event.wait(max(next_round - time.monotonic(), 0))


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


class QuietServer(ThreadingHTTPServer):
    def handle_error(self, request: object, client_address: object) -> None:
        """A scrape Prometheus gave up on (its 1 s timeout, on a loaded host) shows in its figures, not here."""


def prometheus_durations(tmp: Path, agent_port: int, node_port: int) -> tuple[dict[str, list[float]], float]:
    """scrape_duration_seconds of each target (tfprofd, node, static) and the lowest ``up`` of tfprofd."""
    request = urllib.request.Request(f"http://127.0.0.1:{agent_port}/metrics", headers=HEADERS)
    with urllib.request.urlopen(request) as response:
        Static.body, Static.content_type = response.read(), response.headers["Content-Type"]
    static = QuietServer(("127.0.0.1", 0), Static)
    threading.Thread(target=static.serve_forever, daemon=True).start()
    prometheus, prom_port = start_prometheus(tmp, agent_port, extra_targets={"node": node_port,
                                                                             "static": static.server_address[1]})
    try:
        time.sleep(PROMETHEUS_SECONDS)
        deadline = time.monotonic() + 30
        while True:  # at least a few scrapes of each target past the cold ones (a slow start on a busy host)
            durations = {r["metric"]["job"]: [float(v) for _, v in r["values"]][COLD_SCRAPES:]
                         for r in query(prom_port, "scrape_duration_seconds[10m]")}
            if all(len(durations.get(job, ())) >= 3 for job in ("tfprofd", "node", "static")):
                break
            if time.monotonic() > deadline:
                raise RuntimeError(f"Prometheus scraped too little: {durations}")
            time.sleep(0.5)
        up = min(float(v) for r in query(prom_port, 'up{job="tfprofd"}[10m]') for _, v in r["values"])
        return durations, up
    finally:
        prometheus.stop()
        static.shutdown()


def query(prom_port: int, promql: str) -> list[dict]:
    url = f"http://127.0.0.1:{prom_port}/api/v1/query?" + urllib.parse.urlencode({"query": promql})
    return json.loads(urllib.request.urlopen(url).read())["data"]["result"]


POLL_SECONDS = 0.5  # how often wait_jobs asks whether the agent serves every job


def wait_jobs(agent_port: int, jobs: int, interval: float = 1.0) -> tuple[float, float]:
    """Until the agent serves every reporting job (a thousand new jobs take a few samples), and then until it no
    longer renders ahead for these polls: (the reports it had accepted at the last poll, monotonic time then). The
    agent keeps a scraper's cadence, rendering every sample near its next scrape, for two of its periods and 2.5
    sampling intervals after its last scrape (``cadence_kept``): a window measured as unscraped from sooner counted
    up to four renderings of 1,000 jobs for the bench's own polls (0.4-0.8% of a core). A second more for the
    polls' own jitter (the agent's period is a mean of the gaps it saw, the longest here at most). ``--quick``
    (CI, whose figures nobody reads) waits 2 s instead."""
    deadline = time.monotonic() + 120
    longest, last = POLL_SECONDS, None
    while time.monotonic() < deadline:
        body = urllib.request.urlopen(f"http://127.0.0.1:{agent_port}/metrics", timeout=30).read().decode()
        now = time.monotonic()
        longest, last = (longest, now) if last is None else (max(longest, now - last), now)
        if metric_value(body, "tfprofd_hook_jobs") == jobs:
            settled = last + (2 if QUICK else cadence_kept(longest, interval) + 1)
            time.sleep(max(0.0, settled - time.monotonic()))
            return metric_value(body, "tfprofd_hook_reports_total") or 0.0, last
        time.sleep(POLL_SECONDS)
    raise RuntimeError(f"the agent did not see {jobs} jobs")


def reports(agent_port: int) -> float:
    """Reports the agent has accepted (the reporting process may fall behind on a loaded host)."""
    body = urllib.request.urlopen(f"http://127.0.0.1:{agent_port}/metrics", timeout=30).read().decode()
    return metric_value(body, "tfprofd_hook_reports_total") or 0.0


def measure(jobs: int) -> dict[str, float]:
    """Every figure with ``jobs`` jobs reporting, tfprofd beside node_exporter."""
    with tempfile.TemporaryDirectory() as tmp:
        hook_port = free_port(socket.SOCK_DGRAM)
        agent, agent_port = start_agent(Path(tmp), gpus=8, extra=["--hook.listen", f"127.0.0.1:{hook_port}"])
        node, node_port = start_node_exporter()
        context = multiprocessing.get_context("spawn")
        stop_event = context.Event()
        addr = f"unix:{Path(tmp) / 'hook.sock'}" if UNIX else f"127.0.0.1:{hook_port}"
        reporting = context.Process(target=report_forever, args=(addr, jobs, stop_event, SPREAD),
                                    daemon=True)
        reporting.start()
        try:
            reports0, started = wait_jobs(agent_port, jobs)  # read outside the CPU window
            a0, n0 = cpu_seconds(agent.pid), cpu_seconds(node.pid)
            time.sleep(CPU_SECONDS)  # sampling and the jobs' reports, no scrapes
            agent_cpu = (cpu_seconds(agent.pid) - a0) / CPU_SECONDS
            node_cpu = (cpu_seconds(node.pid) - n0) / CPU_SECONDS
            reports_per_second = (reports(agent_port) - reports0) / (time.monotonic() - started)
            a0, started = cpu_seconds(agent.pid), time.monotonic()
            durations, up_min = prometheus_durations(Path(tmp), agent_port, node_port)
            # over the whole window: Prometheus's start and the waits for its scrapes make it longer than
            # PROMETHEUS_SECONDS on a loaded host (dividing by that overstated the CPU)
            agent_cpu_scraped = (cpu_seconds(agent.pid) - a0) / (time.monotonic() - started)
            agent_cpu_slow = cpu_scraped_every(agent.pid, agent_port, SLOW_SCRAPE_SECONDS) \
                if jobs == MANY else float("nan")
            new_a, new_n = latencies(agent_port, node_port, kept_alive=False)
            kept_a, kept_n = latencies(agent_port, node_port, kept_alive=True)
            agent_rss, node_rss = rss_bytes(agent.pid), rss_bytes(node.pid)
            series = urllib.request.urlopen(f"http://127.0.0.1:{agent_port}/metrics").read().count(b"\n")
        finally:
            stop_event.set()
            reporting.join(10)
            stop(agent)
            stop(node)
    r: dict[str, float] = {"jobs": jobs, "series_lines": series, "up_min": up_min, "reports_per_s": reports_per_second}
    for name, (a, n) in {"new": (new_a, new_n), "kept": (kept_a, kept_n),
                         "prometheus": (durations["tfprofd"], durations["node"])}.items():
        r[f"{name}_tfprofd_p50_ms"], r[f"{name}_tfprofd_p99_ms"] = percentile(a, 50) * 1000, percentile(a, 99) * 1000
        r[f"{name}_node_p50_ms"], r[f"{name}_node_p99_ms"] = percentile(n, 50) * 1000, percentile(n, 99) * 1000
        r[f"{name}_p99_ratio"] = r[f"{name}_tfprofd_p99_ms"] / r[f"{name}_node_p99_ms"]
    r["prometheus_floor_p50_ms"] = percentile(durations["static"], 50) * 1000
    r["prometheus_floor_p99_ms"] = percentile(durations["static"], 99) * 1000
    r["prometheus_floor_ratio"] = r["prometheus_tfprofd_p99_ms"] / r["prometheus_floor_p99_ms"]
    r.update({"tfprofd_rss_mb": agent_rss / 2**20, "node_rss_mb": node_rss / 2**20,
              "tfprofd_cpu_pct": agent_cpu * 100, "node_cpu_pct": node_cpu * 100,
              "tfprofd_cpu_scraped_pct": agent_cpu_scraped * 100, "tfprofd_cpu_slow_pct": agent_cpu_slow * 100})
    return r


def show(r: dict[str, float]) -> None:
    jobs = int(r["jobs"])
    few = jobs <= FEW
    print(f"/metrics of tfprofd (8 simulated GPUs, {jobs} reporting jobs: {r['series_lines']:.0f} lines) and "
          "node_exporter, as Prometheus asks for it (OpenMetrics, gzip):")
    for name, label, target in (
            ("new", f"new connection per scrape, {SCRAPES} scrapes", "target <= 0.2" if few else ""),
            ("kept", f"one kept-alive connection, {SCRAPES} scrapes", "target <= 0.2" if few else "target <= 1"),
            ("prometheus", f"real Prometheus every 1 s for {PROMETHEUS_SECONDS}s, scrape_duration_seconds", "")):
        print(f"  {label}:")
        print(f"    tfprofd        p50 {r[f'{name}_tfprofd_p50_ms']:.2f} ms  p99 {r[f'{name}_tfprofd_p99_ms']:.2f} ms")
        print(f"    node_exporter  p50 {r[f'{name}_node_p50_ms']:.2f} ms  p99 {r[f'{name}_node_p99_ms']:.2f} ms")
        shown = f"  ({target})" if target else ""
        print(f"    p99 ratio tfprofd/node_exporter = {r[f'{name}_p99_ratio']:.3f}{shown}")
    print(f"    Prometheus's own part, the same body from a static server: p50 {r['prometheus_floor_p50_ms']:.2f} ms"
          f"  p99 {r['prometheus_floor_p99_ms']:.2f} ms; tfprofd/static p99 = {r['prometheus_floor_ratio']:.2f}"
          f"{'' if few else '  (target <= 1.5)'}; lowest up of tfprofd: {r['up_min']:.0f}")
    print(f"  resident memory: tfprofd {r['tfprofd_rss_mb']:.1f} MiB{' (target <= 35)' if few else ''}, "
          f"node_exporter {r['node_rss_mb']:.1f} MiB")
    print(f"  CPU while sampling at 1 s and receiving {jobs} jobs' reports ({r['reports_per_s']:.0f} a second), "
          f"{CPU_SECONDS}s unscraped: tfprofd "
          f"{r['tfprofd_cpu_pct']:.2f}% of one core{' (target < 1%)' if few else ''}, node_exporter "
          f"{r['node_cpu_pct']:.2f}% (it samples only when scraped)")
    print(f"  the same while Prometheus scrapes every second: tfprofd {r['tfprofd_cpu_scraped_pct']:.2f}%"
          f"{'' if few else ' (target <= 5%)'}")
    if not few:
        print(f"  the same while scraped every {SLOW_SCRAPE_SECONDS} s (Prometheus's headers, one connection): tfprofd "
              f"{r['tfprofd_cpu_slow_pct']:.2f}% (target <= 5%)")


PLOT_W, PLOT_H, MARGIN = 360, 220, 48
SERIES = {  # panel title -> (result key, legend, colour) for each line it draws
    "Prometheus scrape_duration_seconds (ms)": (("prometheus_tfprofd_p50_ms", "p50", "#1f77b4"),
                                                ("prometheus_tfprofd_p99_ms", "p99", "#d62728")),
    "agent CPU (% of a core)": (("tfprofd_cpu_scraped_pct", "scraped every 1 s", "#1f77b4"),
                                ("tfprofd_cpu_pct", "unscraped", "#2ca02c")),
}


def plot(results: list[dict[str, float]]) -> str:
    """The scaling table as an SVG of two panels against the number of jobs, both axes linear and from 0:
    cost that grows linearly with the jobs is a straight line through the points. Written by hand (~30
    lines) rather than adding a plotting library to the bench's dependencies for one chart."""
    top = max(r["jobs"] for r in results)
    out = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{2 * (PLOT_W + MARGIN)}" '
           f'height="{PLOT_H + 2 * MARGIN}" font-family="sans-serif" font-size="11">',
           '<rect width="100%" height="100%" fill="white"/>']
    bottom = MARGIN + PLOT_H
    for panel, (title, lines) in enumerate(SERIES.items()):
        left = MARGIN + panel * (PLOT_W + MARGIN)
        high = max(r[key] for key, _, _ in lines for r in results) * 1.1 or 1.0
        x_per_job, y_per_unit = PLOT_W / top, PLOT_H / high
        out += [f'<text x="{left}" y="{MARGIN - 20}" font-weight="bold">{escape(title)}</text>',
                f'<polyline points="{left:.1f},{MARGIN:.1f} {left:.1f},{bottom:.1f} {left + PLOT_W:.1f},{bottom:.1f}" '
                'fill="none" stroke="black"/>',
                f'<text x="{left + PLOT_W / 2}" y="{bottom + 30}" text-anchor="middle">reporting jobs</text>']
        for i in range(5):
            jobs, value = top * i / 4, high * i / 4
            out += [f'<text x="{left + jobs * x_per_job:.1f}" y="{bottom + 14}" text-anchor="middle">{jobs:.0f}</text>',
                    f'<text x="{left - 6}" y="{bottom - value * y_per_unit + 4:.1f}" '
                    f'text-anchor="end">{value:.3g}</text>']
        for n, (key, legend, colour) in enumerate(lines):
            points = [(left + r["jobs"] * x_per_job, bottom - r[key] * y_per_unit) for r in results]
            out.append(f'<polyline points="{" ".join(f"{x:.1f},{y:.1f}" for x, y in points)}" fill="none" '
                       f'stroke="{colour}"/>')
            out += [f'<circle cx="{x:.1f}" cy="{y:.1f}" r="3" fill="{colour}"/>' for x, y in points]
            out.append(f'<text x="{left + 10}" y="{MARGIN + 14 * (n + 1)}" fill="{colour}">{escape(legend)}</text>')
    out.append("</svg>")
    return "\n".join(out) + "\n"


def main() -> list[dict[str, float]]:
    results = []
    queue = Path("/proc/sys/net/unix/max_dgram_qlen").read_text().strip()
    print(f"the jobs report {'at their own phases' if SPREAD else 'in one burst a second'}, over "
          f"{f'the Unix socket (net.unix.max_dgram_qlen {queue})' if UNIX else 'UDP'}")
    sizes = [int(a.split("=", 1)[1]) for a in sys.argv[1:] if a.startswith("--jobs=")] or sorted({*SCALING, FEW, MANY})
    for jobs in sizes:
        r = measure(jobs)
        if jobs in (FEW, MANY):
            show(r)
        results.append(r)
    print("scrape and CPU against the number of reporting jobs (8 GPUs, Prometheus every 1 s):")
    print(f"  {'jobs':>5} {'lines':>6} {'scrape p50 ms':>13} {'p99 ms':>7} {'static p99':>10} "
          f"{'CPU % scraped':>13} {'unscraped':>9} {'CPU ms/s per added job':>22}")
    first = results[0]
    for r in results:
        added = r["jobs"] - first["jobs"]  # % of a core -> ms of CPU a second, for each job beyond the fewest
        per_job = (r["tfprofd_cpu_scraped_pct"] - first["tfprofd_cpu_scraped_pct"]) * 10 / added if added else 0
        print(f"  {r['jobs']:5.0f} {r['series_lines']:6.0f} {r['prometheus_tfprofd_p50_ms']:13.1f} "
              f"{r['prometheus_tfprofd_p99_ms']:7.1f} {r['prometheus_floor_p99_ms']:10.1f} "
              f"{r['tfprofd_cpu_scraped_pct']:13.2f} {r['tfprofd_cpu_pct']:9.2f} {per_job:22.3f}")
    for arg in sys.argv[1:]:
        if arg.startswith("--plot="):
            Path(arg.split("=", 1)[1]).write_text(plot(results))
    return results


if __name__ == "__main__":
    main()
