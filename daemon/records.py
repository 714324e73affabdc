"""Capture records and their directories on disk, written so that nobody else's file is ever touched.

Layout under the state directory::

    records/<id>.json      one record per capture; the directory is 0700 (only the agent writes there)
    captures/<id>/...      the capture's trace (and xprof's viewer cache), group-readable

Ids have the agent's own format and must equal the record's file name. Files are written through a
``mkstemp`` file renamed into place and read with ``O_NOFOLLOW``; a record file that is unreadable or
wrong is set aside (``.bad-<time>``), named in the log, and the agent starts anyway. Deleting a capture
walks its directory by file descriptor: it never follows a link, never leaves the directory, and
counts only the bytes it really freed.
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

from .analysis.model import CaptureAnalysis

log = logging.getLogger("tfprofd.records")

ID = re.compile(r"^\d{8}T\d{6}Z-[0-9a-f]{6}$")
TRIGGERS = ("rule", "alert", "manual", "baseline")
ACTIVE = ("running", "analyzing")
FINISHED = ("done", "failed", "analysis_failed")
_UMASK_LOCK = threading.Lock()


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
            "bytes": (int,), "directory": (str,), "analysis": (dict, type(None)), "context": (dict, type(None))}
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
        if not ID.match(values["id"]):
            raise ValueError(f"id {values['id']!r} is not a capture id")
        if values["trigger"] not in TRIGGERS or values["status"] not in (*ACTIVE, *FINISHED):
            raise ValueError(f"unknown trigger or status ({values['trigger']!r}, {values['status']!r})")
        if not all(isinstance(t, dict) and all(isinstance(v, str) for v in t.values()) for t in values["targets"]):
            raise ValueError("field 'targets' must be a list of objects of strings")
        if not all(isinstance(f, str) for f in values.get("files", [])):
            raise ValueError("field 'files' must be a list of strings")
        if values.get("analysis") is not None:
            values["analysis"] = CaptureAnalysis.from_json(values["analysis"])
        return cls(**values)


def new_id(now: float) -> str:
    return time.strftime("%Y%m%dT%H%M%SZ", time.gmtime(now)) + "-" + secrets.token_hex(3)


def make_dir(path: Path, mode: int, exist_ok: bool = False) -> None:
    """Create a directory with exactly ``mode`` (never world-writable), whatever the umask.

    No chmod: a setgid parent passes its bit on by itself, and a chmod that keeps it would be refused
    under systemd's RestrictSUIDSGID. The umask is narrowed only to let ``mode``'s own bits through,
    and always keeps other users' write bit, so another thread's file never comes out world-writable.
    """
    if mode & 0o7002:
        raise ValueError(f"mode {mode:o}: no world-write, setuid, setgid or sticky bit")
    with _UMASK_LOCK:
        old = os.umask(~mode & 0o777 | 0o002)
        try:
            os.mkdir(path, mode)
        except FileExistsError:
            if not exist_ok:
                raise
            st = os.lstat(path)
            if not stat.S_ISDIR(st.st_mode):
                raise NotADirectoryError(f"{path} exists and is not a directory") from None
        finally:
            os.umask(old)


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
        if not stat.S_ISREG(os.fstat(f.fileno()).st_mode):
            raise OSError(f"{path} is not a regular file")
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


def tree_bytes(path: Path) -> int:
    """Bytes of the regular files under ``path``, not following links."""
    total = 0
    try:
        for _, _, files, dir_fd in os.fwalk(path, follow_symlinks=False):
            for name in files:
                with contextlib.suppress(OSError):
                    st = os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
                    if stat.S_ISREG(st.st_mode):
                        total += st.st_size
    except OSError:
        pass
    return total


def remove_tree(path: Path) -> tuple[int, list[str]]:
    """Delete a directory tree without following links or leaving it; (bytes freed, what could not go)."""
    freed, left = 0, []
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return 0, []
    if not stat.S_ISDIR(st.st_mode):
        return 0, [f"{path}: not a directory, left alone"]
    for dirpath, dirnames, files, dir_fd in os.fwalk(path, topdown=False, follow_symlinks=False,
                                                      onerror=lambda e: left.append(f"{e.filename}: {e.strerror}")):
        for name in files:
            try:
                st = os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
                os.unlink(name, dir_fd=dir_fd)
                if stat.S_ISREG(st.st_mode) and st.st_nlink == 1:
                    freed += st.st_size  # a file with another hard link frees nothing
            except OSError as exc:
                left.append(f"{dirpath}/{name}: {exc.strerror}")
        for name in dirnames:
            try:
                if stat.S_ISLNK(os.stat(name, dir_fd=dir_fd, follow_symlinks=False).st_mode):
                    os.unlink(name, dir_fd=dir_fd)
                else:
                    os.rmdir(name, dir_fd=dir_fd)
            except OSError as exc:
                left.append(f"{dirpath}/{name}: {exc.strerror}")
    try:
        os.rmdir(path)
    except OSError as exc:
        left.append(f"{path}: {exc.strerror}")
    return freed, left


class RecordStore:
    """Owns ``records/`` and ``captures/`` under the state directory."""

    def __init__(self, state_dir: Path):
        self.records_dir = state_dir / "records"
        self.captures_dir = state_dir / "captures"
        make_dir(self.records_dir, 0o700, exist_ok=True)
        make_dir(self.captures_dir, 0o750, exist_ok=True)
        for directory in (self.records_dir, self.captures_dir):
            st = os.lstat(directory)
            if st.st_uid != os.geteuid() or st.st_mode & 0o002:
                raise PermissionError(f"{directory} must be owned by the agent's user and not world-writable")
        self._lock = threading.Lock()

    def capture_dir(self, capture_id: str) -> Path:
        if not ID.match(capture_id):
            raise ValueError(f"{capture_id!r} is not a capture id")
        return self.captures_dir / capture_id

    def create_capture_dir(self, capture_id: str, mode: int) -> Path:
        path = self.capture_dir(capture_id)
        make_dir(path, mode)
        return path

    def save(self, record: CaptureRecord) -> None:
        path = self.records_dir / f"{self.capture_dir(record.id).name}.json"
        with self._lock:
            write_private(path, json.dumps(record.public(), indent=1, sort_keys=True).encode())

    def load(self) -> Iterator[CaptureRecord]:
        """Every valid record; bad ones are set aside with the reason."""
        for path in sorted(self.records_dir.glob("*.json")):
            try:
                record = CaptureRecord.from_dict(json.loads(read_nofollow(path)))
                if record.id != path.stem:
                    raise ValueError(f"its id {record.id!r} is not its file name")
            except (OSError, ValueError, UnicodeDecodeError, RecursionError) as exc:
                set_aside(path, f"not a valid capture record: {exc}")
                continue
            record.directory = str(self.capture_dir(record.id))  # never trust a stored path
            yield record

    def delete(self, record: CaptureRecord) -> int:
        """Remove a capture's directory and its record; the bytes freed. What cannot go is logged."""
        freed, left = remove_tree(self.capture_dir(record.id))
        for problem in left[:5]:
            log.warning("capture %s: could not delete %s", record.id, problem)
        if len(left) > 5:
            log.warning("capture %s: %d more paths could not be deleted", record.id, len(left) - 5)
        with self._lock, contextlib.suppress(FileNotFoundError):
            os.unlink(self.records_dir / f"{record.id}.json")
        return freed
