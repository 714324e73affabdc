"""The state directory's files, opened relative to directory descriptors and never through a link.

The state directory may be writable by the agent's group (the chart's 2770 hostPath): a member can rename
what is in it and put a link, or a directory of their own, in its place. So the agent opens the state
directory once, and each directory under it by name relative to that descriptor (``O_NOFOLLOW |
O_DIRECTORY``), checking that it is the agent's own and the very directory (device, inode) it found first.
A directory that was swapped is refused (``StateDirSwapped``, logged and counted in
``tfprofd_state_dir_refused_total``), never followed. Files are created, read, renamed and deleted relative
to their directory's descriptor, and a capture's tree is deleted only if the agent owns its directory.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import secrets
import stat
import threading
from collections.abc import Iterator
from pathlib import Path

from prometheus_client.core import Metric

from tfprofd.exporter.base import counter

log = logging.getLogger("tfprofd.statedir")

REFUSED_KINDS = ("directory", "capture", "file")
MAX_DEPTH = 32  # a capture's tree is 4 deep (plugins/profile/<run>/<file>); deeper ones are left, reported
_DIR = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
_UMASK_LOCK = threading.Lock()


class StateDirSwapped(PermissionError):
    """A path under the state directory is a link, another user's, or not what the agent created there."""


class StateDir:
    """The agent's state directory, held open; every path below it is reached from its descriptor."""

    def __init__(self, path: Path):
        self.path = path
        self._fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)  # the operator's path, as configured
        self._known: dict[str, tuple[int, int]] = {}  # directory name -> (device, inode) when first opened
        self._lock = threading.Lock()
        self.refused = dict.fromkeys(REFUSED_KINDS, 0)
        self.last_refusal: str | None = None  # shown in /healthz

    def close(self) -> None:
        os.close(self._fd)

    def _refuse(self, kind: str, what: str, why: str) -> StateDirSwapped:
        with self._lock:
            self.refused[kind] += 1
        message = f"{self.path / what} {why}; refusing to follow it (another user may have swapped it)"
        log.error("%s", message)
        self.last_refusal = message
        return StateDirSwapped(errno.EPERM, message)

    # ---- directories ----

    def ensure_dir(self, name: str, mode: int) -> None:
        """Create the state directory's subdirectory ``name`` if missing, and remember which one it is."""
        mkdir_at(self._fd, name, mode, exist_ok=True)
        with self.open_dir(name):
            pass

    @contextlib.contextmanager
    def open_dir(self, name: str) -> Iterator[int]:
        """A descriptor of the subdirectory ``name``: the agent's own, the one it found first; else refused."""
        fd = self._open_owned_dir(self._fd, name, name, "directory")
        try:
            st = os.fstat(fd)
            with self._lock:
                known = self._known.setdefault(name, (st.st_dev, st.st_ino))
            if known != (st.st_dev, st.st_ino):
                raise self._refuse("directory", name, "is not the directory the agent made there (it was replaced)")
            yield fd
        finally:
            os.close(fd)

    def _open_owned_dir(self, parent: int, name: str, shown: str, kind: str) -> int:
        try:
            fd = os.open(name, _DIR, dir_fd=parent)
        except OSError as exc:
            if exc.errno in (errno.ELOOP, errno.ENOTDIR):
                raise self._refuse(kind, shown, "is a symbolic link or not a directory") from None
            raise
        st = os.fstat(fd)
        if st.st_uid != os.geteuid() or st.st_mode & stat.S_IWOTH:
            os.close(fd)
            raise self._refuse(kind, shown, f"is owned by uid {st.st_uid} or writable by every user, not the "
                                            f"agent's own (uid {os.geteuid()})")
        return fd

    def make_subdir(self, directory: str, name: str, mode: int) -> Path:
        """Create ``directory/name`` (it must not exist); its path, for the processes that write into it."""
        with self.open_dir(directory) as fd:
            mkdir_at(fd, name, mode)
        return self.path / directory / name

    # ---- files ----

    def write(self, directory: str, name: str, data: bytes, mode: int = 0o600) -> None:
        """Write ``directory/name`` atomically: a new file (O_EXCL, never a planted link) renamed over it."""
        with self.open_dir(directory) as fd:
            tmp = f".{name}.{secrets.token_hex(4)}"
            out = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, mode, dir_fd=fd)
            try:
                with os.fdopen(out, "wb") as f:
                    f.write(data)
                    f.flush()
                    os.fsync(f.fileno())
                os.replace(tmp, name, src_dir_fd=fd, dst_dir_fd=fd)
            except BaseException:
                with contextlib.suppress(OSError):
                    os.unlink(tmp, dir_fd=fd)
                raise

    def read(self, directory: str, name: str, limit: int = 16 * 1024 * 1024) -> bytes:
        """The bytes of ``directory/name``, a regular file of the agent's; a link or anything else is refused."""
        with self.open_dir(directory) as fd:
            try:
                file_fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, dir_fd=fd)
            except OSError as exc:
                if exc.errno == errno.ELOOP:
                    raise self._refuse("file", f"{directory}/{name}", "is a symbolic link") from None
                raise
            with os.fdopen(file_fd, "rb") as f:
                st = os.fstat(f.fileno())
                if not stat.S_ISREG(st.st_mode) or st.st_uid != os.geteuid():
                    raise self._refuse("file", f"{directory}/{name}", "is not a regular file of the agent's")
                data = f.read(limit + 1)
        if len(data) > limit:
            raise OSError(errno.EFBIG, f"{self.path / directory / name} is larger than {limit} bytes")
        return data

    def names(self, directory: str) -> list[str]:
        with self.open_dir(directory) as fd:
            return sorted(os.listdir(fd))

    def rename(self, directory: str, name: str, new_name: str) -> None:
        with self.open_dir(directory) as fd:
            os.rename(name, new_name, src_dir_fd=fd, dst_dir_fd=fd)

    def unlink(self, directory: str, name: str) -> None:
        """Remove ``directory/name`` (the entry itself: a link is removed, never followed); gone already is fine."""
        with self.open_dir(directory) as fd, contextlib.suppress(FileNotFoundError):
            os.unlink(name, dir_fd=fd)

    # ---- a capture's tree ----

    def tree_bytes(self, directory: str, name: str) -> int:
        """Bytes of the regular files in ``directory/name``, not following links; 0 if it is not the agent's."""
        try:
            with self.open_dir(directory) as parent:
                fd = self._open_owned_dir(parent, name, f"{directory}/{name}", "capture")
                try:
                    return _tree_bytes(fd, MAX_DEPTH)
                finally:
                    os.close(fd)
        except OSError:
            return 0

    def remove_tree(self, directory: str, name: str) -> tuple[int, list[str]]:
        """Delete ``directory/name`` and everything in it, from descriptors, never through a link, and only if
        the agent owns that directory (else StateDirSwapped); (bytes freed, what could not be deleted)."""
        with self.open_dir(directory) as parent:
            try:
                fd = self._open_owned_dir(parent, name, f"{directory}/{name}", "capture")
            except FileNotFoundError:
                return 0, []
            left: list[str] = []
            try:
                freed = _empty(fd, f"{self.path / directory / name}", left, MAX_DEPTH)
            finally:
                os.close(fd)
            try:
                os.rmdir(name, dir_fd=parent)
            except OSError as exc:
                left.append(f"{self.path / directory / name}: {exc.strerror}")
        return freed, left

    def collect(self) -> Iterator[Metric]:
        with self._lock:
            refused = sorted(self.refused.items())
        yield counter("state_dir_refused", "Paths under the state directory the agent refused to use because they "
                      "were a link, another user's, or not what it created there (by kind: directory, capture, "
                      "file); see the log.", ["kind"], (((kind,), n) for kind, n in refused))


def mkdir_at(dir_fd: int | None, name: str | Path, mode: int, exist_ok: bool = False) -> None:
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
            os.mkdir(name, mode, dir_fd=dir_fd)
        except FileExistsError:
            if not exist_ok:
                raise
            st = os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
            if not stat.S_ISDIR(st.st_mode):
                raise NotADirectoryError(errno.ENOTDIR, f"{name} exists and is not a directory") from None
        finally:
            os.umask(old)


def _entries(fd: int) -> list[tuple[str, os.stat_result]]:
    out = []
    for name in os.listdir(fd):
        with contextlib.suppress(FileNotFoundError):
            out.append((name, os.stat(name, dir_fd=fd, follow_symlinks=False)))
    return out


def _tree_bytes(fd: int, depth: int) -> int:
    total = 0
    for name, st in _entries(fd):
        if stat.S_ISREG(st.st_mode):
            total += st.st_size
        elif stat.S_ISDIR(st.st_mode) and depth > 0:
            with contextlib.suppress(OSError):
                child = os.open(name, _DIR, dir_fd=fd)
                try:
                    total += _tree_bytes(child, depth - 1)
                finally:
                    os.close(child)
    return total


def _empty(fd: int, shown: str, left: list[str], depth: int) -> int:
    """Delete what is in the directory ``fd``; the bytes freed (a file with another hard link frees none)."""
    freed = 0
    for name, st in _entries(fd):
        try:
            if stat.S_ISDIR(st.st_mode):
                if depth <= 0:
                    left.append(f"{shown}/{name}: deeper than {MAX_DEPTH} levels, left alone")
                    continue
                child = os.open(name, _DIR, dir_fd=fd)
                try:
                    freed += _empty(child, f"{shown}/{name}", left, depth - 1)
                finally:
                    os.close(child)
                os.rmdir(name, dir_fd=fd)
            else:
                os.unlink(name, dir_fd=fd)
                if stat.S_ISREG(st.st_mode) and st.st_nlink == 1:
                    freed += st.st_size
        except OSError as exc:
            left.append(f"{shown}/{name}: {exc.strerror}")
    return freed
