"""Arrays as tensors: sharing their memory where torch can view it, copies where it
cannot (negative strides, the other byte order), numpy where torch has no dtype.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from ..read.reader import as_raw, copy_bytes
from .assemble import torch_dtype


def stack_bytes(arrays: Sequence[np.ndarray]) -> np.ndarray:
    """Arrays of one dtype and shape stacked into one new array, every byte (record padding too) copied."""
    return np.stack([as_raw(np.asarray(array)) for array in arrays]).view(np.asarray(arrays[0]).dtype)


def has_negative_strides(array: np.ndarray) -> bool:
    return any(stride < 0 for stride in array.strides)


def viewable_by_torch(array: np.ndarray) -> np.ndarray:
    """The array, or a C-order copy where a stride is negative, which torch cannot view.
    A copy, not ascontiguousarray: a reversed view of one row is contiguous to numpy and
    would come back as it is, its negative stride kept."""
    return array.copy() if has_negative_strides(array) else array


def shared_by_the_batch(value: Any) -> Any:
    """A ragged field's sample as a tensor viewing its memory (an array of a dtype torch lacks as
    it is): for a batch copied whole before anyone sees it (into MmapLoader's ring)."""
    return as_tensors(np.asarray(value)) if isinstance(value, np.ndarray) else value


def owned_by_the_batch(value: Any) -> Any:
    """A ragged field's sample as a batch lists it: a tensor (or, of a dtype torch lacks, an
    array) of a copy, as torch's stack copies a fixed field, so that editing the batch in place
    leaves the sample, and whatever it came from (a transform's cache), as it was."""
    if isinstance(value, torch.Tensor):
        return value.clone()
    if isinstance(value, np.ndarray):
        return shared_by_the_batch(copy_bytes(np.asarray(value)))  # every byte, record padding too
    return value


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
