"""Data for training: batches (`DataSet`), the iterator protocol and the built-in iterators."""

from dl4py.data.csv import CsvDataSetIterator
from dl4py.data.dataset import DataSet
from dl4py.data.device import DeviceDataSetIterator
from dl4py.data.iterators import ArrayDataSetIterator, DataSetIterator
from dl4py.data.mnist import MnistDataSetIterator, load_mnist

__all__ = [
    "DataSet",
    "DataSetIterator",
    "ArrayDataSetIterator",
    "DeviceDataSetIterator",
    "MnistDataSetIterator",
    "CsvDataSetIterator",
    "load_mnist",
]
