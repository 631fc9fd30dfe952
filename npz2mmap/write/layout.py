"""Where everything lies in the blob: each field's data region and its tables, aligned, in order.

``lay_out`` turns what the plan builder gathered (each field's dtype and every sample's shape)
into a Plan: the regions of docs/FORMAT.md, checked to fit before a byte is written.
"""

from __future__ import annotations

import bisect
import dataclasses
import functools
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import numpy as np
from numpy.typing import NDArray

from ..errors import SourceError
from ..format.index import (
    BLOB_HEADER_NBYTES,
    CRC_DTYPE,
    IDENTITY_NBYTES,
    MAX_PAYLOAD_NBYTES,
    OFFSET_DTYPE,
    SHAPE_DTYPE,
    Region,
    checked_nbytes,
    representable_nbytes,
)

FieldShapes = tuple[str, np.dtype, NDArray[np.int64], bool]  # name, stored dtype, shapes, cast


@dataclass(frozen=True)
class FieldPlan:
    """Where one field goes and what each sample of it looks like."""

    name: str
    dtype: np.dtype  # the stored (little-endian) dtype
    shapes: NDArray[np.int64]  # (num_samples, ndim)
    sample_offsets: NDArray[np.int64]  # (num_samples + 1,) byte offsets within data
    fixed_shape: tuple[int, ...] | None
    data: Region
    cast: bool = False  # some source's dtype differs from the stored one beyond byte order (--cast)
    sample_crc32: Region = Region(0, 0)  # tables are placed after all data
    offsets: Region | None = None
    shapes_region: Region | None = None

    @property
    def ndim(self) -> int:
        return int(self.shapes.shape[1])


@dataclass(frozen=True)
class Plan:
    """The layout; ``sources`` are files, file k holding samples file_starts[k] to file_starts[k+1]."""

    sources: Sequence[str]
    fields: tuple[FieldPlan, ...]
    align: int
    payload_nbytes: int
    file_starts: NDArray[np.int64]
    mode: str = "files"  # "rows": each file holds many samples along axis 0
    # Per field planned with a cast, the files whose values are cast (so a file dropped takes its cast along).
    cast_files: Mapping[str, NDArray[np.int64]] = dataclasses.field(default_factory=dict)

    @property
    def num_samples(self) -> int:
        return int(self.file_starts[-1])

    def file_rows(self, k: int) -> tuple[int, int]:
        """(first sample, number of samples) of file k."""
        first = int(self.file_starts[k])
        return first, int(self.file_starts[k + 1]) - first

    @property
    def data_nbytes(self) -> int:
        return sum(f.data.nbytes for f in self.fields)


def lay_out(
    sources: Sequence[str],
    fields: list[FieldShapes],
    align: int,
    file_starts: NDArray[np.int64] | None = None,
    mode: str = "files",
) -> Plan:
    """Place all fields' data regions first, then their tables, each region aligned.

    ``fields`` gives each field's name, stored dtype, per-sample shapes
    (num_samples, ndim) and whether it was cast; each sample's size must be
    one numpy can represent. Raises SourceError, naming the file that crosses
    the line, if a field or the payload would be larger than numpy or a file
    can hold.
    """
    if file_starts is None:
        file_starts = np.arange(len(sources) + 1, dtype=np.int64)
    num_samples = int(file_starts[-1])
    allocate = _Allocator(align)
    locate = functools.partial(_file_of_sample, sources, file_starts)
    placed = [_place_data(*f, allocate, locate) for f in fields]
    placed = [_place_tables(f, num_samples, allocate) for f in placed]
    return Plan(sources, tuple(placed), align, allocate.cursor, file_starts, mode)


def _file_of_sample(sources: Sequence[str], file_starts: NDArray[np.int64], sample: int) -> str:
    return sources[int(np.searchsorted(file_starts, sample, side="right")) - 1]


class _Allocator:
    """Hands out consecutive aligned regions of the payload, never past MAX_PAYLOAD_NBYTES."""

    def __init__(self, align: int) -> None:
        self.align = align
        self.cursor = _aligned(IDENTITY_NBYTES, align)  # the blob identity comes first

    def __call__(self, nbytes: int, label: str) -> Region:
        region = Region(self.cursor, nbytes)
        cursor = _aligned(region.end, self.align)
        if cursor > MAX_PAYLOAD_NBYTES:
            raise SourceError(f"{label}: the dataset would pass {MAX_PAYLOAD_NBYTES} bytes, its largest size")
        self.cursor = cursor
        return region


def _place_data(
    name: str,
    dtype: np.dtype,
    shapes: NDArray[np.int64],
    cast: bool,
    allocate: _Allocator,
    locate: Callable[[int], str],
) -> FieldPlan:
    nbytes = np.prod(shapes, axis=1, dtype=np.int64) * dtype.itemsize
    sample_offsets = np.zeros(len(shapes) + 1, dtype=np.int64)
    np.cumsum(nbytes, out=sample_offsets[1:])
    _check_data_fits(name, sample_offsets, MAX_PAYLOAD_NBYTES - allocate.cursor, locate)
    fixed_shape = _fixed_shape(shapes)
    if fixed_shape is not None:
        _check_column(name, dtype, fixed_shape, len(shapes), locate)
    return FieldPlan(
        name=name,
        dtype=dtype,
        shapes=shapes,
        sample_offsets=sample_offsets,
        fixed_shape=fixed_shape,
        data=allocate(int(sample_offsets[-1]), f"field {name!r} data"),
        cast=cast,
    )


def _check_data_fits(
    name: str, sample_offsets: NDArray[np.int64], room: int, locate: Callable[[int], str]
) -> None:
    """Every sample must end within ``room`` bytes of the payload.

    Each sample is smaller than 2**63 bytes, so the running int64 sum, where
    it first passes ``room``, is either larger or wrapped negative.
    """
    past = np.flatnonzero((sample_offsets < 0) | (sample_offsets > room))
    if len(past):
        raise SourceError(
            f"{locate(int(past[0]) - 1)}[{name}]: with this file the field's data passes "
            f"{room} bytes, more than the dataset can hold"
        )


def _check_column(
    name: str, dtype: np.dtype, shape: tuple[int, ...], num_samples: int, locate: Callable[[int], str]
) -> None:
    """A fixed field is read as one (num_samples, *shape) array, which numpy must be able to make.

    Its size is checked with the data; this catches zero-length axes beside huge ones.
    """

    def too_large(count: int) -> bool:
        return representable_nbytes((count, *shape), dtype.itemsize) is None

    if too_large(num_samples):
        count = bisect.bisect_left(range(num_samples + 1), True, key=too_large)
        checked_nbytes((count, *shape), dtype.itemsize, f"{locate(count - 1)}[{name}]", SourceError)


def _place_tables(f: FieldPlan, num_samples: int, allocate: _Allocator) -> FieldPlan:
    label = f"field {f.name!r}"
    sample_crc32 = allocate(num_samples * CRC_DTYPE.itemsize, f"{label} sample_crc32")
    if f.fixed_shape is not None:
        return dataclasses.replace(f, sample_crc32=sample_crc32)
    return dataclasses.replace(
        f,
        sample_crc32=sample_crc32,
        offsets=allocate((num_samples + 1) * OFFSET_DTYPE.itemsize, f"{label} offsets"),
        shapes_region=allocate(f.shapes.size * SHAPE_DTYPE.itemsize, f"{label} shapes"),
    )


def _fixed_shape(shapes: NDArray[np.int64]) -> tuple[int, ...] | None:
    """The common shape when every sample agrees, else None (a ragged field).

    With no samples at all (a shard of zero rows) a 0-d field is fixed, any
    other ragged: both describe an empty field validly.
    """
    if not len(shapes):
        return () if shapes.shape[1] == 0 else None
    if (shapes == shapes[0]).all():
        return tuple(int(d) for d in shapes[0])
    return None


def _aligned(payload_offset: int, align: int) -> int:
    """The first payload offset >= ``payload_offset`` whose file offset is aligned."""
    file_offset = BLOB_HEADER_NBYTES + payload_offset
    return -(-file_offset // align) * align - BLOB_HEADER_NBYTES
