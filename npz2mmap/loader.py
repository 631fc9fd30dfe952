"""MmapLoader: batches gathered straight from the mapping by a background thread.

A memory-mapped read needs no decoding, so DataLoader's worker processes add
only their cost (pickling every batch through a pipe). This loader gathers
each batch in one copy per field from the page cache into the output tensor,
in a thread that runs ahead of the training loop (numpy copies release the
GIL), and needs no worker processes at all.
"""

from __future__ import annotations

import functools
import itertools
import queue
import threading
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any

import numpy as np
import torch
from numpy.typing import NDArray

from .dataset import MmapDataset, as_tensors, collate
from .parts import PartsReader
from .reader import normalise_indices

_END = object()


class _Failed:
    def __init__(self, error: BaseException) -> None:
        self.error = error


class MmapLoader:
    """Iterate an MmapDataset in batches of torch tensors, without worker processes.

    ``shuffle`` draws a new order each epoch from ``seed`` and the epoch
    (``set_epoch`` fixes it, as with DistributedSampler); ``sampler`` (any
    iterable of indices, e.g. a DistributedSampler or BlockShuffleSampler)
    replaces both, and ``batch_sampler`` (e.g. LengthGroupedSampler) replaces
    the batching too. ``collate_fn`` (e.g. PaddedCollate) turns each gathered
    batch into the output instead. ``prefetch`` batches are prepared ahead by a background
    thread; with 0 there is no thread and each batch is gathered when asked
    for (fastest when nothing else runs between batches). ``pin_memory``
    gathers into page-locked tensors where CUDA is available (ignored otherwise).
    """

    def __init__(
        self,
        dataset: MmapDataset,
        batch_size: int,
        *,
        shuffle: bool = False,
        sampler: Iterable[int] | None = None,
        batch_sampler: Iterable[Sequence[int]] | None = None,
        collate_fn: Callable[[Any], Any] | None = None,
        drop_last: bool = False,
        prefetch: int = 2,
        pin_memory: bool = False,
        seed: int = 0,
    ) -> None:
        if batch_size < 1 or prefetch < 0:
            raise ValueError("batch_size must be at least 1 and prefetch at least 0")
        self.dataset = dataset
        self.batch_size = batch_size
        self.shuffle = shuffle
        self.sampler = sampler
        self.batch_sampler = batch_sampler
        self.collate_fn = collate_fn
        self.drop_last = drop_last
        self.prefetch = prefetch
        self.pin_memory = pin_memory and torch.cuda.is_available()
        self.seed = seed
        self.epoch = 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch
        for sampler in (self.sampler, self.batch_sampler):
            set_sampler_epoch = getattr(sampler, "set_epoch", None)
            if set_sampler_epoch is not None:
                set_sampler_epoch(epoch)

    def __len__(self) -> int:
        if self.batch_sampler is not None:
            return len(self.batch_sampler)  # type: ignore[arg-type]
        count = len(self.sampler) if hasattr(self.sampler, "__len__") else len(self.dataset)  # type: ignore[arg-type]
        return count // self.batch_size if self.drop_last else -(-count // self.batch_size)

    def index_batches(self) -> Iterator[NDArray[np.int64]]:
        """The batches of sample indices of this epoch, checked as the dataset checks them.

        Raises TypeError for an index that is not an integer, IndexError for
        one out of range (see reader.normalise_indices).
        """
        num_samples = len(self.dataset)
        if self.batch_sampler is not None:
            yield from (normalise_indices(batch, num_samples) for batch in self.batch_sampler)
            return
        for batch in self._batches_of_order(num_samples):
            if self.drop_last and len(batch) < self.batch_size:
                return
            yield normalise_indices(batch, num_samples)

    def _batches_of_order(self, num_samples: int) -> Iterator[Sequence[int] | NDArray[np.int64]]:
        """This epoch's order cut into batch-sized pieces, the last one maybe shorter."""
        if self.sampler is not None:
            indices = iter(self.sampler)
            while batch := list(itertools.islice(indices, self.batch_size)):
                yield batch
            return
        if self.shuffle:
            order = np.random.default_rng((self.seed, self.epoch)).permutation(num_samples)
        else:
            order = np.arange(num_samples)
        for start in range(0, num_samples, self.batch_size):
            yield order[start : start + self.batch_size]

    def __iter__(self) -> Iterator[Any]:
        try:
            if self.prefetch == 0:
                yield from (self.load(indices) for indices in self.index_batches())
            else:
                yield from self._prefetched()
        finally:
            if self.sampler is None and self.batch_sampler is None and self.shuffle:
                self.epoch += 1

    def _prefetched(self) -> Iterator[Any]:
        batches: queue.Queue[Any] = queue.Queue(maxsize=self.prefetch)
        stop = threading.Event()
        thread = threading.Thread(target=self._produce, args=(batches, stop), daemon=True)
        thread.start()
        try:
            while (item := batches.get()) is not _END:
                if isinstance(item, _Failed):
                    raise item.error
                yield item
        finally:
            stop.set()
            while thread.is_alive():
                try:
                    batches.get(timeout=0.05)
                except queue.Empty:
                    pass
            thread.join()

    def _produce(self, batches: queue.Queue[Any], stop: threading.Event) -> None:
        try:
            for indices in self.index_batches():
                if stop.is_set():
                    return
                batches.put(self.load(indices))
            batches.put(_END)
        except BaseException as exc:  # handed to the consuming thread, which re-raises it
            batches.put(_Failed(exc))

    def load(self, indices: np.ndarray) -> Any:
        """One batch: each fixed field gathered straight into its output tensor."""
        if self.collate_fn is not None:
            return self.collate_fn(self.dataset.__getitems__(indices))
        if self.dataset.transform is not None:
            return collate(self.dataset.__getitems__(indices))
        reader = self.dataset.reader
        out = {name: self._gather(reader, name, indices) for name in self.dataset.fields}
        return out[self.dataset.fields[0]] if self.dataset.single else out

    def _gather(self, reader: PartsReader, name: str, indices: np.ndarray) -> Any:
        field = reader.field(name)
        if field.shape is None:
            return as_tensors(reader.gather(name, indices))
        dtype = torch_dtype(field.dtype)
        if dtype is None:
            return reader.gather(name, indices)  # a dtype torch lacks stays numpy
        tensor = torch.empty((len(indices), *field.shape), dtype=dtype, pin_memory=self.pin_memory)
        reader.gather(name, indices, out=tensor.numpy())
        return tensor


@functools.cache
def torch_dtype(dtype: np.dtype) -> torch.dtype | None:
    """The torch dtype of a numpy dtype, or None where torch has none (looked up once per dtype)."""
    try:
        return torch.from_numpy(np.empty(0, dtype=dtype)).dtype
    except TypeError:
        return None
