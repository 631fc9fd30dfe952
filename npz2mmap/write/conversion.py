"""Conversion end to end: discover sources, scan headers, plan, copy, publish.

Both passes run on a pool of worker processes; results come back in sample
order, so the output is byte-identical whatever the number of workers.
"""

from __future__ import annotations

import contextlib
import errno
import functools
import os
import time
import zipfile
import zlib
from array import array
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np

from .. import fsutil, pagecache
from ..errors import DatasetInputError, MismatchError, OutputError, SourceError
from ..format.index import (
    BLOB_NAME,
    MIN_ALIGN,
    Index,
)
from ..ingest.discover import discover_sources, looks_like_sample_dirs
from ..ingest.npy_header import NP_LOAD_LIMIT, HeaderLimit, MemberHeader, header_limit
from ..ingest.npz import MemberLocation
from ..ingest.sources import is_field_name, scan_source
from ..parallel import Mapper, keeps_signal_mask, worker_map
from ..progress import Progress, progress_display
from ..text import human_bytes
from . import blob_writer, publish
from .layout import Plan
from .options import (
    PartOption,
    PathOrPaths,
    WriteOptions,
    check_flags,
    check_workers,
    parse_inputs,
    parse_keys,
    select_part,
    sources_before_part,
)
from .plan import Disagreements, PlanBuilder, drop_files
from .shapes import (
    HeldShape,
    NearlyFixed,
    Replan,
    find_nearly_fixed,
)

# The copy pass sends at most this many consecutive files to a worker at once.
MAX_BATCH_FILES = 256
FILE_NBYTES = MemberLocation._fields.index("file_nbytes")


@dataclass(frozen=True)
class ConvertResult:
    out_dir: str
    index: Index
    data_nbytes: int
    seconds: float
    skipped: tuple[tuple[str, str], ...] = ()  # (path, reason) of each file --skip-bad left out
    sources_nbytes: int = 0  # the converted files' sizes on disk, compressed or not
    nearly_fixed: tuple[NearlyFixed, ...] = ()  # ragged fields only a few files keep from being fixed


@keeps_signal_mask
def convert(
    inputs: PathOrPaths,
    out_dir: str | os.PathLike[str],
    *,
    keys: Iterable[str] | None = None,
    casts: Mapping[str, np.dtype | str] | None = None,
    fixed: Iterable[str] = (),
    skip_bad: bool = False,
    part: PartOption = None,
    rows: bool = False,
    sample_dirs: bool = False,
    workers: int | None = None,
    align: int = MIN_ALIGN,
    overwrite: bool = False,
    progress: Progress | str | None = None,
    max_header_size: int | HeaderLimit | None = None,
) -> ConvertResult:
    """Convert NPZ and .npy files (one sample each) into a dataset directory at ``out_dir``.

    ``inputs`` is one path or a list of paths: files, directories (searched
    recursively) and ``@LIST`` files naming one input a line, as on the CLI.
    A ``.npy`` file is one sample with one field, ``arr_0``; with
    ``sample_dirs``, each directory that directly holds ``.npy`` files is one
    sample instead, each ``NAME.npy`` in it the field NAME.

    ``casts`` maps keys to the dtype to store them as, for sources that differ
    (numpy's 'same_kind' casts only); otherwise every file must agree exactly.
    Each key in ``fixed`` must have the first file's sample shape in every file
    (FixedShapeError naming the first that differs; UnknownKeyError for a key
    that is not a field). With ``skip_bad``, unreadable or corrupt files, and
    files that break ``fixed``, are left out and listed in the dataset's
    ``skipped.jsonl`` instead of ending the conversion. ``nearly_fixed`` of the
    result names each ragged field that only a few files keep from being
    fixed (see npz2mmap.write.shapes for the rule). With
    ``part=(i, n)`` (or ``"I/N"``, or ``"auto"`` from torchrun's or Slurm's
    environment), only the i-th of n contiguous slices of the sorted inputs
    is converted, into a complete dataset of its own at OUT/part-IIIII (or
    OUT with ``{part}`` replaced), as ``convert --part`` and ``Writer(part=)``
    write it; ``ConvertResult.out_dir`` names it. With ``rows``, every
    array of a file shares its first dimension and each row is one sample.
    ``progress`` is a Progress object, or a mode of ``--progress`` ("auto",
    "bar", "log", "none") to show it on stderr as the CLI does; TypeError otherwise.
    ``max_header_size`` is np.load's: the longest ``.npy`` header read, in
    characters (default np.load's 10,000; at most 1,000,000). Raise it only for
    files you trust, such as records of thousands of fields.

    Raises SourceError for unusable inputs, OutputError when ``out_dir``
    cannot be written, TypeError or ValueError for a bad ``part`` or
    ``align``; on any error nothing is left at ``out_dir`` and an existing
    dataset there is untouched.
    """
    started = time.perf_counter()
    options = WriteOptions.checked(out_dir, part=part, align=align, casts=casts, fixed=fixed)
    part, out, fixed_keys = options.part, options.out_dir, options.fixed
    display = progress_display(progress)
    inputs = parse_inputs(inputs)
    chosen_keys = parse_keys(keys)
    workers = check_workers(workers)
    check_flags(skip_bad=skip_bad, rows=rows, sample_dirs=sample_dirs, overwrite=overwrite)
    limit = header_limit(max_header_size)
    publish.check_output(out, overwrite)
    publish.refuse_output_a_pattern_takes(out, inputs)  # before the walk would call OUT an input dataset
    all_sources = discover_sources(inputs, sample_dirs, skip_bad)
    sources = select_part(all_sources, part)
    publish.refuse_output_inside_inputs(out, inputs)
    skipped: list[tuple[str, str]] = []
    with (
        display as shown,
        publish.output_lock(out) as lock_fd,
        worker_map(workers or os.cpu_count() or 1, len(sources), close_in_workers=(lock_fd,)) as imap,
    ):
        space = publish.free_nbytes(out)
        found = blob_writer.MemberLocations()
        scan = Scan(
            chosen_keys,
            skip_bad,
            options.casts,
            rows,
            options.align,
            space,
            fixed=fixed_keys,
            header_limit=limit,
        )
        try:
            batch_files = scan_batch_files(len(sources), workers or os.cpu_count() or 1)
            plan = scan.run(sources, imap, batch_files, shown, skipped, part, found)
        except MismatchError as exc:
            if sample_dirs or not looks_like_sample_dirs(sources):
                raise
            raise MismatchError(f"{exc} (each directory one sample? use --sample-dirs)") from exc
        locations = found.table(len(plan.sources), len(plan.fields))
        earlier = earlier_held_shapes(sources_before_part(all_sources, part), scan)
        replan = None
        if fixed_keys:
            replan = Replan(plan, locations, fixed_keys, skip_bad, skipped, part, earlier)
            plan, locations = replan.without(())
        blob_writer.check_index_nbytes(out, plan, len(skipped) + len(plan.sources), part)
        needed = blob_writer.dataset_nbytes(plan, skipped, part)
        publish.check_free_space(out, needed, space)
        staging = publish.make_staging_dir(out)
        try:
            num_workers = workers or os.cpu_count() or 1
            copy = _Copy(plan, locations, staging, imap, shown, skip_bad, num_workers, replan)
            plan, index = copy.run(sources, skipped, part)
            # of the files converted: the copy may have left out some that the scan took
            scanned = _scanned_file_nbytes(copy.locations)
            sources_nbytes = _total_file_nbytes(plan.sources) if sample_dirs else scanned
            publish.publish(staging, out, overwrite)
        except SourceError as exc:
            with_hint = found_bad_in_copy(exc)
            if with_hint is exc:
                raise
            raise with_hint from exc
        except OSError as exc:
            if not fsutil.is_io_error(exc):
                raise
            raise OutputError(
                f"{out}: cannot write the dataset ({exc.strerror or exc}){_sizes(exc, needed, space)}"
            ) from exc
        finally:
            publish.remove_staging(staging)
    seconds = time.perf_counter() - started
    return ConvertResult(
        out, index, plan.data_nbytes, seconds, tuple(skipped), sources_nbytes, find_nearly_fixed(plan)
    )


def earlier_held_shapes(earlier_sources: Sequence[str], scan: Scan) -> dict[str, HeldShape]:
    """The shapes the files before a part hold its ``--fixed`` keys to: for each key, the
    first of them with samples of it. Files that cannot be read are passed over (the part
    holding them reports them), also one whose members' bytes fail their CRC, which only the
    copy of its own part finds; reading stops once every key has its shape."""
    wanted = set(scan.fixed)
    held: dict[str, HeldShape] = {}
    for path in earlier_sources:
        if not wanted:
            break
        try:
            scanned = scan.scan_one(path)
        except SourceError:
            continue
        if isinstance(scanned, str) or not (wanted & scanned[0].keys()) or not _reads_whole(path, scanned[0]):
            continue
        for key in sorted(wanted & scanned[0].keys()):
            shape = scanned[0][key].shape
            if not scan.rows:
                held[key] = HeldShape(shape, path)
            elif shape and shape[0] > 0:
                held[key] = HeldShape(shape[1:], path)
        wanted -= held.keys()
    return held


def _reads_whole(path: str, keys: Iterable[str]) -> bool:
    """Whether the members of an NPZ file that the conversion takes (``keys``) inflate and match
    their CRCs, as the copy checks them (a .npy file or a sample directory has no CRC: what the
    scan read is what the copy reads)."""
    if not path.lower().endswith(".npz"):
        return True
    try:
        with open(fsutil.open_regular(path), "rb") as fp, zipfile.ZipFile(fp) as archive:
            for key in keys:
                with archive.open(f"{key}.npy") as member:
                    while member.read(CRC_CHECK_CHUNK_NBYTES):
                        pass  # zipfile checks the CRC at the member's end
            return True
    except (OSError, EOFError, KeyError, zipfile.BadZipFile, zlib.error, fsutil.NotRegularFile,
            NotImplementedError, RuntimeError, ValueError) as exc:  # fmt: skip
        fsutil.reraise_if_from_a_handler(exc)
        return False


CRC_CHECK_CHUNK_NBYTES = 4 << 20


def _sizes(exc: OSError, needed_nbytes: int, free_nbytes: int | None) -> str:
    """For a full disk, what the dataset needs and what was free when the conversion began."""
    if exc.errno != errno.ENOSPC:
        return ""
    free = "unknown" if free_nbytes is None else f"{free_nbytes:,} bytes ({human_bytes(free_nbytes)})"
    needed = f"{needed_nbytes:,} bytes ({human_bytes(needed_nbytes)})"
    return f": the dataset needs {needed}, {free} free when the conversion began"


def _total_file_nbytes(paths: Sequence[str]) -> int:
    """The sources' sizes together (a sample directory's .npy files); one that cannot be read now
    counts 0 (the copy will name it)."""
    total = 0
    for path in paths:
        with contextlib.suppress(OSError):
            total += _source_nbytes(path)
    return total


def _scanned_file_nbytes(locations: np.ndarray) -> int:
    """The sources' sizes together, as scanned (the size of the file holding each one's first member)."""
    return int(locations[:, 0, FILE_NBYTES].sum()) if locations.shape[1] else 0


def _source_nbytes(path: str) -> int:
    if not os.path.isdir(path):
        return os.stat(path).st_size
    with os.scandir(path) as entries:
        return sum(e.stat().st_size for e in entries if is_field_name(e.name) and e.is_file())


Scanned = tuple[dict[str, MemberHeader], dict[str, MemberLocation]]

# The scan sends at most this many consecutive files to a worker at once. A batch
# of more samples than MAX_BATCH_SAMPLES (--rows) comes back file by file instead,
# so that no message holds every row's shape of many large files.
MAX_SCAN_BATCH_FILES = 256
MAX_BATCH_SAMPLES = 1 << 16


class ScannedBatch(NamedTuple):
    """What a worker found in consecutive files: a partial plan, or each file's scan."""

    plan: PlanBuilder | None  # the usable files, each checked against the first of them
    skipped: list[tuple[int, str]]  # with a plan: (position, reason) of each file --skip-bad leaves out
    locations: array[int]  # with a plan: the usable files' MemberLocations, in plan order
    files: list[Scanned | str | MismatchError]  # without a plan: each file's scan (or why it is left out)
    error: SourceError | None = None  # without a plan: what the scan of the file after ``files`` raised


def scan_batch_files(num_files: int, workers: int) -> int:
    """Files per scan batch: several batches per worker, so that the last ones finish together."""
    return max(1, min(MAX_SCAN_BATCH_FILES, num_files // (workers * 8)))


@dataclass(frozen=True)
class Scan:
    """Pass 1: read every member header and plan the layout.

    Workers scan consecutive files and check them against the first of each
    batch; the main process checks each batch's first file against the
    dataset's and merges the batch (PlanBuilder.merge), so it does no work
    per file. A batch in which a file disagreed or could not be read comes
    back file by file, and the main process adds those files one at a time,
    so that every error is the one a serial scan meets first.
    """

    keys: tuple[str, ...] | None
    skip_bad: bool
    casts: dict[str, np.dtype]
    rows: bool
    align: int
    max_payload_nbytes: int | None
    max_batch_samples: int = MAX_BATCH_SAMPLES
    fixed: tuple[str, ...] = ()  # keys that must be fields (hold_fixed checks their shapes after the scan)
    header_limit: HeaderLimit = NP_LOAD_LIMIT

    def run(
        self,
        sources: list[str],
        imap: Mapper,
        batch_files: int,
        progress: Progress,
        skipped: list[tuple[str, str]],
        part: tuple[int, int] | None,
        found: blob_writer.MemberLocations,
    ) -> Plan:
        """The plan of the usable sources; ``skipped`` and ``found`` (where members lie) filled in.

        A part with no usable source (an empty slice of ``--part``, or one whose
        files were all skipped) plans an empty dataset: no samples, no fields.
        """
        progress.stage("scan", len(sources), 0, unit="files")
        # Only this builder names the fields, so only it checks that ``fixed`` names fields.
        builder = PlanBuilder(self.align, self.casts, self.rows, self.max_payload_nbytes, fixed=self.fixed)
        usable: list[str] = []
        disagreements = Disagreements()  # every file that disagrees is named at the end, in one error

        def batches() -> Iterator[list[str]]:
            return (sources[i : i + batch_files] for i in range(0, len(sources), batch_files))

        for paths, batch in zip(batches(), imap(self.scan_batch, batches(), per_message=1), strict=True):
            if batch.plan is not None:
                try:
                    self._take_batch(batch.plan, batch, paths, builder, usable, skipped, found)
                except MismatchError:  # its first file disagrees with the dataset's: look at each
                    batch = ScannedBatch(None, [], array("q"), [self.scan_or_refusal(p) for p in paths])
            if batch.plan is None:
                scans = zip(paths[: len(batch.files)], batch.files, strict=True)  # up to any unreadable one
                _add_one_by_one(scans, builder, usable, skipped, found, disagreements)
                if batch.error is not None:
                    disagreed = disagreements.error(builder.first_source, builder.source_dtypes())
                    raise stopped_at(batch.error, disagreed)
            progress.advance(len(paths), 0)
        error = disagreements.error(builder.first_source, builder.source_dtypes())
        if error is not None:
            raise error
        if not usable and skipped and (part is None or part[1] == 1):  # a part of one is the whole
            count, first = f"{len(skipped):,}", skipped[0][1]
            raise SourceError(f"no usable input: --skip-bad left out all {count}; the first: {first}")
        return builder.finish(usable, allow_empty=part is not None)

    def scan_batch(self, paths: list[str]) -> ScannedBatch:
        """In a worker: scan consecutive files and check them against the first usable one.

        Once a file disagrees with it, or the batch holds more than
        ``max_batch_samples`` samples, the batch comes back file by file; a
        file that cannot be read ends it, with the files before it.
        """
        builder: PlanBuilder | None = PlanBuilder(self.align, self.casts, self.rows, self.max_payload_nbytes)
        skipped: list[tuple[int, str]] = []
        found = blob_writer.MemberLocations()
        files: list[Scanned | str | MismatchError] = []
        for k, path in enumerate(pagecache.read_ahead(paths)):
            try:
                scanned = self.scan_or_refusal(path)
            except SourceError as exc:
                return ScannedBatch(None, [], array("q"), files, exc)
            files.append(scanned)
            if isinstance(scanned, MismatchError):
                builder = None
            elif isinstance(scanned, str):
                skipped.append((k, scanned))
            elif builder is not None:
                try:
                    builder.add(path, scanned[0])
                except SourceError:  # which file a serial scan names depends on the files before
                    builder = None
                    continue
                found.add(scanned[1])
                if builder.num_samples > self.max_batch_samples:
                    builder = None
        if builder is None:
            return ScannedBatch(None, [], array("q"), files)
        return ScannedBatch(builder, skipped, found.values, [])

    def _take_batch(
        self,
        planned: PlanBuilder,
        batch: ScannedBatch,
        paths: list[str],
        builder: PlanBuilder,
        usable: list[str],
        skipped: list[tuple[str, str]],
        found: blob_writer.MemberLocations,
    ) -> None:
        """Record a batch a worker planned whole; MismatchError, recording nothing, if it disagrees."""
        left_out = dict(batch.skipped)
        kept = [path for k, path in enumerate(paths) if k not in left_out]
        builder.merge(planned, kept)
        skipped.extend((paths[k], reason) for k, reason in batch.skipped)
        usable.extend(kept)
        found.values.extend(batch.locations)  # only once the plan has taken the files

    def scan_or_refusal(self, path: str) -> Scanned | str | MismatchError:
        """scan_one, or the MismatchError that names what the source lacks (a key --keys chose),
        returned so that the scan goes on and names every such source."""
        try:
            return self.scan_one(path)
        except DatasetInputError:
            raise
        except MismatchError as exc:
            return exc

    def scan_one(self, path: str) -> Scanned | str:
        """A source's member headers and locations, or with --skip-bad the reason it is unusable."""
        try:
            return scan_source(path, self.keys, self.header_limit)
        except (DatasetInputError, MismatchError):
            raise  # a mistake in the inputs, or files that disagree, not a bad file: never skipped
        except SourceError as exc:
            if not self.skip_bad:
                raise
            return str(exc)


def found_bad_in_copy(error: SourceError) -> SourceError:
    """A file found bad only as its bytes were copied (a member's CRC, a file changed since the
    scan), with the ways past it."""
    if isinstance(error, (MismatchError, DatasetInputError)):
        return error
    return type(error)(f"{error}{COPY_PASS_HINT}")


COPY_PASS_HINT = "; convert again if it was being written, or --skip-bad leaves such files out"


def stopped_at(error: SourceError, disagreed: SourceError | None) -> SourceError:
    """The error of a file that stops the scan, with the way past it, after the files that
    disagreed before it, if any (so that one run names them all)."""
    if not isinstance(error, DatasetInputError):  # an input that is a dataset is never left out
        error = type(error)(f"{error}; --skip-bad leaves such files out")
    if disagreed is None:
        return error
    return SourceError(f"{disagreed}; then the scan stopped at {error}")


def _add_one_by_one(
    scans: Iterable[tuple[str, Scanned | str | MismatchError]],
    builder: PlanBuilder,
    usable: list[str],
    skipped: list[tuple[str, str]],
    found: blob_writer.MemberLocations,
    disagreements: Disagreements,
) -> None:
    for path, scanned in scans:
        if isinstance(scanned, str):
            skipped.append((path, scanned))
            continue
        try:
            if isinstance(scanned, MismatchError):
                raise scanned
            builder.add(path, scanned[0])
        except MismatchError as exc:
            disagreements.add(exc)
            continue
        usable.append(path)
        found.add(scanned[1])  # only once the plan has taken the file


class _Copy:
    """Pass 2: copy every member into the blob, then write tables and index.

    Consecutive files travel to the workers in batches, each batch's samples
    of a field written together. A file found bad only now (a corrupt
    member) is left out with ``skip_bad`` by planning again without it (held
    to --fixed shapes anew, by ``replan``) and copying into a fresh blob.
    """

    def __init__(
        self,
        plan: Plan,
        locations: np.ndarray,
        staging: str,
        imap: Mapper,
        progress: Progress,
        skip_bad: bool,
        workers: int,
        replan: Replan | None = None,
    ) -> None:
        self.plan = plan
        self.locations = locations
        self.staging = staging
        self.imap = imap
        self.progress = progress
        self.skip_bad = skip_bad
        self.workers = workers
        self.replan = replan
        self.found_bad: set[str] = set()

    def run(
        self, sources: list[str], skipped: list[tuple[str, str]], part: tuple[int, int] | None
    ) -> tuple[Plan, Index]:
        while True:
            crc32s, failed = self._copy_samples()
            if not failed:
                sort_in_input_order(skipped, sources)  # as parts merge them
                return self.plan, blob_writer.finish_dataset(self.staging, self.plan, crc32s, skipped, part)
            skipped.extend((self.plan.sources[k], reason) for k, reason in failed)
            self.found_bad.update(self.plan.sources[k] for k, _ in failed)
            if self.replan is not None:
                self.plan, self.locations = self.replan.without(self.found_bad)
            else:
                kept = np.ones(len(self.plan.sources), dtype=bool)
                kept[[k for k, _ in failed]] = False
                self.plan = drop_files(self.plan, [k for k, _ in failed], allow_empty=part is not None)
                self.locations = self.locations[kept]
            os.unlink(os.path.join(self.staging, BLOB_NAME))

    def _copy_samples(self) -> tuple[list[np.ndarray], list[tuple[int, str]]]:
        plan = self.plan
        self.progress.stage("copy", len(plan.sources), plan.data_nbytes, unit="files")
        blob_path = blob_writer.create_blob(self.staging, plan.payload_nbytes)
        crc32s = [np.zeros(plan.num_samples, dtype=np.uint32) for _ in plan.fields]
        failed: list[tuple[int, str]] = []
        copy_batch = functools.partial(_copy_batch, blob_path, self.skip_bad)
        # Several batches per worker, so the last ones finish together; at most MAX_BATCH_FILES each.
        per_worker = -(-len(plan.sources) // (self.workers * 4)) if self.workers > 1 else MAX_BATCH_FILES
        files_per_batch = max(1, min(MAX_BATCH_FILES, per_worker))
        tasks = blob_writer.batch_tasks(plan, self.locations, files_per_batch)
        for result in self.imap(copy_batch, tasks, per_message=1):
            first = int(plan.file_starts[result.first_file])
            for table, crcs in zip(crc32s, result.crc32s, strict=True):
                table[first : first + len(crcs)] = crcs
            failed.extend(result.failures)
            self.progress.advance(result.num_files, result.nbytes)
        return crc32s, failed


def sort_in_input_order(skipped: list[tuple[str, str]], sources: Sequence[str]) -> None:
    """Sort (path, reason) pairs by where their paths come in ``sources``.

    Positions are kept for the skipped paths alone: a dict of every source
    would cost a million files ~100 MB.
    """
    if not skipped:
        return
    wanted = {path for path, _ in skipped}
    position = {path: k for k, path in enumerate(sources) if path in wanted}
    skipped.sort(key=lambda item: position[item[0]])


def _copy_batch(blob_path: str, skip_bad: bool, task: blob_writer.BatchTask) -> blob_writer.BatchResult:
    return blob_writer.write_batch(blob_path, task, skip_bad)
