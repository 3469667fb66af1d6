"""ArrayDataSetIterator: epoch orders, batching, conversion and validation."""

import numpy as np
import pytest
import torch

from dl4py.data import ArrayDataSetIterator, DataSet, DataSetIterator
from dl4py.errors import DataError


def _ids(n=10, batch_size=4, **kw):
    # Feature row i holds i, so a batch's first column names the examples it carries.
    features = torch.arange(n, dtype=torch.float32).reshape(n, 1).repeat(1, 3)
    labels = torch.arange(n) % 3
    return ArrayDataSetIterator(features, labels, batch_size, **kw)


def _epoch(it):
    return [int(v) for batch in it for v in batch.features[:, 0]]


def test_is_a_dataset_iterator_yielding_datasets():
    it = _ids()
    assert isinstance(it, DataSetIterator)
    batches = list(it)
    assert all(isinstance(b, DataSet) for b in batches)
    assert [b.num_examples() for b in batches] == [4, 4, 2]
    assert len(it) == 3 and it.total_examples() == 10
    assert it.num_classes() == 3 and it.input_shape() == (3,)


def test_every_example_exactly_once_per_epoch():
    it = _ids(n=103, batch_size=8)
    for _ in range(3):
        order = _epoch(it)
        assert sorted(order) == list(range(103))


def test_shuffle_order_is_a_function_of_seed_and_epoch():
    a, b = _ids(n=50, seed=7), _ids(n=50, seed=7)
    epochs_a = [_epoch(a) for _ in range(3)]
    assert epochs_a == [_epoch(b) for _ in range(3)]
    assert len({tuple(e) for e in epochs_a}) == 3, "consecutive epochs must differ"
    assert epochs_a[0] != list(range(50))
    expected = torch.randperm(50, generator=torch.Generator().manual_seed(7 + 2)).tolist()
    assert epochs_a[2] == expected
    assert _epoch(_ids(n=50, seed=8)) != epochs_a[0]


def test_set_epoch_overrides_the_counter_and_counting_continues_from_it():
    ref = _ids(n=40, seed=3)
    orders = [_epoch(ref) for _ in range(6)]
    it = _ids(n=40, seed=3)
    it.set_epoch(4)
    assert _epoch(it) == orders[4]
    assert _epoch(it) == orders[5]
    it.set_epoch(1)
    assert _epoch(it) == orders[1]
    assert it.epoch_order(4).tolist() == orders[4]
    with pytest.raises(ValueError, match="epoch"):
        it.set_epoch(-1)


def test_epoch_is_taken_when_iteration_starts_and_reset_restarts_from_first_batch():
    it = _ids(n=20, batch_size=4, seed=1)
    first = iter(it)
    second = iter(it)  # a second pass started before the first is consumed
    assert [int(v) for b in second for v in b.features[:, 0]] == it.epoch_order(1).tolist()
    assert [int(v) for b in first for v in b.features[:, 0]] == it.epoch_order(0).tolist()
    partial = iter(it)
    next(partial)
    it.reset()
    again = list(it)
    assert len(again) == 5 and sorted(int(v) for b in again for v in b.features[:, 0]) == list(range(20))


def test_no_shuffle_keeps_order_with_views_not_copies():
    it = _ids(n=10, batch_size=4, shuffle=False)
    assert _epoch(it) == list(range(10)) == _epoch(it)
    batch = next(iter(it))
    assert batch.features.data_ptr() == it.features.data_ptr()
    assert batch.features.is_contiguous()


def test_drop_last():
    it = _ids(n=10, batch_size=4, drop_last=True)
    assert len(it) == 2 and it.total_examples() == 8
    for _ in range(3):
        order = _epoch(it)
        assert len(order) == 8 and len(set(order)) == 8
    exact = _ids(n=8, batch_size=4, drop_last=True)
    assert len(exact) == 2 and exact.total_examples() == 8
    with pytest.raises(ValueError, match="no batch"):
        _ids(n=3, batch_size=4, drop_last=True)


def test_limit_keeps_the_first_examples_before_shuffling():
    it = _ids(n=30, batch_size=4, limit=7, seed=5)
    assert it.total_examples() == 7 and len(it) == 2
    assert it.features.shape == (7, 3) and it.labels.shape == (7,)
    order = _epoch(it)
    assert sorted(order) == list(range(7)) and order != list(range(7))
    with pytest.raises(ValueError, match="limit=31 exceeds the 30"):
        _ids(n=30, limit=31)


def test_numpy_inputs_are_converted_once():
    rng = np.random.default_rng(0)
    features = rng.normal(size=(9, 2, 2))  # float64
    labels = rng.integers(0, 4, size=9).astype(np.int32)
    it = ArrayDataSetIterator(features, labels, batch_size=5, shuffle=False)
    assert it.features.dtype == torch.float32 and it.labels.dtype == torch.int64
    assert it.input_shape() == (2, 2)
    batch = next(iter(it))
    assert batch.features.dtype == torch.float32 and batch.labels.dtype == torch.int64
    np.testing.assert_allclose(batch.features.numpy(), features[:5].astype(np.float32))
    assert batch.labels.tolist() == labels[:5].tolist()
    read_only = np.ones((4, 2))
    read_only.flags.writeable = False
    assert ArrayDataSetIterator(read_only, np.zeros(4, dtype=np.int64), 2).features.shape == (4, 2)


def test_regression_targets_are_float32_2d():
    targets = np.linspace(0, 1, 12).reshape(6, 2)
    it = ArrayDataSetIterator(np.ones((6, 3)), targets, batch_size=4)
    assert it.num_classes() is None
    batch = next(iter(it))
    assert batch.labels.dtype == torch.float32 and batch.labels.shape == (4, 2)


def test_num_classes_explicit_and_checked():
    labels = torch.tensor([0, 1, 1, 0])
    assert ArrayDataSetIterator(torch.ones(4, 2), labels, 2, num_classes=10).num_classes() == 10
    with pytest.raises(DataError, match=r"< num_classes=2, got 5 \(row 2\)"):
        ArrayDataSetIterator(torch.ones(4, 2), torch.tensor([0, 1, 5, 0]), 2, num_classes=2)
    with pytest.raises(ValueError, match="num_classes applies to class-index labels"):
        ArrayDataSetIterator(torch.ones(4, 2), torch.ones(4, 1), 2, num_classes=2)


@pytest.mark.parametrize("bad", [0, -3, 2.5, True, "8", None])
def test_batch_size_must_be_a_positive_int(bad):
    with pytest.raises(ValueError, match="batch_size"):
        ArrayDataSetIterator(torch.ones(4, 2), torch.zeros(4, dtype=torch.int64), bad)


@pytest.mark.parametrize(
    "features, labels, error, pattern",
    [
        (torch.ones(5, 2), torch.zeros(4, dtype=torch.int64), DataError, "features has 5 rows but labels has 4"),
        (torch.ones(4, 2), torch.zeros(4), DataError, r"1-D integer class indices.*reshape\(-1, 1\)"),
        (torch.ones(4, 2), torch.zeros(4, 2, dtype=torch.int64), DataError, "argmax"),
        (torch.ones(4, 2), torch.zeros(4, 1, 1), DataError, "labels must be"),
        (torch.ones(4, 2), torch.tensor([0, -1, 0, 0]), DataError, r"class indices >= 0, got -1 \(row 1\)"),
        (torch.ones(4), torch.zeros(4, dtype=torch.int64), DataError, "at least 2 dimensions"),
        (torch.ones(0, 2), torch.zeros(0, dtype=torch.int64), DataError, "empty"),
        ([[1.0, 2.0]], torch.zeros(1, dtype=torch.int64), TypeError, "features must be a torch.Tensor"),
        (np.array([["a"], ["b"]]), np.zeros(2, dtype=np.int64), DataError, "features must hold numbers"),
    ],
)
def test_bad_data_is_rejected_with_a_clear_message(features, labels, error, pattern):
    with pytest.raises(error, match=pattern):
        ArrayDataSetIterator(features, labels, 2)


@pytest.mark.parametrize("limit", [0, -1, 1.5])
def test_limit_must_be_a_positive_int(limit):
    with pytest.raises(ValueError, match="limit"):
        _ids(limit=limit)
