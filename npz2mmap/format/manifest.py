"""The parts of a dataset: manifest.json, the list of dataset directories read as one.

A multi-part dataset is either a list of dataset directories or a directory
holding ``manifest.json`` that names them (relative paths, in order). This
module reads that file, with bounds, makes its text (``merge`` writes it), and
resolves a dataset path to its parts; the parts' indexes are read by ``index.py`` (docs/FORMAT.md).
"""

from __future__ import annotations

import json
import os
from collections.abc import KeysView, Sequence
from collections.abc import Set as AbstractSet

from .. import fsutil
from ..errors import FormatError
from ..text import brief
from .files import decode_json, read_regular_file
from .index import INDEX_NAME

MANIFEST_NAME = "manifest.json"
MANIFEST_FORMAT = "npz2mmap-parts"
MANIFEST_VERSION = 1
# A manifest names parts by path: 16 MiB holds hundreds of thousands.
MAX_MANIFEST_NBYTES = 16 << 20

PathLike = str | os.PathLike[str]


def resolve_parts(source: PathLike | Sequence[PathLike]) -> list[str]:
    """The dataset directories a dataset path (or list of paths) stands for, in order."""
    return [part for _, parts in resolve_listed(source) for part in parts]


def resolve_listed(source: PathLike | Sequence[PathLike]) -> list[tuple[str | None, list[str]]]:
    """The dataset directories of ``source``, in order, grouped by the manifest.json that lists
    them (its path), or None for a directory given itself."""
    if isinstance(source, (str, os.PathLike)):
        path = os.fspath(source)
        _check_path(path, "dataset path")
        if is_manifest_dir(path):
            return [(os.path.join(path, MANIFEST_NAME), read_manifest(path))]
        return [(None, [path])]
    refuse_unordered(source)
    listed = [group for item in source for group in resolve_listed(item)]
    parts = [part for _, group in listed for part in group]
    if not parts:
        raise FormatError("no dataset parts given")
    repeated = _first_repeated(parts)
    if repeated is not None:
        raise FormatError(f"{repeated}: given twice; each part may appear only once")
    return listed


def is_unordered(items: object) -> bool:
    """Whether ``items`` is a set, whose order changes from run to run (a dict's keys keep theirs):
    never the order of parts or of inputs, which is the samples' order."""
    return isinstance(items, AbstractSet) and not isinstance(items, KeysView)


def refuse_unordered(parts: object) -> None:
    """TypeError for parts given as a set: its order, and the samples' with it, changes from run to run."""
    if is_unordered(parts):
        raise TypeError(
            "the parts are a set, whose order changes from run to run, and the samples' order with it: "
            "give a list, in the order the parts are read"
        )


def is_manifest_dir(path: str) -> bool:
    """Whether a dataset path is a directory of parts: it holds manifest.json and no index.json."""
    # lexists, not isfile: a manifest.json that is a pipe or a device is read (and refused), not ignored.
    return os.path.lexists(os.path.join(path, MANIFEST_NAME)) and not os.path.lexists(
        os.path.join(path, INDEX_NAME)
    )


def _check_path(part: str, where: str) -> None:
    """A path the operating system can take: no NUL, no text that has no bytes (a lone surrogate)."""
    try:
        if "\0" in part:
            raise ValueError
        os.fsencode(part)
    except (ValueError, UnicodeError):
        raise FormatError(f"{where}: part path {part!r} is not a valid file name") from None


def _first_repeated(parts: Sequence[str]) -> str | None:
    """The first part that names (through any path) a directory named earlier, if any."""
    seen: set[str] = set()
    for part in parts:
        real = os.path.realpath(part)
        if real in seen:
            return part
        seen.add(real)
    return None


def read_manifest(directory: str) -> list[str]:
    """Parts listed by ``directory/manifest.json``; raises FormatError if it is malformed."""
    path = os.path.join(directory, MANIFEST_NAME)
    document = decode_json(read_regular_file(path, MAX_MANIFEST_NBYTES), path)
    if not isinstance(document, dict) or document.get("format") != MANIFEST_FORMAT:
        raise FormatError(f"{path}: not an npz2mmap manifest (format {MANIFEST_FORMAT!r} expected)")
    version = document.get("version")
    if (
        type(version) is not int
        or version != MANIFEST_VERSION
        or set(document) != {"format", "version", "parts"}
    ):
        raise FormatError(f"{path}: manifest version {brief(version)} or keys not supported")
    parts = document["parts"]
    if not isinstance(parts, list) or not parts or not all(isinstance(p, str) and p for p in parts):
        raise FormatError(f"{path}: 'parts' must be a non-empty list of paths")
    for part in parts:
        _check_path(part, path)
    listed = [_part_path(directory, p) for p in parts]
    nested = next((part for part in listed if is_manifest_dir(part)), None)
    if nested is not None:
        raise FormatError(
            f"{path}: lists {nested}, itself a directory of parts (it holds {MANIFEST_NAME}); "
            "list its parts instead (npz2mmap merge takes both directories and writes one list)"
        )
    repeated = _first_repeated(listed)
    if repeated is not None:
        raise FormatError(f"{path}: lists part {repeated} twice; each part may appear only once")
    return listed


PartLabel = tuple[int, int] | None  # an index's provenance.part: (i, n), or None


def naming_parts(parts: Sequence[str]) -> str:
    """Parts given in a list, for a message: 'parts A to B', or 'part A'."""
    return f"parts {parts[0]} to {parts[-1]}" if len(parts) > 1 else f"part {parts[0]}"


def check_part_set(labelled: Sequence[tuple[str, PartLabel]], where: str) -> None:
    """FormatError unless the parts that record a part (i, n) are one whole run, listed in order.

    They must all have the same n and list each of 0..n-1 once, in increasing i:
    a part left from a run with another count, a missing or repeated part, or
    parts out of order would otherwise add, lose or move samples without a word.
    Parts that record none (plain conversions, merged datasets) are not
    constrained. ``where`` (a manifest, or the parts given to merge) starts the message.
    """
    numbered = [(path, label) for path, label in labelled if label is not None]
    if not numbered:
        return
    problem = (
        _other_count(numbered) or _listed_twice(numbered) or _missing(numbered) or _out_of_order(numbered)
    )
    if problem is not None:
        raise FormatError(f"{where}: {problem}")


def _other_count(numbered: list[tuple[str, tuple[int, int]]]) -> str | None:
    first, (i, n) = numbered[0]
    for path, (j, m) in numbered[1:]:
        if m != n:
            return (
                f"{path} is part {j} of {m}, but {first} is part {i} of {n}: a part of an earlier run "
                "with another count; remove it or convert it again"
            )
    return None


def _listed_twice(numbered: list[tuple[str, tuple[int, int]]]) -> str | None:
    seen: dict[int, str] = {}
    for path, (i, n) in numbered:
        if i in seen:
            return (
                f"part {i} of {n} is listed twice, as {seen[i]} and {path}; "
                "list only the one converted in this run"
            )
        seen[i] = path
    return None


def _missing(numbered: list[tuple[str, tuple[int, int]]]) -> str | None:
    """Distinct numbers below n (as the index reader ensures) miss one unless there are n;
    described by runs, never by counting to n, which a forged index may set to 2^62."""
    n = numbered[0][1][1]
    listed = sorted(i for _, (i, _) in numbered)
    if len(listed) == n:
        return None
    bounds = [-1, *listed, n]
    absent = [(low + 1, high - 1) for low, high in zip(bounds, bounds[1:], strict=False) if high - low > 1]
    present = (
        f"part {listed[0]} of {n} is" if len(listed) == 1 else f"parts {_numbers(_runs(listed))} of {n} are"
    )
    if n - len(listed) == 1:
        return (
            f"part {absent[0][0]} of {n} is missing ({present} listed): "
            f"convert it (--part {absent[0][0]}/{n}), then merge"
        )
    return (
        f"parts {_numbers(absent)} of {n} are missing ({present} listed): "
        f"convert them (--part I/{n} for each), then merge"
    )


def _out_of_order(numbered: list[tuple[str, tuple[int, int]]]) -> str | None:
    for (path, (i, n)), (later, (j, _)) in zip(numbered, numbered[1:], strict=False):
        if j < i:
            return (
                f"listed out of order: {path}, part {i} of {n}, before {later}, part {j} of {n}; "
                "list the parts in increasing order (as part-* sorts them), then merge"
            )
    return None


def _runs(values: list[int]) -> list[tuple[int, int]]:
    """Sorted numbers as runs of consecutive ones, (first, last) each."""
    runs: list[tuple[int, int]] = []
    for value in values:
        if runs and value == runs[-1][1] + 1:
            runs[-1] = (runs[-1][0], value)
        else:
            runs.append((value, value))
    return runs


def _numbers(runs: list[tuple[int, int]]) -> str:
    """Runs of part numbers for a message, long ones as first-last: '0, 1, 2' or '0-41, 43'."""
    return ", ".join(
        f"{first}-{last}" if last - first > 2 else ", ".join(map(str, range(first, last + 1)))
        for first, last in runs
    )


def _part_path(directory: str, part: str) -> str:
    """Where a listed part lies: its ``..`` taken as the system takes it, up from the directory
    a link leads to (a lexical join would read another dataset through a linked path)."""
    joined = os.path.join(directory, part)
    return fsutil.absolute_path(joined) if ".." in part.split("/") else os.path.normpath(joined)


def manifest_text(directory: str, parts: Sequence[str]) -> str:
    """The manifest naming ``parts``, relative to ``directory`` where possible: between their
    real paths, so that the manifest reads the same parts by any path that reaches it."""
    relative = [os.path.relpath(os.path.realpath(p), os.path.realpath(directory)) for p in parts]
    document = {"format": MANIFEST_FORMAT, "version": MANIFEST_VERSION, "parts": relative}
    return json.dumps(document, indent=1, sort_keys=True) + "\n"
