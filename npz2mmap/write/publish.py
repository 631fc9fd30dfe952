"""The output directory's life: refuse, lock, stage, publish atomically, clean up.

A dataset is built in a hidden sibling directory of OUT and renamed into place
only when complete, so OUT is at every moment absent, the old dataset or the
new one; a lock file beside OUT keeps two conversions apart and lets the lock
holder remove what killed conversions left behind.
"""

from __future__ import annotations

import contextlib
import errno
import os
import secrets
import shutil
from collections.abc import Iterator, Sequence

from .. import fsutil, locks
from ..errors import FormatError, OutputError
from ..format.index import (
    BLOB_NAME,
    DATASET_FILES,
    INDEX_NAME,
    LOCK_SUFFIX,
    RETIRED_MARK,
    STAGING_MARK,
    load_index,
)
from ..format.manifest import MANIFEST_NAME, read_manifest
from ..ingest.patterns import Pattern, is_pattern
from ..parallel import interrupts_blocked
from ..text import human_bytes


def check_output(out_dir: str, overwrite: bool) -> None:
    """Refuse early what publish() would refuse late: an existing OUT without overwrite.

    With ``overwrite``, refuses anything but an npz2mmap dataset, a manifest
    directory written by ``merge``, or an empty directory. Refuses a symbolic
    link at OUT, and a parent of OUT that cannot hold it, with the reason.
    """
    if os.path.islink(out_dir):
        raise OutputError(f"{out_dir}: {_link_problem(out_dir)}")
    refuse_inside_a_dataset(out_dir)
    if not os.path.lexists(out_dir):
        check_parent(out_dir)
        return
    try:
        reason = _why_not_ours(out_dir)
    except OSError as exc:
        if not fsutil.is_io_error(exc):
            raise
        reason = _not_a_dataset(f"cannot look inside: {exc.strerror or exc}")
    if reason is not None:  # said at once: --overwrite would refuse it too
        raise OutputError(
            f"{out_dir}: exists and {reason}; choose another OUT "
            "(--overwrite replaces only a dataset or an empty directory)"
        )
    if not overwrite:
        raise OutputError(f"{out_dir}: already exists; pass --overwrite to replace it")


def refuse_inside_a_dataset(out_dir: str) -> None:
    """OutputError if OUT lies inside a dataset's directory: one more entry there makes that
    dataset one that verify and --overwrite refuse (a dataset holds its four files only)."""
    below = fsutil.absolute_path(out_dir)
    directory = os.path.dirname(below)
    while directory != below:
        if all(os.path.isfile(os.path.join(directory, name)) for name in (INDEX_NAME, BLOB_NAME)):
            raise OutputError(
                f"{out_dir}: inside the npz2mmap dataset {directory}, which must hold its own files "
                "only; choose an OUT outside it"
            )
        below, directory = directory, os.path.dirname(directory)


def refuse_output_inside_inputs(out: str, inputs: Sequence[str | os.PathLike[str]]) -> None:
    """OUT inside an input directory would be walked by the next conversion of it."""
    real_out = os.path.realpath(out)
    for item in inputs:
        path = os.fspath(item)
        real_input = os.path.realpath(path)
        if os.path.isdir(path) and os.path.commonpath([real_out, real_input]) == real_input:
            raise OutputError(f"{out}: is inside the input directory {path}; write the dataset elsewhere")


def refuse_output_a_pattern_takes(out: str, inputs: Sequence[str | os.PathLike[str]]) -> None:
    """OUT that a pattern in the inputs takes whole would be converted by the next run of it."""
    real_out = os.path.realpath(out)
    for item in inputs:
        path = os.fspath(item)
        if is_pattern(path) and _pattern_takes(Pattern(path), real_out):
            raise OutputError(
                f"{out}: the pattern {path} takes it (or a directory holding it); narrow the pattern "
                "(such as '*.npz') or write the dataset elsewhere"
            )


def _pattern_takes(pattern: Pattern, real_out: str) -> bool:
    """Whether the walk of ``pattern`` takes the directory ``real_out`` whole."""
    real_base = os.path.realpath(pattern.base)
    if os.path.commonpath([real_out, real_base]) != real_base or real_out == real_base:
        return False
    names = tuple(os.path.relpath(real_out, real_base).split(os.sep))
    return any(pattern.matches(names[:k], is_directory=True) for k in range(len(names) + 1))


def check_creatable_dir(out_dir: str) -> None:
    """OutputError unless OUT is a directory or can be made one (merge writes its manifest inside OUT)."""
    refuse_inside_a_dataset(out_dir)
    if os.path.isdir(out_dir):
        return
    if os.path.islink(out_dir):
        raise OutputError(f"{out_dir}: {_link_problem(out_dir)}")
    check_parent(out_dir)


def _link_problem(link: str) -> str:
    """Why a symbolic link at OUT is refused, and the way out: it names what the link points to."""
    broken = _unresolved_link(link)
    if broken is not None:
        return f"is {broken}; remove it, or choose another OUT"
    target = os.path.realpath(link)
    return (
        f"is a symbolic link to {target}; npz2mmap neither replaces a link nor writes a dataset "
        f"through one: name {target} itself as OUT, or remove the link"
    )


def _unresolved_link(path: str) -> str | None:
    """What ``path`` is when it is a link that leads nowhere (a loop, or to nothing), else None."""
    try:
        os.stat(path)
    except OSError as exc:
        fsutil.reraise_if_from_a_handler(exc)
        if exc.errno == errno.ELOOP:
            return "a symbolic link loop"
        if os.path.islink(path):
            return f"a broken symbolic link (to {os.path.realpath(path)}, which does not exist)"
    return None


def check_parent(out_dir: str) -> None:
    """OutputError unless the nearest ancestor of OUT that exists is a directory.

    A broken symbolic link or a file there would otherwise fail as "File exists".
    """
    ancestor = _nearest_existing_ancestor(out_dir)
    if os.path.isdir(ancestor):
        return
    where = f"{out_dir}: its {'parent' if ancestor == _parent(out_dir) else 'ancestor'} {ancestor} is"
    broken = _unresolved_link(ancestor)
    if broken is None:
        kind = "a file" if os.path.isfile(ancestor) else fsutil.describe_kind(ancestor)
        raise OutputError(f"{where} {kind}, not a directory; choose another OUT")
    if broken.startswith("a broken"):
        target = os.path.realpath(ancestor)
        raise OutputError(f"{where} {broken}; create {target}, or choose another OUT")
    raise OutputError(f"{where} {broken}; choose another OUT")


def _parent(out_dir: str) -> str:
    return os.path.dirname(os.path.normpath(out_dir)) or os.curdir


def _nearest_existing_ancestor(out_dir: str) -> str:
    """OUT's parent, or its nearest ancestor that exists (as a link, even a broken one) when it does not."""
    path = _parent(out_dir)
    while not os.path.lexists(path) and os.path.dirname(path) not in ("", path):
        path = os.path.dirname(path)
    return path if os.path.lexists(path) else os.curdir


def creation_error(out_dir: str, exc: OSError) -> OutputError:
    """The OutputError for ``exc``, raised while creating files beside OUT: the reason in words
    where one is known (a parent that is no directory, or that this user may not write)."""
    try:
        check_parent(out_dir)
    except OutputError as problem:
        return problem
    ancestor = _nearest_existing_ancestor(out_dir)
    if exc.errno in (errno.EACCES, errno.EPERM, errno.EROFS) and not os.access(ancestor, os.W_OK | os.X_OK):
        return OutputError(
            f"{out_dir}: cannot create it in {ancestor} ({exc.strerror}); "
            "choose an OUT in a directory you can write"
        )
    return OutputError(f"{out_dir}: cannot create the output beside it ({exc.strerror or exc})")


def _why_not_ours(path: str) -> str | None:
    """None when ``path`` is ours to replace, else why not, said after "exists and": file
    names alone prove nothing."""
    if os.path.islink(path):
        return _not_a_dataset("a symbolic link")
    if not os.path.isdir(path):
        return _not_a_dataset("not a directory")
    entries = set(os.listdir(path))
    if not entries:
        return None
    if INDEX_NAME in entries:
        reason = _why_not_a_dataset(path, entries)
        return None if reason is None else _not_a_dataset(reason)
    if MANIFEST_NAME in entries:
        return _why_not_a_manifest_dir(path, entries)
    return _not_a_dataset(f"it holds neither {INDEX_NAME} nor {MANIFEST_NAME}")


def _not_a_dataset(reason: str) -> str:
    return f"is not an npz2mmap dataset ({reason})"


def _why_not_a_dataset(path: str, entries: set[str]) -> str | None:
    foreign = sorted(entries - set(DATASET_FILES))
    if foreign:
        return f"it also holds {foreign[0]!r}"
    try:
        load_index(path)
    except FormatError as exc:
        return str(exc)
    return None


def _why_not_a_manifest_dir(path: str, entries: set[str]) -> str | None:
    """A manifest that parses, beside nothing but parts it lists that are datasets held inside."""
    try:
        listed = {os.path.normpath(part) for part in read_manifest(path)}
    except FormatError as exc:
        return _not_a_dataset(str(exc))
    for entry in sorted(entries - {MANIFEST_NAME}):
        inner = os.path.join(path, entry)
        if os.path.normpath(inner) not in listed:
            unlisted = f"it also holds {entry!r}, which its {MANIFEST_NAME} does not list as a part"
            return _not_a_dataset(unlisted)
        if os.path.islink(inner):  # its dataset is elsewhere, perhaps another's: never replaced from here
            return f"its part {entry!r} is a symbolic link, which --overwrite does not follow"
        if not os.path.isdir(inner):
            return _not_a_dataset(f"its part {entry!r} is not a directory")
        reason = _why_not_a_dataset(inner, set(os.listdir(inner)))
        if reason is not None:
            return _not_a_dataset(f"its part {entry!r} is not a dataset ({reason})")
    return None


@contextlib.contextmanager
def output_lock(out_dir: str) -> Iterator[int]:
    """Be the only converter writing OUT; remove what dead converters left beside it.

    Yields the descriptor holding the lock, which processes forked meanwhile
    must close (see locks.exclusive_lock). Raises OutputError when another
    conversion to OUT is running.
    """
    lock = None
    try:
        try:
            lock = take_output_lock(out_dir)
            yield lock.fd
        finally:
            if lock is not None:
                lock.release()
    finally:  # a Ctrl-C that cut the release short: once is enough, so the retry is not cut
        if lock is not None:
            lock.release()


class OutputLock:
    """OUT's lock, held from ``take_output_lock`` to ``release``, which a later call finishes if cut short."""

    def __init__(self, out_dir: str, held: locks.HeldLock, made_dirs: list[str]) -> None:
        self.out_dir = out_dir
        self.held = held
        self.fd = held.fd
        self.made_dirs = made_dirs  # OUT's ancestors made for the lock, deepest first

    def release(self) -> None:
        """Remove OUT's staging directories, give the lock back, remove the directories made for it.

        Every staging directory of OUT is the lock holder's, so none outlives
        the lock: not even one a Ctrl-C made before its maker could note it, or
        kept from being removed. In a forked child, does nothing: the lock is
        its parent's.
        """
        if os.getpid() != self.held.owner_pid:
            return
        if self.held.fd >= 0:
            remove_staging_dirs(self.out_dir)
        self.held.release()
        _remove_if_empty(self.made_dirs)


def take_output_lock(out_dir: str, held_in: list[OutputLock] | None = None) -> OutputLock:
    """Lock OUT (see output_lock) until ``release``; OutputError when another conversion holds it.

    The lock is also put in ``held_in`` before this returns, so that a caller
    interrupted as the call returns still finds it to release.
    """
    parent, name = os.path.split(fsutil.absolute_path(out_dir))
    made_dirs = _missing_dirs(parent)
    lock_path = os.path.join(parent, f".{name}{LOCK_SUFFIX}")
    taken: list[locks.HeldLock] = []
    try:  # taken and then interrupted, the lock is given back
        os.makedirs(parent, exist_ok=True)
        with interrupts_blocked():  # from the lock file's creation to ``taken``: none is left beside OUT
            held = locks.take_lock(lock_path, held_in=taken)
        if held is not None:
            _remove_leftovers(parent, name)
            sweep_leftovers_of(parent)  # a part's OUT: what a killed writer of OUT itself left
            lock = OutputLock(out_dir, held, made_dirs)
            if held_in is not None:
                held_in.append(lock)
            return lock
    except BaseException as exc:
        for each in taken:
            each.release()
        if not taken:  # the lock file may have been made, its descriptor lost to a Ctrl-C
            locks.remove_free_lock_file(lock_path)
        _remove_if_empty(made_dirs)
        if fsutil.is_io_error(exc):
            raise creation_error(out_dir, exc) from exc
        raise
    _remove_if_empty(made_dirs)
    raise OutputError(f"{out_dir}: another npz2mmap conversion or Writer is writing it")


def sweep_leftovers_of(out_dir: str) -> None:
    """Remove what a killed writer of ``out_dir`` left beside it, if no writer holds its lock:
    for outputs inside it (parts, a manifest), which do not take that lock themselves."""
    parent, name = os.path.split(fsutil.absolute_path(out_dir))
    lock_path = os.path.join(parent, f".{name}{LOCK_SUFFIX}")
    if not name or not os.path.lexists(lock_path):  # a killed writer leaves its lock file
        return
    try:
        held = locks.take_lock(lock_path)
    except OSError as exc:  # a directory not ours to write: nothing of ours to remove
        fsutil.reraise_if_from_a_handler(exc)
        return
    if held is None:
        return
    try:
        _remove_leftovers(parent, name)
    finally:
        held.release()


def _missing_dirs(path: str) -> list[str]:
    """``path`` and its ancestors that do not exist yet, deepest first."""
    missing = []
    while not os.path.lexists(path) and os.path.dirname(path) != path:
        missing.append(path)
        path = os.path.dirname(path)
    return missing


def _remove_if_empty(dirs: list[str]) -> None:
    """Remove the directories made for OUT's lock that nothing else has filled (OUT/ of a part)."""
    for path in dirs:
        try:
            os.rmdir(path)
        except OSError as exc:
            fsutil.reraise_if_from_a_handler(exc)
            return


def _remove_leftovers(parent: str, name: str) -> None:
    """Staging and retired directories of OUT whose converter was killed.

    Where directories cannot be swapped atomically, a converter killed between
    moving the old OUT aside and moving the new one in left OUT absent: its
    old dataset is put back in place (or, if that fails, left aside), never removed.
    """
    prefixes = (f".{name}{STAGING_MARK}", f".{name}{RETIRED_MARK}")
    leftovers = sorted(entry for entry in os.listdir(parent) if entry.startswith(prefixes))
    retired = [entry for entry in leftovers if entry.startswith(prefixes[1])]
    out_dir = os.path.join(parent, name)
    if len(retired) == 1 and not os.path.lexists(out_dir) and _holds_data(os.path.join(parent, retired[0])):
        leftovers.remove(retired[0])
        with contextlib.suppress(OSError):
            os.rename(os.path.join(parent, retired[0]), out_dir)
    for entry in leftovers:
        shutil.rmtree(os.path.join(parent, entry), ignore_errors=True)


def _holds_data(path: str) -> bool:
    """A dataset or a manifest directory of ours, not an empty directory: worth putting back."""
    try:
        return bool(os.listdir(path)) and _why_not_ours(path) is None
    except OSError as exc:
        fsutil.reraise_if_from_a_handler(exc)
        return False


def make_staging_dir(out_dir: str) -> str:
    """A hidden sibling of OUT, so the final rename stays on one filesystem; OutputError if it
    cannot be made.

    Created with the umask's permissions (not mkdtemp's 0700), since it becomes OUT.
    """
    parent, name = os.path.split(fsutil.absolute_path(out_dir))
    try:
        return _make_unique_dir(parent, f".{name}{STAGING_MARK}")
    except OSError as exc:
        if not fsutil.is_io_error(exc):
            raise
        raise creation_error(out_dir, exc) from exc


def free_nbytes(out: str) -> int | None:
    """Bytes free on the file system that will hold OUT, or None where unknown."""
    try:
        return shutil.disk_usage(os.path.dirname(fsutil.absolute_path(out))).free
    except OSError as exc:
        fsutil.reraise_if_from_a_handler(exc)
        return None


def check_free_space(out: str, needed_nbytes: int, free_nbytes: int | None) -> None:
    """Refuse, before anything is written, a dataset larger than the space free for it."""
    if free_nbytes is not None and needed_nbytes > free_nbytes:
        raise OutputError(
            f"{out}: the dataset needs {needed_nbytes:,} bytes ({human_bytes(needed_nbytes)}), "
            f"{free_nbytes:,} bytes ({human_bytes(free_nbytes)}) free on its file system"
        )


def _make_unique_dir(parent: str, prefix: str) -> str:
    while True:
        path = os.path.join(parent, prefix + secrets.token_hex(4))
        try:
            os.mkdir(path)
            return path
        except FileExistsError:
            continue


def publish(staging_dir: str, out_dir: str, overwrite: bool) -> None:
    """Rename the finished staging directory to OUT; an old OUT goes only after.

    Replacing swaps the two directories in one atomic step where the system
    can (the old dataset then sits at ``staging_dir`` for the caller to remove),
    so OUT is at every moment either the old or the new complete dataset.
    Elsewhere (macOS, Windows, file systems without RENAME_EXCHANGE) the old
    OUT is renamed aside first, so OUT is briefly absent; a converter killed
    right then leaves the old dataset aside, and the next conversion to OUT
    puts it back. Readers that have the old dataset open keep their mapping
    of the old files (on Windows, the rename then fails instead).
    """
    check_output(out_dir, overwrite)
    parent = os.path.dirname(fsutil.absolute_path(out_dir))
    if not os.path.lexists(out_dir):
        os.rename(staging_dir, out_dir)
        fsutil.fsync_dir(parent)
        return
    if fsutil.exchange(staging_dir, out_dir):
        fsutil.fsync_dir(parent)
        return
    retired = _make_unique_dir(parent, f".{os.path.basename(out_dir)}{RETIRED_MARK}")
    os.rename(out_dir, retired)
    try:
        os.rename(staging_dir, out_dir)
    except OSError:
        os.rename(retired, out_dir)
        raise
    fsutil.fsync_dir(parent)
    shutil.rmtree(retired, ignore_errors=True)


def remove_staging_dirs(out_dir: str) -> None:
    """Remove every staging directory of OUT: only for the holder of OUT's lock, whose they all are."""
    parent, name = os.path.split(fsutil.absolute_path(out_dir))
    with fsutil.io_errors_ignored():
        for entry in os.listdir(parent):
            if entry.startswith(f".{name}{STAGING_MARK}"):
                fsutil.remove_tree(os.path.join(parent, entry))


def remove_staging(staging_dir: str) -> None:
    fsutil.remove_tree(staging_dir)
