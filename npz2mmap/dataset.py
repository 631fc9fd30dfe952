"""MmapDataset: a map-style torch Dataset over a converted dataset.

Each process maps the blob itself, lazily, on first access; pickling carries
only the recipe (path, fields, transform, the parsed index), so DataLoader
workers start fast under fork, spawn and forkserver, and all of them share the
operating system's page cache instead of holding copies.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
from torch.utils.data import Dataset

from .reader import DatasetReader, blob_identity
from .spec import Index, load_index


class MmapDataset(Dataset[Any]):
    """Samples of an npz2mmap dataset as numpy arrays.

    ``ds[i]`` returns a dict field -> array, or the bare array when ``fields``
    is a single name. Arrays are fresh, writable copies: editing one never
    reaches the file or a later read. Raises FormatError if the dataset is
    invalid and KeyError for unknown fields.
    """

    def __init__(
        self,
        path: str | os.PathLike[str],
        fields: str | Sequence[str] | None = None,
        transform: Callable[[Any], Any] | None = None,
    ) -> None:
        self.path = os.fspath(path)
        self.index: Index = load_index(self.path)
        self.blob_identity = blob_identity(self.path)
        self.single = isinstance(fields, str)
        names = [fields] if isinstance(fields, str) else list(fields or self.index.field_names)
        for name in names:
            self.index.field(name)
        self.fields: tuple[str, ...] = tuple(names)
        self.transform = transform
        self._reader: DatasetReader | None = None
        self._pid = -1

    def __len__(self) -> int:
        return self.index.num_samples

    @property
    def reader(self) -> DatasetReader:
        """This process's mapping, opened on first use (and again after a fork)."""
        if self._reader is None or self._pid != os.getpid():
            self._reader = DatasetReader(self.path, self.index, self.blob_identity)
            self._pid = os.getpid()
        return self._reader

    def __getitem__(self, i: int) -> Any:
        reader = self.reader
        i = reader.sample_index(i)
        if self.single:
            sample: Any = np.array(reader.view(self.fields[0], i))
        else:
            sample = {name: np.array(reader.view(name, i)) for name in self.fields}
        return self.transform(sample) if self.transform is not None else sample

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        state["_reader"] = None
        state["_pid"] = -1
        return state

    def __repr__(self) -> str:
        return f"MmapDataset({self.path!r}, samples={len(self)}, fields={list(self.fields)})"
