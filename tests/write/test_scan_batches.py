"""The batched scan plans exactly what adding the files one at a time plans.

Workers check each batch of files against its own first file, and the main
process merges the batches (PlanBuilder.merge). The oracle is the plainest
serial definition: PlanBuilder.add file by file, in order. Both must agree on
the plan, on the files skipped and where members lie, and on the error:
its type and its exact message, naming the same file. Fake headers stand
for files, so hypothesis can try thousands of mixtures of agreeing and
disagreeing files, casts, rows and tight free space cheaply.
"""

from __future__ import annotations

import re
import shutil
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner
from conftest import SKIP_BAD_HINT, write_npz, write_samples
from hypothesis import event, given, settings
from hypothesis import strategies as st

from npz2mmap.cli.commands import cli
from npz2mmap.errors import MismatchError, SourceError
from npz2mmap.format.index import MIN_ALIGN
from npz2mmap.ingest.npy_header import MemberHeader
from npz2mmap.ingest.npz import MemberLocation
from npz2mmap.parallel import _serial_map
from npz2mmap.progress import SilentProgress
from npz2mmap.write import blob_writer, conversion
from npz2mmap.write.layout import Plan
from npz2mmap.write.plan import Disagreements, PlanBuilder

DTYPES = ["|u1", "<i4", ">i4", "<f8", "<f4"]


@st.composite
def fake_files(draw: st.DrawFn, rows: bool) -> list[dict[str, MemberHeader] | str]:
    """Files that mostly agree with the first (same keys, dtypes, ndim; other sizes), and a few
    that do not: another dtype, ndim or key set, a name a dataset may not hold, or unreadable."""
    keys = draw(st.sets(st.sampled_from(["a", "a", "b", "b", "bad/name"]), min_size=1, max_size=2))
    dtypes = {key: draw(st.sampled_from(DTYPES)) for key in sorted(keys)}
    ndims = {key: draw(st.integers(1 if rows else 0, 2)) for key in sorted(keys)}
    files: list[dict[str, MemberHeader] | str] = []
    for _ in range(draw(st.integers(1, 14))):
        kind = draw(st.sampled_from(["same"] * 12 + ["unreadable", "dtype", "ndim", "keys"]))
        if kind == "unreadable":
            files.append("unreadable")
            continue
        file_keys = draw(st.sets(st.sampled_from(["a", "b"]), max_size=2)) if kind == "keys" else keys
        num_rows = draw(st.integers(0, 3))
        headers = {}
        for key in sorted(file_keys):
            dtype = np.dtype(draw(st.sampled_from(DTYPES)) if kind == "dtype" else dtypes.get(key, "|u1"))
            ndim = draw(st.integers(0, 2)) if kind == "ndim" else ndims.get(key, 1)
            shape = tuple(draw(st.lists(st.integers(0, 3), min_size=ndim, max_size=ndim)))
            if rows and shape and kind == "same":
                shape = (num_rows, *shape[1:])
            headers[key] = MemberHeader(key, dtype, shape, False, 128, int(np.prod(shape)) * dtype.itemsize)
        files.append(headers)
    return files


def fake_scanner(files: list[dict[str, MemberHeader] | str]):
    def scan_source(path: str, keys: tuple[str, ...] | None, limit: object = None) -> conversion.Scanned:
        k = int(path.removeprefix("f"))
        if isinstance(files[k], str):
            raise SourceError(f"{path}: {files[k]}")
        headers = files[k]
        locations = {key: MemberLocation(k, i, 3, 4, 5, 6) for i, key in enumerate(headers)}
        return headers, locations

    return scan_source


def plan_one_by_one(scan_source, paths, scan: conversion.Scan) -> tuple[Plan, list, list]:
    """The oracle: every file scanned and added in order, by the serial rules."""
    builder = PlanBuilder(scan.align, scan.casts, scan.rows, scan.max_payload_nbytes)
    usable, skipped, found = [], [], blob_writer.MemberLocations()
    disagreements = Disagreements()  # a file that disagrees is left out and named at the end
    for path in paths:
        try:
            headers, locations = scan_source(path, None)
        except SourceError as exc:
            if not scan.skip_bad:
                raise conversion.stopped_at(exc, disagreements.error(builder.first_source)) from None
            skipped.append((path, str(exc)))
            continue
        try:
            builder.add(path, headers)
        except MismatchError as exc:
            disagreements.add(exc)
            continue
        usable.append(path)
        found.add(locations)
    error = disagreements.error(builder.first_source)
    if error is not None:
        raise error
    return builder.finish(usable, allow_empty=True), skipped, list(found.values)


def plan_in_batches(paths, scan: conversion.Scan, batch_files: int) -> tuple[Plan, list, list]:
    skipped: list[tuple[str, str]] = []
    found = blob_writer.MemberLocations()
    plan = scan.run(paths, _serial_map, batch_files, SilentProgress(), skipped, (0, 2), found)  # a part: may be empty
    return plan, skipped, list(found.values)


def outcome(make) -> tuple:
    """What a planner gives, comparable: the plan's every array and name, or the error."""
    try:
        plan, skipped, found = make()
    except SourceError as exc:
        return type(exc), str(exc)
    fields = [(f.name, f.dtype.str, f.shapes.tolist(), f.fixed_shape, f.data, f.cast) for f in plan.fields]
    return list(plan.sources), fields, plan.file_starts.tolist(), plan.payload_nbytes, skipped, found


@settings(max_examples=500, deadline=None)
@given(
    data=st.data(),
    batch_files=st.integers(1, 5),
    skip_bad=st.booleans(),
    rows=st.booleans(),
    cast=st.sampled_from([None, None, "<f8", "<i4"]),
    space=st.one_of(st.none(), st.integers(0, 120)),
    batch_samples=st.sampled_from([0, 1, 2, 5, conversion.MAX_BATCH_SAMPLES]),
)
def test_a_batched_scan_plans_and_fails_exactly_as_one_file_at_a_time(
    data, batch_files, skip_bad, rows, cast, space, batch_samples
) -> None:
    files = data.draw(fake_files(rows))
    scan_source = fake_scanner(files)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(conversion, "scan_source", scan_source)
        casts = {} if cast is None else {"a": np.dtype(cast)}
        scan = conversion.Scan(None, skip_bad, casts, rows, MIN_ALIGN, space, batch_samples)
        check_batched_against_one_by_one(scan_source, files, batch_files, scan)


def check_batched_against_one_by_one(scan_source, files, batch_files, scan: conversion.Scan) -> None:
    paths = [f"f{k}" for k in range(len(files))]
    expected = outcome(lambda: plan_one_by_one(scan_source, paths, scan))
    event("error" if isinstance(expected[0], type) else "plan")
    assert outcome(lambda: plan_in_batches(paths, scan, batch_files)) == expected


@pytest.mark.parametrize("batch_files", [1, 2, 3, 100])
def test_a_file_that_disagrees_within_a_later_batch_is_named_with_the_first_file(monkeypatch, batch_files):
    """The worker checks the batch against the batch's first file; the message names the dataset's."""
    header = {"a": MemberHeader("a", np.dtype("<i4"), (2,), False, 128, 8)}
    other = {"a": MemberHeader("a", np.dtype("<f4"), (2,), False, 128, 8)}
    files = [header] * 5 + [other]
    monkeypatch.setattr(conversion, "scan_source", fake_scanner(files))
    scan = conversion.Scan(None, False, {}, False, MIN_ALIGN, None)
    with pytest.raises(SourceError) as raised:
        plan_in_batches([f"f{k}" for k in range(len(files))], scan, batch_files)
    assert str(raised.value).startswith("f5[a]: dtype float32 differs from int32 in f0;")


@pytest.mark.parametrize(("max_batch_samples", "merged"), [(9, True), (8, False)])
def test_a_batch_of_many_rows_comes_back_file_by_file(monkeypatch, max_batch_samples, merged) -> None:
    """A message never holds every row's shape of a batch of large --rows files."""
    header = {"a": MemberHeader("a", np.dtype("<i4"), (3, 2), False, 128, 24)}
    monkeypatch.setattr(conversion, "scan_source", fake_scanner([header] * 3))
    scan = conversion.Scan(None, False, {}, True, MIN_ALIGN, None, max_batch_samples)
    batch = scan.scan_batch(["f0", "f1", "f2"])
    if merged:
        assert batch.plan is not None and batch.plan.num_samples == 9 and batch.files == []
    else:
        assert batch.plan is None and [files[0] for files in batch.files] == [header] * 3


@pytest.fixture(scope="module")
def many_files(tmp_path_factory) -> Path:
    """600 small files, enough for several scan batches with any number of workers."""
    src = tmp_path_factory.mktemp("many") / "src"
    write_samples(src, [{"x": np.arange(i % 7, dtype=np.int32), "y": np.int64(i)} for i in range(600)])
    return src


@pytest.mark.parametrize(
    ("edits", "skip_bad", "named"),
    [
        ({300: "dtype", 450: "unreadable"}, False, [300, 450]),  # a file that disagrees, then the scan stops
        ({257: "unreadable", 400: "dtype"}, False, [257]),
        ({257: "unreadable", 400: "dtype"}, True, [400]),
        ({1: "keys", 599: "dtype"}, False, [1, 599]),  # every file that disagrees, in one message
        ({400: "dtype", 405: "unreadable"}, False, [400, 405]),  # one batch: the file before the unreadable one
    ],
)
def test_a_conversion_names_the_same_first_bad_file_with_any_number_of_workers(
    tmp_path, many_files, edits, skip_bad, named
) -> None:
    src = tmp_path / "src"
    shutil.copytree(many_files, src)
    for k, kind in edits.items():
        path = src / f"s{k:05d}.npz"
        if kind == "unreadable":
            path.write_bytes(path.read_bytes()[:40])
        elif kind == "dtype":
            write_npz(path, x=np.arange(3, dtype=np.float32), y=np.int64(k))
        else:
            write_npz(path, x=np.arange(3, dtype=np.int32), z=np.int64(k))
    outputs = set()
    for workers in (1, 2, 3):
        options = ["--workers", str(workers), "-q"] + (["--skip-bad"] if skip_bad else [])
        result = CliRunner().invoke(cli, ["convert", str(src), "-o", str(tmp_path / "out"), *options])
        assert result.exit_code == 1 and not (tmp_path / "out").exists()
        outputs.add(result.output)
    (output,) = outputs
    disagreeing = [k for k in named if edits[k] != "unreadable"]
    if len(disagreeing) > 1:
        assert output.startswith(f"Error: {len(disagreeing)} files disagree with the first, {src / 's00000.npz'}: ")
    else:
        assert output.startswith(f"Error: {src / f's{named[0]:05d}.npz'}")
    named_in_order = [int(k) for k in re.findall(r"s(\d{5})\.npz\[?\w*\]?: ", output)]
    assert [k for k in named_in_order if k != 0] == named  # s00000.npz is the first, named as such
    assert len(output.splitlines()) == 1
    if edits[named[0]] != "unreadable":
        assert f"in {src / 's00000.npz'}" in output or "differ from " + str(src / "s00000.npz") in output
    if edits[named[-1]] == "unreadable":
        assert output.endswith(f"{src / f's{named[-1]:05d}.npz'}: not a valid zip/npz file: truncated (it starts "
                               "as a zip does, but its end, the zip's directory, is missing; 40 bytes)"
                               f"{SKIP_BAD_HINT}\n")
