"""Samplers that keep shuffled reads of a cold dataset close to sequential."""

from __future__ import annotations

import math
from collections.abc import Iterator

import numpy as np
from torch.utils.data import Sampler


class BlockShuffleSampler(Sampler[int]):
    """Shuffle blocks of neighbouring samples, then the samples within each block.

    Every epoch visits every sample once in a new order, but reads stay inside
    one block of ``block_size`` neighbours at a time, so on a dataset larger
    than RAM the disk sees block-sized sequential reads instead of scattered
    ones (the idea of FFCV's quasi-random order). Call ``set_epoch`` each epoch.
    """

    def __init__(self, num_samples: int, block_size: int = 1024, seed: int = 0) -> None:
        if num_samples < 0 or block_size < 1:
            raise ValueError("num_samples must be >= 0 and block_size >= 1")
        self.num_samples = num_samples
        self.block_size = block_size
        self.seed = seed
        self.epoch = 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __len__(self) -> int:
        return self.num_samples

    def __iter__(self) -> Iterator[int]:
        rng = np.random.default_rng((self.seed, self.epoch))
        num_blocks = -(-self.num_samples // self.block_size)
        for block in rng.permutation(num_blocks):
            start = int(block) * self.block_size
            members = np.arange(start, min(start + self.block_size, self.num_samples))
            rng.shuffle(members)
            yield from members.tolist()


class LengthGroupedSampler(Sampler[list[int]]):
    """Batches of samples of similar length, in a new random order each epoch.

    A batch sampler: samples are shuffled, cut into pools of ``batch_size *
    pool_batches``, sorted by length within a pool and cut into batches, and
    the batches are shuffled, so padding stays small while order stays random.
    ``lengths`` comes from ``MmapDataset.lengths(field)`` (shapes of more than
    one dimension are compared by element count). Every sample appears exactly
    once per epoch; no samples give no batches. With a DataLoader, or without
    worker processes::

        from torch.utils.data import DataLoader
        from npz2mmap import LengthGroupedSampler, MmapDataset, MmapLoader, PaddedCollate

        ds = MmapDataset(path, fields=["tokens", "label"])
        sampler = LengthGroupedSampler(ds.lengths("tokens"), batch_size=32)
        loader = DataLoader(ds, batch_sampler=sampler, collate_fn=PaddedCollate())
        no_workers = MmapLoader(ds, 32, batch_sampler=sampler, collate_fn=PaddedCollate())
    """

    def __init__(
        self,
        lengths: np.ndarray,
        batch_size: int,
        *,
        pool_batches: int = 50,
        drop_last: bool = False,
        seed: int = 0,
    ) -> None:
        if batch_size < 1 or pool_batches < 1:
            raise ValueError("batch_size and pool_batches must be at least 1")
        lengths = np.asarray(lengths)
        self.lengths = lengths.reshape(len(lengths), math.prod(lengths.shape[1:])).prod(axis=1)
        self.batch_size = batch_size
        self.pool = batch_size * pool_batches
        self.drop_last = drop_last
        self.seed = seed
        self.epoch = 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __len__(self) -> int:
        n = len(self.lengths)
        return n // self.batch_size if self.drop_last else -(-n // self.batch_size)

    def __iter__(self) -> Iterator[list[int]]:
        rng = np.random.default_rng((self.seed, self.epoch))
        order = rng.permutation(len(self.lengths))
        batches = []
        for start in range(0, len(order), self.pool):
            pool = order[start : start + self.pool]
            pool = pool[np.argsort(self.lengths[pool], kind="stable")]
            batches += [pool[i : i + self.batch_size] for i in range(0, len(pool), self.batch_size)]
        if self.drop_last:
            batches = [b for b in batches if len(b) == self.batch_size]
        for k in rng.permutation(len(batches)):
            yield batches[k].tolist()
