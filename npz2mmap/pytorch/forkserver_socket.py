"""The forkserver's listening socket, removed once its trainer is gone.

Under ``forkserver``, ``multiprocessing`` binds the server's socket as
``pymp-XXXXXXXX/listener-XXXXXXXX`` in the temporary directory of the process
that starts it (the trainer). A finalizer removes that directory at a normal
exit; after a ``kill -9`` nothing runs in the trainer. So the trainer marks
the directory as its own (``npz2mmap-trainer-PID-START``, an empty file), and:

- its workers outlive it for a moment (they watch it and exit when it is
  gone): the last thing they do is remove the socket and the mark, and the
  directory if nothing else is in it, once the trainer is provably dead;
- when nothing was left to do that (no worker was running, or all were
  killed with it), the next MmapLoader to start forkserver workers in the
  same temporary directory removes the directory: only one of this user
  holding nothing but forkserver sockets and marks, every one of a trainer
  provably dead.

Nothing else is ever removed, and nothing of a trainer that may still run.
"""

from __future__ import annotations

import contextlib
import os
import re
import stat
import time
from dataclasses import dataclass
from multiprocessing import util

# How long a worker waits, once its trainer's end of the pipes closed, for the
# trainer to be gone for the kernel too (dead or a zombie) before it removes anything.
TRAINER_EXIT_WAIT_S = 2.0
POLL_S = 0.02
TEMP_DIR_PREFIX = "pymp-"  # multiprocessing.util.get_temp_dir's
LISTENER_PREFIX = "listener-"  # multiprocessing.connection.arbitrary_address's
MARK = re.compile(r"npz2mmap-trainer-(\d+)-(\d+|none)")


@dataclass(frozen=True)
class ForkserverSocket:
    """One trainer's forkserver socket on disk, and how to tell that trainer is gone."""

    path: str
    trainer_pid: int
    trainer_start: str | None  # Linux: its start time in clock ticks, telling a reused pid apart

    @classmethod
    def of_this_process(cls, start_method: str) -> ForkserverSocket | None:
        """This process's forkserver socket (the server started now if need be); None but under forkserver.

        None too where the socket has no path (an abstract one) or this
        Python's forkserver keeps its address elsewhere: nothing is removed then.
        """
        if start_method != "forkserver":
            return None
        from multiprocessing import forkserver  # POSIX only

        forkserver.ensure_running()
        address = getattr(forkserver._forkserver, "_forkserver_address", None)
        if not isinstance(address, str) or util.is_abstract_socket_namespace(address):
            return None
        if not os.path.basename(os.path.dirname(address)).startswith(TEMP_DIR_PREFIX):
            return None
        remove_stale_dirs(os.path.dirname(os.path.dirname(address)))  # the temporary directory
        socket = cls(address, os.getpid(), start_time(os.getpid()))
        with contextlib.suppress(OSError):  # unmarked, the directory is only left alone
            with open(socket.mark_path, "a"):
                pass
        return socket

    @property
    def mark_path(self) -> str:
        """The empty file naming this trainer as the directory's owner."""
        name = f"npz2mmap-trainer-{self.trainer_pid}-{self.trainer_start or 'none'}"
        return os.path.join(os.path.dirname(self.path), name)

    def remove_if_trainer_gone(self, wait_s: float = TRAINER_EXIT_WAIT_S) -> None:
        """Remove the socket, then its directory if empty, once the trainer is dead (``wait_s`` at most)."""
        deadline = time.monotonic() + wait_s
        while not self.trainer_gone():
            if time.monotonic() >= deadline:
                return
            time.sleep(POLL_S)
        with contextlib.suppress(OSError):  # another worker of the trainer may have been first
            if stat.S_ISSOCK(os.lstat(self.path).st_mode):
                os.unlink(self.path)
        with contextlib.suppress(OSError):
            os.unlink(self.mark_path)
        with contextlib.suppress(OSError):  # not empty: the rest is the trainer's own, left as it is
            os.rmdir(os.path.dirname(self.path))

    def trainer_gone(self) -> bool:
        """Provably so: no process has its pid, or the one that has is a zombie or started at another time."""
        try:
            os.kill(self.trainer_pid, 0)
        except ProcessLookupError:
            return True
        except OSError:  # a process of another user has the pid: tell nothing
            return False
        if self.trainer_start is None:
            return False
        fields = stat_fields(self.trainer_pid)
        if fields is None:
            return False  # gone between the two looks, or no /proc: the next look tells
        state, started = fields[0], fields[19]
        return state in ("Z", "X", "x") or started != self.trainer_start


def stat_fields(pid: int) -> list[str] | None:
    """The fields of /proc/PID/stat after the command name (the state first), or None where unreadable."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as fp:
            text = fp.read().decode("ascii", "replace")
    except OSError:
        return None
    fields = text.rsplit(")", 1)[-1].split()
    return fields if len(fields) > 19 else None


def start_time(pid: int) -> str | None:
    """When process ``pid`` started, in clock ticks since boot (Linux), as /proc says it; None elsewhere."""
    fields = stat_fields(pid)
    return None if fields is None else fields[19]


def remove_stale_dirs(temp_dir: str) -> None:
    """Remove the ``pymp-*`` directories of ``temp_dir`` that trainers killed with their workers left.

    Only a directory of this user, not a link, holding nothing but
    forkserver sockets and at least one trainer's mark, every marked
    trainer provably dead. Anything else is left as it is.
    """
    try:
        names = [name for name in os.listdir(temp_dir) if name.startswith(TEMP_DIR_PREFIX)]
    except OSError:
        return
    for name in names:
        directory = os.path.join(temp_dir, name)
        entries = stale_entries(directory)
        if entries is None:
            continue
        with contextlib.suppress(OSError):
            for entry in entries:
                os.unlink(os.path.join(directory, entry))
            os.rmdir(directory)  # fails if anything came meanwhile: then it stays


def stale_entries(directory: str) -> list[str] | None:
    """The entries of a directory a dead trainer left (sockets and marks), or None if it is not one."""
    try:
        info = os.lstat(directory)
        if not stat.S_ISDIR(info.st_mode) or info.st_uid != os.geteuid():
            return None
        entries = os.listdir(directory)
        kinds = [os.lstat(os.path.join(directory, entry)).st_mode for entry in entries]
    except OSError:
        return None
    owners = []
    for entry, mode in zip(entries, kinds, strict=True):
        mark = MARK.fullmatch(entry)
        if mark is not None and stat.S_ISREG(mode) and 0 < int(mark.group(1)) < 2**31:
            owners.append(
                ForkserverSocket("", int(mark.group(1)), None if mark.group(2) == "none" else mark.group(2))
            )
        elif not (entry.startswith(LISTENER_PREFIX) and stat.S_ISSOCK(mode)):
            return None
    if not owners or not all(owner.trainer_gone() for owner in owners):
        return None
    return entries
