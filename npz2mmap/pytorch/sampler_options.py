"""The samplers' arguments, checked when a sampler is made, as torch's DistributedSampler
checks its own: counts, switches, lengths, and the world size and rank (given, or from
torch.distributed's process group)."""

from __future__ import annotations

from typing import Any

import numpy as np
import torch.distributed as dist


def checked_lengths(given: Any) -> np.ndarray:
    """``given`` as an integer array of one length or one shape per sample; TypeError or
    ValueError naming what is wrong (a negative, a fraction, a third dimension)."""
    lengths = np.asarray(given)
    if lengths.size == 0 and lengths.ndim in (1, 2):
        return lengths.astype(np.int64)
    if lengths.ndim not in (1, 2):
        raise ValueError(
            f"lengths must be one length (1-d) or one shape (2-d) per sample, not {lengths.ndim}-d"
        )
    if lengths.dtype.kind not in "iu":
        raise TypeError(f"lengths must be integers, as ds.lengths(field) gives, not {lengths.dtype}")
    negative = np.flatnonzero((lengths < 0).any(axis=-1) if lengths.ndim == 2 else lengths < 0)
    if negative.size:
        sample = int(negative[0])
        value = lengths[sample].min() if lengths.ndim == 2 else lengths[sample]
        raise ValueError(f"lengths must be at least 0; sample {sample} has {value}")
    return lengths


def replicas_and_rank(num_replicas: int | None, rank: int | None) -> tuple[int, int]:
    """The world size and rank given, or torch.distributed's, or a single process's."""
    in_group = dist.is_available() and dist.is_initialized()
    rank_given = rank is not None
    if num_replicas is None:
        num_replicas = dist.get_world_size() if in_group else 1
    if rank is None:
        rank = dist.get_rank() if in_group else 0
    for name, value in (("num_replicas", num_replicas), ("rank", rank)):
        if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
            raise ValueError(f"{name} must be an integer, not {value!r}")
    num_replicas, rank = int(num_replicas), int(rank)
    if num_replicas > 1 and not rank_given and not in_group:  # every process would be rank 0
        raise ValueError(
            f"num_replicas={num_replicas} without rank: pass rank= (this process's place in "
            f"0..{num_replicas - 1}), or initialise torch.distributed's process group, which gives both"
        )
    if num_replicas < 1 or not 0 <= rank < num_replicas:
        raise ValueError(f"rank must be in 0..num_replicas-1, got rank {rank} of {num_replicas}")
    return num_replicas, rank


def check_count(name: str, value: Any, minimum: int) -> int:
    """``value`` as an int of at least ``minimum``; ValueError naming ``name`` otherwise (a bool,
    a float, a string are not counts; numpy's integers are)."""
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise ValueError(f"{name} must be an integer >= {minimum}, not {value!r}")
    if value < minimum:
        raise ValueError(f"{name} must be an integer >= {minimum}, not {value}")
    return int(value)


def check_flag(name: str, value: Any) -> bool:
    """``value`` as a bool; ValueError naming ``name`` for anything else ("no" is not False)."""
    if not isinstance(value, (bool, np.bool_)):
        raise ValueError(f"{name} must be True or False, not {value!r}")
    return bool(value)
