"""The data a run config names: training, validation and test iterators (beside the runner,
which is its one user: it reads the run config and the train floor's validation split).

``make_iterators`` builds the training and test iterators of the ``data`` section (MNIST,
a CSV file, an image folder per class); ``make_validation`` holds data out as
``data.validation`` says (a split of the training data, or a file or folder of its own).
Every error names the config key at fault.
"""

from __future__ import annotations

import contextlib

from dl4py.config.run import DataConfig
from dl4py.data.csv import CsvDataSetIterator
from dl4py.data.images import ImageFolderIterator
from dl4py.data.mnist import MnistDataSetIterator
from dl4py.errors import ConfigError, DataSizeError
from dl4py.train.validation import split_validation


def make_iterators(data: DataConfig, batch_size: int, input_shape: tuple[int, ...]):
    """Training and test iterators for the data section (test is None when there is none)."""
    if data.dataset == "mnist":
        train = MnistDataSetIterator(
            batch_size, train=True, seed=data.seed, shuffle=data.shuffle, limit=data.limit_train
        )
        test = MnistDataSetIterator(batch_size, train=False, seed=data.seed, shuffle=False, limit=data.limit_test)
    elif data.dataset == "image_folder":
        train, test = _image_folders(data, batch_size, input_shape)
    else:
        def csv(path, limit, shuffle):
            return CsvDataSetIterator(
                path, batch_size, label_index=data.label_index, num_classes=data.num_classes,
                skip_lines=data.skip_lines, shuffle=shuffle, seed=data.seed, limit=limit,
            )

        with _limit_named("data.limit_train"):
            train = csv(data.train_path, data.limit_train, data.shuffle)
        with _limit_named("data.limit_test"):
            test = csv(data.test_path, data.limit_test, False) if data.test_path else None
    if tuple(train.input_shape()) != tuple(input_shape):
        raise ConfigError(
            "network.input_type",
            f"gives examples of shape {list(input_shape)} but the {data.dataset} data has "
            f"{list(train.input_shape())}",
        )
    return train, test


def _image_folders(data: DataConfig, batch_size: int, input_shape: tuple[int, ...]):
    """ImageFolderIterators for ``data.train_path`` (augmented as asked) and ``data.test_path``
    (never augmented, classes numbered as the training set's); sizes default to the network's."""
    sizes = {"channels": data.channels, "height": data.height, "width": data.width}
    if len(input_shape) == 3:  # convolutional: (channels, height, width)
        sizes = {k: v if v is not None else d for (k, v), d in zip(sizes.items(), input_shape)}
    for key, value in sizes.items():
        if value is None:
            raise ConfigError(f"data.{key}", f"is required: the network's input type gives flat examples "
                                             f"{list(input_shape)}; image folders give [channels, height, width] "
                                             "(use input_type convolutional)")
    common = dict(batch_size=batch_size, seed=data.seed, **sizes)
    train = ImageFolderIterator(data.train_path, shuffle=data.shuffle, random_crop=data.random_crop,
                                flip=data.flip, **common)
    test = None
    if data.test_path:
        test = ImageFolderIterator(data.test_path, shuffle=False, labels=train.labels, **common)
    return train, test


def make_validation(data: DataConfig, train, batch_size: int):
    """``(train, validation)``: ``data.validation`` held out of ``train`` (``split``) or read
    from its own ``path`` like the test data; ``validation`` is None without the section."""
    section = data.validation
    if section is None:
        return train, None
    if section.split is not None:
        return split_validation(train, section.split, seed=data.seed)
    if data.dataset == "image_folder":
        return train, ImageFolderIterator(section.path, batch_size=batch_size, seed=data.seed, shuffle=False,
                                          labels=train.labels, channels=train.channels, height=train.height,
                                          width=train.width)
    return train, CsvDataSetIterator(section.path, batch_size, label_index=data.label_index,
                                     num_classes=data.num_classes, skip_lines=data.skip_lines, shuffle=False)


@contextlib.contextmanager
def _limit_named(key: str):
    """A limit beyond the data's size, named by its config key."""
    try:
        yield
    except DataSizeError as exc:
        raise ConfigError(key, f"is {exc.limit}, more than the {exc.available} examples of {exc.source}") from None
