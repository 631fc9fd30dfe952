"""Progress: the callback library functions accept, and the displays of it on stderr.

Library functions take a ``Progress`` (or one of the ``PROGRESS_MODES`` the
CLI's ``--progress`` takes) and only tell it what they do; the displays here
draw tqdm bars or give timed log lines on stderr (the CLI's echo, for the CLI),
never on stdout.
"""

from __future__ import annotations

import contextlib
import sys
import time
from collections.abc import Callable, Iterator
from typing import Any, Protocol

import tqdm

from .text import human_bytes


class _Bar(tqdm.tqdm):
    """tqdm's bar without its monitor thread (the converter forks its workers), leaving tqdm's
    own setting, which other libraries' bars use, as it was."""

    monitor_interval = 0


class Progress(Protocol):
    """Told when a stage starts and as its items and bytes are done.

    A stage counts ``total_files`` items of ``unit`` (files, samples, parts,
    fields) and, when ``total_nbytes`` is not 0, bytes as well.
    """

    def stage(self, name: str, total_files: int, total_nbytes: int, unit: str = "files") -> None: ...

    def advance(self, files: int, nbytes: int) -> None: ...


class SilentProgress:
    """The default: reports nothing."""

    def stage(self, name: str, total_files: int, total_nbytes: int, unit: str = "files") -> None:
        pass

    def advance(self, files: int, nbytes: int) -> None:
        pass


PROGRESS_MODES = ("auto", "bar", "log", "none")
LOG_INTERVAL_SECONDS = 10.0


class BarProgress:
    """Draws each stage of a library call as a tqdm bar on stderr."""

    def __init__(self) -> None:
        self.bar: tqdm.tqdm[Any] | None = None
        self.done = self.total = 0
        self.unit = "files"

    def stage(self, name: str, total_files: int, total_nbytes: int, unit: str = "files") -> None:
        self.close()
        self.done, self.total, self.unit = 0, total_files, unit
        if total_nbytes:
            self.bar = _Bar(total=total_nbytes, desc=name, unit="B", unit_scale=True, dynamic_ncols=True)
        else:
            self.bar = _Bar(total=total_files, desc=name, unit=f" {unit}", dynamic_ncols=True)

    def advance(self, files: int, nbytes: int) -> None:
        if self.bar is None:
            return
        self.done += files
        if self.bar.unit == "B":
            of_total = f"{self.done}/{self.total} {counted(self.unit, self.total)}"
            self.bar.set_postfix_str(of_total, refresh=False)
            self.bar.update(nbytes)
        else:
            self.bar.update(files)

    def close(self, finished: bool = True) -> None:
        if self.bar is not None:
            self.bar.close()
            self.bar = None


class LogProgress:
    """Hands ``emit`` a progress line every ``interval`` seconds, for logs that are not a terminal.

    A stage that runs at least ``interval`` seconds gets periodic lines and a
    last one when it finishes; shorter stages give none. ``emit`` is where the
    lines go: the CLI passes its own echo; a library caller who asked for
    ``progress="log"`` gets them on stderr, as tqdm's bars are. ``clock`` is
    injectable so tests need not sleep.
    """

    def __init__(
        self,
        interval: float = LOG_INTERVAL_SECONDS,
        clock: Callable[[], float] | None = None,
        emit: Callable[[str], object] | None = None,
    ) -> None:
        self.interval = interval
        self.clock = clock if clock is not None else time.monotonic
        self.emit = emit if emit is not None else _to_stderr
        self.name: str | None = None
        self.unit = "files"
        self.done = self.total = self.nbytes = self.total_nbytes = 0
        self.started = self.last_line = 0.0

    def stage(self, name: str, total_files: int, total_nbytes: int, unit: str = "files") -> None:
        self.close()
        self.name, self.unit, self.total, self.total_nbytes = name, unit, total_files, total_nbytes
        self.done = self.nbytes = 0
        self.started = self.last_line = self.clock()

    def advance(self, files: int, nbytes: int) -> None:
        self.done += files
        self.nbytes += nbytes
        now = self.clock()
        if now - self.last_line >= self.interval:
            self.last_line = now
            self.emit(self.line(now - self.started, finished=False))

    def close(self, finished: bool = True) -> None:
        """End the stage: its last line, if it printed any and ``finished`` (not stopped by an error)."""
        if self.name is not None and finished and self.last_line > self.started:
            self.emit(self.line(self.clock() - self.started, finished=True))
        self.name = None

    def line(self, seconds: float, finished: bool) -> str:
        """``copy: 120/1,000 files (12%), 1.2 GB/9.8 GB, 45.6 MB/s, 0:00:27 elapsed, ETA 0:03:18``."""
        of_total = f"{self.done:,}/{self.total:,} {counted(self.unit, self.total)}"
        parts = [f"{of_total} ({_percent(self.done, self.total)})"]
        if self.total_nbytes:
            done, total = self.nbytes, self.total_nbytes
            parts.append(f"{human_bytes(done)}/{human_bytes(total)}")
            parts.append(f"{human_bytes(round(done / seconds)) if seconds > 0 else '?'}/s")
        else:
            done, total = self.done, self.total
            parts.append(f"{done / seconds:,.1f} {self.unit}/s" if seconds > 0 else f"? {self.unit}/s")
        if finished:
            parts.append(f"done in {_clock_time(seconds)}")
        else:
            eta = _clock_time((total - done) * seconds / done) if done and total >= done else "?"
            parts.append(f"{_clock_time(seconds)} elapsed, ETA {eta}")
        return f"{self.name}: " + ", ".join(parts)


def counted(unit: str, total: int) -> str:
    """A plural unit ('files') as it reads after 'N of ``total``': 'file' when the total is 1."""
    return unit[:-1] if total == 1 and unit.endswith("s") else unit


def _percent(done: int, total: int) -> str:
    return f"{min(done, total) * 100 // total}%" if total else "100%"


def _clock_time(seconds: float) -> str:
    """3725.2 -> '1:02:05'."""
    whole = int(seconds)
    return f"{whole // 3600}:{whole % 3600 // 60:02d}:{whole % 60:02d}"


def choose_progress(
    mode: str, emit: Callable[[str], object] | None = None
) -> BarProgress | LogProgress | SilentProgress:
    """The display for ``--progress``: auto draws bars on a terminal and log lines (to ``emit``,
    see LogProgress) elsewhere."""
    if sys.stderr is None:  # closed (2>&-): nowhere to show progress
        return SilentProgress()
    if mode == "auto":
        mode = "bar" if sys.stderr.isatty() else "log"
    if mode == "bar":
        return BarProgress()
    if mode == "log":
        return LogProgress(emit=emit)
    return SilentProgress()


@contextlib.contextmanager
def showing_progress(mode: str, emit: Callable[[str], object] | None = None) -> Iterator[Progress]:
    """A progress display for one call; its last line is given only if the call succeeds."""
    progress = choose_progress(mode, emit)
    try:
        yield progress
    except BaseException:
        if not isinstance(progress, SilentProgress):
            progress.close(finished=False)
        raise
    if not isinstance(progress, SilentProgress):
        progress.close()


def _to_stderr(line: str) -> None:
    if sys.stderr is not None:
        sys.stderr.write(line + "\n")
        sys.stderr.flush()


def progress_display(progress: Progress | str | None) -> contextlib.AbstractContextManager[Progress]:
    """What a library call's ``progress=`` stands for: None (nothing), a mode of PROGRESS_MODES
    (shown as ``--progress`` shows it) or a Progress object (used as it is).

    Raises TypeError for anything else, naming what is allowed.
    """
    if progress is None:
        return contextlib.nullcontext(SilentProgress())
    if isinstance(progress, str) and progress in PROGRESS_MODES:
        return showing_progress(progress)
    if not isinstance(progress, (str, bool)) and all(
        callable(getattr(progress, method, None)) for method in ("stage", "advance")
    ):
        return contextlib.nullcontext(progress)
    modes = ", ".join(repr(mode) for mode in PROGRESS_MODES)
    raise TypeError(
        f"progress must be None, one of {modes} or an object with stage() and advance() methods, "
        f"got {progress!r}"
    )
