"""Lock files: one process at a time holds a path's lock, without waiting, on any platform.

flock(2) on POSIX, a locked byte on Windows (msvcrt); the facilities are fsutil's, so a test
that takes them away there takes them away here.
"""

from __future__ import annotations

import contextlib
import errno
import os
import secrets
import stat
from collections.abc import Iterator

from . import fsutil


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
        with fsutil.io_errors_ignored():
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
    if fsutil.fcntl is None:
        if fsutil.msvcrt is None:
            raise OSError(errno.ENOSYS, "no way to lock a file on this platform (neither fcntl nor msvcrt)")
        try:
            fsutil.msvcrt.locking(fd, fsutil.msvcrt.LK_NBLCK, 1)
        except OSError:
            return False
        return True
    try:
        fsutil.fcntl.flock(fd, fsutil.fcntl.LOCK_EX | fsutil.fcntl.LOCK_NB)
    except BlockingIOError:
        return False
    return True


def _open_lock_file(path: str) -> int:
    """Open (or create) the lock file without blocking or following a link; OSError unless it is
    a regular file (a link in its place would have the lock's writes land in the file it names)."""
    if os.path.islink(path):  # also where there is no O_NOFOLLOW
        raise OSError(errno.EINVAL, f"the lock file {path} is a symbolic link, not a regular file")
    fd = os.open(path, os.O_RDWR | os.O_CREAT | fsutil.NONBLOCK | fsutil.NOFOLLOW | fsutil.BINARY, 0o644)
    mode = os.fstat(fd).st_mode
    if not stat.S_ISREG(mode):
        os.close(fd)
        raise OSError(errno.EINVAL, f"the lock file {path} is {fsutil.file_type(mode)}, not a regular file")
    return fd


LOCK_TOKEN_OFFSET = 1  # after the byte that msvcrt locks, so another handle may read the token


def _write_token(fd: int) -> bytes:
    """Write a random token into the lock file ``fd`` holds; return it."""
    token = secrets.token_hex(16).encode("ascii")
    fsutil.write_all_at(fd, token, LOCK_TOKEN_OFFSET)
    return token


def _path_holds(path: str, token: bytes) -> bool:
    """Whether ``path`` still names the lock file we wrote ``token`` into (another process may have
    removed it between our open and our lock, or a person since). OSError unless it is a regular file."""
    try:
        check = fsutil.open_regular(path)
    except FileNotFoundError:
        return False
    except fsutil.NotRegularFile as exc:
        raise OSError(errno.EINVAL, f"the lock file {path} is {exc}") from None  # swapped since opened
    try:
        return fsutil.read_at(check, len(token), LOCK_TOKEN_OFFSET) == token
    finally:
        os.close(check)
