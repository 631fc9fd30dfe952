"""GatheredBatch: the samples a batch of MmapDataset gathered with one copy per field.

It is the sequence of samples torch's collate expects, whose fields are whole arrays, so
``collate`` turns them into tensors without another copy; what a collate hands out is
never written again (see GatheredBatch).
"""

from __future__ import annotations

import operator
from collections.abc import Callable, Mapping
from collections.abc import Sequence as SequenceABC
from typing import Any, cast, overload

import numpy as np
import torch
from torch.utils.data import get_worker_info

from ..read.ragged import RaggedRows, RaggedShapes
from .assemble import NewMemory, place_listed, torch_dtype
from .samples import FieldSample, GatheredSample, NumpyOnlySample, RaggedSample
from .tensors import as_tensors


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
        ragged: RaggedShapes | None = None,
        shared: Mapping[str, torch.Tensor] | None = None,
        regather: Callable[[str], np.ndarray | RaggedRows] | None = None,
        private: bool = False,
    ) -> None:
        self._fields: dict[str, Any] = dict(arrays)  # or _HANDED_OUT, once a collate has
        self.single = single
        self.length = length
        self.ragged: RaggedShapes = ragged or {}
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
            bare: Any = self._sample(self.single, j)  # an IndexError for j out of range
            if type(bare) is np.ndarray:  # a fixed field's: as its name goes with a ragged one's
                bare = bare.view(FieldSample)
            bare.field_name = self.single
            self._viewed.add(operator.index(j) % self.length)
            return bare
        j = operator.index(j)
        j = j + self.length if j < 0 else j
        if not 0 <= j < self.length:
            raise IndexError(f"sample {j} is out of range for a batch of {self.length}")
        handed = self._handed.get(j)
        if handed is None:
            sample = GatheredSample((name, self._sample(name, j)) for name in self._fields)
            sample.ragged = None if self._private else self.ragged
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
            marked = array.view(RaggedSample)
            marked.field_name, marked.sample_shape = name, self.ragged[name]
            return marked
        return array.view(NumpyOnlySample) if torch_dtype(array.dtype) is None else array


_HANDED_OUT = object()  # a field whose memory a collate handed out, to be read again when used


def _layout(value: Any) -> Any:
    """What of a handed-out value can change in place without changing its bytes: an array's
    shape, strides and dtype (None for anything else)."""
    return (value.shape, value.strides, value.dtype) if isinstance(value, np.ndarray) else None
