"""The page cache is npz2mmap's cache: fill it before training and see how much is resident."""

from __future__ import annotations

import os
from dataclasses import dataclass

from . import fsutil
from .parts import Parts
from .progress import Progress, SilentProgress
from .spec import BLOB_NAME


@dataclass(frozen=True)
class Residency:
    blob_paths: tuple[str, ...]
    resident_nbytes: int
    blob_nbytes: int

    @property
    def fraction(self) -> float:
        return self.resident_nbytes / self.blob_nbytes if self.blob_nbytes else 1.0


def residency(path: str | os.PathLike[str]) -> Residency:
    """How much of a dataset's blobs (all parts) is in the page cache. Raises FormatError, OSError."""
    parts = Parts(path)
    blobs = tuple(os.path.join(p, BLOB_NAME) for p in parts.paths)
    resident = sum(fsutil.resident_nbytes(blob) for blob in blobs)
    return Residency(blobs, resident, sum(index.blob_nbytes for index in parts.indexes))


def warm(path: str | os.PathLike[str], progress: Progress | None = None) -> Residency:
    """Read every blob once so that every process on this node then maps cached pages.

    Run it once per node before training; the kernel may evict pages again
    under memory pressure, which the returned residency shows.
    """
    progress = progress or SilentProgress()
    parts = Parts(path)
    progress.stage("warm", len(parts.paths), sum(index.blob_nbytes for index in parts.indexes))
    for part in parts.paths:
        fsutil.load_into_page_cache(os.path.join(part, BLOB_NAME), lambda nbytes: progress.advance(0, nbytes))
        progress.advance(1, 0)
    return residency(path)
