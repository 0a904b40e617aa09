"""Datasets (``fuel.datasets``): in memory, from iterables, ``.npy`` files, HDF5 files.

The modules keep Fuel's paths: :mod:`producer.datasets.base` (``Dataset``,
``IterableDataset``, ``IndexableDataset``) and :mod:`producer.datasets.hdf5`
(``H5PYDataset``, ``PytablesDataset``; h5py and tables are optional extras, imported
when a file is opened).
"""

from producer.datasets.base import (
    Dataset,
    IndexableDataset,
    IterableDataset,
    NpyDataset,
    normalize_request,
)
from producer.datasets.hdf5 import H5PYDataset
from producer.datasets.pytables import PytablesDataset

__all__ = [
    "Dataset",
    "H5PYDataset",
    "IndexableDataset",
    "IterableDataset",
    "NpyDataset",
    "PytablesDataset",
    "normalize_request",
]
