"""What ``npz2mmap inspect`` shows: a dataset's fields and one sample's statistics."""

from __future__ import annotations

import os
from typing import Any

import numpy as np

from .reader import DatasetReader
from .spec import BLOB_NAME, FORMAT_NAME, FORMAT_VERSION


def describe_dataset(path: str | os.PathLike[str]) -> dict[str, Any]:
    """Format, counts, sizes and one entry per field. Raises FormatError."""
    reader = DatasetReader(path)
    index = reader.index
    return {
        "path": reader.path,
        "format": FORMAT_NAME,
        "version": FORMAT_VERSION,
        "tool_version": index.tool_version,
        "num_samples": index.num_samples,
        "blob": BLOB_NAME,
        "blob_nbytes": index.blob_nbytes,
        "align": index.align,
        "fields": [_describe_field(reader, name) for name in index.field_names],
    }


def _describe_field(reader: DatasetReader, name: str) -> dict[str, Any]:
    f = reader.index.field(name)
    out: dict[str, Any] = {
        "name": name,
        "kind": "ragged" if f.ragged else "fixed",
        "dtype": dtype_name(f.dtype),
        "nbytes": f.data.nbytes,
    }
    if f.shape is not None:
        out["shape"] = list(f.shape)
    else:
        shapes = reader.table(name, "shapes")
        out["min_shape"] = [int(d) for d in shapes.min(axis=0)] if len(shapes) else []
        out["max_shape"] = [int(d) for d in shapes.max(axis=0)] if len(shapes) else []
    return out


def describe_sample(path: str | os.PathLike[str], i: int) -> dict[str, Any]:
    """Shape, dtype and min/max/mean of each field of sample ``i``. Raises IndexError, FormatError."""
    reader = DatasetReader(path)
    i = reader.sample_index(i)
    return {
        "sample": i,
        "fields": [_describe_array(name, reader.view(name, i)) for name in reader.field_names],
    }


def _describe_array(name: str, array: np.ndarray) -> dict[str, Any]:
    out: dict[str, Any] = {"name": name, "shape": list(array.shape), "dtype": dtype_name(array.dtype)}
    if array.size and array.dtype.kind in "biuf":
        out.update(min=array.min().item(), max=array.max().item(), mean=float(array.mean(dtype=np.float64)))
    return out


def dtype_name(dtype: np.dtype) -> str:
    """'float32' for numbers, numpy's own spelling ('<U8', 'datetime64[s]', records) otherwise."""
    return dtype.name if dtype.kind in "biufc" else str(dtype)
