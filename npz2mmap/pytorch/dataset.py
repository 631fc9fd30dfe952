"""MmapDataset: a map-style torch Dataset over a converted dataset.

Each process maps the blob itself, lazily, on first access; pickling carries
only the recipe (path, fields, transform, the parsed index), so DataLoader
workers start fast under fork, spawn and forkserver, and all of them share the
operating system's page cache instead of holding copies.
"""

from __future__ import annotations

import functools
import operator
import os
import threading
import warnings
from collections.abc import Callable, Mapping, Sequence
from collections.abc import Sequence as SequenceABC
from typing import Any, cast, overload

import numpy as np
import torch
from numpy.typing import NDArray
from torch.utils.data import Dataset, default_collate, get_worker_info
from torch.utils.data._utils.collate import collate as torch_collate
from torch.utils.data._utils.collate import (
    collate_numpy_array_fn,
    collate_numpy_scalar_fn,
    default_collate_fn_map,
)

from ..errors import LargerThanMemoryWarning
from ..read.memory import fits_in_memory, larger_than_memory, memory_limit
from ..read.parts import Parts, PartsReader
from ..read.ragged import RaggedRows
from ..read.reader import ADVICE, as_raw, copy_bytes
from .assemble import NewMemory, place_fixed, place_listed, torch_dtype

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
        self.path = os.fspath(path) if isinstance(path, (str, os.PathLike)) else [os.fspath(p) for p in path]
        self.parts = Parts(self.path)
        self.single = isinstance(fields, str)
        if isinstance(fields, (bytes, bytearray)):
            raise TypeError(f"fields names fields by str (one, or a list of them), not {fields!r}")
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
        repeated = next((name for k, name in enumerate(names) if name in names[:k]), None)
        if repeated is not None:
            raise ValueError(f"fields names {repeated!r} twice; name each field once")
        self.fields: tuple[str, ...] = tuple(names)
        # The selected fields whose shape differs between samples (in any part); batches carry it.
        self.ragged_fields = frozenset(name for name in names if self.parts.field(name).shape is None)
        self.transform = transform
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
        (through ConcatDataset or Subset) treats them as it treats a batch of this dataset."""
        sample = self._read(i)
        return self._marked(sample, self.transform is None) if isinstance(sample, dict) else sample

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

    def lengths(self, field: str) -> np.ndarray:
        """Per-sample lengths of a field (int64 (N,) for 1-d samples, shapes (N, ndim) otherwise).

        Read from the index and its shape tables only, never from sample data,
        so building length-grouped batches costs no I/O of the data itself.
        """
        shapes = self.reader.shapes(field)
        return np.ascontiguousarray(shapes[:, 0] if shapes.shape[1] == 1 else shapes)

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


class GatheredBatch(SequenceABC[Any]):
    """Samples gathered field by field: ``arrays[field]`` holds the whole batch.

    Indexing gives per-sample views, so torch's default collate still works;
    ``collate`` uses ``arrays`` directly. A ragged field may come located but
    not yet read (RaggedRows): ``PaddedCollate`` pads it straight from the
    mapping, and anything else reading the field gets its per-sample copies,
    made once, on first use. Pickling sends the copies, never the mapping.

    A collated batch is its user's, as with any Dataset: the memory a collate
    hands out as a field's tensor leaves the samples. Those handed out so far
    keep their rows (a collate_fn's edits of them) in memory of their own; the
    field is read again (from the mapping, with ``regather``; else from a copy
    taken as it is handed out) when used afterwards, with those rows written
    back. An array taken out of a sample before the collate still views the
    batch's memory.
    """

    def __init__(
        self,
        arrays: Mapping[str, np.ndarray | list[np.ndarray] | RaggedRows],
        single: str | None,
        length: int,
        ragged: frozenset[str] = frozenset(),
        shared: Mapping[str, torch.Tensor] | None = None,
        regather: Callable[[str], np.ndarray | RaggedRows] | None = None,
        private: bool = False,
    ) -> None:
        self._fields: dict[str, Any] = dict(arrays)  # or _HANDED_OUT, once a collate has
        self.single = single
        self.length = length
        self.ragged = ragged
        self._shared = dict(shared or {})  # fixed fields gathered into shared memory, by name
        self._regather = regather  # reads a field again from the mapping, once its memory is handed out
        self._private = private  # made by a collate for itself: its memory is nobody else's
        # Each dict sample handed out, with the values (and their layouts) it was handed out with:
        # a collate_fn may edit it (s["y"] = s["y"] + 1, s["extra"] = ..., s["x"].shape = ...)
        # before collating.
        self._handed: dict[int, tuple[dict[str, Any], dict[str, tuple[Any, Any]]]] = {}
        self._viewed: set[int] = set()  # bare samples handed out (``single``), which a user may edit
        # Per field handed out: the rows its samples held then (their edits), for when it is read again.
        self._kept: dict[str, dict[int, np.ndarray]] = {}

    @property
    def samples_edited(self) -> bool:
        """Whether a sample dict handed out was given other keys, values or array layouts
        (``.shape``, ``.dtype`` set in place) since: collating then goes by the samples, not by
        the fields (collate, PaddedCollate). Edits of the arrays' elements are the fields' own
        (the samples are views of them)."""
        return any(
            sample.keys() != given.keys()
            or any(
                sample[key] is not value or _layout(value) != layout for key, (value, layout) in given.items()
            )
            for sample, given in self._handed.values()
        )

    @property
    def arrays(self) -> dict[str, np.ndarray | list[np.ndarray]]:
        """Every field: one array for a fixed field, a list of per-sample arrays for a ragged one."""
        return {name: self.field(name) for name in self._fields}

    @property
    def field_names(self) -> tuple[str, ...]:
        return tuple(self._fields)

    def field(self, name: str) -> np.ndarray | list[np.ndarray]:
        """One field of the batch (see ``arrays``), read from the mapping now if it was only located."""
        value = self._fields[name]
        if value is _HANDED_OUT:  # set only where the field can be read again (see _hand_out)
            value = self._fields[name] = cast(Callable[[str], Any], self._regather)(name)
            kept = self._kept.pop(name, {})
            if kept:
                value = self._fields[name] = self._with_kept_rows(name, value, kept)
        if isinstance(value, RaggedRows):
            value = self._fields[name] = value.copies()
        return value

    def _with_kept_rows(self, name: str, value: Any, kept: dict[int, np.ndarray]) -> Any:
        """The field read again, with the rows its samples held when it was handed out (a
        collate_fn's edits of them), and those samples viewing it again."""
        if isinstance(value, RaggedRows):
            value = value.copies()
        for j, row in kept.items():
            np.copyto(value[j] if isinstance(value, list) else value[j, ...], row, casting="no")
            handed = self._handed.get(j)
            if handed is not None and handed[0].get(name) is row:
                view = self._sample(name, j, value)
                handed[0][name] = view
                handed[1][name] = (view, _layout(view))
        return value

    def tensor(self, name: str) -> Any:
        """A fixed field as one tensor of the batch's memory (numpy where torch lacks the dtype),
        handed out: the samples read the field again if used afterwards (see the class).

        Inside a DataLoader worker it is the shared-memory tensor the field was
        gathered into, which crosses to the trainer with no further copy.
        """
        shared = self._shared.pop(name, None)
        tensor = shared if shared is not None else as_tensors(self.field(name))
        self._hand_out(name)
        return tensor

    def listed(self, name: str) -> list[Any]:
        """A ragged field as a list of per-sample tensors (numpy where torch lacks the dtype):
        packed from the mapping into one buffer, in shared memory inside a DataLoader worker."""
        rows = self.ragged_rows(name)
        if rows is None:
            listed = as_tensors(self.field(name))
            self._hand_out(name)
            return listed
        samples, fill = place_listed(rows, NewMemory(shared=get_worker_info() is not None))
        fill()
        return samples()

    def _hand_out(self, name: str) -> None:
        """The field's memory is now a batch's: the samples read the field again when used, and
        the samples handed out so far keep what they hold (their edits), in rows of their own."""
        if self._private:
            return
        value = self._fields[name]
        kept = self._keep_handed_rows(name, value)
        if self._regather is not None:
            self._fields[name] = _HANDED_OUT
            self._kept[name] = kept
        elif isinstance(value, list):
            self._fields[name] = self._with_kept_rows(name, [array.copy() for array in value], kept)
        elif isinstance(value, np.ndarray):
            self._fields[name] = self._with_kept_rows(name, value.copy(), kept)

    def _keep_handed_rows(self, name: str, value: Any) -> dict[int, np.ndarray]:
        """Copies of the rows of ``name`` the samples handed out hold; each sample dict holds its copy."""
        kept: dict[int, np.ndarray] = {}
        for j, (sample, layouts) in self._handed.items():
            if name in sample and name in layouts and sample[name] is layouts[name][0]:
                row = np.array(sample[name], copy=True, subok=True)
                sample[name] = row
                layouts[name] = (row, _layout(row))
                kept[j] = row
        if self.single == name:
            for j in self._viewed:
                kept[j] = np.array(value[j] if isinstance(value, list) else value[j, ...], copy=True)
        return kept

    def ragged_rows(self, name: str) -> RaggedRows | None:
        """The field's samples as located in the mapping, if not read yet (see RaggedRows)."""
        value = self._fields[name]
        return value if isinstance(value, RaggedRows) else None

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        state["_fields"] = self.arrays
        state["_shared"] = {}  # the arrays view the same memory, and travel by value
        state["_regather"] = None  # the mapping stays here; the copy owns its arrays
        if not self.samples_edited:  # views of the arrays, which would arrive as copies of their own
            state["_handed"] = {}
        return state

    def __len__(self) -> int:
        return self.length

    @overload
    def __getitem__(self, j: int) -> Any: ...

    @overload
    def __getitem__(self, j: slice) -> list[Any]: ...

    def __getitem__(self, j: int | slice) -> Any:
        if isinstance(j, slice):
            return [self[k] for k in range(*j.indices(self.length))]
        if self.single is not None:
            bare = self._sample(self.single, j)  # an IndexError for j out of range
            self._viewed.add(operator.index(j) % self.length)
            return bare
        j = operator.index(j)
        j = j + self.length if j < 0 else j
        if not 0 <= j < self.length:
            raise IndexError(f"sample {j} is out of range for a batch of {self.length}")
        handed = self._handed.get(j)
        if handed is None:
            sample = GatheredSample((name, self._sample(name, j)) for name in self._fields)
            layouts = {key: (value, _layout(value)) for key, value in sample.items()}
            handed = self._handed[j] = (sample, layouts)
        return handed[0]

    def _sample(self, name: str, j: int, value: Any = None) -> np.ndarray:
        """One sample's array, 0-d for a 0-d field as ``ds[i]`` gives it (never a numpy scalar).

        A ragged field's is marked so torch's default collate lists it, one of
        a dtype torch lacks so that it stacks it as numpy (as ``collate`` does).
        """
        value = self.field(name) if value is None else value
        array = value[j] if isinstance(value, list) else value[j, ...]
        if name in self.ragged:
            return array.view(RaggedSample)
        return array.view(NumpyOnlySample) if torch_dtype(array.dtype) is None else array


_HANDED_OUT = object()  # a field whose memory a collate handed out, to be read again when used


def _layout(value: Any) -> Any:
    """What of a handed-out value can change in place without changing its bytes: an array's
    shape, strides and dtype (None for anything else)."""
    return (value.shape, value.strides, value.dtype) if isinstance(value, np.ndarray) else None


class RaggedSample(np.ndarray):
    """A sample of a ragged field, as GatheredBatch hands it to torch's default collate.

    Samples of one ragged field differ in shape, so stacking them fails inside
    torch; the default collate gives them as a list of tensors instead, as
    ``collate`` does (``PaddedCollate`` pads them into one tensor).
    """


def _collate_ragged_samples(batch: Sequence[np.ndarray], *, collate_fn_map: Any = None) -> list[Any]:
    """torch's default collate for ragged samples: one tensor per sample, in a list (of a bare
    field's GatheredBatch, ``collate``'s list, whose memory then leaves the samples)."""
    if isinstance(batch, GatheredBatch):
        return collate(batch)
    return [as_tensors(np.asarray(sample)) for sample in batch]


class NumpyOnlySample(np.ndarray):
    """A sample of a field whose dtype torch lacks (strings, records, datetimes), as batches hand it
    to torch's default collate, which would refuse it: stacked as numpy, as ``collate`` gives it."""


def _collate_numpy_only_samples(batch: Sequence[np.ndarray], *, collate_fn_map: Any = None) -> np.ndarray:
    return stack_bytes(batch)


def stack_bytes(arrays: Sequence[np.ndarray]) -> np.ndarray:
    """Arrays of one dtype and shape stacked into one new array, every byte (record padding too) copied."""
    return np.stack([as_raw(np.asarray(array)) for array in arrays]).view(np.asarray(arrays[0]).dtype)


# torch documents extending its default collate through this registry; the keys
# are types only npz2mmap's batches make, so nothing else is collated differently.
default_collate_fn_map[RaggedSample] = _collate_ragged_samples
default_collate_fn_map[NumpyOnlySample] = _collate_numpy_only_samples


class GatheredSample(dict[str, Any]):
    """A dict sample of a GatheredBatch: views of the batch's arrays. Through it torch's default
    collate hands the whole batch to ``collate``, which gives each fixed field's gathered array as
    the batch's tensor, where torch would stack the views into another (a copy, and another
    block of shared memory inside a DataLoader worker)."""


def _collate_gathered_samples(batch: Sequence[GatheredSample], *, collate_fn_map: Any = None) -> Any:
    """torch's default collate of a GatheredBatch: ``collate``'s batch (the same tensors, arrays
    and lists torch's collate makes of its samples, with no copy); of such samples rearranged
    into a list of one's own, torch's own collate, field by field."""
    if isinstance(batch, GatheredBatch):
        return collate(batch)
    return torch_collate([dict(sample) for sample in batch], collate_fn_map=collate_fn_map)


class MarkedSample(dict[str, Any]):
    """A dataset's dict sample (``ds[i]``, or a transform's in a batch), with the names of the
    dataset's ragged fields (``listed``: samples as read, whose ragged fields torch's default
    collate lists)."""

    ragged: frozenset[str] = frozenset()
    listed = False


class TransformedRaggedArray(np.ndarray):
    """A transform's bare array sample of a ragged field (``fields`` a single name), in a batch."""

    field_name = ""
    listed = False


def mark_transformed(sample: Any, ragged: frozenset[str], single: str | None, listed: bool = False) -> Any:
    """A transformed sample as torch's default collate should see it: knowing its ragged fields.

    Only dicts and bare numpy arrays are marked; other samples are the transform's to collate.
    With ``listed`` (samples as read, ``tensors=True``), ragged fields are listed, as without it.
    """
    if isinstance(sample, dict):
        marked = MarkedSample(sample)
        marked.ragged = ragged
        marked.listed = listed
        return marked
    if single in ragged and isinstance(sample, np.ndarray):
        array = sample.view(TransformedRaggedArray)
        array.field_name = single
        array.listed = listed
        return array
    if type(sample) is np.ndarray and torch_dtype(sample.dtype) is None:
        return sample.view(NumpyOnlySample)
    return sample


def _collate_transformed_samples(batch: Sequence[MarkedSample], *, collate_fn_map: Any = None) -> Any:
    """torch's default collate of transformed dict samples, refusing to stack ragged shapes it cannot."""
    ragged = batch[0].ragged
    out = {}
    for name in batch[0]:
        values = [sample[name] for sample in batch]
        if name in ragged and batch[0].listed:
            out[name] = [as_tensors(np.asarray(v)) if isinstance(v, np.ndarray) else v for v in values]
            continue
        if name in ragged:
            _check_stackable(name, values)
        stacked = collate_numpy_torch_lacks(values)  # strings, records: numpy, as without a transform
        out[name] = stacked if stacked is not None else torch_collate(values, collate_fn_map=collate_fn_map)
    return out


# numpy scalars collated as numpy stacks them (torch's default collate refuses record,
# datetime, uint64 and longdouble scalars, promotes mixed ones its own way, and makes str_
# and bytes_ ones a list of strings, where 0-d string arrays are one array)
NUMPY_SCALARS = (np.number, np.bool_, np.void, np.datetime64, np.timedelta64, np.str_, np.bytes_)


def _is_numpy_value(value: Any) -> bool:
    return isinstance(value, (np.ndarray, *NUMPY_SCALARS))


def collate_numpy_torch_lacks(values: Sequence[Any]) -> Any:
    """Numpy values torch would collate otherwise than numpy stacks them, stacked by numpy;
    None for any other.

    Arrays of a dtype torch lacks, and numpy scalars, are stacked, every byte
    copied; arrays of other dtypes, by numpy's promotion (strings of other widths,
    datetimes of other units, float32 with int64 as float64, where torch's would take
    float32); a byte order not the machine's is made native, and
    the result is a tensor where torch has its dtype. Shapes that differ are numpy's
    ValueError. Arrays of one dtype torch has are left to torch (None), whose
    collate gathers them straight into shared memory inside DataLoader workers,
    unless one has a negative stride (a reversed view), which torch cannot view.
    """
    if not _is_numpy_value(values[0]) or not all(_is_numpy_value(v) for v in values):
        return None
    if any(isinstance(v, RaggedSample) for v in values):
        return None  # a ragged field's samples, which torch's collate lists
    arrays = [np.asarray(v) for v in values]
    if (
        all(isinstance(v, np.ndarray) for v in values)
        and all(a.dtype == arrays[0].dtype for a in arrays)
        and torch_dtype(arrays[0].dtype) is not None
        and not any(_has_negative_strides(a) for a in arrays)  # which torch refuses to view
    ):
        return None  # torch's own collate, as for a dataset's samples
    if all(a.dtype == arrays[0].dtype for a in arrays):
        stacked = stack_bytes(arrays) if all(a.shape == arrays[0].shape for a in arrays) else np.stack(arrays)
    else:
        stacked = np.stack(arrays)
    if not stacked.dtype.isnative:  # as a dataset's own batches are: native, whatever the kind
        stacked = stacked.astype(stacked.dtype.newbyteorder("="))
    return as_tensors(stacked)


def _has_negative_strides(array: np.ndarray) -> bool:
    return any(stride < 0 for stride in array.strides)


def viewable_by_torch(array: np.ndarray) -> np.ndarray:
    """The array, or a C-order copy where a stride is negative, which torch cannot view.
    A copy, not ascontiguousarray: a reversed view of one row is contiguous to numpy and
    would come back as it is, its negative stride kept."""
    return array.copy() if _has_negative_strides(array) else array


def _collate_transformed_arrays(
    batch: Sequence[TransformedRaggedArray], *, collate_fn_map: Any = None
) -> Any:
    arrays = [np.asarray(sample) for sample in batch]
    if batch[0].listed:
        return [as_tensors(array) for array in arrays]
    _check_stackable(batch[0].field_name, arrays)
    return torch_collate(arrays, collate_fn_map=collate_fn_map)


def _check_stackable(name: str, values: Sequence[Any]) -> None:
    """A ragged field the transform left in different shapes: say which collate to use instead.

    Raises ValueError; torch's own error (stack expects each tensor to be equal
    size) names neither the field nor a way out.
    """
    shapes = sorted({tuple(value.shape) for value in values if isinstance(value, (np.ndarray, torch.Tensor))})
    if len(shapes) > 1:
        raise ValueError(
            f"field {name!r} is ragged and the transform left it in shapes {shapes[0]} and {shapes[-1]} "
            "in one batch, which torch's default collate cannot stack: pass collate_fn=npz2mmap.collate "
            "(ragged fields as lists of tensors) or collate_fn=npz2mmap.PaddedCollate() (padded) "
            "to the DataLoader, or have the transform return one shape"
        )


default_collate_fn_map[MarkedSample] = _collate_transformed_samples
default_collate_fn_map[TransformedRaggedArray] = _collate_transformed_arrays
default_collate_fn_map[GatheredSample] = _collate_gathered_samples


class SampleList(list[Any]):
    """Transformed samples of a batch, with the names of the dataset's ragged fields.

    ``single`` names the field when each sample is a bare array.
    """

    def __init__(self, samples: list[Any], ragged: frozenset[str], single: str | None = None) -> None:
        super().__init__(samples)
        self.ragged = ragged
        self.single = single


def collate(batch: Any) -> Any:
    """Collate for MmapDataset: a GatheredBatch becomes tensors sharing its memory.

    Fixed fields become one tensor each (no copy); ragged fields stay lists of
    tensors, also when a transform made the batch and in a plain list of the
    dataset's samples (``[ds[i], ...]``, a ConcatDataset's); dtypes torch lacks
    (strings, records, datetimes) stay numpy arrays, also in a plain list.
    Anything else goes to torch's default collate.
    """
    if isinstance(batch, GatheredBatch) and batch.samples_edited:  # by the samples as edited
        batch = SampleList(list(batch), batch.ragged, batch.single)
    elif not isinstance(batch, (GatheredBatch, SampleList)) and _marked_samples(batch):
        ragged = frozenset().union(*(s.ragged for s in batch if isinstance(s, MarkedSample)))
        batch = SampleList(list(batch), ragged)
    if isinstance(batch, SampleList):
        return _collate_listing_ragged(batch)
    if not isinstance(batch, GatheredBatch):
        check_same_keys(batch)
        if batch and isinstance(batch[0], Mapping):
            return _collate_plain_dicts(batch)
        return torch_collate(batch, collate_fn_map=PLAIN_COLLATE_FNS)
    tensors = {
        name: batch.listed(name) if name in batch.ragged else batch.tensor(name)
        for name in batch.field_names
    }
    return tensors[batch.single] if batch.single is not None else tensors


def _marked_samples(batch: Any) -> bool:
    """Whether a plain list holds a dataset's dict samples (``[ds[i], ...]``), which know their
    ragged fields."""
    return isinstance(batch, Sequence) and any(isinstance(sample, MarkedSample) for sample in batch)


def _collate_plain_dicts(samples: Sequence[Mapping[str, Any]]) -> Any:
    """Dict samples from elsewhere (other datasets', or built by hand) by key, as torch's
    default collate takes them, with numpy's stacking where torch's differs; a key whose
    arrays differ in shape raises ValueError naming it and the way out."""
    out = {}
    for key in samples[0]:
        values = [sample[key] for sample in samples]
        shapes = sorted({tuple(v.shape) for v in values if isinstance(v, (np.ndarray, torch.Tensor))})
        if len(shapes) > 1:
            raise ValueError(
                f"field {key!r} has samples of shapes {shapes[0]} and {shapes[-1]} in one batch, a ragged "
                "field in samples that do not say so (not an MmapDataset's): pass "
                f"collate_fn=npz2mmap.PaddedCollate(ragged=[{key!r}]) to pad it, or collate it yourself"
            )
        out[key] = torch_collate(values, collate_fn_map=PLAIN_COLLATE_FNS)
    try:
        return type(samples[0])(out)  # type: ignore[call-arg]  # as torch's: the samples' own mapping type
    except TypeError:
        return out


def _collate_listing_ragged(samples: SampleList) -> Any:
    """Transformed samples: each ragged field as a list of tensors, the rest by torch's default collate."""
    if samples.single is not None and samples.single in samples.ragged:
        return [_as_tensor(sample) for sample in samples]
    if not samples or not isinstance(samples[0], dict):
        return _collate_values(list(samples))
    check_same_keys(samples)
    return {
        name: [_as_tensor(sample[name]) for sample in samples]
        if name in samples.ragged
        else _collate_values([sample[name] for sample in samples])
        for name in samples[0]
    }


def check_same_keys(samples: Sequence[Any]) -> None:
    """Raise ValueError if dict samples of one batch differ in keys: a batch's keys would
    otherwise be the first sample's, the others' own keys dropped without a word."""
    if not samples or not isinstance(samples[0], Mapping):
        return
    first = set(samples[0])
    for j, sample in enumerate(samples):
        if isinstance(sample, Mapping) and set(sample) != first:
            raise ValueError(
                f"sample {j} of a batch has keys {sorted(map(str, sample))} where sample 0 has "
                f"{sorted(map(str, first))}: give every sample the same keys (edit them in the "
                "dataset's transform, or in a collate_fn of your own)"
            )


def _collate_arrays(arrays: Sequence[np.ndarray], *, collate_fn_map: Any = None) -> Any:
    """Arrays of plain samples (``ds[i]``) stacked as a GatheredBatch's: numpy where torch lacks the dtype."""
    stacked = collate_numpy_torch_lacks(arrays)
    if stacked is not None:
        return stacked
    torch_own = collate_numpy_array_fn if isinstance(arrays[0], np.ndarray) else collate_numpy_scalar_fn
    return torch_own(arrays, collate_fn_map=collate_fn_map)


# torch's default collate functions, with numpy's stacking for numpy values (numpy's scalar
# types first: torch looks a value's type up in this order)
PLAIN_COLLATE_FNS: dict[type | tuple[type, ...], Callable[..., Any]] = {
    **{kind: _collate_arrays for kind in NUMPY_SCALARS},
    **default_collate_fn_map,
    np.ndarray: _collate_arrays,
}


def _collate_values(values: list[Any]) -> Any:
    """torch's default collate, except arrays of a dtype torch lacks, stacked as numpy."""
    stacked = collate_numpy_torch_lacks(values) if values else None
    return stacked if stacked is not None else default_collate(values)


def _as_tensor(value: Any) -> Any:
    """A transform's array as a tensor sharing its memory (a plain ndarray, not a marked view)."""
    return as_tensors(np.asarray(value)) if isinstance(value, np.ndarray) else value


def as_tensors(array: np.ndarray | list[np.ndarray]) -> Any:
    """Tensors sharing the arrays' memory; of an array in the other byte order, or with a
    negative stride (which torch cannot view), a tensor of a copy; arrays of dtypes torch
    lacks are returned as they are."""
    if isinstance(array, list):
        return [as_tensors(item) for item in array]
    if torch_dtype(array.dtype) is not None:
        return torch.from_numpy(viewable_by_torch(array))
    native = array.dtype.newbyteorder("=")
    if array.dtype.names is None and not array.dtype.isnative and torch_dtype(native) is not None:
        return torch.from_numpy(array.astype(native))
    return array
