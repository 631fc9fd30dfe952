"""MmapLoader: batches gathered straight from the mapping, by a thread or by worker processes.

A memory-mapped read needs no decoding, so DataLoader's worker processes add
mostly their cost (every batch handed over through a new shared-memory
segment). This loader gathers each batch in one copy per field from the page
cache into the output tensor, in the training process (or a thread running
ahead of it: numpy copies release the GIL); with ``num_workers``, worker
processes run transforms in parallel and write batches into a shared ring
that the trainer reads without a copy (ring.py, slots.py, workers.py).
"""

from __future__ import annotations

import contextlib
import itertools
import numbers
import queue
import threading
from collections import deque
from collections.abc import Callable, Iterable, Iterator, Sequence
from multiprocessing.context import BaseContext
from typing import Any

import numpy as np
import torch
from numpy.typing import NDArray

from ..errors import FormatError
from ..read.indices import normalise_indices
from ..write.options import check_flags, check_integer
from .batch_plan import BatchPlan, InMemory, plan_batches
from .dataset import MmapDataset
from .padding import PaddedCollate
from .resume import Position, samplers_of
from .ring import RingWorkers
from .slots import aligned, default_slot_nbytes
from .workers import resolve_context, seed_base

_END = object()


class _Failed:
    def __init__(self, error: BaseException) -> None:
        self.error = error


class MmapLoader:
    """Iterate an MmapDataset in batches of torch tensors, without or with worker processes.

    ``shuffle`` draws a new order each epoch from ``seed`` and the epoch
    (``set_epoch`` fixes it, as with DistributedSampler); without ``seed``,
    one is drawn from torch's default generator, as DataLoader draws its own
    (``torch.manual_seed`` before makes the order repeat), and
    ``load_state_dict`` takes the state's; ``sampler`` (any
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
    ``slot_nbytes`` each (rounded up to a multiple of 64); the batches yielded are **views of the ring**: a
    batch stays valid until the next batch is requested from this loader,
    also once it is closed or dropped (``.clone()`` what you keep longer);
    ``pin_memory`` page-locks the ring. A batch that takes longer than
    ``timeout`` seconds (0: no limit) raises WorkerError and stops the
    workers. See ring.py and slots.py.
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
        seed: int | None = None,
        num_workers: int = 0,
        batch_transform: Callable[[Any], Any] | None = None,
        multiprocessing_context: BaseContext | str | None = None,
        slot_nbytes: int | None = None,
        timeout: float = 0,
        read_ahead: int = 4,
    ) -> None:
        if not isinstance(dataset, MmapDataset):
            raise TypeError(
                f"MmapLoader reads an MmapDataset, not a {type(dataset).__name__}: wrap your data in "
                "torch's DataLoader instead, or open the converted dataset with MmapDataset(path)"
            )
        self.seed_given = seed is not None
        if seed is None:  # as DataLoader's: torch.manual_seed decides it, drawn only where it is used
            seed = seed_base() if shuffle is True else 0
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
        for name, value, least in (
            ("batch_size", batch_size, 1),
            ("prefetch", prefetch, 0),
            ("num_workers", num_workers, 0),
            ("read_ahead", read_ahead, 0),
        ):
            if value < least:
                raise ValueError(f"{name} must be at least {least}, got {value}")
        check_flags(shuffle=shuffle, drop_last=drop_last, pin_memory=pin_memory)
        if slot_nbytes is not None and check_integer("slot_nbytes", slot_nbytes) < 1:
            raise ValueError(f"slot_nbytes must be at least 1, got {slot_nbytes}")
        check_timeout(timeout)
        resolve_context(multiprocessing_context)  # checked now, as DataLoader does
        if multiprocessing_context is not None and num_workers == 0:
            raise ValueError(
                "multiprocessing_context is for worker processes, which num_workers=0 does not start: "
                "pass num_workers=1 or more, or leave multiprocessing_context out"
            )
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
        self._position = Position()
        self._pass_running = False

    def __repr__(self) -> str:
        order = [f"shuffle=True, seed={self.seed}"] if self.shuffle else []
        order += [f"{name}={type(value).__name__}" for name, value in self._given_orders()]
        settings = [f"batch_size={self.batch_size}", *order, f"num_workers={self.num_workers}"]
        if self.collate_fn is not None:
            named = getattr(self.collate_fn, "__name__", type(self.collate_fn).__name__)
            settings.append(f"collate_fn={named}")
        return f"MmapLoader({self.dataset!r}, {', '.join(settings)})"

    def _given_orders(self) -> list[tuple[str, Any]]:
        given = (("sampler", self.sampler), ("batch_sampler", self.batch_sampler))
        return [(name, value) for name, value in given if value is not None]

    def set_epoch(self, epoch: int) -> None:
        """Choose the epoch (for the shuffle and the samplers'). Of the calls before a pass, the
        epoch chosen last decides: a loaded state resumes if it is its epoch, and nothing otherwise."""
        self._position.choose_epoch(self, epoch)
        self.epoch = epoch
        for _, sampler in samplers_of(self):  # a BatchSampler's own sampler too
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
        one out of range (see indices.normalise_indices).
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
        return _PassIterator(self._running_pass())

    def _running_pass(self) -> Iterator[Any]:
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
            # Rounded up to whole SLOT_ALIGN units: every slot starts aligned, so does every array in it.
            asked = self.slot_nbytes or default_slot_nbytes(self.dataset, self._largest_batch_size())
            slot_nbytes = aligned(asked)
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

        Raises ValueError for a state this loader did not write, another seed than
        one given to this loader (a loader given none takes the state's), batch
        size, dataset length, shuffle or drop_last (its batches would be other samples),
        and mid-pass over torch's RandomSampler, whose order cannot be drawn again;
        RuntimeError while a pass is running.
        """
        if self._pass_running:  # the running pass would go on, and the next one skip batches
            raise RuntimeError(
                "MmapLoader.load_state_dict during a pass: finish the pass, or leave it (break) and "
                "let the iterator go, before loading a state"
            )
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
        # A field named ragged has the shape given with it, or differs in every dimension.
        declared = {
            name: (None,) * dataset.parts.field(name).ndim if shape is None else shape
            for name, shape in (collate_fn.ragged or {}).items()
            if name in dataset.fields
        }
        collate_fn.check_keys(dataset.fields, {**dataset.ragged_fields, **declared})


MAX_TIMEOUT_S = 10**7  # about 4 months: more than any wait a platform's clock and selectors take


def check_timeout(timeout: object) -> None:
    """TypeError unless ``timeout`` is a real number, ValueError unless 0 <= timeout <= MAX_TIMEOUT_S."""
    if isinstance(timeout, bool) or not isinstance(timeout, numbers.Real):
        raise TypeError(f"timeout must be a number of seconds (0: no limit), not {timeout!r}")
    if not 0 <= float(timeout) <= MAX_TIMEOUT_S:
        raise ValueError(f"timeout must be from 0 to {MAX_TIMEOUT_S:,} seconds (0: no limit), got {timeout}")


class _PassIterator:
    """A pass's batches. After an error in one, the pass has ended: ``next`` says so, where a
    generator would raise StopIteration and a loop that caught the error would end its epoch
    early without a word (torch's DataLoader goes on with the next batch)."""

    def __init__(self, batches: Iterator[Any]) -> None:
        self._batches = batches
        self._ended_at: str | None = None

    def __iter__(self) -> _PassIterator:
        return self

    def __next__(self) -> Any:
        if self._ended_at is not None:
            raise RuntimeError(
                f"MmapLoader: this pass ended at an error ({self._ended_at}) and does not go on after "
                "one: catch the error inside the transform or collate_fn, or begin a new pass"
            )
        try:
            return next(self._batches)
        except StopIteration:
            raise
        except Exception as exc:
            self._ended_at = f"{type(exc).__name__}: {exc}"
            raise

    def close(self) -> None:
        """End the pass now, as a generator's close does."""
        close = getattr(self._batches, "close", None)
        if close is not None:
            close()
