"""How MmapLoader makes each batch: one plan, chosen once per loader, run in the trainer or a worker.

The plan is chosen from the loader's settings, the fewer steps a batch has,
the fewer copies: an untransformed batch is assembled straight from the
mapping (``assemble``), padded too when ``collate_fn`` is a plain
PaddedCollate; transformed samples are stacked as ``collate`` does; any
other ``collate_fn`` or ``batch_transform`` makes the batch, which is then
held as it is. The same plan fills new memory in the trainer (``InMemory``)
and a ring slot in a worker (``slots.SlotDestination``): the destination
says where each array goes, so both give the same batch.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, Protocol

import numpy as np

from ..format.index import SampleShape
from ..read.ragged import RaggedShapes
from .assemble import Destination, NewMemory, Padding, assemble
from .collate import collate
from .dataset import MmapDataset
from .padding import PaddedCollate


class BatchDestination(Destination, Protocol):
    """Where a plan's batch goes: arrays placed by the assembler, or a batch made whole."""

    pin_memory: bool  # whether a batch made in this process's memory for it is pinned

    def hold(self, batch: Any) -> Any:
        """What the loader gives for ``batch``, a batch made elsewhere (in this process's memory)."""

    def collated(self, samples: Sequence[Any]) -> Any:
        """What the loader gives for ``samples`` collated as ``npz2mmap.collate`` does."""


class InMemory(NewMemory):
    """New tensors in this process (pinned with ``pin_memory``); a batch made whole is taken as it is."""

    def hold(self, batch: Any) -> Any:
        return batch

    def collated(self, samples: Sequence[Any]) -> Any:
        return collate(samples)


class BatchPlan(Protocol):
    def make(self, indices: np.ndarray, destination: BatchDestination) -> Any:
        """The batch of samples ``indices`` (as the sampler gave them), in ``destination``."""


class FromTheMapping:
    """An untransformed batch, each field copied once from the mapping (padded with ``padding``)."""

    def __init__(self, dataset: MmapDataset, padding: Padding | None = None) -> None:
        self.dataset = dataset
        self.padding = padding

    def make(self, indices: np.ndarray, destination: BatchDestination) -> Any:
        reader = self.dataset.reader
        out = assemble(reader, self.dataset.fields, reader.sample_indices(indices), destination, self.padding)
        return out[self.dataset.fields[0]] if self.dataset.single and self.padding is None else out


class TransformedSamples:
    """Samples as the dataset's transform gives them, stacked as ``collate`` does."""

    def __init__(self, dataset: MmapDataset) -> None:
        self.dataset = dataset

    def make(self, indices: np.ndarray, destination: BatchDestination) -> Any:
        return destination.collated(self.dataset.__getitems__(indices))


class CollatedBy:
    """Samples (or the dataset's batch) given to the user's ``collate_fn``."""

    def __init__(self, dataset: MmapDataset, collate_fn: Callable[[Any], Any]) -> None:
        self.dataset = dataset
        self.collate_fn = collate_fn

    def make(self, indices: np.ndarray, destination: BatchDestination) -> Any:
        return destination.hold(self.collate_fn(self.dataset.__getitems__(indices)))


class Transformed:
    """Another plan's batch, made in this process's memory, then given to ``batch_transform``."""

    def __init__(self, plan: BatchPlan, batch_transform: Callable[[Any], Any]) -> None:
        self.plan = plan
        self.batch_transform = batch_transform

    def make(self, indices: np.ndarray, destination: BatchDestination) -> Any:
        batch = self.plan.make(indices, InMemory(destination.pin_memory))
        return destination.hold(self.batch_transform(batch))


def plan_batches(
    dataset: MmapDataset,
    collate_fn: Callable[[Any], Any] | None,
    batch_transform: Callable[[Any], Any] | None,
) -> BatchPlan:
    """The plan that makes MmapLoader's batches with these settings, with the fewest copies."""
    plan: BatchPlan
    padding = padding_from_the_mapping(dataset, collate_fn)
    if collate_fn is None:
        plan = FromTheMapping(dataset) if dataset.transform is None else TransformedSamples(dataset)
    elif padding is not None:
        plan = FromTheMapping(dataset, padding)
    else:
        plan = CollatedBy(dataset, collate_fn)
    return plan if batch_transform is None else Transformed(plan, batch_transform)


def padding_from_the_mapping(dataset: MmapDataset, collate_fn: Any) -> Padding | None:
    """The padding of ``collate_fn`` when it is a plain PaddedCollate of untransformed batches
    (which pads straight from the mapping), else None. Raises ValueError, as the PaddedCollate
    would, when a key it adds is also a field's."""
    if (
        type(collate_fn) is not PaddedCollate
        or collate_fn.nested
        or not _named_as_recorded(collate_fn.ragged, dataset.ragged_fields)
        or dataset.transform is not None
    ):
        return None
    collate_fn.check_keys(dataset.fields, dataset.ragged_fields)
    return Padding(collate_fn.pad_value, collate_fn.mask)


def _named_as_recorded(named: dict[str, SampleShape | None] | None, recorded: RaggedShapes) -> bool:
    """Whether a PaddedCollate's ``ragged`` gives the keys the dataset's recorded shapes give:
    nothing, or the same fields named without shapes (checked per batch otherwise), each
    differing in every dimension, as a field named so does."""
    return named is None or set(named) == set(recorded) and all(
        named[name] is None and shape is not None and all(length is None for length in shape)
        for name, shape in recorded.items()
    )
