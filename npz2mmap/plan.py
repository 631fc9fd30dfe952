"""Planning: from the member headers of every source to the blob's layout.

Pure computation, no I/O: the headers arrive in sample order, are checked for
agreement (same keys, dtypes and ndim in every file) and become a Plan that
places every field's data and tables at aligned offsets of the payload.
"""

from __future__ import annotations

from array import array
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import numpy as np
from numpy.typing import NDArray

from .errors import SourceError
from .npzfile import MemberHeader
from .spec import BLOB_HEADER_NBYTES, CRC_DTYPE, OFFSET_DTYPE, SHAPE_DTYPE, Region, storage_dtype


@dataclass(frozen=True)
class FieldPlan:
    """Where one field goes and what each sample of it looks like."""

    name: str
    dtype: np.dtype  # the stored (little-endian) dtype
    shapes: NDArray[np.int64]  # (num_samples, ndim)
    sample_offsets: NDArray[np.int64]  # (num_samples + 1,) byte offsets within data
    fixed_shape: tuple[int, ...] | None
    data: Region
    sample_crc32: Region
    offsets: Region | None
    shapes_region: Region | None

    @property
    def ndim(self) -> int:
        return int(self.shapes.shape[1])


@dataclass(frozen=True)
class Plan:
    sources: list[str]
    fields: tuple[FieldPlan, ...]
    align: int
    payload_nbytes: int

    @property
    def num_samples(self) -> int:
        return len(self.sources)

    @property
    def data_nbytes(self) -> int:
        return sum(f.data.nbytes for f in self.fields)


class _FieldCollector:
    """Accumulates one field's per-sample shapes in compact arrays."""

    def __init__(self, header: MemberHeader, path: str) -> None:
        self.dtype = storage_dtype(header.dtype)
        self.ndim = len(header.shape)
        self.first_path = path
        self.dims: array[int] = array("q")

    def add(self, header: MemberHeader, path: str) -> None:
        where = f"{path}[{header.key}]"
        if storage_dtype(header.dtype) != self.dtype:
            raise SourceError(f"{where}: dtype {header.dtype} differs from {self.dtype} in {self.first_path}")
        if len(header.shape) != self.ndim:
            raise SourceError(
                f"{where}: {len(header.shape)}-d array {header.shape} differs from the "
                f"{self.ndim}-d arrays in {self.first_path}"
            )
        self.dims.extend(header.shape)


def build_plan(
    sources: Sequence[str],
    headers: Iterable[dict[str, MemberHeader]],
    align: int,
) -> Plan:
    """Check that the sources agree and lay out the payload.

    ``headers`` yields, for each source in order, its members' headers (the
    selected keys only). Raises SourceError naming the first file that differs.
    """
    collectors: dict[str, _FieldCollector] = {}
    keys: list[str] = []
    for path, members in zip(sources, headers, strict=True):
        if not collectors:
            keys = sorted(members)
            collectors = {key: _FieldCollector(members[key], path) for key in keys}
        elif sorted(members) != keys:
            raise SourceError(_describe_key_mismatch(path, sorted(members), keys, sources[0]))
        for key in keys:
            collectors[key].add(members[key], path)
    if not keys:
        raise SourceError(f"{sources[0]}: holds no arrays")
    return _lay_out(list(sources), collectors, align)


def _describe_key_mismatch(path: str, found: list[str], expected: list[str], first: str) -> str:
    missing = sorted(set(expected) - set(found))
    extra = sorted(set(found) - set(expected))
    parts = [f"missing {', '.join(missing)}" if missing else "", f"extra {', '.join(extra)}" if extra else ""]
    detail = "; ".join(p for p in parts if p)
    return f"{path}: keys differ from {first} ({detail}); select common keys with --keys"


def _lay_out(sources: list[str], collectors: dict[str, _FieldCollector], align: int) -> Plan:
    num_samples = len(sources)
    cursor = _aligned(0, align)
    staged = []
    for name, collector in collectors.items():
        shapes = np.frombuffer(collector.dims, dtype=np.int64).reshape(num_samples, collector.ndim)
        nbytes = np.prod(shapes, axis=1, dtype=np.int64) * collector.dtype.itemsize
        sample_offsets = np.zeros(num_samples + 1, dtype=np.int64)
        np.cumsum(nbytes, out=sample_offsets[1:])
        data = Region(cursor, int(sample_offsets[-1]))
        cursor = _aligned(data.end, align)
        staged.append((name, collector.dtype, shapes, sample_offsets, data))
    fields = []
    for name, dtype, shapes, sample_offsets, data in staged:
        fixed = _fixed_shape(shapes)
        sample_crc32 = Region(cursor, num_samples * CRC_DTYPE.itemsize)
        cursor = _aligned(sample_crc32.end, align)
        offsets = shapes_region = None
        if fixed is None:
            offsets = Region(cursor, (num_samples + 1) * OFFSET_DTYPE.itemsize)
            cursor = _aligned(offsets.end, align)
            shapes_region = Region(cursor, shapes.size * SHAPE_DTYPE.itemsize)
            cursor = _aligned(shapes_region.end, align)
        fields.append(
            FieldPlan(name, dtype, shapes, sample_offsets, fixed, data, sample_crc32, offsets, shapes_region)
        )
    return Plan(sources, tuple(fields), align, cursor)


def _fixed_shape(shapes: NDArray[np.int64]) -> tuple[int, ...] | None:
    """The common shape when every sample agrees, else None (a ragged field)."""
    if len(shapes) and (shapes == shapes[0]).all():
        return tuple(int(d) for d in shapes[0])
    return None


def _aligned(payload_offset: int, align: int) -> int:
    """The first payload offset >= ``payload_offset`` whose file offset is aligned."""
    file_offset = BLOB_HEADER_NBYTES + payload_offset
    return -(-file_offset // align) * align - BLOB_HEADER_NBYTES
