"""Folders dl4py owns: one writer each, and names read from disk kept inside them.

One writer per folder: an exclusive OS lock on a run directory or a sweep folder.

The lock is ``flock`` on ``<folder>/.lock``, as SQLite and git guard what two processes
might write: the kernel drops it when the holding process ends, however it ends, so a
crash or ``kill -9`` never leaves a stale lock behind. The holder writes its PID into the
file so that a refused second writer can be told who holds the folder.

Names read back from state files (a sweep's experiment names) are untrusted input: an
edited ``sweep.json`` must not make dl4py delete or write anything outside its folder.
"""

from __future__ import annotations

import os
from pathlib import Path

from dl4py.errors import ConfigError, StorageError

LOCK_FILE = ".lock"


def path_inside(root: str | Path, name: str, where: str) -> Path:
    """``root / name`` when ``name`` is one plain folder name that stays inside ``root``
    (no separator, no ``..``, not absolute, no symbolic link leading out); else a
    ConfigError naming ``where`` (the file the name came from)."""
    text = name if isinstance(name, str) else repr(name)
    plain = (isinstance(name, str) and name not in ("", ".", "..") and "/" not in name
             and "\\" not in name and "\0" not in name and not os.path.isabs(name))
    if plain:
        path = Path(root) / name
        try:
            inside = path.resolve().parent == Path(root).resolve()
        except OSError:
            inside = False
        if inside:
            return path
    raise ConfigError(where, f"names {text!r}, which is not a plain folder name inside {root}; "
                             "the file was edited or is corrupt, and nothing was touched")


def claim_new_folder(folder: Path, what: str, hint: str) -> tuple["FolderLock", bool]:
    """Create ``folder`` (or take it empty), locked for this process: the lock, and whether
    it was created. A file in its place, or files in it, is a ConfigError on ``--output``
    ending with ``hint`` (what to do instead)."""
    created = not folder.exists()
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except FileExistsError:
        raise ConfigError("--output", f"{folder} exists and is not a directory") from None
    except OSError as exc:
        raise StorageError(f"create the {what}", folder, exc) from None
    lock = FolderLock(folder, what).acquire()  # before looking inside: two claims at once, one wins
    if any(entry.name != LOCK_FILE for entry in folder.iterdir()):
        lock.release()
        raise ConfigError("--output", f"{folder} already holds files; {hint}")
    return lock, created


class FolderLock:
    """``with FolderLock(run_dir, "run directory", "--output"):`` -- refused with a
    ConfigError naming ``where`` and the holder's PID while another process holds it."""

    def __init__(self, folder: str | Path, what: str = "run directory", where: str = "--output"):
        self.folder, self.what, self.where = Path(folder), what, where
        self.path = self.folder / LOCK_FILE
        self._fd: int | None = None

    def acquire(self) -> "FolderLock":
        if self._fd is not None:  # held already (a second flock here would conflict with our own)
            return self
        try:
            import fcntl  # optional: fcntl (POSIX only; elsewhere no OS lock is taken)
        except ImportError:  # not POSIX: no OS lock to take
            return self
        try:
            fd = os.open(self.path, os.O_CREAT | os.O_RDWR, 0o644)
        except OSError as exc:
            raise ConfigError(self.where, f"cannot lock {self.what} {self.folder}: {exc.strerror} "
                                          f"({self.path})") from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            holder = _read_pid(fd)
            os.close(fd)
            who = f"process {holder}" if holder else "another process"
            raise ConfigError(self.where, f"{self.what} {self.folder} is in use by {who}; wait for it to "
                                          f"finish or stop it, or choose another folder") from None
        try:  # the PID is information for a refused writer, not part of the lock
            os.ftruncate(fd, 0)
            os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        except OSError:
            pass
        self._fd = fd
        return self

    def release(self) -> None:
        if self._fd is not None:
            os.close(self._fd)  # closing the descriptor releases the lock
            self._fd = None

    @property
    def held(self) -> bool:
        return self._fd is not None

    def __enter__(self) -> "FolderLock":
        return self.acquire()

    def __exit__(self, *exc) -> bool:
        self.release()
        return False


def _read_pid(fd: int) -> int | None:
    try:
        text = os.pread(fd, 32, 0).decode("ascii", "replace").strip()
        return int(text) if text.isdigit() else None
    except OSError:
        return None
