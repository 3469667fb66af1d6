"""A DL4J ``ModelSerializer`` zip opened safely: its entries listed, the ones dl4py reads read
within bounds, the Java-serialized ones recorded and never opened.

What ``ModelSerializer.writeModel`` puts in the zip (DL4J 0.7 to 1.0):

- ``configuration.json``: the MultiLayerConfiguration or ComputationGraphConfiguration;
- ``coefficients.bin``: every parameter as one ND4J row vector (``read_array``);
- ``updaterState.bin``: the updater's state, one row vector, when saved with the updater;
- ``normalizer.bin``: a data normalizer (DL4J 0.9 on), read by the importer (``normalizer_file``);
- ``preprocessor.bin`` (0.7-era data normalizer) and ``updater.bin`` (0.7-era updater): Java
  objects written with ``ObjectOutputStream``. Reading one means running Java's
  deserialization, which can do anything the classes named in the file allow: dl4py never
  opens them, and says that it left them out.

Every size is checked before anything is allocated: the zip's directory must fit in the file,
each entry's compressed bytes must lie inside the file, only DL4J's methods (deflate, stored)
are read, and an entry may not claim more bytes than deflate can make of its compressed ones
(1032 to 1; an untrained model's all-zero updater state compresses about 980 to 1, so real files
fit). Python's zip reader stops at the claimed size, so what is claimed is what is allocated at
most; the caller bounds it further by what the configuration needs (``read(max_bytes=)``).
"""

from __future__ import annotations

import os
import zipfile
import zlib
from dataclasses import dataclass
from pathlib import Path

from dl4py.dl4j.ndarray import DL4JFileError

CONFIGURATION = "configuration.json"
COEFFICIENTS = "coefficients.bin"
UPDATER_STATE = "updaterState.bin"
NORMALIZER = "normalizer.bin"
# Java-serialized (ObjectOutputStream) entries: never deserialized (see the module docstring).
JAVA_SERIALIZED = {
    "preprocessor.bin": "a 0.7-era data normalizer",
    "updater.bin": "a 0.7-era updater",
}
# A configuration is a few kilobytes; a bigger one is not DL4J's.
MAX_CONFIGURATION_BYTES = 16 * 1024 * 1024
# Deflate's largest ratio is about 1032 to 1 (258-byte matches in 2-bit codes); a little over.
MAX_DEFLATE_RATIO = 1100
_SLACK_BYTES = 4096  # tiny entries: headers and end blocks outweigh the ratio
_CHUNK_BYTES = 1 << 20
_METHODS = {zipfile.ZIP_STORED: "stored", zipfile.ZIP_DEFLATED: "deflate"}


@dataclass(frozen=True)
class ModelZip:
    """A ModelSerializer zip's directory, checked; ``read`` gives one entry's bytes."""

    path: Path
    entries: dict[str, zipfile.ZipInfo]

    @property
    def name(self) -> str:
        return str(self.path)

    def has(self, entry: str) -> bool:
        return entry in self.entries

    def left_out(self) -> list[str]:
        """One line per entry dl4py never reads (the Java-serialized ones), and why."""
        return [f"{entry} ({what}, a Java-serialized object: dl4py never deserializes one)"
                for entry, what in JAVA_SERIALIZED.items() if entry in self.entries]

    def read(self, entry: str, max_bytes: int | None = None) -> bytes:
        """The bytes of ``entry``; a DL4JFileError naming the file and the entry when it is
        missing, claims more than ``max_bytes``, or is damaged."""
        info = self.entries.get(entry)
        if info is None:
            raise DL4JFileError(self.name, f"has no {entry} entry (entries: {', '.join(self.entries) or 'none'}); "
                                           "not a DL4J ModelSerializer zip, or an incomplete one")
        if entry in JAVA_SERIALIZED:
            raise DL4JFileError(f"{self.name}:{entry}", "is a Java-serialized object, which dl4py never reads")
        if max_bytes is not None and info.file_size > max_bytes:
            raise DL4JFileError(f"{self.name}:{entry}", f"claims {info.file_size} bytes, more than the "
                                                        f"{max_bytes} its content can take")
        try:
            data = _read_bounded(self.path, info)
        except (zipfile.BadZipFile, zlib.error, EOFError, OSError) as exc:
            raise DL4JFileError(f"{self.name}:{entry}", f"cannot be read: {_reason(exc)}") from None
        if len(data) != info.file_size:  # a stored entry cut short reads short, unchecked
            raise DL4JFileError(f"{self.name}:{entry}", f"holds {len(data)} bytes, not the {info.file_size} "
                                                        "its header claims (a truncated or damaged file)")
        return data

    def read_configuration(self) -> str:
        data = self.read(CONFIGURATION, MAX_CONFIGURATION_BYTES)
        try:
            return data.decode("utf-8")
        except UnicodeDecodeError as exc:
            raise DL4JFileError(f"{self.name}:{CONFIGURATION}", f"is not UTF-8 text (byte {exc.start})") from None


def open_model_zip(path) -> ModelZip:
    """The zip at ``path`` with its directory checked against the file (see the module
    docstring); a DL4JFileError naming the file, and the entry where one is at fault."""
    path = Path(path)
    try:
        size = os.path.getsize(path)
        with zipfile.ZipFile(path) as archive:
            infos = archive.infolist()
    except FileNotFoundError:
        raise DL4JFileError(str(path), "no such file") from None
    except (zipfile.BadZipFile, zipfile.LargeZipFile, EOFError, OSError, ValueError) as exc:
        raise DL4JFileError(str(path), f"is not a readable zip file ({_reason(exc)}): a truncated "
                                       "download, or not a DL4J model") from None
    entries: dict[str, zipfile.ZipInfo] = {}
    for info in infos:
        _check_entry(path, size, info)
        if info.filename in entries:
            raise DL4JFileError(f"{path}:{info.filename}", "appears twice in the zip's directory")
        entries[info.filename] = info
    return ModelZip(path, entries)


def _check_entry(path: Path, size: int, info: zipfile.ZipInfo) -> None:
    where = f"{path}:{info.filename}"
    # The local header (30 bytes and the name) and the compressed bytes must lie in the file.
    end = info.header_offset + 30 + len(info.filename.encode("utf-8")) + info.compress_size
    if info.header_offset < 0 or end > size:
        raise DL4JFileError(where, f"its {info.compress_size} compressed bytes at offset {info.header_offset} run "
                                   f"past the end of the {size}-byte file (a truncated or damaged file)")
    if info.compress_type not in _METHODS:
        raise DL4JFileError(where, f"is compressed with method {info.compress_type}; DL4J writes deflate or stored")
    limit = info.compress_size if info.compress_type == zipfile.ZIP_STORED else (
        info.compress_size * MAX_DEFLATE_RATIO + _SLACK_BYTES)
    if info.file_size > limit:
        raise DL4JFileError(where, f"claims {info.file_size} bytes from {info.compress_size} compressed "
                                   f"({_METHODS[info.compress_type]}), more than that can give: a crafted "
                                   "header or a zip bomb")


def _read_bounded(path: Path, info: zipfile.ZipInfo) -> bytes:
    """The entry's bytes, inflated a chunk at a time: ``ZipFile.read`` inflates all the
    compressed bytes in one call, however far past the claimed size they would go."""
    chunks = []
    with zipfile.ZipFile(path) as archive, archive.open(info) as stream:
        while chunk := stream.read(_CHUNK_BYTES):  # stops at the claimed size, checks the CRC there
            chunks.append(chunk)
    return b"".join(chunks)


def _reason(exc: BaseException) -> str:
    return str(exc) or type(exc).__name__
