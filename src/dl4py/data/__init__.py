"""Data for training: batches (`DataSet`), the iterator protocol and the built-in iterators."""

from dl4py.data.adapters import as_iterator
from dl4py.data.batch_stream import BatchesIterator, LoaderIterator, UnknownLengthError
from dl4py.data.csv import CsvDataSetIterator
from dl4py.data.dataset import DataSet
from dl4py.data.device import DeviceDataSetIterator
from dl4py.data.images import ImageFolderIterator
from dl4py.data.iterators import ArrayDataSetIterator, DataSetIterator
from dl4py.data.mnist import MnistDataSetIterator, load_mnist
from dl4py.data.sequences import SequenceDataSetIterator
from dl4py.data.normalizers import (
    ImagePreProcessingScaler,
    Normalizer,
    NormalizerMinMaxScaler,
    NormalizerStandardize,
)
from dl4py.data.streaming import TableDataset, TableDirectoryIterator

__all__ = [
    "DataSet",
    "DataSetIterator",
    "ArrayDataSetIterator",
    "DeviceDataSetIterator",
    "MnistDataSetIterator",
    "CsvDataSetIterator",
    "SequenceDataSetIterator",
    "load_mnist",
    "ImageFolderIterator",
    "Normalizer",
    "NormalizerStandardize",
    "NormalizerMinMaxScaler",
    "ImagePreProcessingScaler",
    "as_iterator",
    "LoaderIterator",
    "BatchesIterator",
    "UnknownLengthError",
    "TableDirectoryIterator",
    "TableDataset",
]
