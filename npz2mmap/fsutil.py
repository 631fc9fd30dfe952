"""File-system operations beyond portable os: opening without blocking, positioned I/O, reserve, exchange.

Each degrades to a correct, maybe slower, path where the platform or file
system lacks it (macOS, Windows). Which facilities exist is decided once, at
import, so a test can take them away here and in spawned workers alike;
locks.py and pagecache.py use them from here.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import importlib
import os
import shutil
import stat
from collections.abc import Callable, Iterator
from types import ModuleType
from typing import Any, TypeGuard

# For tests only: comma-separated facilities to behave as if missing (fcntl,
# pread, pwrite, preadv, posix_fadvise, fallocate, renameat2, copy_file_range,
# sync_file_range), read at import so that
# spawned workers, which import afresh, inherit the choice with the environment.
WITHOUT_ENV = "NPZ2MMAP_WITHOUT"
_WITHOUT = frozenset(os.environ.get(WITHOUT_ENV, "").split(","))


def _import(name: str) -> ModuleType | None:
    if name in _WITHOUT:
        return None
    try:
        return importlib.import_module(name)
    except ImportError:
        return None


def _os_function(name: str) -> Callable[..., Any] | None:
    return None if name in _WITHOUT else getattr(os, name, None)


fcntl = _import("fcntl")  # not on Windows
msvcrt = _import("msvcrt")  # only on Windows
pread = _os_function("pread")  # not on Windows
pwrite = _os_function("pwrite")  # not on Windows
posix_fadvise = _os_function("posix_fadvise")  # not on macOS or Windows
copy_file_range = _os_function("copy_file_range")  # Linux only
preadv = _os_function("preadv")  # not on Windows
RWF_NOWAIT = getattr(os, "RWF_NOWAIT", None)  # Linux only

UNSUPPORTED = {errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP, errno.ENOTSUP}
# Opening a FIFO blocks until a writer comes; O_NONBLOCK returns at once, and
# the type of what was opened is then checked on the descriptor itself.
NONBLOCK = getattr(os, "O_NONBLOCK", 0)
NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)
# Windows opens descriptors in text mode, which would turn b"\n" into b"\r\n".
BINARY = getattr(os, "O_BINARY", 0)
_READ_FLAGS = os.O_RDONLY | NONBLOCK | getattr(os, "O_NOCTTY", 0) | BINARY


class NotRegularFile(ValueError):
    """What was opened is a FIFO, a device, a directory...: never read from it."""


def open_regular(path: str) -> int:
    """A blocking read-only descriptor of the regular file at ``path``.

    Opened without blocking and checked with fstat on the descriptor, so a
    FIFO or a device in the file's place (even one swapped in after a check
    of the path) is refused instead of hanging or reading without end.
    Raises OSError from open(2), NotRegularFile naming what was found.
    """
    fd = open_regular_sized(path)[0]
    try:
        if NONBLOCK and hasattr(os, "set_blocking"):
            os.set_blocking(fd, True)
    except BaseException:
        os.close(fd)
        raise
    return fd


def open_regular_sized(path: str) -> tuple[int, int]:
    """open_regular's descriptor, left non-blocking, and the file's size, from the fstat that
    checked its type.

    For a descriptor only ever read at an offset (read_at): O_NONBLOCK changes
    nothing for reads of a regular file, so it is not cleared (one system call
    less per file). A buffered reader should use open_regular.
    """
    fd = os.open(path, _READ_FLAGS)
    try:
        status = os.fstat(fd)
        check_regular(status.st_mode)
        return fd, status.st_size
    except BaseException:
        os.close(fd)
        raise


def absolute_path(path: str | os.PathLike[str]) -> str:
    """The absolute path of the file the system opens for ``path``.

    os.path.abspath drops ``link/..`` lexically, where POSIX goes up from the link's target: a
    ``..`` is resolved here as the system resolves it (realpath of the path up to the last
    ``..``). Windows resolves ``..`` lexically itself, so there abspath is the answer.
    """
    text = os.fspath(path)
    parts = text.split("/")
    if os.path.sep != "/" or ".." not in parts:
        return os.path.abspath(text)
    last = len(parts) - 1 - parts[::-1].index("..")
    head = "/".join(parts[: last + 1]) or "/"
    return os.path.normpath(os.path.join(os.path.realpath(head), *parts[last + 1 :]))


def check_regular(mode: int) -> None:
    """NotRegularFile, naming what it is, unless ``mode`` (an st_mode) is a regular file's."""
    if not stat.S_ISREG(mode):
        raise NotRegularFile(f"{file_type(mode)}, not a regular file")


def describe_kind(path: str) -> str:
    """What is at ``path`` when it is not a regular file, for a message: "a pipe (FIFO)", "a broken link"...

    Uses stat, which never blocks, not open.
    """
    try:
        return file_type(os.stat(path).st_mode)
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            return "a symbolic link loop"
        if exc.errno == errno.ENOENT:
            return "a broken link"
        return f"not readable ({exc.strerror})"


def file_type(mode: int) -> str:
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
    """A libc function of this process, or None where there is none (Windows, macOS, tests)."""
    if name.removesuffix("64") in _WITHOUT:
        return None
    try:
        function = getattr(ctypes.CDLL(None, use_errno=True), name)
    except (AttributeError, OSError, TypeError):  # TypeError: Windows has no "this process" library
        return None
    function.argtypes = argtypes
    function.restype = ctypes.c_int
    return function


fallocate = _libc_function("fallocate64", ctypes.c_int, ctypes.c_int, ctypes.c_int64, ctypes.c_int64)
renameat2 = _libc_function(
    "renameat2", ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint
)
mincore = _libc_function("mincore", ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p)
sync_file_range = _libc_function(
    "sync_file_range", ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint
)
_SYNC_FILE_RANGE_WRITE = 2


def read_at(fd: int, nbytes: int, offset: int) -> bytes:
    """Up to ``nbytes`` from ``offset``: pread(2) where there is one, else seek and read.

    The fallback moves the descriptor's position, so it is only for a
    descriptor that one thread of one process uses at a time.
    """
    if pread is not None:
        return bytes(pread(fd, nbytes, offset))
    os.lseek(fd, offset, os.SEEK_SET)
    return os.read(fd, nbytes)


def write_all_at(fd: int, data: bytes | bytearray | memoryview, offset: int) -> None:
    """Write every byte of ``data`` at ``offset``: pwrite(2) where there is one, else seek and write.

    Each call may write fewer bytes than asked, so loop. The fallback moves
    the descriptor's position: every writer opens its own descriptor.
    """
    view = memoryview(data)
    while view:
        if pwrite is not None:
            written = pwrite(fd, view, offset)
        else:
            os.lseek(fd, offset, os.SEEK_SET)
            written = os.write(fd, view)
        view = view[written:]
        offset += written


def start_writeback(fd: int, offset: int, nbytes: int) -> None:
    """Start writing ``nbytes`` at ``offset`` of ``fd`` to disk, without waiting for it.

    The disk then works while the copy goes on, and the final fsync, which
    nothing runs beside, finds little left to write. Advice only: where there
    is no sync_file_range (macOS, Windows) or it fails, nothing happens, and
    the fsync still writes everything.
    """
    if sync_file_range is not None and nbytes > 0:
        sync_file_range(fd, offset, nbytes, _SYNC_FILE_RANGE_WRITE)


def reserve(fd: int, nbytes: int) -> None:
    """Allocate the first ``nbytes`` of ``fd`` on disk now, so a full disk fails here and not halfway.

    Uses fallocate(2); where there is none (macOS, Windows) or the file
    system refuses it, writes zeros instead: slower, but a full disk still
    fails here, and a later write through a mapping cannot die of SIGBUS.
    Raises OSError (ENOSPC on a full disk).
    """
    if nbytes == 0:
        return
    if fallocate is not None:
        if fallocate(fd, 0, 0, nbytes) == 0:
            return
        code = ctypes.get_errno()
        if code not in UNSUPPORTED:
            raise OSError(code, os.strerror(code))
    _write_zeros(fd, nbytes)


COPY_CHUNK_NBYTES = 8 << 20


def copy_range(src_fd: int, dst_fd: int, nbytes: int, src_offset: int, dst_offset: int) -> None:
    """Copy ``nbytes`` from ``src_offset`` of one file to ``dst_offset`` of another.

    copy_file_range(2) keeps the bytes in the kernel (or shares extents, on
    file systems that can); where there is none (macOS, Windows) or the file
    system refuses it, reads and writes in chunks of COPY_CHUNK_NBYTES.
    Raises OSError, also when the source ends early.
    """
    done = 0
    if copy_file_range is not None:
        try:
            while done < nbytes:
                count = copy_file_range(
                    src_fd,
                    dst_fd,
                    min(COPY_CHUNK_NBYTES, nbytes - done),
                    src_offset + done,
                    dst_offset + done,
                )
                if count == 0:
                    break
                done += count
        except OSError as exc:
            if exc.errno not in UNSUPPORTED | {errno.EXDEV}:
                raise
    while done < nbytes:
        chunk = read_at(src_fd, min(COPY_CHUNK_NBYTES, nbytes - done), src_offset + done)
        if not chunk:
            raise OSError(errno.EIO, f"file ends {nbytes - done} bytes early")
        write_all_at(dst_fd, chunk, dst_offset + done)
        done += len(chunk)


ZEROS_CHUNK_NBYTES = 8 << 20


def _write_zeros(fd: int, nbytes: int) -> None:
    zeros = bytes(min(ZEROS_CHUNK_NBYTES, nbytes))
    for offset in range(0, nbytes, len(zeros)):
        write_all_at(fd, memoryview(zeros)[: min(len(zeros), nbytes - offset)], offset)
    os.fsync(fd)


def exchange(path_a: str, path_b: str) -> bool:
    """Atomically swap two paths with renameat2(RENAME_EXCHANGE); False where unsupported."""
    if renameat2 is None:
        return False
    if renameat2(_AT_FDCWD, os.fsencode(path_a), _AT_FDCWD, os.fsencode(path_b), _RENAME_EXCHANGE) == 0:
        return True
    code = ctypes.get_errno()
    if code in UNSUPPORTED:
        return False
    raise OSError(code, os.strerror(code), path_a)


def is_io_error(exc: BaseException) -> TypeGuard[OSError]:
    """Whether ``exc`` is an error of a file call of ours, to be told as OutputError.

    An OSError a signal handler raised (TimeoutError from an alarm, say) has no
    errno, and is the caller's: it must go on unchanged.
    """
    return isinstance(exc, OSError) and exc.errno is not None


def reraise_if_from_a_handler(exc: BaseException) -> None:
    """Raise ``exc`` again if it is an OSError a signal handler raised (see is_io_error).

    For the ``except OSError`` that tells a file's problem: a TimeoutError from
    an alarm is not the file's, and must reach the caller as itself, never be
    taken for a bad file (and skipped) or a bad dataset.
    """
    if isinstance(exc, OSError) and not is_io_error(exc):
        raise exc


@contextlib.contextmanager
def io_errors_ignored() -> Iterator[None]:
    """Ignore the block's I/O errors, not an OSError that a signal handler raised (see is_io_error)."""
    try:
        yield
    except OSError as exc:
        if not is_io_error(exc):
            raise


def remove_tree(path: str) -> None:
    """Remove a directory tree as far as it can be, like rmtree's ignore_errors, but let a
    signal handler's exception through."""
    shutil.rmtree(path, onerror=_raise_unless_io_error)


def _raise_unless_io_error(function: object, path: str, exc_info: tuple[Any, BaseException, Any]) -> None:
    if not is_io_error(exc_info[1]):
        raise exc_info[1]


def fsync_dir(path: str) -> None:
    """Make a directory's entries (a rename, a new file) durable.

    Nothing on Windows, which cannot open a directory (NTFS journals its entries).
    """
    if os.name == "nt":
        return
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
