"""The ``npz2mmap`` console script's entry point, light enough to catch Ctrl-C from the start.

The commands (``commands.py``) import click and numpy, which takes a moment;
an interrupt then, or at any later moment, ends with ``Aborted!`` on stderr and
exit code 1 (click's own answer to Ctrl-C during a command), never a traceback.
This module imports nothing else on its own, so the console script reaches
``main`` at once.
"""

from __future__ import annotations

import signal
import sys
from typing import Any

ABORTED_EXIT_CODE = 1


def main() -> None:
    """Run the command line; Ctrl-C at any moment prints 'Aborted!' and exits 1."""
    try:
        try:
            from .commands import cli

            cli(prog_name="npz2mmap")
        except KeyboardInterrupt:
            sys.stderr.write("\nAborted!\n")
            sys.exit(ABORTED_EXIT_CODE)
        except OSError as exc:  # our own output could not be written (a full disk, a closed pipe)
            if sys.stderr is not None:
                sys.stderr.write(f"Error: cannot write the output ({exc.strerror or exc})\n")
            sys.exit(1)
    finally:
        hold_back_late_interrupts()


def hold_back_late_interrupts() -> None:
    """Block Ctrl-C once the command has ended: the exit code and output are final.

    Python puts SIGINT's default action back while it shuts down, so a Ctrl-C
    in those last moments would kill the process by the signal (exit -2, no
    'Aborted!') after a command that succeeded. Nothing runs after this.
    """
    if hasattr(signal, "pthread_sigmask"):
        signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})


def __getattr__(name: str) -> Any:
    """The click group and helpers of ``commands`` (``npz2mmap.cli.cli``), imported on first use.

    Dunder names are never delegated: the import system probes ``__path__``
    and the like, and must not import the commands while doing so.
    """
    if not name.startswith("__"):
        from . import commands

        if hasattr(commands, name):
            return getattr(commands, name)
    raise AttributeError(f"module 'npz2mmap.cli' has no attribute {name!r}")


if __name__ == "__main__":
    main()
