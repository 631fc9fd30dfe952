"""Merging parts: a manifest that lists them (instant), or one dataset copied from them.

Parts converted from contiguous slices of one sorted input list (``convert
--part``) merge, with ``copy``, into exactly the bytes a single conversion of
the whole list writes: the layout rules are the same and the data and
checksum tables are concatenated, never recomputed.
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Iterable
from dataclasses import dataclass

import numpy as np

from .. import fsutil
from ..errors import FormatError, MissingInputError, OutputError, RaggedFieldWarning, SourceError
from ..format import provenance
from ..format.index import BLOB_HEADER_NBYTES, INDEX_NAME
from ..format.manifest import (
    MANIFEST_NAME,
    PathLike,
    check_part_set,
    manifest_text,
    naming_parts,
    read_manifest,
    refuse_unordered,
    resolve_parts,
)
from ..ingest.discover import RealPaths
from ..progress import Progress, progress_display
from ..read.parts import Parts, PartsReader
from . import blob_writer, publish
from .layout import Plan, lay_out
from .options import check_flags, check_out_dir, listed_paths

COPY_CHUNK_NBYTES = 8 << 20


@dataclass(frozen=True)
class MergeResult:
    out_dir: str
    num_parts: int
    num_samples: int
    copied: bool
    ragged_across_parts: tuple[str, ...] = ()  # one line per field each part holds fixed, in different shapes


def merge(
    parts: PathLike | Iterable[PathLike],
    out_dir: PathLike,
    *,
    copy: bool = False,
    overwrite: bool = False,
    progress: Progress | str | None = None,
) -> MergeResult:
    """Present ``parts`` (dataset paths, in order: a list or any iterable but a set; one path is
    a list of one) as one dataset at ``out_dir``.

    Without ``copy``, writes ``out_dir/manifest.json`` naming the parts
    (relative paths, so the tree can move as a whole). With ``copy``, writes a
    single dataset at ``out_dir``. Raises FormatError when the parts are
    invalid, disagree or, where they record a part (i, n), are not one whole
    run in order (see manifest.check_part_set); OutputError when ``out_dir``
    cannot be written. Nothing is written when it raises before writing.
    """
    refuse_unordered(parts)
    listed = listed_paths("parts", parts)
    check_flags(copy=copy, overwrite=overwrite)
    check_out_dir(out_dir)
    copy, overwrite = bool(copy), bool(overwrite)  # numpy's bools too, as the plain values they are
    display = progress_display(progress)  # as convert's: None, a mode of --progress, or a Progress
    for part in listed:  # a part not there is a usage mistake, as a missing INPUT of convert is
        if not os.path.lexists(part):
            raise MissingInputError(f"{os.fspath(part)}: no such dataset")
    given = resolve_parts(listed)
    opened = Parts(given)  # without empty parts, which contribute nothing
    labels = [index.part for index in opened.all_indexes]  # empty parts' too
    check_part_set(list(zip(given, labels, strict=True)), naming_parts(given))
    _check_disjoint_sources(opened, naming_parts(given))
    _refuse_all_left_out(opened)
    out = os.fspath(out_dir)
    ragged = ragged_across_parts(opened)
    if copy:
        with display as shown:
            _merge_by_copy(opened, out, overwrite, shown)
    else:
        _write_manifest(given, out, overwrite)
    for line in ragged:
        warnings.warn(line, RaggedFieldWarning, stacklevel=2)
    return MergeResult(out, len(given), opened.num_samples, copy, ragged)


def ragged_across_parts(parts: Parts) -> tuple[str, ...]:
    """A line for each field that every part holding samples stores fixed, but not all in one
    shape: ragged only once merged, which no part's conversion could see (a Writer's parts
    each hold ``fixed=`` keys to their own first sample)."""
    lines = []
    pairs = zip(parts.paths, parts.indexes, strict=True)
    holding = [(path, index) for path, index in pairs if index.num_samples]
    if any(index.num_samples == 1 for _, index in holding):
        return ()  # a part of one sample holds every field fixed, whatever the data: nothing to see
    for name, info in parts.fields.items():
        shapes = [(path, index.field(name).shape) for path, index in holding]
        if info.shape is not None or not shapes or any(shape is None for _, shape in shapes):
            continue
        first, shape = shapes[0]
        other, other_shape = next((item for item in shapes if item[1] != shape), (None, None))
        if other is None:  # one shape wherever there are samples: no part differs
            continue
        lines.append(
            f"field {name} is ragged only because the parts differ in shape: {first} has {shape}, "
            f"{other} has {other_shape}; convert the parts again with one shape if it should be fixed"
        )
    return tuple(lines)


def _refuse_all_left_out(parts: Parts) -> None:
    """SourceError when --skip-bad left out every file of the parts, as one conversion of those
    files is refused: parts merge into what one conversion makes, or nothing. Files of no rows
    are files read, so parts of them merge, as they convert, into a dataset of no samples."""
    num_skipped = sum(index.num_skipped for index in parts.all_indexes)
    if any(index.num_sources for index in parts.all_indexes) or not num_skipped:
        return
    pairs = zip(parts.all_paths, parts.all_indexes, strict=True)
    path, index = next((path, index) for path, index in pairs if index.num_skipped)
    first = provenance.read_skipped(path, index)[0][1]
    raise SourceError(f"no usable input: --skip-bad left out all {num_skipped:,}; the first: {first}")


def _check_disjoint_sources(parts: Parts, where: str) -> None:
    """FormatError if two parts of one run name the same source: one was converted again, alone,
    after the input list changed, so its slice overlaps its neighbour's (samples twice).

    Only parts that record a part (i, n) are compared, and among them only those that name each
    source once, as a conversion does: a Writer's parts may give many samples one ``source=``
    (or none), which says nothing of overlap. Reads every part's sources.jsonl once.
    """
    owner: dict[str, tuple[str, str]] = {}  # by real path (one file named by two paths): name, part
    real_path = RealPaths()
    for path, index in zip(parts.paths, parts.indexes, strict=True):
        if index.part is None:
            continue
        names = [name for name in provenance.read_sources(path, index)[0] if os.path.isabs(name)]  # no label
        if len(set(names)) < len(names):
            continue
        for name in names:
            first_name, first = owner.setdefault(_real_or_as_named(name, real_path), (name, path))
            if first != path:
                also = "" if first_name == name else f" (in it as {first_name})"
                raise FormatError(
                    f"{where}: {name} is a source of both {first}{also} and {path}: the inputs changed "
                    "between their conversions (a part converted again alone), or two Writers were given one "
                    "source=; convert every part of the run again, or give each sample its own source"
                )


def _real_or_as_named(name: str, real_path: RealPaths) -> str:
    """A source's real path (links resolved), or its name where it is no absolute path of
    this system (a label, a source since removed)."""
    if not os.path.isabs(name):
        return name
    try:
        return real_path(os.path.normpath(name))
    except (OSError, ValueError):
        return name


def _write_manifest(parts: list[str], out: str, overwrite: bool) -> None:
    publish.check_creatable_dir(out)
    if os.path.exists(os.path.join(out, INDEX_NAME)):
        raise OutputError(f"{out}: holds a dataset; write the manifest into another directory")
    manifest = os.path.join(out, MANIFEST_NAME)
    if os.path.lexists(manifest):
        if not overwrite:
            raise OutputError(f"{manifest}: already exists; pass --overwrite to replace it")
        _refuse_foreign_manifest(manifest, out)
    publish.sweep_leftovers_of(out)
    try:
        os.makedirs(out, exist_ok=True)
        temporary = f"{manifest}.{os.getpid()}.tmp"
        with open(temporary, "w", encoding="utf-8") as fp:
            fp.write(manifest_text(out, parts))
            fp.flush()
            os.fsync(fp.fileno())
        os.replace(temporary, manifest)
        fsutil.fsync_dir(out)
    except OSError as exc:
        fsutil.reraise_if_from_a_handler(exc)
        raise OutputError(f"{manifest}: cannot write ({exc.strerror or exc})") from exc


def _refuse_foreign_manifest(manifest: str, out: str) -> None:
    """--overwrite replaces only a manifest that merge wrote."""
    try:
        read_manifest(out)
    except FormatError as exc:
        raise OutputError(f"{manifest}: exists and is not ours ({exc}); refusing to replace it") from None


def _merge_by_copy(parts: Parts, out: str, overwrite: bool, progress: Progress) -> None:
    publish.check_output(out, overwrite)
    reader = PartsReader(parts)
    plan = _plan_concatenation(reader)
    skipped = _read_skipped(parts)
    with publish.output_lock(out):
        staging = publish.make_staging_dir(out)
        try:
            progress.stage("merge", len(parts.paths), plan.data_nbytes, unit="parts")
            blob_path = blob_writer.create_blob(staging, plan.payload_nbytes)
            _copy_data(reader, plan, blob_path, progress)
            crcs = [
                np.concatenate([part.table(f.name, "sample_crc32") for part in reader.readers])
                for f in plan.fields
            ]
            blob_writer.finish_dataset(staging, plan, crcs, skipped)
            publish.publish(staging, out, overwrite)
        except OSError as exc:
            fsutil.reraise_if_from_a_handler(exc)
            raise OutputError(f"{out}: cannot write the dataset ({exc.strerror or exc})") from exc
        finally:
            publish.remove_staging(staging)


def _plan_concatenation(reader: PartsReader) -> Plan:
    """Lay out the whole from the parts' tables, each checked first as verify checks it.

    The new tables are built from the parts' (shapes re-planned, sample
    checksums concatenated), so a damaged table would otherwise be copied
    under a fresh checksum.
    """
    parts = reader.parts
    for part in reader.readers:
        for name in part.field_names:
            part.check_tables(name)
    modes = {index.mode for index in parts.indexes}
    if len(modes) > 1:
        raise FormatError(
            f"parts were made in different modes ({', '.join(sorted(modes))}); they cannot be copied into one"
        )
    mode = modes.pop()
    files: list[str] = []
    counts = []
    for path, index in zip(parts.paths, parts.indexes, strict=True):
        part_files, starts = provenance.read_sources(path, index)
        files += part_files
        counts.append(np.diff(starts))
    fields = []
    for name, info in parts.fields.items():
        cast = any(index.field(name).cast for index in parts.indexes)
        fields.append((name, info.dtype, reader.shapes(name), cast))
    starts = np.concatenate([[0], np.cumsum(np.concatenate(counts))]).astype(np.int64)
    return lay_out(files, fields, max(index.align for index in parts.indexes), starts, mode)


def _copy_data(parts_reader: PartsReader, plan: Plan, blob_path: str, progress: Progress) -> None:
    """Each part's data region of each field, back to back: the bytes are already final."""
    fd = os.open(blob_path, os.O_WRONLY | fsutil.BINARY)
    try:
        for k, reader in enumerate(parts_reader.readers):
            index = reader.index
            start = int(parts_reader.parts.starts[k])
            for field in plan.fields:
                source = index.field(field.name).data
                data = reader.payload[source.offset : source.end]
                position = BLOB_HEADER_NBYTES + field.data.offset + int(field.sample_offsets[start])
                for chunk in range(0, len(data), COPY_CHUNK_NBYTES):
                    piece = data[chunk : chunk + COPY_CHUNK_NBYTES]
                    fsutil.write_all_at(fd, piece.data, position + chunk)
                    progress.advance(0, len(piece))
            progress.advance(1, 0)
    finally:
        os.close(fd)


def _read_skipped(parts: Parts) -> list[tuple[str, str]]:
    """Every part's skipped files, empty parts' included, in part order."""
    return [
        skip
        for path, index in zip(parts.all_paths, parts.all_indexes, strict=True)
        for skip in provenance.read_skipped(path, index)
    ]
