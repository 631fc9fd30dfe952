"""The parts a manifest or merge joins, where they record a part (i, n), are one whole run in order.

Parts left from a run with another count, a missing part, a part listed twice
or parts out of order would add, lose or move samples without a word.
"""

from __future__ import annotations

import json
import os
import re
import shutil
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner
from conftest import write_npz, write_samples
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import npz2mmap
from npz2mmap import MmapDataset
from npz2mmap.check.verify import verify
from npz2mmap.cli.commands import cli
from npz2mmap.errors import FormatError
from npz2mmap.format.manifest import check_part_set
from npz2mmap.write.conversion import convert
from npz2mmap.write.merge import merge

DATASET_FILES = ("data.npy", "index.json", "sources.jsonl", "skipped.jsonl")


def run(*args: object):
    return CliRunner().invoke(cli, [str(a) for a in args])


def seven_files(tmp_path: Path) -> Path:
    write_samples(tmp_path / "src", [{"x": np.full(3, i)} for i in range(7)])
    return tmp_path / "src"


def convert_parts(src: Path, out: Path, count: int, which: range | list[int], *extra: str) -> None:
    for i in which:
        result = run("convert", src, "-o", out, "--part", f"{i}/{count}", "-q", *extra)
        assert (result.exit_code, result.output) == (0, ""), result.output


def write_manifest(directory: Path, parts: list[str]) -> Path:
    manifest = directory / "manifest.json"
    manifest.write_text(json.dumps({"format": "npz2mmap-parts", "version": 1, "parts": parts}))
    return manifest


def test_parts_left_from_a_run_with_another_count_are_refused_by_merge(tmp_path) -> None:
    src, out = seven_files(tmp_path), tmp_path / "A"
    convert_parts(src, out, 4, range(4))
    convert_parts(src, out, 2, range(2), "--overwrite")  # a re-run with 2 tasks
    parts = sorted(out.glob("part-*"))
    message = (
        f"Error: parts {parts[0]} to {parts[3]}: {parts[2]} is part 2 of 4, but {parts[0]} is part 0 of 2: "
        "a part of an earlier run with another count; remove it or convert it again\n"
    )
    before = sorted(os.listdir(out))
    for copy in ((), ("--copy",)):
        target = out if not copy else tmp_path / "A.mmap"
        result = run("merge", *parts, "-o", target, *copy)
        assert (result.exit_code, result.output) == (1, message)
        assert sorted(os.listdir(out)) == before and not (tmp_path / "A.mmap").exists()
    for stale in parts[2:]:
        shutil.rmtree(stale)
    assert run("merge", *parts[:2], "-o", out, "-q").exit_code == 0  # the way out
    assert [int(sample["x"][0]) for sample in MmapDataset(out)] == list(range(7))


def test_a_manifest_whose_part_was_converted_again_with_another_count_is_refused_by_readers(
    tmp_path,
) -> None:
    src, out = seven_files(tmp_path), tmp_path / "Bm"
    convert_parts(src, out, 4, range(4))
    assert run("merge", *sorted(out.glob("part-*")), "-o", out, "-q").exit_code == 0
    convert_parts(src, out, 2, [0], "--overwrite")  # part-00000 now holds 4 of the 7 files
    message = (
        f"{out / 'manifest.json'}: {out / 'part-00001'} is part 1 of 4, but {out / 'part-00000'} is part 0 "
        "of 2: a part of an earlier run with another count; remove it or convert it again"
    )
    with pytest.raises(FormatError, match=f"^{re.escape(message)}$"):
        MmapDataset(out)
    assert verify(out).problems == [message]
    assert verify(out, sources=True).problems == [message]
    for command in ("inspect", "warm"):
        result = run(command, out)
        assert (result.exit_code, result.output) == (1, f"Error: {message}\n"), command
    result = run("verify", out)
    assert result.exit_code == 1 and result.output.splitlines()[0] == message


def test_a_missing_part_is_refused_by_merge_and_nothing_is_written(tmp_path) -> None:
    src, out = seven_files(tmp_path), tmp_path / "C"
    convert_parts(src, out, 4, [0, 1, 3])  # the task of part 2 failed
    parts = sorted(out.glob("part-*"))
    result = run("merge", *parts, "-o", tmp_path / "C.mmap", "--copy")
    assert (result.exit_code, result.output) == (
        1,
        f"Error: parts {parts[0]} to {parts[2]}: part 2 of 4 is missing (parts 0, 1, 3 of 4 are listed): "
        "convert it (--part 2/4), then merge\n",
    )
    assert not (tmp_path / "C.mmap").exists()
    assert sorted(os.listdir(tmp_path)) == ["C", "src"]
    write_manifest(out, [p.name for p in parts])  # a manifest written by hand: the same rule
    with pytest.raises(FormatError, match=re.escape(f"{out / 'manifest.json'}: part 2 of 4 is missing")):
        MmapDataset(out)


def test_a_part_listed_twice_or_out_of_order_is_refused_naming_both(tmp_path) -> None:
    src, out = seven_files(tmp_path), tmp_path / "D"
    convert_parts(src, out, 2, range(2))
    shutil.copytree(out / "part-00001", out / "copy-of-1")
    twice = write_manifest(out, ["part-00000", "part-00001", "copy-of-1"])
    message = (
        f"{twice}: part 1 of 2 is listed twice, as {out / 'part-00001'} and {out / 'copy-of-1'}; "
        "list only the one converted in this run"
    )
    with pytest.raises(FormatError, match=f"^{re.escape(message)}$"):
        MmapDataset(out)
    reversed_ = write_manifest(out, ["part-00001", "part-00000"])
    message = (
        f"{reversed_}: listed out of order: {out / 'part-00001'}, part 1 of 2, before {out / 'part-00000'}, "
        "part 0 of 2; list the parts in increasing order (as part-* sorts them), then merge"
    )
    with pytest.raises(FormatError, match=f"^{re.escape(message)}$"):
        MmapDataset(out)
    result = run("merge", out / "part-00001", out / "part-00000", "-o", tmp_path / "m")
    assert result.exit_code == 1 and "listed out of order" in result.output
    assert not (tmp_path / "m").exists()


def test_parts_without_a_part_number_join_a_whole_run_in_any_place(tmp_path) -> None:
    """Plain conversions and merged datasets record none: appending files is adding a part."""
    src = seven_files(tmp_path)
    convert_parts(src, tmp_path / "run", 2, range(2))
    convert([src], tmp_path / "plain", workers=1)
    run_parts = sorted((tmp_path / "run").glob("part-*"))
    order = [tmp_path / "plain", run_parts[0], tmp_path / "plain2", run_parts[1]]
    merge([run_parts[0], run_parts[1]], tmp_path / "plain2", copy=True)  # merged: records none
    assert merge(order, tmp_path / "m").num_samples == 21
    each = [[int(s["x"][0]) for s in MmapDataset(path)] for path in order]
    assert each[1:4:2] == [[0, 1, 2], [3, 4, 5, 6]]
    assert [int(s["x"][0]) for s in MmapDataset(tmp_path / "m")] == [x for values in each for x in values]


# --- the rule, as a property over lists of parts -------------------------------------

COUNTS = (1, 2, 3)  # of 2 source files: part 0 of 3 is empty


def accepted_by_the_rule(labels: list[tuple[int, int] | None]) -> bool:
    """The rule, restated: the numbered labels, in order, are exactly (0, n), (1, n), ..., (n-1, n)."""
    numbered = [label for label in labels if label is not None]
    return not numbered or numbered == [(i, numbered[0][1]) for i in range(numbered[0][1])]


@pytest.fixture(scope="module")
def pool(tmp_path_factory) -> dict[str, Path]:
    """Two copies of every part (i, n) of two files, for n in COUNTS, and two unnumbered datasets."""
    root = tmp_path_factory.mktemp("pool")
    write_samples(root / "src", [{"x": np.arange(i + 2, dtype=np.int16)} for i in range(2)])
    parts = {}
    for copy in "ab":
        for n in COUNTS:
            for i in range(n):
                written = convert([root / "src"], root / f"{copy}{n}" / "{part}", part=(i, n), workers=1)
                parts[f"{copy}:{i}/{n}"] = Path(written.out_dir)
        parts[f"{copy}:none"] = Path(convert([root / "src"], root / f"{copy}-plain", workers=1).out_dir)
    convert([root / "src"], root / "single", workers=1)
    return parts


def label_of(key: str) -> tuple[int, int] | None:
    number = key.split(":")[1]
    return None if number == "none" else (int(number.split("/")[0]), int(number.split("/")[1]))


@st.composite
def part_lists(draw: st.DrawFn) -> list[str]:
    """Any distinct parts in any order, or a whole run (of either copy) with unnumbered ones between."""
    keys = [f"{c}:{i}/{n}" for c in "ab" for n in COUNTS for i in range(n)] + ["a:none", "b:none"]
    if draw(st.booleans()):
        return draw(st.lists(st.sampled_from(keys), min_size=1, max_size=6, unique=True))
    n = draw(st.sampled_from(COUNTS))
    listed = [f"{draw(st.sampled_from('ab'))}:{i}/{n}" for i in range(n)]
    for extra in draw(st.lists(st.sampled_from(["a:none", "b:none"]), max_size=2, unique=True)):
        listed.insert(draw(st.integers(0, len(listed))), extra)
    return listed


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(keys=part_lists())
def test_merge_and_readers_accept_a_list_of_parts_exactly_when_the_rule_does(pool, tmp_path, keys) -> None:
    paths = [pool[key] for key in keys]
    expected = accepted_by_the_rule([label_of(key) for key in keys])
    out = tmp_path / f"m{len(os.listdir(tmp_path))}"
    try:
        merge(paths, out)
        merged = True
    except FormatError:
        merged = False
    assert merged == expected and out.exists() == expected
    listing = tmp_path / f"l{len(os.listdir(tmp_path))}"
    listing.mkdir()
    write_manifest(listing, [os.fspath(p) for p in paths])
    try:
        read = len(MmapDataset(listing))
    except FormatError:
        read = -1
    sizes = [json.loads((path / "index.json").read_text())["num_samples"] for path in paths]
    assert read == (sum(sizes) if expected else -1)
    try:  # the same parts given as a list (one part alone always opens: a part is a dataset)
        read_listed = len(MmapDataset(paths))
    except FormatError:
        read_listed = -1
    assert read_listed == (sum(sizes) if expected or len(paths) == 1 else -1)
    assert verify(listing).ok == expected
    if expected and all(label_of(key) is not None for key in keys):  # a whole run of one input list
        copied = tmp_path / f"c{len(os.listdir(tmp_path))}"
        merge(paths, copied, copy=True)
        single = pool["a:none"].parent / "single"
        for name in DATASET_FILES:
            assert (copied / name).read_bytes() == (single / name).read_bytes(), name


def test_the_message_describes_missing_parts_by_runs_whatever_the_count() -> None:
    """A forged index may record part 0 of 2^62: the message is made without counting to n."""
    n = 1 << 62
    with pytest.raises(FormatError) as refused:
        check_part_set([("p", (0, n))], "m")
    assert str(refused.value) == (
        f"m: parts 1-{n - 1} of {n} are missing (part 0 of {n} is listed): "
        f"convert them (--part I/{n} for each), then merge"
    )
    listed = [(f"p{i}", (i, 50)) for i in [*range(42), 43, 45, 46, 47, 48, 49]]
    with pytest.raises(FormatError) as refused:
        check_part_set(listed, "m")
    assert str(refused.value) == (
        "m: parts 42, 44 of 50 are missing (parts 0-41, 43, 45-49 of 50 are listed): "
        "convert them (--part I/50 for each), then merge"
    )


def test_a_part_converted_again_after_the_inputs_changed_is_refused_by_the_source_both_name(tmp_path) -> None:
    """Same count, same part numbers, but a file added: the re-run part's slice overlaps its neighbour's."""
    src = tmp_path / "src"
    for i in range(1, 7):
        write_npz(src / f"f{i}.npz", x=np.array(i))
    for i in range(2):
        convert([src], tmp_path / "out", part=(i, 2), workers=1)
    write_npz(src / "f0.npz", x=np.array(0))  # sorts first: every slice moves by one file
    convert([src], tmp_path / "out", part=(1, 2), workers=1, overwrite=True)
    parts = [tmp_path / "out" / "part-00000", tmp_path / "out" / "part-00001"]
    for copy in (False, True):
        with pytest.raises(FormatError) as refused:
            merge(parts, tmp_path / "merged", copy=copy)
        assert str(refused.value) == (
            f"parts {parts[0]} to {parts[1]}: {src / 'f3.npz'} is a source of both {parts[0]} and {parts[1]}: "
            "the inputs changed between their conversions (a part converted again alone), or two Writers were "
            "given one source=; convert every part of the run again, or give each sample its own source"
        )
        assert not (tmp_path / "merged").exists()
    convert([src], tmp_path / "out", part=(0, 2), workers=1, overwrite=True)  # the way out
    merge(parts, tmp_path / "merged", copy=True)
    assert [int(v) for v in npz2mmap.DatasetReader(tmp_path / "merged").column("x")] == list(range(7))


@pytest.mark.skipif(not hasattr(os, "symlink") or os.name == "nt", reason="symlinks")
def test_parts_naming_one_file_by_two_paths_are_refused_as_parts_naming_it_alike(tmp_path) -> None:
    """Rank 0 typed d, rank 1 a link to it: the names differed, so one file was merged in twice."""
    src = tmp_path / "d"
    for name in "abc":
        write_npz(src / f"{name}.npz", x=np.array(ord(name)))
    os.symlink(src, tmp_path / "link")
    convert([src / "a.npz", src / "b.npz"], tmp_path / "out", part=(0, 2), workers=1)  # a
    convert([src / "c.npz", tmp_path / "link" / "a.npz"], tmp_path / "out", part=(1, 2), workers=1)  # link/a
    parts = [tmp_path / "out" / "part-00000", tmp_path / "out" / "part-00001"]
    for copy in (False, True):
        with pytest.raises(FormatError) as refused:
            merge(parts, tmp_path / "merged", copy=copy)
        assert str(refused.value).startswith(
            f"parts {parts[0]} to {parts[1]}: {tmp_path / 'link' / 'a.npz'} is a source of both {parts[0]} "
            f"(in it as {src / 'a.npz'}) and {parts[1]}: the inputs changed between their conversions"
        )
        assert not (tmp_path / "merged").exists()


@pytest.mark.parametrize("labels", [["gen", "gen"], ["", ""], ["shared.npz", "shared.npz", "own"]])
def test_writer_parts_giving_many_samples_one_source_merge(tmp_path, labels) -> None:
    """source= labels what a sample came from; several ranks' samples may share it (rows of one
    file, or one generator), which is no sign of a part converted again."""
    for rank in range(2):
        with npz2mmap.Writer(tmp_path / "w", part=(rank, 2)) as w:
            for k, label in enumerate(labels):
                w.append({"x": np.array(rank * 10 + k)}, source=label)
    parts = sorted((tmp_path / "w").glob("part-*"))
    merge(parts, tmp_path / "merged", copy=True)
    expected = [rank * 10 + k for rank in range(2) for k in range(len(labels))]
    assert [int(v) for v in npz2mmap.DatasetReader(tmp_path / "merged").column("x")] == expected


def test_writer_parts_naming_one_source_file_each_once_are_refused(tmp_path) -> None:
    """Each sample its own source file, as a conversion's, yet one in both parts: a sample written twice."""
    for name in ("s0", "s1", "s9"):
        write_npz(tmp_path / f"{name}.npz", x=np.array(0))
    for rank in range(2):
        with npz2mmap.Writer(tmp_path / "w", part=(rank, 2)) as w:
            w.append({"x": np.array(rank)}, source=str(tmp_path / f"s{rank}.npz"))
            w.append({"x": np.array(9)}, source=str(tmp_path / "s9.npz"))
    parts = sorted((tmp_path / "w").glob("part-*"))
    with pytest.raises(FormatError, match=r"s9.npz is a source of both .*part-00000 and .*part-00001"):
        merge(parts, tmp_path / "merged")


def test_writer_parts_giving_one_sample_each_one_label_merge(tmp_path) -> None:
    """A label names no file, so it tells nothing of overlap: one sample per part under 'imagenet'
    was refused as "a source of both", two in one part merged."""
    for rank in range(2):
        with npz2mmap.Writer(tmp_path / "w", part=(rank, 2)) as w:
            w.append({"x": np.array(rank)}, source="imagenet")
    parts = sorted((tmp_path / "w").glob("part-*"))
    merge(parts, tmp_path / "merged", copy=True)
    assert [int(v) for v in npz2mmap.DatasetReader(tmp_path / "merged").column("x")] == [0, 1]


def test_a_list_of_parts_with_one_out_of_place_is_refused_as_its_manifest_is(tmp_path) -> None:
    src, out = seven_files(tmp_path), tmp_path / "L"
    convert_parts(src, out, 3, range(3))
    parts = sorted(out.glob("part-*"))
    with pytest.raises(FormatError) as refused:
        MmapDataset([parts[1], parts[0], parts[2]])
    assert str(refused.value) == (
        f"parts {parts[1]} to {parts[2]}: listed out of order: {parts[1]}, part 1 of 3, before {parts[0]}, "
        "part 0 of 3; list the parts in increasing order (as part-* sorts them), then merge"
    )
    with pytest.raises(FormatError, match="part 1 of 3 is missing"):
        MmapDataset([parts[0], parts[2]])
    assert len(MmapDataset(parts[1])) == len(MmapDataset([parts[1]])) == 2  # a part alone is a dataset
