"""The page cache is npz2mmap's cache: fill it before training and see how much is resident."""

from __future__ import annotations

import os
from dataclasses import dataclass

from . import fsutil
from .progress import Progress, SilentProgress
from .spec import BLOB_NAME, load_index


@dataclass(frozen=True)
class Residency:
    blob_path: str
    resident_nbytes: int
    blob_nbytes: int

    @property
    def fraction(self) -> float:
        return self.resident_nbytes / self.blob_nbytes if self.blob_nbytes else 1.0


def residency(path: str | os.PathLike[str]) -> Residency:
    """How much of a dataset's blob is in the page cache. Raises FormatError, OSError."""
    index = load_index(path)
    blob_path = os.path.join(os.fspath(path), BLOB_NAME)
    return Residency(blob_path, fsutil.resident_nbytes(blob_path), index.blob_nbytes)


def warm(path: str | os.PathLike[str], progress: Progress | None = None) -> Residency:
    """Read the blob once so that every process on this node then maps cached pages.

    Run it once per node before training; the kernel may evict pages again
    under memory pressure, which the returned residency shows.
    """
    progress = progress or SilentProgress()
    index = load_index(path)
    blob_path = os.path.join(os.fspath(path), BLOB_NAME)
    progress.stage("warm", 1, index.blob_nbytes)
    fsutil.load_into_page_cache(blob_path, lambda nbytes: progress.advance(0, nbytes))
    return residency(path)
