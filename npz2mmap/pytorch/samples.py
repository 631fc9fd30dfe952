"""How a dataset's samples say what they are: marked types that tell a collate, torch's
default one too, which fields are ragged and which dtypes torch lacks.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from ..format.index import SampleShape
from ..read.ragged import RaggedShapes
from .assemble import torch_dtype


class RaggedSample(np.ndarray):
    """A sample of a ragged field, as GatheredBatch hands it to torch's default collate.

    Samples of one ragged field differ in shape, so stacking them fails inside
    torch; the default collate gives them as a list of tensors instead, as
    ``collate`` does (``PaddedCollate`` pads them into one tensor). Knows the
    field's shape in every sample (None where samples differ).
    """

    sample_shape: SampleShape | None = None


class NumpyOnlySample(np.ndarray):
    """A sample of a field whose dtype torch lacks (strings, records, datetimes), as batches hand it
    to torch's default collate, which would refuse it: stacked as numpy, as ``collate`` gives it."""


class GatheredSample(dict[str, Any]):
    """A dict sample of a GatheredBatch: views of the batch's arrays. Through it torch's default
    collate hands the whole batch to ``collate``, which gives each fixed field's gathered array as
    the batch's tensor, where torch would stack the views into another (a copy, and another
    block of shared memory inside a DataLoader worker)."""


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

    Only dicts and bare numpy arrays are marked; other samples are the transform's to collate.
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
    if type(sample) is np.ndarray and torch_dtype(sample.dtype) is None:
        return sample.view(NumpyOnlySample)
    return sample


class SampleList(list[Any]):
    """Transformed samples of a batch, with the names of the dataset's ragged fields.

    ``single`` names the field when each sample is a bare array.
    """

    def __init__(self, samples: list[Any], ragged: RaggedShapes, single: str | None = None) -> None:
        super().__init__(samples)
        self.ragged = ragged
        self.single = single


def marked_ragged(samples: Any) -> RaggedShapes:
    """The ragged fields, with their sample shapes, that a dataset's samples say they belong to,
    in a list a collate_fn made of them (sorted, sliced, copied; ``list(batch)``): fields are
    ragged by the dataset, never by one batch. Empty for samples from elsewhere, which say nothing."""
    if not isinstance(samples, Sequence):
        return {}
    found: dict[str, SampleShape | None] = {}
    for sample in samples:
        if isinstance(sample, MarkedSample):
            found.update(sample.ragged)
        elif isinstance(sample, Mapping):
            found.update(
                (key, value.sample_shape) for key, value in sample.items() if isinstance(value, RaggedSample)
            )
        elif isinstance(sample, TransformedRaggedArray):
            found[sample.field_name] = sample.sample_shape
    return found
