"""Conversion end to end: discover sources, scan headers, plan, copy, publish.

Both passes run on a pool of worker processes; results come back in sample
order, so the output is byte-identical whatever the number of workers.
"""

from __future__ import annotations

import functools
import os
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from . import writer
from .errors import OutputError
from .inputs import discover_sources
from .npzfile import MemberHeader, read_headers
from .parallel import Mapper, worker_map
from .plan import Plan, build_plan
from .progress import Progress, SilentProgress
from .spec import MAX_ALIGN, MIN_ALIGN, Index


@dataclass(frozen=True)
class ConvertResult:
    out_dir: str
    index: Index
    data_nbytes: int
    seconds: float


def convert(
    inputs: Sequence[str | os.PathLike[str]],
    out_dir: str | os.PathLike[str],
    *,
    keys: Sequence[str] | None = None,
    casts: Mapping[str, np.dtype | str] | None = None,
    workers: int | None = None,
    align: int = MIN_ALIGN,
    overwrite: bool = False,
    progress: Progress | None = None,
) -> ConvertResult:
    """Convert NPZ files (one sample each) into a dataset directory at ``out_dir``.

    ``casts`` maps keys to the dtype to store them as, for sources that differ
    (numpy's 'same_kind' casts only). Otherwise every file must agree exactly.

    Raises SourceError for unusable inputs and OutputError when ``out_dir``
    cannot be written; on any error nothing is left at ``out_dir`` and an
    existing dataset there is untouched.
    """
    started = time.perf_counter()
    out = os.fspath(out_dir)
    _check_align(align)
    writer.check_output(out, overwrite)
    sources = discover_sources(inputs)
    progress = progress or SilentProgress()
    _refuse_output_inside_inputs(out, inputs)
    with writer.output_lock(out), worker_map(workers or os.cpu_count() or 1, len(sources)) as imap:
        plan = _scan(sources, keys, _parse_casts(casts), align, imap, progress)
        staging = _make_staging_dir(out)
        try:
            index = _copy(plan, staging, imap, progress)
            writer.publish(staging, out, overwrite)
        except OSError as exc:
            raise OutputError(f"{out}: cannot write the dataset ({exc.strerror or exc})") from exc
        finally:
            writer.remove_staging(staging)
    return ConvertResult(out, index, plan.data_nbytes, time.perf_counter() - started)


def _refuse_output_inside_inputs(out: str, inputs: Sequence[str | os.PathLike[str]]) -> None:
    """OUT inside an input directory would be walked by the next conversion of it."""
    real_out = os.path.realpath(out)
    for item in inputs:
        path = os.fspath(item)
        if os.path.isdir(path) and os.path.commonpath([real_out, os.path.realpath(path)]) == os.path.realpath(
            path
        ):
            raise OutputError(f"{out}: is inside the input directory {path}; write the dataset elsewhere")


def _make_staging_dir(out: str) -> str:
    try:
        return writer.make_staging_dir(out)
    except OSError as exc:
        raise OutputError(f"{out}: cannot create the output beside it ({exc.strerror or exc})") from exc


def _check_align(align: int) -> None:
    if not MIN_ALIGN <= align <= MAX_ALIGN or align & (align - 1):
        raise ValueError(f"align must be a power of two from {MIN_ALIGN} to {MAX_ALIGN}, got {align}")


def _parse_casts(casts: Mapping[str, np.dtype | str] | None) -> dict[str, np.dtype]:
    return {key: cast_dtype(value) for key, value in (casts or {}).items()}


def cast_dtype(value: np.dtype | str) -> np.dtype:
    """The dtype a --cast names; ValueError unless it is a fixed-size, pickle-free numpy dtype."""
    try:
        dtype = np.dtype(value)
    except TypeError:
        raise ValueError(f"{value!r} is not a numpy dtype") from None
    if dtype.hasobject or dtype.itemsize == 0:
        raise ValueError(f"{value!r} is not a fixed-size, pickle-free dtype")
    return dtype


def _scan(
    sources: list[str],
    keys: Sequence[str] | None,
    casts: dict[str, np.dtype],
    align: int,
    imap: Mapper[Any, Any],
    progress: Progress,
) -> Plan:
    """Pass 1: read every member header and plan the layout."""
    progress.stage("scan", len(sources), 0)

    def reported(headers: Iterator[dict[str, MemberHeader]]) -> Iterator[dict[str, MemberHeader]]:
        for item in headers:
            progress.advance(1, 0)
            yield item

    scan_one = functools.partial(read_headers, keys=tuple(keys) if keys else None)
    return build_plan(sources, reported(imap(scan_one, sources)), align, casts)


def _copy(plan: Plan, staging: str, imap: Mapper[Any, Any], progress: Progress) -> Index:
    """Pass 2: copy every member into the blob, then write tables and index."""
    progress.stage("copy", plan.num_samples, plan.data_nbytes)
    blob_path = writer.create_blob(staging, plan.payload_nbytes)
    crc32s = [np.zeros(plan.num_samples, dtype=np.uint32) for _ in plan.fields]
    copy_one = functools.partial(writer.write_sample, blob_path)
    try:
        for result in imap(copy_one, writer.sample_tasks(plan)):
            for table, crc in zip(crc32s, result.crc32s, strict=True):
                table[result.sample] = crc
            progress.advance(1, result.nbytes)
    finally:
        writer.close_blobs()
    return writer.finish_dataset(staging, plan, crc32s)
