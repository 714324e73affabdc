"""Capture records and their directories on disk, written so that nobody else's file is ever touched.

Layout under the state directory::

    records/<id>.json      one record per capture; the directory is 0700 (only the agent writes there)
    captures/<id>/...      the capture's trace (and xprof's viewer cache), group-readable

Ids have the agent's own format and must equal the record's file name. Every path is reached through
``StateDir`` (statedir.py): relative to directory descriptors, never through a link, and refused if a
member of the state directory's group swapped it. A record file that is unreadable or wrong is set aside
(``.bad-<time>``), named in the log, and the agent starts anyway. Deleting a capture walks its directory
by file descriptor, only if the agent owns it, and counts only the bytes it really freed.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import re
import secrets
import stat
import tempfile
import threading
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from prometheus_client.core import Metric

from .analysis.model import CaptureAnalysis
from .hostcontext import HostContext
from .statedir import StateDir, mkdir_at

log = logging.getLogger("tfprofd.records")

ID = re.compile(r"^\d{8}T\d{6}Z-[0-9a-f]{6}$")
TRIGGERS = ("rule", "alert", "manual", "baseline")
ACTIVE = ("running", "analyzing")
FINISHED = ("done", "failed", "analysis_failed", "discarded")  # discarded: taken on pending, the rule never fired


@dataclass
class CaptureRecord:
    id: str
    trigger: str
    job: str
    targets: list[dict[str, str]]
    requested_at: float
    duration_ms: int
    mode: str
    rule: str | None = None
    alert: str | None = None
    gpu: str | None = None
    status: str = "running"
    reason: str | None = None
    detail: str | None = None
    started_at: float | None = None
    finished_at: float | None = None
    files: list[str] = field(default_factory=list)
    bytes: int = 0
    directory: str = ""
    analysis: CaptureAnalysis | None = None
    context: dict[str, Any] | None = None  # the job's samples/s and batch size when the capture was asked for
    host: HostContext | None = None  # what the host was doing over the capture window (hostcontext.py)

    def public(self) -> dict[str, Any]:
        out = {name: value for name, value in asdict(self).items() if name != "analysis"}
        out["analysis"] = self.analysis.to_json() if self.analysis is not None else None
        return out

    @classmethod
    def from_dict(cls, data: Any) -> CaptureRecord:
        """A record from its JSON; raises ValueError naming the first field that is wrong."""
        if not isinstance(data, dict):
            raise ValueError(f"expected a JSON object, got {type(data).__name__}")
        kinds: dict[str, tuple[type, ...]] = {
            "id": (str,), "trigger": (str,), "job": (str,), "targets": (list,), "requested_at": (int, float),
            "duration_ms": (int,), "mode": (str,), "rule": (str, type(None)), "alert": (str, type(None)),
            "gpu": (str, type(None)), "status": (str,), "reason": (str, type(None)), "detail": (str, type(None)),
            "started_at": (int, float, type(None)), "finished_at": (int, float, type(None)), "files": (list,),
            "bytes": (int,), "directory": (str,), "analysis": (dict, type(None)), "context": (dict, type(None)),
            "host": (dict, type(None))}
        required = {"id", "trigger", "job", "targets", "requested_at", "duration_ms", "mode"}
        values = {}
        for name, types in kinds.items():
            if name not in data:
                if name in required:
                    raise ValueError(f"field {name!r} is missing")
                continue
            value = data[name]
            if isinstance(value, bool) or not isinstance(value, types):
                raise ValueError(f"field {name!r} has the wrong type ({type(value).__name__})")
            values[name] = value
        if not ID.fullmatch(values["id"]):
            raise ValueError(f"id {values['id']!r} is not a capture id")
        if values["trigger"] not in TRIGGERS or values["status"] not in (*ACTIVE, *FINISHED):
            raise ValueError(f"unknown trigger or status ({values['trigger']!r}, {values['status']!r})")
        if not all(isinstance(t, dict) and all(isinstance(v, str) for v in t.values()) for t in values["targets"]):
            raise ValueError("field 'targets' must be a list of objects of strings")
        if not all(isinstance(f, str) for f in values.get("files", [])):
            raise ValueError("field 'files' must be a list of strings")
        if values.get("host") is not None:
            values["host"] = HostContext.from_json(values["host"])
        if values.get("analysis") is not None:
            values["analysis"] = CaptureAnalysis.from_json(values["analysis"])
        return cls(**values)


def new_id(now: float) -> str:
    return time.strftime("%Y%m%dT%H%M%SZ", time.gmtime(now)) + "-" + secrets.token_hex(3)


def make_dir(path: Path, mode: int, exist_ok: bool = False) -> None:
    """Create a directory with exactly ``mode`` (never world-writable), whatever the umask (``mkdir_at``)."""
    mkdir_at(None, path, mode, exist_ok)


def write_private(path: Path, data: bytes, mode: int = 0o600) -> None:
    """Write a file atomically: a fresh mkstemp file beside it (O_EXCL, never a planted link), renamed in."""
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, mode)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


def read_nofollow(path: Path, limit: int = 16 * 1024 * 1024) -> bytes:
    """A regular file's bytes, refusing a symbolic link or anything that is not a regular file."""
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    with os.fdopen(fd, "rb") as f:
        st = os.fstat(f.fileno())
        if not stat.S_ISREG(st.st_mode):
            raise OSError(f"{path} is not a regular file")
        if st.st_uid != os.geteuid():
            raise OSError(f"{path} is owned by uid {st.st_uid}, not by the agent's user (uid {os.geteuid()})")
        data = f.read(limit + 1)
    if len(data) > limit:
        raise OSError(f"{path} is larger than {limit} bytes")
    return data


def set_aside(path: Path, why: str) -> None:
    """Rename a bad state file out of the way, keeping it for a person to look at."""
    aside = path.with_name(f"{path.name}.bad-{time.strftime('%Y%m%dT%H%M%S')}")
    try:
        os.rename(path, aside)
        log.error("%s: %s; set aside as %s, starting without it", path, why, aside.name)
    except OSError as exc:
        log.error("%s: %s; could not set it aside (%s), ignoring it", path, why, exc)


class RecordStore:
    """Owns ``records/`` and ``captures/`` under the state directory, reached only through ``StateDir``."""

    def __init__(self, state_dir: Path):
        self.state = StateDir(state_dir)
        self.records_dir = state_dir / "records"
        self.captures_dir = state_dir / "captures"
        self.state.ensure_dir("records", 0o700)
        self.state.ensure_dir("captures", 0o750)
        self._lock = threading.Lock()

    def capture_dir(self, capture_id: str) -> Path:
        if not ID.fullmatch(capture_id):
            raise ValueError(f"{capture_id!r} is not a capture id")
        return self.captures_dir / capture_id

    def create_capture_dir(self, capture_id: str, mode: int) -> Path:
        """The new capture's directory; raises OSError (StateDirSwapped if ``captures`` was swapped)."""
        return self.state.make_subdir("captures", self.capture_dir(capture_id).name, mode)

    def capture_bytes(self, capture_id: str) -> int:
        """Bytes of the capture's files (0 if its directory is not the agent's own)."""
        return self.state.tree_bytes("captures", self.capture_dir(capture_id).name)

    def save(self, record: CaptureRecord) -> None:
        name = f"{self.capture_dir(record.id).name}.json"
        with self._lock:
            self.state.write("records", name, json.dumps(record.public(), indent=1, sort_keys=True).encode())

    def load(self) -> Iterator[CaptureRecord]:
        """Every valid record; bad ones are set aside with the reason."""
        for name in self.state.names("records"):
            if not name.endswith(".json") or name.startswith("."):
                continue
            try:
                record = CaptureRecord.from_dict(json.loads(self.state.read("records", name)))
                if record.id != name[:-len(".json")]:
                    raise ValueError(f"its id {record.id!r} is not its file name")
            except (OSError, ValueError, UnicodeDecodeError, RecursionError) as exc:
                self._set_aside(name, f"not a valid capture record: {exc}")
                continue
            record.directory = str(self.capture_dir(record.id))  # never trust a stored path
            yield record

    def _set_aside(self, name: str, why: str) -> None:
        aside = f"{name}.bad-{time.strftime('%Y%m%dT%H%M%S')}"
        try:
            self.state.rename("records", name, aside)
            log.error("%s: %s; set aside as %s, starting without it", self.records_dir / name, why, aside)
        except OSError as exc:
            log.error("%s: %s; could not set it aside (%s), ignoring it", self.records_dir / name, why, exc)

    def delete(self, record: CaptureRecord) -> int:
        """Remove a capture's directory and its record; the bytes freed. What cannot go is logged; a directory
        that is not the agent's own (swapped) is left alone, and the record with it."""
        try:
            freed, left = self.state.remove_tree("captures", self.capture_dir(record.id).name)
        except OSError as exc:
            log.error("capture %s: not deleted: %s", record.id, exc)
            return 0
        for problem in left[:5]:
            log.warning("capture %s: could not delete %s", record.id, problem)
        if len(left) > 5:
            log.warning("capture %s: %d more paths could not be deleted", record.id, len(left) - 5)
        try:
            with self._lock:
                self.state.unlink("records", f"{record.id}.json")
        except OSError as exc:
            log.error("capture %s: its record was not deleted: %s", record.id, exc)
        return freed

    def collect(self) -> Iterator[Metric]:
        return self.state.collect()
