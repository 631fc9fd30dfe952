"""Writing: a Plan becomes data.npy, its tables, sources.jsonl and index.json.

Workers copy samples into disjoint byte ranges of the preallocated blob, so
they need no locks and the bytes do not depend on their number; the main
process then writes the tables and, last, the index, fsyncing everything.
Where the files go and how they are published is ``publish``'s business.
"""

from __future__ import annotations

import dataclasses
import json
import os
import zlib
from array import array
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import NamedTuple

import numpy as np
from numpy.typing import NDArray

from .. import fsutil, pagecache
from .._version import __version__
from ..errors import MismatchError, SourceError
from ..format import provenance
from ..format.dtypes import dtype_to_json, storage_dtype
from ..format.index import (
    BLOB_HEADER_NBYTES,
    BLOB_NAME,
    CRC_DTYPE,
    INDEX_NAME,
    MAX_INDEX_NBYTES,
    MAX_NBYTES,
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
)
from ..format.tables import sample_shape_of_table
from ..ingest.elements import ByteReader, Piece, stored_pieces
from ..ingest.npy_header import SCANNED_LIMIT, MemberHeader, parse_npy_header
from ..ingest.npz import CHUNK_NBYTES, LOCATION_FIELDS, MemberLocation
from ..ingest.sources import kind_scanned, open_source
from .casts import can_cast
from .layout import FieldPlan, Plan

# A batch of the copy pass holds at most this many source bytes (unless one file alone is larger).
BATCH_NBYTES = 32 << 20
STORED_NBYTES = MemberLocation._fields.index("stored_nbytes")
# Adjacent small writes are gathered into runs of up to RUN_NBYTES, at most MAX_RUNS at once.
RUN_NBYTES = 1 << 20
MAX_RUNS = 16


class MemberTask(NamedTuple):
    key: str
    dtype: np.dtype  # as stored
    shape: tuple[int, ...] | None  # the member's expected shape; None: any with 0 rows
    file_offset: int
    cast: bool
    rows: int  # samples this member holds: 1, or its first dimension in rows mode


class FieldTask(NamedTuple):
    """One field of a batch of consecutive source files, one entry per file."""

    key: str
    dtype: np.dtype  # as stored
    cast: bool
    file_offsets: NDArray[np.int64]  # where each file's samples of the field start in the blob
    shapes: NDArray[np.int64]  # (files, ndim): each file's member shape (its rows' in rows mode)


class BatchTask(NamedTuple):
    """Copy consecutive source files (or sample directories) to their places in the blob."""

    first_file: int
    paths: list[str]
    rows: NDArray[np.int64]  # samples each file holds
    fields: tuple[FieldTask, ...]
    locations: NDArray[np.int64]  # (files, fields, LOCATION_FIELDS): MemberLocation rows
    mode: str


class BatchResult(NamedTuple):
    first_file: int
    num_files: int
    crc32s: tuple[NDArray[np.uint32], ...]  # per field, one CRC-32 per sample of the batch
    nbytes: int
    failures: tuple[tuple[int, str], ...]  # (file, reason): left out with skip_bad


class MemberLocations:
    """Where every selected member of every source lies, as scanned: compact int64 rows.

    Rows come in plan order (sources in order, keys sorted), so the table of
    N sources is an (N, fields, LOCATION_FIELDS) array with no object per file.
    """

    def __init__(self) -> None:
        self.values: array[int] = array("q")

    def add(self, locations: Mapping[str, MemberLocation]) -> None:
        for key in sorted(locations):
            self.values.extend(locations[key])

    def table(self, num_files: int, num_fields: int) -> NDArray[np.int64]:
        return np.frombuffer(self.values, dtype=np.int64).reshape(num_files, num_fields, LOCATION_FIELDS)


def batch_tasks(
    plan: Plan, locations: NDArray[np.int64], max_files: int, max_nbytes: int = BATCH_NBYTES
) -> Iterator[BatchTask]:
    """Tasks of consecutive files, in order: at most ``max_files`` files, ``max_nbytes`` source bytes
    (unless one file alone is larger), built lazily from the plan."""
    ends = np.cumsum(locations[:, :, STORED_NBYTES].sum(axis=1))
    start = 0
    while start < len(plan.sources):
        before = int(ends[start - 1]) if start else 0
        stop = int(np.searchsorted(ends, before + max_nbytes, side="right"))
        stop = min(max(stop, start + 1), start + max_files, len(plan.sources))
        yield _batch_task(plan, locations, start, stop)
        start = stop


def _batch_task(plan: Plan, locations: NDArray[np.int64], start: int, stop: int) -> BatchTask:
    firsts = plan.file_starts[start:stop]
    rows = plan.file_starts[start + 1 : stop + 1] - firsts
    # A file of no rows has no sample to take a shape from; its shape is not used.
    shaped = np.minimum(firsts, max(plan.num_samples - 1, 0))
    fields = tuple(
        FieldTask(
            f.name,
            f.dtype,
            f.cast,
            BLOB_HEADER_NBYTES + f.data.offset + f.sample_offsets[firsts],
            f.shapes[shaped] if plan.num_samples else np.zeros((len(firsts), f.ndim), np.int64),
        )
        for f in plan.fields
    )
    return BatchTask(start, list(plan.sources[start:stop]), rows, fields, locations[start:stop], plan.mode)


# --- worker side -------------------------------------------------------------


def write_batch(blob_path: str, task: BatchTask, skip_bad: bool) -> BatchResult:
    """Copy a batch of source files' members into the blob; return their CRC-32s.

    A file that turns out bad raises SourceError, or with ``skip_bad`` is
    listed in the result instead. The blob is opened for this task alone: a
    descriptor kept for later tasks would outlive the file it names (a retry
    replaces ``data.npy``).
    """
    starts = np.zeros(len(task.paths) + 1, dtype=np.int64)
    np.cumsum(task.rows, out=starts[1:])
    crcs = tuple(np.zeros(int(starts[-1]), dtype=np.uint32) for _ in task.fields)
    failures = []
    nbytes = 0
    fd = os.open(blob_path, os.O_WRONLY | fsutil.BINARY)
    try:
        out = GatheredWrites(fd)
        for i, path in enumerate(pagecache.read_ahead(task.paths)):
            try:
                file_crcs, file_nbytes = _copy_file(task, i, path, out, blob_path)
            except SourceError as exc:
                if not skip_bad or isinstance(exc, MismatchError):  # a file that disagrees is not bad
                    raise
                failures.append((task.first_file + i, str(exc)))
                continue
            for table, values in zip(crcs, file_crcs, strict=True):
                table[starts[i] : starts[i + 1]] = values
            nbytes += file_nbytes
        out.flush()
    finally:
        os.close(fd)
    return BatchResult(task.first_file, len(task.paths), crcs, nbytes, tuple(failures))


def _copy_file(
    task: BatchTask, i: int, path: str, out: GatheredWrites, blob_path: str
) -> tuple[list[list[int]], int]:
    """Copy file ``i`` of the batch: its members' CRC-32s (one per sample) and stored bytes."""
    rows = int(task.rows[i])
    crcs = []
    nbytes = 0
    locations = [MemberLocation(*values) for values in task.locations[i].tolist()]  # Python ints
    scanned = kind_scanned(locations[0]) if task.fields else None
    with open_source(path, scanned, SCANNED_LIMIT) as source:
        for field, location in zip(task.fields, locations, strict=True):
            member = _member_task(field, i, rows, task.mode)
            where = f"{path}[{member.key}]"
            reader = ByteReader(source.located_bytes(member.key, location), where)
            header = parse_npy_header(_HeaderStream(reader), member.key, where, SCANNED_LIMIT)
            if header.header_nbytes + header.nbytes != location.nbytes or not _matches_plan(header, member):
                raise SourceError(f"{where}: changed since it was scanned")
            chunks = _rest(reader, header.nbytes)
            if header.fortran_order and len([d for d in header.shape if d != 1]) > 1:
                crcs.append(_copy_fortran(chunks, header, member, blob_path, where))
            else:
                crcs.append(_copy_c_order(chunks, header, member, out, where))
            nbytes += _stored_nbytes(header, member)
    return crcs, nbytes


def _member_task(field: FieldTask, i: int, rows: int, mode: str) -> MemberTask:
    shape = tuple(field.shapes[i].tolist())
    if mode == "rows":
        return MemberTask(
            field.key,
            field.dtype,
            (rows, *shape) if rows else None,
            int(field.file_offsets[i]),
            field.cast,
            rows,
        )
    return MemberTask(field.key, field.dtype, shape, int(field.file_offsets[i]), field.cast, rows)


class _HeaderStream:
    """The start of a member's bytes as the stream parse_npy_header reads."""

    def __init__(self, reader: ByteReader) -> None:
        self.reader = reader

    def read(self, nbytes: int) -> bytes:
        return bytes(self.reader.read(nbytes))


def _rest(reader: ByteReader, nbytes: int) -> Iterator[Piece]:
    """The member's data after its header, then to its end, so its size and CRC-32 are checked."""
    yield from reader.pieces(nbytes)
    reader.finish()


class GatheredWrites:
    """Writes at given blob offsets, a run of adjacent small ones sent in one pwrite.

    The samples of consecutive files lie back to back in each field, so a
    batch of small files costs one write per field, not one per member. At
    most MAX_RUNS runs of under RUN_NBYTES each are held; ``flush`` writes them.
    """

    def __init__(self, fd: int) -> None:
        self.fd = fd
        self.runs: dict[int, tuple[int, bytearray]] = {}  # end offset -> (start offset, bytes)

    def write(self, data: Piece, offset: int) -> None:
        run = self.runs.pop(offset, None)
        if run is None:
            if len(data) >= RUN_NBYTES:
                self._put(data, offset)
                return
            if len(self.runs) >= MAX_RUNS:
                self.flush()
            run = (offset, bytearray())
        start, gathered = run
        gathered += data
        if len(gathered) >= RUN_NBYTES:
            self._put(gathered, start)
        else:
            self.runs[offset + len(data)] = (start, gathered)

    def _put(self, data: Piece, offset: int) -> None:
        fsutil.write_all_at(self.fd, data, offset)
        fsutil.start_writeback(self.fd, offset, len(data))

    def flush(self) -> None:
        for start, gathered in self.runs.values():
            self._put(gathered, start)
        self.runs.clear()


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
    chunks: Iterator[Piece], header: MemberHeader, member: MemberTask, out: GatheredWrites, where: str
) -> list[int]:
    crcs = _RowCrcs(member.rows, _stored_nbytes(header, member))
    position = member.file_offset
    for piece in stored_pieces(chunks, header, member.dtype, where):
        out.write(piece, position)
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
    chunks: Iterator[Piece], header: MemberHeader, member: MemberTask, blob_path: str, where: str
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
        ragged_shape=None if f.fixed_shape is not None else sample_shape_of_table(f.shapes),
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

    def widest_shape(f: Field) -> Field:  # a file left out can turn a null into a number
        return f if f.ragged_shape is None else dataclasses.replace(f, ragged_shape=(MAX_NBYTES,) * f.ndim)

    no_crcs = np.zeros(0, dtype=CRC_DTYPE)
    fields = tuple(widest_shape(_table_field(f, no_crcs, widest)) for f in plan.fields)
    return len(index_to_json(_plan_index(plan, fields, max_skipped, part)).encode("utf-8"))


def check_index_nbytes(out_dir: str, plan: Plan, max_skipped: int, part: tuple[int, int] | None) -> None:
    """SourceError, before anything is copied, when index.json would be larger than readers accept:
    records of very many fields (their descriptions are in it) in several keys."""
    nbytes = index_nbytes_bound(plan, max_skipped, part)
    if nbytes <= MAX_INDEX_NBYTES:
        return
    sizes = {f.name: len(json.dumps(dtype_to_json(f.dtype))) for f in plan.fields}
    largest = max(sizes, key=sizes.__getitem__)
    raise SourceError(
        f"{out_dir}: index.json would be {nbytes:,} bytes, more than the {MAX_INDEX_NBYTES:,} a reader "
        f"accepts (the dtype of field {largest!r} alone takes {sizes[largest]:,}); convert fewer keys"
    )


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


def dataset_nbytes(plan: Plan, skipped: Sequence[tuple[str, str]], part: tuple[int, int] | None) -> int:
    """Bytes of every file the conversion of ``plan`` writes: the blob, sources.jsonl,
    skipped.jsonl and (at most) index.json.

    With long paths, sources.jsonl can be a large part of a dataset of small samples.
    """
    skipped_nbytes = sum(len(line.encode("utf-8")) for line in provenance.skipped_lines(skipped))
    text_nbytes = provenance.source_lines_nbytes(plan) + skipped_nbytes
    index_nbytes = index_nbytes_bound(plan, len(skipped) + len(plan.sources), part)
    return BLOB_HEADER_NBYTES + plan.payload_nbytes + text_nbytes + index_nbytes
