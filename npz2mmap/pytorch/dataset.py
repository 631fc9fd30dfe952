"""MmapDataset: a map-style torch Dataset over a converted dataset.

Each process maps the blob itself, lazily, on first access; pickling carries
only the recipe (path, fields, transform, the parsed index), so DataLoader
workers start fast under fork, spawn and forkserver, and all of them share the
operating system's page cache instead of holding copies.
"""

from __future__ import annotations

import functools
import os
import threading
import warnings
from collections.abc import Callable, Iterable, Sequence
from typing import Any, cast

import numpy as np
import torch
from numpy.typing import NDArray
from torch.utils.data import Dataset, get_worker_info

from ..errors import LargerThanMemoryWarning
from ..format.index import SampleShape
from ..format.manifest import is_unordered, refuse_unordered
from ..read.features import Feature
from ..read.memory import fits_in_memory, larger_than_memory, memory_limit
from ..read.parts import Parts, PartsReader
from ..read.ragged import RaggedRows, lengths_axis
from ..read.reader import ADVICE, copy_bytes
from ..write.options import check_flags, repeated

# Imported for its registrations: torch's default collate must know the marked sample types
# wherever a dataset's batches are collated, in every worker process too.
from . import collate as _collate  # noqa: F401
from .assemble import NewMemory, place_fixed
from .gathered import GatheredBatch
from .samples import SampleList, mark_transformed
from .tensors import as_tensors

READS = ("auto", "exact", "mapped")


_warned_larger_than_memory: set[tuple[str, ...]] = set()


def choose_exact_reads(reads: str, parts: Parts, where: str) -> bool:
    """Whether to read samples exactly (see MmapDataset); warns once per dataset when it does not fit."""
    if reads not in READS:
        raise ValueError(f"reads must be one of {', '.join(map(repr, READS))}, not {reads!r}")
    nbytes = sum(index.blob_nbytes for index in parts.indexes)
    limit = memory_limit()
    if fits_in_memory(nbytes, limit):
        return reads == "exact"
    key = tuple(parts.paths)
    if key not in _warned_larger_than_memory:
        _warned_larger_than_memory.add(key)
        assert limit is not None
        warnings.warn(larger_than_memory(where, nbytes, limit), LargerThanMemoryWarning, stacklevel=3)
    return reads != "mapped"


class MmapDataset(Dataset[Any]):
    """Samples of an npz2mmap dataset as numpy arrays.

    ``path`` is a dataset directory, a directory with a ``manifest.json`` of
    parts, or a list of either: parts are read as one dataset, in order.
    ``ds[i]`` returns a dict field -> array, or the bare array when ``fields``
    is a single name. Arrays are fresh, writable copies: editing one never
    reaches the file or a later read; with ``tensors=True`` they come as torch
    tensors sharing that copy (dtypes torch lacks stay numpy). Only the
    selected ``fields`` are ever read. ``advice`` ('random', 'sequential', ...)
    is passed to madvise for each process's mapping.

    ``reads`` says how samples come from the disk when they are not cached:
    ``"mapped"``, by the kernel's page faults and read-around (right while the
    data fits in memory: what it reads around is read once and stays);
    ``"exact"``, each batch's exact byte ranges asked for at once, with no
    read-around (right when it does not fit: nothing is read for nothing, and
    the disk has many reads in flight); ``"auto"`` (the default), ``"exact"``
    when the dataset's blobs do not fit in the memory this process may use
    (npz2mmap.read.memory), with a LargerThanMemoryWarning naming both sizes, once.
    Raises FormatError if the dataset is invalid, KeyError for unknown fields.
    """

    def __init__(
        self,
        path: str | os.PathLike[str] | Sequence[str | os.PathLike[str]],
        fields: str | Sequence[str] | None = None,
        transform: Callable[[Any], Any] | None = None,
        advice: str | None = None,
        tensors: bool = False,
        reads: str = "auto",
    ) -> None:
        if isinstance(path, (str, os.PathLike)):
            self.path: str | list[str] = os.fspath(path)
        else:
            refuse_unordered(path)
            self.path = [os.fspath(p) for p in path]
        self.parts = Parts(self.path)
        self.single = isinstance(fields, str)
        if isinstance(fields, (bytes, bytearray)) or not isinstance(fields, (str, Iterable, type(None))):
            raise TypeError(f"fields names fields by str (one, or a list of them), not {fields!r}")
        if is_unordered(fields):
            raise TypeError("fields is a set, whose order changes from run to run: give a list (or a tuple)")
        if isinstance(fields, str):
            names = [fields]
        else:
            names = list(self.parts.field_names if fields is None else fields)
            if fields is not None and not names:
                raise ValueError("fields is empty: name at least one field, or leave it None for every field")
        for name in names:
            if not isinstance(name, str):
                raise TypeError(f"fields names fields by str (one, or a list of them), not {name!r}")
            self.parts.field(name)
        twice = repeated(names)
        if twice is not None:
            raise ValueError(f"fields names {twice!r} twice; name each field once")
        self.fields: tuple[str, ...] = tuple(names)
        # The selected fields whose shape differs between samples (in any part), with the shape each
        # index records (None where a version 2 part records none): see ragged_fields.
        infos = [self.parts.field(name) for name in names]
        self._recorded = {info.name: info.sample_shape for info in infos if info.shape is None}
        self._ragged_fields: dict[str, SampleShape] | None = None
        self.transform = transform
        check_flags(tensors=tensors)
        self.tensors = tensors
        if advice is not None and advice not in ADVICE:
            raise ValueError(f"advice must be one of {', '.join(ADVICE)}, got {advice!r}")
        self.advice = advice
        # Decided once, here, in the process that made the dataset: its workers read alike.
        self.exact_reads = choose_exact_reads(reads, self.parts, str(self.path))
        self._opened: tuple[int, PartsReader] | None = None  # (pid, its mappings): replaced at once
        self._locks: dict[int, threading.Lock] = {}

    def __len__(self) -> int:
        return self.parts.num_samples

    @property
    def ragged_fields(self) -> dict[str, SampleShape]:
        """The selected fields whose shape differs between samples, each with its shape in every
        sample (None where samples differ): batches carry it. From the index; where a version 2
        dataset records none (a ragged field of 2 or more dimensions), from its tables, on first
        use (once per process), so that opening it stays as cheap as before."""
        if self._ragged_fields is None:
            self._ragged_fields = {
                name: shape if shape is not None else self.reader.sample_shape(name)
                for name, shape in self._recorded.items()
            }
        return self._ragged_fields

    @property
    def reader(self) -> PartsReader:
        """This process's mappings, opened on first use (and again after a fork).

        Threads asking at once (MmapLoader's prefetch thread and the training
        loop) wait for one opening and share it.
        """
        pid = os.getpid()
        opened = self._opened
        if opened is None or opened[0] != pid:
            with self._opening_lock(pid):
                opened = self._opened
                if opened is None or opened[0] != pid:
                    advice = self.advice or ("random" if self.exact_reads and "random" in ADVICE else None)
                    opened = self._opened = (pid, PartsReader(self.parts, advice))
        return opened[1]

    def _opening_lock(self, pid: int) -> threading.Lock:
        """This process's lock: one inherited through fork may be held by a thread that is not there.

        setdefault is atomic, so threads racing here get the same lock.
        """
        return self._locks.setdefault(pid, threading.Lock())

    def __getitem__(self, i: int) -> Any:
        """Sample ``i``, knowing its ragged fields, so that a collate of samples taken one by one
        (through ConcatDataset or Subset) treats them as it treats a batch of this dataset. Only a
        plain dict, or the bare array of a ragged field, is marked: a transform's own mapping type
        is given back as it made it."""
        sample = self._read(i)
        bare_ragged = self.single and self.fields[0] in self.ragged_fields and type(sample) is np.ndarray
        return self._marked(sample, self.transform is None) if type(sample) is dict or bare_ragged else sample

    def _read(self, i: int) -> Any:
        reader = self.reader
        i = reader.sample_index(i)
        if self.single:
            sample: Any = self._copy(reader.view(self.fields[0], i))
        else:
            sample = {name: self._copy(reader.view(name, i)) for name in self.fields}
        return self.transform(sample) if self.transform is not None else sample

    def _marked(self, sample: Any, listed: bool) -> Any:
        return mark_transformed(sample, self.ragged_fields, self.fields[0] if self.single else None, listed)

    def _copy(self, view: np.ndarray) -> Any:
        array = copy_bytes(view)
        return as_tensors(array) if self.tensors else array

    def _sample_for_batch(self, i: int, listed: bool) -> Any:
        """``ds[i]``, except a bare ragged sample stays numpy, which torch's default collate can list."""
        if listed and self.single and self.fields[0] in self.ragged_fields:
            return copy_bytes(self.reader.view(self.fields[0], self.reader.sample_index(i)))
        return self._read(i)

    def __getitems__(self, indices: Sequence[int] | NDArray[np.integer]) -> Sequence[Any]:
        """A batch of samples, gathered with one copy per field (DataLoader calls this).

        Returns a GatheredBatch: a sequence of samples that the default collate
        accepts, and that ``npz2mmap.collate`` turns into tensors with no
        further copy. With a transform or ``tensors=True``, samples are read
        one by one instead, each as ``ds[i]`` gives it.
        """
        reader = self.reader
        idx = reader.sample_indices(indices)
        if self.exact_reads:
            reader.will_need(self.fields, idx)
        if self.transform is not None or self.tensors:  # samples as ds[i] gives them, one by one
            single = self.fields[0] if self.single else None
            listed = self.transform is None  # ragged fields as read: listed by torch's default collate
            samples = [self._marked(self._sample_for_batch(i, listed), listed) for i in idx.tolist()]
            return SampleList(samples, self.ragged_fields, single)
        destination = NewMemory(shared=get_worker_info() is not None)
        fields: dict[str, Any] = {}
        shared: dict[str, torch.Tensor] = {}
        for name in self.fields:
            if name in self.ragged_fields:  # located only: the collate pads or lists it
                fields[name] = reader.ragged_rows(name, idx)
                continue
            held, fill = place_fixed(reader, name, idx, destination)
            fill()
            if isinstance(held, torch.Tensor):
                fields[name], shared[name] = held.numpy(), held
            else:
                fields[name] = held
        single = self.fields[0] if self.single else None
        regather = functools.partial(_read_again, reader, idx)
        return GatheredBatch(fields, single, len(idx), self.ragged_fields, shared, regather)

    @property
    def features(self) -> dict[str, Feature]:
        """Each selected field's dtype and shape in every sample, None in each dimension in which
        samples differ (``(None, 4)`` for boxes), by name: the schema, as Hugging Face's
        ``features``; read from the index, no sample data."""
        return {
            name: Feature(info.dtype, self.ragged_fields.get(name, info.shape or ()), info.ndim)
            for name, info in ((name, self.parts.field(name)) for name in self.fields)
        }

    def lengths(self, field: str) -> np.ndarray:
        """Every sample's length (int64, (N,)) along the one dimension in which a field's samples
        differ: a sequence's length, the count of a (k, 4) field's boxes; a fixed field's first
        dimension. ValueError when several differ (``shapes`` then has every shape) and for a 0-d field.

        Read from the index and its shape tables only, never from sample data,
        so building length-grouped batches costs no I/O of the data itself.
        """
        shapes = self.shapes(field)  # tables checked whole first, as verify checks them
        if not shapes.shape[1]:
            raise ValueError(f"field {field!r} is 0-d: its samples have no length")
        shape = self.ragged_fields.get(field) or self.parts.field(field).shape or ()
        axis = lengths_axis(shape) if field in self.ragged_fields else 0
        if axis is None:
            dims = ", ".join(str(d) for d, length in enumerate(shape) if length is None)
            raise ValueError(
                f"field {field!r} differs between samples in dimensions {dims}, so no one length "
                f"describes a sample: ds.shapes({field!r}) gives each sample's shape"
            )
        return np.ascontiguousarray(shapes[:, axis])

    def shapes(self, field: str) -> np.ndarray:
        """Every sample's shape (int64, (N, ndim)), from the index tables alone."""
        return np.ascontiguousarray(self.reader.shapes(field))

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        state["_opened"] = None
        state["_locks"] = {}  # locks do not pickle; the process that loads this makes its own
        return state

    def __repr__(self) -> str:
        parts = f", parts={len(self.parts.paths)}" if len(self.parts.paths) > 1 else ""
        return f"MmapDataset({self.path!r}, samples={len(self)}{parts}, fields={list(self.fields)})"


def _read_again(reader: PartsReader, indices: NDArray[np.int64], name: str) -> np.ndarray | RaggedRows:
    """A batch's field read from the mapping once more: gathered anew, or (ragged) located."""
    if reader.field(name).shape is None:
        return reader.ragged_rows(name, indices)
    return cast(np.ndarray, reader.gather(name, indices))  # a fixed field gathers into one array
