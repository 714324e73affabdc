"""The agent against real NVML, on a machine with a GPU: ``make gpu-check``.

``build`` (on a machine with a package index) puts only what the agent needs for NVML sampling into
``.gpu-check/site`` (prometheus-client, nvidia-ml-py, psutil, pyyaml and tfprofd itself, pure Python or
abi3 wheels, about 5 MB): the GPU machine has NVML but no package registry, and any Python 3.10+ runs it.

``run`` (on the GPU machine; the device tool carries ``.gpu-check``) starts the real agent with that
directory alone on its path, against the real ``libnvidia-ml.so.1``, for ``--seconds`` (60), scrapes it,
lints the scrape with promtool where there is one, and prints: the GPU model and driver, every GPU series,
which NVML readings each GPU has, each collector's success and sampling duration, and every NVML call
that failed. With ``--workload`` (default 20 s; PyTorch with CUDA on that machine) a job runs on GPU 0 through the
hook (``bench/gpu_workload.py``), at full speed and then slowed: the check prints, per phase, GPU 0's utilization
and SM activity, the job's samples/s and step time, and whether ``tfprofd_gpu_job_info`` put the job's worker on the
GPU (the join the straggler rule's GPU signal is built on). With ``--jobs N``, N simulated jobs report (over UDP
from loopback, ``--pods`` over UDP from a network namespace of their own as pods do, or ``--unix`` over the hook's
Unix socket) at their own phases once a second, and the check prints the agent's CPU with them, unscraped for up to
20 s and then while it scrapes every second (the kernel's UDP socket table grows with the host's memory, and the
agent reads it for a loopback UDP report: a GPU host's figures are not the development machine's). It writes the
scrape, the log and the summary to ``$OUT`` (or ``--out``) when set. It exits 1, saying why, where NVML cannot be
loaded or initialized or reports no GPU: nothing was checked there.
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SITE = ROOT / ".gpu-check" / "site"
PACKAGES = ("prometheus-client", "nvidia-ml-py", "psutil", "pyyaml")
SERIES = re.compile(r"^tfprofd_(gpu|gpus|mig|nvml)[a-z_]*[{ ]")
NVML_UNAVAILABLE = re.compile(r"NVML unavailable \(([^)]*)\)")
SAMPLE = re.compile(r'^(?P<name>[a-z_]+)(\{(?P<labels>.*)\})? (?P<value>\S+)$')


def build() -> int:
    """Install the agent's NVML sampling needs into .gpu-check/site (no dependencies resolved beyond them)."""
    shutil.rmtree(SITE, ignore_errors=True)
    SITE.mkdir(parents=True)
    pip = [sys.executable, "-m", "pip", "install", "--quiet", "--disable-pip-version-check", "--no-deps",
           "--no-compile", "--target", str(SITE)]
    subprocess.run([*pip, "--only-binary", ":all:", *PACKAGES], check=True)
    subprocess.run([*pip, str(ROOT)], check=True)
    size = sum(f.stat().st_size for f in SITE.rglob("*") if f.is_file())
    print(f"built {SITE.relative_to(ROOT)}: {size / 2**20:.1f} MB")
    return 0


def free_ports(*kinds: int) -> list[int]:
    """A free loopback port of each socket kind, all bound at once so that no two are the same (the kernel may
    pick a port just closed again)."""
    with contextlib.ExitStack() as stack:
        sockets = [stack.enter_context(socket.socket(socket.AF_INET, kind)) for kind in kinds]
        for s in sockets:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in sockets]


def scrape(port: int) -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as response:
        return response.read().decode()


def serving(agent: subprocess.Popen, port: int, log_path: Path, within: float = 30) -> bool:
    """Whether the agent serves /metrics within ``within`` seconds; if not, its log is printed."""
    deadline = time.monotonic() + within
    while True:
        try:
            scrape(port)
            return True
        except OSError:
            if agent.poll() is not None or time.monotonic() > deadline:
                print(log_path.read_text(), file=sys.stderr)
                return False
            time.sleep(0.2)


def parse(text: str) -> list[tuple[str, dict[str, str], float]]:
    out = []
    for line in text.splitlines():
        m = SAMPLE.match(line)
        if m:
            labels = dict(re.findall(r'(\w+)="((?:[^"\\]|\\.)*)"', m["labels"] or ""))
            out.append((m["name"], labels, float(m["value"])))
    return out


def nvml_problem(text: str, log: str) -> str | None:
    """Why the run checked no GPU (NVML unavailable, or no GPU reported), or None."""
    unavailable = NVML_UNAVAILABLE.search(log)
    if unavailable:
        return (f"NVML is unavailable on this host ({unavailable[1]}): no NVIDIA driver, or no libnvidia-ml.so.1 "
                "where the dynamic loader looks (ldconfig -p | grep nvidia-ml; LD_LIBRARY_PATH). Run it on a "
                "machine with an NVIDIA GPU and its driver")
    count = next((value for name, _, value in parse(text) if name == "tfprofd_gpus"), None)
    if not count:
        return "NVML loaded but reports no GPU on this host (tfprofd_gpus 0): nothing was checked"
    return None


def torch_cuda() -> bool:
    """Whether this machine's python3 has PyTorch with a CUDA device (the workload's framework)."""
    probe = "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)"
    return subprocess.run(["python3", "-c", probe], capture_output=True).returncode == 0


def start_jobs(site: Path, addr: str, jobs: int, netns: str | None = None) -> subprocess.Popen:
    """``jobs`` simulated jobs reporting once a second each, at their own phases, to ``addr`` (UDP, or the hook's
    Unix socket: ``unix:PATH``) (``bench/scrape.py``'s reporter, in a process of its own, until it is killed), from
    the network namespace ``netns`` where given."""
    code = ("import threading; from scrape import report_forever; "
            f"report_forever({addr!r}, {jobs}, threading.Event(), spread=True)")
    path = os.pathsep.join(str(p) for p in (site, ROOT / "bench", ROOT / "tests"))
    return subprocess.Popen([*(["ip", "netns", "exec", netns] if netns else []), sys.executable, "-c", code],
                            env={**os.environ, "PYTHONPATH": path})


POD_NETNS = f"tfprofd-gpu-check-{os.getpid()}"
HOST_SIDE, POD_SIDE = "10.254.214.1", "10.254.214.2"  # a /30 of the veth pair


def pod_network(netns: str, host_side: str, pod_side: str) -> bool:
    """A network namespace ``netns`` for simulated jobs, joined to the host's by a veth pair whose ends get
    ``host_side`` and ``pod_side`` (a /30), as pods on a pod network are: their reports come from an address that
    is not the host's, so the agent reads no socket table for them (``--pods`` here and in ``versus.py``).
    ``remove_pod_network`` removes it and the pair. False, saying why and leaving neither behind, where it cannot be
    made (it needs root and ip(8))."""
    link = f"tfp{os.getpid()}"  # remove_pod_network knows it by this name
    for command in (f"ip netns add {netns}", f"ip link add {link} type veth peer name {link}p",
                    f"ip link set {link}p netns {netns}", f"ip addr add {host_side}/30 dev {link}",
                    f"ip link set {link} up", f"ip -n {netns} addr add {pod_side}/30 dev {link}p",
                    f"ip -n {netns} link set {link}p up", f"ip -n {netns} link set lo up"):
        try:
            done = subprocess.run(command.split(), capture_output=True, text=True)
        except OSError as exc:
            print(f"--pods: cannot run ip(8): {exc}", file=sys.stderr)
            return False
        if done.returncode != 0:
            print(f"--pods: `{command}` failed: {done.stderr.strip()}", file=sys.stderr)
            remove_pod_network(netns)
            return False
    return True


def remove_pod_network(netns: str) -> None:
    """Remove what ``pod_network`` made, all of it or a part (a failed step, a signal between two)."""
    with contextlib.suppress(OSError):  # no ip(8): nothing was made
        subprocess.run(["ip", "link", "del", f"tfp{os.getpid()}"], capture_output=True)  # both ends still here
        subprocess.run(["ip", "netns", "del", netns], capture_output=True)  # the pair goes with it


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def queue_length() -> str:
    """How many datagrams the kernel queues for a Unix socket here (below 64 the agent reads each report as it
    comes: README, Known issues)."""
    try:
        return Path("/proc/sys/net/unix/max_dgram_qlen").read_text().strip()
    except OSError:
        return "unknown"


def value_of(text: str, metric: str) -> float | None:
    return next((value for name, _, value in parse(text) if name == metric), None)


SETTLED_WINDOW = 10  # s: from this CPU window up, it starts once the agent no longer renders for the check's polls


def unscraped_from(last: float, longest_gap: float, interval: float = 1.0) -> float:
    """When, after its last scrape at ``last`` (monotonic), the agent no longer renders ahead for that scraper: it
    keeps a scraper's cadence for two of its periods (a mean of its gaps, at most ``longest_gap``) and 2.5 sampling
    intervals (``tfprofd.daemon.exposition.cadence_kept``; this script imports nothing of the agent's), and a CPU
    window begun sooner counted up to four renderings of every job for the check's own polls; a second more for
    the polls' jitter."""
    return last + 2 * longest_gap + 2.5 * interval + 1


def jobs_cpu(agent: subprocess.Popen, port: int, jobs: int, window: float, over: str) -> str:
    """The agent's CPU while ``jobs`` simulated jobs report and nobody scrapes it, once it serves them all."""
    deadline = time.monotonic() + 120
    longest, last = 1.0, None
    while True:
        text = scrape(port)
        now = time.monotonic()
        longest, last = (longest, now) if last is None else (max(longest, now - last), now)
        if value_of(text, "tfprofd_hook_jobs") == jobs:
            break
        if now > deadline or agent.poll() is not None:
            return f"{jobs} jobs: the agent did not serve them all within 120 s\n"
        time.sleep(1)
    reports0 = value_of(text, "tfprofd_hook_reports_total") or 0
    if window >= SETTLED_WINDOW:  # a shorter one is a smoke run (the tests': 2 s), whose figure nobody reads
        time.sleep(max(0.0, unscraped_from(last, longest) - time.monotonic()))
    cpu0, started = cpu_seconds(agent.pid), time.monotonic()
    time.sleep(window)
    cpu, ended = cpu_seconds(agent.pid) - cpu0, time.monotonic()
    reports = (value_of(scrape(port), "tfprofd_hook_reports_total") or 0) - reports0
    return (f"{jobs} jobs reporting at their own phases over {over} ({reports / (ended - last):.0f} reports/s), "
            f"{window:.0f} s unscraped: the agent's CPU {100 * cpu / (ended - started):.2f}% of a core\n")


def run(seconds: float, out: Path | None, site: Path = SITE, workload: float = 0, jobs: int = 0,
        unix: bool = False, pods: bool = False) -> int:
    if not (site / "tfprofd").is_dir():
        print(f"{site} is missing: run `python3 bench/gpu_check.py build` where pip can reach an index",
              file=sys.stderr)
        return 2
    with tempfile.TemporaryDirectory(prefix="tfprofd-gpu-check-") as tmp:  # the agent's state and log, then gone
        # a stop (timeout(1)'s SIGTERM) ends the check through its finally clauses: no namespace or pair is left
        signal.signal(signal.SIGTERM, lambda signum, _: sys.exit(128 + signum))
        try:
            if pods and not pod_network(POD_NETNS, HOST_SIDE, POD_SIDE):
                return 2
            return run_in(Path(tmp), seconds, out, site, workload, jobs, unix, POD_NETNS if pods else None)
        finally:
            if pods:
                remove_pod_network(POD_NETNS)


def run_in(tmp: Path, seconds: float, out: Path | None, site: Path, workload: float, jobs: int, unix: bool,
           netns: str | None = None) -> int:
    port, api, udp = free_ports(socket.SOCK_STREAM, socket.SOCK_STREAM, socket.SOCK_DGRAM)
    hook = f"{HOST_SIDE if netns else '127.0.0.1'}:{udp}"
    args = [sys.executable, "-S", "-m", "tfprofd.daemon", "run", "--listen", f"127.0.0.1:{port}",
            "--api.listen", f"127.0.0.1:{api}", "--hook.listen", hook,
            "--hook.socket", str(tmp / "hook.sock"), "--state-dir", str(tmp / "state"), "--interval", "1s"]
    env = {**os.environ, "PYTHONPATH": str(site), "PYTHONUNBUFFERED": "1"}
    env.pop("TFPROFD_CONFIG", None)
    log_path = tmp / "agent.log"
    with open(log_path, "wb") as log:
        agent = subprocess.Popen(args, env=env, stdout=log, stderr=subprocess.STDOUT)
        many = None
        try:
            if not serving(agent, port, log_path):
                return 1
            many = start_jobs(site, f"unix:{tmp / 'hook.sock'}" if unix else hook, jobs, netns) if jobs else None
            over = (f"the Unix socket (net.unix.max_dgram_qlen {queue_length()})" if unix
                    else "UDP from a network namespace of their own (pods)" if netns else "UDP")
            measured = jobs_cpu(agent, port, jobs, min(seconds, 20), over) if many is not None else ""
            job = None
            if workload and torch_cuda():
                job = subprocess.Popen(
                    ["python3", str(ROOT / "bench" / "gpu_workload.py"), "--addr", f"unix:{tmp / 'hook.sock'}",
                     "--site", str(site), "--seconds", str(workload)], stdout=subprocess.PIPE, text=True)
            elif workload:
                print("no PyTorch with CUDA on this machine: the workload part is skipped", file=sys.stderr)
            started, cpu0 = time.monotonic(), cpu_seconds(agent.pid)
            durations: dict[str, list[float]] = {}
            scrapes: list[tuple[float, str]] = []
            while ((time.monotonic() - started < seconds or (job is not None and job.poll() is None))
                   and not NVML_UNAVAILABLE.search(log_path.read_text())):
                text = scrape(port)
                scrapes.append((time.time(), text))
                for name, labels, value in parse(text):
                    if name == "tfprofd_collector_duration_seconds":
                        durations.setdefault(labels["collector"], []).append(value)
                time.sleep(1)
            text = scrape(port)
            if many is not None and time.monotonic() - started >= 1:  # not where NVML was missing
                measured += (f"the same, scraped every second by this check for {time.monotonic() - started:.0f} s: "
                             f"{100 * (cpu_seconds(agent.pid) - cpu0) / (time.monotonic() - started):.2f}%\n")
            phases = [json.loads(line) for line in job.communicate()[0].splitlines()] if job is not None else []
        finally:
            if many is not None:
                many.kill()
                many.wait()
            agent.terminate()
            agent.wait(10)
    lint = "promtool not found"
    if shutil.which("promtool"):
        result = subprocess.run(["promtool", "check", "metrics"], input=text, capture_output=True, text=True)
        lint = "clean" if result.returncode == 0 and not (result.stdout + result.stderr).strip() else (
            (result.stdout + result.stderr).strip())
    summary = summarize(text, durations, log_path.read_text(), lint, seconds)
    if phases:
        summary += summarize_workload(scrapes, phases)
    summary += measured
    print(summary)
    if out is not None:
        out.mkdir(parents=True, exist_ok=True)
        (out / "metrics.prom").write_text(text)
        (out / "agent.log").write_text(log_path.read_text())
        (out / "summary.txt").write_text(summary)
    problem = nvml_problem(text, log_path.read_text())
    if problem:
        print(f"gpu-check FAILED: {problem}", file=sys.stderr)
        return 1
    return 0


def summarize(text: str, durations: dict[str, list[float]], log: str, lint: str, seconds: float) -> str:
    samples = parse(text)
    lines = [f"agent ran {seconds:.0f} s against real NVML; promtool: {lint}"]
    for name, labels, _ in samples:
        if name == "tfprofd_gpu_info":
            lines.append(f"GPU {labels['gpu']}: {labels['name']} ({labels['uuid']}), driver {labels['driver_version']}")
    gpus = sorted({labels["gpu"] for name, labels, _ in samples if name.startswith("tfprofd_gpu_") and "gpu" in labels})
    for g in gpus:
        have = sorted({name.removeprefix("tfprofd_") for name, labels, _ in samples if labels.get("gpu") == g})
        lines.append(f"GPU {g} readings ({len(have)}): {', '.join(have)}")
    lines.append("collectors (success, sampling duration median/max over the run):")
    for name, labels, value in samples:
        if name == "tfprofd_collector_success":
            d = sorted(durations.get(labels["collector"], [0.0]))
            lines.append(f"  {labels['collector']:12s} success {value:.0f}  {d[len(d) // 2] * 1000:.2f} / "
                         f"{d[-1] * 1000:.2f} ms")
    failed = [f"  {labels['call']}: {labels['error']} x{value:.0f}" for name, labels, value in samples
              if name == "tfprofd_nvml_errors_total"]
    lines.append("NVML calls that failed:" + ("\n" + "\n".join(failed) if failed else " none"))
    warnings = [line for line in log.splitlines() if "level=warning" in line or "level=error" in line]
    lines.append("agent warnings:" + ("\n  " + "\n  ".join(warnings) if warnings else " none"))
    lines.append("GPU series:")
    lines += [f"  {line}" for line in text.splitlines() if SERIES.match(line)]
    return "\n".join(lines) + "\n"


def _median(values: list[float]) -> float:
    return sorted(values)[len(values) // 2] if values else float("nan")


def _values(scrapes: list[list[tuple[str, dict[str, str], float]]], metric: str, **match: str) -> list[float]:
    return [v for samples in scrapes for name, labels, v in samples
            if name == metric and all(labels.get(k, "") == want for k, want in match.items())]


def summarize_workload(scrapes: list[tuple[float, str]], phases: list[dict]) -> str:
    """Per workload phase: GPU 0's readings, the job's throughput and step time, and its gpu_job_info series."""
    lines = ["workload on GPU 0 (bench/gpu_workload.py; the first 3 s of each phase left out as warm-up):"]
    for phase, following in itertools.pairwise(phases):
        taken = [parse(text) for at, text in scrapes if phase["time"] + 3 <= at <= following["time"]]
        utilization = _values(taken, "tfprofd_gpu_utilization_ratio", gpu="0")
        sm_activity = _values(taken, "tfprofd_gpu_sm_activity_ratio", gpu="0", gpu_instance_id="")
        throughput = _values(taken, "tfprofd_training_samples_per_second")
        sums = _values(taken, "tfprofd_training_step_duration_seconds_sum")
        counts = _values(taken, "tfprofd_training_step_duration_seconds_count")
        steps = counts[-1] - counts[0] if len(counts) > 1 else 0
        mean_step = (sums[-1] - sums[0]) / steps if steps > 0 else float("nan")
        attributed = sorted({f"{labels['training_job']}/{labels['worker']} on GPU {labels['gpu']}"
                             for samples in taken for name, labels, _ in samples if name == "tfprofd_gpu_job_info"})
        lines.append(
            f"  {phase['phase']:7s} {len(taken)} scrapes: utilization median {_median(utilization):.2f}, SM activity "
            f"median {_median(sm_activity):.2f}, samples/s median {_median(throughput):.0f}, mean step "
            f"{mean_step * 1000:.1f} ms, gpu_job_info: {', '.join(attributed) or 'none'}")
    return "\n".join(lines) + "\n"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("step", choices=("build", "run"))
    parser.add_argument("--seconds", type=float, default=60)
    parser.add_argument("--out", type=Path, default=Path(os.environ["OUT"]) if os.environ.get("OUT") else None)
    parser.add_argument("--site", type=Path, default=SITE, help="where `build` put the agent (run only)")
    parser.add_argument("--workload", type=float, default=20, metavar="SECONDS",
                        help="run a PyTorch job on GPU 0 this long per phase (0: none)")
    parser.add_argument("--jobs", type=int, default=0,
                        help="simulated jobs reporting over UDP during the run; prints the agent's CPU")
    parser.add_argument("--unix", action="store_true", help="the simulated jobs report over the hook's Unix socket")
    parser.add_argument("--pods", action="store_true",
                        help="the simulated jobs report over UDP from a network namespace of their own, as pods do "
                             "(root and ip(8))")
    options = parser.parse_args()
    if options.jobs < 0:
        parser.error(f"--jobs must be 0 or more, not {options.jobs}")
    if (options.unix or options.pods) and not options.jobs:
        parser.error("--unix and --pods say how the --jobs report: give --jobs N too")
    if options.unix and options.pods:
        parser.error("--unix and --pods are two ways to report: give one")
    return build() if options.step == "build" else run(options.seconds, options.out, options.site, options.workload,
                                                        options.jobs, options.unix, options.pods)


if __name__ == "__main__":
    sys.exit(main())
