"""Datasets made of parts: several dataset directories read as one, in order.

A part is an ordinary dataset directory. A multi-part dataset is either a list
of such directories or a directory holding ``manifest.json`` that names them
(relative paths). Parts must agree on their fields' names, dtypes and ndim;
opening costs the same per part whatever its size, and nothing is copied.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, cast

import numpy as np
from numpy.typing import NDArray

from ..errors import FormatError
from ..format.files import open_regular
from ..format.index import (
    BLOB_NAME,
    SKIPPED_NAME,
    SOURCES_NAME,
    Index,
    SampleShape,
    load_index,
)
from ..format.manifest import PathLike, check_part_set, naming_parts, resolve_listed
from ..text import quoted
from .indices import normalise_index, normalise_indices
from .ragged import RaggedRows
from .reader import (
    DatasetReader,
    as_raw,
    check_blob,
)


@dataclass(frozen=True)
class FieldInfo:
    """A field as seen across all parts: fixed only if every part has the same shape."""

    name: str
    dtype: np.dtype
    ndim: int
    shape: tuple[int, ...] | None
    # Every sample's shape, None where samples differ; None if a version 2 part records none.
    sample_shape: SampleShape | None


def _check_provenance_files(dataset_dir: str) -> None:
    """FormatError unless sources.jsonl and skipped.jsonl are regular files.

    Opening a dataset reads neither, but every command that does must find
    a file there, never a pipe that would block or a device without end.
    """
    for name in (SOURCES_NAME, SKIPPED_NAME):
        os.close(open_regular(os.path.join(dataset_dir, name)))


class Parts:
    """The indexes of all parts, checked to agree; small and picklable (no mappings).

    Empty parts (no samples, no fields: an empty slice of ``convert --part``)
    contribute nothing and are left out, unless every part is empty. The parts
    of each manifest, and the directories a list gives itself (two or more),
    are checked to be one whole run (see check_part_set), as merge checks them.
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
        given = [parts[0] for manifest, parts in listed if manifest is None]
        if len(given) > 1:  # one directory alone is a dataset, whatever part it records
            check_part_set([(part, labels[part]) for part in given], naming_parts(given))
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
            raise KeyError(f"no field {name!r}; the dataset has: {quoted(self.fields)}") from None


def _contributing(paths: list[str], indexes: list[Index]) -> tuple[list[str], list[Index]]:
    """The parts that hold fields, with their indexes; all parts if none does."""
    kept = [k for k, index in enumerate(indexes) if index.fields] or list(range(len(paths)))
    return [paths[k] for k in kept], [indexes[k] for k in kept]


def _agreeing_fields(paths: list[str], indexes: list[Index]) -> dict[str, FieldInfo]:
    first = indexes[0]
    for path, index in zip(paths[1:], indexes[1:], strict=True):
        if index.field_names != first.field_names:
            raise FormatError(
                f"{path}: fields {quoted(index.field_names)} differ from {paths[0]}'s "
                f"{quoted(first.field_names)}; parts must agree"
            )
        for f in index.fields:
            seen = first.field(f.name)
            if f.dtype != seen.dtype or f.ndim != seen.ndim:
                raise FormatError(
                    f"{path}: field {f.name!r} is {f.dtype} with ndim {f.ndim}, but {seen.dtype} with ndim "
                    f"{seen.ndim} in {paths[0]}; parts must agree{_cast_advice(f.name, f.ndim == seen.ndim)}"
                )
    # A part of no samples (an empty shard of --rows) has no shape to give: it does not make a
    # field ragged, as it does not in one conversion of all the sources.
    holding = [index for index in indexes if index.num_samples] or indexes
    return {f.name: _field_info(f.name, holding) for f in first.fields}


def _field_info(name: str, indexes: list[Index]) -> FieldInfo:
    """Field ``name`` across parts: each dimension's length where every part gives the same."""
    f = indexes[0].field(name)
    shape = combined_sample_shape([index.field(name).sample_shape for index in indexes])
    fixed = shape if shape is not None and None not in shape else None
    return FieldInfo(name, f.dtype, f.ndim, cast("tuple[int, ...] | None", fixed), shape)


def combined_sample_shape(shapes: list[SampleShape | None]) -> SampleShape | None:
    """Parts' sample shapes as one: a dimension's length where all give the same, else None;
    None if any part's is not recorded."""
    if any(shape is None for shape in shapes):
        return None
    return tuple(lengths[0] if len(set(lengths)) == 1 else None for lengths in zip(*shapes, strict=True))


def _cast_advice(name: str, same_ndim: bool) -> str:
    """For parts that differ in a field's dtype alone, how to make them agree."""
    if not same_ndim:
        return ""
    return (
        f": convert every part again with one --cast {name}=DTYPE (a conversion of all their files "
        "at once names one that holds them)"
    )


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
        """Normalise ``i`` (see indices.normalise_index)."""
        return normalise_index(i, self.parts.num_samples)

    def sample_indices(self, indices: Sequence[int] | NDArray[np.integer]) -> NDArray[np.int64]:
        """Normalise many indices at once; IndexError naming the first out of range."""
        return normalise_indices(indices, self.parts.num_samples)

    def sample_shape(self, name: str) -> SampleShape:
        """Field ``name``'s shape in every sample, None in each dimension in which samples differ:
        from the indexes, or where a version 2 part records none, from every part's shapes table."""
        info = self.field(name)
        if info.sample_shape is not None:
            return info.sample_shape
        holding = [reader for reader in self.readers if len(reader)] or self.readers
        return combined_sample_shape([reader.sample_shape(name) for reader in holding]) or ()

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
        return RaggedRows(name, info.dtype, sources, part_of, starts, shapes, self.sample_shape(name))

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
