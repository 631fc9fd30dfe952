"""The progress callback library functions accept; only the CLI draws bars."""

from __future__ import annotations

from typing import Protocol


class Progress(Protocol):
    """Told when a stage starts and as files and bytes are done."""

    def stage(self, name: str, total_files: int, total_nbytes: int) -> None: ...

    def advance(self, files: int, nbytes: int) -> None: ...


class SilentProgress:
    """The default: reports nothing."""

    def stage(self, name: str, total_files: int, total_nbytes: int) -> None:
        pass

    def advance(self, files: int, nbytes: int) -> None:
        pass
