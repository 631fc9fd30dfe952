"""The ``npz2mmap`` console script's entry point, light enough to catch Ctrl-C from the start.

The commands (``commands.py``) import click and numpy, which takes a moment;
an interrupt then, or at any later moment, ends with ``Aborted!`` on stderr and
exit code 1 (click's own answer to Ctrl-C during a command), never a traceback;
once the command has ended, a Ctrl-C changes nothing. SIGTERM (a batch job's
time limit) and SIGHUP (a closed terminal) end a command as Ctrl-C does, its
staging removed, and the process then dies by that signal, as its sender expects. This module imports
nothing else of the package, so the console script reaches ``main`` at once.
"""

from __future__ import annotations

import os
import signal
import sys
import threading

ABORTED_EXIT_CODE = 1


def main() -> None:
    """Run the command line; Ctrl-C at any moment prints 'Aborted!' and exits 1.

    The console script's entry point: it ends the process (SystemExit) and
    leaves Ctrl-C ignored, so nothing can change the exit code after it.
    """
    while True:  # a Ctrl-C can land between any two steps below: each is retried, none run twice
        try:
            end_on_termination_as_on_ctrl_c()
            if "code" not in _outcome:
                _outcome["code"] = run_command()
            ignore_late_interrupts()
            break
        except KeyboardInterrupt:
            _outcome.setdefault("code", ABORTED)
    code = _outcome.pop("code")
    if code == ABORTED:
        sys.stderr.write("\nAborted!\n")
        code = ABORTED_EXIT_CODE
    ending = _outcome.pop("signal", None)
    if code != 0 and isinstance(ending, int):
        die_by(ending)
    sys.exit(code)


# How the command ended, kept outside main's frame so that a Ctrl-C at its first step loses nothing.
_outcome: dict[str, int | str] = {}
ABORTED = "aborted"

# Signals that end a command as Ctrl-C does, where the system has them.
ENDING_SIGNALS = tuple(getattr(signal, name) for name in ("SIGTERM", "SIGHUP") if hasattr(signal, name))


def end_on_termination_as_on_ctrl_c() -> None:
    """Make SIGTERM and SIGHUP raise KeyboardInterrupt, so that a command cleans up as on Ctrl-C
    (where they still have their default action: a handler of the caller's is kept)."""
    if threading.current_thread() is not threading.main_thread():
        return
    for number in ENDING_SIGNALS:
        if signal.getsignal(number) == signal.SIG_DFL:
            signal.signal(number, _ended_by_signal)


def _ended_by_signal(number: int, frame: object) -> None:
    _outcome.setdefault("signal", number)
    raise KeyboardInterrupt


def die_by(number: int) -> None:
    """End the process by signal ``number``'s default action, once the command has cleaned up."""
    sys.stderr.flush()
    if sys.platform != "win32":
        signal.signal(number, signal.SIG_DFL)
        os.kill(os.getpid(), number)
    sys.exit(ABORTED_EXIT_CODE)


def run_command() -> int | str:
    """Run the click group; return its exit code (0 when it returns)."""
    try:
        from .commands import cli

        cli(prog_name="npz2mmap")
    except SystemExit as exited:
        return 0 if exited.code is None else exited.code  # type: ignore[return-value]
    except KeyboardInterrupt:  # before click's own handler could take it
        return ABORTED
    except OSError as exc:  # our own output could not be written (a full disk, a closed pipe)
        if sys.stderr is not None:
            sys.stderr.write(f"Error: cannot write the output ({exc.strerror or exc})\n")
        return 1
    return 0


def ignore_late_interrupts() -> None:
    """Ignore Ctrl-C once the command has ended: the exit code and output are final.

    Python puts SIGINT's default action back while it shuts down, so a Ctrl-C
    in those last moments would kill the process by the signal (exit -2, no
    'Aborted!') after a command that succeeded. Ignoring it holds for every
    thread of the process (numpy's BLAS threads take signals too), where a
    signal mask would hold for this thread alone. Nothing runs after this.
    """
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        for number in ENDING_SIGNALS:
            if signal.getsignal(number) is _ended_by_signal:
                signal.signal(number, signal.SIG_IGN)


if __name__ == "__main__":
    main()
