"""The leaves of a batch: which tensors and arrays a ring slot carries as bytes, grouped by the
memory they share, and the descriptors the trainer rebuilds them from as views of the slot.

A leaf whose bytes alone say everything (a plain strided CPU tensor, a numpy array of items)
travels as bytes; anything else stays in the tree and travels pickled.
"""

from __future__ import annotations

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
        and not value.__dict__  # Python attributes (t.meta = ...), which pickling keeps
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


def described_tree(tree: Any, described: dict[int, ViewLeaf]) -> Any:
    leaf = described.get(id(tree))
    if leaf is not None:
        return leaf
    return map_tree(tree, lambda value: described_tree(value, described))
