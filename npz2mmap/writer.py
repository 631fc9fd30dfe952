"""Writing: a Plan becomes data.npy, its tables, sources.jsonl and index.json.

Workers copy samples into disjoint byte ranges of the preallocated blob, so
they need no locks and the bytes do not depend on their number; the main
process then writes the tables and, last, the index, fsyncing everything.
Where the files go and how they are published is ``publish``'s business.
"""

from __future__ import annotations

import dataclasses
import os
import zlib
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import NamedTuple

import numpy as np

from . import __version__, fsutil, provenance
from .elements import ByteReader, stored_pieces
from .errors import SourceError
from .npzfile import CHUNK_NBYTES, MemberHeader
from .plan import FieldPlan, Plan, can_cast
from .sources import open_source
from .spec import (
    BLOB_HEADER_NBYTES,
    BLOB_NAME,
    CRC_DTYPE,
    INDEX_NAME,
    OFFSET_DTYPE,
    SHAPE_DTYPE,
    SKIPPED_NAME,
    SOURCES_NAME,
    Field,
    Index,
    Region,
    blob_header,
    blob_identity,
    index_digest,
    index_to_json,
    storage_dtype,
)


class MemberTask(NamedTuple):
    key: str
    dtype: np.dtype  # as stored
    shape: tuple[int, ...] | None  # the member's expected shape; None: any with 0 rows
    file_offset: int
    cast: bool
    rows: int  # samples this member holds: 1, or its first dimension in rows mode


class SampleTask(NamedTuple):
    """Copy every selected member of one source (file or sample directory) to its place in the blob."""

    file: int
    path: str
    members: tuple[MemberTask, ...]


class SampleResult(NamedTuple):
    file: int
    crc32s: tuple[list[int], ...]  # per field, one CRC-32 per sample of the file
    nbytes: int


def sample_tasks(plan: Plan) -> Iterator[SampleTask]:
    """One task per source file, in order, built lazily from the plan."""
    for k, path in enumerate(plan.sources):
        first, count = plan.file_rows(k)
        yield SampleTask(k, path, tuple(_member_task(f, first, count, plan.mode) for f in plan.fields))


def _member_task(f: FieldPlan, first: int, count: int, mode: str) -> MemberTask:
    offset = BLOB_HEADER_NBYTES + f.data.offset + int(f.sample_offsets[first])
    if mode == "rows":
        shape = (count, *(int(d) for d in f.shapes[first])) if count else None
    else:
        shape = tuple(int(d) for d in f.shapes[first])
    return MemberTask(f.name, f.dtype, shape, offset, f.cast, count)


# --- worker side -------------------------------------------------------------


def write_sample(blob_path: str, task: SampleTask) -> SampleResult:
    """Copy one source file's members into the blob; return their CRC-32s.

    The blob is opened for this task alone: a descriptor kept for later tasks
    would outlive the file it names (a retry replaces ``data.npy``).
    """
    fd = os.open(blob_path, os.O_WRONLY | fsutil.BINARY)
    try:
        return _copy_members(task, fd, blob_path)
    finally:
        os.close(fd)


def _copy_members(task: SampleTask, fd: int, blob_path: str) -> SampleResult:
    crcs = []
    nbytes = 0
    with open_source(task.path) as source:
        keys = source.keys()
        for member in task.members:
            where = f"{task.path}[{member.key}]"
            if member.key not in keys:
                raise SourceError(f"{where}: key vanished since the file was scanned")
            header = source.header(member.key)
            if not _matches_plan(header, member):
                raise SourceError(f"{where}: changed since it was scanned")
            chunks = source.data_chunks(member.key, header)
            if header.fortran_order and len([d for d in header.shape if d != 1]) > 1:
                crcs.append(_copy_fortran(chunks, header, member, blob_path, where))
            else:
                crcs.append(_copy_c_order(chunks, header, member, fd, where))
            nbytes += _stored_nbytes(header, member)
    return SampleResult(task.file, tuple(crcs), nbytes)


def _matches_plan(header: MemberHeader, member: MemberTask) -> bool:
    if member.shape is None:
        if not header.shape or header.shape[0] != 0:
            return False
    elif header.shape != member.shape:
        return False
    if member.cast:
        return can_cast(header.dtype, member.dtype)
    return storage_dtype(header.dtype) == member.dtype


def _copy_c_order(
    chunks: Iterator[bytes], header: MemberHeader, member: MemberTask, fd: int, where: str
) -> list[int]:
    crcs = _RowCrcs(member.rows, _stored_nbytes(header, member))
    position = member.file_offset
    for piece in stored_pieces(chunks, header, member.dtype, where):
        fsutil.write_all_at(fd, piece, position)
        crcs.feed(piece)
        position += len(piece)
    return crcs.result()


def _stored_nbytes(header: MemberHeader, member: MemberTask) -> int:
    return header.nbytes // header.dtype.itemsize * member.dtype.itemsize


class _RowCrcs:
    """CRC-32 of each of ``rows`` equal slices of a byte stream: one per sample."""

    def __init__(self, rows: int, total_nbytes: int) -> None:
        self.rows = rows
        self.row_nbytes = total_nbytes // rows if rows else 0
        self.crcs: list[int] = []
        self.current = 0
        self.filled = 0

    def feed(self, data: bytes | bytearray | memoryview) -> None:
        view = memoryview(data)
        while view and self.row_nbytes:
            take = min(len(view), self.row_nbytes - self.filled)
            self.current = zlib.crc32(view[:take], self.current)
            self.filled += take
            view = view[take:]
            if self.filled == self.row_nbytes:
                self.crcs.append(self.current)
                self.current = self.filled = 0

    def result(self) -> list[int]:
        return self.crcs if self.row_nbytes else [0] * self.rows


def _copy_fortran(
    chunks: Iterator[bytes], header: MemberHeader, member: MemberTask, blob_path: str, where: str
) -> list[int]:
    """Write a Fortran-order member in C order through a mapping of its destination.

    Elements are converted in file order, then moved as raw bytes (a void
    dtype), so padding and byte order are exactly as in the C-order case.
    """
    raw = np.dtype((np.void, member.dtype.itemsize))
    target = np.memmap(blob_path, dtype=raw, mode="r+", offset=member.file_offset, shape=header.shape)
    reader = ByteReader(stored_pieces(chunks, header, member.dtype, where), where)
    _fill_from_fortran(target.reshape([d for d in header.shape if d != 1]), reader)
    reader.finish()
    target.flush()
    flat = target.reshape(-1).view(np.uint8)
    crcs = _RowCrcs(member.rows, len(flat))
    for start in range(0, len(flat), CHUNK_NBYTES):
        crcs.feed(flat[start : start + CHUNK_NBYTES].data)
    del target, flat
    return crcs.result()


def _fill_from_fortran(view: np.ndarray, reader: ByteReader) -> None:
    """Fill C-order ``view`` (a void dtype) from bytes arriving in Fortran order, in bounded pieces.

    Fortran order puts the last axis slowest, so each index of the last axis is
    one contiguous piece: recurse on it until a piece fits in a chunk.
    """
    itemsize = view.dtype.itemsize
    if view.nbytes <= CHUNK_NBYTES:
        piece = np.frombuffer(reader.read(view.nbytes), view.dtype)
        view[...] = piece.reshape(view.shape[::-1]).T
    elif view.ndim > 1:
        for k in range(view.shape[-1]):
            _fill_from_fortran(view[..., k], reader)
    elif itemsize <= CHUNK_NBYTES:
        per_piece = CHUNK_NBYTES // itemsize
        for start in range(0, len(view), per_piece):
            count = min(per_piece, len(view) - start)
            view[start : start + count] = np.frombuffer(reader.read(count * itemsize), view.dtype)
    else:
        for k in range(len(view)):
            _fill_element(view[k : k + 1].view(np.uint8), reader)


def _fill_element(element: np.ndarray, reader: ByteReader) -> None:
    """One element larger than a chunk, piece by piece."""
    for start in range(0, len(element), CHUNK_NBYTES):
        count = min(CHUNK_NBYTES, len(element) - start)
        element[start : start + count] = np.frombuffer(reader.read(count), np.uint8)


# --- main side ---------------------------------------------------------------


def create_blob(staging_dir: str, payload_nbytes: int) -> str:
    """Create data.npy with its header and a zero-filled payload, its disk space reserved.

    Reserving first makes a full disk fail before any copying, and keeps
    writes through a mapping (Fortran-order members) from dying of SIGBUS.
    """
    path = os.path.join(staging_dir, BLOB_NAME)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | fsutil.BINARY, 0o644)
    try:
        fsutil.reserve(fd, BLOB_HEADER_NBYTES + payload_nbytes)
        fsutil.write_all_at(fd, blob_header(payload_nbytes), 0)
        os.ftruncate(fd, BLOB_HEADER_NBYTES + payload_nbytes)
    finally:
        os.close(fd)
    return path


def finish_dataset(
    staging_dir: str,
    plan: Plan,
    sample_crc32s: Sequence[np.ndarray],
    skipped: Sequence[tuple[str, str]] = (),
    part: tuple[int, int] | None = None,
) -> Index:
    """Write the tables, sources.jsonl, skipped.jsonl and, last, index.json; fsync everything."""
    blob_path = os.path.join(staging_dir, BLOB_NAME)
    fd = os.open(blob_path, os.O_WRONLY | fsutil.BINARY)
    try:
        fields = tuple(_write_tables(fd, f, crcs) for f, crcs in zip(plan.fields, sample_crc32s, strict=True))
        index = _plan_index(plan, fields, len(skipped), part)
        index_text = index_to_json(index).encode("utf-8")
        digest = index_digest(index_text)
        fsutil.write_all_at(fd, blob_identity(digest), BLOB_HEADER_NBYTES)
        os.fsync(fd)
    finally:
        os.close(fd)
    _write_file(os.path.join(staging_dir, SOURCES_NAME), provenance.source_lines(plan))
    _write_file(os.path.join(staging_dir, SKIPPED_NAME), provenance.skipped_lines(skipped))
    _write_index(os.path.join(staging_dir, INDEX_NAME), index_text)
    fsutil.fsync_dir(staging_dir)
    return dataclasses.replace(index, digest=digest)


def _write_tables(fd: int, f: FieldPlan, crcs: np.ndarray) -> Field:
    def put(region: Region, table: np.ndarray) -> Region:
        data = np.ascontiguousarray(table).tobytes()
        fsutil.write_all_at(fd, data, BLOB_HEADER_NBYTES + region.offset)
        return dataclasses.replace(region, crc32=zlib.crc32(data))

    return _table_field(f, crcs, put)


def _table_field(f: FieldPlan, crcs: np.ndarray, put: Callable[[Region, np.ndarray], Region]) -> Field:
    """The index entry of a planned field, ``put`` writing each table and giving its region."""
    offsets = shapes = None
    if f.fixed_shape is None and f.offsets is not None and f.shapes_region is not None:
        offsets = put(f.offsets, f.sample_offsets.astype(OFFSET_DTYPE))
        shapes = put(f.shapes_region, f.shapes.astype(SHAPE_DTYPE))
    return Field(
        name=f.name,
        dtype=f.dtype,
        ndim=f.ndim,
        shape=f.fixed_shape,
        data=f.data,
        sample_crc32=put(f.sample_crc32, crcs.astype(CRC_DTYPE)),
        offsets=offsets,
        shapes=shapes,
        cast=f.cast,
    )


def _plan_index(
    plan: Plan, fields: tuple[Field, ...], num_skipped: int, part: tuple[int, int] | None
) -> Index:
    return Index(
        num_samples=plan.num_samples,
        align=plan.align,
        payload_nbytes=plan.payload_nbytes,
        fields=fields,
        tool_version=__version__,
        num_sources=len(plan.sources),
        mode=plan.mode,
        num_skipped=num_skipped,
        part=part,
    )


def index_nbytes_bound(plan: Plan, max_skipped: int, part: tuple[int, int] | None) -> int:
    """index.json's size at most, known before the copy: every checksum at its widest, and
    ``max_skipped`` files left out (planning again without a file only shortens the rest)."""

    def widest(region: Region, table: np.ndarray) -> Region:
        return dataclasses.replace(region, crc32=0xFFFFFFFF)

    no_crcs = np.zeros(0, dtype=CRC_DTYPE)
    fields = tuple(_table_field(f, no_crcs, widest) for f in plan.fields)
    return len(index_to_json(_plan_index(plan, fields, max_skipped, part)).encode("utf-8"))


def _write_index(path: str, text: bytes) -> None:
    """Binary, so the bytes on disk are the bytes the blob's identity names on every platform."""
    with open(path, "xb") as fp:
        fp.write(text)
        fp.flush()
        os.fsync(fp.fileno())


def _write_file(path: str, lines: Iterable[str]) -> None:
    """Create and fsync a text file, line by line (a million source paths need no big string)."""
    with open(path, "x", encoding="utf-8") as fp:
        fp.writelines(lines)
        fp.flush()
        os.fsync(fp.fileno())
