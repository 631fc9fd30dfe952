"""The one batch assembler: a batch's arrays placed, then filled from the mapping, into any memory.

Every loader makes its batches here: ``MmapLoader`` in its own process and
in its thread (new tensors, pinned with ``pin_memory``) and in its worker
processes (a ring slot), through the plan batch_plan.py chooses, and ``DataLoader`` workers through
``MmapDataset.__getitems__``, ``collate`` and ``PaddedCollate`` (shared-memory
tensors). A ``Destination`` says where an array goes and what the batch
holds for it; ``assemble`` takes every place before copying any byte, so a
destination that runs out of room (a full slot) leaves nothing half done.

Three placements, each one copy from the page cache: a fixed field gathered
into one (batch, *shape) array; a ragged field's samples packed one after
another and handed out as a list; a ragged field padded to the batch's
largest shape, beside its lengths, shapes (and mask) under the keys
``ragged.padded_extras`` and ``ragged.mask_key`` name.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np
import torch
from numpy.typing import NDArray

from ..read.ragged import RaggedRows, check_padded_size, mask_key

if TYPE_CHECKING:
    from ..read.parts import PartsReader


class Destination(Protocol):
    """Where a batch's arrays go."""

    def array(self, dtype: np.dtype, shape: tuple[int, ...]) -> tuple[np.ndarray, Any]:
        """A writable C-contiguous array to fill, and what the batch holds for it."""

    def rows(self, rows: RaggedRows) -> tuple[NDArray[np.uint8], NDArray[np.int64], Callable[[], Any]]:
        """Bytes to pack ``rows`` into, each sample's offset in them, and what gives the batch's list
        once they are filled."""


@dataclass(frozen=True)
class Padding:
    """How ragged fields are padded (PaddedCollate's settings)."""

    pad_value: float = 0
    mask: bool = False


@functools.cache
def torch_dtype(dtype: np.dtype) -> torch.dtype | None:
    """The torch dtype of a numpy dtype, or None where torch has none (looked up once per dtype)."""
    try:
        return torch.from_numpy(np.empty(0, dtype=dtype)).dtype
    except (TypeError, ValueError):  # ValueError: a byte order torch does not read
        return None


def shared_tensor(shape: tuple[int, ...], dtype: np.dtype) -> torch.Tensor | None:
    """An uninitialised tensor in shared memory, or None where torch lacks ``dtype``.

    Made as torch's own default collate makes its output inside DataLoader
    workers, so a batch gathered into it crosses to the trainer without the
    copy into shared memory that a private tensor would need.
    """
    if torch_dtype(dtype) is None or not dtype.isnative:
        return None
    empty = torch.from_numpy(np.empty(0, dtype=dtype))
    try:  # torch's own (private) way; a torch without it gets a private tensor, copied when sent
        storage = empty._typed_storage()._new_shared(math.prod(shape))
    except (AttributeError, RuntimeError):
        return None
    return empty.new(storage).view(shape)


class NewMemory:
    """New tensors (numpy arrays where torch lacks the dtype): pinned with ``pin_memory``, or in
    shared memory with ``shared`` (inside a DataLoader worker, so a batch crosses to the trainer
    with no further copy, as torch's default collate makes its own)."""

    def __init__(self, pin_memory: bool = False, shared: bool = False) -> None:
        self.pin_memory = pin_memory
        self.shared = shared

    def array(self, dtype: np.dtype, shape: tuple[int, ...]) -> tuple[np.ndarray, Any]:
        tensor_dtype = torch_dtype(dtype)
        if tensor_dtype is None:
            array = np.empty(shape, dtype)
            return array, array
        tensor = shared_tensor(shape, dtype) if self.shared else None
        if tensor is None:
            try:
                tensor = torch.empty(shape, dtype=tensor_dtype, pin_memory=self.pin_memory)
            except RuntimeError as exc:  # torch's allocator says so in a RuntimeError
                if "can't allocate memory" not in str(exc):
                    raise
                raise MemoryError(str(exc)) from None
        return tensor.numpy(), tensor

    def rows(self, rows: RaggedRows) -> tuple[NDArray[np.uint8], NDArray[np.int64], Callable[[], Any]]:
        nbytes = rows.row_nbytes()
        offsets = np.cumsum(nbytes) - nbytes
        packed, _ = self.array(np.dtype(np.uint8), (int(nbytes.sum()),))
        return packed, offsets, functools.partial(_unpacked, rows, packed, offsets)


def _unpacked(rows: RaggedRows, packed: NDArray[np.uint8], offsets: NDArray[np.int64]) -> list[Any]:
    """Each packed sample as its own tensor (numpy where torch lacks the dtype), viewing ``packed``."""
    out = []
    nbytes = rows.row_nbytes().tolist()
    for offset, n, shape in zip(offsets.tolist(), nbytes, rows.shapes.tolist(), strict=True):
        sample = packed[offset : offset + n].view(rows.dtype).reshape(shape)
        out.append(sample if torch_dtype(rows.dtype) is None else torch.from_numpy(sample))
    return out


def assemble(
    reader: PartsReader,
    fields: Sequence[str],
    indices: NDArray[np.int64],
    destination: Destination,
    padding: Padding | None = None,
) -> dict[str, Any]:
    """Samples ``indices`` (normalised) of ``fields``, one copy each, into ``destination``.

    Fixed fields are gathered; ragged ones are padded with ``padding``, or listed
    without it. Raises ValueError for a padded batch numpy cannot make, and whatever
    the destination raises when it has no room, before any byte is copied.
    """
    out: dict[str, Any] = {}
    listed: dict[str, Callable[[], Any]] = {}
    fills: list[Callable[[], object]] = []
    for name in fields:
        if reader.field(name).shape is not None:
            out[name], fill = place_fixed(reader, name, indices, destination)
            fills.append(fill)
            continue
        rows = reader.ragged_rows(name, indices)
        if padding is None:
            out[name] = None  # keeps the fields' order
            listed[name], fill = place_listed(rows, destination)
            fills.append(fill)
        else:
            placed, padded_fills = place_padded(rows, destination, padding)
            out.update(placed)
            fills.extend(padded_fills)
    for fill in fills:
        fill()
    for name, samples in listed.items():
        out[name] = samples()
    return out


def place_fixed(
    reader: PartsReader, name: str, indices: NDArray[np.int64], destination: Destination
) -> tuple[Any, Callable[[], object]]:
    """Room for a fixed field's samples in one array, and the gather that fills it."""
    field = reader.field(name)
    assert field.shape is not None
    target, held = destination.array(field.dtype, (len(indices), *field.shape))
    return held, functools.partial(reader.gather, name, indices, out=target)


Fill = Callable[[], object]


def place_listed(rows: RaggedRows, destination: Destination) -> tuple[Callable[[], Any], Fill]:
    """Room for a ragged field's samples one after another; what gives the list, and the copy."""
    packed, offsets, listed = destination.rows(rows)
    return listed, functools.partial(rows.fill_packed, packed, offsets)


def place_padded(
    rows: RaggedRows, destination: Destination, padding: Padding
) -> tuple[dict[str, Any], list[Callable[[], object]]]:
    """Room for a ragged field padded to the batch's largest shape, its lengths (and mask), and
    the copies that fill them."""
    shape = rows.padded_shape()
    check_padded_size(rows.name, shape, rows.dtype.itemsize)
    out: dict[str, Any] = {}
    try:
        padded, out[rows.name] = destination.array(rows.dtype, shape)
    except MemoryError:
        nbytes = int(np.prod(shape, dtype=object)) * rows.dtype.itemsize
        raise MemoryError(f"field {rows.name!r}: a batch padded to {shape} needs {nbytes:,} bytes") from None
    fills: list[Callable[[], object]] = [functools.partial(rows.fill_padded, padded, padding.pad_value)]
    for key, extra in rows.extras().items():
        target, out[key] = destination.array(extra.dtype, extra.shape)
        fills.append(functools.partial(np.copyto, target, extra))
    if padding.mask:
        mask_target, out[mask_key(rows.name)] = destination.array(np.dtype(np.bool_), shape)
        fills.append(functools.partial(_fill_mask, rows, mask_target))
    return out, fills


def _fill_mask(rows: RaggedRows, target: np.ndarray) -> None:
    target[...] = rows.mask()
