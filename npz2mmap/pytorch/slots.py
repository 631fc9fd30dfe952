"""The ring's memory: one shared block of slots, what a worker writes into a slot, and how the
trainer reads it back as views.

A slot holds a batch's arrays one after another, each aligned; the batch
itself travels as a small descriptor tree (leaves of dtype, shape, offset,
strides), which the trainer turns into tensors viewing the slot. The block
is a mapping of its own (``RingBlock``), unmapped in the trainer only once no
tensor views it any more: on POSIX a temporary file unlinked at once (in
/dev/shm on Linux) whose descriptor workers inherit or receive, so no name
is left behind and the kernel frees it with the last process that maps it.
"""

from __future__ import annotations

import ctypes
import math
import multiprocessing
import multiprocessing.connection
import multiprocessing.heap
import multiprocessing.reduction
import os
import tempfile
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from numpy.typing import NDArray

from ..errors import WorkerError
from ..read.ragged import RaggedRows
from .assemble import torch_dtype
from .collate import collate
from .dataset import MmapDataset
from .leaves import (
    Leaf,
    LeafUnpickler,
    PickledTree,
    RowsLeaf,
    ViewLeaf,
    describe_leaf,
    map_tree,
    pickle_with_leaves,
    plan_regions,
    span_nbytes,
)
from .samples import SampleList
from .tensors import shared_by_the_batch

# Every array in a slot starts at a multiple of 64 bytes: aligned for any
# dtype's view, and no two arrays share a cache line.
SLOT_ALIGN = 64


SLOT_SPARE_NBYTES = 1 << 20


# A dataset with a huge ragged sample would otherwise ask for a huge ring;
# batches larger than this travel through a pipe unless slot_nbytes says otherwise.
MAX_DEFAULT_SLOT_NBYTES = 256 << 20


def default_slot_nbytes(dataset: MmapDataset, batch_size: int) -> int:
    """Room for the largest batch the dataset can give untransformed, twice, plus 1 MiB (256 MiB at most).

    The largest sample of a ragged field comes from its shape table (checked
    whole, once). Twice leaves room for a transform or collate that widens
    dtypes or pads; a batch that still does not fit travels through a pipe.
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


class SlotFull(Exception):
    """A batch needs more bytes than its slot has (it then travels through a pipe, copied).

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


@dataclass(frozen=True)
class PrivateBlock:
    """Memory of one process's own, in place of a shared block (see ``Ring.private``)."""

    buffer: memoryview


class Ring:
    """The shared block as slots; both the trainer and the workers view it through this."""

    def __init__(
        self, block: multiprocessing.heap.Arena | PrivateBlock, num_slots: int, slot_nbytes: int
    ) -> None:
        self.block = block  # what workers are given: it pickles as the memory's descriptor
        self.num_slots = num_slots
        self.slot_nbytes = slot_nbytes
        self.memory = memoryview(block.buffer)  # every view of the ring holds the mapping through this
        self.bytes_np = np.frombuffer(self.memory, dtype=np.uint8)

    @classmethod
    def allocate(cls, num_slots: int, slot_nbytes: int) -> Ring:
        """A new block (not touched here: pages are committed as batches are first written)."""
        return cls(RingBlock(num_slots * slot_nbytes), num_slots, slot_nbytes)

    @classmethod
    def private(cls, nbytes: int) -> Ring:
        """One slot of this process's own memory, aligned as a shared slot is.

        A batch larger than its shared slot is written into one of these and
        sent as its bytes: the trainer's batch then shares memory between
        leaves (a view and its base, a tensor and its numpy array) as one
        from a shared slot does.
        """
        raw = np.empty(nbytes + SLOT_ALIGN, dtype=np.uint8)
        skip = -raw.ctypes.data % SLOT_ALIGN
        return cls(PrivateBlock(raw[skip : skip + nbytes].data), 1, nbytes)

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
        if isinstance(tree, PickledTree):
            return LeafUnpickler(tree, self.build).load()
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

    def write(self, tree: Any) -> PickledTree:
        """Copy every tensor and array of ``tree`` into the slot; return its descriptor.

        ``tree`` is pickled whole, its plain tensors and arrays (wherever
        they are: in any container, object or attribute) as references.
        Those are grouped by the memory they view: each region of
        overlapping leaves is copied once, whole, at its start's alignment
        modulo SLOT_ALIGN, and each leaf is described as a view into it with
        its own strides, so the trainer's batch shares memory, layout and
        identity as this one does. Every place is taken before any byte is
        copied. What a view of bare bytes would lose stays in the pickle: a
        tensor's requires_grad, quantization or conj/neg bit, an object or
        itemless dtype.
        """
        data, leaves = pickle_with_leaves(tree)
        described: dict[int, ViewLeaf] = {}
        copies = []
        for region in plan_regions(leaves):
            offset = self.reserve_at_alignment_of(region.nbytes, region.start)
            slot_region = (offset, region.nbytes)
            copies.append((offset, region))
            for leaf in region.leaves:
                described[id(leaf)] = describe_leaf(leaf, slot_region, region.start)
        address = self.ring.address() + self.slot * self.ring.slot_nbytes
        for offset, region in copies:
            if region.nbytes:
                ctypes.memmove(address + offset, region.start, region.nbytes)
        return PickledTree(data, tuple(described[id(leaf)] for leaf in leaves))

    def reserve_at_alignment_of(self, nbytes: int, address: int) -> int:
        """Room for ``nbytes`` starting at ``address`` modulo SLOT_ALIGN: every item keeps its alignment."""
        slot_address = self.ring.address() + self.slot * self.ring.slot_nbytes
        self.used = aligned(self.used)
        self.used += (address - slot_address - self.used) % SLOT_ALIGN
        return self.reserve(nbytes)


def tree_nbytes(tree: Any) -> int:
    """The slot bytes ``tree`` would need at most (a batch larger than its slot is given this much)."""
    return sum(aligned(region.nbytes + SLOT_ALIGN) for region in plan_regions(pickle_with_leaves(tree)[1]))


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
    out: dict[str, Any] = {}
    for name in samples[0]:
        values = [sample[name] for sample in samples]
        if name not in samples.ragged and _stackable(values):
            leaf, target = _place_array(writer, values[0].dtype, (len(values), *values[0].shape))
            np.stack(values, out=target)
            out[name] = leaf
        elif name in samples.ragged:  # listed as collate lists it, copied once, into the slot
            out[name] = writer.write([shared_by_the_batch(value) for value in values])
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
