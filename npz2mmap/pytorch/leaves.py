"""The leaves of a batch: which tensors and arrays a ring slot carries as bytes, grouped by the
memory they share, and the descriptors the trainer rebuilds them from as views of the slot.

A leaf whose bytes alone say everything (a plain strided CPU tensor, a numpy array of items)
travels as bytes; the rest of a batch a function made travels pickled around references to them.
"""

from __future__ import annotations

import io
import pickle
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch


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


@dataclass(frozen=True, eq=False)
class PickledTree:
    """A batch a function made, pickled whole, each tensor and array a slot can hold in it replaced
    by a reference to ``leaves`` (pickle's persistent ids, numbered in the order met).

    Any container or object travels as pickle rebuilds it (an ``OrderedDict``,
    a dataclass, a tensor's Python attributes), with its plain tensors and
    arrays as views of the slot, sharing memory with each other as they did.
    Unpickled anew for every batch, so no value is handed out twice.
    """

    data: bytes
    leaves: tuple[ViewLeaf, ...]


# Values that cannot change in place: a tree may share them between batches.
IMMUTABLE_ATOMS = (bool, int, float, complex, str, bytes, type(None))


def is_bare_layout(tree: Any) -> bool:
    """Only leaves, immutable atoms and the containers ``materialise`` rebuilds: safe to reuse.

    Anything else in a tree is a value handed out as it is, so a cached
    tree would give the same object to every batch of that layout.
    """
    if isinstance(tree, (Leaf, RowsLeaf, ViewLeaf, PickledTree)) or type(tree) in IMMUTABLE_ATOMS:
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


def _is_plain(value: Any) -> bool:
    """A tensor a slot view gives back whole: plain, strided, on the CPU, with no autograd or view bits."""
    return (
        type(value) is torch.Tensor
        and _is_bare_memory(value)
        and not value.__dict__  # Python attributes (t.meta = ...) travel beside a view (see LeafPickler)
    )


def _is_bare_memory(value: torch.Tensor) -> bool:
    """A tensor whose items are its strided CPU memory and nothing more: a plain view of it
    loses only its type and attributes."""
    return (
        value.layout == torch.strided
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


def is_slot_leaf(value: Any) -> bool:
    """A tensor or array a slot holds as bytes, read back as a view of them."""
    return _is_plain(value) or _is_plain_array(value)


# The dtypes torch's own pickling takes; it refuses the others (the wider unsigned ints, complex32,
# the float8 and smaller ones: "UntypedStorage has no attribute dtype"), which go as their bytes.
_PICKLED_BY_TORCH = frozenset(
    [torch.bool, torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64, torch.float16]
    + [torch.bfloat16, torch.float32, torch.float64, torch.complex64, torch.complex128]
)


# What torch's own pickling for processes says of it too ("Cowardly refusing to serialize non-leaf
# tensor which requires_grad"): plain pickling would send a leaf cut off from its graph, silently.
_IN_A_GRAPH = (
    "a tensor in the batch is part of an autograd graph (made by {}, it requires grad), which cannot "
    "cross from a worker process: its gradients would never reach the tensors it was computed from; "
    "detach() it in the collate_fn or transform, or compute it in the training loop"
)


class TensorPickler(pickle.Pickler):
    """Pickle, with the plain tensors of dtypes torch cannot pickle sent as their bytes."""

    def reducer_override(self, obj: Any) -> Any:
        if isinstance(obj, torch.Tensor) and obj.grad_fn is not None:
            raise RuntimeError(_IN_A_GRAPH.format(type(obj.grad_fn).__name__))
        if _pickled_as_bytes(obj):
            bits = (obj.is_conj(), obj.is_neg(), obj.requires_grad)
            plain = obj.detach()
            plain = plain.conj() if bits[0] else plain  # a conj or neg view's memory, as torch keeps it
            plain = plain._neg_view() if bits[1] else plain
            raw = plain.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()
            return _tensor_from_bytes, (raw, str(obj.dtype).removeprefix("torch."), tuple(obj.shape), bits)
        return NotImplemented


def _pickled_as_bytes(obj: Any) -> bool:
    """A plain dense CPU tensor of a dtype torch's pickling refuses (quantized ones it takes)."""
    return (
        type(obj) is torch.Tensor
        and obj.dtype not in _PICKLED_BY_TORCH
        and obj.layout == torch.strided
        and obj.device.type == "cpu"
        and not (obj.is_quantized or obj.is_nested)
    )


def _tensor_from_bytes(
    raw: bytes, dtype_name: str, shape: tuple[int, ...], bits: tuple[bool, bool, bool]
) -> torch.Tensor:
    """A tensor TensorPickler sent as its bytes, with its conj, neg and requires_grad bits."""
    dtype = getattr(torch, dtype_name)
    if not raw:
        tensor = torch.empty(shape, dtype=dtype)
    else:
        tensor = torch.frombuffer(bytearray(raw), dtype=torch.uint8).view(dtype).reshape(shape)
    conj, neg, requires_grad = bits
    tensor = tensor._neg_view() if neg else tensor
    tensor = tensor.conj() if conj else tensor
    return tensor.requires_grad_(requires_grad)


class LeafPickler(TensorPickler):
    """Pickles a batch whole, each tensor and array a slot can hold as a persistent id, kept in ``leaves``.

    A tensor carrying Python attributes, a tensor subclass and a numpy
    subclass whose memory is bare travel as a plain view of that memory (a
    leaf) with their type and attributes, so they too share memory with
    the rest of the batch.
    """

    def __init__(self, file: io.BytesIO) -> None:
        super().__init__(file, pickle.HIGHEST_PROTOCOL)
        self.leaves: list[Any] = []  # also keeps the views made here alive, so their ids stay theirs
        self.numbers: dict[int, int] = {}

    def persistent_id(self, obj: Any) -> int | None:
        if not is_slot_leaf(obj):
            return None
        number = self.numbers.get(id(obj))
        if number is None:
            number = self.numbers[id(obj)] = len(self.leaves)
            self.leaves.append(obj)
        return number

    def reducer_override(self, obj: Any) -> Any:
        plain = _plain_view_beneath(obj)
        if plain is not None:
            return _retyped, (plain, type(obj)), dict(obj.__dict__), None, None, _set_attributes
        return super().reducer_override(obj)


def _plain_view_beneath(obj: Any) -> Any:
    """A plain tensor or array viewing the memory of ``obj`` when that is all ``obj`` has beyond its type
    and attributes (its ``__dict__``, pickled as they would be), else None."""
    if isinstance(obj, torch.Tensor) and not _is_plain(obj) and _is_bare_memory(obj):
        if type(obj).__reduce_ex__ is not torch.Tensor.__reduce_ex__:
            return None
        tensor = obj.as_subclass(torch.Tensor) if type(obj) is not torch.Tensor else obj.detach()
        return tensor if _is_plain(tensor) else None
    if isinstance(obj, np.ndarray) and type(obj) is not np.ndarray and _is_numpy_subclass_of_attributes(obj):
        array = obj.view(np.ndarray)
        return array if _is_plain_array(array) else None
    return None


def _is_numpy_subclass_of_attributes(obj: np.ndarray) -> bool:
    """A subclass that pickles as its items, its type and its ``__dict__`` (``matrix``, ``MaskedArray``,
    ``recarray``): never a ``memmap``, whose attributes hold its open mapping."""
    reduce = type(obj).__reduce__
    return (
        not isinstance(obj, np.memmap)
        and hasattr(obj, "__dict__")
        and type(obj).__reduce_ex__ is np.ndarray.__reduce_ex__
        and (reduce is np.ndarray.__reduce__ or reduce is np.ma.MaskedArray.__reduce__)
    )


def _retyped(plain: Any, cls: type) -> Any:
    """``plain`` (a view of the slot) as an object of ``cls``, still viewing it."""
    if cls is torch.Tensor or cls is np.ndarray:
        return plain
    if isinstance(plain, torch.Tensor):
        return plain.as_subclass(cls)
    return plain.view(cls)


def _set_attributes(obj: Any, attributes: dict[str, Any]) -> None:
    obj.__dict__.update(attributes)


def pickle_with_leaves(tree: Any) -> tuple[bytes, list[Any]]:
    """``tree`` pickled by LeafPickler, and its leaves in the order of their persistent ids."""
    data = io.BytesIO()
    pickler = LeafPickler(data)
    pickler.dump(tree)
    return data.getvalue(), pickler.leaves


class LeafUnpickler(pickle.Unpickler):
    """Unpickles a PickledTree's data, each persistent id made by ``view`` of its leaf."""

    def __init__(self, tree: PickledTree, view: Callable[[ViewLeaf], Any]) -> None:
        super().__init__(io.BytesIO(tree.data))
        self.tree = tree
        self.view = view

    def persistent_load(self, pid: Any) -> Any:
        return self.view(self.tree.leaves[pid])


@dataclass
class Region:
    """Bytes ``[start, start + nbytes)`` of the worker's memory that some leaves of a batch view."""

    start: int  # an address
    nbytes: int
    leaves: list[Any]


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


def plan_regions(leaves: Sequence[Any]) -> list[Region]:
    """``leaves`` grouped into regions of overlapping memory, by address.

    Views that overlap lie in one allocation, so every byte of a region is
    memory the worker may read. A leaf with no items is a region of its own, of no bytes.
    """
    regions: list[Region] = []
    empty: list[Region] = []
    for (lo, hi), leaf in sorted(((leaf_span(leaf), leaf) for leaf in leaves), key=lambda s: s[0]):
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
