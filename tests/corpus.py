"""The recorded scenario corpus: small CPU traces crossing each source of steps with each cause a CPU trace can
show, made by tests/jobs/corpus.py and kept xz-compressed in tests/fixtures/traces/corpus/.

``python tests/corpus.py [NAME...]`` (or ``RECORD_TRACES=1 .venv/bin/pytest tests/test_corpus.py``) records
them again, on a quiet machine; tests/fixtures/traces/README.md says where and with what they were made.
"""

from __future__ import annotations

import json
import lzma
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

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

    @property
    def name(self) -> str:
        spe = f"-spe{self.steps_per_execution}" if self.steps_per_execution > 1 else ""
        return f"{self.source}{spe}-{self.cause}"

    @property
    def path(self) -> Path:
        return CORPUS / f"{self.name}.xplane.pb.xz"


KERAS_SOURCES = ("hook_keras3", "hook_tf_keras", "keras3_tensorboard", "tf_keras_fit")
# Seconds profiled per cause: traces of many short steps are kept short (their size grows with the steps).
SECONDS = {"input": 1.0, "callback": 1.0, "compute": 0.5, "small_batch": 0.25}
CASES = (
    *(Case(source, cause, seconds=SECONDS[cause])
      for source in (*KERAS_SOURCES, "custom_unmarked") for cause in ("input", "callback", "compute", "small_batch")),
    # steps_per_execution=8: one marker per 8 steps run in a while loop (an input wait of 50 ms per step)
    *(Case(source, cause, 8, seconds=2.0, read_delay=0.05 if cause == "input" else None)
      for source in KERAS_SOURCES for cause in ("input", "compute")),
)


def record(case: Case) -> dict:
    """Run the job, keep its trace compressed at case.path; what the job printed."""
    with tempfile.TemporaryDirectory(prefix="tfprofd-corpus-") as tmp:
        args = [sys.executable, str(JOB), case.source, case.cause, tmp, "--seconds", str(case.seconds),
                "--steps-per-execution", str(case.steps_per_execution)]
        if case.read_delay is not None:
            args += ["--read-delay", str(case.read_delay)]
        result = subprocess.run(args, capture_output=True, text=True, timeout=300)
        if result.returncode != 0:
            raise RuntimeError(f"{case.name}: {result.stderr[-3000:]}")
        made = list(Path(tmp).glob("**/plugins/profile/*/*.xplane.pb"))
        if len(made) != 1:
            raise RuntimeError(f"{case.name}: expected one trace, found {made}")
        CORPUS.mkdir(parents=True, exist_ok=True)
        case.path.write_bytes(lzma.compress(made[0].read_bytes(), preset=9 | lzma.PRESET_EXTREME))
    return json.loads(result.stdout.strip().splitlines()[-1])


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
            print(f"{c.name}: {c.path.stat().st_size} bytes, {made}", flush=True)
