"""The progress callback library functions accept; only the CLI draws bars."""

from __future__ import annotations

from typing import Protocol


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
