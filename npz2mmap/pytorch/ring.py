"""The trainer's side of MmapLoader's worker ring (RingWorkers): which slot each batch goes to,
the tasks sent to the workers in order, and the batches handed out as views of their slots.

Torch's DataLoader moves every batch from a worker through a fresh
shared-memory segment whose handle crosses a socket; for data that needs no
decoding that hand-off costs more than the work. Here the loader allocates
one shared block of ``num_slots`` slots once (``slots.py``: ``Ring``,
``RingBlock``); a worker (``workers.py``) writes its batch straight into the
slot it is given and sends back a small descriptor (dtype, shape, offset,
strides per tensor), and the trainer hands out tensors that are views of the
slot. The block is unmapped in the trainer only once no tensor views it any
more, so a batch kept past its loader's end is never overwritten by another ring.
"""

from __future__ import annotations

import os
import pickle
import traceback
import warnings
import weakref
from collections import deque
from collections.abc import Callable, Iterator
from multiprocessing.context import BaseContext
from typing import Any

import numpy as np
import torch

from ..errors import WorkerError
from .batch_plan import BatchPlan
from .leaves import is_bare_layout
from .slots import Ring, pin_ring
from .workers import WorkerPool, pickled_or_none, seed_base, worker_failure

# Leaving a pass early waits this long at most (or ``timeout``) for the batches in flight, then
# stops the workers: a stuck one must not hang a loop the user has left (the next pass restarts them).
DRAIN_TIMEOUT_S = 10.0


class RingWorkers:
    """The trainer's side: batches sent to the workers round robin, yielded in order as slot views.

    A batch stays valid until the next one is requested: only then is its
    slot given to another batch. The workers and the ring live until
    ``close()``, or until this object is dropped (a finalizer closes them).
    """

    def __init__(
        self,
        plan: BatchPlan,
        num_workers: int,
        num_slots: int,
        slot_nbytes: int,
        context: BaseContext,
        pin_memory: bool,
        timeout: float = 0,
    ) -> None:
        self.timeout = timeout  # seconds a batch may take (0: no limit)
        self.pool = WorkerPool(plan, num_workers, num_slots, slot_nbytes, context, seed_base())
        unpin = None
        try:
            unpin = pin_ring(self.pool.ring) if pin_memory else None
        except BaseException:
            self.pool.close()
            raise
        self._finalizer = weakref.finalize(self, _close, self.pool, unpin)
        self.pinned = unpin is not None
        # Slots no batch in hand or in flight uses, each with the event its reuse waits for.
        self._free: deque[tuple[int, Any]] = deque((slot, None) for slot in range(num_slots))
        self.warned_overflow = False
        self.busy = False
        self._layouts: dict[int, tuple[bytes, Any]] = {}  # per slot: the last layout's bytes and its tree
        self._next_worker = 0

    @property
    def closed(self) -> bool:
        return not self._finalizer.alive

    def close(self) -> None:
        self._finalizer()

    def batches(self, indices: Iterator[np.ndarray], first_number: int) -> Iterator[Any]:
        """Load ``indices`` through the workers; yield each batch, in order, as views of its slot.

        A worker's exception is raised as WorkerError once the batches before
        it are yielded, and the workers stay; a worker's death, Ctrl-C or any
        other exception stops them. Leaving early lets the batches in flight
        finish (so their slots are free for the next pass).
        """
        self.busy = True
        try:
            yield from self._batches(indices, first_number)
        finally:
            self.busy = False

    def _batches(self, indices: Iterator[np.ndarray], first_number: int) -> Iterator[Any]:
        free = self._free
        in_flight: deque[tuple[int, int, int, np.ndarray]] = deque()
        numbered = enumerate(indices, start=first_number)
        deferred: list[BaseException] = []  # an error of the index order, raised in its turn
        failure: WorkerError | None = None
        held: int | None = None
        try:
            while True:
                self._dispatch(numbered, free, in_flight, deferred)
                if not in_flight:
                    break
                number, slot, worker, batch_indices = in_flight.popleft()
                reply = self._opened(self.pool.receive(worker, number, self.timeout), slot)
                held = slot
                if reply[0] == "error":
                    self._drain(in_flight)
                    failure = worker_failure(worker, number, batch_indices, reply)
                    break
                yield reply[2]
                # The next batch is requested: this one's slot may be reused, once the
                # device has copied it when pinned (the copy may still be queued).
                free.append((slot, self._gpu_mark()))
                held = None
        except GeneratorExit:
            self._drain(in_flight)
            raise
        except BaseException:
            self.close()
            raise
        finally:
            if held is not None:
                free.append((held, self._gpu_mark()))
        if failure is not None:
            raise failure
        if deferred:
            raise deferred[0]

    def _dispatch(
        self,
        numbered: Iterator[tuple[int, np.ndarray]],
        free: deque[tuple[int, Any]],
        in_flight: deque[tuple[int, int, int, np.ndarray]],
        deferred: list[BaseException],
    ) -> None:
        while free and not deferred:
            mark = free[0][1]
            if mark is not None and not mark.query():
                if in_flight:
                    return  # try again at the next request
                mark.synchronize()
            try:
                number, batch_indices = next(numbered)
            except StopIteration:
                return
            except Exception as exc:
                deferred.append(exc)
                return
            slot, _ = free.popleft()
            worker = self._next_worker
            self._next_worker = (worker + 1) % self.pool.num_workers
            self.pool.send(worker, number, slot, batch_indices)
            in_flight.append((number, slot, worker, batch_indices))

    def _gpu_mark(self) -> Any:
        """A CUDA event after every copy queued so far, when the ring is pinned (else None).

        A slot is refilled only once its event has passed, so a
        ``.to(device, non_blocking=True)`` of a batch is never overwritten.
        """
        if not self.pinned:
            return None
        event = torch.cuda.Event()
        event.record()
        return event

    def _opened(self, reply: tuple[Any, ...], slot: int) -> tuple[Any, ...]:
        """("batch", number, batch) from a worker's reply, or an error reply.

        A batch the trainer cannot unpickle becomes an error reply too, so it
        is reported as the worker's other errors are (and the workers stay).
        """
        if reply[0] == "error":
            return reply
        try:
            return ("batch", reply[1], self._batch_of(reply, slot))
        except Exception as exc:
            text = f"(unpickling the batch in the trainer)\n{traceback.format_exc()}"
            return ("error", reply[1], pickled_or_none(exc), text)

    def _batch_of(self, reply: tuple[Any, ...], slot: int) -> Any:
        if reply[0] == "slot":
            return self.pool.ring.materialise(slot, self._tree_of(slot, reply[2]))
        _, number, layout, data = reply
        own = Ring.private(len(data))
        own.bytes_np[:] = np.frombuffer(data, dtype=np.uint8)
        batch = own.materialise(0, pickle.loads(layout))
        if not self.warned_overflow:
            self.warned_overflow = True
            warnings.warn(
                f"MmapLoader: batch {number} needs {len(data)} bytes, more than a ring slot's "
                f"{self.pool.ring.slot_nbytes}; such batches go through a pipe, copied (slower): "
                "pass a larger slot_nbytes",
                RuntimeWarning,
                stacklevel=5,
            )
        return batch

    def _tree_of(self, slot: int, layout: bytes) -> Any:
        """The descriptor tree of ``layout``, unpickled only when it differs from the slot's last one.

        Only a bare layout is kept for reuse: a tree holding values that
        travelled pickled (a dataclass, a masked array, a tensor subclass) is
        unpickled anew for every batch, since those values are handed out as
        they are and the user may change them in place.
        """
        seen = self._layouts.get(slot)
        if seen is not None and seen[0] == layout:
            return seen[1]
        tree = pickle.loads(layout)
        if is_bare_layout(tree):
            self._layouts[slot] = (layout, tree)
        else:
            self._layouts.pop(slot, None)
        return tree

    def _drain(self, in_flight: deque[tuple[int, int, int, np.ndarray]]) -> None:
        """Wait for the batches in flight, dropping them; a dead or stuck worker stops the workers instead."""
        if self.closed:  # the loader was closed with this pass still open: nothing is in flight any more
            return
        try:
            while in_flight:
                number, slot, worker, _ = in_flight.popleft()
                self.pool.receive(worker, number, self.timeout or DRAIN_TIMEOUT_S)
                self._free.append((slot, None))  # never handed out
        except WorkerError:
            self.close()


def _close(pool: WorkerPool, unpin: Callable[[], None] | None) -> None:
    if os.getpid() != pool.owner_pid:  # a forked child's copy: neither the workers nor the pinning are its
        return
    try:
        pool.close()
    finally:
        if unpin is not None:
            unpin()
