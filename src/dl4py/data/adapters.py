"""Data from anywhere -> the iterator protocol. The one place that knows these types.

``as_iterator`` is what ``fit``, ``evaluate``, ``score`` and ``output`` call. It accepts:

- a ``DataSetIterator``: used as it is;
- a ``DataSet``: one batch (DL4J's ``fit(DataSet)``), or batches of ``batch_size``;
- ``(X, y)``: numpy arrays, tensors or pandas objects, batches of ``batch_size`` (32 by
  default, as Keras), shuffled each training epoch with the model's seed;
- a pandas ``DataFrame`` with ``label=`` naming the label column(s) (``features=`` the
  feature columns, default all others);
- a Hugging Face ``datasets.Dataset`` (``label=`` default "label", ``features=`` default
  all other columns) or ``IterableDataset`` (streamed);
- a torch ``DataLoader``: its batches, in its order (``num_workers`` loads in background);
- a torch ``Dataset``: map-style is batched (and shuffled for training) by dl4py, iterable
  streams in its own order;
- any iterable of ``(features, labels)`` batches, or a zero-argument function returning one
  (a generator is one pass; a function gives every epoch a fresh one).

pandas and ``datasets`` are recognised by module name, so neither is imported unless used.
"""

from __future__ import annotations

import numpy as np
import torch
from torch.utils.data import DataLoader, IterableDataset, RandomSampler

from dl4py.data.batch_stream import BatchesIterator, LoaderIterator
from dl4py.data.columns import cell_explainer, dict_arrays, first_non_finite, frame_arrays
from dl4py.data.dataset import DataSet
from dl4py.data.iterators import ArrayDataSetIterator, DataSetIterator, _positive_int
from dl4py.errors import DataError

__all__ = ["as_iterator", "DEFAULT_BATCH_SIZE"]

DEFAULT_BATCH_SIZE = 32  # Keras' default for arrays

ACCEPTED = (
    "a DataSetIterator, a DataSet, (features, labels) arrays or tensors, a pandas DataFrame "
    "(with label=), a Hugging Face Dataset, a torch DataLoader or Dataset, an iterable of "
    "(features, labels) batches, or a function returning one"
)


def as_iterator(data, batch_size: int | None = None, *, shuffle: bool | None = None, seed: int = 0,
                label=None, features=None, training: bool = False, labelled: bool = True) -> DataSetIterator:
    """``data`` as a DataSetIterator.

    ``shuffle`` applies to sources dl4py batches itself (arrays, DataFrames, HF and
    map-style Datasets): None means shuffle when ``training``, each epoch in the order
    ``seed + epoch`` gives. A DataLoader or an iterable keeps its own order.
    ``labelled=False`` (``output``): a DataFrame may then have no label column.

    >>> it = as_iterator((np.zeros((100, 3)), np.arange(100) % 2), training=True)
    >>> len(it), it.batch_size
    (4, 32)
    """
    if batch_size is not None:
        batch_size = _positive_int(batch_size, "batch_size")
    module = type(data).__module__ or ""
    if isinstance(data, DataSetIterator):
        _no_options(data, batch_size=batch_size, shuffle=shuffle, label=label, features=features)
        return data
    if isinstance(data, DataSet):
        _no_options(data, shuffle=shuffle, label=label, features=features)
        if data.features_mask is not None:  # padded sequences: one batch, its mask kept
            if batch_size is not None and batch_size < data.num_examples():
                raise DataError("a DataSet with a features_mask is one batch; for smaller batches of "
                                "sequences use SequenceDataSetIterator(sequences, labels, batch_size)")
            return BatchesIterator([data], name="DataSet")
        # DL4J's fit(DataSet) is one step on the whole set; a batch size splits it.
        return ArrayDataSetIterator(data.features, data.labels, batch_size=batch_size or max(data.num_examples(), 1),
                                    shuffle=False)
    order = dict(batch_size=batch_size or DEFAULT_BATCH_SIZE, shuffle=training if shuffle is None else shuffle,
                 seed=seed)
    if module.startswith("pandas") and type(data).__name__ == "DataFrame":
        x, y = frame_arrays(data, label, features, "the DataFrame", need_label=labelled)
        return _arrays(x, y, **order)
    if module.startswith("datasets"):
        return _hugging_face(data, shuffle, label, features, order)
    if isinstance(data, torch.utils.data.DataLoader):
        _no_options(data, batch_size=batch_size, shuffle=shuffle)
        return LoaderIterator(data, label=label, features=features)
    if isinstance(data, torch.utils.data.Dataset):
        return _torch_dataset(data, shuffle, label, features, order)
    if isinstance(data, (tuple, list)) and len(data) == 2 and all(map(_array_like, data)):
        _no_options(data, label=label, features=features)
        return _arrays(_plain(data[0], "features"), _plain(data[1], "labels"), **order)
    if callable(data) or (hasattr(data, "__iter__") and not isinstance(data, (str, bytes, dict))):
        _no_options(data, batch_size=batch_size, shuffle=shuffle)
        return BatchesIterator(data, label=label, features=features)
    raise DataError(f"cannot train on {_type_name(data)}: expected {ACCEPTED}")


def _arrays(x, y, batch_size, shuffle, seed) -> ArrayDataSetIterator:
    if y is None:  # features only (output): labels that are never read
        y = torch.zeros(len(x), dtype=torch.int64)
    return ArrayDataSetIterator(x, y, batch_size=batch_size, shuffle=shuffle, seed=seed)


def _torch_dataset(data, shuffle, label, features, order) -> DataSetIterator:
    if isinstance(data, IterableDataset):
        if shuffle:
            raise ValueError(
                f"shuffle=True: {_type_name(data)} is an iterable Dataset and streams in its own order; "
                "shuffle inside it (or use TableDirectoryIterator(shuffle_buffer=...))"
            )
        return LoaderIterator(DataLoader(data, batch_size=order["batch_size"]), label=label, features=features)
    try:
        len(data)
    except TypeError:
        raise DataError(f"{_type_name(data)} is a map-style Dataset without __len__; dl4py cannot batch it") from None
    # A generator dl4py reseeds every epoch: the RandomSampler then draws the very order an
    # ArrayDataSetIterator with this seed draws (both are one randperm(n) of it). It is the
    # sampler's alone: a DataLoader's own generator also seeds its workers, a draw first.
    generator = torch.Generator() if order["shuffle"] else None
    sampler = RandomSampler(data, generator=generator) if generator is not None else None
    loader = DataLoader(data, batch_size=order["batch_size"], sampler=sampler)
    return LoaderIterator(loader, generator, order["seed"], label=label, features=features)


def _hugging_face(data, shuffle, label, features, order) -> DataSetIterator:
    kind = type(data).__name__
    if kind == "DatasetDict" or kind == "IterableDatasetDict":
        raise DataError(f"a Hugging Face {kind} holds several splits ({', '.join(data)}); pass one, e.g. ds['train']")
    if kind == "IterableDataset":
        if shuffle:
            raise ValueError("shuffle=True: a Hugging Face IterableDataset streams in its own order; "
                             "use its .shuffle(buffer_size=...) instead")
        size = order["batch_size"]

        def batches():  # streamed: HF reads and decodes as the epoch goes
            return (dict_arrays(b, label, features, "the Hugging Face IterableDataset")
                    for b in data.iter(batch_size=size))

        it = BatchesIterator(batches, name="Hugging Face IterableDataset")
        it.batch_size = size
        return it
    if kind != "Dataset":
        raise DataError(f"cannot train on {_type_name(data)}: expected {ACCEPTED}")
    label = "label" if label is None else label
    columns = list(data.column_names)
    wanted = [label] if isinstance(label, str) else list(label)
    wanted += ([features] if isinstance(features, str) else list(features)) if features is not None else [
        c for c in columns if c not in wanted]
    missing = [c for c in wanted if c not in columns]
    if missing:
        raise DataError(
            f"the Hugging Face Dataset has no column {missing[0]!r}; its columns are {', '.join(map(repr, columns))}"
            + ("; name the label with label=..." if missing[0] == label else "")
        )
    # One columnar read, in memory as the other in-memory sources are.
    table = data.select_columns(wanted).with_format("numpy")[:]
    x, y = dict_arrays(table, label, features, "the Hugging Face Dataset")
    return _arrays(x, y, **order)


def _array_like(value) -> bool:
    module = type(value).__module__ or ""
    return isinstance(value, (np.ndarray, torch.Tensor)) or (
        module.startswith("pandas") and type(value).__name__ in ("DataFrame", "Series"))


def _plain(value, name: str):
    """pandas -> numpy (numeric and finite only); arrays and tensors as they are."""
    if isinstance(value, (np.ndarray, torch.Tensor)):
        return value
    kind = type(value).__name__
    array = value.to_numpy()
    if array.dtype.kind not in "biuf":
        raise DataError(f"{name}: the pandas {kind} holds {array.dtype} values, not numbers")
    bad = first_non_finite(array.reshape(len(array), -1))
    if bad is not None:  # a Series is a frame of one column, named by the Series' name
        frame = value if kind == "DataFrame" else value.to_frame()
        raise DataError(cell_explainer(frame, f"{name}: the pandas {kind}")(bad[0], str(frame.columns[bad[1]])))
    return array


def _no_options(data, **given) -> None:
    """An option that cannot apply to ``data`` is an error, never silently ignored."""
    for name, value in given.items():
        if value is not None:
            own = {"batch_size": "its own batch size", "shuffle": "its own order",
                   "label": "its own labels", "features": "its own features"}[name]
            raise ValueError(f"{name} applies to arrays, DataFrames and Datasets that dl4py batches; "
                             f"{_type_name(data)} has {own}")


def _type_name(data) -> str:
    kind = type(data)
    module = kind.__module__ or ""
    return f"{module}.{kind.__qualname__}" if module not in ("builtins", "") else kind.__qualname__
