"""Atomic file writes: a reader sees the old file or the new one, never half of one.

When the operating system refuses (disk full, no permission, read-only file system), the
previous file stays as it was, the temporary file is removed, and the error is a
StorageError naming the file and the cause.
"""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path

from dl4py.errors import StorageError


def atomic_write_bytes(path: str | Path, data: bytes) -> None:
    path = Path(path)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    except OSError as exc:
        raise StorageError("write", path, exc) from exc
    try:
        os.chmod(tmp, 0o666 & ~_umask())  # mkstemp's 0600 would hide the file from the user's group
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException as exc:
        with_suppressed_unlink(tmp)
        if isinstance(exc, OSError):
            raise StorageError("write", path, exc) from exc
        raise
    _fsync_dir(path.parent)



def atomic_write_text(path: str | Path, text: str) -> None:
    atomic_write_bytes(path, text.encode("utf-8"))


def atomic_write_json(path: str | Path, obj) -> None:
    atomic_write_text(path, json.dumps(obj, indent=2, sort_keys=False) + "\n")


def with_suppressed_unlink(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


def _umask() -> int:
    mask = os.umask(0)  # the only way to read it is to set it
    os.umask(mask)
    return mask


def _fsync_dir(directory: Path) -> None:
    # The rename is durable only once the directory entry is on disk.
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)
