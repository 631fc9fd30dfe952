"""Planning: from the member headers of every source to the blob's layout.

Pure computation, no I/O: the headers arrive in sample order, are checked for
agreement (same keys, dtypes and ndim in every file) and become a Plan that
places every field's data and tables at aligned offsets of the payload.
"""

from __future__ import annotations

import dataclasses
from array import array
from collections.abc import Iterable, Mapping, Sequence
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
    cast: bool = False  # stored dtype chosen with --cast, not the sources'
    sample_crc32: Region = Region(0, 0)  # tables are placed after all data
    offsets: Region | None = None
    shapes_region: Region | None = None

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

    def __init__(self, header: MemberHeader, path: str, cast: np.dtype | None) -> None:
        self.cast = cast
        self.dtype = storage_dtype(cast if cast is not None else header.dtype)
        self.ndim = len(header.shape)
        self.first_path = path
        self.dims: array[int] = array("q")

    def add(self, header: MemberHeader, path: str) -> None:
        where = f"{path}[{header.key}]"
        if self.cast is not None:
            if not can_cast(header.dtype, self.dtype):
                raise SourceError(
                    f"{where}: dtype {header.dtype} cannot be cast to {self.dtype} without changing kind"
                )
        elif storage_dtype(header.dtype) != self.dtype:
            raise SourceError(
                f"{where}: dtype {header.dtype} differs from {self.dtype} in {self.first_path}; "
                f"use --cast {header.key}=DTYPE to store one dtype"
            )
        if len(header.shape) != self.ndim:
            raise SourceError(
                f"{where}: {len(header.shape)}-d array {header.shape} differs from the "
                f"{self.ndim}-d arrays in {self.first_path}"
            )
        self.dims.extend(header.shape)


def can_cast(source: np.dtype, target: np.dtype) -> bool:
    """What --cast allows: numpy's 'same_kind' rule (float64 -> float32, never float -> int)."""
    return bool(np.can_cast(source, target, casting="same_kind"))


def build_plan(
    sources: Sequence[str],
    headers: Iterable[dict[str, MemberHeader]],
    align: int,
    casts: Mapping[str, np.dtype] | None = None,
) -> Plan:
    """Check that the sources agree and lay out the payload.

    ``headers`` yields, for each source in order, its members' headers (the
    selected keys only); ``casts`` maps keys to the dtype they are stored as.
    Raises SourceError naming the first file that differs.
    """
    casts = dict(casts or {})
    collectors: dict[str, _FieldCollector] = {}
    keys: list[str] = []
    for path, members in zip(sources, headers, strict=True):
        if not collectors:
            keys = sorted(members)
            collectors = {key: _FieldCollector(members[key], path, casts.get(key)) for key in keys}
            unknown = sorted(set(casts) - set(keys))
            if unknown:
                raise SourceError(f"{path}: --cast names key(s) {', '.join(unknown)} that are not converted")
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
    """All fields' data regions first, then their tables, each region aligned."""
    num_samples = len(sources)
    allocate = _Allocator(align)
    fields = [_place_data(name, collector, num_samples, allocate) for name, collector in collectors.items()]
    fields = [_place_tables(f, num_samples, allocate) for f in fields]
    return Plan(sources, tuple(fields), align, allocate.cursor)


class _Allocator:
    """Hands out consecutive aligned regions of the payload."""

    def __init__(self, align: int) -> None:
        self.align = align
        self.cursor = _aligned(0, align)

    def __call__(self, nbytes: int) -> Region:
        region = Region(self.cursor, nbytes)
        self.cursor = _aligned(region.end, self.align)
        return region


def _place_data(name: str, collector: _FieldCollector, num_samples: int, allocate: _Allocator) -> FieldPlan:
    shapes = np.frombuffer(collector.dims, dtype=np.int64).reshape(num_samples, collector.ndim)
    nbytes = np.prod(shapes, axis=1, dtype=np.int64) * collector.dtype.itemsize
    sample_offsets = np.zeros(num_samples + 1, dtype=np.int64)
    np.cumsum(nbytes, out=sample_offsets[1:])
    return FieldPlan(
        name=name,
        dtype=collector.dtype,
        shapes=shapes,
        sample_offsets=sample_offsets,
        fixed_shape=_fixed_shape(shapes),
        data=allocate(int(sample_offsets[-1])),
        cast=collector.cast is not None,
    )


def _place_tables(f: FieldPlan, num_samples: int, allocate: _Allocator) -> FieldPlan:
    sample_crc32 = allocate(num_samples * CRC_DTYPE.itemsize)
    if f.fixed_shape is not None:
        return dataclasses.replace(f, sample_crc32=sample_crc32)
    return dataclasses.replace(
        f,
        sample_crc32=sample_crc32,
        offsets=allocate((num_samples + 1) * OFFSET_DTYPE.itemsize),
        shapes_region=allocate(f.shapes.size * SHAPE_DTYPE.itemsize),
    )


def _fixed_shape(shapes: NDArray[np.int64]) -> tuple[int, ...] | None:
    """The common shape when every sample agrees, else None (a ragged field)."""
    if len(shapes) and (shapes == shapes[0]).all():
        return tuple(int(d) for d in shapes[0])
    return None


def _aligned(payload_offset: int, align: int) -> int:
    """The first payload offset >= ``payload_offset`` whose file offset is aligned."""
    file_offset = BLOB_HEADER_NBYTES + payload_offset
    return -(-file_offset // align) * align - BLOB_HEADER_NBYTES
