"""MmapLoader's worker processes: batches written into a shared ring of slots, read as views.

Torch's DataLoader moves every batch from a worker through a fresh
shared-memory segment whose handle crosses a socket; for data that needs no
decoding that hand-off costs more than the work. Here the loader allocates
one shared block of ``num_slots`` slots once; a worker writes its batch
straight into the slot it is given and sends back a small descriptor
(dtype, shape, offset, strides per tensor), and the trainer hands out tensors that are
views of the slot. The block is a mapping of its own (``RingBlock``): on
POSIX a temporary file unlinked at once (in /dev/shm on Linux) whose
descriptor workers inherit or receive, so no name is left behind and the
kernel frees it with the last process that maps it, whatever way they end.
In the trainer it is unmapped only once no tensor views it any more, so a
batch kept past its loader's end is never overwritten by another ring.
"""

from __future__ import annotations

import contextlib
import ctypes
import io
import math
import multiprocessing
import multiprocessing.connection
import multiprocessing.heap
import multiprocessing.reduction
import os
import pickle
import random
import selectors
import signal
import struct
import tempfile
import threading
import time
import traceback
import warnings
import weakref
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from multiprocessing.context import BaseContext
from typing import Any, NoReturn

import numpy as np
import torch
from numpy.typing import NDArray

from .. import parallel
from ..errors import WorkerError
from ..read.ragged import RaggedRows
from .batch_plan import BatchPlan, InMemory
from .dataset import MmapDataset, SampleList, collate, torch_dtype
from .forkserver_socket import ForkserverSocket

# Every array in a slot starts at a multiple of 64 bytes: aligned for any
# dtype's view, and no two arrays share a cache line.
SLOT_ALIGN = 64
SLOT_SPARE_NBYTES = 1 << 20
# A dataset with a huge ragged sample would otherwise ask for a huge ring;
# batches larger than this travel pickled unless slot_nbytes says otherwise.
MAX_DEFAULT_SLOT_NBYTES = 256 << 20
STOP_TIMEOUT_S = 5.0
# Leaving a pass early waits this long at most (or ``timeout``) for the batches in flight, then
# stops the workers: a stuck one must not hang a loop the user has left (the next pass restarts them).
DRAIN_TIMEOUT_S = 10.0
INDICES_SHOWN = 10
# A task is its batch number and slot, then the batch's sample indices (int64); empty: stop.
TASK_HEADER = struct.Struct("<qq")


def default_slot_nbytes(dataset: MmapDataset, batch_size: int) -> int:
    """Room for the largest batch the dataset can give untransformed, twice, plus 1 MiB (256 MiB at most).

    The largest sample of a ragged field comes from its shape table (checked
    whole, once). Twice leaves room for a transform or collate that widens
    dtypes or pads; a batch that still does not fit travels pickled.
    """
    reader = dataset.reader
    total = 0
    for name in dataset.fields:
        field = reader.field(name)
        if field.shape is not None:
            largest = math.prod(field.shape)
        else:  # every row is a shape numpy can make (checked), so its product fits an int64
            shapes = reader.shapes(name)
            largest = int(shapes.prod(axis=1).max()) if len(shapes) else 0
        total += batch_size * (largest * field.dtype.itemsize + SLOT_ALIGN)
    return aligned(min(2 * total + SLOT_SPARE_NBYTES, MAX_DEFAULT_SLOT_NBYTES))


def aligned(nbytes: int) -> int:
    return -(-nbytes // SLOT_ALIGN) * SLOT_ALIGN


@dataclass(frozen=True)
class Leaf:
    """Where one array of a batch lies in its slot; ``tensor`` says torch tensor or numpy array."""

    offset: int
    dtype: Any  # torch.dtype for a tensor, np.dtype for an array
    shape: tuple[int, ...]
    tensor: bool


@dataclass(frozen=True, eq=False)
class RowsLeaf:
    """A ragged field's samples packed one after another from ``offset``, read back as a list."""

    offset: int
    dtype: Any  # as Leaf's
    tensor: bool
    shapes: np.ndarray  # int64 (n, ndim)

    def offsets(self) -> np.ndarray:
        """Each sample's offset in the slot (a multiple of its itemsize: the region starts aligned)."""
        nbytes = np.prod(self.shapes, axis=1, dtype=np.int64) * self.dtype.itemsize
        return self.offset + np.cumsum(nbytes) - nbytes


@dataclass(frozen=True, eq=False)
class ViewLeaf:
    """One tensor or array a batch function made: a strided view into a region of the slot.

    Leaves that viewed overlapping memory in the worker share one region (the
    same tuple), so the trainer's views of it share memory as they did; the
    same ViewLeaf twice in a tree is one object there too.
    """

    region: tuple[int, int]  # (offset in the slot, nbytes)
    offset: int  # bytes from the region's start to the first item
    dtype: Any  # as Leaf's
    shape: tuple[int, ...]
    strides: tuple[int, ...]  # in bytes, as numpy counts them
    tensor: bool
    writeable: bool = True  # numpy's flag (a broadcast array is read-only)


class SlotFull(Exception):
    """A batch needs more bytes than its slot has (it then travels pickled).

    ``batch`` is the batch when it was already made in the worker's own memory.
    """

    def __init__(self, nbytes: int) -> None:
        super().__init__(nbytes)
        self.nbytes = nbytes
        self.batch: Any = None


class RingBlock(multiprocessing.heap.Arena):
    """One ring's shared memory, a mapping of its own: never a piece of ``multiprocessing``'s heap.

    The heap hands the bytes of a freed block (and of any arena under 4 MiB)
    to its next allocation, another loader's ring included, while tensors of
    a batch the user kept may still view them. This mapping is unmapped only
    when the last memoryview of it (each tensor handed out holds one) is
    gone. It pickles as its descriptor, passed to spawn and forkserver workers.
    """

    def _choose_dir(self, size: int) -> str:
        """/dev/shm where it has room, else the temporary directory (the file is unlinked at once).

        Not ``multiprocessing``'s own ``pymp-*`` directory, its fallback:
        that one is left behind when the trainer is killed.
        """
        for directory in getattr(self, "_dir_candidates", []):
            stat = os.statvfs(directory)
            if stat.f_bavail * stat.f_frsize >= size:
                return str(directory)
        return tempfile.gettempdir()


if os.name == "posix":  # the heap registers this reduction for Arena alone, not for its subclasses
    multiprocessing.reduction.register(RingBlock, multiprocessing.heap.reduce_arena)


class Ring:
    """The shared block as slots; both the trainer and the workers view it through this."""

    def __init__(self, block: multiprocessing.heap.Arena, num_slots: int, slot_nbytes: int) -> None:
        self.block = block  # what workers are given: it pickles as the memory's descriptor
        self.num_slots = num_slots
        self.slot_nbytes = slot_nbytes
        self.memory = memoryview(block.buffer)  # every view of the ring holds the mapping through this
        self.bytes_np = np.frombuffer(self.memory, dtype=np.uint8)

    @classmethod
    def allocate(cls, num_slots: int, slot_nbytes: int) -> Ring:
        """A new block (not touched here: pages are committed as batches are first written)."""
        return cls(RingBlock(num_slots * slot_nbytes), num_slots, slot_nbytes)

    @property
    def nbytes(self) -> int:
        return self.num_slots * self.slot_nbytes

    def address(self) -> int:
        return int(self.bytes_np.ctypes.data)

    def slot_bytes(self, slot: int) -> np.ndarray:
        """The slot as a writable uint8 array."""
        return self.bytes_np[slot * self.slot_nbytes : (slot + 1) * self.slot_nbytes]

    def view(self, slot: int, leaf: Leaf) -> Any:
        """The tensor or array ``leaf`` describes, sharing the slot's memory."""
        return self._view(slot, leaf.dtype, leaf.tensor, leaf.offset, leaf.shape)

    def _view(self, slot: int, dtype: Any, tensor: bool, offset: int, shape: Sequence[int]) -> Any:
        numel = math.prod(shape)
        start = slot * self.slot_nbytes + offset
        if tensor:
            flat = self._tensor(dtype, start, numel)
            return flat if len(shape) == 1 else flat.view(shape)
        return self.bytes_np[start : start + numel * dtype.itemsize].view(dtype).reshape(shape)

    def _tensor(self, dtype: torch.dtype, start: int, numel: int) -> torch.Tensor:
        """``numel`` items from byte ``start`` of the block, in a storage of exactly their bytes.

        A slice of one tensor over the block would share the block's storage:
        torch.save, pickle or deepcopy of one small tensor would then write
        the whole ring, other batches included.
        """
        if numel == 0:  # frombuffer refuses a count of 0
            return torch.empty(0, dtype=dtype)
        return torch.frombuffer(self.memory, dtype=dtype, count=numel, offset=start)

    def rows(self, slot: int, leaf: RowsLeaf) -> list[Any]:
        """The samples ``leaf`` describes, each a view of the slot with a storage of its own bytes."""
        dtype, tensor, shapes = leaf.dtype, leaf.tensor, leaf.shapes
        return [
            self._view(slot, dtype, tensor, offset, shape)
            for offset, shape in zip(leaf.offsets().tolist(), shapes.tolist(), strict=True)
        ]

    def materialise(self, slot: int, tree: Any) -> Any:
        """A descriptor tree with every leaf replaced by its views (new tensors, of the same memory)."""
        return BatchViews(self, slot).build(tree)

    def region_bytes(self, slot: int, region: tuple[int, int]) -> np.ndarray:
        start = slot * self.slot_nbytes + region[0]
        return self.bytes_np[start : start + region[1]]

    def region_storage(self, slot: int, region: tuple[int, int]) -> torch.UntypedStorage:
        """A storage of exactly the region's bytes (see ``_tensor``: never one of the whole block)."""
        if region[1] == 0:
            return torch.UntypedStorage(0)
        start = slot * self.slot_nbytes + region[0]
        flat = torch.frombuffer(self.memory, dtype=torch.uint8, count=region[1], offset=start)
        return flat.untyped_storage()


class BatchViews:
    """One batch's descriptor tree made views of its slot; ViewLeafs of one region share its storage."""

    def __init__(self, ring: Ring, slot: int) -> None:
        self.ring = ring
        self.slot = slot
        self.made: dict[ViewLeaf, Any] = {}  # by identity (eq=False): a leaf twice is one object twice
        self.storages: dict[tuple[int, int], torch.UntypedStorage] = {}

    def build(self, tree: Any) -> Any:
        if isinstance(tree, Leaf):
            return self.ring.view(self.slot, tree)
        if isinstance(tree, RowsLeaf):
            return self.ring.rows(self.slot, tree)
        if isinstance(tree, ViewLeaf):
            made = self.made.get(tree)
            if made is None:
                made = self.made[tree] = self.tensor(tree) if tree.tensor else self.array(tree)
            return made
        return map_tree(tree, self.build)

    def array(self, leaf: ViewLeaf) -> np.ndarray:
        buffer = self.ring.region_bytes(self.slot, leaf.region)
        array: np.ndarray = np.ndarray(
            leaf.shape, leaf.dtype, buffer=buffer, offset=leaf.offset, strides=leaf.strides
        )
        array.flags.writeable = leaf.writeable
        return array

    def tensor(self, leaf: ViewLeaf) -> torch.Tensor:
        """The tensor over its region's storage; over one of its own items where torch cannot place it there.

        A storage offset counts items: a leaf whose first byte is not a whole
        number of its items from the region's start (a float viewing bytes of
        a byte tensor, say) gets a storage of its own bytes, still aliasing them.
        """
        itemsize = leaf.dtype.itemsize
        strides = [stride // itemsize for stride in leaf.strides]
        empty = torch.empty(0, dtype=leaf.dtype)
        if leaf.offset % itemsize == 0:
            storage = self.storages.get(leaf.region)
            if storage is None:
                storage = self.storages[leaf.region] = self.ring.region_storage(self.slot, leaf.region)
            return empty.set_(storage, leaf.offset // itemsize, leaf.shape, strides)
        nbytes = span_nbytes(leaf.shape, leaf.strides, itemsize)
        own = self.ring.region_storage(self.slot, (leaf.region[0] + leaf.offset, nbytes))
        return empty.set_(own, 0, leaf.shape, strides)


# Values that cannot change in place: a tree may share them between batches.
IMMUTABLE_ATOMS = (bool, int, float, complex, str, bytes, type(None))


def is_bare_layout(tree: Any) -> bool:
    """Only leaves, immutable atoms and the containers ``materialise`` rebuilds: safe to reuse.

    Anything else in a tree is a value handed out as it is, so a cached
    tree would give the same object to every batch of that layout.
    """
    if isinstance(tree, (Leaf, RowsLeaf, ViewLeaf)) or type(tree) in IMMUTABLE_ATOMS:
        return True
    if type(tree) is dict:
        return all(type(key) in IMMUTABLE_ATOMS and is_bare_layout(value) for key, value in tree.items())
    if type(tree) is list or isinstance(tree, tuple):
        return all(is_bare_layout(value) for value in tree)
    return False


def map_tree(tree: Any, fn: Callable[[Any], Any]) -> Any:
    """``fn`` applied to the items of a dict, list or tuple (named ones kept), else ``tree`` itself."""
    if type(tree) is dict:
        return {key: fn(value) for key, value in tree.items()}
    if type(tree) is list:
        return [fn(value) for value in tree]
    if isinstance(tree, tuple):
        items = [fn(value) for value in tree]
        return type(tree)(*items) if hasattr(tree, "_fields") else type(tree)(items)
    return tree


class SlotWriter:
    """Places arrays one after another in one slot, each aligned; raises SlotFull past its end."""

    def __init__(self, ring: Ring, slot: int) -> None:
        self.ring = ring
        self.slot = slot
        self.used = 0

    def place(self, dtype: Any, shape: tuple[int, ...], tensor: bool) -> tuple[Leaf, Any]:
        leaf = Leaf(self.reserve(math.prod(shape) * dtype.itemsize), dtype, shape, tensor)
        return leaf, self.ring.view(self.slot, leaf)

    def reserve(self, nbytes: int) -> int:
        """The offset of ``nbytes`` more bytes in the slot (the next place starts aligned after them)."""
        offset = self.used
        self.used = aligned(self.used + nbytes)
        if self.used > self.ring.slot_nbytes:
            raise SlotFull(self.used)
        return offset

    def place_rows(self, rows: RaggedRows) -> tuple[RowsLeaf, np.ndarray]:
        """Room for a ragged field's samples one after another; the leaf and the samples' offsets."""
        tensor_dtype = torch_dtype(rows.dtype)
        dtype = rows.dtype if tensor_dtype is None else tensor_dtype
        leaf = RowsLeaf(
            self.reserve(int(rows.row_nbytes().sum())), dtype, tensor_dtype is not None, rows.shapes
        )
        return leaf, leaf.offsets()

    def write(self, tree: Any) -> Any:
        """Copy every tensor and array of ``tree`` into the slot; return the descriptor tree.

        Leaves are grouped by the memory they view: each region of
        overlapping leaves is copied once, whole, at its start's alignment
        modulo SLOT_ALIGN, and each leaf is described as a view into it with
        its own strides, so the trainer's batch shares memory, layout and
        identity as this one does. Every place is taken before any byte is
        copied. Anything else (numbers, strings, nested or sparse tensors,
        object arrays, and what a view of bare bytes would lose: a tensor's
        requires_grad, subclass, quantization or conj/neg bit, an itemless
        dtype) stays in the tree and travels pickled with it.
        """
        regions = plan_regions(tree)
        described: dict[int, ViewLeaf] = {}
        copies = []
        for region in regions:
            offset = self.reserve_at_alignment_of(region.nbytes, region.start)
            slot_region = (offset, region.nbytes)
            copies.append((offset, region))
            for leaf in region.leaves:
                described[id(leaf)] = describe_leaf(leaf, slot_region, region.start)
        address = self.ring.address() + self.slot * self.ring.slot_nbytes
        for offset, region in copies:
            if region.nbytes:
                ctypes.memmove(address + offset, region.start, region.nbytes)
        return _described(tree, described)

    def reserve_at_alignment_of(self, nbytes: int, address: int) -> int:
        """Room for ``nbytes`` starting at ``address`` modulo SLOT_ALIGN: every item keeps its alignment."""
        slot_address = self.ring.address() + self.slot * self.ring.slot_nbytes
        self.used = aligned(self.used)
        self.used += (address - slot_address - self.used) % SLOT_ALIGN
        return self.reserve(nbytes)


def _is_plain(value: Any) -> bool:
    """A tensor a slot view gives back whole: plain, strided, on the CPU, with no autograd or view bits."""
    return (
        type(value) is torch.Tensor
        and value.layout == torch.strided
        and not value.is_quantized  # its scale and zero point are not bytes of the slot
        and value.device.type == "cpu"
        and not value.is_nested
        and not value.requires_grad
        and not value.is_conj()
        and not value.is_neg()
    )


def _is_plain_array(value: Any) -> bool:
    """A numpy array (no subclass) whose items are bytes a slot view gives back: no objects, not itemless."""
    return type(value) is np.ndarray and not value.dtype.hasobject and value.dtype.itemsize > 0


@dataclass
class Region:
    """Bytes ``[start, start + nbytes)`` of the worker's memory that some leaves of a batch view."""

    start: int  # an address
    nbytes: int
    leaves: list[Any]


def leaves_of(tree: Any) -> list[Any]:
    """The distinct tensors and arrays a slot can hold in ``tree`` (each once, however often it appears)."""
    found: dict[int, Any] = {}

    def visit(value: Any) -> Any:
        if _is_plain(value) or _is_plain_array(value):
            found.setdefault(id(value), value)
        else:
            map_tree(value, visit)
        return value

    visit(tree)
    return list(found.values())


def leaf_layout(leaf: Any) -> tuple[int, tuple[int, ...], tuple[int, ...], int]:
    """A tensor's or array's address, shape, strides in bytes and itemsize."""
    if isinstance(leaf, torch.Tensor):
        itemsize = leaf.element_size()
        return leaf.data_ptr(), tuple(leaf.shape), tuple(s * itemsize for s in leaf.stride()), itemsize
    return leaf.__array_interface__["data"][0], leaf.shape, leaf.strides, leaf.dtype.itemsize


def leaf_span(leaf: Any) -> tuple[int, int]:
    """The addresses ``[lo, hi)`` from the leaf's lowest item to past its highest (empty when it has none)."""
    address, shape, strides, itemsize = leaf_layout(leaf)
    if 0 in shape:
        return address, address
    lo = address + sum(stride * (n - 1) for n, stride in zip(shape, strides, strict=True) if stride < 0)
    return lo, lo + span_nbytes(shape, strides, itemsize)


def span_nbytes(shape: Sequence[int], strides: Sequence[int], itemsize: int) -> int:
    """Bytes from the lowest item of a strided view to past its highest (0 when it has no items)."""
    if 0 in shape:
        return 0
    return itemsize + sum(abs(stride) * (n - 1) for n, stride in zip(shape, strides, strict=True))


def plan_regions(tree: Any) -> list[Region]:
    """The leaves of ``tree`` grouped into regions of overlapping memory, by address.

    Views that overlap lie in one allocation, so every byte of a region is
    memory the worker may read. A leaf with no items is a region of its own, of no bytes.
    """
    regions: list[Region] = []
    empty: list[Region] = []
    for (lo, hi), leaf in sorted(((leaf_span(leaf), leaf) for leaf in leaves_of(tree)), key=lambda s: s[0]):
        if hi == lo:
            empty.append(Region(lo, 0, [leaf]))
        elif regions and lo < regions[-1].start + regions[-1].nbytes:
            last = regions[-1]
            last.nbytes = max(last.nbytes, hi - last.start)
            last.leaves.append(leaf)
        else:
            regions.append(Region(lo, hi - lo, [leaf]))
    return regions + empty


def describe_leaf(leaf: Any, slot_region: tuple[int, int], region_start: int) -> ViewLeaf:
    address, shape, strides, _ = leaf_layout(leaf)
    offset = address - region_start if slot_region[1] else 0
    if isinstance(leaf, torch.Tensor):
        return ViewLeaf(slot_region, offset, leaf.dtype, shape, strides, True)
    return ViewLeaf(slot_region, offset, leaf.dtype, shape, strides, False, bool(leaf.flags.writeable))


def _described(tree: Any, described: dict[int, ViewLeaf]) -> Any:
    leaf = described.get(id(tree))
    if leaf is not None:
        return leaf
    return map_tree(tree, lambda value: _described(value, described))


def tree_nbytes(tree: Any) -> int:
    """The slot bytes ``tree`` would need at most (for the message when it does not fit)."""
    return sum(aligned(region.nbytes + SLOT_ALIGN) for region in plan_regions(tree))


class SlotDestination:
    """A ring slot as a batch plan's destination: each array placed after the last, aligned;
    the batch holds descriptors (leaves), read back in the trainer as views of the slot.

    A batch that does not fit raises SlotFull; one already made in this
    process's memory (``hold``, ``collated``) goes with it, so it is not made twice.
    """

    pin_memory = False  # a worker pins nothing: the trainer pins the ring

    def __init__(self, writer: SlotWriter) -> None:
        self.writer = writer

    def array(self, dtype: np.dtype, shape: tuple[int, ...]) -> tuple[np.ndarray, Any]:
        leaf, target = _place_array(self.writer, dtype, shape)
        return target, leaf

    def rows(self, rows: RaggedRows) -> tuple[NDArray[np.uint8], NDArray[np.int64], Callable[[], Any]]:
        leaf, offsets = self.writer.place_rows(rows)
        return self.writer.ring.slot_bytes(self.writer.slot), offsets, lambda: leaf

    def hold(self, batch: Any) -> Any:
        try:
            return self.writer.write(batch)
        except SlotFull as full:
            full.batch = batch
            raise

    def collated(self, samples: Sequence[Any]) -> Any:
        try:
            return write_collated(samples, self.writer)
        except SlotFull as full:
            full.batch = collate(samples)
            raise


def write_collated(samples: Sequence[Any], writer: SlotWriter) -> Any:
    """Transformed samples collated as ``npz2mmap.collate`` does, each stacked straight into the slot.

    A field whose values are arrays of one shape and dtype is stacked there
    with no intermediate tensor; anything else is collated by ``collate`` and
    then copied in. Raises SlotFull when the slot is too small.
    """
    if not isinstance(samples, SampleList) or not samples or not isinstance(samples[0], dict):
        return writer.write(collate(samples))
    out = {}
    for name in samples[0]:
        values = [sample[name] for sample in samples]
        if name not in samples.ragged and _stackable(values):
            leaf, target = _place_array(writer, values[0].dtype, (len(values), *values[0].shape))
            np.stack(values, out=target)
            out[name] = leaf
        else:
            out[name] = writer.write(collate(SampleList([{name: v} for v in values], samples.ragged))[name])
    return out


def _stackable(values: list[Any]) -> bool:
    """Plain numpy arrays of one shape and of one dtype that torch has (which collate would stack).

    A negative stride is left to ``collate``, which refuses it as it does without workers.
    """
    first = values[0]
    if type(first) is not np.ndarray or not first.dtype.isnative or torch_dtype(first.dtype) is None:
        return False
    return all(
        type(v) is np.ndarray
        and v.shape == first.shape
        and v.dtype == first.dtype
        and min(v.strides, default=0) >= 0
        for v in values
    )


def _place_array(writer: SlotWriter, dtype: np.dtype, shape: tuple[int, ...]) -> tuple[Leaf, np.ndarray]:
    """A numpy target in the slot; its leaf is read back as a tensor where torch has the dtype."""
    leaf, target = writer.place(dtype, shape, False)
    tensor_dtype = torch_dtype(dtype)
    if tensor_dtype is not None:
        leaf = Leaf(leaf.offset, tensor_dtype, leaf.shape, True)
    return leaf, target


def worker_main(
    worker_id: int,
    conn: Any,
    block: Any,
    num_slots: int,
    slot_nbytes: int,
    plan: BatchPlan,
    seed: int,
    forkserver_socket: ForkserverSocket | None = None,
) -> None:
    """A worker's life: make each batch it is sent into its slot, until told to stop or the pipe closes.

    Under forkserver, a worker whose trainer died removes the trainer's
    forkserver socket on its way out (forkserver_socket.py).
    """
    on_trainer_gone = None if forkserver_socket is None else forkserver_socket.remove_if_trainer_gone
    parallel.become_worker(on_trainer_gone)
    torch.set_num_threads(1)  # the workers are the parallelism; threads inside each would compete
    _seed_generators(seed)
    ring = Ring(block, num_slots, slot_nbytes)
    while True:
        try:
            task = conn.recv_bytes()
        except (EOFError, OSError):  # the trainer is gone (it says stop otherwise), maybe with replies unread
            if on_trainer_gone is not None:
                on_trainer_gone()
            return
        if not task:
            return
        number, slot = TASK_HEADER.unpack_from(task)
        indices = np.frombuffer(task, dtype="<i8", offset=TASK_HEADER.size)
        reply = _make_into_slot(plan, ring, slot, number, indices)  # bytes, numbers and text only
        conn.send_bytes(pickle.dumps(reply, pickle.HIGHEST_PROTOCOL))


def _seed_generators(seed: int) -> None:
    """A distinct seed per worker (and per start), so forked workers do not draw the same augmentations."""
    random.seed(seed)
    torch.manual_seed(seed)
    np.random.seed(seed % 2**32)


def _make_into_slot(
    plan: BatchPlan, ring: Ring, slot: int, number: int, indices: np.ndarray
) -> tuple[Any, ...]:
    """One batch's reply: ("slot", number, layout), ("pickled", number, nbytes, batch) or ("error", ...).

    The layout and the batch are pickled here, inside the try: a batch that
    cannot be pickled (a lock, a generator) is an error of this batch, and
    the trainer can tell one it cannot unpickle from a broken pipe. An error
    is ("error", number, pickled exception or None, traceback text).
    """
    try:
        try:
            return ("slot", number, _layout(plan.make(indices, SlotDestination(SlotWriter(ring, slot)))))
        except SlotFull as full:
            batch = full.batch if full.batch is not None else plan.make(indices, InMemory())
        return ("pickled", number, tree_nbytes(batch), _layout(batch))
    except BaseException as exc:  # KeyboardInterrupt, SystemExit too: from user code (workers ignore SIGINT)
        return ("error", number, _pickled_or_none(exc), traceback.format_exc())


def _layout(tree: Any) -> bytes:
    """A slot's descriptor tree (or a whole batch), pickled apart, so the trainer can tell a layout
    it has seen by its bytes."""
    data = io.BytesIO()
    _TensorPickler(data, pickle.HIGHEST_PROTOCOL).dump(tree)
    return data.getvalue()


# Dtypes whose tensors torch's own pickling refuses ("UntypedStorage has no attribute dtype").
_BY_BYTES_DTYPES = frozenset(
    getattr(torch, name)
    for name in ("uint16", "uint32", "uint64", "complex32", "float8_e4m3fn", "float8_e5m2")
    if hasattr(torch, name)
)


class _TensorPickler(pickle.Pickler):
    """Pickle, with the plain tensors of dtypes torch cannot pickle sent as their bytes."""

    def reducer_override(self, obj: Any) -> Any:
        if type(obj) is torch.Tensor and obj.dtype in _BY_BYTES_DTYPES and obj.layout == torch.strided:
            raw = obj.detach().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()
            return _tensor_from_bytes, (raw, str(obj.dtype).removeprefix("torch."), tuple(obj.shape))
        return NotImplemented


def _tensor_from_bytes(raw: bytes, dtype_name: str, shape: tuple[int, ...]) -> torch.Tensor:
    """A tensor _TensorPickler sent as its bytes."""
    dtype = getattr(torch, dtype_name)
    if not raw:
        return torch.empty(shape, dtype=dtype)
    return torch.frombuffer(bytearray(raw), dtype=torch.uint8).view(dtype).reshape(shape)


def _pickled_or_none(exc: BaseException) -> bytes | None:
    try:
        data = pickle.dumps(exc, pickle.HIGHEST_PROTOCOL)
        pickle.loads(data)
    except Exception:
        return None
    return data


class RemoteTraceback(Exception):
    """The traceback of an exception raised in a worker, as text (chained to what the trainer raises)."""

    def __str__(self) -> str:
        return str(self.args[0])


class WorkerPool:
    """``num_workers`` processes and the ring they write into, started once and kept across epochs."""

    @parallel.keeps_signal_mask  # SIGINT is blocked while workers start: never for longer
    def __init__(
        self,
        plan: BatchPlan,
        num_workers: int,
        num_slots: int,
        slot_nbytes: int,
        context: BaseContext,
        seed: int,
    ) -> None:
        self.ring = allocate_ring(num_slots, slot_nbytes)
        self.processes: list[Any] = []
        self.conns: list[Any] = []
        self._selectors: dict[int, selectors.BaseSelector] = {}
        # Only the process that started the workers may stop them: a forked child
        # (another loader's worker) that runs this pool's finalizer must not.
        self.owner_pid = os.getpid()
        self.start_method = context.get_start_method()
        self.answered: set[int] = set()  # workers that have replied at least once
        try:
            with parallel.interrupts_blocked():  # workers start deaf to Ctrl-C, then ignore it
                with _interrupts_ignored_across_exec(self.start_method):
                    forkserver_socket = ForkserverSocket.of_this_process(self.start_method)
                for worker_id in range(num_workers):
                    args = (worker_id, self.ring.block, num_slots, slot_nbytes, plan, seed + worker_id)
                    self._start(context, worker_id, (*args, forkserver_socket))
        except BaseException:  # e.g. a transform that spawn cannot pickle: stop those started
            self.close()
            raise

    def _start(self, context: BaseContext, worker_id: int, args: tuple[Any, ...]) -> None:
        ours, theirs = context.Pipe(duplex=True)
        process = context.Process(  # type: ignore[attr-defined]
            target=worker_main,
            args=(args[0], theirs, *args[1:]),
            name=f"npz2mmap-loader-{worker_id}",
            daemon=True,
        )
        try:
            with _interrupts_ignored_across_exec(self.start_method):
                process.start()
        except BaseException:
            ours.close()
            raise
        finally:
            theirs.close()
        self.processes.append(process)
        self.conns.append(ours)

    @property
    def num_workers(self) -> int:
        return len(self.processes)

    def send(self, worker: int, number: int, slot: int, indices: np.ndarray) -> None:
        try:
            self.conns[worker].send_bytes(TASK_HEADER.pack(number, slot) + indices.astype("<i8").tobytes())
        except OSError:  # a dead worker's pipe
            self._raise_gone(worker, number)

    def receive(self, worker: int, number: int, timeout: float = 0) -> tuple[Any, ...]:
        """The reply for batch ``number`` from ``worker``; WorkerError at once if any worker has died.

        ``timeout`` (seconds, 0: none) bounds the wait: past it the worker is
        taken for stuck, killed, and WorkerError names it.
        """
        conn = self.conns[worker]
        deadline = time.monotonic() + timeout if timeout > 0 else None
        while True:
            ready = self._wait(worker, deadline)
            if not ready:
                self._raise_stuck(worker, number, timeout)
            if conn in ready:
                try:
                    reply = pickle.loads(conn.recv_bytes())
                    self.answered.add(worker)
                    if reply[1] != number:  # replies come in the order tasks went: anything else is a bug
                        raise WorkerError(
                            f"MmapLoader worker {worker} answered batch {reply[1]}, not {number}"
                        )
                    return reply  # type: ignore[no-any-return]
                except (EOFError, OSError):
                    self._raise_gone(worker, number)
            for process in self.processes:
                if process.sentinel in ready:
                    process.join(STOP_TIMEOUT_S)  # reaped, so its exit code is known
            self.raise_if_dead(number)

    def _wait(self, worker: int, deadline: float | None) -> list[Any]:
        """Wait for ``worker``'s reply or any worker's end; return those ready (its pipe, sentinels).

        An empty list: ``deadline`` (time.monotonic) passed first.

        On POSIX a selector made once per worker does it in one system call
        (``multiprocessing.connection.wait`` builds one per call); Windows
        pipes are not selectable, so there it is that function.
        """
        if os.name != "posix":
            sentinels = [process.sentinel for process in self.processes]
            return multiprocessing.connection.wait([self.conns[worker], *sentinels], _left(deadline))
        selector = self._selectors.get(worker)
        if selector is None:
            selector = self._selectors[worker] = selectors.DefaultSelector()
            selector.register(self.conns[worker], selectors.EVENT_READ)
            for process in self.processes:
                selector.register(process.sentinel, selectors.EVENT_READ)
        while True:
            left = _left(deadline)
            ready = selector.select(left)
            if ready:  # else a signal interrupted the wait, or the deadline passed
                return [key.fileobj for key, _ in ready]
            if left is not None and _left(deadline) == 0:
                return []

    def _raise_stuck(self, worker: int, number: int, timeout: float) -> NoReturn:
        """The worker sent nothing within ``timeout``: kill it (it may be stopped or deadlocked), say so."""
        process = self.processes[worker]
        process.kill()
        why = (
            "stuck or stopped?"
            if worker in self.answered
            else "its first batch: still starting? A spawned worker imports torch first"
        )
        raise WorkerError(
            f"MmapLoader worker {worker} (pid {process.pid}) sent no batch {number} within the "
            f"timeout of {timeout:g} s ({why}); the workers were stopped"
        )

    def _raise_gone(self, worker: int, number: int) -> NoReturn:
        """The worker's pipe broke: it is gone, and its exit code (once the kernel has it) tells how."""
        self.processes[worker].join(STOP_TIMEOUT_S)
        self.raise_if_dead(number)
        raise WorkerError(f"MmapLoader worker {worker} closed its pipe while batch {number} was being loaded")

    def raise_if_dead(self, number: int) -> None:
        for worker, process in enumerate(self.processes):
            if process.exitcode is not None:
                killed = process.exitcode == -getattr(signal, "SIGKILL", 9)
                hint = " (out of memory? see the kernel log)" if killed else self._import_hint(worker)
                raise WorkerError(
                    f"MmapLoader worker {worker} (pid {process.pid}) {describe_exit(process.exitcode)}{hint} "
                    f"while batch {number} was being loaded; the workers were stopped"
                )

    def _import_hint(self, worker: int) -> str:
        """Why a spawned worker may die before its first reply: it could not import what it was sent."""
        if worker in self.answered or self.start_method not in ("spawn", "forkserver"):
            return ""
        return (
            f" before its first batch (under {self.start_method}, each worker imports the main script: "
            'start the loader under `if __name__ == "__main__":`, and define the dataset, transforms '
            "and collate_fn at module level, outside that block and outside functions)"
        )

    def close(self) -> None:
        """Ask every worker to stop, wait a little, then kill whatever is left.

        A no-op in any process but the one that started them (a forked child
        holds copies of this pool that are not its own).
        """
        if os.getpid() != self.owner_pid:
            return
        for conn in self.conns:
            try:
                conn.send_bytes(b"")
            except OSError:
                pass
        for process in self.processes:
            process.join(STOP_TIMEOUT_S)
            if process.exitcode is None:
                process.kill()
                process.join()
        for selector in self._selectors.values():
            selector.close()
        self._selectors.clear()
        for conn in self.conns:
            conn.close()
        self.processes.clear()
        self.conns.clear()


def _left(deadline: float | None) -> float | None:
    """Seconds until ``deadline`` (0 once past it), or None for no deadline."""
    return None if deadline is None else max(0.0, deadline - time.monotonic())


def allocate_ring(num_slots: int, slot_nbytes: int) -> Ring:
    """The loader's shared block; WorkerError naming its size when the system cannot give it."""
    try:
        return Ring.allocate(num_slots, slot_nbytes)
    except (OSError, MemoryError, OverflowError) as exc:
        reason = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc) or type(exc).__name__
        raise WorkerError(
            f"MmapLoader could not allocate its ring of {num_slots * slot_nbytes} bytes "
            f"({num_slots} slots of slot_nbytes={slot_nbytes}): {reason}; pass a smaller slot_nbytes"
        ) from None


@contextlib.contextmanager
def _interrupts_ignored_across_exec(start_method: str) -> Iterator[None]:
    """Ctrl-C ignored while a spawn or forkserver worker starts, so that it starts ignoring it.

    A blocked SIGINT reaches forked children only: spawn's exec clears the
    mask, but keeps an ignored SIGINT, and Python then installs no
    KeyboardInterrupt handler (no traceback while the worker imports). Only
    the main thread can change a handler; elsewhere the mask alone is kept.
    """
    previous = signal.getsignal(signal.SIGINT)
    in_main_thread = threading.current_thread() is threading.main_thread()
    if start_method == "fork" or previous is None or not in_main_thread:
        yield  # previous None: a handler set outside Python, which could not be restored
        return
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)


def describe_exit(exitcode: int) -> str:
    """'was killed by signal SIGKILL' or 'exited with code 3'."""
    if exitcode < 0:
        try:
            return f"was killed by signal {signal.Signals(-exitcode).name}"
        except ValueError:
            return f"was killed by signal {-exitcode}"
    return f"exited with code {exitcode}"


def worker_failure(worker: int, number: int, indices: np.ndarray, reply: tuple[Any, ...]) -> WorkerError:
    """The trainer's error for a worker's exception: names worker, batch and samples, chains the original."""
    _, _, pickled, text = reply
    original: BaseException | None = None
    if pickled is not None:
        try:
            original = pickle.loads(pickled)
        except Exception:
            original = None
    remote = RemoteTraceback(f"\n\nTraceback in the worker:\n{text}")
    shown = ", ".join(str(int(i)) for i in indices[:INDICES_SHOWN])
    more = f", ... ({len(indices)} in all)" if len(indices) > INDICES_SHOWN else ""
    summary = exception_line(original) if original is not None else text.strip().splitlines()[-1]
    error = WorkerError(
        f"MmapLoader worker {worker} failed on batch {number} (samples {shown}{more}): {summary}"
    )
    if original is not None:
        original.__cause__ = remote
        error.__cause__ = original
    else:
        error.__cause__ = remote
    return error


def exception_line(error: BaseException) -> str:
    """'ValueError: bad sample', or the bare type name when the message is empty (a KeyboardInterrupt)."""
    message = str(error)
    return f"{type(error).__name__}: {message}" if message else type(error).__name__


def resolve_context(context: BaseContext | str | None) -> BaseContext:
    """A multiprocessing context from a context, a start method's name, or None (the platform's default)."""
    if context is None:
        return multiprocessing.get_context()
    if isinstance(context, str):
        return multiprocessing.get_context(context)
    return context


def pin_ring(ring: Ring) -> Callable[[], None]:
    """Register the ring page-locked with CUDA (once per loader); return the function undoing it.

    Host-to-device copies from a pinned slot run asynchronously. Raises
    WorkerError when CUDA refuses.
    """
    cudart = torch.cuda.cudart()
    address, nbytes = ring.address(), ring.nbytes
    status = cudart.cudaHostRegister(address, nbytes, 0)
    if int(status) != 0:
        raise WorkerError(
            f"CUDA could not page-lock the loader's ring of {nbytes} bytes (error {int(status)})"
        )
    return lambda: cudart.cudaHostUnregister(address)


def seed_base() -> int:
    """A seed for one start of the workers, drawn from torch's default generator as DataLoader
    draws its base seed: ``torch.manual_seed`` before the loader starts makes the workers'
    augmentations repeat, and each start draws a new one."""
    return int(torch.empty((), dtype=torch.int64).random_().item())


class RingWorkers:
    """The trainer's side: batches sent to the workers round robin, yielded in order as slot views.

    A batch stays valid until the next one is requested: only then is its
    slot given to another batch. The workers and the ring live until
    ``close()``, or until this object is dropped (a finalizer closes them).
    """

    def __init__(
        self,
        plan: BatchPlan,
        num_workers: int,
        num_slots: int,
        slot_nbytes: int,
        context: BaseContext,
        pin_memory: bool,
        timeout: float = 0,
    ) -> None:
        self.timeout = timeout  # seconds a batch may take (0: no limit)
        self.pool = WorkerPool(plan, num_workers, num_slots, slot_nbytes, context, seed_base())
        unpin = None
        try:
            unpin = pin_ring(self.pool.ring) if pin_memory else None
        except BaseException:
            self.pool.close()
            raise
        self._finalizer = weakref.finalize(self, _close, self.pool, unpin)
        self.pinned = unpin is not None
        # Slots no batch in hand or in flight uses, each with the event its reuse waits for.
        self._free: deque[tuple[int, Any]] = deque((slot, None) for slot in range(num_slots))
        self.warned_overflow = False
        self.busy = False
        self._layouts: dict[int, tuple[bytes, Any]] = {}  # per slot: the last layout's bytes and its tree
        self._next_worker = 0

    @property
    def closed(self) -> bool:
        return not self._finalizer.alive

    def close(self) -> None:
        self._finalizer()

    def batches(self, indices: Iterator[np.ndarray], first_number: int) -> Iterator[Any]:
        """Load ``indices`` through the workers; yield each batch, in order, as views of its slot.

        A worker's exception is raised as WorkerError once the batches before
        it are yielded, and the workers stay; a worker's death, Ctrl-C or any
        other exception stops them. Leaving early lets the batches in flight
        finish (so their slots are free for the next pass).
        """
        self.busy = True
        try:
            yield from self._batches(indices, first_number)
        finally:
            self.busy = False

    def _batches(self, indices: Iterator[np.ndarray], first_number: int) -> Iterator[Any]:
        free = self._free
        in_flight: deque[tuple[int, int, int, np.ndarray]] = deque()
        numbered = enumerate(indices, start=first_number)
        deferred: list[BaseException] = []  # an error of the index order, raised in its turn
        failure: WorkerError | None = None
        held: int | None = None
        try:
            while True:
                self._dispatch(numbered, free, in_flight, deferred)
                if not in_flight:
                    break
                number, slot, worker, batch_indices = in_flight.popleft()
                reply = self._opened(self.pool.receive(worker, number, self.timeout), slot)
                held = slot
                if reply[0] == "error":
                    self._drain(in_flight)
                    failure = worker_failure(worker, number, batch_indices, reply)
                    break
                yield reply[2]
                # The next batch is requested: this one's slot may be reused, once the
                # device has copied it when pinned (the copy may still be queued).
                free.append((slot, self._gpu_mark()))
                held = None
        except GeneratorExit:
            self._drain(in_flight)
            raise
        except BaseException:
            self.close()
            raise
        finally:
            if held is not None:
                free.append((held, self._gpu_mark()))
        if failure is not None:
            raise failure
        if deferred:
            raise deferred[0]

    def _dispatch(
        self,
        numbered: Iterator[tuple[int, np.ndarray]],
        free: deque[tuple[int, Any]],
        in_flight: deque[tuple[int, int, int, np.ndarray]],
        deferred: list[BaseException],
    ) -> None:
        while free and not deferred:
            mark = free[0][1]
            if mark is not None and not mark.query():
                if in_flight:
                    return  # try again at the next request
                mark.synchronize()
            try:
                number, batch_indices = next(numbered)
            except StopIteration:
                return
            except Exception as exc:
                deferred.append(exc)
                return
            slot, _ = free.popleft()
            worker = self._next_worker
            self._next_worker = (worker + 1) % self.pool.num_workers
            self.pool.send(worker, number, slot, batch_indices)
            in_flight.append((number, slot, worker, batch_indices))

    def _gpu_mark(self) -> Any:
        """A CUDA event after every copy queued so far, when the ring is pinned (else None).

        A slot is refilled only once its event has passed, so a
        ``.to(device, non_blocking=True)`` of a batch is never overwritten.
        """
        if not self.pinned:
            return None
        event = torch.cuda.Event()
        event.record()
        return event

    def _opened(self, reply: tuple[Any, ...], slot: int) -> tuple[Any, ...]:
        """("batch", number, batch) from a worker's reply, or an error reply.

        A batch the trainer cannot unpickle becomes an error reply too, so it
        is reported as the worker's other errors are (and the workers stay).
        """
        if reply[0] == "error":
            return reply
        try:
            return ("batch", reply[1], self._batch_of(reply, slot))
        except Exception as exc:
            text = f"(unpickling the batch in the trainer)\n{traceback.format_exc()}"
            return ("error", reply[1], _pickled_or_none(exc), text)

    def _batch_of(self, reply: tuple[Any, ...], slot: int) -> Any:
        if reply[0] == "slot":
            return self.pool.ring.materialise(slot, self._tree_of(slot, reply[2]))
        _, number, nbytes, pickled = reply
        batch = pickle.loads(pickled)
        if not self.warned_overflow:
            self.warned_overflow = True
            warnings.warn(
                f"MmapLoader: batch {number} needs {nbytes} bytes, more than a ring slot's "
                f"{self.pool.ring.slot_nbytes}; such batches go through a pipe, pickled (slower): "
                "pass a larger slot_nbytes",
                RuntimeWarning,
                stacklevel=5,
            )
        return batch

    def _tree_of(self, slot: int, layout: bytes) -> Any:
        """The descriptor tree of ``layout``, unpickled only when it differs from the slot's last one.

        Only a bare layout is kept for reuse: a tree holding values that
        travelled pickled (a dataclass, a masked array, a tensor subclass) is
        unpickled anew for every batch, since those values are handed out as
        they are and the user may change them in place.
        """
        seen = self._layouts.get(slot)
        if seen is not None and seen[0] == layout:
            return seen[1]
        tree = pickle.loads(layout)
        if is_bare_layout(tree):
            self._layouts[slot] = (layout, tree)
        else:
            self._layouts.pop(slot, None)
        return tree

    def _drain(self, in_flight: deque[tuple[int, int, int, np.ndarray]]) -> None:
        """Wait for the batches in flight, dropping them; a dead or stuck worker stops the workers instead."""
        if self.closed:  # the loader was closed with this pass still open: nothing is in flight any more
            return
        try:
            while in_flight:
                number, slot, worker, _ = in_flight.popleft()
                self.pool.receive(worker, number, self.timeout or DRAIN_TIMEOUT_S)
                self._free.append((slot, None))  # never handed out
        except WorkerError:
            self.close()


def _close(pool: WorkerPool, unpin: Callable[[], None] | None) -> None:
    if os.getpid() != pool.owner_pid:  # a forked child's copy: neither the workers nor the pinning are its
        return
    try:
        pool.close()
    finally:
        if unpin is not None:
            unpin()
