"""DL4J's normalizer.bin (``dl4py.dl4j.normalizer_file``). No real normalizer.bin is among
DL4J's published test files, so the files here are written as DL4J's own code writes them,
following its Java line by line (``NormalizerSerializer.writeHeader``: writeUTF("NORMALIZER"),
writeInt(1), writeUTF(type); ``StandardizeSerializerStrategy``, ``MinMaxSerializerStrategy``,
``ImagePreProcessingSerializerStrategy``: writeBoolean(fitLabel), writeDouble of the ranges,
Nd4j.write of each array), with ``write_array`` standing in for Nd4j.write (shown byte-identical
to DL4J 1.0.0-beta4's arrays in test_dl4j_arrays.py). Read -> write is byte for byte; the dl4py
normalizer each maps onto transforms features as DL4J's strategies do (their formulas, in float32,
written out below); and a crafted or truncated file is one line naming what is wrong."""

from __future__ import annotations

import struct

import numpy as np
import pytest
import torch

from dl4py.data.normalizers import ImagePreProcessingScaler, NormalizerMinMaxScaler, NormalizerStandardize
from dl4py.dl4j import DL4JFileError, write_array
from dl4py.dl4j.normalizer_file import (load_normalizer, normalizer_from_dl4j, normalizer_to_dl4j, read_normalizer,
                                        write_normalizer)

EPS = 1e-5  # Nd4j.EPS_THRESHOLD


def _utf(text: str) -> bytes:  # DataOutputStream.writeUTF, for ASCII
    return struct.pack(">H", len(text)) + text.encode("ascii")


def _dl4j_file(kind: str, body: bytes) -> bytes:
    """NormalizerSerializer.write: the header, then the strategy's bytes."""
    return _utf("NORMALIZER") + struct.pack(">i", 1) + _utf(kind) + body


def standardize_file(mean, std, labels=None) -> bytes:
    body = struct.pack(">?", labels is not None) + write_array(mean) + write_array(std)
    return _dl4j_file("STANDARDIZE", body + (b"".join(write_array(a) for a in labels) if labels else b""))


def min_max_file(target_min, target_max, low, high, labels=None) -> bytes:
    body = struct.pack(">?dd", labels is not None, target_min, target_max) + write_array(low) + write_array(high)
    return _dl4j_file("MIN_MAX", body + (b"".join(write_array(a) for a in labels) if labels else b""))


def image_file(min_range, max_range, max_pixel) -> bytes:
    return _dl4j_file("IMAGE_MIN_MAX", struct.pack(">ddd", min_range, max_range, max_pixel))


MEAN = np.array([0.5, -2.0, 10.0, 3.0], dtype=np.float32)
STD = np.array([2.0, 0.25, 0.0, 1.5], dtype=np.float32)  # a constant feature: std 0
LOW = np.array([-1.0, 0.0, 5.0, 2.0], dtype=np.float32)
HIGH = np.array([3.0, 0.5, 5.0, 10.0], dtype=np.float32)  # a constant feature: max == min
FILES = {
    "standardize": standardize_file(MEAN, STD),
    "standardize, labels too": standardize_file(MEAN, STD, labels=(MEAN[:2], STD[:2])),
    "standardize, 0.x [1, n] doubles": standardize_file(MEAN.astype(np.float64).reshape(1, 4),
                                                        STD.astype(np.float64).reshape(1, 4)),
    "min-max": min_max_file(-1.0, 1.0, LOW, HIGH),
    "min-max, labels too": min_max_file(0.0, 1.0, LOW, HIGH, labels=(LOW[:1], HIGH[:1])),
    "image": image_file(-0.5, 0.5, 255.0),
    "image, 16 bits": image_file(0.0, 1.0, 65535.0),
    "image, inverted": image_file(1.0, 0.0, 255.0),  # DL4J allows maxRange < minRange: 1 - x / 255
}


@pytest.mark.parametrize("name", sorted(FILES))
def test_a_dl4j_normalizer_file_is_written_again_byte_for_byte(name):
    assert write_normalizer(read_normalizer(FILES[name])) == FILES[name]


def test_the_values_read_are_the_values_dl4j_wrote():
    standardize = read_normalizer(FILES["standardize, labels too"])
    assert (standardize.kind, standardize.fit_labels) == ("STANDARDIZE", True)
    assert list(standardize.arrays) == ["mean", "std", "label_mean", "label_std"]
    assert np.array_equal(standardize.arrays["std"], STD) and np.array_equal(standardize.arrays["label_mean"], MEAN[:2])
    min_max = read_normalizer(FILES["min-max"])
    assert (min_max.kind, min_max.fit_labels, min_max.min_range, min_max.max_range) == ("MIN_MAX", False, -1.0, 1.0)
    assert np.array_equal(min_max.arrays["min"], LOW) and np.array_equal(min_max.arrays["max"], HIGH)
    image = read_normalizer(FILES["image"])
    assert (image.kind, image.min_range, image.max_range, image.max_pixel_value) == ("IMAGE_MIN_MAX", -0.5, 0.5, 255.0)


# DL4J's transforms, from its Java, in the float32 DL4J computes them in.
def dl4j_standardize(x, mean, std):
    std = np.maximum(std, np.float32(EPS))  # DistributionStats' constructor
    return (x - _per_feature(mean, x)) / _per_feature(std, x)  # StandardizeStrategy.preProcess


def dl4j_min_max(x, low, high, min_range, max_range):
    high = high + (np.maximum(high - low, np.float32(EPS)) - (high - low))  # MinMaxStats' constructor
    max_range = max(max_range, min_range + EPS)  # MinMaxStrategy's constructor
    scaled = (x - _per_feature(low, x)) / _per_feature(high - low, x)  # MinMaxStrategy.preProcess
    return scaled * np.float32(max_range - min_range) + np.float32(min_range)


def dl4j_image(x, min_range, max_range, max_pixel):
    x = x / np.float32(max_pixel)  # ImagePreProcessingScaler.preProcess
    if max_range - min_range != 1:
        x = x * np.float32(max_range - min_range)
    return x + np.float32(min_range) if min_range != 0 else x


def _per_feature(stat, x):
    """Row-vector ops for [n, f]; a broadcast along dimension 1 for [n, c, ...] (DL4J's strategies)."""
    return stat.reshape((1, -1) + (1,) * (x.ndim - 2))


@pytest.mark.parametrize("shape", [(5, 4), (3, 4, 2, 3)], ids=["rows", "images"])
def test_the_mapped_normalizers_transform_as_dl4j_does(shape):
    x = np.random.default_rng(0).uniform(-3, 260, shape).astype(np.float32)
    cases = [
        ("standardize", dl4j_standardize(x, MEAN, STD)),
        ("standardize, 0.x [1, n] doubles", dl4j_standardize(x, MEAN, STD)),
        ("min-max", dl4j_min_max(x, LOW, HIGH, -1.0, 1.0)),
        ("image", dl4j_image(x, -0.5, 0.5, 255.0)),
        ("image, 16 bits", dl4j_image(x, 0.0, 1.0, 65535.0)),
        ("image, inverted", dl4j_image(x, 1.0, 0.0, 255.0)),
    ]
    for name, expected in cases:
        normalizer = load_normalizer(FILES[name])
        got = normalizer.transform(torch.from_numpy(x)).numpy()
        np.testing.assert_allclose(got, expected, rtol=2e-6, atol=2e-6, err_msg=name)


def test_min_max_with_an_empty_target_range_is_widened_as_dl4j_widens_it():
    """MinMaxStrategy raises maxRange to minRange + 1e-5; dl4py takes the widened range."""
    normalizer = load_normalizer(min_max_file(2.0, 2.0, LOW, HIGH))
    assert (normalizer.min_range, normalizer.max_range) == (2.0, 2.0 + EPS)


@pytest.mark.parametrize("normalizer", [
    NormalizerStandardize().fit(torch.tensor([[1.0, 2.0], [3.0, 7.0], [2.0, -1.0]])),
    NormalizerStandardize(mean=[0.5, 1.5], std=[2.0, 4.0]),
    NormalizerMinMaxScaler(-1.0, 2.0).fit(torch.tensor([[1.0, 2.0], [3.0, 2.0]])),
    ImagePreProcessingScaler(0.0, 1.0, max_bits=12),
], ids=["standardize fitted", "standardize float32-exact", "min-max", "image"])
def test_a_dl4py_normalizer_goes_to_dl4j_as_dl4j_writes_it_and_comes_back_the_same(normalizer):
    """The written file is the one DL4J's serializer writes for these statistics (FLOAT where
    every value is a float32, else DOUBLE: no bit lost), and reading it back gives a normalizer
    with the same statistics and the same transform."""
    data = write_normalizer(normalizer_to_dl4j(normalizer))
    if isinstance(normalizer, ImagePreProcessingScaler):
        assert data == image_file(0.0, 1.0, 4095.0)
    else:
        first, second = (getattr(normalizer, n).numpy() for n in _stat_names(normalizer))
        exact = all(np.array_equal(a.astype(np.float32).astype(np.float64), a) for a in (first, second))
        first, second = (a.astype(np.float32 if exact else np.float64) for a in (first, second))
        expected = (standardize_file(first, second) if isinstance(normalizer, NormalizerStandardize)
                    else min_max_file(normalizer.min_range, normalizer.max_range, first, second))
        assert data == expected
    again = load_normalizer(data)
    assert type(again) is type(normalizer) and again.settings() == normalizer.settings()
    for name in _stat_names(normalizer):
        assert torch.equal(getattr(again, name), getattr(normalizer, name)), name
    x = torch.rand(4, 2) * 50
    assert torch.equal(again.transform(x), normalizer.transform(x))


def _stat_names(normalizer) -> tuple[str, ...]:
    return {NormalizerStandardize: ("mean", "std"), NormalizerMinMaxScaler: ("min", "max")}.get(type(normalizer), ())


def _crafted():
    good = FILES["standardize"]
    mean_at = len(_dl4j_file("STANDARDIZE", b"\0"))  # where the mean array starts
    huge = bytearray(good)  # the mean's data buffer claims 2**60 values
    length_at = mean_at + len(write_array(MEAN)) - 4 * 4 - len(_utf("FLOAT")) - 8
    huge[length_at:length_at + 8] = struct.pack(">q", 1 << 60)
    return [
        (b"", "the header needs 2 bytes at byte 0, but 0 are left"),
        (_utf("NORMALISER") + good[12:], "starts with 'NORMALISER', not 'NORMALIZER'"),
        (_utf("NORMALIZER") + struct.pack(">i", 2) + good[16:], "is version 2; NormalizerSerializer writes only "
                                                                 "version 1"),
        (_dl4j_file("FOO", b""), "normalizer type 'FOO' is not one of DL4J's NormalizerType names"),
        (_dl4j_file("CUSTOM", _utf("com.example.MyStrategy")), "holds a CUSTOM normalizer (strategy class "
                                                               "com.example.MyStrategy)"),
        (_dl4j_file("MULTI_STANDARDIZE", b"\0"), "holds a MultiNormalizerStandardize (MULTI_STANDARDIZE)"),
        (_dl4j_file("STANDARDIZE", b"\x07") + good[mean_at:], "fitLabel is the byte 7, not 0 or 1"),
        (good + b"\0", "1 bytes follow the NormalizerStandardize"),
        (bytes(huge), "says it holds 1152921504606846976 FLOAT values"),
        (image_file(0, 1, 255)[:-3], "minRange, maxRange, maxPixelVal needs 24 bytes"),
    ]


@pytest.mark.parametrize("data, message", _crafted())
def test_a_crafted_file_is_one_line_naming_the_problem(data, message):
    with pytest.raises(DL4JFileError) as refused:
        read_normalizer(data, name="model.zip/normalizer.bin")
    text = str(refused.value)
    assert text.startswith("model.zip/normalizer.bin: ") and message in text and "\n" not in text, text


@pytest.mark.parametrize("name", sorted(FILES))
def test_every_truncation_is_one_line(name):
    data = FILES[name]
    for cut in range(len(data)):
        with pytest.raises(DL4JFileError) as refused:
            read_normalizer(data[:cut])
        assert str(refused.value).startswith("normalizer.bin: ") and "\n" not in str(refused.value)


@pytest.mark.parametrize("data, message", [
    (FILES["standardize, labels too"], "the NormalizerStandardize also normalizes labels (fitLabel=true)"),
    (FILES["min-max, labels too"], "the NormalizerMinMaxScaler also normalizes labels (fitLabel=true)"),
    (image_file(0, 1, 100.0), "ImagePreProcessingScaler: maxPixelVal 100.0 is not 2**bits - 1"),
    (standardize_file(MEAN, STD[:3]), "NormalizerStandardize: mean has 4 values but std has 3"),
    (standardize_file(np.array([1.0, np.nan], dtype=np.float32), STD[:2]), "NormalizerStandardize: mean must be a "
                                                                           "non-empty vector of finite numbers"),
    (standardize_file(MEAN.reshape(2, 2), STD.reshape(2, 2)), "statistics shaped [2, 2], not a row"),
])
def test_what_dl4py_cannot_hold_is_refused_in_one_line(data, message):
    with pytest.raises(DL4JFileError) as refused:
        normalizer_from_dl4j(read_normalizer(data), where="model.zip/normalizer.bin")
    text = str(refused.value)
    assert text.startswith("model.zip/normalizer.bin: ") and message in text and "\n" not in text, text
