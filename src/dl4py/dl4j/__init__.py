"""Deeplearning4j's files in dl4py: ND4J arrays (``read_array``, ``write_array``)."""

from dl4py.dl4j.ndarray import DL4JFileError, read_array, write_array

__all__ = ["DL4JFileError", "read_array", "write_array"]
