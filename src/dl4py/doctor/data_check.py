"""The data check: are the MNIST files where dl4py looks, readable and intact?

The same folders, in the same order, and the same SHA-256 sums as loading MNIST uses
(``dl4py.data.mnist``), without its download: a doctor reads, it does not fetch.
"""

from __future__ import annotations

import gzip
import hashlib
import os
import zlib
from pathlib import Path

from dl4py.data.mnist import SHA256, search_dirs
from dl4py.doctor.result import FAILED, PASSED, SKIPPED, WARNING, Result

FIX_ABSENT = "set DL4PY_DATA to a folder holding mnist/, or let MNIST download on first use"


def mnist_files() -> Result:
    folders = search_dirs(None)
    explicit = os.environ.get("DL4PY_DATA")
    if explicit and not folders[0].is_dir():
        return Result(WARNING, f"DL4PY_DATA={explicit} but {folders[0]} is not a folder; MNIST would come from "
                               f"{folders[-1]} or be downloaded there",
                      "point DL4PY_DATA at the folder that holds mnist/")
    found, missing = {}, []
    for name in SHA256:
        path = next((p for folder in folders for p in (folder / name, folder / f"{name}.gz") if p.is_file()), None)
        if path is None:
            missing.append(name)
        else:
            found[name] = path
    if not found:
        searched = " or ".join(map(str, folders))
        return Result(SKIPPED, f"no MNIST files in {searched}; downloaded on first use", FIX_ABSENT)
    for name, path in found.items():
        problem = _verify(path, SHA256[name])
        if problem:
            return Result(FAILED, f"{path}: {problem}", "delete it and it downloads again on first use, "
                                                        "or replace it with a good copy")
    where = ", ".join(sorted({str(path.parent) for path in found.values()}))
    if missing:
        return Result(WARNING, f"{len(found)} of {len(SHA256)} MNIST files in {where} (SHA-256 verified); missing "
                               f"{', '.join(missing)}, downloaded on first use", FIX_ABSENT)
    return Result(PASSED, f"{len(found)} MNIST files in {where}, readable, SHA-256 verified")


def _verify(path: Path, sha256: str) -> str | None:
    """Why ``path`` (raw or gzip) is not the file with uncompressed content ``sha256``."""
    try:
        raw = path.read_bytes()
    except OSError as exc:
        return f"not readable: {exc.strerror or exc}"
    try:
        data = gzip.decompress(raw) if path.name.endswith(".gz") else raw
    except (OSError, EOFError, zlib.error) as exc:
        return f"not a valid gzip stream ({exc})"
    return None if hashlib.sha256(data).hexdigest() == sha256 else "SHA-256 mismatch: the file is damaged"
