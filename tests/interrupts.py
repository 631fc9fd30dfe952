"""Ctrl-C at every point of npz2mmap's own code: a trace function that sends SIGINT at the k-th event.

A real Ctrl-C makes Python raise KeyboardInterrupt between two bytecodes of
the main thread, unless SIGINT is blocked, when it waits for the unblocking.
``Interrupt(k)`` counts the line and opcode events of frames running
npz2mmap's modules and, at the k-th, sends the process a real SIGINT
(``signal.raise_signal``): raised at once where it is not blocked, held back
by the kernel where it is, exactly as a Ctrl-C pressed at that instant.
"""

from __future__ import annotations

import os
import signal
import sys
from types import FrameType, TracebackType
from typing import Any

import npz2mmap

PACKAGE_DIR = os.path.dirname(os.path.abspath(npz2mmap.__file__)) + os.sep


def sigint_blocked() -> bool:
    return signal.SIGINT in signal.pthread_sigmask(signal.SIG_BLOCK, [])


class Interrupt:
    """Within ``with``, send SIGINT at the ``k``-th (from 0) line or opcode event in npz2mmap.

    ``on_fire`` is called just before the signal goes; what it returns is kept as ``noted``.

    After the block, ``fired`` says whether it was sent (False: the code ran
    fewer than k + 1 events), ``where`` names the point (module, function,
    line) and ``blocked`` whether SIGINT was blocked there.
    """

    def __init__(self, k: int, on_fire: Any = None, opcodes: bool = True, blocked_only: bool = False) -> None:
        self.k = k
        self.opcodes = opcodes  # False: line events only, for long code
        self.blocked_only = blocked_only  # count only events where SIGINT is blocked
        self.count = 0
        self.on_fire = on_fire
        self.fired = False
        self.blocked = False
        self.where = ""
        self.noted: Any = None

    def __enter__(self) -> Interrupt:
        if signal.getsignal(signal.SIGINT) is not signal.default_int_handler:
            raise RuntimeError("SIGINT must raise KeyboardInterrupt for this test")
        sys.settrace(self._call)
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        sys.settrace(None)

    def _call(self, frame: FrameType, event: str, arg: object) -> Any:
        if not frame.f_code.co_filename.startswith(PACKAGE_DIR):
            return None
        frame.f_trace_opcodes = self.opcodes
        return self._event

    def _event(self, frame: FrameType, event: str, arg: object) -> Any:
        if event in ("line", "opcode") and not self.fired:
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
        name = os.path.relpath(code.co_filename, PACKAGE_DIR)
        self.where = f"{name}:{code.co_name}:{frame.f_lineno} (opcode at {frame.f_lasti})"
        if self.on_fire is not None:
            self.noted = self.on_fire()
        signal.raise_signal(signal.SIGINT)
