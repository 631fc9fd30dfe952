"""Ctrl-C at every point of npz2mmap's own code: a trace function that sends SIGINT at the k-th event.

A real Ctrl-C makes Python raise KeyboardInterrupt between two bytecodes of
the main thread, unless SIGINT is blocked, when it waits for the unblocking.
``Interrupt(k)`` counts the line and opcode events of frames running
npz2mmap's modules and, at the k-th, sends the process a real SIGINT
(``signal.raise_signal``): raised at once where it is not blocked, held back
by the kernel where it is, exactly as a Ctrl-C pressed at that instant.

Two variants: ``other_thread=True`` raises the KeyboardInterrupt at the next
check whatever this thread's signal mask (``_thread.interrupt_main``), as when
a Ctrl-C sent to the process was taken by another of its threads (numpy's
BLAS threads, say) while this one held SIGINT back; ``raises=`` an exception
class sends SIGALRM to a handler that raises it, as the ``signal.alarm``
timeout idiom does. The frames counted also include those of contextlib,
where npz2mmap's ``with`` statements run, and with ``pool_too=True`` those
of concurrent.futures, multiprocessing and threading that this thread runs
(a pool starting its thread and its processes).
"""

from __future__ import annotations

import _thread
import concurrent.futures
import contextlib
import itertools
import multiprocessing
import os
import signal
import sys
import threading
from types import FrameType, TracebackType
from typing import Any

from conftest import RunSize

import npz2mmap
from npz2mmap import locks
from npz2mmap.write import publish

PACKAGE_DIR = os.path.dirname(os.path.abspath(npz2mmap.__file__)) + os.sep
def moments(step: int, run_size: RunSize) -> itertools.count[int]:
    """The events an interrupt-anywhere test fires at: 0, then every 2 ``step`` (every ``step`` in its long run)."""
    return itertools.count(0, step * run_size.of(2, 1))


CONTEXTLIB_FILE = contextlib.__file__
# With ``pool_too=True``, also the standard library's code that starts and feeds worker processes.
POOL_DIRS = tuple(
    os.path.dirname(module.__file__) + os.sep for module in (concurrent.futures, multiprocessing)
) + (threading.__file__,)


def sigint_blocked() -> bool:
    return signal.SIGINT in signal.pthread_sigmask(signal.SIG_BLOCK, [])


class Interrupt:
    """Within ``with``, send SIGINT at the ``k``-th (from 0) line or opcode event in npz2mmap.

    ``on_fire`` is called just before the signal goes; what it returns is kept as ``noted``.

    After the block, ``fired`` says whether it was sent (False: the code ran
    fewer than k + 1 events), ``where`` names the point (module, function,
    line) and ``blocked`` whether SIGINT was blocked there.
    """

    def __init__(
        self,
        k: int,
        on_fire: Any = None,
        opcodes: bool = True,
        blocked_only: bool = False,
        other_thread: bool = False,
        raises: type[BaseException] | None = None,
        pool_too: bool = False,
    ) -> None:
        self.k = k
        self.pool_too = pool_too
        self.other_thread = other_thread
        self.raises = raises
        self.previous_alarm_handler: Any = None
        self.opcodes = opcodes  # False: line events only, for long code
        self.blocked_only = blocked_only  # count only events where SIGINT is blocked
        self.count = 0
        self.on_fire = on_fire
        self.fired = False
        self.blocked = False
        self.where = ""
        self.noted: Any = None
        self.pid = os.getpid()

    def __enter__(self) -> Interrupt:
        if signal.getsignal(signal.SIGINT) is not signal.default_int_handler:
            raise RuntimeError("SIGINT must raise KeyboardInterrupt for this test")
        if self.raises is not None:
            self.previous_alarm_handler = signal.signal(signal.SIGALRM, self._raise)
        self.pid = os.getpid()  # a forked child inherits the trace function: it must not fire there
        sys.settrace(self._call)
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        sys.settrace(None)
        if self.raises is not None:
            signal.signal(signal.SIGALRM, self.previous_alarm_handler)

    def _raise(self, signum: int, frame: FrameType | None) -> None:
        assert self.raises is not None
        raise self.raises("alarm")

    def _call(self, frame: FrameType, event: str, arg: object) -> Any:
        filename = frame.f_code.co_filename
        if not (
            filename.startswith(PACKAGE_DIR)
            or filename == CONTEXTLIB_FILE
            or (self.pool_too and filename.startswith(POOL_DIRS))
        ):
            return None
        frame.f_trace_opcodes = self.opcodes
        return self._event

    def _event(self, frame: FrameType, event: str, arg: object) -> Any:
        if event in ("line", "opcode") and not self.fired and os.getpid() == self.pid:
            if self.blocked_only and not sigint_blocked():
                return self._event
            if self.count == self.k:
                self._fire(frame)
            self.count += 1
        return self._event

    def _fire(self, frame: FrameType) -> None:
        self.fired = True
        self.blocked = sigint_blocked()
        code = frame.f_code
        name = (
            os.path.basename(code.co_filename)
            if not code.co_filename.startswith(PACKAGE_DIR)
            else (os.path.relpath(code.co_filename, PACKAGE_DIR))
        )
        self.where = f"{name}:{code.co_name}:{frame.f_lineno} (opcode at {frame.f_lasti})"
        if self.on_fire is not None:
            self.noted = self.on_fire()
        if self.raises is not None:
            signal.raise_signal(signal.SIGALRM)
        elif self.other_thread:
            _thread.interrupt_main()
        else:
            signal.raise_signal(signal.SIGINT)


def lock_is_free(out_dir: str | os.PathLike[str]) -> bool:
    """Whether OUT's output lock can be taken now (it is given back at once)."""
    parent, name = os.path.split(os.path.abspath(out_dir))
    with locks.exclusive_lock(os.path.join(parent, f".{name}{publish.LOCK_SUFFIX}")) as fd:
        return fd is not None


def left_beside(out_dir: str | os.PathLike[str]) -> list[str]:
    """What a writer or conversion of OUT left beside it: staging or retired directories."""
    parent, name = os.path.split(os.path.abspath(out_dir))
    marks = (f".{name}{publish.STAGING_MARK}", f".{name}{publish.RETIRED_MARK}")
    return sorted(entry for entry in os.listdir(parent) if entry.startswith(marks))
