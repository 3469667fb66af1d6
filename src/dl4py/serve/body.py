"""What ``POST /predict`` reads: a JSON body's ``features``, checked against the model's input.

Pure functions of bytes, without the web framework, so every rule is testable alone and
each refusal is a ``RequestError`` carrying its HTTP status and a message naming what is
wrong: not JSON, or nested deeper than ``MAX_NESTING`` (400); no ``features`` key, something
that is not a number, examples of the wrong shape or of different lengths, a value beyond
float32, a number of more digits than Python reads (422).
"""

from __future__ import annotations

import json
import math
import sys

import numpy as np

FLOAT32_MAX = float(np.finfo(np.float32).max)
# Levels of arrays and objects a body may nest: the object, features, and up to 30 dimensions
# of one example. Python's json parser recurses once per level and fails near 1,000 with a
# RecursionError; numpy stops at 64 dimensions. Deeper bodies are refused before parsing.
MAX_NESTING = 32
# What is left of a body once every byte but the structural ones is deleted (bytes.translate).
_NOT_STRUCTURE = bytes(c for c in range(256) if c not in b'[]{}"')
# The bytes of JSON numbers, their separators and whitespace: deleted from a body of numbers
# and lists under "features", they leave its key, braces and brackets (one pass: ``_plain``).
_NUMBER_BYTES = b"0123456789.eE+-, \t\n\r"
_PLAIN_HEAD = b'{"features":'.translate(None, _NUMBER_BYTES)


class RequestError(Exception):
    """A request the server refuses: ``status`` (4xx or 503) and a message for the client."""

    def __init__(self, status: int, message: str):
        self.status, self.message = status, message
        super().__init__(f"{status}: {message}")


def read_features(body: bytes, example_shape: tuple[int, ...]) -> np.ndarray:
    """The examples of a ``{"features": ...}`` body as float32 ``[n, *example_shape]``.

    ``features`` is a list of examples, each nested as ``example_shape`` or flat (its
    ``prod(example_shape)`` numbers), or one such example alone.
    """
    plain = _plain(body)
    document = _json(body, checked_nesting=plain)
    if not isinstance(document, dict):
        raise RequestError(422, f'the body must be a JSON object {{"features": [...]}}, got a JSON {_kind(document)}')
    if "features" not in document:
        keys = ", ".join(map(repr, list(document)[:5])) or "none"
        raise RequestError(422, f'the body has no "features" key (its keys: {keys}); '
                                'send {"features": [[...], ...]}, one list of numbers per example')
    features = document["features"]
    if not plain and (b"true" in body or b"false" in body):  # numpy would take a JSON boolean for 1 or 0
        bad = _first_non_number(features, "features")
        if bad is not None:
            raise RequestError(422, bad)
    # Only numbers and lists, which numpy reads straight into float32; anything else (a string,
    # null, a boolean) takes the checking path, which names what is wrong.
    values = _plain_numbers(features) if plain else None
    return _shaped(values if values is not None else _numbers(features), example_shape)


def _plain(body: bytes) -> bool:
    """Whether the body holds nothing but the "features" key, lists and numbers, nested no
    deeper than MAX_NESTING: one pass over it, where a JSON boolean, null, string or second key
    leaves letters or quotes behind. Not a check that it is valid JSON (the parser is that)."""
    rest = body.translate(None, _NUMBER_BYTES)
    if not (rest.startswith(_PLAIN_HEAD) and rest.endswith(b"}")):
        return False
    brackets = rest[len(_PLAIN_HEAD):-1]
    if brackets.strip(b"[]"):  # something but brackets between the key and the closing brace
        return False
    if brackets.count(b"[") < MAX_NESTING:  # they cannot nest deeper than they open
        return True
    steps = np.where(np.frombuffer(brackets, np.uint8) == ord("["), 1, -1)  # many examples
    return int(np.cumsum(steps).max()) < MAX_NESTING  # the object's brace is one level more


def _plain_numbers(features) -> np.ndarray | None:
    """``features`` as float32 when they are lists of finite float32 numbers of equal lengths;
    None for anything ``_numbers`` must look at to say what is wrong."""
    if not isinstance(features, list):
        return None
    try:
        with np.errstate(over="ignore"):
            values = np.asarray(features, dtype=np.float32)
    except (ValueError, OverflowError):  # rows of different lengths; an int beyond float's range
        return None
    return values if values.size and np.isfinite(values).all() else None


def _json(body: bytes, checked_nesting: bool = False):
    try:
        text = body.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise RequestError(400, f"the body is not UTF-8 text: byte {exc.start} cannot be decoded") from None
    depth = None if checked_nesting else _nesting_over(body, MAX_NESTING)
    if depth is not None:
        raise RequestError(400, f"the body nests arrays or objects {depth} levels deep, deeper than the "
                                f"{MAX_NESTING} this server reads; features are a list of examples, each "
                                "nested as one example's shape")
    try:
        return _DECODER.decode(text)
    except json.JSONDecodeError as exc:
        raise RequestError(400, f"the body is not valid JSON: {exc.msg} at line {exc.lineno}, "
                                f"column {exc.colno}") from None
    except ValueError:  # int() refuses more than sys.get_int_max_str_digits() digits (a CPU guard, 3.10.7+)
        raise RequestError(422, _long_number(body, sys.get_int_max_str_digits())) from None


def _nesting_over(body: bytes, limit: int) -> int | None:
    """How deep the body's arrays and objects nest when that is deeper than ``limit``, else
    None; without parsing it (bytes that are not JSON give some number; the parser tells what
    is wrong with them)."""
    if b"\\" in body:  # drop escapes first, so that an escaped quote does not end a string
        body = body.replace(b"\\\\", b"").replace(b'\\"', b"")
    structure = body.translate(None, _NOT_STRUCTURE)  # a few bytes per example, not one per number
    if structure.count(b"[") + structure.count(b"{") <= limit:
        return None  # it cannot nest deeper than it opens: most bodies end here
    codes = np.frombuffer(structure, np.uint8)
    quotes = codes == ord('"')
    outside = np.cumsum(quotes) % 2 == 0  # a quote opens a string, the next one closes it
    # Comparisons rather than np.isin, which sorts its operands: a tenth of the time on the few
    # bytes a small body leaves.
    opens = (codes == ord("[")) | (codes == ord("{"))
    closes = (codes == ord("]")) | (codes == ord("}"))
    steps = opens.astype(np.int64) - closes
    depth = int(np.cumsum(steps * outside).max(initial=0))
    return depth if depth > limit else None


def _long_number(body: bytes, limit: int) -> str:
    """The message for the first number of more than ``limit`` digits, which names where it is."""
    codes = np.frombuffer(body, np.uint8)
    digits = ((codes >= ord("0")) & (codes <= ord("9"))).astype(np.int8)
    edges = np.diff(np.concatenate(([0], digits, [0])))
    starts, ends = np.flatnonzero(edges == 1), np.flatnonzero(edges == -1)
    long = np.flatnonzero(ends - starts > limit)
    where = ""
    if len(long):
        start, length = int(starts[long[0]]), int(ends[long[0]] - starts[long[0]])
        line, column = body.count(b"\n", 0, start) + 1, start - body.rfind(b"\n", 0, start)
        where = f" of {length} digits at line {line}, column {column}"
    return (f"the body holds a number{where}, more than the {limit} digits this server reads; "
            "an integer that long is far beyond float32's range")


def _no_constant(name: str):
    # Python's json reads NaN and Infinity; JSON has neither, and a model should not see them.
    raise RequestError(422, f"features hold {name}, which is not a JSON number; send finite numbers")


_DECODER = json.JSONDecoder(parse_constant=_no_constant)  # one for every request: json.loads makes one a call


def _numbers(features) -> np.ndarray:
    if not isinstance(features, list):
        raise RequestError(422, f'"features" must be a list (of examples), got a JSON {_kind(features)}')
    try:
        array = np.asarray(features)
    except ValueError:  # numpy refuses lists of different lengths
        array = None
    if array is None or array.dtype == object:
        bad = _first_non_number(features, "features")
        if bad is not None:
            raise RequestError(422, bad)
        try:  # numpy keeps an int beyond int64 as an object; as a float it is a number like the others
            array = np.asarray(features, dtype=np.float64)
        except ValueError:
            raise RequestError(422, "features: the examples (or their rows) have different lengths; "
                                    f"lengths at the first level below: {_lengths(features)}") from None
    if array.dtype.kind not in "iuf":  # strings, booleans
        raise RequestError(422, _first_non_number(features, "features") or
                           f"features must be numbers, got {array.dtype.kind!r} values")
    if array.size == 0:
        raise RequestError(422, "features holds no examples")
    with np.errstate(over="ignore"):
        values = array.astype(np.float32)
    if not np.isfinite(values).all():
        index = np.unravel_index(int(np.argmin(np.isfinite(values))), values.shape)
        position = "".join(f"[{i}]" for i in index)
        raise RequestError(422, f"features{position} = {array[index]} is beyond float32's range")
    return values


def _shaped(values: np.ndarray, example_shape: tuple[int, ...]) -> np.ndarray:
    width = math.prod(example_shape)
    shape, example_shape = tuple(values.shape), tuple(example_shape)
    if shape in (example_shape, (width,)):
        values = values[None]  # one example alone
    elif len(shape) < 2 or shape[1:] not in (example_shape, (width,)):
        shown = ", ".join(map(str, example_shape))
        flat = f" (or [n, {width}] flat)" if len(example_shape) > 1 else ""
        raise RequestError(422, f"features have shape {list(shape)}, but the model takes a list of examples "
                                f"[n, {shown}]{flat}, or one example alone")
    return values.reshape(values.shape[0], *example_shape)


def _first_non_number(value, where: str) -> str | None:
    """Where the first value that is not a number sits, or None when there is none."""
    if isinstance(value, list):
        for i, item in enumerate(value):
            found = _first_non_number(item, f"{where}[{i}]")
            if found:
                return found
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return f"{where} is {json.dumps(value)[:40]}, not a number"
    if isinstance(value, int) and abs(value) > FLOAT32_MAX:  # numpy keeps such an int as an object
        digits = str(abs(value))  # too large for a float: written from its digits
        shown = f"{'-' if value < 0 else ''}{digits[0]}.{digits[1:3]}e+{len(digits) - 1}"
        return f"{where} = {shown} is beyond float32's range"
    return None


def _lengths(features: list) -> str:
    lengths = [len(item) if isinstance(item, list) else "a number" for item in features[:8]]
    return ", ".join(map(str, lengths)) + (", ..." if len(features) > 8 else "")


def _kind(value) -> str:
    return {dict: "object", list: "array", str: "string", bool: "boolean", type(None): "null"}.get(
        type(value), "number")
