"""Sample indices as readers take them: Python, numpy and torch integers, negative ones counting
from the end, checked against the number of samples without ever wrapping."""

from __future__ import annotations

import operator
from collections.abc import Sequence
from typing import SupportsIndex

import numpy as np
from numpy.typing import NDArray


def normalise_index(i: SupportsIndex, n: int) -> int:
    """A sample index as an int in 0..n-1 (negatives count from the end).

    Accepts Python and numpy integers; a bool (a mask to numpy), float or
    anything else raises TypeError, and an index out of range IndexError,
    however large (compared as Python ints, so nothing overflows).
    """
    if type(i) is int and 0 <= i < n:  # the common case, first: one ds[i] normalises once per field
        return i
    if isinstance(i, (bool, np.bool_)) or str(getattr(i, "dtype", "")) in ("bool", "torch.bool"):
        raise TypeError(_not_an_integer(i))
    ndim = getattr(i, "ndim", 0)
    if ndim != 0:  # a one-element tensor of any shape has __index__; an index has no axes
        raise TypeError(f"sample index {i!r} is an array of {ndim} dimensions, not an integer")
    try:
        i = operator.index(i)
    except TypeError:
        raise TypeError(_not_an_integer(i)) from None
    if not -n <= i < n:
        raise IndexError(f"sample index {i} is out of range for {n} samples")
    return i + n if i < 0 else i


def _not_an_integer(i: object) -> str:
    return f"sample index {i!r} is a {type(i).__name__}, not an integer"


def normalise_indices(indices: Sequence[int] | NDArray[np.integer], n: int) -> NDArray[np.int64]:
    """Many sample indices as int64 in 0..n-1, under the rules of normalise_index.

    An array must have an integer dtype; a sequence is checked item by item
    unless it holds only Python ints (the DataLoader's batches), which numpy
    converts exactly. IndexError names the first index out of range.
    """
    if isinstance(indices, np.ndarray):
        if indices.dtype.kind not in "iu":
            raise TypeError(f"sample indices must be integers, not an array of {indices.dtype}")
        if indices.ndim != 1:
            raise TypeError(f"sample indices must be one-dimensional, not of shape {indices.shape}")
        return _within(indices, n)
    if not isinstance(indices, (list, tuple)):
        indices = list(indices)
    if all(type(i) is int for i in indices):
        idx = np.asarray(indices)
        if idx.dtype.kind in "iu":  # else empty, or beyond int64 (numpy made floats or objects)
            return _within(idx, n)
    return np.array([normalise_index(i, n) for i in indices], dtype=np.int64)


def _all_within(idx: NDArray[np.integer], n: int) -> bool:
    """Whether 0 <= i < n for every index: one reduction where, read as unsigned, a negative
    index is at least n."""
    bits = 8 * idx.dtype.itemsize
    if idx.dtype.kind == "u" or n <= 1 << (bits - 1):
        return int(idx.view(f"u{idx.dtype.itemsize}").max()) < n
    return bool(0 <= idx.min() and idx.max() < n)


def _within(idx: NDArray[np.integer], n: int) -> NDArray[np.int64]:
    """Integer indices checked in their own dtype, so unsigned ones never wrap to negative."""
    if len(idx) and _all_within(idx, n):  # the usual batch: one reduction, no copy
        return idx.astype(np.int64, copy=False)
    too_low = idx < -n if idx.dtype.kind == "i" else np.zeros(idx.shape, dtype=bool)
    bad = np.flatnonzero(too_low | (idx >= n))
    if len(bad):
        raise IndexError(f"sample index {idx[bad[0]]} is out of range for {n} samples")
    idx = idx.astype(np.int64, copy=False)
    return np.where(idx < 0, idx + n, idx)
