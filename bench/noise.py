"""Issue 24: the shipped rules must not turn machine noise into captures.

A real agent with the shipped default rules watches a steady Keras demo job (its own work never changes)
while other processes load the host on a random schedule: bursts of 1-3 CPU hogs lasting 10 s to 3 min,
some with a disk writer (fsync'd writes), separated by quiet gaps. At the end it reads the agent's capture
records through the control API and prints captures by rule with each one's verdict, the rules' firings and
the captures taken on pending and discarded (``tfprofd_captures_discarded_total``).

Target: no ``throughput_drop``/``step_time_outlier`` capture (nor any other) of the unchanged job, or each
one's record says the host was contended (``host_contention``, or the contention in its host context).
Exits 1 otherwise. Prints progress every minute, so a log cut short still says what happened.

``--minutes`` (default 60), ``--seed``; ``--quick``: one short burst (CI: the bench runs; the figure means
nothing).
"""

from __future__ import annotations

import argparse
import os
import random
import re
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import common  # noqa: F401  (puts tests/ on the path)
from helpers import AgentProcess, wait_for

JOB = "noise"
# The demo's job (daemon/demo.py) without its injected input bottleneck: CPU-bound, steady.
JOB_ARGS = ["--job", JOB, "--features", "64", "--width", "1024", "--batch-size", "64", "--samples", "4096"]
HOG = "while True: pass"
WRITER = ("import os, sys\n"
          "block = os.urandom(1 << 20)\n"
          "while True:\n"
          "    with open(sys.argv[1], 'wb') as f:\n"
          "        for _ in range(64):\n"
          "            f.write(block)\n"
          "        f.flush(); os.fsync(f.fileno())\n"
          "    os.unlink(sys.argv[1])\n")
CONTENDED = "the host was contended"  # hostcontext.apply's note when the trace's verdict stands


@dataclass
class Burst:
    start: float  # seconds from the start of the load
    seconds: float
    hogs: int
    disk: bool


@dataclass
class LoadLog:
    """The schedule as run, and /proc/loadavg sampled every few seconds."""

    bursts: list[Burst] = field(default_factory=list)
    loadavg: list[float] = field(default_factory=list)  # 1-minute load average


def schedule(rng: random.Random, seconds: float, quick: bool) -> list[Burst]:
    """Bursts of 1-3 hogs, 10 s-3 min long, some with a disk writer, quiet gaps of 20 s-4 min between."""
    if quick:
        return [Burst(2.0, 6.0, 2, True)]
    bursts, t = [], rng.uniform(30, 120)
    while t < seconds:
        length = min(rng.uniform(10, 180), seconds - t)
        bursts.append(Burst(round(t, 1), round(length, 1), rng.randint(1, 3), rng.random() < 0.3))
        t += length + rng.uniform(20, 240)
    return bursts


def run_load(bursts: list[Burst], tmp: Path, stop: threading.Event) -> None:
    """Start and stop the other processes on the schedule; none is left running."""
    started = time.monotonic()
    for burst in bursts:
        if stop.wait(max(burst.start - (time.monotonic() - started), 0)):
            return
        procs = [subprocess.Popen([sys.executable, "-c", HOG]) for _ in range(burst.hogs)]
        if burst.disk:
            procs.append(subprocess.Popen([sys.executable, "-c", WRITER, str(tmp / "noise-writer.bin")]))
        try:
            stop.wait(burst.seconds)
        finally:
            for proc in procs:
                proc.kill()
                proc.wait()
            (tmp / "noise-writer.bin").unlink(missing_ok=True)


def sample_load(log: LoadLog, stop: threading.Event, every: float) -> None:
    while not stop.wait(every):
        log.loadavg.append(float(Path("/proc/loadavg").read_text().split()[0]))


def metric(text: str, name: str) -> dict[str, float]:
    """{rule: value} of a counter family labelled by rule."""
    out = {}
    for m in re.finditer(rf'^{name}\{{rule="([^"]+)"\}} (\S+)$', text, re.MULTILINE):
        out[m.group(1)] = float(m.group(2))
    return out


def verdict(record: dict[str, Any]) -> tuple[bool, str]:
    """Whether the record says the host was contended, and the verdict to print."""
    analysis = record.get("analysis") or {}
    host = record.get("host") or {}
    before = host.get("before") or {}
    contention, where = host.get("contention"), "in the capture window"
    if contention is None and before.get("contention") is not None:
        contention, where = before["contention"], f"over the {before['lookback']:.0f} s its rule measured"
    said = (analysis.get("bottleneck") == "host_contention" or CONTENDED in (analysis.get("summary") or "")
            or contention is not None)
    what = analysis.get("bottleneck") or f"{record['status']}: {record.get('reason')}"
    if contention is not None:
        what += f" (host: the job lost {contention['lost_share']:.0%} of {contention['wanted_cores']:.1f} CPUs {where})"
    elif before:
        what += f" (host: not contended; {before['cpu_busy']:.0%} busy before)"
    return said, what


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--minutes", type=float, default=60.0)
    parser.add_argument("--seed", type=int, default=24)
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args()
    seconds = 20.0 if args.quick else args.minutes * 60
    rng = random.Random(args.seed)
    bursts = schedule(rng, seconds, args.quick)
    load = LoadLog(bursts)
    with tempfile.TemporaryDirectory() as tmpdir:
        tmp = Path(tmpdir)
        # The shipped rules (no --config), the real host's procfs, no GPU: the job trains on the CPU.
        agent = AgentProcess(tmp, args=["--interval", "1s", "--collectors.nvml.enabled", "false"],
                             fixtures=False).start()
        job = None
        stop = threading.Event()
        threads: list[threading.Thread] = []
        try:
            env = {**os.environ, "TFPROFD_ADDR": f"unix:{agent.hook_socket}", "TF_CPP_MIN_LOG_LEVEL": "3"}
            job = subprocess.Popen([sys.executable, "-m", "tfprofd.daemon.demo_job", *JOB_ARGS,
                                    "--seconds", str(seconds + 600)],
                                   env=env, stdout=subprocess.DEVNULL, stderr=open(tmp / "job.log", "ab"))
            wait_for(lambda: job.poll() is None and f'training_job="{JOB}"' in agent.scrape(), 300,
                     interval=1, message="the job's samples/s at the agent")
            print(f"noise: agent pid {agent.proc.pid} (API {agent.api}, state {tmp / 'state'}), job pid {job.pid}; "
                  f"{len(bursts)} bursts over "
                  f"{seconds / 60:.1f} min (seed {args.seed})", flush=True)
            for b in bursts:
                print(f"  burst at {b.start:7.1f} s for {b.seconds:5.1f} s: {b.hogs} hog(s)"
                      f"{' + disk writer' if b.disk else ''}", flush=True)
            threads = [threading.Thread(target=run_load, args=(bursts, tmp, stop)),
                       threading.Thread(target=sample_load, args=(load, stop, 1 if args.quick else 10))]
            for t in threads:
                t.start()
            started = time.monotonic()
            while (elapsed := time.monotonic() - started) < seconds:
                time.sleep(min(60.0, seconds - elapsed))
                if job.poll() is not None:
                    raise RuntimeError(f"the job exited ({job.returncode}); see {tmp / 'job.log'}")
                text = agent.scrape()
                rate = re.search(rf'^tfprofd_training_samples_per_second\{{[^}}]*training_job="{JOB}"[^}}]*\}} (\S+)',
                                 text, re.MULTILINE)
                captures = agent.call("GET", "/captures")[1]["captures"]
                print(f"  t={time.monotonic() - started:5.0f} s  load {load.loadavg[-1] if load.loadavg else 0:.2f}"
                      f"  samples/s {float(rate.group(1)) if rate else 0:.0f}  captures {len(captures)}"
                      f"  firings {({k: v for k, v in metric(text, 'tfprofd_rule_firings_total').items() if v})}"
                      f"  discarded {metric(text, 'tfprofd_captures_discarded_total')}", flush=True)
            stop.set()
            for t in threads:
                t.join()
            # let captures asked for near the end finish their analysis
            wait_for(lambda: all(c["status"] not in ("running", "analyzing")
                                 for c in agent.call("GET", "/captures")[1]["captures"]),
                     600, interval=2, message="captures to finish")
            text = agent.scrape()
            status, body = agent.call("GET", "/captures")
            assert status == 200, body
            records = body["captures"]
            refused = refusals(agent.log())
        finally:
            stop.set()
            for t in threads:
                t.join()
            if job is not None and job.poll() is None:
                job.kill()
                job.wait()
            agent.stop()
    return report(records, text, load, refused)


def refusals(log: str) -> dict[tuple[str, str], int]:
    """{(rule, why): count} of firings the policy refused a capture, from the agent's log."""
    out: dict[tuple[str, str], int] = {}
    for m in re.finditer(r'rule (\S+): no capture: ([^"]*)"', log):
        why = m.group(2)
        why = ("cooldown" if "cooldown ago" in why else "max_per_hour" if "max_per_hour" in why
               else "busy" if "busy" in why or "running" in why else why[:60])
        out[(m.group(1), why)] = out.get((m.group(1), why), 0) + 1
    return out


def report(records: list[dict[str, Any]], text: str, load: LoadLog, refused: dict[tuple[str, str], int]) -> int:
    firings = metric(text, "tfprofd_rule_firings_total")
    discarded = metric(text, "tfprofd_captures_discarded_total")
    kept = [r for r in records if r["status"] != "discarded"]
    la = load.loadavg or [0.0]
    print(f"load average (1 min) over the run: min {min(la):.2f}, mean {statistics.fmean(la):.2f}, max {max(la):.2f} "
          f"({len(la)} samples); bursts {len(load.bursts)}, "
          f"{sum(b.seconds for b in load.bursts) / 60:.1f} min of hogs")
    rules = sorted(set(firings) | set(discarded) | {r["rule"] or r["trigger"] for r in records})
    print(f"{'rule':28} {'firings':>7} {'captures':>8} {'discarded':>9}")
    for rule in rules:
        print(f"{rule:28} {firings.get(rule, 0):7.0f} {sum((r['rule'] or r['trigger']) == rule for r in kept):8} "
              f"{discarded.get(rule, 0):9.0f}")
    for (rule, why), n in sorted(refused.items()):
        print(f"  {rule}: {n} firing/pending transition(s) refused a capture: {why}")
    failing = 0
    for r in kept:
        ok, what = verdict(r)
        if r["trigger"] == "baseline":  # scheduled once the job trained steadily: what the job does, not noise
            ok, what = True, f"{what}; a baseline, taken while no rule fired (not judged)"
        failing += not ok
        at = time.strftime('%H:%M:%S', time.gmtime(r['requested_at']))
        print(f"  capture {r['id']} rule {r['rule'] or r['trigger']} at {at} UTC: {what} -> "
              f"{'ok (host contended)' if ok else 'FAIL: noise captured as the job'}")
    judged = sum(r["trigger"] != "baseline" for r in kept)
    print(f"captures of the unchanged job not saying the host was contended: {failing} of {judged}")
    return 1 if failing else 0


if __name__ == "__main__":
    sys.exit(main())
