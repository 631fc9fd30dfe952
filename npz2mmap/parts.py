"""Datasets made of parts: several dataset directories read as one, in order.

A part is an ordinary dataset directory. A multi-part dataset is either a list
of such directories or a directory holding ``manifest.json`` that names them
(relative paths). Parts must agree on their fields' names, dtypes and ndim;
opening costs the same per part whatever its size, and nothing is copied.
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
from numpy.typing import NDArray

from .errors import FormatError
from .ragged import RaggedRows
from .reader import (
    DatasetReader,
    as_raw,
    check_blob,
    normalise_index,
    normalise_indices,
)
from .spec import (
    BLOB_NAME,
    INDEX_NAME,
    SKIPPED_NAME,
    SOURCES_NAME,
    Index,
    brief,
    decode_json,
    load_index,
    open_regular,
    read_regular_file,
)

MANIFEST_NAME = "manifest.json"
MANIFEST_FORMAT = "npz2mmap-parts"
MANIFEST_VERSION = 1
# A manifest names parts by path: 16 MiB holds hundreds of thousands.
MAX_MANIFEST_NBYTES = 16 << 20

PathLike = str | os.PathLike[str]


@dataclass(frozen=True)
class FieldInfo:
    """A field as seen across all parts: fixed only if every part has the same shape."""

    name: str
    dtype: np.dtype
    ndim: int
    shape: tuple[int, ...] | None


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
    listed = [group for item in source for group in resolve_listed(item)]
    parts = [part for _, group in listed for part in group]
    if not parts:
        raise FormatError("no dataset parts given")
    repeated = _first_repeated(parts)
    if repeated is not None:
        raise FormatError(f"{repeated}: given twice; each part may appear only once")
    return listed


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
    listed = [os.path.normpath(os.path.join(directory, p)) for p in parts]
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


def _check_provenance_files(dataset_dir: str) -> None:
    """FormatError unless sources.jsonl and skipped.jsonl are regular files.

    Opening a dataset reads neither, but every command that does must find
    a file there, never a pipe that would block or a device without end.
    """
    for name in (SOURCES_NAME, SKIPPED_NAME):
        os.close(open_regular(os.path.join(dataset_dir, name)))


def manifest_text(directory: str, parts: Sequence[str]) -> str:
    """The manifest naming ``parts``, relative to ``directory`` where possible."""
    relative = [os.path.relpath(os.path.abspath(p), os.path.abspath(directory)) for p in parts]
    document = {"format": MANIFEST_FORMAT, "version": MANIFEST_VERSION, "parts": relative}
    return json.dumps(document, indent=1, sort_keys=True) + "\n"


class Parts:
    """The indexes of all parts, checked to agree; small and picklable (no mappings).

    Empty parts (no samples, no fields: an empty slice of ``convert --part``)
    contribute nothing and are left out, unless every part is empty. The parts
    of each manifest are checked to be one whole run (see check_part_set).
    """

    def __init__(self, source: PathLike | Sequence[PathLike]) -> None:
        listed = resolve_listed(source)
        self.all_paths = [part for _, parts in listed for part in parts]
        self.all_indexes = [load_index(p) for p in self.all_paths]
        for path, index in zip(self.all_paths, self.all_indexes, strict=True):
            check_blob(os.path.join(path, BLOB_NAME), index)
            _check_provenance_files(path)
        labels = {path: index.part for path, index in zip(self.all_paths, self.all_indexes, strict=True)}
        for manifest, parts in listed:
            if manifest is not None:
                check_part_set([(part, labels[part]) for part in parts], manifest)
        self.paths, self.indexes = _contributing(self.all_paths, self.all_indexes)
        self.fields = _agreeing_fields(self.paths, self.indexes)
        sizes = np.array([index.num_samples for index in self.indexes], dtype=np.int64)
        self.starts: NDArray[np.int64] = np.concatenate([[0], np.cumsum(sizes)])

    @property
    def num_samples(self) -> int:
        return int(self.starts[-1])

    @property
    def field_names(self) -> tuple[str, ...]:
        return tuple(self.fields)

    def field(self, name: str) -> FieldInfo:
        try:
            return self.fields[name]
        except KeyError:
            raise KeyError(f"no field {name!r}; the dataset has: {', '.join(self.fields)}") from None


def _contributing(paths: list[str], indexes: list[Index]) -> tuple[list[str], list[Index]]:
    """The parts that hold fields, with their indexes; all parts if none does."""
    kept = [k for k, index in enumerate(indexes) if index.fields] or list(range(len(paths)))
    return [paths[k] for k in kept], [indexes[k] for k in kept]


def _agreeing_fields(paths: list[str], indexes: list[Index]) -> dict[str, FieldInfo]:
    first = indexes[0]
    fields = {f.name: FieldInfo(f.name, f.dtype, f.ndim, f.shape) for f in first.fields}
    for path, index in zip(paths[1:], indexes[1:], strict=True):
        if index.field_names != first.field_names:
            raise FormatError(
                f"{path}: fields {', '.join(index.field_names)} differ from {paths[0]}'s "
                f"{', '.join(first.field_names)}; parts must agree"
            )
        for f in index.fields:
            seen = fields[f.name]
            if f.dtype != seen.dtype or f.ndim != seen.ndim:
                raise FormatError(
                    f"{path}: field {f.name!r} is {f.dtype} with ndim {f.ndim}, but {seen.dtype} with ndim "
                    f"{seen.ndim} in {paths[0]}; parts must agree"
                )
            if f.shape != seen.shape:
                fields[f.name] = FieldInfo(f.name, f.dtype, f.ndim, None)
    return _fixed_where_samples_agree(fields, indexes)


def _fixed_where_samples_agree(fields: dict[str, FieldInfo], indexes: list[Index]) -> dict[str, FieldInfo]:
    """Fields whose parts with samples all store one shape are fixed: a part of no samples (an
    empty shard of ``--rows``, which has no shape to give) does not make them ragged, as it does
    not in one conversion of all the sources."""
    holding = [index for index in indexes if index.num_samples]
    for name, info in fields.items():
        shapes = {index.field(name).shape for index in holding}
        if info.shape is None and len(shapes) == 1 and None not in shapes:
            fields[name] = FieldInfo(name, info.dtype, info.ndim, shapes.pop())
    return fields


# A part, which of a batch's samples lie in it (None: all), and their indices within it.
PartGroup = tuple[int, "NDArray[np.intp] | None", "NDArray[np.int64]"]


class PartsReader:
    """Read-only mappings of every part, addressed by global sample index."""

    def __init__(self, parts: Parts, advice: str | None = None) -> None:
        self.parts = parts
        self.readers = [
            DatasetReader(path, index) for path, index in zip(parts.paths, parts.indexes, strict=True)
        ]
        if advice is not None:
            for reader in self.readers:
                reader.advise(advice)

    def will_need(self, names: Sequence[str], indices: NDArray[np.int64]) -> int:
        """Issue the reads of exactly these samples (normalised) of fields ``names``, in every part
        they lie in (see DatasetReader.will_need); the number of requests made."""
        return sum(self.readers[part].will_need(names, local) for part, _, local in self._by_part(indices))

    def _by_part(self, indices: NDArray[np.int64]) -> list[PartGroup]:
        """The samples (normalised) grouped by the part they lie in: each part, which of ``indices``
        lie in it (None when all do) and their indices within it."""
        if len(self.readers) == 1:
            return [(0, None, indices)]
        part_of = np.searchsorted(self.parts.starts, indices, side="right") - 1
        if len(part_of) and (part_of == part_of[0]).all():
            return [(int(part_of[0]), None, indices - self.parts.starts[part_of[0]])]
        groups: list[PartGroup] = []
        for part in np.unique(part_of).tolist():
            chosen = np.flatnonzero(part_of == part)
            groups.append((part, chosen, indices[chosen] - self.parts.starts[part]))
        return groups

    def __len__(self) -> int:
        return self.parts.num_samples

    @property
    def field_names(self) -> tuple[str, ...]:
        return self.parts.field_names

    def field(self, name: str) -> FieldInfo:
        return self.parts.field(name)

    def sample_index(self, i: int) -> int:
        """Normalise ``i`` (see reader.normalise_index)."""
        return normalise_index(i, self.parts.num_samples)

    def sample_indices(self, indices: Sequence[int] | NDArray[np.integer]) -> NDArray[np.int64]:
        """Normalise many indices at once; IndexError naming the first out of range."""
        return normalise_indices(indices, self.parts.num_samples)

    def shapes(self, name: str) -> NDArray[np.int64]:
        """Every sample's shape of a field, (num_samples, ndim), from the tables only.

        The whole tables are checked first (as verify checks them), so every
        shape returned is one numpy can make; FormatError names the part otherwise.
        """
        info = self.field(name)
        pieces = [reader.shapes(name) for reader in self.readers]
        return np.concatenate(pieces) if pieces else np.zeros((0, info.ndim), dtype=np.int64)

    def view(self, name: str, i: int) -> np.ndarray:
        """Sample ``i`` of field ``name`` as a read-only view of its part's mapping."""
        if len(self.readers) == 1:
            return self.readers[0].view(name, i)
        i = self.sample_index(i)
        part = int(np.searchsorted(self.parts.starts, i, side="right")) - 1
        return self.readers[part].view(name, i - int(self.parts.starts[part]))

    def ragged_rows(self, name: str, indices: Sequence[int] | NDArray[np.integer]) -> RaggedRows:
        """Where many samples of a field lie, in any parts, checked (see DatasetReader.ragged_rows)."""
        idx = self.sample_indices(indices)
        info = self.field(name)
        part_of = np.empty(len(idx), dtype=np.intp)
        starts = np.empty(len(idx), dtype=np.int64)
        shapes = np.empty((len(idx), info.ndim), dtype=np.int64)
        for part, chosen, local in self._by_part(idx):
            where = slice(None) if chosen is None else chosen
            part_of[where] = part
            starts[where], shapes[where] = self.readers[part].locate(name, local)
        sources = [reader.data(name) for reader in self.readers]
        return RaggedRows(name, info.dtype, sources, part_of, starts, shapes)

    def gather(
        self, name: str, indices: Sequence[int] | NDArray[np.integer], out: np.ndarray | None = None
    ) -> np.ndarray | list[np.ndarray]:
        """Many samples of a field in one pass (see DatasetReader.gather).

        A batch within one part is gathered straight into ``out``; one spanning
        several is gathered part by part, which costs one more copy for a fixed field.
        """
        idx = self.sample_indices(indices)
        info = self.field(name)
        if info.shape is None:
            return self.ragged_rows(name, idx).copies()
        groups = self._by_part(idx)
        if len(groups) == 1:
            part, _, local = groups[0]
            return self.readers[part].gather(name, local, out)
        if out is None:
            out = np.empty((len(idx), *info.shape), dtype=info.dtype)
        for part, chosen, local in groups:
            gathered = np.asarray(self.readers[part].gather(name, local))  # fixed: one array
            as_raw(out)[chosen] = as_raw(gathered)
        return out


def describe_parts(parts: Parts) -> list[dict[str, Any]]:
    """Every part's path, samples, first sample and blob (its own data.npy), for ``inspect``;
    empty parts too (which contribute nothing), marked ``empty``."""
    described = []
    start = 0
    for path, index in zip(parts.all_paths, parts.all_indexes, strict=True):
        described.append(
            {
                "path": path,
                "num_samples": index.num_samples,
                "start": start,
                "empty": index.num_samples == 0,
                "blob": os.path.join(path, BLOB_NAME),
                "blob_nbytes": index.blob_nbytes,
            }
        )
        start += index.num_samples
    return described
