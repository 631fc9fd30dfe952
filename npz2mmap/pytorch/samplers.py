"""Samplers that keep shuffled reads of a cold dataset close to sequential."""

from __future__ import annotations

import contextlib
import importlib.util
import math
import os
import sys
import types
import warnings
import zlib
from collections.abc import Callable, Iterable, Iterator
from typing import Any, TypeVar

import numpy as np
import torch
from torch.utils.data import Sampler

from ..errors import SameEpochWarning
from ..read.memory import memory_limit
from .sampler_options import check_count, check_flag, checked_lengths, replicas_and_rank

T = TypeVar("T")


class _Resumable:
    """Epoch, and ``state_dict`` / ``load_state_dict`` to resume mid-epoch.

    The protocol torchdata's ``StatefulDataLoader`` calls (and a training loop
    can call itself): the state is the epoch and how many items the current
    pass has yielded; after ``load_state_dict`` the next pass yields the rest
    of that epoch in the same order, and later passes are whole epochs again.
    As with ``DistributedSampler``, the order is the epoch's: ``set_epoch``
    before each pass gives a new one, and a pass that runs over an epoch
    already run to its end without it warns (SameEpochWarning) once.

    A pass begins at its first item, not at ``iter()``: torch's DataLoader with
    workers makes an iterator it never reads before the one it does. Of two
    passes running at once (a peek, ``next(iter(loader))``, inside a loop), the
    state counts the one that yielded last.
    """

    def __init__(self, seed: int) -> None:
        self.seed = check_count("seed", seed, 0)
        self.epoch = 0
        self._yielded = 0
        self._resume_at = 0
        self._epoch_given = True  # set_epoch or a loaded state since the last pass began
        self._epoch_set: int | None = None  # the epoch set_epoch chose since the last pass began
        self._live_passes = 0  # passes begun and neither run to their end nor closed
        self._live_epoch = 0  # the epoch of the pass begun last
        self._loaded: tuple[int, int] | None = None  # epoch, yielded of a state loaded since a pass began
        self._epoch_done = False  # a pass of self.epoch yielded its every item
        self._warned = False

    def __len__(self) -> int:
        raise NotImplementedError

    def set_epoch(self, epoch: int) -> None:
        """Choose the epoch, whose order the next pass yields (DistributedSampler's convention:
        call it before each epoch). The epoch chosen last before a pass begins decides: a state
        loaded since the last pass began resumes if it is that state's epoch, and nothing
        otherwise (see load_state_dict). The epoch a running pass yields changes nothing, even
        after another: the pass and the state's count of it go on (Lightning sets it after iter())."""
        epoch = check_count("epoch", epoch, 0)
        if self._live_passes and epoch == self._live_epoch and self._loaded is None:
            self.epoch, self._epoch_set = epoch, None  # no epoch chosen for the next pass: none to weigh
            self._epoch_given = False  # counting the running pass again, if another epoch was set
            return
        if epoch != self.epoch:
            self._epoch_done = False
        if self._loaded is not None and epoch == self._loaded[0]:
            self._resume_at = self._loaded[1]  # the loaded state's own epoch: it resumes
        elif epoch != self.epoch:
            self._resume_at = 0
        if not self._live_passes:
            self._yielded = self._resume_at
        self.epoch = self._epoch_set = epoch
        self._epoch_given = True

    def state_dict(self) -> dict[str, Any]:
        """Where the current pass stands: its epoch, seed and items yielded so far, with the
        sampler's kind and the settings that make its order (a state loaded into a sampler of
        another kind or of other settings is refused)."""
        yielded = self._resume_at if self._epoch_given else self._yielded
        return {
            "sampler": type(self).__name__,
            "epoch": self.epoch,
            "seed": self.seed,
            "yielded": yielded,
            **self._order_settings(),
        }

    def next_pass_state(self) -> dict[str, Any]:
        """The state the next pass will begin from, for a loader noting its samplers as a pass
        begins: a resume given, else this epoch from its start."""
        return {**self.state_dict(), "yielded": self._resume_at if self._epoch_given else 0}

    def _order_settings(self) -> dict[str, int]:
        """What besides seed and epoch makes the order; the subclass's."""
        return {}

    def _earlier_settings(self) -> dict[str, int]:
        """The settings a state of an earlier version could only have had where it lacks them
        (the subclass's: those it did not write had one value then)."""
        return {}

    def _always_written(self) -> frozenset[str]:
        """The settings every version of this sampler wrote: a state without one is another's
        (the subclass's)."""
        return frozenset()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Make the next pass continue the saved epoch after its yielded items.

        Raises ValueError for a state this sampler did not write: a missing or
        non-integer epoch, seed or count, entries it does not write, another seed
        or other settings, a count past the epoch's end. A setting a state of an
        earlier version lacks is the one it could only have had then
        (``_earlier_settings``), or else taken as this sampler's.

        Of the calls before a pass, the epoch ``set_epoch`` chose last decides,
        before or after the load: the state resumes if it is that state's
        epoch, and nothing otherwise. torchdata's ``StatefulDataLoader`` loads
        the state only as its next pass starts, after the loop's ``set_epoch``,
        and a state saved at (or just before) an epoch's end then resumes into
        the epoch the loop set, whole, as ``DistributedSampler`` would give it.
        """
        if not isinstance(state, dict):
            raise ValueError(f"sampler state must be a dict, not {type(state).__name__}")
        written = {"sampler", "epoch", "seed", "yielded", *self._order_settings()}
        unknown = sorted(map(str, state.keys() - written))
        if unknown:
            raise ValueError(
                f"sampler state has {', '.join(map(repr, unknown))}, which {type(self).__name__} does not "
                "write (the state of another sampler?); resume with the sampler the state was saved from"
            )
        settings_given = state.keys() & self._order_settings().keys()  # a state some sampler wrote
        lacking = sorted(self._always_written() - state.keys()) if settings_given else []
        if "sampler" not in state and lacking:  # an earlier version's, but not of this kind
            raise ValueError(
                f"sampler state has no {lacking[0]}, which every {type(self).__name__} state holds (the "
                "state of another sampler?); resume with the sampler the state was saved from"
            )
        kind = state.get("sampler", type(self).__name__)  # a state without it: an earlier version's
        if kind != type(self).__name__:
            raise ValueError(
                f"sampler state is a {kind}'s, this sampler is a {type(self).__name__}: resume with the "
                "sampler the state was saved from"
            )
        epoch, seed, yielded = (state_int(state, key) for key in ("epoch", "seed", "yielded"))
        if epoch < 0:
            raise ValueError(f"sampler state: epoch {epoch} is negative")
        if seed != self.seed:
            raise ValueError(f"sampler state has seed {seed}, this sampler has seed {self.seed}")
        earlier = self._earlier_settings()
        for key, value in self._order_settings().items():
            saved = state.get(key, earlier.get(key, value))  # a state without it: an earlier version's
            if saved != value:
                raise ValueError(
                    f"sampler state has {key} {saved!r}, this sampler has {value!r}: its order would be "
                    "another; resume with the sampler the state was saved from"
                )
        if not 0 <= yielded <= len(self):
            raise ValueError(f"sampler state: yielded {yielded} is outside 0..{len(self)}")
        self._loaded = (epoch, yielded)  # resumed if its epoch is the one chosen last before the pass
        if self._epoch_set is not None and self._epoch_set != epoch:
            epoch, yielded = self._epoch_set, 0  # the loop's epoch, from its start
        self.epoch = epoch
        self._yielded = self._resume_at = yielded
        self._epoch_given, self._epoch_done = True, False

    def _pass(self, items_of: Callable[[int, int], Iterable[T]]) -> Iterator[T]:
        """One pass of the epoch, begun at its first item: a pending resume's items skipped, the
        rest counted as they are yielded. ``items_of(epoch, skip)`` gives the epoch's items
        (those before ``skip`` may be left out)."""
        if not self._epoch_given:
            self._resume_at = 0
            if (self._epoch_done or self._yielded >= len(self) > 0) and not self._warned:
                self._warned = True
                warnings.warn(
                    f"{type(self).__name__}: another pass over epoch {self.epoch}, in the same order: "
                    "call sampler.set_epoch(epoch) before each epoch for a new one, as with "
                    "DistributedSampler",
                    SameEpochWarning,
                    stacklevel=_caller_outside_libraries(),  # the user's line that began the pass
                )
        self._epoch_given, self._epoch_set, self._loaded = False, None, None
        self._yielded = count = skip = self._resume_at
        self._resume_at = 0
        self._live_passes += 1
        self._live_epoch = self.epoch
        try:
            for position, item in enumerate(items_of(self.epoch, skip)):
                if position >= skip:
                    count += 1
                    self._yielded = count  # of the pass that yielded last: a peek's iter() does not reset it
                    yield item
            self._epoch_done = True
        finally:
            self._live_passes -= 1


def _library_dirs() -> tuple[str, ...]:
    """The folders of the packages a pass is begun through (a loader's next()), not the user's."""
    dirs = [os.path.dirname(os.path.dirname(os.path.abspath(__file__))), os.path.dirname(torch.__file__)]
    spec = importlib.util.find_spec("torchdata")
    if spec is not None and spec.origin:
        dirs.append(os.path.dirname(spec.origin))
    return tuple(os.path.join(d, "") for d in dirs)


_LIBRARY_DIRS = _library_dirs()


def _caller_outside_libraries() -> int:
    """For warnings.warn in a pass: the stacklevel of the first frame, from the one whose next()
    began the pass up, that is outside npz2mmap, torch and torchdata (a DataLoader's, else)."""
    frame: types.FrameType | None = sys._getframe(2)
    level = 2
    while frame is not None and frame.f_code.co_filename.startswith(_LIBRARY_DIRS):
        frame, level = frame.f_back, level + 1
    return level if frame is not None else 2


class BlockShuffleSampler(_Resumable, Sampler[int]):
    """Shuffle blocks of neighbouring samples, then the samples within each window of blocks.

    Every epoch visits every sample once in a new order: the blocks of
    ``block_size`` neighbours are shuffled, taken ``interleave`` at a time, and
    the samples of those blocks shuffled together, so each batch draws from up
    to ``interleave`` distant places while reads stay inside a window of
    ``interleave * block_size`` samples (the idea of FFCV's quasi-random order
    and LitData's chunk interleaving). Call ``set_epoch`` each epoch.
    Resumable mid-epoch through ``state_dict`` / ``load_state_dict``.

    ``interleave="auto"`` (with ``dataset``) takes as many blocks at a time as
    let two windows of the dataset's average sample fill at most
    ``WINDOW_FRACTION`` of the memory the process may use (the smallest of its
    cgroup's limit and ``MemAvailable``): the most distant places per batch the
    page cache can hold beside everything else; the number chosen is
    ``interleave``, and a state loaded from another machine keeps its own.

    Given the ``dataset`` (an ``MmapDataset``) that reads exactly (it does not
    fit in memory, or ``reads="exact"``), the sampler itself asks for each
    window's blocks whole, one sequential read per block and field, as it
    starts yielding the window before: whichever process iterates it (the
    ``DataLoader``'s main process, ``MmapLoader``), the disk reads at its
    sequential speed, and up to two windows are in the page cache at once.

    Under DDP (``num_replicas``, ``rank``: default from ``torch.distributed``
    once initialised), each rank takes its own contiguous share of the
    epoch's shuffled blocks, so ranks read apart; as with
    ``DistributedSampler``, the first samples of the epoch's shuffled blocks
    (taken before each window's own shuffle) are repeated to fill the last
    share (``drop_last``: the last ones left out).
    """

    def __init__(
        self,
        num_samples: int,
        block_size: int = 1024,
        seed: int = 0,
        *,
        interleave: int | str = 1,
        dataset: Any = None,
        num_replicas: int | None = None,
        rank: int | None = None,
        drop_last: bool = False,
    ) -> None:
        super().__init__(seed)
        self.num_samples = check_count("num_samples", num_samples, 0)
        self.block_size = check_count("block_size", block_size, 1)
        self.auto_interleave = interleave == "auto"
        self.interleave = (
            auto_interleave(dataset, self.block_size)
            if self.auto_interleave
            else check_count("interleave", interleave, 1)
        )
        if dataset is not None and len(dataset) != self.num_samples:
            raise ValueError(
                f"num_samples is {self.num_samples} but the dataset has {len(dataset)} samples: pass len(ds)"
            )
        self.dataset = dataset
        self.drop_last = check_flag("drop_last", drop_last)
        self.num_replicas, self.rank = replicas_and_rank(num_replicas, rank)

    def _order_settings(self) -> dict[str, int]:
        return {
            "num_samples": self.num_samples,
            "block_size": self.block_size,
            "interleave": self.interleave,
            "num_replicas": self.num_replicas,
            "rank": self.rank,
            "drop_last": int(self.drop_last),
        }

    def _earlier_settings(self) -> dict[str, int]:
        # The first version's states wrote only num_samples and block_size: it had no other settings.
        return {"interleave": 1, "num_replicas": 1, "rank": 0, "drop_last": 0}

    def _always_written(self) -> frozenset[str]:
        return frozenset({"num_samples", "block_size"})

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """As ``_Resumable.load_state_dict``; with ``interleave="auto"``, the state's own
        interleave is taken (the memory where it was saved may have chosen another)."""
        saved = state.get("interleave") if isinstance(state, dict) else None
        if self.auto_interleave and isinstance(saved, int) and not isinstance(saved, bool) and saved >= 1:
            self.interleave = saved
        super().load_state_dict(state)

    def __len__(self) -> int:
        return self._share_size()

    def _share_size(self) -> int:
        n, replicas = self.num_samples, self.num_replicas
        return n // replicas if self.drop_last else -(-n // replicas)

    def __iter__(self) -> Iterator[int]:
        return self._pass(self._order)

    def _order(self, epoch: int, skip: int) -> Iterator[int]:
        rng = np.random.default_rng((self.seed, epoch))
        windows = self.windows(rng)
        for k, window in enumerate(windows):
            if k == 0:
                self._read(window)
            if k + 1 < len(windows):
                self._read(windows[k + 1])
            members = np.concatenate([np.arange(start, stop) for start, stop in window])
            rng.shuffle(members)
            yield from members.tolist()

    def windows(self, rng: np.random.Generator) -> list[list[tuple[int, int]]]:
        """This rank's windows of the epoch, in order: each a list of runs [start, stop) of
        neighbouring samples (whole blocks, or pieces of them at the share's edges)."""
        num_blocks = -(-self.num_samples // self.block_size)
        blocks = [
            (int(b) * self.block_size, min((int(b) + 1) * self.block_size, self.num_samples))
            for b in rng.permutation(num_blocks)
        ]
        if self.num_replicas > 1 or self.drop_last:
            blocks = _share_of(blocks, self._share_size(), self.num_replicas, self.rank)
        return [blocks[i : i + self.interleave] for i in range(0, len(blocks), self.interleave)]

    def _read(self, window: list[tuple[int, int]]) -> None:
        """Ask the dataset to read a window's runs whole, if it reads exactly (see the class)."""
        dataset = self.dataset
        if dataset is None or not getattr(dataset, "exact_reads", False):
            return
        indices = np.concatenate([np.arange(start, stop, dtype=np.int64) for start, stop in window])
        with contextlib.suppress(Exception):  # a read ahead is a hint: loading the samples reports errors
            dataset.reader.will_need(dataset.fields, indices)


# interleave="auto" lets two windows take at most this share of the memory the process may use.
WINDOW_FRACTION = 0.25
DEFAULT_INTERLEAVE = 8  # where no limit can be read


def auto_interleave(dataset: Any, block_size: int) -> int:
    """How many blocks of ``block_size`` samples two windows of ``dataset`` may hold within
    WINDOW_FRACTION of the memory this process may use (at least 1, at most every block)."""
    if dataset is None or not hasattr(dataset, "parts"):
        raise ValueError(
            "interleave='auto' sizes the window from the dataset's samples and the memory this "
            "process may use: pass dataset=ds (an MmapDataset), or a number of blocks"
        )
    num_samples = len(dataset)
    num_blocks = max(1, -(-num_samples // block_size))
    limit = memory_limit()
    if limit is None:
        return min(DEFAULT_INTERLEAVE, num_blocks)
    blob_nbytes = sum(index.blob_nbytes for index in dataset.parts.indexes)  # every field: a bound
    sample_nbytes = max(1, blob_nbytes // max(1, num_samples))
    window_budget = int(limit.nbytes * WINDOW_FRACTION) // 2
    return max(1, min(num_blocks, window_budget // (block_size * sample_nbytes)))


def _share_of(blocks: list[tuple[int, int]], share: int, replicas: int, rank: int) -> list[tuple[int, int]]:
    """One rank's runs: the epoch's runs laid end to end, repeated from the start to fill
    ``replicas`` shares (or cut to them), cut at the rank's share."""
    runs: list[tuple[int, int]] = []
    wanted, start_at = share * replicas, share * rank
    position = 0
    while position < start_at + share and blocks:
        for start, stop in blocks:
            lo, hi = max(position, start_at), min(position + stop - start, start_at + share, wanted)
            if lo < hi:
                runs.append((start + lo - position, start + hi - position))
            position += stop - start
            if position >= start_at + share:
                break
    return runs


class ShuffleSampler(_Resumable, Sampler[int]):
    """A full shuffle, as ``DataLoader(shuffle=True)`` or ``DistributedSampler`` draws it,
    that asks for its samples' exact reads ``read_ahead`` samples before it yields them.

    Given an ``MmapDataset`` that reads exactly (it does not fit in memory, or
    ``reads="exact"``), the process iterating the sampler (a ``DataLoader``'s
    main process, or ``MmapLoader``) keeps ``read_ahead`` samples' reads in
    flight, where workers alone could ask for no more than their own batches:
    up to ``read_ahead`` samples of page cache. For any other dataset (or a
    length) it is a plain seeded shuffle. Every epoch (``set_epoch``) is a new
    order of the seed; resumable mid-epoch through ``state_dict`` /
    ``load_state_dict``. Under DDP (``num_replicas``, ``rank``: default from
    ``torch.distributed`` once initialised), ranks share the epoch's order as
    in ``DistributedSampler``: the first samples repeated to fill the last
    share, or the last ones left out with ``drop_last``.
    """

    def __init__(
        self,
        dataset: Any,
        *,
        seed: int = 0,
        read_ahead: int = 512,
        num_replicas: int | None = None,
        rank: int | None = None,
        drop_last: bool = False,
    ) -> None:
        if not isinstance(read_ahead, int) or isinstance(read_ahead, bool) or read_ahead < 0:
            raise ValueError(f"read_ahead must be an int >= 0 (samples), not {read_ahead!r}")
        super().__init__(seed)
        self.dataset = dataset
        num_samples = dataset if isinstance(dataset, int) else len(dataset)
        self.num_samples = check_count("num_samples", num_samples, 0)
        self.read_ahead = read_ahead
        self.drop_last = check_flag("drop_last", drop_last)
        self.num_replicas, self.rank = replicas_and_rank(num_replicas, rank)

    def _order_settings(self) -> dict[str, int]:
        return {
            "num_samples": self.num_samples,
            "num_replicas": self.num_replicas,
            "rank": self.rank,
            "drop_last": int(self.drop_last),
        }

    def __len__(self) -> int:
        n, replicas = self.num_samples, self.num_replicas
        return n // replicas if self.drop_last else -(-n // replicas)

    def __iter__(self) -> Iterator[int]:
        return self._pass(self._order)

    def _order(self, epoch: int, skip: int) -> Iterator[int]:
        rng = np.random.default_rng((self.seed, epoch))
        shuffled = rng.permutation(self.num_samples)
        order = np.resize(shuffled, len(self) * self.num_replicas)[self.rank :: self.num_replicas]
        return self._reading_ahead(order, skip)

    def _reading_ahead(self, order: np.ndarray, skip: int) -> Iterator[int]:
        """The order, each sample's reads asked for ``read_ahead`` samples before it (from ``skip``)."""
        dataset, ahead = self.dataset, self.read_ahead
        if not ahead or not getattr(dataset, "exact_reads", False):
            yield from order.tolist()
            return
        issued = skip
        for position, index in enumerate(order.tolist()):
            if position >= skip and issued < min(position + ahead, len(order)):
                stop = min(max(position + ahead, issued + READ_CHUNK), len(order))
                with contextlib.suppress(Exception):  # a hint: loading the samples reports errors
                    dataset.reader.will_need(dataset.fields, order[issued:stop].astype(np.int64))
                issued = stop
            yield index


READ_CHUNK = 64  # samples whose reads a ShuffleSampler asks for at a time


class LengthGroupedSampler(_Resumable, Sampler[list[int]]):
    """Batches of samples of similar length, in a new random order each epoch.

    A batch sampler: samples are shuffled, cut into pools of ``batch_size *
    pool_batches``, sorted by length within a pool and cut into batches, and
    the batches are shuffled, so padding stays small while order stays random.
    ``lengths`` comes from ``MmapDataset.lengths(field)`` (or, given shapes,
    ``MmapDataset.shapes(field)``, they are compared by element count). Every sample appears exactly
    once per epoch; no samples give no batches.

    Under DDP, as with ``DistributedSampler``: ``num_replicas`` and ``rank``
    (default: from ``torch.distributed`` once initialised, else 1 and 0) give
    each rank an equal share of the epoch's shuffled samples, grouped by
    length on that rank, so every rank has the same number of batches. When
    the sample count does not divide by ``num_replicas``, the first samples of
    the shuffled order are repeated to fill the last share (fewer than
    ``num_replicas`` of them); with ``drop_last`` the last ones are left out
    instead, along with each rank's short batch. Resumable mid-epoch through
    ``state_dict`` / ``load_state_dict`` (per rank). With a
    DataLoader, or without worker processes::

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
        num_replicas: int | None = None,
        rank: int | None = None,
    ) -> None:
        check_count("batch_size", batch_size, 1)
        check_count("pool_batches", pool_batches, 1)
        check_flag("drop_last", drop_last)
        super().__init__(seed)
        lengths = checked_lengths(lengths)
        self.lengths = lengths.reshape(len(lengths), math.prod(lengths.shape[1:])).prod(axis=1)
        self.batch_size = batch_size
        self.pool = batch_size * pool_batches
        self.drop_last = drop_last
        self.num_replicas, self.rank = replicas_and_rank(num_replicas, rank)

    def __len__(self) -> int:
        share = self._share_size()
        return share // self.batch_size if self.drop_last else -(-share // self.batch_size)

    def _order_settings(self) -> dict[str, int]:
        lengths_crc32 = zlib.crc32(np.ascontiguousarray(self.lengths, dtype="<i8").tobytes())
        return {
            "batch_size": self.batch_size,
            "pool": self.pool,
            "drop_last": int(self.drop_last),
            "num_replicas": self.num_replicas,
            "rank": self.rank,
            "lengths_crc32": lengths_crc32,
        }

    def __iter__(self) -> Iterator[list[int]]:
        return self._pass(self._batches)

    def _share_size(self) -> int:
        """How many samples each rank gets per epoch."""
        n = len(self.lengths)
        return n // self.num_replicas if self.drop_last else -(-n // self.num_replicas)

    def _batches(self, epoch: int, skip: int) -> Iterator[list[int]]:
        rng = np.random.default_rng((self.seed, epoch))
        shuffled = rng.permutation(len(self.lengths))
        # Every rank draws the same permutation, so the shares are disjoint.
        order = np.resize(shuffled, self._share_size() * self.num_replicas)[self.rank :: self.num_replicas]
        batches = []
        for start in range(0, len(order), self.pool):
            pool = order[start : start + self.pool]
            pool = pool[np.argsort(self.lengths[pool], kind="stable")]
            batches += [pool[i : i + self.batch_size] for i in range(0, len(pool), self.batch_size)]
        if self.drop_last:
            batches = [b for b in batches if len(b) == self.batch_size]
        for k in rng.permutation(len(batches)):
            yield batches[k].tolist()


def state_int(state: dict[str, Any], key: str, what: str = "sampler state") -> int:
    """One integer entry of a state; ValueError naming ``what`` if missing or not an int."""
    value = state.get(key)
    if type(value) is not int:
        raise ValueError(f"{what}: {key!r} must be an integer, found {value!r}")
    return value
