"""The page cache: what of a file is cached, advice on how it will be read, reading it in.

Advice only where the platform has it (posix_fadvise, mincore, RWF_NOWAIT reads: Linux);
elsewhere each call does nothing or says it cannot tell. The facilities are fsutil's, so a
test that takes them away there takes them away here.
"""

from __future__ import annotations

import contextlib
import ctypes
import io
import mmap
import os
import stat
from collections import deque
from collections.abc import Callable, Iterator, Sequence

import numpy as np

from . import fsutil


def resident_nbytes(fd: int, nbytes: int) -> int | None:
    """How many of the first ``nbytes`` of an open file are in the page cache now.

    mincore(2) over a read-only mapping of the descriptor; None where the
    platform has no mincore (Windows) or does not support it here.
    """
    if fsutil.mincore is None:
        return None
    if nbytes == 0:
        return 0
    pages = np.zeros(-(-nbytes // mmap.PAGESIZE), dtype=np.uint8)
    with mmap.mmap(fd, nbytes, access=mmap.ACCESS_READ) as mapping:
        view = np.frombuffer(mapping, dtype=np.uint8)
        status = fsutil.mincore(view.ctypes.data, nbytes, pages.ctypes.data)
        del view
    if status != 0:
        code = ctypes.get_errno()
        if code in fsutil.UNSUPPORTED:
            return None
        raise OSError(code, os.strerror(code))
    return min(nbytes, int(np.count_nonzero(pages & 1)) * mmap.PAGESIZE)


WARM_CHUNK_NBYTES = 8 << 20


def advise(fd: int, nbytes: int, advice: str) -> None:
    """Tell the kernel how the first ``nbytes`` of ``fd`` will be read: "sequential" or "willneed".

    Advice only: nothing where there is no posix_fadvise (macOS, Windows) or
    the file system refuses it.
    """
    if fsutil.posix_fadvise is None:
        return
    flag = os.POSIX_FADV_SEQUENTIAL if advice == "sequential" else os.POSIX_FADV_WILLNEED
    with contextlib.suppress(OSError):
        fsutil.posix_fadvise(fd, 0, nbytes, flag)


READ_AHEAD_FILES = 256
READ_AHEAD_NBYTES = 32 << 20
READ_AHEAD_MAX_FILE_NBYTES = 4 << 20
CACHED_PROBE_NBYTES = 64 << 10


def read_ahead(
    paths: Sequence[str], ahead_files: int = READ_AHEAD_FILES, ahead_nbytes: int = READ_AHEAD_NBYTES
) -> Iterator[str]:
    """Yield ``paths`` in order; when their pages are not cached, first ask the kernel to read
    the files ahead (posix_fadvise WILLNEED): up to ``ahead_files`` files, ``ahead_nbytes`` in all.

    Small files read one after the other each wait for the disk; asked for
    together, their reads overlap and merge (10,000 small files scanned from
    a cold cache: 1.9 s one by one, 1.0 s asked 32 files ahead, 0.55 s
    asked 256 ahead, as fast as from the cache). Whether they are cached is
    probed once, on the last path, by a read that never waits (RWF_NOWAIT),
    so cached files cost nothing more. Advice only: nothing where there is
    no posix_fadvise (macOS, Windows). A path that stat finds is not a
    regular file of at most READ_AHEAD_MAX_FILE_NBYTES is passed over
    unopened; one swapped in after the stat is opened without blocking, as
    the sources are (fsutil.open_regular_sized), and closed again. Whoever reads a
    path names any problem with it.
    """
    if fsutil.posix_fadvise is None or not paths or _is_cached(paths[-1]):
        yield from paths
        return
    advised_nbytes: deque[int] = deque()  # of the files from the one yielded next on
    pending = 0
    advised = 0
    for k, path in enumerate(paths):
        while advised < len(paths) and advised - k < ahead_files and (pending < ahead_nbytes or advised == k):
            nbytes = _will_need(paths[advised])
            advised_nbytes.append(nbytes)
            pending += nbytes
            advised += 1
        yield path
        pending -= advised_nbytes.popleft()


def _is_cached(path: str) -> bool:
    """Whether the start of the regular file at ``path`` is in the page cache; False when unknown.

    A read that never waits, not resident_nbytes: Linux's mincore reports a
    file's cached pages only to its owner or to a process that may write it,
    and sources are often neither.
    """
    if fsutil.preadv is None or fsutil.RWF_NOWAIT is None:
        return False
    try:
        if not stat.S_ISREG(os.stat(path).st_mode):
            return True  # nothing to read ahead
        fd, nbytes = fsutil.open_regular_sized(path)
    except (OSError, fsutil.NotRegularFile):
        return True
    try:
        wanted = min(nbytes, CACHED_PROBE_NBYTES)
        return fsutil.preadv(fd, [bytearray(wanted)], 0, fsutil.RWF_NOWAIT) == wanted
    except OSError:  # EAGAIN: not cached; EOPNOTSUPP: cannot tell
        return False
    finally:
        os.close(fd)


def _will_need(path: str) -> int:
    """Ask for the regular file at ``path`` to be read into the page cache; the bytes asked for."""
    with contextlib.suppress(OSError, fsutil.NotRegularFile):
        status = os.stat(path)  # never opens what is not a regular file
        if not stat.S_ISREG(status.st_mode) or not 0 < status.st_size <= READ_AHEAD_MAX_FILE_NBYTES:
            return 0
        fd, nbytes = fsutil.open_regular_sized(path)
        try:
            advise(fd, nbytes, "willneed")
            return nbytes
        finally:
            os.close(fd)
    return 0


def load_into_page_cache(fd: int, nbytes: int, on_progress: Callable[[int], None] | None = None) -> int:
    """Read the first ``nbytes`` of an open file once, sequentially, so its pages are cached.

    Reads only through ``fd`` and never past ``nbytes``; returns how many
    bytes were read, fewer only if the file was truncated meanwhile.
    """
    advise(fd, nbytes, "sequential")
    chunk = memoryview(bytearray(min(WARM_CHUNK_NBYTES, nbytes)))
    done = 0
    with io.FileIO(fd, "r", closefd=False) as fp:
        fp.seek(0)
        while done < nbytes:
            count = fp.readinto(chunk[: min(len(chunk), nbytes - done)])
            if not count:
                break
            done += count
            if on_progress is not None:
                on_progress(count)
    return done
