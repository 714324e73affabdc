"""The agent captures and analyses a job on a real GPU: ``make gpu-check``'s capture part.

``build`` (where pip reaches an index) downloads xprof's wheel into ``.gpu-check/wheels`` (32 MB, for the
GPU machine's Python 3.12): the agent's analysis needs xprof, which the GPU machine lacks; its other needs
(gRPC, protobuf, NumPy) are there. ``run`` (on the GPU machine, after ``gpu_check.py build``) installs that
wheel into a temporary directory, starts the real agent against the real NVML with ``.gpu-check/site`` and
xprof on its path, and runs ``bench/gpu_jax_job.py`` (JAX with CUDA: the machine has no TensorFlow, and JAX's
profiler server is TensorFlow's) through the hook. In each of the job's phases it asks the agent's API for a
capture of the job, as a user's ``curl`` does, waits for the analysis, and prints what the record says: status,
steps, step time, the GPU's busy share, the bottleneck and its reason. It writes each record and each trace
(xz) to ``$OUT`` (or ``--out``). Then it says whether the job lived (it exits 0) and lists every record, the
rules' own captures on pending too. Exits 1 where a capture did not end ``done`` or the job died.
"""

from __future__ import annotations

import argparse
import json
import lzma
import os
import re
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path

from gpu_check import ROOT, SITE, free_ports, serving

WHEELS = ROOT / ".gpu-check" / "wheels"
PLATFORMS = ("manylinux_2_27_x86_64", "manylinux_2_17_x86_64", "manylinux2014_x86_64")


def build() -> int:
    """xprof's wheel, of the version pyproject.toml pins, for the GPU machine's Python."""
    pin = re.search(r'"(xprof==[^"]+)"', (ROOT / "pyproject.toml").read_text())
    if pin is None:
        raise SystemExit("pyproject.toml pins no xprof version")
    shutil.rmtree(WHEELS, ignore_errors=True)
    platforms = [arg for platform in PLATFORMS for arg in ("--platform", platform)]
    subprocess.run([sys.executable, "-m", "pip", "download", "--quiet", "--disable-pip-version-check", "--no-deps",
                    "--only-binary", ":all:", "--python-version", "3.12", "--implementation", "cp", *platforms,
                    "--dest", str(WHEELS), pin[1]], check=True)
    size = sum(f.stat().st_size for f in WHEELS.iterdir())
    print(f"built {WHEELS.relative_to(ROOT)}: {size / 2**20:.1f} MB")
    return 0


def xprof_site(tmp: Path) -> list[str]:
    """Where the agent finds xprof: nowhere extra if this Python has it, else the wheel installed under tmp."""
    try:
        import xprof  # noqa: F401
        return []
    except ImportError:
        pass
    wheels = sorted(WHEELS.glob("xprof-*.whl"))
    if not wheels:
        raise SystemExit(f"no xprof here and no wheel in {WHEELS}: run `python3 bench/gpu_capture.py build` "
                         "where pip can reach an index")
    target = tmp / "xprof-site"
    subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", "--disable-pip-version-check", "--no-index",
                    "--no-deps", "--no-compile", "--target", str(target), *map(str, wheels)], check=True)
    return [str(target)]


def api(port: int, token: str, path: str, body: dict | None = None) -> tuple[int, dict]:
    request = urllib.request.Request(f"http://127.0.0.1:{port}{path}", method="POST" if body is not None else "GET",
                                     data=json.dumps(body).encode() if body is not None else None,
                                     headers={"Authorization": f"Bearer {token}"})
    try:
        with urllib.request.urlopen(request, timeout=30) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read() or b"{}")


def capture(port: int, token: str, job: str, duration_ms: int, deadline: float) -> dict:
    """One capture of the job through the API, waited for until its analysis ends (or the deadline passes)."""
    while True:
        status, answer = api(port, token, "/api/v1/captures", {"job": job, "duration_ms": duration_ms})
        if status == 202:
            break
        if status not in (404, 409) or time.monotonic() > deadline:  # 404: the job's first report not in yet
            raise SystemExit(f"capture refused: {status} {answer}")
        time.sleep(0.5)
    while True:
        status, record = api(port, token, answer["url"])
        if record.get("status") not in ("running", "analyzing") or time.monotonic() > deadline:
            return record
        time.sleep(0.5)


def describe(record: dict) -> str:
    lines = [f"  record {record['id']}: {record['status']}"
             + (f" ({record['reason']}: {record.get('detail')})" if record.get("reason") else "")
             + f", {record['bytes'] / 1e6:.1f} MB"]
    for worker in (record.get("analysis") or {}).get("workers", []):
        step = worker.get("step_time_ms") or {}
        ratios = worker.get("ratios") or {}
        busy = [f"{d['name']} busy {d['busy']:.0%}" for d in worker.get("devices", []) if d.get("busy") is not None]
        lines.append(f"  {worker['steps']} steps, mean {step.get('mean', float('nan')):.1f} ms, "
                     f"device idle {ratios.get('device_idle')}, {', '.join(busy) or 'no GPU busy share'}; "
                     f"hardware: {worker.get('hardware') or '?'}")
        lines.append(f"  bottleneck: {worker['bottleneck']}: {worker['why']}")
        lines.append(f"  xprof: {worker.get('xprof_conclusion')}")
    host = record.get("host")
    if host:
        lines.append(f"  host: {json.dumps(host)[:300]}")
    return "\n".join(lines)


def run(seconds: float, duration_ms: int, out: Path | None, python: str) -> int:
    if not (SITE / "tfprofd").is_dir():
        print(f"{SITE} is missing: run `python3 bench/gpu_check.py build` where pip can reach an index",
              file=sys.stderr)
        return 2
    if subprocess.run([python, "-c", "import jax"], capture_output=True).returncode != 0:
        print(f"no JAX for {python} on this machine: the capture part is skipped", file=sys.stderr)
        return 0
    with tempfile.TemporaryDirectory(prefix="tfprofd-gpu-capture-") as tmp:  # the agent's state and log, then gone
        return run_in(Path(tmp), seconds, duration_ms, out, python)


def run_in(tmp: Path, seconds: float, duration_ms: int, out: Path | None, python: str) -> int:
    port, api_port, hook_port, profiler_port = free_ports(socket.SOCK_STREAM, socket.SOCK_STREAM, socket.SOCK_DGRAM,
                                                         socket.SOCK_STREAM)
    state = tmp / "state"
    args = [sys.executable, "-m", "tfprofd.daemon", "run", "--listen", f"127.0.0.1:{port}",
            "--api.listen", f"127.0.0.1:{api_port}", "--hook.listen", f"127.0.0.1:{hook_port}",
            "--hook.socket", str(tmp / "hook.sock"), "--state-dir", str(state), "--interval", "1s",
            "--captures.baseline", "false"]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(SITE), *xprof_site(tmp)]), "PYTHONUNBUFFERED": "1"}
    env.pop("TFPROFD_CONFIG", None)
    log_path = tmp / "agent.log"
    failed = on_gpu = False
    with open(log_path, "wb") as log:
        agent = subprocess.Popen(args, env=env, stdout=log, stderr=subprocess.STDOUT)
        job = None
        try:
            if not serving(agent, port, log_path):
                return 1
            token = (state / "api.token").read_text().strip()
            job = subprocess.Popen([python, str(ROOT / "bench" / "gpu_jax_job.py"), "--addr",
                                    f"unix:{tmp / 'hook.sock'}", "--site", str(SITE), "--seconds", str(seconds),
                                    "--profiler-port", str(profiler_port)], stdout=subprocess.PIPE, text=True)
            for want in ("compute", "input"):
                line = job.stdout.readline()
                if not line:
                    print(f"the job ended before its {want} phase", flush=True)
                    failed = True
                    break
                phase = json.loads(line)
                on_gpu = phase["backend"] == "gpu"
                print(f"phase {phase['phase']} on {phase['device']} ({phase['backend']})", flush=True)
                time.sleep(min(3.0, seconds / 4))  # past the phase's first steps
                record = capture(api_port, token, "gpu-check-jax", duration_ms,
                                 time.monotonic() + seconds * 0.7 + 240)
                print(describe(record), flush=True)
                failed |= record["status"] != "done"
                if out is not None:
                    out.mkdir(parents=True, exist_ok=True)
                    (out / f"{want}.record.json").write_text(json.dumps(record, indent=1))
                    for path in (state / "captures" / record["id"]).rglob("*.xplane.pb"):
                        (out / f"{want}.xplane.pb.xz").write_bytes(lzma.compress(path.read_bytes()))
            job.communicate(timeout=seconds * 2 + 60)
            print(f"the job exited {job.returncode}" + ("" if job.returncode == 0 else ": it died (see its output)"))
            failed |= job.returncode != 0
            _, listed = api(api_port, token, "/api/v1/captures")
            print("every record (the rules' captures too):")
            for r in listed["captures"]:
                workers = (r.get("analysis") or {}).get("workers", [])
                ring = (r.get("context") or {}).get("mode") == "snapshots"
                failed |= on_gpu and ring  # continuous profiling kills GPU jobs: never armed on a GPU host
                print(f"  {r['id']} {r['trigger']} {r.get('rule') or ''} {r['status']} mode="
                      f"{(r.get('context') or {}).get('mode', 'capture')} "
                      f"{(r.get('context') or {}).get('mode_reason', '')} "
                      f"{' '.join(w['bottleneck'] for w in workers)}")
        finally:
            if job is not None and job.poll() is None:
                job.kill()
            agent.terminate()
            try:
                agent.wait(10)
            except subprocess.TimeoutExpired:
                agent.kill()
                agent.wait()
    warnings = [line for line in log_path.read_text().splitlines() if "level=warning" in line or "level=error" in line]
    print("agent warnings:" + ("\n  " + "\n  ".join(warnings) if warnings else " none"))
    if out is not None:
        (out / "capture-agent.log").write_text(log_path.read_text())
    return 1 if failed else 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("step", choices=("build", "run"))
    parser.add_argument("--seconds", type=float, default=20, help="each phase of the job")
    parser.add_argument("--duration-ms", type=int, default=2000, help="each capture")
    parser.add_argument("--python", default="python3", help="the job's interpreter (it needs JAX)")
    parser.add_argument("--out", type=Path, default=Path(os.environ["OUT"]) if os.environ.get("OUT") else None)
    options = parser.parse_args()
    if options.step == "build":
        return build()
    return run(options.seconds, options.duration_ms, options.out, options.python)


if __name__ == "__main__":
    sys.exit(main())
