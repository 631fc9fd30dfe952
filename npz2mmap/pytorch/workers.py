"""MmapLoader's worker processes: each one's loop (make the batch it is sent into its slot) and
the pool that starts them, sends them tasks, reads their replies and reports their deaths."""

from __future__ import annotations

import contextlib
import io
import multiprocessing
import multiprocessing.connection
import multiprocessing.heap
import multiprocessing.reduction
import os
import pickle
import random
import selectors
import signal
import struct
import threading
import time
import traceback
from collections.abc import Iterator
from multiprocessing.context import BaseContext
from typing import Any, NoReturn

import numpy as np
import torch

from .. import parallel
from ..errors import WorkerError
from .batch_plan import BatchPlan, InMemory
from .forkserver_socket import ForkserverSocket
from .leaves import TensorPickler
from .slots import Ring, SlotDestination, SlotFull, SlotWriter, allocate_ring, tree_nbytes

STOP_TIMEOUT_S = 5.0
INDICES_SHOWN = 10
# A task is its batch number and slot, then the batch's sample indices (int64); empty: stop.
TASK_HEADER = struct.Struct("<qq")


def worker_main(
    worker_id: int,
    conn: Any,
    block: Any,
    num_slots: int,
    slot_nbytes: int,
    plan: BatchPlan,
    seed: int,
    forkserver_socket: ForkserverSocket | None = None,
) -> None:
    """A worker's life: make each batch it is sent into its slot, until told to stop or the pipe closes.

    Under forkserver, a worker whose trainer died removes the trainer's
    forkserver socket on its way out (forkserver_socket.py).
    """
    on_trainer_gone = None if forkserver_socket is None else forkserver_socket.remove_if_trainer_gone
    parallel.become_worker(on_trainer_gone)
    torch.set_num_threads(1)  # the workers are the parallelism; threads inside each would compete
    _seed_generators(seed)
    ring = Ring(block, num_slots, slot_nbytes)
    while True:
        try:
            task = conn.recv_bytes()
        except (EOFError, OSError):  # the trainer is gone (it says stop otherwise), maybe with replies unread
            if on_trainer_gone is not None:
                on_trainer_gone()
            return
        if not task:
            return
        number, slot = TASK_HEADER.unpack_from(task)
        indices = np.frombuffer(task, dtype="<i8", offset=TASK_HEADER.size)
        reply = _make_into_slot(plan, ring, slot, number, indices)  # bytes, numbers and text only
        conn.send_bytes(pickle.dumps(reply, pickle.HIGHEST_PROTOCOL))


def _seed_generators(seed: int) -> None:
    """A distinct seed per worker (and per start), so forked workers do not draw the same augmentations."""
    random.seed(seed)
    torch.manual_seed(seed)
    np.random.seed(seed % 2**32)


def _make_into_slot(
    plan: BatchPlan, ring: Ring, slot: int, number: int, indices: np.ndarray
) -> tuple[Any, ...]:
    """One batch's reply: ("slot", number, layout), ("sent", number, layout, bytes) or ("error", ...).

    A batch larger than its slot is written as into a slot, but into memory
    of this process's own, and sent whole ("sent"): it comes with the same
    memory shared between its leaves. The layout is pickled here, inside the
    try: a batch that cannot be pickled (a lock, a generator) is an error of
    this batch, and the trainer can tell one it cannot unpickle from a
    broken pipe. An error is ("error", number, pickled exception or None,
    traceback text).
    """
    try:
        try:
            return ("slot", number, _layout(plan.make(indices, SlotDestination(SlotWriter(ring, slot)))))
        except SlotFull as full:
            batch = full.batch if full.batch is not None else plan.make(indices, InMemory())
        own = SlotWriter(Ring.private(tree_nbytes(batch)), 0)
        layout = _layout(own.write(batch))
        return ("sent", number, layout, own.ring.bytes_np[: own.used].tobytes())
    except BaseException as exc:  # KeyboardInterrupt, SystemExit too: from user code (workers ignore SIGINT)
        return ("error", number, pickled_or_none(exc), traceback.format_exc())


def _layout(tree: Any) -> bytes:
    """A slot's descriptor tree (or a whole batch), pickled apart, so the trainer can tell a layout
    it has seen by its bytes."""
    data = io.BytesIO()
    TensorPickler(data, pickle.HIGHEST_PROTOCOL).dump(tree)
    return data.getvalue()


def pickled_or_none(exc: BaseException) -> bytes | None:
    try:
        data = pickle.dumps(exc, pickle.HIGHEST_PROTOCOL)
        pickle.loads(data)
    except Exception:
        return None
    return data


class RemoteTraceback(Exception):
    """The traceback of an exception raised in a worker, as text (chained to what the trainer raises)."""

    def __str__(self) -> str:
        return str(self.args[0])


class WorkerPool:
    """``num_workers`` processes and the ring they write into, started once and kept across epochs."""

    @parallel.keeps_signal_mask  # SIGINT is blocked while workers start: never for longer
    def __init__(
        self,
        plan: BatchPlan,
        num_workers: int,
        num_slots: int,
        slot_nbytes: int,
        context: BaseContext,
        seed: int,
    ) -> None:
        self.ring = allocate_ring(num_slots, slot_nbytes)
        self.processes: list[Any] = []
        self.conns: list[Any] = []
        self._selectors: dict[int, selectors.BaseSelector] = {}
        # Only the process that started the workers may stop them: a forked child
        # (another loader's worker) that runs this pool's finalizer must not.
        self.owner_pid = os.getpid()
        self.start_method = context.get_start_method()
        self.answered: set[int] = set()  # workers that have replied at least once
        try:
            with parallel.interrupts_blocked():  # workers start deaf to Ctrl-C, then ignore it
                with _interrupts_ignored_across_exec(self.start_method):
                    forkserver_socket = ForkserverSocket.of_this_process(self.start_method)
                for worker_id in range(num_workers):
                    args = (worker_id, self.ring.block, num_slots, slot_nbytes, plan, seed + worker_id)
                    self._start(context, worker_id, (*args, forkserver_socket))
        except BaseException:  # e.g. a transform that spawn cannot pickle: stop those started
            self.close()
            raise

    def _start(self, context: BaseContext, worker_id: int, args: tuple[Any, ...]) -> None:
        ours, theirs = context.Pipe(duplex=True)
        process = context.Process(  # type: ignore[attr-defined]
            target=worker_main,
            args=(args[0], theirs, *args[1:]),
            name=f"npz2mmap-loader-{worker_id}",
            daemon=True,
        )
        try:
            with _interrupts_ignored_across_exec(self.start_method):
                process.start()
        except BaseException:
            ours.close()
            raise
        finally:
            theirs.close()
        self.processes.append(process)
        self.conns.append(ours)

    @property
    def num_workers(self) -> int:
        return len(self.processes)

    def send(self, worker: int, number: int, slot: int, indices: np.ndarray) -> None:
        try:
            self.conns[worker].send_bytes(TASK_HEADER.pack(number, slot) + indices.astype("<i8").tobytes())
        except OSError:  # a dead worker's pipe
            self._raise_gone(worker, number)

    def receive(self, worker: int, number: int, timeout: float = 0) -> tuple[Any, ...]:
        """The reply for batch ``number`` from ``worker``; WorkerError at once if any worker has died.

        ``timeout`` (seconds, 0: none) bounds the wait: past it the worker is
        taken for stuck, killed, and WorkerError names it.
        """
        conn = self.conns[worker]
        deadline = time.monotonic() + timeout if timeout > 0 else None
        while True:
            ready = self._wait(worker, deadline)
            if not ready:
                self._raise_stuck(worker, number, timeout)
            if conn in ready:
                try:
                    reply = pickle.loads(conn.recv_bytes())
                    self.answered.add(worker)
                    if reply[1] != number:  # replies come in the order tasks went: anything else is a bug
                        raise WorkerError(
                            f"MmapLoader worker {worker} answered batch {reply[1]}, not {number}"
                        )
                    return reply  # type: ignore[no-any-return]
                except (EOFError, OSError):
                    self._raise_gone(worker, number)
            for process in self.processes:
                if process.sentinel in ready:
                    process.join(STOP_TIMEOUT_S)  # reaped, so its exit code is known
            self.raise_if_dead(number)

    def _wait(self, worker: int, deadline: float | None) -> list[Any]:
        """Wait for ``worker``'s reply or any worker's end; return those ready (its pipe, sentinels).

        An empty list: ``deadline`` (time.monotonic) passed first.

        On POSIX a selector made once per worker does it in one system call
        (``multiprocessing.connection.wait`` builds one per call); Windows
        pipes are not selectable, so there it is that function.
        """
        if os.name != "posix":
            sentinels = [process.sentinel for process in self.processes]
            return multiprocessing.connection.wait([self.conns[worker], *sentinels], _left(deadline))
        selector = self._selectors.get(worker)
        if selector is None:
            selector = self._selectors[worker] = selectors.DefaultSelector()
            selector.register(self.conns[worker], selectors.EVENT_READ)
            for process in self.processes:
                selector.register(process.sentinel, selectors.EVENT_READ)
        while True:
            left = _left(deadline)
            ready = selector.select(left)
            if ready:  # else a signal interrupted the wait, or the deadline passed
                return [key.fileobj for key, _ in ready]
            if left is not None and _left(deadline) == 0:
                return []

    def _raise_stuck(self, worker: int, number: int, timeout: float) -> NoReturn:
        """The worker sent nothing within ``timeout``: kill it (it may be stopped or deadlocked), say so."""
        process = self.processes[worker]
        process.kill()
        why = (
            "stuck or stopped?"
            if worker in self.answered
            else "its first batch: still starting? A spawned worker imports torch first"
        )
        raise WorkerError(
            f"MmapLoader worker {worker} (pid {process.pid}) sent no batch {number} within the "
            f"timeout of {timeout:g} s ({why}); the workers were stopped"
        )

    def _raise_gone(self, worker: int, number: int) -> NoReturn:
        """The worker's pipe broke: it is gone, and its exit code (once the kernel has it) tells how."""
        self.processes[worker].join(STOP_TIMEOUT_S)
        self.raise_if_dead(number)
        raise WorkerError(f"MmapLoader worker {worker} closed its pipe while batch {number} was being loaded")

    def raise_if_dead(self, number: int) -> None:
        for worker, process in enumerate(self.processes):
            if process.exitcode is not None:
                killed = process.exitcode == -getattr(signal, "SIGKILL", 9)
                hint = " (out of memory? see the kernel log)" if killed else self._import_hint(worker)
                raise WorkerError(
                    f"MmapLoader worker {worker} (pid {process.pid}) {describe_exit(process.exitcode)}{hint} "
                    f"while batch {number} was being loaded; the workers were stopped"
                )

    def _import_hint(self, worker: int) -> str:
        """Why a spawned worker may die before its first reply: it could not import what it was sent."""
        if worker in self.answered or self.start_method not in ("spawn", "forkserver"):
            return ""
        return (
            f" before its first batch (under {self.start_method}, each worker imports the main script: "
            'start the loader under `if __name__ == "__main__":`, and define the dataset, transforms '
            "and collate_fn at module level, outside that block and outside functions)"
        )

    def close(self) -> None:
        """Ask every worker to stop, wait a little, then kill whatever is left.

        A no-op in any process but the one that started them (a forked child
        holds copies of this pool that are not its own).
        """
        if os.getpid() != self.owner_pid:
            return
        for conn in self.conns:
            try:
                conn.send_bytes(b"")
            except OSError:
                pass
        for process in self.processes:
            process.join(STOP_TIMEOUT_S)
            if process.exitcode is None:
                process.kill()
                process.join()
        for selector in self._selectors.values():
            selector.close()
        self._selectors.clear()
        for conn in self.conns:
            conn.close()
        self.processes.clear()
        self.conns.clear()


def _left(deadline: float | None) -> float | None:
    """Seconds until ``deadline`` (0 once past it), or None for no deadline."""
    return None if deadline is None else max(0.0, deadline - time.monotonic())


@contextlib.contextmanager
def _interrupts_ignored_across_exec(start_method: str) -> Iterator[None]:
    """Ctrl-C ignored while a spawn or forkserver worker starts, so that it starts ignoring it.

    A blocked SIGINT reaches forked children only: spawn's exec clears the
    mask, but keeps an ignored SIGINT, and Python then installs no
    KeyboardInterrupt handler (no traceback while the worker imports). Only
    the main thread can change a handler; elsewhere the mask alone is kept.
    """
    previous = signal.getsignal(signal.SIGINT)
    in_main_thread = threading.current_thread() is threading.main_thread()
    if start_method == "fork" or previous is None or not in_main_thread:
        yield  # previous None: a handler set outside Python, which could not be restored
        return
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)


def describe_exit(exitcode: int) -> str:
    """'was killed by signal SIGKILL' or 'exited with code 3'."""
    if exitcode < 0:
        try:
            return f"was killed by signal {signal.Signals(-exitcode).name}"
        except ValueError:
            return f"was killed by signal {-exitcode}"
    return f"exited with code {exitcode}"


def worker_failure(worker: int, number: int, indices: np.ndarray, reply: tuple[Any, ...]) -> WorkerError:
    """The trainer's error for a worker's exception: names worker, batch and samples, chains the original."""
    _, _, pickled, text = reply
    original: BaseException | None = None
    if pickled is not None:
        try:
            original = pickle.loads(pickled)
        except Exception:
            original = None
    remote = RemoteTraceback(f"\n\nTraceback in the worker:\n{text}")
    shown = ", ".join(str(int(i)) for i in indices[:INDICES_SHOWN])
    more = f", ... ({len(indices)} in all)" if len(indices) > INDICES_SHOWN else ""
    summary = exception_line(original) if original is not None else text.strip().splitlines()[-1]
    error = WorkerError(
        f"MmapLoader worker {worker} failed on batch {number} (samples {shown}{more}): {summary}"
    )
    if original is not None:
        original.__cause__ = remote
        error.__cause__ = original
    else:
        error.__cause__ = remote
    return error


def exception_line(error: BaseException) -> str:
    """'ValueError: bad sample', or the bare type name when the message is empty (a KeyboardInterrupt)."""
    message = str(error)
    return f"{type(error).__name__}: {message}" if message else type(error).__name__


def resolve_context(context: BaseContext | str | None) -> BaseContext:
    """A multiprocessing context from a context, a start method's name, or None (the platform's default).

    TypeError or ValueError, as DataLoader raises them, for anything else or a start method
    this platform lacks.
    """
    if context is None:
        return multiprocessing.get_context()
    if isinstance(context, str):
        methods = multiprocessing.get_all_start_methods()
        if context not in methods:
            raise ValueError(
                f"multiprocessing_context must name a start method of this platform ({', '.join(methods)}), "
                f"not {context!r}"
            )
        return multiprocessing.get_context(context)
    if not isinstance(context, BaseContext):
        raise TypeError(
            "multiprocessing_context must be a start method's name or a multiprocessing context, "
            f"not {context!r}"
        )
    return context


def seed_base() -> int:
    """A seed for one start of the workers, drawn from torch's default generator as DataLoader
    draws its base seed: ``torch.manual_seed`` before the loader starts makes the workers'
    augmentations repeat, and each start draws a new one."""
    return int(torch.empty((), dtype=torch.int64).random_().item())
