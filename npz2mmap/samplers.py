"""Samplers that keep shuffled reads of a cold dataset close to sequential."""

from __future__ import annotations

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
