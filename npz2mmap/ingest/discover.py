"""Turning the command line's INPUT arguments into the ordered list of sources.

A source is an NPZ file, a ``.npy`` file or, with ``sample_dirs``, a directory
that directly holds ``.npy`` files (one sample, one field per file).
"""

from __future__ import annotations

import errno
import glob
import heapq
import os
import posixpath
import stat
from collections.abc import Callable, Iterable, Sequence
from typing import NamedTuple

from .. import fsutil
from ..errors import FormatError, MissingInputError, NamedNpyError, SourceError
from ..format.files import decode_json, read_regular_file
from ..format.index import (
    BLOB_HEADER_NBYTES,
    BLOB_NAME,
    FORMAT_NAME,
    IDENTITY_MAGIC,
    INDEX_NAME,
    MAX_INDEX_NBYTES,
    SOURCES_NAME,
)
from ..format.manifest import MANIFEST_FORMAT, MANIFEST_NAME, MAX_MANIFEST_NBYTES
from .npz import NPY_SUFFIX
from .patterns import Pattern
from .sources import holds_npy_files, is_hidden, is_npy_path

NPZ_SUFFIX = ".npz"
LIST_PREFIX = "@"
# Two million paths of 100 characters fit; a file much larger is not a list.
MAX_LIST_CHARS = 256 << 20

# A found source: its absolute path, and the same with every symlink resolved
# (two sources with one real path are the same file).
Found = tuple[str, str]

# The file that makes a directory an npz2mmap dataset, the "format" it declares, and its largest size.
DATASET_MARKERS = {
    INDEX_NAME: (FORMAT_NAME, MAX_INDEX_NBYTES),
    MANIFEST_NAME: (MANIFEST_FORMAT, MAX_MANIFEST_NBYTES),
}


def discover_sources(
    inputs: Sequence[str | os.PathLike[str]], sample_dirs: bool = False, skip_bad: bool = False
) -> list[str]:
    """Expand files, directories and ``@list.txt`` files into absolute source paths.

    Directories are searched recursively (symlinks followed, loops skipped,
    hidden names skipped) for ``*.npz`` and ``*.npy`` files, or with
    ``sample_dirs`` for ``*.npz`` files and directories holding ``*.npy``
    files, all sorted by path; otherwise the order is the order given. A
    directory reached by several paths is walked once, under the one that
    sorts first, whatever order the file system lists them in.
    Raises SourceError for missing paths, duplicates, npz2mmap datasets (even
    with ``skip_bad``: naming one is a mistake, not a bad file), or when
    nothing is found, and for pipes, devices and broken links unless
    ``skip_bad``: then they are sources too, for the scan to refuse and
    record like any bad file.
    """
    found: list[Found] = []
    resolve = RealPaths()
    for item in inputs:
        text = os.fspath(item)
        if not text:
            raise MissingInputError("an empty INPUT (an unset shell variable?): name a file or directory")
        if text == LIST_PREFIX:
            raise SourceError(f"{LIST_PREFIX!r} names no list file: give {LIST_PREFIX}LIST, e.g. @train.txt")
        if text.startswith(LIST_PREFIX):
            try:
                found.extend(_expand_list_file(text[len(LIST_PREFIX) :], sample_dirs, skip_bad, resolve))
            except MissingInputError as exc:
                if not os.path.lexists(text):
                    raise
                raise MissingInputError(f"{exc} (to convert the path {text}, type ./{text})") from None
        else:
            found.extend(_expand_path(text, sample_dirs, skip_bad, resolve))
    if not found:
        shown = " ".join(os.fspath(i) for i in inputs)
        raise SourceError(f"no {NPZ_SUFFIX} or {NPY_SUFFIX} files found in: {shown}")
    _refuse_duplicates(found)
    return [path for path, _ in found]


def _expand_list_file(
    list_path: str, sample_dirs: bool, skip_bad: bool, resolve: RealPaths
) -> Iterable[Found]:
    """Each line is a path, exactly as written (spaces too), relative to the list file's
    directory; lines of white space are skipped, and so are comments, lines whose first
    character other than white space is ``#`` (``./#x.npz`` names such a path). The list
    is opened like a source (a pipe in its place is refused, never waited on)."""
    try:
        with open(fsutil.open_regular(list_path), encoding="utf-8-sig") as fp:
            text = fp.read(MAX_LIST_CHARS + 1)
        if len(text) > MAX_LIST_CHARS:
            raise SourceError(f"{list_path}: list file is longer than {MAX_LIST_CHARS:,} characters")
        # Read with universal newlines, so lines end at \n, \r\n or \r, and only there: not at
        # the other characters splitlines() breaks at (U+2028, U+0085, \x1c...), which a path may hold.
        lines = text.split("\n")
    except OSError as exc:
        fsutil.reraise_if_from_a_handler(exc)
        if exc.errno == errno.ENOENT:  # a usage mistake, as a missing input is
            raise MissingInputError(f"{list_path}: no such list file") from None
        raise SourceError(f"{list_path}: cannot read list file ({exc.strerror})") from None
    except fsutil.NotRegularFile as exc:
        raise SourceError(f"{list_path}: list file is {exc}") from None
    except UnicodeDecodeError:
        raise SourceError(f"{list_path}: list file is not UTF-8 text") from None
    base = os.path.dirname(fsutil.absolute_path(list_path))
    for number, line in enumerate(lines, start=1):
        if line.strip() and not line.lstrip().startswith("#"):
            try:
                yield from _expand_path(
                    os.path.join(base, line), sample_dirs, skip_bad, resolve, patterns=False
                )
            except SourceError as exc:
                where = f"{list_path}, line {number:,}"
                raise type(exc)(f"{where}: {exc}{_spaces_hint(base, line)}") from None


def _spaces_hint(base: str, line: str) -> str:
    """For a list line not found whose path, without the white space around it, exists: say so.

    A line names its path exactly, spaces included (a file may be named " a.npz").
    """
    trimmed = line.strip()
    if trimmed == line or not os.path.lexists(os.path.join(base, trimmed)):
        return ""
    return f" (the line has white space around {trimmed!r}, which exists: remove the white space to name it)"


def _expand_path(
    path: str, sample_dirs: bool, skip_bad: bool, resolve: RealPaths, patterns: bool = True
) -> list[Found]:
    if os.path.isdir(path):
        return _walk(path, sample_dirs, skip_bad, resolve)
    if sample_dirs and is_npy_named_with_sample_dirs(path):
        raise NamedNpyError(npy_with_sample_dirs(path))
    if os.path.isfile(path) or (skip_bad and os.path.lexists(path)):
        _refuse_blob_of_dataset(path)
        absolute = fsutil.absolute_path(path)
        return [(absolute, resolve(absolute))]
    if os.path.lexists(path):
        raise SourceError(f"{path}: {fsutil.describe_kind(path)}, not a regular file or directory")
    if patterns and glob.has_magic(path):  # a list's lines are paths exactly as written, never patterns
        return _expand_pattern(path, sample_dirs, skip_bad, resolve)
    raise MissingInputError(f"{path}: no such file or directory")


def _expand_pattern(text: str, sample_dirs: bool, skip_bad: bool, resolve: RealPaths) -> list[Found]:
    """A glob pattern (quoted, so the shell left it): the walk of the directory it starts from,
    by the walk's rules, taking what the pattern matches (``**`` any depth; directories matched
    taken whole; of files, those a walk would take: .npz, and .npy unless ``sample_dirs``).
    MissingInputError if it matches nothing."""
    pattern = Pattern(text)
    if os.pardir in pattern.below:  # a walk goes down from the base only
        raise MissingInputError(
            f"{text}: '{os.pardir}' after a wildcard is not supported (the search goes down from "
            f"{pattern.base}): put it before the first wildcard, or name the directories to search"
        )
    found = []
    if os.path.isdir(pattern.base):
        found = _walk(pattern.base, sample_dirs, skip_bad, resolve, pattern)
    if not found:
        raise MissingInputError(
            f"{text}: the pattern matches no .npz or .npy file, nor a directory holding one"
        )
    return found


def _taken_by_a_walk(name: str, sample_dirs: bool) -> bool:
    return name.lower().endswith(NPZ_SUFFIX) or (is_npy_path(name) and not sample_dirs)


def looks_like_sample_dirs(sources: Sequence[str]) -> bool:
    """Whether .npy files look like the fields of samples, one directory each: their names
    repeat across directories (s0/x.npy, s0/y.npy, s1/x.npy), unlike a flat folder's."""
    names_by_dir: dict[str, set[str]] = {}
    for path in sources:
        if is_npy_path(path):
            names_by_dir.setdefault(os.path.dirname(path), set()).add(os.path.basename(path))
    if not any(len(names) > 1 for names in names_by_dir.values()):
        return False
    seen: set[str] = set()
    for names in names_by_dir.values():
        if seen & names:
            return True
        seen |= names
    return False


def is_npy_named_with_sample_dirs(path: str) -> bool:
    """Whether ``path``, an input named with --sample-dirs, is a .npy file (refused: npy_with_sample_dirs)."""
    return is_npy_path(path) and os.path.lexists(path) and not os.path.isdir(path)


def npy_with_sample_dirs(path: str) -> str:
    """Why a .npy file cannot be named with --sample-dirs: it would be a sample of one field,
    ``arr_0``, beside samples whose fields are named by their files."""
    return (
        f"{path}: a .npy file named with --sample-dirs, where each sample is a directory "
        "of .npy files; name its directory instead"
    )


def _walk(
    top: str, sample_dirs: bool, skip_bad: bool, resolve: RealPaths, pattern: Pattern | None = None
) -> list[Found]:
    """Every source below ``top``, following directory links but never a loop twice.

    Directories are walked in the order of their absolute paths (each path
    sorts after its parent's), so one reached twice is walked under the path
    that sorts first, however the file system orders its listings.
    A source's absolute and real paths are its name joined to its directory's,
    found once per directory: no per-file path resolution. Messages name
    paths as reached from ``top``, as given. Hidden entries are skipped.
    With ``pattern`` (whose walk starts at ``top``), only what it matches is
    taken, directories it matches whole; directories where it can match
    nothing are not listed.
    """
    found: list[Found] = []
    seen_dirs: set[tuple[int, int]] = set()
    absolute = fsutil.absolute_path(top)
    taken = pattern is None or pattern.matches((), is_directory=True)  # 'd/**' names d itself
    pending = [(absolute, _Directory(top, absolute, resolve(absolute), (), taken))]
    while pending:
        directory = heapq.heappop(pending)[1]
        entries = _list_unseen(directory.path, seen_dirs)
        if entries is None:
            continue
        if directory.taken:
            _refuse_dataset(directory.path, entries)
        is_sample = sample_dirs and holds_npy_files(entries)
        if is_sample and directory.taken:
            found.append((directory.absolute, directory.real))
        for entry in entries:
            below = (*directory.below, entry.name)
            if directory.taken and is_hidden(entry.name):
                continue
            if _is(entry.is_dir):
                taken = directory.taken or pattern is None or pattern.matches(below, is_directory=True)
                if taken or (pattern is not None and pattern.may_match_below(below)):
                    inner = _Directory(entry.path, *resolve.entry(directory, entry), below, taken)
                    heapq.heappush(pending, (inner.absolute, inner))
                continue
            named = directory.taken or (pattern is not None and pattern.matches(below, is_directory=False))
            if is_sample:  # its other files, .npz ones too, are not sources: the directory is
                if named and not directory.taken and is_npy_path(entry.name):
                    raise NamedNpyError(npy_with_sample_dirs(entry.path))
                continue
            if named and _taken_by_a_walk(entry.name, sample_dirs):
                if not directory.taken:
                    _refuse_dataset(directory.path, entries)
                if not skip_bad and not _is(entry.is_file):
                    raise SourceError(f"{entry.path}: {fsutil.describe_kind(entry.path)}, not a regular file")
                found.append(resolve.entry(directory, entry))
    found.sort(key=_path_of)
    return found


def _list_unseen(path: str, seen_dirs: set[tuple[int, int]]) -> list[os.DirEntry[str]] | None:
    """The entries of the directory at ``path``, or None if it was listed before (by another path)."""
    try:
        info = os.stat(path)
        if (info.st_dev, info.st_ino) in seen_dirs:
            return None
        seen_dirs.add((info.st_dev, info.st_ino))
        return list(os.scandir(path))
    except OSError as exc:
        fsutil.reraise_if_from_a_handler(exc)
        raise SourceError(f"{path}: cannot list directory ({exc.strerror})") from None


def _refuse_dataset(path: str, entries: Iterable[os.DirEntry[str]]) -> None:
    """SourceError if the directory at ``path`` is an npz2mmap dataset: its blob is no sample.

    Also one whose index is missing or damaged: its ``data.npy`` still opens
    with the identity every npz2mmap blob starts with.
    """
    entries = list(entries)
    for entry in entries:
        if entry.name in DATASET_MARKERS and _is(entry.is_file) and _declares_npz2mmap(entry.path):
            raise SourceError(
                f"{path}: is an npz2mmap dataset (it holds {entry.name}), {_not_a_source(entry.name)}"
            )
    for entry in entries:
        if entry.name == BLOB_NAME and _is(entry.is_file) and is_npz2mmap_blob(entry.path):
            raise SourceError(f"{path}: holds an npz2mmap blob ({BLOB_NAME}) {_without_index()}")


def _without_index() -> str:
    """The rest of the message for a blob whose dataset has no valid index: what it is, the way out."""
    return (
        f"without a valid {INDEX_NAME}: a dataset, damaged or incomplete, not a source; "
        f"convert its sources again by naming the paths listed in its {SOURCES_NAME}"
    )


def is_npz2mmap_blob(blob_path: str) -> bool:
    """Whether the regular file at ``blob_path`` starts as every npz2mmap blob does (a 64-byte read)."""
    try:
        fd = fsutil.open_regular_sized(blob_path)[0]
    except (OSError, fsutil.NotRegularFile) as exc:
        fsutil.reraise_if_from_a_handler(exc)
        return False
    try:
        return fsutil.read_at(fd, len(IDENTITY_MAGIC), BLOB_HEADER_NBYTES) == IDENTITY_MAGIC
    except OSError as exc:
        fsutil.reraise_if_from_a_handler(exc)
        return False
    finally:
        os.close(fd)


def _refuse_blob_of_dataset(path: str) -> None:
    """SourceError for a ``data.npy`` named directly whose directory is an npz2mmap dataset."""
    if os.path.basename(path) != BLOB_NAME:
        return
    dataset_dir = os.path.dirname(path) or os.curdir
    for name in DATASET_MARKERS:
        marker_path = os.path.join(dataset_dir, name)
        if os.path.isfile(marker_path) and _declares_npz2mmap(marker_path):
            raise SourceError(
                f"{path}: lies in an npz2mmap dataset (its directory holds {name}), {_not_a_source(name)}"
            )
    if is_npz2mmap_blob(path):
        raise SourceError(f"{path}: is the blob of an npz2mmap dataset {_without_index()}")


def _not_a_source(marker: str) -> str:
    """The way out, for a dataset named as a source."""
    listed_in = SOURCES_NAME if marker == INDEX_NAME else f"parts' {SOURCES_NAME}"
    return (
        "not a source: join datasets with npz2mmap merge, or convert its sources again "
        f"by naming the paths listed in its {listed_in}"
    )


def _declares_npz2mmap(marker_path: str) -> bool:
    """Whether the file at ``marker_path`` (an index.json or manifest.json) is npz2mmap's.

    Called only for a regular file by stat; opened as one (a pipe swapped in is
    refused, never waited on) and read up to the size npz2mmap allows it.
    Other tools' files of the same name, and files that are not JSON, are not npz2mmap's.
    """
    expected_format, max_nbytes = DATASET_MARKERS[os.path.basename(marker_path)]
    try:
        document = decode_json(read_regular_file(marker_path, max_nbytes), marker_path)
    except FormatError:
        return False
    return isinstance(document, dict) and document.get("format") == expected_format


class _Directory(NamedTuple):
    """A directory to walk: its path as reached from the input, absolute, and with links resolved;
    its names below the walk's top, and whether it is taken whole (a pattern matched it)."""

    path: str
    absolute: str
    real: str
    below: tuple[str, ...]
    taken: bool


def _path_of(item: Found) -> str:
    return item[0]


class RealPaths:
    """``os.path.realpath`` of absolute paths, resolving each directory once.

    The real path of a name that is not a symlink is its directory's real path
    joined with the name. That holds for POSIX paths; elsewhere (Windows:
    junctions, case) every path is resolved in full.
    """

    def __init__(self) -> None:
        self._dirs: dict[str, str] = {}
        self._posix = os.path is posixpath

    def __call__(self, absolute: str) -> str:
        """The real path of ``absolute`` (a normalized absolute path)."""
        if not self._posix or os.path.islink(absolute):
            return os.path.realpath(absolute)
        head, name = os.path.split(absolute)
        if not name:  # the root
            return os.path.realpath(absolute)
        if head not in self._dirs:
            self._dirs[head] = os.path.realpath(head)
        return os.path.join(self._dirs[head], name)

    def entry(self, directory: _Directory, entry: os.DirEntry[str]) -> Found:
        """The absolute and real paths of an entry of ``directory``."""
        absolute = entry.path
        if directory.path != directory.absolute:
            absolute = os.path.join(directory.absolute, entry.name)
        if not self._posix or _is(entry.is_symlink):
            return absolute, os.path.realpath(absolute)
        if directory.real == directory.absolute:  # no link on the way: share the string
            return absolute, absolute
        return absolute, os.path.join(directory.real, entry.name)


def _is(test: Callable[[], bool]) -> bool:
    """A DirEntry type test that says False where following a link fails (a loop: ELOOP)."""
    try:
        return test()
    except OSError as exc:
        fsutil.reraise_if_from_a_handler(exc)
        return False


def _refuse_duplicates(found: list[Found]) -> None:
    """SourceError for a file found twice, by one path or two (compared after resolving symlinks).

    A pipe, device or broken link reached twice (only ``skip_bad`` keeps them)
    is no sample read twice: each path is skipped and listed by the scan.
    """
    first_seen: dict[str, str] = {}
    for path, real in found:
        if real in first_seen and _is_file_or_directory(real):
            other = first_seen[real]
            same = "given twice" if other == path else f"is the same file as {other}"
            raise SourceError(f"{path}: {same}; each sample file may appear only once")
        first_seen[real] = path


def _is_file_or_directory(path: str) -> bool:
    try:
        mode = os.stat(path).st_mode
    except OSError as exc:
        fsutil.reraise_if_from_a_handler(exc)
        return False
    return stat.S_ISREG(mode) or stat.S_ISDIR(mode)
