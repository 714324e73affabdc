"""The recorded scenario corpus: small CPU traces crossing each source of steps with each cause a CPU trace can
show, made by tests/jobs/corpus.py and kept xz-compressed in tests/fixtures/traces/corpus/.

``python tests/corpus.py [NAME...]`` (or ``RECORD_TRACES=1 .venv/bin/pytest tests/test_corpus.py``) records
them again, on a quiet machine; tests/fixtures/traces/README.md says where and with what they were made.

Host contention is a cause a trace cannot show alone: its cases (``-contended``) are recorded with CPU hogs
(``python3 -c "while True: pass"``, one per CPU) beside the job, and keep beside the trace, in ``NAME.host.json``,
the ``HostContext`` the agent would have measured over the capture window: the recorder reads the window's edges
with tfprofd.daemon.hostcontext (the job's process and its threads against every other process) when the job
says its profiling session opens and closes.
"""

from __future__ import annotations

import json
import lzma
import os
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from tfprofd.daemon.hostcontext import Edge, HostContext, measure, read_edge
from tfprofd.exporter.base import HostPaths

TESTS = Path(__file__).parent
CORPUS = TESTS / "fixtures" / "traces" / "corpus"
JOB = TESTS / "jobs" / "corpus.py"


@dataclass(frozen=True)
class Case:
    source: str  # tests/jobs/corpus.py's SOURCES
    cause: str  # tests/jobs/corpus.py's CAUSES
    steps_per_execution: int = 1
    seconds: float = 1.0  # profiled, about
    read_delay: float | None = None  # the input cause's read wait per batch, if not the job's default
    hogs: int = 0  # CPU-bound processes beside the job (the host contention cases)

    @property
    def name(self) -> str:
        spe = f"-spe{self.steps_per_execution}" if self.steps_per_execution > 1 else ""
        return f"{self.source}{spe}-{self.cause}" + ("-contended" if self.hogs else "")

    @property
    def path(self) -> Path:
        return CORPUS / f"{self.name}.xplane.pb.xz"

    @property
    def host_path(self) -> Path:
        """The host context over the capture window (contended cases only)."""
        return CORPUS / f"{self.name}.host.json"

    def host(self) -> HostContext:
        return HostContext.from_json(json.loads(self.host_path.read_text()))


KERAS_SOURCES = ("hook_keras3", "hook_tf_keras", "keras3_tensorboard", "tf_keras_fit")
# Seconds profiled per cause: traces of many short steps are kept short (their size grows with the steps).
SECONDS = {"input": 1.0, "callback": 1.0, "compute": 0.5, "small_batch": 0.25}
CASES = (
    *(Case(source, cause, seconds=SECONDS[cause])
      for source in (*KERAS_SOURCES, "custom_unmarked") for cause in ("input", "callback", "compute", "small_batch")),
    # steps_per_execution=8: one marker per 8 steps run in a while loop (an input wait of 50 ms per step)
    *(Case(source, cause, 8, seconds=2.0, read_delay=0.05 if cause == "input" else None)
      for source in KERAS_SOURCES for cause in ("input", "compute")),
    # host contention: the compute job (CPU-bound steps) with a CPU hog per CPU beside it
    *(Case(source, "compute", seconds=SECONDS["compute"], hogs=os.cpu_count() or 2)
      for source in ("hook_keras3", "tf_keras_fit", "custom_unmarked")),
)


def record(case: Case) -> dict:
    """Run the job (beside case.hogs CPU hogs), keep its trace compressed at case.path and, with hogs, the host
    context over its capture window at case.host_path; what the job printed."""
    with tempfile.TemporaryDirectory(prefix="tfprofd-corpus-") as tmp:
        args = [sys.executable, str(JOB), case.source, case.cause, tmp, "--seconds", str(case.seconds),
                "--steps-per-execution", str(case.steps_per_execution)]
        if case.read_delay is not None:
            args += ["--read-delay", str(case.read_delay)]
        if case.hogs:
            args.append("--window-ack")
        hogs = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(case.hogs)]
        try:
            printed, host = run_job(args, Path(tmp) / "stderr", measured=bool(case.hogs))
        finally:
            for hog in hogs:
                hog.kill()
                hog.wait()
        made = list(Path(tmp).glob("**/plugins/profile/*/*.xplane.pb"))
        if len(made) != 1:
            raise RuntimeError(f"{case.name}: expected one trace, found {made}")
        CORPUS.mkdir(parents=True, exist_ok=True)
        case.path.write_bytes(lzma.compress(made[0].read_bytes(), preset=9 | lzma.PRESET_EXTREME))
        if host is not None:
            if host.contention is None or not {h.pid for h in hogs} & {o.pid for o in host.top_others}:
                raise RuntimeError(f"{case.name}: the hogs (pids {[h.pid for h in hogs]}) did not starve the job: "
                                   f"{host.lines()}")
            case.host_path.write_text(json.dumps(host.to_json(), indent=1) + "\n")
    return json.loads(printed[-1])


def run_job(args: list[str], stderr: Path, measured: bool) -> tuple[list[str], HostContext | None]:
    """Run the job; the lines it printed and, if ``measured``, the host context between its window lines (read
    as the agent reads a capture window's edges: the job's process and its threads, no tfprofd processes)."""
    edges: dict[str, Edge] = {}
    printed: list[str] = []
    with stderr.open("w+") as err:
        job = subprocess.Popen(args, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=err, text=True)
        timer = threading.Timer(300, job.kill)
        timer.start()
        try:
            for line in job.stdout:
                printed.append(line.strip())
                if measured and line.startswith('{"window"'):
                    edges[json.loads(line)["window"]] = read_edge(HostPaths(), [job.pid], None, time.monotonic())
                    job.stdin.write("\n")  # the edge is read: the job goes on
                    job.stdin.flush()
            code = job.wait()
        finally:
            timer.cancel()
            job.kill()
            job.stdin.close()
        if code != 0:
            err.seek(0)
            raise RuntimeError(f"{args[2]} {args[3]}: exit {code}: {err.read()[-3000:]}")
    if not measured:
        return printed, None
    if set(edges) != {"open", "closed"}:
        raise RuntimeError(f"{args[2]} {args[3]}: the job did not say when its capture window opened and closed")
    return printed, measure(edges["open"], edges["closed"], os.sysconf("SC_CLK_TCK"), job_visible=True)


def unpack(case: Case, into: Path) -> Path:
    """The case's trace as a TensorBoard log directory under ``into`` (as a capture or Keras leaves one)."""
    run = into / case.name / "plugins" / "profile" / "recorded"
    run.mkdir(parents=True)
    (run / "localhost.xplane.pb").write_bytes(lzma.decompress(case.path.read_bytes()))
    return into / case.name


if __name__ == "__main__":
    wanted = set(sys.argv[1:])
    for c in CASES:
        if not wanted or c.name in wanted:
            made = record(c)
            host = f", host: {c.host().contention.why}" if c.hogs else ""
            print(f"{c.name}: {c.path.stat().st_size} bytes, {made}{host}", flush=True)
