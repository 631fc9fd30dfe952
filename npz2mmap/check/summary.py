"""What ``npz2mmap inspect`` shows: a dataset's fields and one sample's statistics."""

from __future__ import annotations

import os
from typing import Any

import numpy as np
from numpy.typing import NDArray

from ..format.index import BLOB_NAME, FORMAT_NAME
from ..format.manifest import is_manifest_dir
from ..format.provenance import read_skipped, read_sources
from ..progress import Progress, SilentProgress
from ..read.parts import FieldInfo, Parts, PartsReader, describe_parts
from ..read.reader import DatasetReader
from .moments import FLOAT_KINDS, INTEGER_KINDS, running_statistics


def describe_dataset(path: str | os.PathLike[str]) -> dict[str, Any]:
    """Format, counts, sizes, blobs (one per part), parts and one entry per field. Raises FormatError.

    A dataset of parts (a manifest, even of one part) lists every part, empty ones too.
    """
    parts = Parts(path)
    of_parts = is_manifest_dir(os.fspath(path)) or len(parts.all_paths) > 1
    reader = PartsReader(parts)
    first = parts.indexes[0]
    return {
        "path": os.fspath(path),
        "format": FORMAT_NAME,
        "version": min(index.version for index in parts.all_indexes),
        "tool_version": first.tool_version,
        "num_samples": parts.num_samples,
        "blobs": [os.path.join(p, BLOB_NAME) for p in parts.all_paths],
        "blob_nbytes": sum(index.blob_nbytes for index in parts.all_indexes),
        "align": min(index.align for index in parts.all_indexes),  # parts may differ; every region has this
        "parts": describe_parts(parts) if of_parts else [],
        "fields": [_describe_field(parts.field(name), reader) for name in parts.field_names],
        "skipped": _skipped(parts),
    }


MAX_SKIPPED_SHOWN = 20  # of the files --skip-bad left out, those inspect names (the count is whole)


def _skipped(parts: Parts) -> dict[str, Any]:
    """How many files --skip-bad left out, over every part, and the first of them with the reason."""
    count = sum(index.num_skipped for index in parts.all_indexes)
    first: list[dict[str, str]] = []
    for path, index in zip(parts.all_paths, parts.all_indexes, strict=True):
        if index.num_skipped and len(first) < MAX_SKIPPED_SHOWN:
            listed = read_skipped(path, index)[: MAX_SKIPPED_SHOWN - len(first)]
            first += [{"path": source, "reason": reason} for source, reason in listed]
    return {"count": count, "first": first}


def _describe_field(info: FieldInfo, reader: PartsReader) -> dict[str, Any]:
    readers = reader.readers
    out: dict[str, Any] = {
        "name": info.name,
        "kind": "ragged" if info.shape is None else "fixed",
        "dtype": dtype_name(info.dtype),
        "nbytes": sum(r.index.field(info.name).data.nbytes for r in readers),
        "shape": list(reader.sample_shape(info.name)),  # null where samples differ
    }
    if info.shape is not None:
        return out
    shapes = [r.shapes(info.name) for r in readers if len(r)]  # tables checked whole
    out["min_shape"] = np.min([s.min(axis=0) for s in shapes], axis=0).tolist() if shapes else []
    out["max_shape"] = np.max([s.max(axis=0) for s in shapes], axis=0).tolist() if shapes else []
    out["lengths"] = _varying_lengths(np.concatenate(shapes)) if shapes else {}
    return out


def _varying_lengths(shapes: NDArray[np.int64]) -> dict[str, Any]:
    """The length distribution of the first axis whose length varies (axis 0 if none does):
    for shapes (2, 1..3), the 1..3, not a column of 2s."""
    varying = np.flatnonzero(shapes.min(axis=0) != shapes.max(axis=0))
    axis = int(varying[0]) if len(varying) else 0
    return {"axis": axis, **length_distribution(shapes[:, axis])}


def length_distribution(lengths: NDArray[np.int64], bins: int = 10) -> dict[str, Any]:
    """Min, percentiles, max, mean and a histogram of a ragged field's first dimension.

    Lengths are integers, so the histogram's bins are whole lengths: bin k holds
    lengths from edges[k] up to edges[k + 1] - 1, and no length is in two bins.
    Figures are rounded to 6 significant digits (no 230.29999999999998).
    """
    low, high = int(lengths.min()), int(lengths.max())
    width = -(-(high - low + 1) // bins)
    counts = np.bincount((lengths - low) // width, minlength=-(-(high - low + 1) // width))
    edges = [low + k * width for k in range(len(counts) + 1)]
    percentiles = np.percentile(lengths, [50, 90, 99])
    return {
        "min": low,
        "p50": _rounded(percentiles[0]),
        "p90": _rounded(percentiles[1]),
        "p99": _rounded(percentiles[2]),
        "max": high,
        "mean": _rounded(lengths.mean()),
        "histogram": {"counts": counts.tolist(), "edges": edges},
    }


def _rounded(value: float) -> float:
    return float(f"{float(value):.6g}")


STATS_CHUNK_NBYTES = 8 << 20  # a chunk takes a few work arrays of 8-byte numbers: ~30 MB at most
NUMERIC_KINDS = INTEGER_KINDS + FLOAT_KINDS


def describe_sample(path: str | os.PathLike[str], i: int) -> dict[str, Any]:
    """Shape, dtype and min/max/mean of each field of sample ``i``. Raises IndexError, FormatError."""
    parts = Parts(path)
    reader = PartsReader(parts)
    i = reader.sample_index(i)
    return {
        "sample": i,
        **_source_of(parts, i),
        "fields": [_describe_array(name, reader.view(name, i)) for name in reader.field_names],
    }


def _source_of(parts: Parts, i: int) -> dict[str, Any]:
    """The source sample ``i`` came from (sources.jsonl), and in rows mode its row in it."""
    part = int(np.searchsorted(parts.starts, i, side="right")) - 1
    index = parts.indexes[part]
    files, starts = read_sources(parts.paths[part], index)
    local = i - int(parts.starts[part])
    k = int(np.searchsorted(starts, local, side="right")) - 1
    found: dict[str, Any] = {"source": files[k] or None}  # a Writer's sample without source=: none
    if index.mode == "rows":
        found["row"] = local - int(starts[k])
    return found


def _describe_array(name: str, array: np.ndarray) -> dict[str, Any]:
    out: dict[str, Any] = {"name": name, "shape": list(array.shape), "dtype": dtype_name(array.dtype)}
    if array.size and array.dtype.kind in NUMERIC_KINDS:
        figures = _chunked_statistics(array.reshape(-1), array.dtype)
        out.update((key, figures[key]) for key in ("min", "max", "mean", "nan", "inf") if key in figures)
    return out


def _chunked_statistics(values: np.ndarray, dtype: np.dtype) -> dict[str, int | float]:
    """The ``moments`` figures of ``values``, read in bounded chunks (a sample may be gigabytes)."""
    running = running_statistics(dtype)
    step = max(1, STATS_CHUNK_NBYTES // max(dtype.itemsize, 8))  # the work arrays hold 8-byte numbers
    for start in range(0, len(values), step):
        running.add(values[start : start + step])
    return running.result()


def dtype_name(dtype: np.dtype) -> str:
    """'float32' for numbers, numpy's own spelling ('<U8', 'datetime64[s]', records) otherwise."""
    return dtype.name if dtype.kind in "biufc" else str(dtype)


def field_statistics(
    path: str | os.PathLike[str], progress: Progress | None = None
) -> dict[str, dict[str, int | float]]:
    """Count, NaN and infinity counts, min, max, mean and std of every numeric field, in one pass.

    Reads each field's data region (all parts) in bounded chunks and merges the
    chunks' figures (``moments``): exact for integers, stable for a large offset,
    NaN-aware for floats, whose mean and std are those of the finite values.
    Fields of other kinds (complex, dates, strings, records) are left out.
    """
    progress = progress or SilentProgress()
    parts = Parts(path)
    readers = [DatasetReader(p, index) for p, index in zip(parts.paths, parts.indexes, strict=True)]
    numeric = [name for name in parts.field_names if parts.field(name).dtype.kind in NUMERIC_KINDS]
    total = sum(r.index.field(name).data.nbytes for r in readers for name in numeric)
    progress.stage("stats", len(numeric), total, unit="fields")
    return {name: _stream_stats(readers, parts.field(name).dtype, name, progress) for name in numeric}


def _stream_stats(
    readers: list[DatasetReader], dtype: np.dtype, name: str, progress: Progress
) -> dict[str, int | float]:
    running = running_statistics(dtype)
    step = max(1, STATS_CHUNK_NBYTES // max(dtype.itemsize, 8))  # the work arrays hold 8-byte numbers
    for reader in readers:
        field = reader.index.field(name)
        values = reader.payload[field.data.offset : field.data.end].view(field.dtype)
        for start in range(0, len(values), step):
            chunk = values[start : start + step]
            running.add(chunk)
            progress.advance(0, chunk.nbytes)
    progress.advance(1, 0)
    return running.result()
