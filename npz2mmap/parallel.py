"""An ordered parallel map over worker processes, with bounded memory.

Tasks are sent in small batches and only a few batches are in flight at a
time, so a million tasks never sit in a queue at once; results come back in
task order. A worker that dies (killed, out of memory) ends the map with an
error instead of a hang; a main process that dies, even by SIGKILL, takes its
workers with it.
"""

from __future__ import annotations

import contextlib
import functools
import itertools
import multiprocessing
import multiprocessing.connection
import os
import signal
import sys
import threading
from collections import deque
from collections.abc import Callable, Iterable, Iterator, Sequence
from concurrent.futures import Future, ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from typing import ParamSpec, Protocol, TypeVar

from .errors import Npz2mmapError

T = TypeVar("T")
R = TypeVar("R")
P = ParamSpec("P")


class Mapper(Protocol):
    """An ordered map; ``per_message`` tasks travel to a worker together (None: the pool's choice)."""

    def __call__(
        self, fn: Callable[[T], R], items: Iterable[T], per_message: int | None = None
    ) -> Iterator[R]: ...


# On Linux the workers fork: they start at once and callers need no
# ``if __name__ == "__main__"`` guard. They only read files and copy bytes.
START_METHOD = "fork" if sys.platform.startswith("linux") else "spawn"
BATCHES_IN_FLIGHT_PER_WORKER = 4
MAX_BATCH = 64


@contextlib.contextmanager
def worker_map(workers: int, num_tasks: int, close_in_workers: Sequence[int] = ()) -> Iterator[Mapper]:
    """Yield an ordered map: the builtin one for one worker, else a process pool's.

    ``close_in_workers`` names descriptors of this process that forked workers
    must not keep, such as one holding a lock, which would otherwise stay
    held for as long as any worker lives.
    """
    workers = min(workers, num_tasks)  # a process with nothing to do is only a cost
    if workers <= 1:
        yield _serial_map
        return
    batch = max(1, min(MAX_BATCH, num_tasks // (workers * 8)))
    executor = ProcessPoolExecutor(
        workers,
        mp_context=multiprocessing.get_context(START_METHOD),
        initializer=_start_worker,
        initargs=(START_METHOD == "fork", tuple(close_in_workers)),
    )
    try:
        yield lambda fn, items, per_message=None: _ordered_map(
            executor, fn, items, per_message or batch, workers * BATCHES_IN_FLIGHT_PER_WORKER
        )
    except BrokenProcessPool:
        raise Npz2mmapError(
            "a worker process died (killed, or out of memory?); nothing was written"
        ) from None
    finally:
        executor.shutdown(wait=True, cancel_futures=True)


def _serial_map(fn: Callable[[T], R], items: Iterable[T], per_message: int | None = None) -> Iterator[R]:
    return map(fn, items)


def _ordered_map(
    executor: ProcessPoolExecutor, fn: Callable[[T], R], items: Iterable[T], batch: int, in_flight: int
) -> Iterator[R]:
    remaining = iter(items)
    pending: deque[Future[list[R]]] = deque()

    def submit_next() -> None:
        chunk = list(itertools.islice(remaining, batch))
        if chunk:
            with interrupts_blocked(handled_too=True):  # a submit may start the pool's thread and processes
                pending.append(executor.submit(_run_batch, fn, chunk))

    for _ in range(in_flight):
        submit_next()
    while pending:
        results = pending.popleft().result()
        submit_next()
        yield from results


def _run_batch(fn: Callable[[T], R], chunk: list[T]) -> list[R]:
    return [fn(item) for item in chunk]


@contextlib.contextmanager
def interrupts_blocked(handled_too: bool = False) -> Iterator[None]:
    """Hold Ctrl-C back from this thread, and so from processes it starts meanwhile.

    With ``handled_too``, also every signal whose handler is Python code (a
    ``signal.alarm`` timeout that raises, say), whose exception could
    otherwise land halfway through the start of a pool's thread; only for
    the conversion pool, whose workers unblock them again (_start_worker).
    Each is raised as the block ends. A worker inherits the mask and stays deaf
    until its initializer ignores SIGINT, so an interrupt while workers start
    prints no traceback from them. A no-op where signal masks do not exist
    (Windows).
    """
    if not hasattr(signal, "pthread_sigmask"):
        yield
        return
    previous = signal.pthread_sigmask(signal.SIG_BLOCK, [])
    try:
        # Inside the try: a Ctrl-C that came before is raised by this very call, once the mask is set.
        signal.pthread_sigmask(signal.SIG_BLOCK, interrupting_signals() if handled_too else {signal.SIGINT})
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, previous)


# Signals raised by a fault of the running code: blocking them would hang or kill it.
_SYNCHRONOUS = {"SIGSEGV", "SIGBUS", "SIGFPE", "SIGILL", "SIGTRAP", "SIGABRT", "SIGSYS"}
_ASYNCHRONOUS = tuple(
    int(number) for number in signal.valid_signals() if getattr(number, "name", "") not in _SYNCHRONOUS
)


def interrupting_signals() -> set[int]:
    """SIGINT and the asynchronous signals that run a Python handler in this process.

    Built in C calls alone (about 20 µs), so that it stays cheap per task sent.
    """
    handlers = map(signal.getsignal, _ASYNCHRONOUS)
    return {signal.SIGINT, *itertools.compress(_ASYNCHRONOUS, map(callable, handlers))}


def signal_mask() -> set[int] | None:
    """This thread's signal mask, None where there are no masks (Windows)."""
    return signal.pthread_sigmask(signal.SIG_BLOCK, []) if hasattr(signal, "pthread_sigmask") else None


def restore_signal_mask(mask: set[int] | None) -> None:
    """Put back a mask ``signal_mask`` returned."""
    if mask is not None:
        signal.pthread_sigmask(signal.SIG_SETMASK, mask)


# The frames keeps_signal_mask adds between a caller and the function: for warnings' stacklevel.
SIGNAL_MASK_FRAMES = 1 if hasattr(signal, "pthread_sigmask") else 0


def keeps_signal_mask(fn: Callable[P, R]) -> Callable[P, R]:
    """Make ``fn`` leave this thread's signal mask as it found it, however it ends.

    A Ctrl-C that another thread of the process took is raised in this one at
    the next call or loop, whatever its mask: also as interrupts_blocked's
    exit starts, before it restores the mask, which would then stay blocked
    for good. The restore here is retried in a frame already running, when
    ``fn`` raises. When it returns, every block inside it has ended and put
    the mask back, and nothing more runs: a call that did its work (a sample
    appended) is never turned into one that raises on its way out.
    """
    if not hasattr(signal, "pthread_sigmask"):
        return fn

    @functools.wraps(fn)
    def with_mask_restored(*args: P.args, **kwargs: P.kwargs) -> R:
        previous = signal.pthread_sigmask(signal.SIG_BLOCK, [])
        try:
            return fn(*args, **kwargs)
        except BaseException:
            signal.pthread_sigmask(signal.SIG_SETMASK, previous)
            raise

    return with_mask_restored


# Signals whose default action ends a worker: a pool's terminate() sends SIGTERM.
_ENDING_SIGNALS = tuple(getattr(signal, name) for name in ("SIGTERM", "SIGHUP") if hasattr(signal, name))


def _start_worker(forked: bool, close_in_workers: tuple[int, ...]) -> None:
    """Leave Ctrl-C to the main process, drop its private descriptors, die with it.

    A forked worker also drops the parent's Python handlers of SIGTERM and SIGHUP
    (the console script's, which clean up as Ctrl-C does): a worker ends by them."""
    become_worker()
    held = interrupting_signals()  # what interrupts_blocked(handled_too=True) held at the fork
    for number in _ENDING_SIGNALS:
        if callable(signal.getsignal(number)):
            signal.signal(number, signal.SIG_DFL)
    if hasattr(signal, "pthread_sigmask"):
        signal.pthread_sigmask(signal.SIG_UNBLOCK, held)
    if forked:  # only a forked worker has the parent's descriptors, under the same numbers
        for fd in close_in_workers:
            with contextlib.suppress(OSError):
                os.close(fd)


def become_worker(before_exit: Callable[[], None] | None = None) -> None:
    """In a worker process: leave Ctrl-C to the main process and exit when it is gone.

    Shared by the conversion pool and MmapLoader's workers; ``before_exit``
    runs once the parent is gone, just before the exit.
    """
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    if hasattr(signal, "pthread_sigmask"):
        signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})
    _exit_with_parent(before_exit)


def _exit_with_parent(before_exit: Callable[[], None] | None) -> None:
    """Watch the parent from a daemon thread and exit the moment it is gone.

    The parent's sentinel becomes ready when the parent dies, however it dies
    and under every start method and platform; a worker left behind would
    otherwise wait forever for tasks. (Under fork, a worker also holds the
    sentinels of the workers forked before it, so they follow it in turn.)
    """
    parent = multiprocessing.parent_process()
    if parent is None or parent.sentinel is None:
        return
    sentinel = parent.sentinel
    threading.Thread(
        target=_wait_then_exit, args=(sentinel, before_exit), name="npz2mmap-parent-watch", daemon=True
    ).start()


def _wait_then_exit(sentinel: int, before_exit: Callable[[], None] | None) -> None:
    multiprocessing.connection.wait([sentinel])
    try:
        if before_exit is not None:
            before_exit()
    finally:
        os._exit(1)
