"""PaddedCollate: batches with ragged fields as padded tensors plus lengths (and masks)."""

from __future__ import annotations

import numbers
from collections.abc import Iterable, Mapping, Sequence
from typing import Any, cast

import numpy as np
import torch
from torch.utils.data import get_worker_info

from ..format.index import SampleShape
from ..read.ragged import (
    RaggedRows,
    RaggedShapes,
    check_padded_keys,
    check_padded_size,
    mask_key,
    pad_element,
    padded_extras,
    raw_unit,
    valid_mask_of,
)
from ..write.options import check_flags, repeated
from .assemble import NewMemory, Padding, place_padded, torch_dtype
from .collate import check_same_keys
from .gathered import GatheredBatch
from .samples import NOT_RAGGED, bare_field, said_of_fields
from .tensors import as_tensors, stack_bytes, viewable_by_torch


class PaddedCollate:
    """Collate for MmapDataset batches whose fields may be ragged.

    A ragged field ``name`` becomes one tensor padded with ``pad_value`` to the
    batch's largest shape, plus ``name_lengths`` (int64 (batch,): each
    sample's length in the one dimension in which the field's samples differ,
    as a sequence's length or a (k, 4) field's count of boxes; absent where
    they differ in several), for samples of two or more dimensions
    ``name_shapes`` (int64 (batch, ndim), every sample's shape), and, with
    ``mask``, ``name_mask`` (bool, True on real elements). With ``nested``, a ragged field becomes one
    jagged nested tensor instead (``torch.nested``, ragged along the first
    dimension of each sample), with no padding (so ``mask`` and a ``pad_value``
    other than 0 are refused beside it). Fixed fields become tensors as
    with ``collate``; dtypes torch lacks (records, strings, datetimes) stay
    numpy arrays, padded ones too. One tensor per field also crosses from
    DataLoader workers cheaply, where a list of tensors would cost a
    shared-memory handle each. A batch from ``MmapDataset`` is padded straight
    from the mapping, each sample copied once, with no per-sample arrays.
    A batch whose padded array numpy cannot make raises ValueError.

    Which fields are ragged, and in which dimensions, is a property of the
    dataset, never of one batch: a ragged field gets the same keys even when
    every sample of a batch has the same shape, as length-grouped batches
    often do. Batches from ``MmapDataset`` say which fields are ragged and
    where; for samples from elsewhere, name them with ``ragged``: a list of
    names (a field then counts as differing in every dimension), or a dict of
    each one's shape in every sample with None where samples differ
    (``{"boxes": (None, 4)}``, as ``ds.features`` gives it). A field not
    known to be ragged whose shapes differ within a batch raises ValueError.
    Picklable.

    A generated key that is also a field's name (a field ``name_mask`` beside
    a ragged ``name``, with ``mask``) raises ValueError naming both: here for
    the fields ``ragged`` names, at the first batch otherwise.
    """

    def __init__(
        self,
        pad_value: float = 0,
        mask: bool = False,
        nested: bool = False,
        ragged: Iterable[str] | Mapping[str, Sequence[int | None]] | None = None,
    ) -> None:
        check_flags(mask=mask, nested=nested)
        if nested and (mask or not (isinstance(pad_value, numbers.Number) and pad_value == 0)):
            given = "mask=True" if mask else f"pad_value={pad_value!r}"
            raise ValueError(
                f"PaddedCollate: {given} is an option of padding, and nested=True pads no field (a nested "
                "tensor holds each sample's own shape): give one or the other"
            )
        self.pad_value = pad_value
        self.mask = mask
        self.nested = nested
        self.ragged = None if ragged is None else _named_ragged(ragged)
        if self.ragged is not None:
            self.check_keys(sorted(self.ragged), self.ragged)

    def check_keys(self, field_names: Iterable[str], ragged: RaggedShapes) -> None:
        """Raise ValueError if batches of these fields would hold two things under one key.

        With ``nested``, no keys are added, so none can collide.
        """
        check_padded_keys(field_names, {} if self.nested else ragged, self.mask)

    def __call__(self, batch: Any) -> dict[str, Any]:
        said = {} if isinstance(batch, GatheredBatch) else said_of_fields(batch)
        declared = self.ragged or {}
        # A nested batch adds no key: only which fields are ragged matters, not their shapes.
        ragged = _known_shapes(declared, getattr(batch, "ragged", {}), said, keyed=not self.nested)
        if isinstance(batch, GatheredBatch) and batch.samples_edited:  # by the samples as edited
            batch = GatheredBatch(_by_field(list(batch)), None, len(batch), private=True)
        elif not isinstance(batch, GatheredBatch):
            batch = GatheredBatch(_by_field(batch), None, len(batch), private=True)
        if not self.nested:
            ragged = {name: _shape_of_samples(batch, name, ragged[name], name in declared) for name in ragged}
        self.check_keys(batch.field_names, ragged)
        out: dict[str, Any] = {}
        for name in batch.field_names:
            rows = batch.ragged_rows(name)
            if name in ragged and rows is not None and not self.nested:
                out.update(self._collate_rows(rows))
                continue
            value = batch.field(name)
            if name in ragged:
                out.update(self._collate_ragged(name, [np.asarray(v) for v in value], ragged[name]))
            elif isinstance(value, list):
                out[name] = as_tensors(_stack(name, value))
            else:
                out[name] = batch.tensor(name)
        return out

    def _collate_rows(self, rows: RaggedRows) -> dict[str, Any]:
        """A ragged field located in the mapping, padded with one copy per sample (no per-sample
        arrays); inside a DataLoader worker, straight into shared memory, so that it crosses to
        the trainer with no further copy."""
        destination = NewMemory(shared=get_worker_info() is not None)
        out, fills = place_padded(rows, destination, Padding(self.pad_value, self.mask))
        for fill in fills:
            fill()
        return out

    def _collate_ragged(
        self, name: str, arrays: list[np.ndarray], shape: SampleShape | None
    ) -> dict[str, Any]:
        if self.nested:
            if len({a.shape[1:] for a in arrays}) > 1:
                raise ValueError(
                    f"field {name!r} differs beyond its first dimension; a jagged nested tensor "
                    "has one ragged dimension: collate it padded (nested=False)"
                )
            dtype = _common_dtype(arrays, name)
            if torch_dtype(dtype) is None:
                raise ValueError(
                    f"field {name!r} is of dtype {dtype}, which torch has no tensor for, so no nested "
                    "tensor can hold it: collate it padded (nested=False), as a numpy array"
                )
            tensors = [torch.from_numpy(viewable_by_torch(np.asarray(a, dtype=dtype))) for a in arrays]
            return {name: torch.nested.nested_tensor(tensors, layout=torch.jagged)}
        padded, shapes = pad(arrays, self.pad_value, name)
        out = {name: as_tensors(padded)}
        extras = padded_extras(name, shapes, shape)
        out.update((key, torch.from_numpy(array)) for key, array in extras.items())
        if self.mask:
            out[mask_key(name)] = torch.from_numpy(valid_mask(arrays, padded.shape[1:]))
        return out


# The key of bare samples (arrays, not dicts) that say no field: samples from elsewhere.
BARE_KEY = "data"


def _named_ragged(
    ragged: Iterable[str] | Mapping[str, Sequence[int | None]],
) -> dict[str, SampleShape | None]:
    """``ragged`` as PaddedCollate takes it, as names with their shapes (None for a name alone).

    TypeError for a bare string (a list of names is meant), ValueError for a
    shape that says no dimension differs or has a length that is no integer.
    """
    if isinstance(ragged, (str, bytes)) or not isinstance(ragged, Iterable):
        raise TypeError(f"ragged names fields by a list of str (or a dict of their shapes), not {ragged!r}")
    names = list(ragged)
    if not all(isinstance(name, str) for name in names):
        raise TypeError(f"ragged names fields by str, not {names!r}")
    if not isinstance(ragged, Mapping):
        twice = repeated(names)
        if twice is not None:
            raise ValueError(f"ragged names {twice!r} twice; name each field once")
        return dict.fromkeys(names)
    named: dict[str, SampleShape | None] = {}
    for name, shape in ragged.items():
        if shape is None:  # known by name only, as in a list
            named[name] = None
            continue
        lengths = tuple(shape) if isinstance(shape, Iterable) and not isinstance(shape, (str, bytes)) else ()
        if None not in lengths or not all(length is None or _is_length(length) for length in lengths):
            raise ValueError(
                f"ragged[{name!r}] is {shape!r}: give the field's shape in every sample, with None in "
                "each dimension in which samples differ (at least one: (None, 4) for boxes)"
            )
        named[name] = tuple(None if length is None else int(length) for length in lengths)
    return named


def _is_length(value: object) -> bool:
    """Whether ``value`` is a dimension's length: an int of at least 0 (numpy's too, never a bool)."""
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, np.integer)):
        return False
    return bool(value >= 0)


def _shape_of_samples(
    batch: GatheredBatch, name: str, shape: SampleShape | None, declared: bool
) -> SampleShape | None:
    """The shape a ragged field's keys follow: the dataset's for samples as read; for others, or
    where the user ``declared`` the field (``shape``, None for a name alone), ``shape`` (given by
    the user, or said by the dataset the samples were read from), checked against them.

    A field named without a shape, or whose samples a transform gave another ndim than their
    dataset's, differs in every dimension its samples have. ValueError for samples of another
    length where ``shape`` gives one, or of another ndim than declared: no key may depend on one
    batch, and only the user can say in which dimension such samples differ.
    """
    if name not in batch.field_names:
        return shape
    rows = batch.ragged_rows(name)
    if rows is not None and not declared:
        return rows.sample_shape
    if rows is not None:  # declared: the keys follow it, once the samples are seen to have it
        shapes = [tuple(row) for row in rows.shapes.tolist()]
        ndim = rows.shapes.shape[1]
    else:
        value = batch.field(name)
        shapes = [np.shape(v) for v in value] if isinstance(value, list) else [value.shape[1:]] * len(value)
        ndim = len(shape) if shape is not None else 1
    ndim = len(shapes[0]) if shapes else ndim
    if shape is None or (len(shape) != ndim and not declared):
        shape = (None,) * ndim  # samples of several ndims: the padding says so
    else:
        _check_shapes(name, shapes, shape)
    if rows is not None:
        rows.sample_shape = shape
    return shape


def _check_shapes(name: str, shapes: list[tuple[int, ...]], shape: SampleShape) -> None:
    """ValueError for a sample whose shape is not ``shape`` (None where samples may differ)."""
    for found in shapes:
        if len(found) != len(shape) or not all(
            want is None or want == got for want, got in zip(shape, found, strict=True)
        ):
            raise ValueError(
                f"field {name!r} has a sample of shape {found}, not of the shape {shape} its samples "
                f"are said to have (None where they differ; a transform changed them?): pass "
                f"PaddedCollate(ragged={{{name!r}: ...}}) with the shape they have"
            )


def _known_shapes(
    declared: RaggedShapes,
    of_batch: RaggedShapes,
    said: dict[str, list[SampleShape | str | None]],
    keyed: bool = True,
) -> dict[str, SampleShape | None]:
    """The ragged fields a user declared and those a batch (``of_batch``) or its samples
    (``said``) say are ragged, each with the shape the user gave (None for a name alone, which
    differs in every dimension whatever they say), else the one they say.

    When the batch is ``keyed`` (padded, with keys that follow the shapes), ValueError for a
    field the samples of one batch say different things of (they come from datasets that hold
    it differently: a ConcatDataset), unless the user named it; else ragged if any says so.
    """
    out = dict(declared)
    out.update((name, shape) for name, shape in of_batch.items() if name not in declared)
    for name, things in said.items():
        if name in declared:
            continue
        if not keyed:
            things = [thing for thing in things if thing != NOT_RAGGED][:1] or [NOT_RAGGED]
        if len(things) > 1:
            first, other = (_held(thing) for thing in things[:2])
            raise ValueError(
                f"field {name!r}: the samples of one batch come from datasets that hold it differently "
                f"({first} and {other}; a ConcatDataset?), so no one set of keys follows from them: pass "
                f"PaddedCollate(ragged={{{name!r}: ...}}) with the shape of all its samples, None where "
                "they differ"
            )
        if things[0] != NOT_RAGGED and out.get(name) is None:
            out[name] = cast("SampleShape | None", things[0])
    return out


def _held(thing: SampleShape | str | None) -> str:
    return "fixed" if thing == NOT_RAGGED else f"ragged, {thing}"


def _common_dtype(arrays: list[np.ndarray], name: str) -> np.dtype:
    """The dtype a padded batch of these arrays takes: theirs, or numpy's promotion of theirs (native)."""
    if not arrays:
        return np.dtype(np.float32)
    dtype = arrays[0].dtype
    if any(a.dtype != dtype for a in arrays):
        try:
            dtype = np.result_type(*arrays)
        except TypeError as exc:  # numpy's DTypePromotionError is a TypeError
            kinds = sorted({str(a.dtype) for a in arrays})
            raise ValueError(
                f"field {name!r} mixes dtypes {', '.join(kinds)}, which numpy cannot promote to one ({exc})"
            ) from None
    return dtype if dtype.isnative else dtype.newbyteorder("=")


def _by_field(samples: Sequence[Any]) -> dict[str, list[np.ndarray]]:
    """Samples as lists of arrays by field: dicts by key, arrays (or tensors) as one field.

    A tuple or list sample ((input, label), as many datasets give) would become one
    array of mixed values: TypeError, which says what PaddedCollate takes.
    """
    if samples and isinstance(samples[0], Mapping):
        check_same_keys(samples)
        return {key: [_as_array(key, s[key]) for s in samples] for key in samples[0]}
    if samples and isinstance(samples[0], (tuple, list)):
        raise TypeError(
            "PaddedCollate takes samples that are dicts of arrays (or arrays), not "
            f"{type(samples[0]).__name__}s: return a dict such as {{'input': x, 'label': y}} "
            "from the dataset or its transform"
        )
    name = getattr(samples, "single", None) or bare_field(samples) or BARE_KEY
    return {name: [_as_array(name, s) for s in samples]}


def _as_array(name: str, value: Any) -> np.ndarray:
    """A sample's value as an array; ValueError naming the field for a tensor that requires grad
    and for values that make only an array of objects (None, dates, dicts)."""
    if isinstance(value, torch.Tensor):
        if value.requires_grad:
            raise ValueError(
                f"field {name!r} is a tensor that requires grad, which PaddedCollate does not collate: "
                "give it value.detach()"
            )
        value = value.cpu().numpy()
    array = np.asarray(value)
    if array.dtype.kind == "O":
        raise ValueError(
            f"field {name!r} holds {type(value).__name__} values, which make no array but one of "
            "Python objects: PaddedCollate collates arrays and numbers; collate this field in a "
            "collate_fn of your own"
        )
    return array


def _stack(name: str, arrays: list[np.ndarray]) -> np.ndarray:
    shapes = sorted({a.shape for a in arrays})
    if len(shapes) > 1:
        bare = f"bare samples, of no field (key {name!r}), have"
        what = bare if name == BARE_KEY else f"field {name!r} has"
        raise ValueError(
            f"{what} shapes {shapes[0]} and {shapes[-1]} in one batch; "
            f"pass PaddedCollate(ragged=[{name!r}, ...]) to pad it"
        )
    if all(a.dtype == arrays[0].dtype for a in arrays):
        return stack_bytes(arrays)  # np.stack would drop a record dtype's padding (numpy's promotion)
    return np.stack(arrays)


def pad(arrays: list[np.ndarray], pad_value: float = 0, name: str = "data") -> tuple[np.ndarray, np.ndarray]:
    """Stack arrays of one ndim into (len, *largest shape); return it and their shapes (len, ndim).

    Arrays of other dtypes (a user's own samples) are stacked in numpy's
    promotion of them, as np.stack would (strings of other widths, datetimes
    of other units, int8 with uint8), never cast to the first one's. Raises
    ValueError naming the field for dtypes numpy cannot promote, for samples
    of other ndim, and when the padded batch is larger than numpy can make
    (samples of shapes (2**60, 0) and (0, 2**60) pad to 2**120 elements).
    """
    if len({a.ndim for a in arrays}) > 1:
        ndims = sorted({a.ndim for a in arrays})
        raise ValueError(
            f"field {name!r} has samples of {ndims[0]} and {ndims[-1]} dimensions; padding needs one"
        )
    dtype = _common_dtype(arrays, name)
    shapes = np.array([a.shape for a in arrays], dtype=np.int64).reshape(len(arrays), -1)
    largest = tuple(int(d) for d in shapes.max(axis=0)) if len(arrays) else ()
    check_padded_size(name, (len(arrays), *largest), dtype.itemsize)
    out = np.empty((len(arrays), *largest), dtype=dtype)
    unit = raw_unit(dtype)
    raw = out.view(unit)
    raw[...] = pad_element(dtype, pad_value, name)
    for k, array in enumerate(arrays):  # out[k, ...]: a row, even of 0-d samples (out[k] is a scalar)
        where: tuple[int | slice, ...] = (k, *(slice(0, d) for d in array.shape))
        if array.dtype == dtype:  # every byte, record padding too (numpy assigns records field by field)
            raw[where] = array.view(unit)
        else:
            out[where] = array
    return out, shapes


def valid_mask(arrays: list[np.ndarray], padded_shape: tuple[int, ...]) -> np.ndarray:
    """True where a padded batch holds real elements."""
    shapes = np.array([a.shape for a in arrays], dtype=np.int64).reshape(len(arrays), len(padded_shape))
    return valid_mask_of(shapes, padded_shape)
