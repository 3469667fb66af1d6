"""ND4J arrays as DL4J writes them (``Nd4j.write``), read into numpy and written back.

The layout (big-endian, Java's ``DataOutputStream``): two buffers back to back, the shape
information, then the data. Each buffer is ``writeUTF(allocation mode)``, a length,
``writeUTF(data type)``, then its elements. Three generations of header:

- ``JAVACPP``, ``HEAP``, ``DIRECT`` (ND4J before 0.9): an int32 length; the shape buffer of INT;
- ``LONG_SHAPE`` (0.9 to 1.0.0-alpha): an int64 length; the shape buffer of LONG;
- ``MIXED_DATA_TYPES`` (1.0.0-beta on): as LONG_SHAPE, with the data type also flagged in the
  shape buffer's extras (``DATA_TYPE_FLAGS``, from libnd4j's ``ArrayOptions.h``).

The shape buffer is ``[rank, shape..., stride..., extras, element-wise stride, order]``, the
strides in elements and the order 99 (``c``) or 102 (``f``). DL4J writes a view with its own
strides over a buffer of exactly its elements, so the strides are followed, not assumed.

``write_array`` writes the current header: a file read and written again is byte for byte the
one DL4J 1.0.0-beta and later writes for the same array (C order, or F order for an array
numpy holds in Fortran order, as ``read_array`` returns an ``f`` file's).

Every length is checked against the bytes that remain before anything is allocated: a crafted
or truncated file is a ``DL4JFileError`` naming what is wrong, never a huge allocation.
"""

from __future__ import annotations

import io
import struct
from pathlib import Path

import numpy as np

from dl4py.errors import DataError

# ND4J's names for a data buffer's type: numpy's big-endian dtype ("bfloat16": stored as its
# 16 high bits, which numpy lacks; widened to float32 on reading).
DATA_TYPES = {
    "FLOAT": ">f4", "DOUBLE": ">f8", "HALF": ">f2", "BFLOAT16": "bfloat16",
    "INT": ">i4", "LONG": ">i8", "SHORT": ">i2", "BYTE": ">i1",
    "UBYTE": ">u1", "UINT16": ">u2", "UINT32": ">u4", "UINT64": ">u8", "BOOL": ">?",
}
# The data type's flag in a MIXED_DATA_TYPES shape buffer's extras (libnd4j ArrayOptions.h).
_UNSIGNED = 8388608
DATA_TYPE_FLAGS = {
    "HALF": 4096, "BFLOAT16": 2048, "FLOAT": 8192, "DOUBLE": 16384, "BYTE": 32768, "SHORT": 65536,
    "INT": 131072, "LONG": 262144, "BOOL": 524288, "UBYTE": 32768 | _UNSIGNED, "UINT16": 65536 | _UNSIGNED,
    "UINT32": 131072 | _UNSIGNED, "UINT64": 262144 | _UNSIGNED,
}
_NUMPY_NAMES = {np.dtype(code).newbyteorder("="): name for name, code in DATA_TYPES.items() if code != "bfloat16"}
_INT_LENGTH_MODES = ("JAVACPP", "HEAP", "DIRECT")
_LONG_LENGTH_MODES = ("LONG_SHAPE", "MIXED_DATA_TYPES")
_ORDERS = {99: "C", 102: "F"}
MAX_RANK = 32  # ND4J's own limit


class DL4JFileError(DataError):
    """A DL4J file cannot be read: ``WHERE: WHAT``."""

    def __init__(self, where: str, what: str):
        self.where, self.what = where, what
        super().__init__(f"{where}: {what}")

    def __reduce__(self):
        return type(self), (self.where, self.what)


def source_bytes(source, name: str | None, default: str) -> tuple[bytes, str]:
    """The bytes of ``source`` (a path, bytes, or a binary file object) and the name an error
    gives them: ``name``, else the path or the file's name, else ``default``."""
    if isinstance(source, (str, Path)):
        return Path(source).read_bytes(), name or str(source)
    if isinstance(source, (bytes, bytearray, memoryview)):
        return bytes(source), name or default
    return source.read(), name or getattr(source, "name", default)


def read_array(source, name: str | None = None) -> np.ndarray:
    """The array in ``source`` (a path, bytes, or a binary file object) as numpy holds it:
    its shape, its data type (BFLOAT16 widened to float32), Fortran order for an ``f`` file.
    ``name`` says where the bytes came from in an error (default: the path)."""
    data, name = source_bytes(source, name, "the array")
    reader = _Reader(data, name)
    array = _read(reader)
    if reader.left:
        raise DL4JFileError(name, f"{reader.left} bytes follow the array")
    return array


def write_array(array, target=None) -> bytes | None:
    """Write ``array`` as DL4J 1.0.0-beta and later do (``MIXED_DATA_TYPES``), to ``target`` (a
    path or a binary file object); with no target, return the bytes. C order, or F order for
    an array numpy holds in Fortran order only. The shape is kept as it is: DL4J holds a
    vector as a ``[1, n]`` row, so reshape one first where a DL4J reader expects that."""
    array = np.asarray(array)
    kind = _NUMPY_NAMES.get(array.dtype.newbyteorder("="))
    if kind is None:
        raise TypeError(f"write_array: ND4J has no data type for numpy's {array.dtype}")
    order = "F" if array.flags.f_contiguous and not array.flags.c_contiguous else "C"
    strides = _contiguous_strides(array.shape, order)
    shape_info = [array.ndim, *array.shape, *strides, DATA_TYPE_FLAGS[kind], 1, 99 if order == "C" else 102]
    out = io.BytesIO()
    _write_buffer(out, "LONG", np.asarray(shape_info, dtype=">i8"))
    _write_buffer(out, kind, np.ravel(array, order=order).astype(DATA_TYPES[kind], copy=False))
    if target is None:
        return out.getvalue()
    if isinstance(target, (str, Path)):
        Path(target).write_bytes(out.getvalue())
    else:
        target.write(out.getvalue())
    return None


# ---- reading ---------------------------------------------------------------------------------

class _Reader:
    """Bytes read front to back, each read checked against what is left."""

    def __init__(self, data: bytes, name: str):
        self.data, self.name, self.at = data, name, 0

    @property
    def left(self) -> int:
        return len(self.data) - self.at

    def take(self, count: int, what: str) -> bytes:
        if count < 0 or count > self.left:
            raise DL4JFileError(self.name, f"{what} needs {count} bytes at byte {self.at}, but {self.left} are left "
                                           "(a truncated or damaged file)")
        piece = self.data[self.at:self.at + count]
        self.at += count
        return piece

    def utf(self, what: str) -> str:
        (length,) = struct.unpack(">H", self.take(2, what))
        try:
            return self.take(length, what).decode("utf-8")
        except UnicodeDecodeError:
            raise DL4JFileError(self.name, f"{what} at byte {self.at - length} is not text") from None


def _read(reader: _Reader) -> np.ndarray:
    mode, shape_info = _read_buffer(reader, "the shape buffer")
    if shape_info.dtype.kind not in "iu":
        raise DL4JFileError(reader.name, f"the shape buffer holds {shape_info.dtype}, not integers")
    shape, strides, order = _layout(shape_info.astype(np.int64).tolist(), reader.name)
    _, flat = _read_buffer(reader, "the data buffer", mode)
    return _arranged(flat, shape, strides, order, reader.name)


def _read_buffer(reader: _Reader, what: str, mode: str | None = None) -> tuple[str, np.ndarray]:
    """``(allocation mode, elements)`` of one buffer, its length bounded by the bytes left."""
    mode = reader.utf(f"{what}'s allocation mode") if mode is None else _same_mode(reader, what, mode)
    if mode in _INT_LENGTH_MODES:
        (length,) = struct.unpack(">i", reader.take(4, f"{what}'s length"))
    elif mode in _LONG_LENGTH_MODES:
        (length,) = struct.unpack(">q", reader.take(8, f"{what}'s length"))
    else:
        raise DL4JFileError(reader.name, f"{what} has allocation mode {mode!r}, not one ND4J writes "
                                         f"({', '.join(_INT_LENGTH_MODES + _LONG_LENGTH_MODES)})")
    kind = reader.utf(f"{what}'s data type")
    code = DATA_TYPES.get(kind)
    if code is None:
        raise DL4JFileError(reader.name, f"{what} has data type {kind!r}, which dl4py does not read "
                                         f"(it reads {', '.join(DATA_TYPES)})")
    width = 2 if code == "bfloat16" else np.dtype(code).itemsize
    if length < 0 or length > reader.left // width:
        raise DL4JFileError(reader.name, f"{what} says it holds {length} {kind} values, but {reader.left} bytes "
                                         "are left (a truncated or damaged file)")
    raw = reader.take(length * width, f"{what}'s values")
    if code == "bfloat16":  # the high half of a float32
        return mode, (np.frombuffer(raw, dtype=">u2").astype(np.uint32) << 16).view(np.float32)
    return mode, np.frombuffer(raw, dtype=code).astype(np.dtype(code).newbyteorder("="))


def _same_mode(reader: _Reader, what: str, expected: str) -> str:
    mode = reader.utf(f"{what}'s allocation mode")
    if (mode in _INT_LENGTH_MODES) != (expected in _INT_LENGTH_MODES):
        raise DL4JFileError(reader.name, f"{what} has allocation mode {mode!r} after a shape buffer of {expected!r}")
    return mode


def _layout(info: list[int], name: str) -> tuple[tuple[int, ...], tuple[int, ...], str]:
    """``(shape, strides, order)`` of a shape buffer, each checked."""
    rank = info[0] if info else -1
    if not 0 <= rank <= MAX_RANK or len(info) != 2 * rank + 4:
        raise DL4JFileError(name, f"the shape buffer's rank is {rank} with {len(info)} entries "
                                  f"(a rank from 0 to {MAX_RANK} has 2 * rank + 4)")
    shape, strides = tuple(info[1:1 + rank]), tuple(info[1 + rank:1 + 2 * rank])
    if any(size < 0 for size in shape) or any(stride < 0 for stride in strides):
        raise DL4JFileError(name, f"shape {list(shape)} with strides {list(strides)}: no size or stride is negative")
    order = _ORDERS.get(info[-1])
    if order is None:
        raise DL4JFileError(name, f"the order is {info[-1]}, not 99 ('c') or 102 ('f')")
    return shape, strides, order


def _arranged(flat: np.ndarray, shape, strides, order: str, name: str) -> np.ndarray:
    """The data buffer's values at the places the strides give, as a fresh array (F order for
    an ``f`` array)."""
    elements = 1
    for size in shape:
        elements *= size  # Python integers: no overflow to hide a crafted shape
    if elements == 0:
        return np.zeros(shape, dtype=flat.dtype, order=order)
    span = 1 + sum((size - 1) * stride for size, stride in zip(shape, strides))
    if elements > flat.size or span > flat.size:
        raise DL4JFileError(name, f"shape {list(shape)} with strides {list(strides)} reaches {max(elements, span)} "
                                  f"values, but the data buffer holds {flat.size}")
    view = np.lib.stride_tricks.as_strided(flat, shape=shape, strides=[s * flat.itemsize for s in strides],
                                           writeable=False)
    return np.array(view, order=order)


# ---- writing ---------------------------------------------------------------------------------

def _contiguous_strides(shape, order: str) -> list[int]:
    strides, step = [], 1
    for size in (reversed(shape) if order == "C" else shape):
        strides.append(step)
        step *= size
    return list(reversed(strides)) if order == "C" else strides


def _write_buffer(out, kind: str, values: np.ndarray) -> None:
    out.write(_utf("MIXED_DATA_TYPES"))
    out.write(struct.pack(">q", values.size))
    out.write(_utf(kind))
    out.write(values.tobytes())


def _utf(text: str) -> bytes:
    encoded = text.encode("utf-8")
    return struct.pack(">H", len(encoded)) + encoded
