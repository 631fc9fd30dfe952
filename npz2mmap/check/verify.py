"""Verifying a dataset: checksums, table consistency, zero padding, and sources.

Unlike opening, which stops at the first problem, verify collects every
problem it finds and names the affected fields and samples.
"""

from __future__ import annotations

import math
import os
import zlib
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from .. import fsutil
from ..errors import FormatError, SourceError
from ..format import provenance
from ..format.dtypes import storage_dtype
from ..format.index import BLOB_HEADER_NBYTES, IDENTITY_NBYTES, Field, Index, load_index
from ..format.manifest import is_manifest_dir, resolve_parts
from ..ingest.discover import NPZ_SUFFIX
from ..ingest.elements import ByteReader, Piece, stored_pieces
from ..ingest.npy_header import HeaderLimit, MemberHeader, header_limit
from ..ingest.npz import CHUNK_NBYTES, NPY_SUFFIX
from ..ingest.sources import Source, holds_npy_files, open_source
from ..progress import Progress, SilentProgress
from ..read.parts import Parts
from ..read.reader import DatasetReader, identity_problem
from ..text import plural
from ..write.casts import can_cast

MAX_SAMPLES_NAMED = 10
WHOLE_FILE = -1  # a problem offset for a source that holds no sample (a shard of zero rows)


@dataclass
class VerifyReport:
    path: str
    num_samples: int = 0
    problems: list[str] = field(default_factory=list)
    bad_samples: dict[str, list[int]] = field(default_factory=dict)
    sources_checked: bool = False
    unsourced: int = 0  # samples whose source is not named (a Writer's, appended without source=)
    labelled: int = 0  # samples whose source is a label, no file (a Writer's source="generated/3")

    @property
    def ok(self) -> bool:
        return not self.problems


def verify(
    path: str | os.PathLike[str],
    sources: bool = False,
    progress: Progress | None = None,
    max_header_size: int | HeaderLimit | None = None,
) -> VerifyReport:
    """Check a dataset (or every part of a multi-part one) and report every problem found.

    With ``sources``, also compare every sample with its source (NPZ, .npy or sample directory),
    reading ``.npy`` headers up to ``max_header_size`` characters, as ``convert`` does.
    Raises nothing for a damaged dataset: problems go into the report. Raises FormatError for a
    path where there is no dataset at all, as every reader does.
    Sample numbers in a multi-part report are global, problems name the part.
    """
    progress = progress or SilentProgress()
    limit = header_limit(max_header_size)
    if not os.path.lexists(path):  # nothing to check: said in one line, as every reader says it
        load_index(path)  # raises: no such dataset (or one a conversion is writing)
    try:
        parts = resolve_parts(path)
    except FormatError as exc:
        return VerifyReport(os.fspath(path), problems=[str(exc)])
    if len(parts) == 1 and not is_manifest_dir(os.fspath(path)):
        return _verify_one(parts[0], sources, progress, limit)
    report = VerifyReport(os.fspath(path), sources_checked=sources)
    try:
        Parts(path)  # the manifest's parts agree and are one whole run
    except FormatError as exc:
        report.problems.append(str(exc))
    for part in parts:
        one = _verify_one(part, sources, progress, limit)
        report.problems += [f"part {part}: {problem}" for problem in one.problems]
        for name, samples in one.bad_samples.items():
            report.bad_samples.setdefault(name, []).extend(report.num_samples + i for i in samples)
        report.num_samples += one.num_samples
        report.sources_checked &= one.sources_checked
        report.unsourced += one.unsourced
        report.labelled += one.labelled
    return report


def _verify_one(path: str, sources: bool, progress: Progress, limit: HeaderLimit) -> VerifyReport:
    report = VerifyReport(path)
    try:
        index = load_index(report.path)
        reader = DatasetReader(report.path, index, check_identity=False)
    except FormatError as exc:
        report.problems.append(str(exc))
        return report
    if not reader.has_identity():
        report.problems.append(identity_problem(reader.blob_path))
    report.num_samples = index.num_samples
    _check_fields(reader, index.fields, report, progress)
    _check_padding(reader, index, report)
    source_files = _check_provenance_files(report, index)
    if sources and source_files is not None:
        progress.stage("compare", index.num_samples, 0, unit="samples")
        _compare_sources(reader, source_files, report, progress, limit)
        report.sources_checked = True
    return report


def _check_fields(
    reader: DatasetReader, fields: tuple[Field, ...], report: VerifyReport, progress: Progress
) -> None:
    """Check every sample's checksum in each field whose tables are consistent, sample by sample.

    Going sample by sample lets progress count samples; problems are
    reported field by field, in index order.
    """
    table_problems = {f.name: reader.table_problems(f.name) for f in fields}
    checked = [f for f in fields if not table_problems[f.name]]
    expected = {f.name: reader.table(f.name, "sample_crc32") for f in checked}
    bad: dict[str, list[int]] = {f.name: [] for f in checked}
    progress.stage("verify", len(reader), sum(f.data.nbytes for f in checked), unit="samples")
    for i in range(len(reader)):
        nbytes = 0
        for f in checked:
            data = reader.view(f.name, i)  # tables are consistent: raises nothing
            if zlib.crc32(np.ascontiguousarray(data).reshape(-1).view(np.uint8).data) != expected[f.name][i]:
                bad[f.name].append(i)
            nbytes += data.nbytes
        progress.advance(1, nbytes)
    for f in fields:
        report.problems += [f"field {f.name!r}: {problem}" for problem in table_problems[f.name]]
        if bad.get(f.name):
            _report_bad_checksums(report, f.name, bad[f.name])


def _report_bad_checksums(report: VerifyReport, name: str, bad: list[int]) -> None:
    report.bad_samples[name] = bad
    more = " ..." if len(bad) > MAX_SAMPLES_NAMED else ""
    shown = ", ".join(str(i) for i in bad[:MAX_SAMPLES_NAMED]) + more
    verb = "does not match its checksum" if len(bad) == 1 else "do not match their checksums"
    report.problems.append(f"field {name!r}: {plural(len(bad), 'sample')} {verb}: {shown}")


def _check_padding(reader: DatasetReader, index: Index, report: VerifyReport) -> None:
    """Bytes between regions must be zero, so any flipped byte is detected somewhere."""
    regions = [(0, IDENTITY_NBYTES)] + [
        (r.offset, r.end) for f in index.fields for r in (f.data, *f.tables().values())
    ]
    spans = sorted(regions)
    cursor = 0
    for start, end in [*spans, (index.payload_nbytes, index.payload_nbytes)]:
        if start > cursor and reader.payload[cursor:start].any():
            report.problems.append(
                f"padding at blob offset {BLOB_HEADER_NBYTES + cursor}..{BLOB_HEADER_NBYTES + start} "
                "is not zero"
            )
        cursor = max(cursor, end)


def _check_provenance_files(report: VerifyReport, index: Index) -> tuple[list[str], Any] | None:
    """Check sources.jsonl and skipped.jsonl; return the source files and their first samples."""
    try:
        provenance.read_skipped(report.path, index)
    except FormatError as exc:
        report.problems.append(str(exc))
    try:
        return provenance.read_sources(report.path, index)
    except FormatError as exc:
        report.problems.append(str(exc))
        return None


def _compare_sources(
    reader: DatasetReader,
    sources: tuple[list[str], Any],
    report: VerifyReport,
    progress: Progress,
    limit: HeaderLimit,
) -> None:
    """Compare each sample with its source: a file, or in rows mode a row of a file.

    A sample whose source is not named (empty), or is a label (a Writer's ``source=`` that
    names no sample source: see _is_a_label), or is shared with other samples (a Writer's
    rows of one file, where a conversion names each file once), is counted, not compared.
    """
    files, starts = sources
    rows_mode = reader.index.mode == "rows"
    shared = set() if rows_mode else _named_more_than_once(files)
    for k, path in enumerate(files):
        first, count = int(starts[k]), int(starts[k + 1] - starts[k])
        if not path:
            report.unsourced += count
            progress.advance(count, 0)
            continue
        if path in shared or _is_a_label(path):
            report.labelled += count
            progress.advance(count, 0)
            continue
        rows: list[int | None] = list(range(count)) if rows_mode else [None]
        for offset, problem in _compare_file(reader, first, path, rows, limit):
            if offset == WHOLE_FILE:
                report.problems.append(f"{path}: {problem}")
                continue
            i = first + offset
            report.problems.append(
                f"sample {i} ({path}{'' if rows[offset] is None else f' row {rows[offset]}'}): {problem}"
            )
            report.bad_samples.setdefault("sources", []).append(i)
        progress.advance(count, 0)


def _compare_file(
    reader: DatasetReader, first: int, path: str, rows: list[int | None], limit: HeaderLimit
) -> Iterator[tuple[int, str]]:
    """Stream each member of one source and compare its stored samples byte for byte.

    The source's raw bytes, swapped to little-endian (and cast, for a field
    made with --cast) exactly as convert stores them, must equal the stored
    bytes, record padding included. Memory stays bounded whatever the size.
    """
    if "\0" in path or not _encodable(path):  # a Writer's source= label, no file name
        yield from _for_every_sample(
            rows, f"{path!r} is not a file name (a Writer's label?): no source to compare"
        )
        return
    try:
        with open_source(path, limit=limit) as source:
            keys = source.keys()
            for name in reader.field_names:
                if name not in keys:
                    missing = f"key {name!r} is missing from the source"
                    yield from _for_every_sample(rows, missing)
                    continue
                yield from _compare_member(reader, source, name, path, first, rows)
    except (SourceError, FormatError) as exc:
        yield from _for_every_sample(rows, str(exc))


def _is_a_label(path: str) -> bool:
    """A source= a Writer recorded that names no sample source. Convert and the Writer record
    every source naming a file as an absolute path, so a relative one is a label, whatever the
    working directory holds; so is an absolute one of a kind no sample comes from (a file or
    a name whose suffix is not .npz or .npy, a directory holding no .npy file). An absolute
    .npz, .npy or suffixless path gone missing is a problem (a source, or a sample directory,
    removed), never a label."""
    if not os.path.isabs(path):
        return True
    if os.path.isdir(path):
        return not _holds_npy_files(path)
    suffix = os.path.splitext(path)[1].lower()
    return bool(suffix) and suffix not in (NPZ_SUFFIX, NPY_SUFFIX)


def _holds_npy_files(path: str) -> bool:
    try:
        with os.scandir(path) as entries:
            return holds_npy_files(list(entries))
    except OSError as exc:
        fsutil.reraise_if_from_a_handler(exc)
        return True  # unreadable: compared, and the comparison says why it fails


def _named_more_than_once(files: Sequence[str]) -> set[str]:
    """Sources several samples name (a Writer's rows of one file): none is any one sample's."""
    seen: set[str] = set()
    repeated: set[str] = set()
    for path in files:
        if path in seen:
            repeated.add(path)
        seen.add(path)
    return repeated


def _encodable(path: str) -> bool:
    try:
        os.fsencode(path)
    except UnicodeError:
        return False
    return True


def _for_every_sample(rows: list[int | None], problem: str) -> Iterator[tuple[int, str]]:
    """One problem for each sample of a source; for a shard of zero rows, one for the file."""
    if not rows:
        yield WHOLE_FILE, problem
    yield from ((offset, problem) for offset in range(len(rows)))


def _compare_member(
    reader: DatasetReader,
    source: Source,
    name: str,
    path: str,
    first: int,
    rows: list[int | None],
) -> Iterator[tuple[int, str]]:
    """Compare one member with its samples: dtype, shapes, then every byte in file order."""
    header = source.header(name)
    field = reader.index.field(name)
    dtype_ok = (
        can_cast(header.dtype, field.dtype) if field.cast else storage_dtype(header.dtype) == field.dtype
    )
    if not dtype_ok:
        problem = f"field {name!r}: dtype {field.dtype} differs from the source's {header.dtype}"
        yield from _for_every_sample(rows, problem)
        return
    mismatched = list(_shape_problems(reader, name, header, first, rows))
    if mismatched:
        yield from mismatched
        return
    rows_mode = reader.index.mode == "rows"
    stored = reader.view_consecutive(name, first, len(rows)) if rows_mode else reader.view(name, first)
    where = f"{path}[{name}]"
    expected = stored_pieces(source.data_chunks(name, header), header, field.dtype, where)
    found = _file_order_pieces(stored, header.fortran_order)
    bad_rows: set[int] = set()
    padding_rows: set[int] = set()
    value_bytes = value_byte_mask(field.dtype) if _may_hold_padding(field.dtype) else None
    itemsize = field.dtype.itemsize
    for elements, padding_only in _changed_elements(expected, found, stored.nbytes, itemsize, value_bytes):
        bad_rows.update(_element_rows(elements, header, rows_mode).tolist())
        padding_rows.update(_element_rows(padding_only, header, rows_mode).tolist())
    for offset in sorted(bad_rows):
        yield offset, f"field {name!r}: values differ from the source"
    for offset in sorted(padding_rows - bad_rows):
        yield offset, f"field {name!r}: the values equal the source's, but record padding bytes differ"


def _shape_problems(
    reader: DatasetReader, name: str, header: MemberHeader, first: int, rows: list[int | None]
) -> Iterator[tuple[int, str]]:
    """Each sample whose stored shape is not its source's (in rows mode, rows must be 0..n-1)."""
    rows_mode = reader.index.mode == "rows"
    if rows_mode and (not header.shape or rows != list(range(header.shape[0]))):
        found = header.shape[0] if header.shape else 0
        held = plural(found, "row")
        problem = f"field {name!r}: the source holds {held}, not the {len(rows)} sources.jsonl names"
        yield from _for_every_sample(rows, problem)
        return
    expected = header.shape[1:] if rows_mode else header.shape
    for offset in range(len(rows)):
        shape = reader.view(name, first + offset).shape
        if shape != expected:
            yield offset, f"field {name!r}: shape {shape} differs from the source's {expected}"


def _file_order_pieces(stored: np.ndarray, fortran_order: bool) -> Iterator[memoryview]:
    """The stored bytes in the order the source file holds them, in bounded pieces."""
    raw = stored.view(np.dtype((np.void, stored.dtype.itemsize)))
    yield from _c_order_pieces(raw.T if fortran_order else raw)


def _c_order_pieces(array: np.ndarray) -> Iterator[memoryview]:
    if array.flags.c_contiguous:
        flat = array.reshape(-1).view(np.uint8)
        for start in range(0, len(flat), CHUNK_NBYTES):
            yield flat[start : start + CHUNK_NBYTES].data
    elif array.nbytes <= CHUNK_NBYTES:
        yield np.ascontiguousarray(array).reshape(-1).view(np.uint8).data
    elif array.ndim > 1:
        for k in range(len(array)):
            yield from _c_order_pieces(array[k])
    else:
        per_piece = max(1, CHUNK_NBYTES // array.dtype.itemsize)
        for start in range(0, len(array), per_piece):
            yield from _c_order_pieces(array[start : start + per_piece])


def _changed_elements(
    expected: Iterator[Piece],
    found: Iterator[memoryview],
    nbytes: int,
    itemsize: int,
    value_bytes: np.ndarray | None,
) -> Iterator[tuple[np.ndarray, np.ndarray]]:
    """Indices, in stream order, of the elements whose bytes differ between two streams: those
    where a value's bytes differ, and those where only record padding (not ``value_bytes``;
    None: every byte is a value's) does."""
    left, right = ByteReader(expected, "source"), ByteReader(found, "dataset")
    for position in range(0, nbytes, CHUNK_NBYTES):
        size = min(CHUNK_NBYTES, nbytes - position)
        differ = position + np.flatnonzero(
            np.frombuffer(left.read(size), np.uint8) != np.frombuffer(right.read(size), np.uint8)
        )
        if len(differ):
            in_value = np.ones(len(differ), bool) if value_bytes is None else value_bytes[differ % itemsize]
            yield np.unique(differ[in_value] // itemsize), np.unique(differ[~in_value] // itemsize)
    left.finish()
    right.finish()


def _element_rows(elements: np.ndarray, header: MemberHeader, rows_mode: bool) -> np.ndarray:
    """The row (axis-0 index) of each element, counted in file order."""
    if not rows_mode:
        return np.zeros(min(len(elements), 1), dtype=np.int64)
    if header.fortran_order:
        return np.unique(elements % header.shape[0])
    return np.unique(elements // math.prod(header.shape[1:]))


# A record longer than this is compared byte for byte, padding counted as values: its mask would
# cost its size in memory (a void element may be a gigabyte).
MAX_MASKED_ITEMSIZE = 1 << 20


def _may_hold_padding(dtype: np.dtype) -> bool:
    """Records (or subarrays of them) short enough to mask: only they can differ in padding alone."""
    base = dtype.subdtype[0] if dtype.subdtype is not None else dtype
    return base.names is not None and dtype.itemsize <= MAX_MASKED_ITEMSIZE


def value_byte_mask(dtype: np.dtype) -> np.ndarray:
    """Which bytes of one element of ``dtype`` hold values (True) rather than record padding."""
    mask = np.zeros(dtype.itemsize, dtype=bool)
    _mark_values(dtype, 0, mask)
    return mask


def _mark_values(dtype: np.dtype, offset: int, mask: np.ndarray) -> None:
    fields = dtype.fields
    if dtype.subdtype is not None:  # a subarray: its base's mask, repeated
        base, shape = dtype.subdtype
        count = math.prod(shape)
        mask[offset : offset + count * base.itemsize] = np.tile(value_byte_mask(base), count)
    elif fields is not None:
        for name in dtype.names or ():
            member, member_offset = fields[name][:2]
            _mark_values(member, offset + member_offset, mask)
    else:
        mask[offset : offset + dtype.itemsize] = True
