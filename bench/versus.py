"""CPU and resident memory of tfprofd at this checkout against another revision, both agents running at once
(8 simulated GPUs each, ``--jobs`` reporting jobs each, unscraped), measured over the same windows.

Why side by side: this 2-core virtual machine charges a thread's wake after sleep 2-3× more in one hour than
in another (a cold cache, not load: ``uptime`` reads 0.1 either way), so two runs one after the other
compare the hours more than the code. Two agents at once see the same machine; the ratio is the figure.

``--base=REV`` (default ``HEAD~1``): the revision to compare with (its ``daemon/`` and ``exporter/``, from
git). ``--jobs=N`` (20), ``--rounds=R`` (5) windows of ``--seconds=S`` (30). ``--unix``: the jobs report
over each agent's Unix socket, as jobs on a host do (UDP otherwise); ``--spread``: at their own phases over
each second (one burst otherwise). ``--pods``: the jobs report over UDP from a network namespace of their own,
through a veth pair, as pods on a pod network do (their address is not the host's: needs root and ``ip``).
``--scrape-every=S``: both agents are scraped every S seconds as Prometheus scrapes (OpenMetrics, gzip, kept
alive; ``scrape.scrape_every``), from three scrapes before the first window on (unscraped otherwise): the first
in that format, so the agents know the cadence from the second. ``--replicas=2``: by two scrapers, as an HA pair of
Prometheus replicas, from two loopback addresses, the second ``--replica-offset=S`` (2) seconds after the first; the
bench prints each agent's scrape durations (a scrape that finds no part rendered ahead renders it itself).
``--quick``: 2 jobs, one window of 1 s, against ``HEAD`` (CI; without a git history, the checkout against itself).
"""

from __future__ import annotations

import ctypes
import multiprocessing
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from gpu_check import pod_network, remove_pod_network
from scrape import report_forever, scraping, wait_jobs

from common import ROOT, cpu_seconds, rss_bytes, start_agent, stop
from helpers import free_port


def option(name: str, default: str) -> str:
    return next((a.split("=", 1)[1] for a in sys.argv[1:] if a.startswith(f"--{name}=")), default)


QUICK = "--quick" in sys.argv
UNIX, SPREAD, PODS = "--unix" in sys.argv, "--spread" in sys.argv, "--pods" in sys.argv
NETNS = f"tfprofd-bench-{os.getpid()}"
HOST_SIDE, POD_SIDE = "10.254.213.1", "10.254.213.2"  # a /30 of the veth pair
CLONE_NEWNET = 0x40000000  # setns(2): join a network namespace
BASE = option("base", "HEAD" if QUICK else "HEAD~1")
JOBS = 2 if QUICK else int(option("jobs", "20"))
ROUNDS = 1 if QUICK else int(option("rounds", "5"))
SECONDS = 1.0 if QUICK else float(option("seconds", "30"))
SCRAPE_EVERY = float(option("scrape-every", "0"))
SCRAPE_WARMUP = 3  # scrapes before the first window
REPLICAS = int(option("replicas", "1"))
REPLICA_OFFSET = float(option("replica-offset", "2"))


def ratio(this: float, base: float) -> float:
    return this / base if base > 0 else float("nan")  # a window too short to be charged a tick


def base_package(tmp: Path) -> Path | None:
    """A directory holding ``tfprofd`` as it was at BASE (for PYTHONPATH), or None without a git history."""
    tree, package = tmp / "tree", tmp / "package" / "tfprofd"
    tree.mkdir()
    archive = subprocess.run(["git", "-C", str(ROOT), "archive", BASE, "daemon", "exporter"], capture_output=True)
    if archive.returncode != 0:
        if QUICK:
            return None
        raise SystemExit(f"cannot read {BASE} from git: {archive.stderr.decode().strip()}")
    subprocess.run(["tar", "-x", "-C", str(tree)], input=archive.stdout, check=True)
    package.mkdir(parents=True)
    for part in ("daemon", "exporter"):
        (package / part).symlink_to(tree / part)
    return package.parent


def report_from_pods(netns: str, addr: str, jobs: int, stop_event: object, spread: bool) -> None:
    """``report_forever`` from the pods' network namespace (``--pods``)."""
    with open(f"/run/netns/{netns}") as namespace:
        if ctypes.CDLL(None, use_errno=True).setns(namespace.fileno(), CLONE_NEWNET) != 0:
            raise OSError(ctypes.get_errno(), "setns")
    report_forever(addr, jobs, stop_event, spread)


def main() -> None:
    context = multiprocessing.get_context("spawn")
    with tempfile.TemporaryDirectory() as tmp:
        base = base_package(Path(tmp))
        sent = "the Unix socket" if UNIX else "UDP from a network namespace of their own (pods)" if PODS else "UDP"
        print(f"tfprofd at this checkout against {BASE if base else 'itself (no git history)'}, both at once, "
              f"{JOBS} jobs each reporting {'at their own phases' if SPREAD else 'in one burst a second'} over "
              f"{sent}, {f'scraped every {SCRAPE_EVERY:g} s' if SCRAPE_EVERY else 'unscraped'}", flush=True)
        here = f"{ROOT / 'bench'}:{ROOT / 'tests'}"
        agents, senders, ports = {}, [], []
        stop_scraping = threading.Event()
        scrapers: list[tuple[threading.Thread, list[BaseException]]] = []
        durations: dict[int, list[float]] = {}
        try:
            if PODS and not pod_network(NETNS, HOST_SIDE, POD_SIDE):
                raise SystemExit(2)
            for name, path in (("base", f"{base}:{here}" if base else here), ("this", here)):
                directory = Path(tmp) / name
                directory.mkdir()
                pod_side = f"{HOST_SIDE}:{free_port(socket.SOCK_DGRAM)}" if PODS else None
                agent, port = start_agent(directory, 8, extra=["--hook.listen", pod_side] if pod_side else None,
                                          env={"PYTHONPATH": path})
                agents[name] = agent
                ports.append(port)
                command = Path(f"/proc/{agent.pid}/cmdline").read_text().split("\0")
                udp = pod_side or command[command.index("--hook.listen") + 1]
                stop_event = context.Event()
                sender = context.Process(target=report_from_pods if PODS else report_forever, daemon=True, args=(
                    *([NETNS] if PODS else []), f"unix:{directory / 'hook.sock'}" if UNIX else udp, JOBS, stop_event,
                    SPREAD))
                sender.start()
                senders.append((sender, stop_event))
                wait_jobs(port, JOBS)
            if SCRAPE_EVERY:  # the agents learn the cadence before the windows
                for replica in range(REPLICAS):
                    if replica:
                        time.sleep(REPLICA_OFFSET)
                    scrapers.append(scraping(ports, SCRAPE_EVERY, stop_scraping, source=f"127.0.0.{replica + 1}",
                                             durations=durations))
                time.sleep(SCRAPE_WARMUP * SCRAPE_EVERY)
                for taken in durations.values():
                    taken.clear()  # the windows' scrapes only
            cpu: dict[str, list[float]] = {name: [] for name in agents}
            for round_ in range(ROUNDS):
                before, started = {name: cpu_seconds(a.pid) for name, a in agents.items()}, time.monotonic()
                time.sleep(SECONDS)
                elapsed = time.monotonic() - started
                for name, agent in agents.items():
                    cpu[name].append((cpu_seconds(agent.pid) - before[name]) / elapsed * 100)
                print(f"  window {round_ + 1}: base {cpu['base'][-1]:.2f}%  this {cpu['this'][-1]:.2f}% of a core  "
                      f"ratio {ratio(cpu['this'][-1], cpu['base'][-1]):.2f}", flush=True)
            for scraper, scrape_errors in scrapers:
                if scrape_errors or not scraper.is_alive():
                    raise SystemExit(f"the scrapes every {SCRAPE_EVERY:g} s stopped: {scrape_errors[:1]}")
            for name, port in zip(agents, ports, strict=True):
                if taken := sorted(durations.get(port, [])):
                    print(f"  scrapes of {name}: {len(taken)}, median {statistics.median(taken) * 1000:.1f} ms, "
                          f"slowest {taken[-1] * 1000:.1f} ms, {sum(t > 5 * taken[0] for t in taken)} over 5x the "
                          f"fastest")
            ratios = [ratio(t, b) for t, b in zip(cpu["this"], cpu["base"], strict=True)]
            rss = {name: rss_bytes(a.pid) / 2**20 for name, a in agents.items()}
            print(f"  resident: base {rss['base']:.1f} MiB  this {rss['this']:.1f} MiB")
            print(f"this / base CPU: median {statistics.median(ratios):.2f} (windows {min(ratios):.2f}-"
                  f"{max(ratios):.2f}); mean CPU base {statistics.mean(cpu['base']):.2f}%, "
                  f"this {statistics.mean(cpu['this']):.2f}%")
        finally:
            stop_scraping.set()
            for scraper, _ in scrapers:
                scraper.join(60)
            for sender, stop_event in senders:
                stop_event.set()
                sender.join(10)
            for agent in agents.values():
                stop(agent)
            if PODS:
                remove_pod_network(NETNS)


if __name__ == "__main__":
    main()
