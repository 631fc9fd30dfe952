"""An ordered parallel map over worker processes, with bounded memory.

Tasks are sent in small batches and only a few batches are in flight at a
time, so a million tasks never sit in a queue at once; results come back in
task order. A worker that dies (killed, out of memory) ends the map with an
error instead of a hang.
"""

from __future__ import annotations

import contextlib
import itertools
import multiprocessing
import signal
import sys
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import Future, ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from typing import Any, TypeVar

from .errors import Npz2mmapError

T = TypeVar("T")
R = TypeVar("R")
Mapper = Callable[[Callable[[T], R], Iterable[T]], Iterator[R]]

# On Linux the workers fork: they start at once and callers need no
# ``if __name__ == "__main__"`` guard. They only read files and copy bytes.
START_METHOD = "fork" if sys.platform.startswith("linux") else "spawn"
BATCHES_IN_FLIGHT_PER_WORKER = 4
MAX_BATCH = 64


@contextlib.contextmanager
def worker_map(workers: int, num_tasks: int) -> Iterator[Mapper[Any, Any]]:
    """Yield an ordered map: the builtin one for one worker, else a process pool's."""
    if workers <= 1 or num_tasks <= 1:
        yield map
        return
    batch = max(1, min(MAX_BATCH, num_tasks // (workers * 8)))
    executor = ProcessPoolExecutor(
        workers, mp_context=multiprocessing.get_context(START_METHOD), initializer=_ignore_interrupts
    )
    try:
        yield lambda fn, items: _ordered_map(
            executor, fn, items, batch, workers * BATCHES_IN_FLIGHT_PER_WORKER
        )
    except BrokenProcessPool:
        raise Npz2mmapError(
            "a worker process died (killed, or out of memory?); nothing was written"
        ) from None
    finally:
        executor.shutdown(wait=True, cancel_futures=True)


def _ordered_map(
    executor: ProcessPoolExecutor, fn: Callable[[T], R], items: Iterable[T], batch: int, in_flight: int
) -> Iterator[R]:
    remaining = iter(items)
    pending: deque[Future[list[R]]] = deque()

    def submit_next() -> None:
        chunk = list(itertools.islice(remaining, batch))
        if chunk:
            pending.append(executor.submit(_run_batch, fn, chunk))

    for _ in range(in_flight):
        submit_next()
    while pending:
        results = pending.popleft().result()
        submit_next()
        yield from results


def _run_batch(fn: Callable[[T], R], chunk: list[T]) -> list[R]:
    return [fn(item) for item in chunk]


def _ignore_interrupts() -> None:
    """Workers leave Ctrl-C to the main process, which cleans up and stops them."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
