"""MmapLoader: batches gathered straight from the mapping, by a thread or by worker processes.

A memory-mapped read needs no decoding, so DataLoader's worker processes add
mostly their cost (every batch handed over through a new shared-memory
segment). This loader gathers each batch in one copy per field from the page
cache into the output tensor, in the training process (or a thread running
ahead of it: numpy copies release the GIL); with ``num_workers``, worker
processes run transforms in parallel and write batches into a shared ring
that the trainer reads without a copy (ring.py).
"""

from __future__ import annotations

import contextlib
import itertools
import numbers
import queue
import threading
import zlib
from collections import deque
from collections.abc import Callable, Iterable, Iterator, Sequence
from multiprocessing.context import BaseContext
from typing import Any

import numpy as np
import torch
from numpy.typing import NDArray
from torch.utils.data import (
    BatchSampler,
    DistributedSampler,
    RandomSampler,
    SubsetRandomSampler,
    WeightedRandomSampler,
)

from ..errors import FormatError
from ..read.reader import normalise_indices
from .batch_plan import BatchPlan, InMemory, plan_batches
from .dataset import MmapDataset
from .padding import PaddedCollate
from .ring import RingWorkers
from .samplers import _state_int
from .slots import default_slot_nbytes
from .workers import resolve_context

_END = object()


class _Failed:
    def __init__(self, error: BaseException) -> None:
        self.error = error


class MmapLoader:
    """Iterate an MmapDataset in batches of torch tensors, without or with worker processes.

    ``shuffle`` draws a new order each epoch from ``seed`` and the epoch
    (``set_epoch`` fixes it, as with DistributedSampler); ``sampler`` (any
    iterable of indices, e.g. a DistributedSampler or BlockShuffleSampler)
    replaces both, and ``batch_sampler`` (e.g. LengthGroupedSampler) replaces
    the batching too (``batch_size`` is then unused; ``shuffle``, ``sampler`` or
    ``drop_last`` with it, or ``shuffle`` with ``sampler``, is a ValueError, as
    DataLoader has it). ``collate_fn`` (e.g. PaddedCollate) turns each gathered
    batch into the output instead, and ``batch_transform`` then maps each batch.

    With ``num_workers=0``, ``prefetch`` batches are prepared ahead by a background
    thread; with 0 there is no thread and each batch is gathered when asked
    for (fastest when nothing else runs between batches). ``pin_memory``
    gathers into page-locked memory where CUDA is available (ignored otherwise).

    With ``num_workers=N``, N processes (started on first iteration with
    ``multiprocessing_context``, kept across epochs until ``close()``) write
    batches into a shared ring of ``max(N * prefetch, N + 1)`` slots of
    ``slot_nbytes`` each; the batches yielded are **views of the ring**: a
    batch stays valid until the next batch is requested from this loader,
    also once it is closed or dropped (``.clone()`` what you keep longer);
    ``pin_memory`` page-locks the ring. A batch that takes longer than
    ``timeout`` seconds (0: no limit) raises WorkerError and stops the
    workers. See ring.py.
    ``state_dict`` / ``load_state_dict`` resume a pass mid-way, with or without workers.

    When the dataset reads exactly (``MmapDataset(reads=)``: by default when it
    does not fit in memory), the reads of the ``read_ahead`` batches after the
    one being handed to a worker or gathered are issued ahead, every sample's
    exact byte ranges at once, so the disk works while batches are consumed;
    they take up to ``read_ahead`` batches of page cache (0: none ahead).
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
        num_workers: int = 0,
        batch_transform: Callable[[Any], Any] | None = None,
        multiprocessing_context: BaseContext | str | None = None,
        slot_nbytes: int | None = None,
        timeout: float = 0,
        read_ahead: int = 4,
    ) -> None:
        for name, value in (
            ("batch_size", batch_size),
            ("read_ahead", read_ahead),
            ("seed", seed),
            ("prefetch", prefetch),
            ("num_workers", num_workers),
        ):
            if not isinstance(value, numbers.Integral) or isinstance(value, (bool, np.bool_)):
                raise TypeError(f"{name} must be an int, not {value!r}")
        if seed < 0:
            raise ValueError(
                f"seed must be at least 0 (numpy's generators take no negative seed), got {seed}"
            )
        if batch_size < 1 or prefetch < 0 or num_workers < 0 or read_ahead < 0:
            raise ValueError("batch_size must be at least 1, prefetch, num_workers and read_ahead at least 0")
        if slot_nbytes is not None and slot_nbytes < 1:
            raise ValueError(f"slot_nbytes must be at least 1, got {slot_nbytes}")
        check_timeout(timeout)
        check_collate_keys(dataset, collate_fn)
        check_order_options(shuffle, sampler, batch_sampler, drop_last)
        self.dataset = dataset
        self.batch_size = batch_size
        self.shuffle = shuffle
        self.sampler = sampler
        self.batch_sampler = batch_sampler
        self.collate_fn = collate_fn
        self.batch_transform = batch_transform
        self.drop_last = drop_last
        self.prefetch = prefetch
        self.pin_memory = pin_memory and torch.cuda.is_available()
        self.seed = seed
        self.epoch = 0
        self.num_workers = num_workers
        self.multiprocessing_context = multiprocessing_context
        self.slot_nbytes = slot_nbytes
        self.timeout = timeout
        self.read_ahead = read_ahead
        self._workers: RingWorkers | None = None
        self._position = _Position()
        self._pass_running = False

    def set_epoch(self, epoch: int) -> None:
        """Choose the epoch (for the shuffle and the samplers'); another epoch drops a pending resume."""
        if epoch != self.epoch:
            self._position.resume_at, self._position.loaded = 0, None
        self.epoch = epoch
        for _, sampler in _samplers(self):  # a BatchSampler's own sampler too
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
            batches = iter(self.batch_sampler)
            self._position.note_sampler_states(self)
            yield from (normalise_indices(batch, num_samples) for batch in batches)
            return
        for batch in self._batches_of_order(num_samples):
            if self.drop_last and len(batch) < self.batch_size:
                return
            yield normalise_indices(batch, num_samples)

    def _batches_of_order(self, num_samples: int) -> Iterator[Sequence[int] | NDArray[np.int64]]:
        """This epoch's order cut into batch-sized pieces, the last one maybe shorter."""
        if self.sampler is not None:
            indices = iter(self.sampler)
            self._position.note_sampler_states(self)
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
        if self._pass_running:  # one position (and with workers one ring), so one pass at a time
            raise RuntimeError("MmapLoader runs one pass at a time: finish or close the other iterator first")
        self._pass_running = True
        try:
            yield from self._pass()
        finally:
            self._pass_running = False

    def _pass(self) -> Iterator[Any]:
        """One pass: the batches after those a loaded state had yielded, counted as they go."""
        position = self._position
        skip = position.start(self)
        # Batches already yielded before a resume are skipped as indices, never loaded.
        indices: Iterator[NDArray[np.int64]] = itertools.islice(self.index_batches(), skip, None)
        if self.dataset.exact_reads and self.read_ahead:
            indices = reads_issued_ahead(indices, self.dataset, self.read_ahead)
        if self.num_workers > 0:
            batches = self._from_workers(indices)
        elif self.prefetch == 0:
            batches = (self.load(batch) for batch in indices)
        else:
            batches = self._prefetched(indices)
        try:
            for batch in batches:
                position.batches_yielded += 1
                yield batch
            position.finish(self)
        finally:
            batches.close()  # type: ignore[attr-defined]
            if self.sampler is None and self.batch_sampler is None and self.shuffle:
                self.epoch += 1

    def _prefetched(self, indices: Iterator[NDArray[np.int64]]) -> Iterator[Any]:
        batches: queue.Queue[Any] = queue.Queue(maxsize=self.prefetch)
        stop = threading.Event()
        thread = threading.Thread(target=self._produce, args=(indices, batches, stop), daemon=True)
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

    def _produce(
        self, indices: Iterator[NDArray[np.int64]], batches: queue.Queue[Any], stop: threading.Event
    ) -> None:
        try:
            for batch in indices:
                if stop.is_set():
                    return
                batches.put(self.load(batch))
            batches.put(_END)
        except BaseException as exc:  # handed to the consuming thread, which re-raises it
            batches.put(_Failed(exc))

    def load(self, indices: np.ndarray) -> Any:
        """One batch, in this process: each fixed field gathered straight into its output tensor."""
        return self._plan().make(indices, InMemory(self.pin_memory))

    def _plan(self) -> BatchPlan:
        return plan_batches(self.dataset, self.collate_fn, self.batch_transform)

    def _from_workers(self, indices: Iterator[NDArray[np.int64]]) -> Iterator[Any]:
        workers = self._start_workers()
        try:
            yield from workers.batches(indices, self._position.batches_yielded)
        finally:
            if workers.closed:  # a dead worker or Ctrl-C stopped them; the next pass starts new ones
                self._workers = None

    def _start_workers(self) -> RingWorkers:
        if self._workers is None:
            plan = self._plan()
            num_slots = max(self.num_workers * self.prefetch, self.num_workers + 1)
            slot_nbytes = self.slot_nbytes or default_slot_nbytes(self.dataset, self._largest_batch_size())
            context = resolve_context(self.multiprocessing_context)
            self._workers = RingWorkers(
                plan, self.num_workers, num_slots, slot_nbytes, context, self.pin_memory, self.timeout
            )
        return self._workers

    def _largest_batch_size(self) -> int:
        """The batch size slots are sized for: a batch_sampler's own ``batch_size`` when it says one."""
        said = getattr(self.batch_sampler, "batch_size", None)
        if isinstance(said, int) and not isinstance(said, bool) and said >= 1:
            return said
        return self.batch_size

    def close(self) -> None:
        """Stop the worker processes (they start again on the next iteration); a no-op without."""
        workers, self._workers = self._workers, None
        if workers is not None:
            workers.close()

    def __enter__(self) -> MmapLoader:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def state_dict(self) -> dict[str, Any]:
        """Where iteration stands: epoch, seed and batches yielded of the current pass.

        Taken inside the loop (or after leaving it early), ``load_state_dict``
        of it makes the next pass yield exactly the batches after the last one
        yielded; taken between passes, the next pass starts its epoch from the
        beginning. Samplers with a ``state_dict`` are saved as they stood when
        the pass began (between passes: as the next pass will begin them).
        """
        return self._position.state(self)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Resume from a state_dict: the next pass skips the batches already yielded, loading none.

        Raises ValueError for a state this loader did not write, another seed, batch
        size, dataset length, shuffle or drop_last (its batches would be other samples),
        and mid-pass over torch's RandomSampler, whose order cannot be drawn again.
        """
        self._position.load(self, state)


def reads_issued_ahead(
    batches: Iterator[NDArray[np.int64]], dataset: MmapDataset, ahead: int
) -> Iterator[NDArray[np.int64]]:
    """``batches`` as they come, each one's exact reads issued ``ahead`` batches before its turn.

    A batch the reader refuses (a bad table) is not read ahead: loading it raises in its
    turn, as an error of the order itself does, after the batches before it.
    """
    reader = dataset.reader
    window: deque[NDArray[np.int64]] = deque()
    failed: Exception | None = None  # raised once the batches before it are out
    try:
        for batch in batches:
            with contextlib.suppress(FormatError, IndexError):
                reader.will_need(dataset.fields, batch)
            window.append(batch)
            if len(window) > ahead:
                yield window.popleft()
    except Exception as exc:
        failed = exc
    yield from window
    if failed is not None:
        raise failed


def check_order_options(shuffle: bool, sampler: Any, batch_sampler: Any, drop_last: bool) -> None:
    """ValueError for options that would be ignored, as DataLoader refuses them: ``sampler``
    replaces ``shuffle``; ``batch_sampler`` replaces ``sampler``, ``shuffle`` and ``drop_last``."""
    if batch_sampler is not None and (sampler is not None or shuffle or drop_last):
        raise ValueError(
            "batch_sampler makes the batches: it cannot be used with sampler, shuffle or drop_last"
        )
    if sampler is not None and shuffle:
        raise ValueError(
            "sampler gives the order: it cannot be used with shuffle=True (shuffle in the sampler)"
        )


def check_collate_keys(dataset: MmapDataset, collate_fn: Callable[[Any], Any] | None) -> None:
    """ValueError now, before any batch, if a PaddedCollate would put two things under one key.

    Without a transform, the dataset's fields are the batch's; with one, the
    first batch tells.
    """
    if isinstance(collate_fn, PaddedCollate) and dataset.transform is None:
        said = collate_fn.ragged
        collate_fn.check_keys(dataset.fields, dataset.ragged_fields if said is None else said)


class _Position:
    """Where the loader stands in its current pass, for state_dict and resuming."""

    def __init__(self) -> None:
        self.pass_epoch: int | None = None  # None: no pass begun and left unfinished
        self.batches_yielded = 0
        self.sampler_states: dict[str, Any] = {}
        self.resume_at = 0
        self.loaded: dict[str, Any] | None = None
        # Per sampler, after a finished pass: its state then, and as that pass began.
        self.ended_sampler_states: dict[str, tuple[Any, Any]] = {}

    def start(self, loader: MmapLoader) -> int:
        """Begin a pass; return how many batches it skips (those a loaded state had yielded).

        A sampler given another epoch since the state was loaded (``sampler.set_epoch``, as
        ``loader.set_epoch`` does) drops the resume: its pass is a whole new epoch.
        """
        skip = self.resume_at if self.loaded is None or not _samplers_moved(loader, self.loaded) else 0
        self.resume_at, self.loaded = 0, None
        self.pass_epoch, self.batches_yielded, self.sampler_states = loader.epoch, skip, {}
        return skip

    def finish(self, loader: MmapLoader) -> None:
        """The pass is over: remember the samplers' states at its start and end (see ``state``)."""
        self.pass_epoch, self.batches_yielded = None, 0
        self.ended_sampler_states = {
            key: (sampler.state_dict(), self.sampler_states.get(key))
            for key, sampler in _samplers(loader)
            if hasattr(sampler, "state_dict")
        }

    def note_sampler_states(self, loader: MmapLoader) -> None:
        """The samplers' states as this pass begins (they have just been iterated from the start);
        of a sampler with no state of its own but an epoch (DistributedSampler), that epoch."""
        for key, sampler in _samplers(loader):
            state = _sampler_state(sampler)
            if state is not None:
                self.sampler_states[key] = state

    def state(self, loader: MmapLoader) -> dict[str, Any]:
        if self.loaded is not None:
            return dict(self.loaded)
        if self.pass_epoch is None:
            return {
                "epoch": loader.epoch,
                "seed": loader.seed,
                "batches_yielded": 0,
                **_settings(loader),
                **self._next_pass_sampler_states(loader),
            }
        return {
            "epoch": self.pass_epoch,
            "seed": loader.seed,
            "batches_yielded": self.batches_yielded,
            **_settings(loader),
            **self.sampler_states,
        }

    def _next_pass_sampler_states(self, loader: MmapLoader) -> dict[str, Any]:
        """Between passes, each sampler's state as the next pass will begin it.

        A sampler untouched since it finished a pass begins the next one as it
        began that one (its own state counts the items it yielded); one given
        another epoch or state since then says so itself.
        """
        states = {}
        for key, sampler in _samplers(loader):
            if hasattr(sampler, "state_dict"):
                now = sampler.state_dict()
                at_end, at_start = self.ended_sampler_states.get(key, (None, None))
                states[key] = at_start if at_start is not None and now == at_end else now
            elif (state := _sampler_state(sampler)) is not None:
                states[key] = state
        return states

    def load(self, loader: MmapLoader, state: dict[str, Any]) -> None:
        if not isinstance(state, dict):
            raise ValueError(f"loader state must be a dict, not {type(state).__name__}")
        epoch, seed, batches_yielded = (
            _state_int(state, key, "loader state") for key in ("epoch", "seed", "batches_yielded")
        )
        unknown = sorted(map(str, state.keys() - _STATE_KEYS - {key for key, _ in _samplers(loader)}))
        if unknown:
            raise ValueError(
                f"loader state has {', '.join(map(repr, unknown))}, which this loader does not write "
                "(a state of another loader, or of other samplers); resume with the loader it was saved from"
            )
        if seed != loader.seed:
            raise ValueError(f"loader state has seed {seed}, this loader has seed {loader.seed}")
        if epoch < 0:
            raise ValueError(f"loader state: epoch {epoch} is negative")
        if batches_yielded < 0:
            raise ValueError(f"loader state: batches_yielded {batches_yielded} is negative")
        if batches_yielded:
            _refuse_unrepeatable_samplers(loader)
        _check_same_settings(loader, state)
        _check_within_the_pass(loader, batches_yielded)
        loader.epoch = epoch
        for key, sampler in _samplers(loader):
            if key in state and hasattr(sampler, "load_state_dict"):
                sampler.load_state_dict(state[key])  # its own epoch and position
            elif hasattr(sampler, "set_epoch"):  # DistributedSampler: its order is the epoch's
                saved = state.get(key)
                sampler_epoch = saved.get("epoch") if isinstance(saved, dict) else None
                sampler.set_epoch(sampler_epoch if type(sampler_epoch) is int else epoch)
        self.resume_at, self.loaded = batches_yielded, dict(state)


def _check_within_the_pass(loader: MmapLoader, batches_yielded: int) -> None:
    """ValueError for a state past the end of its pass (where the loader knows its length)."""
    with contextlib.suppress(TypeError):  # a sampler of no length
        batches = len(loader)
        if batches_yielded > batches:
            raise ValueError(
                f"loader state: batches_yielded {batches_yielded} is past the end of a pass of "
                f"{batches} batches; resume with the loader the state was saved from"
            )


# What a loader's state holds besides its samplers' states (saved under _samplers' keys).
_STATE_KEYS = {"epoch", "seed", "batches_yielded", "batch_size", "num_samples", "shuffle", "drop_last"} | {
    "sampler_settings"
}


def _sampler_state(sampler: Any) -> dict[str, Any] | None:
    """A sampler's state to save: its own, or for one with only an epoch, ``{"epoch": e}``."""
    if hasattr(sampler, "state_dict"):
        return sampler.state_dict()
    epoch = getattr(sampler, "epoch", None)
    return {"epoch": epoch} if hasattr(sampler, "set_epoch") and type(epoch) is int else None


def _samplers_moved(loader: MmapLoader, loaded: dict[str, Any]) -> bool:
    """Whether a sampler's epoch differs from the one the loaded state gave it."""
    for key, sampler in _samplers(loader):
        saved, now = loaded.get(key), _sampler_state(sampler)
        if isinstance(saved, dict) and isinstance(now, dict) and saved.get("epoch") != now.get("epoch"):
            return True
    return False


# What a state's batches mean: a state loaded into a loader of other settings would skip other samples.
_SETTINGS = ("batch_size", "num_samples", "shuffle", "drop_last")


def _settings(loader: MmapLoader) -> dict[str, Any]:
    return {
        "batch_size": loader.batch_size,
        "num_samples": len(loader.dataset),
        "shuffle": loader.shuffle,
        "drop_last": loader.drop_last,
        # a BatchSampler's own sampler is in its settings already (states of earlier versions lack it)
        "sampler_settings": {
            key: sampler_settings(sampler)
            for key, sampler in _samplers(loader)
            if key != "batch_sampler.sampler"
        },
    }


def sampler_settings(sampler: Any) -> dict[str, Any]:
    """What makes a sampler's order, as far as can be seen from outside: its type, a
    DistributedSampler's world, rank, seed, shuffle and drop_last, a BatchSampler's batch size
    (and its sampler's), a sequence's length and a checksum of its indices, another's length.
    A sampler with a state_dict of its own names its settings there."""
    out: dict[str, Any] = {"type": type(sampler).__name__}
    if isinstance(sampler, BatchSampler):
        out.update(batch_size=sampler.batch_size, drop_last=sampler.drop_last)
        out["sampler"] = sampler_settings(sampler.sampler)
    elif isinstance(sampler, DistributedSampler):
        out.update(num_replicas=sampler.num_replicas, rank=sampler.rank, seed=sampler.seed)
        out.update(shuffle=sampler.shuffle, drop_last=sampler.drop_last, length=len(sampler))
    elif hasattr(sampler, "state_dict"):
        pass
    elif isinstance(sampler, (Sequence, np.ndarray, torch.Tensor)) and not isinstance(sampler, (str, bytes)):
        with contextlib.suppress(TypeError, ValueError, OverflowError):  # indices of another kind
            values = np.asarray(sampler, dtype=np.int64)
            out.update(length=len(values), crc32=zlib.crc32(values.astype("<i8").tobytes()))
    elif hasattr(sampler, "__len__"):
        with contextlib.suppress(TypeError):
            out["length"] = len(sampler)
    return out


def _check_same_settings(loader: MmapLoader, state: dict[str, Any]) -> None:
    """ValueError when the state was saved by a loader of other settings, or over samplers of
    other settings (a state without them, from an earlier version, is taken as it is)."""
    for key, value in _settings(loader).items():
        if key == "sampler_settings" and key in state:
            _check_same_samplers(state[key], value)
        elif key in state and state[key] != value:
            raise ValueError(
                f"loader state has {key} {state[key]!r}, this loader has {value!r}: its batches would be "
                "other samples; resume with the loader the state was saved from"
            )


def _check_same_samplers(saved: Any, now: dict[str, Any]) -> None:
    if not isinstance(saved, dict):
        raise ValueError(f"loader state: 'sampler_settings' must be a dict, found {saved!r}")
    for key in sorted(saved.keys() | now.keys()):
        was, is_now = saved.get(key), now.get(key)
        if was != is_now:
            raise ValueError(
                f"loader state was saved over {_described(key, was)}, this loader has "
                f"{_described(key, is_now)}: its batches would be other samples; resume with the "
                "sampler the state was saved with"
            )


def _described(key: str, settings: Any) -> str:
    if not isinstance(settings, dict):
        return f"no {key}"
    shown = ", ".join(f"{k}={v!r}" for k, v in settings.items() if k != "type")
    return f"{key}={settings.get('type')}({shown})"


# torch's samplers that draw a new order each pass and keep no state: a resume cannot continue one.
_RANDOM_SAMPLERS = (RandomSampler, SubsetRandomSampler, WeightedRandomSampler)


def _refuse_unrepeatable_samplers(loader: MmapLoader) -> None:
    """ValueError for a mid-pass resume over a sampler whose order cannot be drawn again."""
    for _, sampler in _samplers(loader):
        inner = getattr(sampler, "sampler", sampler)  # a BatchSampler's
        for candidate in (sampler, inner):
            if isinstance(candidate, _RANDOM_SAMPLERS) and not hasattr(candidate, "state_dict"):
                raise ValueError(
                    f"{type(candidate).__name__} draws a new order each pass and keeps no state, so a resume "
                    "mid-pass cannot continue its order: use shuffle=True (with seed=), BlockShuffleSampler, "
                    "or a sampler with state_dict() (torchdata's StatefulDataLoader has such samplers)"
                )


def _samplers(loader: MmapLoader) -> list[tuple[str, Any]]:
    """The loader's samplers by the key their state is saved under: its sampler or batch sampler,
    and a torch BatchSampler's own sampler (whose epoch and state make the batches' order)."""
    found = [
        (key, s)
        for key, s in (("sampler", loader.sampler), ("batch_sampler", loader.batch_sampler))
        if s is not None
    ]
    if isinstance(loader.batch_sampler, BatchSampler):
        found.append(("batch_sampler.sampler", loader.batch_sampler.sampler))
    return found


MAX_TIMEOUT_S = 10**7  # about 4 months: more than any wait a platform's clock and selectors take


def check_timeout(timeout: object) -> None:
    """TypeError unless ``timeout`` is a real number, ValueError unless 0 <= timeout <= MAX_TIMEOUT_S."""
    if isinstance(timeout, bool) or not isinstance(timeout, numbers.Real):
        raise TypeError(f"timeout must be a number of seconds (0: no limit), not {timeout!r}")
    if not 0 <= float(timeout) <= MAX_TIMEOUT_S:
        raise ValueError(f"timeout must be from 0 to {MAX_TIMEOUT_S:,} seconds (0: no limit), got {timeout}")
