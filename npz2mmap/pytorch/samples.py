"""How a dataset's samples say what they are: marked types that tell a collate, torch's
default one too, which fields are ragged and which dtypes torch lacks.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import numpy as np

from ..format.index import SampleShape
from ..read.ragged import RaggedShapes
from .assemble import torch_dtype


class RaggedSample(np.ndarray):
    """A sample of a ragged field, as GatheredBatch hands it to torch's default collate.

    Samples of one ragged field differ in shape, so stacking them fails inside
    torch; the default collate gives them as a list of tensors instead, as
    ``collate`` does (``PaddedCollate`` pads them into one tensor). Knows its
    field's name and shape in every sample (None where samples differ).
    """

    field_name = ""
    sample_shape: SampleShape | None = None


class NumpyOnlySample(np.ndarray):
    """A sample of a field whose dtype torch lacks (strings, records, datetimes), as batches hand it
    to torch's default collate, which would refuse it: stacked as numpy, as ``collate`` gives it.
    Handed out bare (a one-field dataset's), it knows its field's name."""

    field_name = ""


class FieldSample(np.ndarray):
    """A bare sample of a fixed field (a one-field dataset's) as a batch hands it out, ``list(batch)``:
    an array that knows its field's name, which torch's default collate stacks as any array."""

    field_name = ""


class GatheredSample(dict[str, Any]):
    """A dict sample of a GatheredBatch: views of the batch's arrays. Through it torch's default
    collate hands the whole batch to ``collate``, which gives each fixed field's gathered array as
    the batch's tensor, where torch would stack the views into another (a copy, and another
    block of shared memory inside a DataLoader worker). Of a dataset's batch, it knows the
    dataset's ragged fields (``ragged``, None otherwise), whatever values a collate_fn puts in it."""

    ragged: RaggedShapes | None = None


class MarkedSample(dict[str, Any]):
    """A dataset's dict sample (``ds[i]``, or a transform's in a batch), with the names of the
    dataset's ragged fields (``listed``: samples as read, whose ragged fields torch's default
    collate lists)."""

    ragged: RaggedShapes = {}
    listed = False


class TransformedRaggedArray(np.ndarray):
    """A transform's bare array sample of a ragged field (``fields`` a single name), in a batch."""

    field_name = ""
    sample_shape: SampleShape | None = None
    listed = False


def mark_transformed(sample: Any, ragged: RaggedShapes, single: str | None, listed: bool = False) -> Any:
    """A transformed sample as torch's default collate should see it: knowing its ragged fields.

    Only dicts and bare numpy arrays are marked (a one-field dataset's with the field's name);
    other samples are the transform's to collate.
    With ``listed`` (samples as read, ``tensors=True``), ragged fields are listed, as without it.
    """
    if isinstance(sample, dict):
        marked = MarkedSample(sample)
        marked.ragged = ragged
        marked.listed = listed
        return marked
    if single is not None and single in ragged and isinstance(sample, np.ndarray):
        array = sample.view(TransformedRaggedArray)
        array.field_name = single
        array.sample_shape = ragged[single]
        array.listed = listed
        return array
    if type(sample) is not np.ndarray or (single is None and torch_dtype(sample.dtype) is not None):
        return sample
    bare = sample.view(NumpyOnlySample if torch_dtype(sample.dtype) is None else FieldSample)
    bare.field_name = single or ""  # a one-field dataset's sample is its field's, whatever made it
    return bare


class SampleList(list[Any]):
    """Transformed samples of a batch, with the names of the dataset's ragged fields.

    ``single`` names the field when each sample is a bare array.
    """

    def __init__(self, samples: list[Any], ragged: RaggedShapes, single: str | None = None) -> None:
        super().__init__(samples)
        self.ragged = ragged
        self.single = single


def bare_field(samples: Sequence[Any]) -> str | None:
    """The field that bare samples (a one-field dataset's, ragged or fixed) belong to, if all say one."""
    bare = (TransformedRaggedArray, RaggedSample, FieldSample, NumpyOnlySample)
    marked = [s.field_name for s in samples if isinstance(s, bare) and s.field_name]
    return marked[0] if marked and len(marked) == len(samples) else None


# What a dataset's sample says of a field its dataset holds fixed (beside the shapes of ragged ones).
NOT_RAGGED = "not ragged"


def marked_ragged(samples: Any) -> RaggedShapes:
    """The ragged fields, with their sample shapes, that a dataset's samples say they belong to,
    in a list a collate_fn made of them (sorted, sliced, copied; ``list(batch)``): fields are
    ragged by the dataset, never by one batch. Empty for samples from elsewhere, which say nothing.
    Of samples from several datasets (a ConcatDataset), a field any of them says is ragged, with
    the shape the first says (``said_of_fields`` tells where they disagree)."""
    return {
        name: shapes[0]
        for name, said in said_of_fields(samples).items()
        if (shapes := [shape for shape in said if not isinstance(shape, str)])
    }


def said_of_fields(samples: Any) -> dict[str, list[SampleShape | str | None]]:
    """Per field, the distinct things a dataset's samples say of it: its shape in every sample
    where their dataset holds it ragged, NOT_RAGGED where it holds it fixed. Samples from
    elsewhere say nothing; more than one thing said comes from samples of several datasets."""
    said: dict[str, list[SampleShape | str | None]] = {}
    if not isinstance(samples, Sequence):
        return said
    for sample in samples:
        for name, what in _said_by(sample):
            known = said.setdefault(name, [])
            if what not in known:
                known.append(what)
    return said


def _said_by(sample: Any) -> Iterator[tuple[str, SampleShape | str | None]]:
    if isinstance(sample, MarkedSample):
        for key in sample:
            yield key, sample.ragged[key] if key in sample.ragged else NOT_RAGGED
    elif isinstance(sample, GatheredSample) and sample.ragged is not None:
        for key in sample:  # the dataset says, whatever value a collate_fn put under the key
            yield key, sample.ragged[key] if key in sample.ragged else NOT_RAGGED
    elif isinstance(sample, Mapping):  # a copy of a dataset's sample: only its ragged values say
        for key, value in sample.items():
            if isinstance(value, RaggedSample):
                yield key, value.sample_shape
    elif isinstance(sample, (TransformedRaggedArray, RaggedSample)):
        yield sample.field_name, sample.sample_shape
