"""The page cache is npz2mmap's cache: fill it before training and see how much is resident."""

from __future__ import annotations

import functools
import os
from collections.abc import Callable
from dataclasses import dataclass

from .. import pagecache
from ..errors import FormatError
from ..format.index import BLOB_NAME, Index
from ..progress import Progress, SilentProgress
from ..read.parts import Parts
from ..read.reader import open_blob


@dataclass(frozen=True)
class Residency:
    blob_paths: tuple[str, ...]
    resident_nbytes: int | None  # None where the platform cannot tell (no mincore)
    blob_nbytes: int

    @property
    def fraction(self) -> float | None:
        if self.resident_nbytes is None:
            return None
        return self.resident_nbytes / self.blob_nbytes if self.blob_nbytes else 1.0


def residency(path: str | os.PathLike[str]) -> Residency:
    """How much of a dataset's blobs (all parts) is in the page cache. Raises FormatError, OSError."""
    return _measure(Parts(path), lambda blob_path, fd, index: None)


def warm(path: str | os.PathLike[str], progress: Progress | None = None) -> Residency:
    """Read every blob once so that every process on this node then maps cached pages.

    Each blob is read through the descriptor that was checked against its
    index, exactly its size, like every reader opens it. Run it once per node
    before training; the kernel may evict pages again under memory pressure,
    which the returned residency shows. Raises FormatError, OSError.
    """
    progress = progress or SilentProgress()
    parts = Parts(path)
    progress.stage("warm", len(parts.paths), sum(index.blob_nbytes for index in parts.indexes), unit="parts")

    def load(blob_path: str, fd: int, index: Index) -> None:
        nbytes = pagecache.load_into_page_cache(fd, index.blob_nbytes, functools.partial(progress.advance, 0))
        if nbytes != index.blob_nbytes:
            raise FormatError(f"{blob_path}: truncated to {nbytes} bytes while being read")
        progress.advance(1, 0)

    return _measure(parts, load)


def _measure(parts: Parts, before: Callable[[str, int, Index], None]) -> Residency:
    """Open each blob with the checks every reader makes, call ``before`` on it, then see what is cached."""
    blob_paths = tuple(os.path.join(path, BLOB_NAME) for path in parts.paths)
    resident: list[int | None] = []
    for blob_path, index in zip(blob_paths, parts.indexes, strict=True):
        fd = open_blob(blob_path, index)
        try:
            before(blob_path, fd, index)
            resident.append(pagecache.resident_nbytes(fd, index.blob_nbytes))
        finally:
            os.close(fd)
    known = [nbytes for nbytes in resident if nbytes is not None]
    total = sum(known) if len(known) == len(resident) else None
    return Residency(blob_paths, total, sum(index.blob_nbytes for index in parts.indexes))
