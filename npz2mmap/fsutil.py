"""File-system operations the writer needs beyond os: reserve, exchange, lock.

Each degrades gracefully where the platform or file system lacks it.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import io
import mmap
import os
import stat
from collections.abc import Callable, Iterator

import numpy as np

try:
    import fcntl
except ImportError:  # Windows
    fcntl = None  # type: ignore[assignment]
    import msvcrt

_UNSUPPORTED = {errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP, errno.ENOTSUP}
# Opening a FIFO blocks until a writer comes; O_NONBLOCK returns at once, and
# the type of what was opened is then checked on the descriptor itself.
_NONBLOCK = getattr(os, "O_NONBLOCK", 0)
_READ_FLAGS = os.O_RDONLY | _NONBLOCK | getattr(os, "O_NOCTTY", 0) | getattr(os, "O_BINARY", 0)


class NotRegularFile(ValueError):
    """What was opened is a FIFO, a device, a directory...: never read from it."""


def open_regular(path: str) -> int:
    """A blocking read-only descriptor of the regular file at ``path``.

    Opened without blocking and checked with fstat on the descriptor, so a
    FIFO or a device in the file's place (even one swapped in after a check
    of the path) is refused instead of hanging or reading without end.
    Raises OSError from open(2), NotRegularFile naming what was found.
    """
    fd = os.open(path, _READ_FLAGS)
    try:
        mode = os.fstat(fd).st_mode
        if not stat.S_ISREG(mode):
            raise NotRegularFile(f"{_file_type(mode)}, not a regular file")
        if _NONBLOCK and hasattr(os, "set_blocking"):
            os.set_blocking(fd, True)
        return fd
    except BaseException:
        os.close(fd)
        raise


def describe_kind(path: str) -> str:
    """What is at ``path`` when it is not a regular file, for a message: "a pipe (FIFO)", "a broken link"...

    Uses stat, which never blocks, not open.
    """
    try:
        return _file_type(os.stat(path).st_mode)
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            return "a symbolic link loop"
        if exc.errno == errno.ENOENT:
            return "a broken link"
        return f"not readable ({exc.strerror})"


def _file_type(mode: int) -> str:
    kinds = (
        (stat.S_ISDIR, "a directory"),
        (stat.S_ISFIFO, "a pipe (FIFO)"),
        (stat.S_ISCHR, "a character device"),
        (stat.S_ISBLK, "a block device"),
        (stat.S_ISSOCK, "a socket"),
    )
    return next((name for test, name in kinds if test(mode)), "of an unknown type")


_AT_FDCWD = -100
_RENAME_EXCHANGE = 2


def _libc_function(name: str, *argtypes: type) -> ctypes._CFuncPtr | None:  # type: ignore[name-defined]
    try:
        function = getattr(ctypes.CDLL(None, use_errno=True), name)
    except (AttributeError, OSError, TypeError):  # TypeError: Windows has no "this process" library
        return None
    function.argtypes = argtypes
    function.restype = ctypes.c_int
    return function


def reserve(fd: int, nbytes: int) -> None:
    """Allocate ``nbytes`` of disk for ``fd`` now, so a full disk fails here and not halfway.

    Uses fallocate(2) directly (glibc's posix_fallocate would emulate it by
    writing every block where unsupported); a no-op where unsupported.
    """
    fallocate = _libc_function("fallocate64", ctypes.c_int, ctypes.c_int, ctypes.c_int64, ctypes.c_int64)
    if fallocate is None or nbytes == 0:
        return
    if fallocate(fd, 0, 0, nbytes) != 0:
        code = ctypes.get_errno()
        if code not in _UNSUPPORTED:
            raise OSError(code, os.strerror(code))


def exchange(path_a: str, path_b: str) -> bool:
    """Atomically swap two paths with renameat2(RENAME_EXCHANGE); False where unsupported."""
    renameat2 = _libc_function(
        "renameat2", ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint
    )
    if renameat2 is None:
        return False
    if renameat2(_AT_FDCWD, os.fsencode(path_a), _AT_FDCWD, os.fsencode(path_b), _RENAME_EXCHANGE) == 0:
        return True
    code = ctypes.get_errno()
    if code in _UNSUPPORTED:
        return False
    raise OSError(code, os.strerror(code), path_a)


@contextlib.contextmanager
def exclusive_lock(lock_path: str) -> Iterator[int | None]:
    """Hold an exclusive lock file for the block; yield None if another process holds it.

    Yields the descriptor that holds the lock. The lock dies with the process
    that took it, but a process forked meanwhile shares it (flock) and must
    close that descriptor, or the lock would live on in it. The file is removed
    afterwards (not on Windows, which cannot remove an open file); a lock taken
    on a file that was removed meanwhile is retried, so two processes never
    both believe they hold it.
    """
    while True:
        fd = os.open(lock_path, os.O_RDWR | os.O_CREAT, 0o644)
        if not _try_lock(fd):
            os.close(fd)
            yield None
            return
        if _same_file(fd, lock_path):
            break
        os.close(fd)
    try:
        yield fd
    finally:
        with contextlib.suppress(FileNotFoundError, PermissionError):
            os.unlink(lock_path)
        os.close(fd)


def _try_lock(fd: int) -> bool:
    """Lock ``fd`` without waiting: flock(2) on POSIX, its first byte on Windows."""
    if fcntl is None:
        try:
            msvcrt.locking(fd, msvcrt.LK_NBLCK, 1)
        except OSError:
            return False
        return True
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return False
    return True


def _same_file(fd: int, path: str) -> bool:
    try:
        on_disk = os.stat(path)
    except FileNotFoundError:
        return False
    held = os.fstat(fd)
    return (held.st_dev, held.st_ino) == (on_disk.st_dev, on_disk.st_ino)


def fsync_dir(path: str) -> None:
    """Make a directory's entries (a rename, a new file) durable."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def resident_nbytes(fd: int, nbytes: int) -> int | None:
    """How many of the first ``nbytes`` of an open file are in the page cache now.

    mincore(2) over a read-only mapping of the descriptor; None where the
    platform has no mincore (Windows) or does not support it here.
    """
    mincore = _libc_function("mincore", ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p)
    if mincore is None:
        return None
    if nbytes == 0:
        return 0
    pages = np.zeros(-(-nbytes // mmap.PAGESIZE), dtype=np.uint8)
    with mmap.mmap(fd, nbytes, access=mmap.ACCESS_READ) as mapping:
        view = np.frombuffer(mapping, dtype=np.uint8)
        status = mincore(view.ctypes.data, nbytes, pages.ctypes.data)
        del view
    if status != 0:
        code = ctypes.get_errno()
        if code in _UNSUPPORTED:
            return None
        raise OSError(code, os.strerror(code))
    return min(nbytes, int(np.count_nonzero(pages & 1)) * mmap.PAGESIZE)


WARM_CHUNK_NBYTES = 8 << 20


def load_into_page_cache(fd: int, nbytes: int, on_progress: Callable[[int], None] | None = None) -> int:
    """Read the first ``nbytes`` of an open file once, sequentially, so its pages are cached.

    Reads only through ``fd`` and never past ``nbytes``; returns how many
    bytes were read, fewer only if the file was truncated meanwhile.
    """
    if hasattr(os, "posix_fadvise"):  # not on macOS or Windows
        with contextlib.suppress(OSError):  # advice only: some file systems refuse it
            os.posix_fadvise(fd, 0, nbytes, os.POSIX_FADV_SEQUENTIAL)
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
