"""ND4J arrays as DL4J wrote them (``../shared/dl4j-models``, real files from DL4J's own test
resources): the three header generations read to their known values, DL4J 1.0.0-beta4's
arrays written again byte for byte, every data type and both orders round-tripped, and a
crafted or truncated array one line naming what is wrong. No processes."""

from __future__ import annotations

import struct
from pathlib import Path

import numpy as np
import pytest

from dl4py.dl4j import DL4JFileError, read_array, write_array
from dl4py.dl4j.ndarray import DATA_TYPE_FLAGS

MODELS = Path(__file__).resolve().parents[1].parent / "shared" / "dl4j-models"
LEGACY, BETA4 = MODELS / "legacy", MODELS / "regression_testing" / "100b4"
# DL4J wrote these two as views: strides of their own over a buffer of exactly their values
# (element-wise stride 0). dl4py writes a copy in C order, as Nd4j.write does for a view's dup.
VIEWS = {"GravesLSTMCharModelingExample_Output_100b4.bin", "SyntheticCNN_Output_100b4.bin"}

pytestmark = pytest.mark.skipif(not MODELS.is_dir(), reason=f"needs DL4J's files in {MODELS}")


def test_the_legacy_headers_read_to_their_known_values():
    """JAVACPP (int32 lengths, an INT shape buffer) and LONG_SHAPE (int64, LONG), as ND4J 0.x
    wrote Nd4j.linspace(1, n, n) reshaped. ND4J's linspace rounds: 24 of the 120 doubles it
    wrote are one unit in the last place above the integer (6.000000000000001), and dl4py reads
    the bits DL4J wrote."""
    javacpp = read_array(LEGACY / "NDArray_javacpp.bin")
    assert javacpp.dtype == np.float64 and javacpp.shape == (2, 3, 4, 5)
    ulps = np.testing.assert_array_max_ulp(javacpp, np.arange(1, 121, dtype=np.float64).reshape(2, 3, 4, 5), maxulp=1)
    assert int((ulps > 0).sum()) == 24 and javacpp[0, 0, 1, 0] == 6.000000000000001
    for name, dtype in (("NDArray_longshape_double.bin", np.float64), ("NDArray_longshape_float.bin", np.float32)):
        array = read_array(LEGACY / name)
        assert array.dtype == dtype and np.array_equal(array, np.arange(1, 6, dtype=dtype).reshape(1, 5))


@pytest.mark.parametrize("path", sorted(BETA4.glob("*_In*_100b4*.bin")) + sorted(BETA4.glob("*_Out*_100b4*.bin")),
                         ids=lambda path: path.name)
def test_a_dl4j_1_0_array_is_written_again_byte_for_byte(path):
    array = read_array(path)
    written = write_array(array)
    if path.name in VIEWS:
        assert np.array_equal(read_array(written), array)  # a copy of the view, the same values
    else:
        assert written == path.read_bytes()


def test_a_view_is_read_through_its_strides():
    """SyntheticCNN's output is [4, 4, 11, 22] with strides [968, 1, 88, 4]: channels last in
    memory. Read as a plain reshape, its values would land in the wrong places."""
    path = BETA4 / "SyntheticCNN_Output_100b4.bin"
    array = read_array(path)
    flat = np.frombuffer(path.read_bytes()[-array.size * 4:], dtype=">f4")
    assert array[1, 2, 3, 4] == flat[1 * 968 + 2 * 1 + 3 * 88 + 4 * 4]
    assert not np.array_equal(array, flat.reshape(array.shape))


@pytest.mark.parametrize("dtype", [np.float32, np.float64, np.float16, np.int32, np.int64, np.int16, np.int8,
                                   np.uint8, np.uint16, np.uint32, np.uint64, np.bool_])
@pytest.mark.parametrize("order", ["C", "F"])
def test_every_data_type_and_both_orders_round_trip_exactly(dtype, order):
    values = np.arange(-12, 12).reshape(2, 3, 4) * 7 % 23
    array = np.array(values.astype(dtype), order=order)
    again = read_array(write_array(array))
    assert again.dtype == array.dtype and again.shape == array.shape and np.array_equal(again, array)
    assert again.flags.f_contiguous == (order == "F")


def test_a_scalar_and_an_empty_array_round_trip():
    for array in (np.array(3.5, dtype=np.float32), np.zeros((0, 4), dtype=np.float64)):
        again = read_array(write_array(array))
        assert again.shape == array.shape and again.dtype == array.dtype and np.array_equal(again, array)


def test_bfloat16_reads_as_the_float32_it_widens_to():
    values = np.array([1.0, -2.5, 3.140625], dtype=np.float32)  # exact in bfloat16
    high = (values.view(np.uint32) >> 16).astype(">u2")
    data = _array_bytes([2, 1, 3, 3, 1, DATA_TYPE_FLAGS["BFLOAT16"], 1, 99], "BFLOAT16", high.tobytes(), 3)
    assert np.array_equal(read_array(data), values.reshape(1, 3))


def _utf(text: str) -> bytes:
    return struct.pack(">H", len(text)) + text.encode()


def _array_bytes(shape_info, kind="FLOAT", payload=None, length=None) -> bytes:
    """A MIXED_DATA_TYPES array as DL4J lays it out, any field replaceable by a crafted one."""
    info = _utf("MIXED_DATA_TYPES") + struct.pack(">q", len(shape_info)) + _utf("LONG")
    info += struct.pack(f">{len(shape_info)}q", *shape_info)
    payload = struct.pack(">3f", 1, 2, 3) if payload is None else payload
    return info + _utf("MIXED_DATA_TYPES") + struct.pack(">q", 3 if length is None else length) + _utf(kind) + payload


GOOD = [2, 1, 3, 3, 1, 8192, 1, 99]  # rank 2, shape [1, 3], strides [3, 1], FLOAT, ews 1, 'c'


@pytest.mark.parametrize("data, message", [
    (_array_bytes(GOOD)[:-5], "the data buffer says it holds 3 FLOAT values, but 7 bytes are left"),
    (_array_bytes(GOOD, length=1 << 60), "says it holds 1152921504606846976 FLOAT values"),
    (_array_bytes([-1, 3, 3, 1, 99]), "the shape buffer's rank is -1"),
    (_array_bytes([2, 1 << 40, 1 << 40, 1 << 40, 1, 8192, 1, 99]), "reaches 1208925819614629174706176 values, "
                                                                   "but the data buffer holds 3"),
    (_array_bytes(GOOD, kind="COMPRESSED"), "data type 'COMPRESSED', which dl4py does not read"),
    (_array_bytes([2, 1, 3, 3, 1, 8192, 1, 7]), "the order is 7, not 99 ('c') or 102 ('f')"),
    (_array_bytes([2, 1, -3, 3, 1, 8192, 1, 99]), "no size or stride is negative"),
    (_array_bytes(GOOD) + b"\0", "1 bytes follow the array"),
    (_utf("CUDA") + b"\0" * 8, "allocation mode 'CUDA', not one ND4J writes"),
    (b"\0", "needs 2 bytes at byte 0, but 1 are left"),
])
def test_a_crafted_or_truncated_array_is_one_line_naming_the_problem(data, message):
    with pytest.raises(DL4JFileError) as refused:
        read_array(data, name="crafted.bin")
    text = str(refused.value)
    assert text.startswith("crafted.bin: ") and message in text and "\n" not in text, text
