"""Fuel's module path ``fuel.datasets.hdf5``: the HDF5 datasets."""

from producer._hdf5 import H5PYDataset
from producer.datasets.pytables import PytablesDataset

__all__ = ["H5PYDataset", "PytablesDataset"]
