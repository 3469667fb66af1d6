"""CsvDataSetIterator: parsing, label handling and error messages that point at the cell."""

import pytest
import torch

from dl4py.data import CsvDataSetIterator
from dl4py.errors import DataError


def _csv(tmp_path, text, name="data.csv"):
    path = tmp_path / name
    path.write_text(text)
    return path


def test_classification_with_label_last(tmp_path):
    path = _csv(tmp_path, "0.5,1.5,2\n1,2,0\n3,4,1\n5,6,2\n7,8,0\n")
    it = CsvDataSetIterator(path, batch_size=2, num_classes=3, shuffle=False)
    assert it.num_classes() == 3 and it.input_shape() == (2,) and len(it) == 3
    assert it.features.dtype == torch.float32 and it.labels.dtype == torch.int64
    assert it.features[0].tolist() == [0.5, 1.5]
    assert it.labels.tolist() == [2, 0, 1, 2, 0]
    assert [b.num_examples() for b in it] == [2, 2, 1]


def test_header_label_first_blank_lines_and_crlf(tmp_path):
    path = _csv(tmp_path, "label,a,b\r\n1,10,20\r\n\r\n0, 30 ,40\r\n")
    it = CsvDataSetIterator(path, 4, label_index=0, num_classes=2, skip_lines=1, shuffle=False)
    assert it.labels.tolist() == [1, 0]
    assert it.features.tolist() == [[10.0, 20.0], [30.0, 40.0]]


def test_regression_target_and_other_delimiter(tmp_path):
    path = _csv(tmp_path, "1;2;0.25\n3;4;-1.5\n")
    it = CsvDataSetIterator(path, 2, delimiter=";", shuffle=False)
    assert it.num_classes() is None
    assert it.labels.dtype == torch.float32 and it.labels.tolist() == [[0.25], [-1.5]]
    assert it.features.tolist() == [[1.0, 2.0], [3.0, 4.0]]


def test_middle_label_column(tmp_path):
    path = _csv(tmp_path, "1,0,2\n3,1,4\n")
    it = CsvDataSetIterator(path, 2, label_index=1, num_classes=2, shuffle=False)
    assert it.labels.tolist() == [0, 1] and it.features.tolist() == [[1.0, 2.0], [3.0, 4.0]]


def test_shuffle_seed_and_limit_pass_through(tmp_path):
    path = _csv(tmp_path, "".join(f"{i},{i % 2}\n" for i in range(20)))
    it = CsvDataSetIterator(path, 3, num_classes=2, seed=4, limit=9)
    assert it.total_examples() == 9
    order = [int(v) for b in it for v in b.features[:, 0]]
    assert sorted(order) == list(range(9)) and order != list(range(9))
    again = CsvDataSetIterator(path, 3, num_classes=2, seed=4, limit=9)
    assert [int(v) for b in again for v in b.features[:, 0]] == order


@pytest.mark.parametrize(
    "text, kwargs, pattern",
    [
        ("1,2,0\n3,x,1\n", {}, r"line 2, column 2: 'x' is not a number"),
        ("h\nskip\n1,2,0\n\n3,4,1\n5,6\n", {"skip_lines": 2}, r"line 6: 2 columns, expected 3"),
        ("1,2,0\n3,4,\n", {}, r"line 2, column 3: '' is not a number"),
        ("1,2,0\n3,4,1\n\n5,6,3\n", {"num_classes": 3}, r"line 4, column 3: label 3 is not an integer in \[0, 3\)"),
        ("1,2,0.5\n", {"num_classes": 3}, r"line 1, column 3: label 0.5 is not an integer"),
        ("2,1,0\n3,-1,1\n", {"num_classes": 3, "label_index": 1}, r"line 2, column 2: label -1"),
        ("", {}, "no data rows"),
        ("a,b,c\n", {"skip_lines": 1}, "no data rows"),
        ("1\n2\n", {}, "need at least one feature column"),
    ],
)
def test_bad_file_errors_name_file_line_and_column(tmp_path, text, kwargs, pattern):
    path = _csv(tmp_path, text, name="bad.csv")
    with pytest.raises(DataError, match=pattern) as info:
        CsvDataSetIterator(path, 2, **kwargs)
    assert str(path) in str(info.value)


def test_missing_file(tmp_path):
    with pytest.raises(DataError, match="nope.csv: no such file"):
        CsvDataSetIterator(tmp_path / "nope.csv", 2)


@pytest.mark.parametrize(
    "kwargs, pattern",
    [
        ({"label_index": 3}, "label_index=3 is out of range"),
        ({"label_index": -4}, "label_index=-4 is out of range"),
        ({"skip_lines": -1}, "skip_lines"),
        ({"delimiter": ""}, "delimiter"),
        ({"num_classes": 0}, "num_classes"),
        ({"batch_size": 0}, "batch_size"),
    ],
)
def test_bad_arguments(tmp_path, kwargs, pattern):
    path = _csv(tmp_path, "1,2,0\n3,4,1\n")
    args = {"batch_size": 2, **kwargs}
    with pytest.raises(ValueError, match=pattern):
        CsvDataSetIterator(path, **args)
