"""Collating a dataset's batches and samples: ``collate``, and the functions torch's default
collate calls for the marked sample types.

torch documents extending its default collate through ``default_collate_fn_map``; the
types registered here are only npz2mmap's, so nothing else is collated differently.
Importing this module registers them (``pytorch.dataset`` imports it).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import numpy as np
import torch
from torch.utils.data import default_collate
from torch.utils.data._utils.collate import collate as torch_collate
from torch.utils.data._utils.collate import (
    collate_numpy_array_fn,
    collate_numpy_scalar_fn,
    default_collate_fn_map,
)

from .assemble import torch_dtype
from .gathered import GatheredBatch
from .samples import (
    GatheredSample,
    MarkedSample,
    NumpyOnlySample,
    RaggedSample,
    SampleList,
    TransformedRaggedArray,
    bare_field,
    marked_ragged,
)
from .tensors import as_tensors, has_negative_strides, owned_by_the_batch, stack_bytes


def _collate_ragged_samples(batch: Sequence[np.ndarray], *, collate_fn_map: Any = None) -> list[Any]:
    """torch's default collate for ragged samples: one tensor per sample, in a list (of a bare
    field's GatheredBatch, ``collate``'s list, whose memory then leaves the samples)."""
    if isinstance(batch, GatheredBatch):
        return collate(batch)
    return [owned_by_the_batch(sample) for sample in batch]


def _collate_numpy_only_samples(batch: Sequence[np.ndarray], *, collate_fn_map: Any = None) -> np.ndarray:
    return stack_bytes(batch)


def _collate_gathered_samples(batch: Sequence[GatheredSample], *, collate_fn_map: Any = None) -> Any:
    """torch's default collate of a GatheredBatch: ``collate``'s batch (the same tensors, arrays
    and lists torch's collate makes of its samples, with no copy); of such samples rearranged
    into a list of one's own, ``collate``'s where their dataset has ragged fields (listed,
    whatever values a collate_fn put under their keys), else torch's own, field by field."""
    if isinstance(batch, GatheredBatch) or marked_ragged(batch):
        return collate(batch)
    return torch_collate([dict(sample) for sample in batch], collate_fn_map=collate_fn_map)


def _collate_transformed_samples(batch: Sequence[MarkedSample], *, collate_fn_map: Any = None) -> Any:
    """torch's default collate of transformed dict samples, refusing to stack ragged shapes it cannot."""
    ragged = batch[0].ragged
    out = {}
    for name in batch[0]:
        values = [sample[name] for sample in batch]
        if name in ragged and batch[0].listed:
            out[name] = [owned_by_the_batch(v) for v in values]
            continue
        if name in ragged:
            _check_stackable(name, values)
        with _naming_unequal_shapes(name, values):
            stacked = collate_numpy_torch_lacks(values)  # strings, records: numpy, as without a transform
            if stacked is None:
                stacked = torch_collate(values, collate_fn_map=collate_fn_map)
            out[name] = stacked
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
        and not any(has_negative_strides(a) for a in arrays)  # which torch refuses to view
    ):
        return None  # torch's own collate, as for a dataset's samples
    if all(a.dtype == arrays[0].dtype for a in arrays):
        stacked = stack_bytes(arrays) if all(a.shape == arrays[0].shape for a in arrays) else np.stack(arrays)
    else:
        stacked = np.stack(arrays)
    if not stacked.dtype.isnative:  # as a dataset's own batches are: native, whatever the kind
        stacked = stacked.astype(stacked.dtype.newbyteorder("="))
    return as_tensors(stacked)


def _collate_transformed_arrays(
    batch: Sequence[TransformedRaggedArray], *, collate_fn_map: Any = None
) -> Any:
    if batch[0].listed:
        return [owned_by_the_batch(sample) for sample in batch]
    arrays = [np.asarray(sample) for sample in batch]
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


# torch documents extending its default collate through this registry; the keys
# are types only npz2mmap's batches make, so nothing else is collated differently.
default_collate_fn_map[RaggedSample] = _collate_ragged_samples
default_collate_fn_map[NumpyOnlySample] = _collate_numpy_only_samples
default_collate_fn_map[MarkedSample] = _collate_transformed_samples
default_collate_fn_map[TransformedRaggedArray] = _collate_transformed_arrays
default_collate_fn_map[GatheredSample] = _collate_gathered_samples


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
    elif not isinstance(batch, (GatheredBatch, SampleList)):
        ragged = marked_ragged(batch)  # one walk of the samples per batch
        if ragged:
            batch = SampleList(list(batch), ragged, bare_field(batch))
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
    if isinstance(samples[0], (MarkedSample, GatheredSample)):
        return out  # a batch of the dataset's samples is a dict, as its GatheredBatch's collate is
    try:
        return type(samples[0])(out)  # type: ignore[call-arg]  # as torch's: the samples' own mapping type
    except TypeError:
        return out


def _collate_listing_ragged(samples: SampleList) -> Any:
    """Transformed samples: each ragged field as a list of tensors, the rest by torch's default collate."""
    if samples.single is not None and samples.single in samples.ragged:
        return [owned_by_the_batch(sample) for sample in samples]
    if not samples or not isinstance(samples[0], dict):
        return _collate_values(list(samples))
    check_same_keys(samples)
    out = {}
    for name in samples[0]:
        values = [sample[name] for sample in samples]
        if name in samples.ragged:
            out[name] = [owned_by_the_batch(value) for value in values]
            continue
        with _naming_unequal_shapes(name, values):
            out[name] = _collate_values(values)
    return out


@contextlib.contextmanager
def _naming_unequal_shapes(name: str, values: Sequence[Any]) -> Iterator[None]:
    """Stacking ``values`` under ``name``: where it fails (torch's error names no key), a
    ValueError naming the key if its values differ in shape, as a ragged field a transform
    renamed or made does. Looked at only on failure, never per batch."""
    try:
        yield
    except (RuntimeError, ValueError):
        shapes = sorted({tuple(v.shape) for v in values if isinstance(v, (np.ndarray, torch.Tensor))})
        if len(shapes) < 2:
            raise
        raise ValueError(
            f"{name!r} has samples of shapes {shapes[0]} and {shapes[-1]} in one batch, and is no ragged "
            f"field of the dataset (a transform renamed or reshaped one?): pass "
            f"collate_fn=npz2mmap.PaddedCollate(ragged=[{name!r}]) to pad it, or have the transform keep "
            "one shape, or a ragged field's own name"
        ) from None


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
