"""File-system operations beyond portable os: positioned I/O, reserve, exchange, lock, advice.

Each degrades to a correct, maybe slower, path where the platform or file
system lacks it (macOS, Windows). Which facilities exist is decided once, at
import, so a test can take them away here and in spawned workers alike.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import importlib
import io
import mmap
import os
import secrets
import shutil
import stat
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from types import ModuleType
from typing import Any, TypeGuard

import numpy as np

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
_RWF_NOWAIT = getattr(os, "RWF_NOWAIT", None)  # Linux only

_UNSUPPORTED = {errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP, errno.ENOTSUP}
# Opening a FIFO blocks until a writer comes; O_NONBLOCK returns at once, and
# the type of what was opened is then checked on the descriptor itself.
_NONBLOCK = getattr(os, "O_NONBLOCK", 0)
_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)
# Windows opens descriptors in text mode, which would turn b"\n" into b"\r\n".
BINARY = getattr(os, "O_BINARY", 0)
_READ_FLAGS = os.O_RDONLY | _NONBLOCK | getattr(os, "O_NOCTTY", 0) | BINARY


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
        if _NONBLOCK and hasattr(os, "set_blocking"):
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


def check_regular(mode: int) -> None:
    """NotRegularFile, naming what it is, unless ``mode`` (an st_mode) is a regular file's."""
    if not stat.S_ISREG(mode):
        raise NotRegularFile(f"{_file_type(mode)}, not a regular file")


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
        if code not in _UNSUPPORTED:
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
            if exc.errno not in _UNSUPPORTED | {errno.EXDEV}:
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
    if code in _UNSUPPORTED:
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
    held = take_lock(lock_path)
    if held is None:
        yield None
        return
    try:
        try:
            yield held.fd
        finally:
            held.release()
    finally:  # a Ctrl-C that cut the release short: once is enough, so the retry is not cut
        held.release()


class HeldLock:
    """A lock file taken by ``take_lock``; ``release`` gives it back, and finishes a release cut short."""

    def __init__(self, path: str, fd: int, token: bytes) -> None:
        self.path = path
        self.fd = fd
        self.token = token
        self.owner_pid = os.getpid()

    def release(self) -> None:
        """Remove the lock file while it is still ours, then close it; a no-op once done.

        A forked child's copy does nothing: the lock and the descriptor are its parent's.
        """
        if self.fd < 0 or os.getpid() != self.owner_pid:
            return
        # Only while the path still names our file: one removed by hand may have been
        # replaced by another process's lock since.
        with io_errors_ignored():
            if _path_holds(self.path, self.token):
                os.unlink(self.path)
        fd, self.fd = self.fd, -1
        os.close(fd)


def take_lock(lock_path: str, held_in: list[HeldLock] | None = None) -> HeldLock | None:
    """Lock ``lock_path`` without waiting; None if another process holds it (see exclusive_lock).

    The lock is also put in ``held_in`` before this returns, so that a caller
    interrupted as the call returns still finds it to release.
    """
    while True:
        fd = _open_lock_file(lock_path)
        held = None
        try:  # from the open on: a lock taken and then interrupted is never left held
            locked = _try_lock(fd)
            if locked:
                token = _write_token(fd)
                if _path_holds(lock_path, token):
                    held = HeldLock(lock_path, fd, token)
                    if held_in is not None:
                        held_in.append(held)
                    return held
        except BaseException:
            if held is None:
                os.close(fd)
            else:  # the descriptor is held's now, and released once whoever else releases it
                held.release()
            raise
        os.close(fd)
        if not locked:
            return None


def remove_free_lock_file(lock_path: str) -> None:
    """Remove a lock file that no process holds, as one cut short between its creation and its lock.

    Taken and given back, which removes it; a process that opened it meanwhile
    finds it gone once it has the lock, and retries (see exclusive_lock).
    """
    with contextlib.suppress(OSError):
        held = take_lock(lock_path)
        if held is not None:
            held.release()


def _try_lock(fd: int) -> bool:
    """Lock ``fd`` without waiting: flock(2) on POSIX, its first byte on Windows.

    Raises OSError on a platform with neither.
    """
    if fcntl is None:
        if msvcrt is None:
            raise OSError(errno.ENOSYS, "no way to lock a file on this platform (neither fcntl nor msvcrt)")
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


def _open_lock_file(path: str) -> int:
    """Open (or create) the lock file without blocking or following a link; OSError unless it is
    a regular file (a link in its place would have the lock's writes land in the file it names)."""
    if os.path.islink(path):  # also where there is no O_NOFOLLOW
        raise OSError(errno.EINVAL, f"the lock file {path} is a symbolic link, not a regular file")
    fd = os.open(path, os.O_RDWR | os.O_CREAT | _NONBLOCK | _NOFOLLOW | BINARY, 0o644)
    mode = os.fstat(fd).st_mode
    if not stat.S_ISREG(mode):
        os.close(fd)
        raise OSError(errno.EINVAL, f"the lock file {path} is {_file_type(mode)}, not a regular file")
    return fd


LOCK_TOKEN_OFFSET = 1  # after the byte that msvcrt locks, so another handle may read the token


def _write_token(fd: int) -> bytes:
    """Write a random token into the lock file ``fd`` holds; return it."""
    token = secrets.token_hex(16).encode("ascii")
    write_all_at(fd, token, LOCK_TOKEN_OFFSET)
    return token


def _path_holds(path: str, token: bytes) -> bool:
    """Whether ``path`` still names the lock file we wrote ``token`` into (another process may have
    removed it between our open and our lock, or a person since). OSError unless it is a regular file."""
    try:
        check = open_regular(path)
    except FileNotFoundError:
        return False
    except NotRegularFile as exc:
        raise OSError(errno.EINVAL, f"the lock file {path} is {exc}") from None  # swapped since opened
    try:
        return read_at(check, len(token), LOCK_TOKEN_OFFSET) == token
    finally:
        os.close(check)


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


def resident_nbytes(fd: int, nbytes: int) -> int | None:
    """How many of the first ``nbytes`` of an open file are in the page cache now.

    mincore(2) over a read-only mapping of the descriptor; None where the
    platform has no mincore (Windows) or does not support it here.
    """
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


def advise(fd: int, nbytes: int, advice: str) -> None:
    """Tell the kernel how the first ``nbytes`` of ``fd`` will be read: "sequential" or "willneed".

    Advice only: nothing where there is no posix_fadvise (macOS, Windows) or
    the file system refuses it.
    """
    if posix_fadvise is None:
        return
    flag = os.POSIX_FADV_SEQUENTIAL if advice == "sequential" else os.POSIX_FADV_WILLNEED
    with contextlib.suppress(OSError):
        posix_fadvise(fd, 0, nbytes, flag)


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
    the sources are (open_regular_sized), and closed again. Whoever reads a
    path names any problem with it.
    """
    if posix_fadvise is None or not paths or _is_cached(paths[-1]):
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
    if preadv is None or _RWF_NOWAIT is None:
        return False
    try:
        if not stat.S_ISREG(os.stat(path).st_mode):
            return True  # nothing to read ahead
        fd, nbytes = open_regular_sized(path)
    except (OSError, NotRegularFile):
        return True
    try:
        wanted = min(nbytes, CACHED_PROBE_NBYTES)
        return preadv(fd, [bytearray(wanted)], 0, _RWF_NOWAIT) == wanted
    except OSError:  # EAGAIN: not cached; EOPNOTSUPP: cannot tell
        return False
    finally:
        os.close(fd)


def _will_need(path: str) -> int:
    """Ask for the regular file at ``path`` to be read into the page cache; the bytes asked for."""
    with contextlib.suppress(OSError, NotRegularFile):
        status = os.stat(path)  # never opens what is not a regular file
        if not stat.S_ISREG(status.st_mode) or not 0 < status.st_size <= READ_AHEAD_MAX_FILE_NBYTES:
            return 0
        fd, nbytes = open_regular_sized(path)
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
