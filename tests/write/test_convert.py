"""Conversion: input discovery, determinism, refusals, and atomic output."""

from __future__ import annotations

import itertools
import json
import os
import shutil
from pathlib import Path

import numpy as np
import pytest
from conftest import assert_same_array, blob_bytes, write_npz, write_samples
from interrupts import Interrupt, left_beside, lock_is_free, moments, sigint_blocked

from npz2mmap.check.verify import verify
from npz2mmap.errors import FixedShapeError, OutputError, SourceError, UnknownKeyError
from npz2mmap.ingest.discover import discover_sources
from npz2mmap.read.reader import DatasetReader
from npz2mmap.write import blob_writer, publish
from npz2mmap.write.conversion import convert
from npz2mmap.write.merge import merge
from npz2mmap.write.writer import Writer


def read_sources(dataset: Path) -> list[str]:
    return [json.loads(line) for line in (dataset / "sources.jsonl").read_text().splitlines()]


def leftovers(parent: Path) -> list[str]:
    return sorted(
        p.name for p in parent.iterdir() if publish.STAGING_MARK in p.name or "npz2mmap-old" in p.name
    )


def mixed_samples(count: int) -> list[dict[str, np.ndarray]]:
    rng = np.random.default_rng(3)
    return [
        {
            "x": rng.standard_normal((2, 8)).astype(np.float32),
            "tokens": np.arange(rng.integers(0, 40), dtype=np.int16),
        }
        for _ in range(count)
    ]


def test_output_is_byte_identical_for_any_number_of_workers(tmp_path) -> None:
    write_samples(tmp_path / "src", mixed_samples(150))
    convert([tmp_path / "src"], tmp_path / "w1", workers=1)
    convert([tmp_path / "src"], tmp_path / "w2", workers=2)
    convert([tmp_path / "src"], tmp_path / "w3", workers=3)
    for name in ("data.npy", "index.json", "sources.jsonl"):
        first = (tmp_path / "w1" / name).read_bytes()
        assert (tmp_path / "w2" / name).read_bytes() == first
        assert (tmp_path / "w3" / name).read_bytes() == first


def test_directories_are_searched_recursively_in_sorted_order(tmp_path) -> None:
    for name in ("b/2.npz", "a/z.npz", "a/sub/1.npz", "c.npz", "a/notes.txt"):
        path = tmp_path / "src" / name
        if name.endswith(".npz"):
            write_npz(path, v=np.int32(len(name)))
        else:
            path.write_text("not data")
    convert([tmp_path / "src"], tmp_path / "out", workers=1)
    expected = [str(tmp_path / "src" / n) for n in ("a/sub/1.npz", "a/z.npz", "b/2.npz", "c.npz")]
    assert read_sources(tmp_path / "out") == expected


def test_list_files_keep_their_order_and_resolve_relative_paths(tmp_path) -> None:
    for i in range(3):
        write_npz(tmp_path / "data" / f"{i}.npz", v=np.int64(i))
    (tmp_path / "lists").mkdir()
    (tmp_path / "lists" / "order.txt").write_text("../data/2.npz\n\n../data/0.npz\n")
    convert(
        [f"@{tmp_path / 'lists' / 'order.txt'}", tmp_path / "data" / "1.npz"], tmp_path / "out", workers=1
    )
    reader = DatasetReader(tmp_path / "out")
    assert [int(reader.view("v", i)) for i in range(3)] == [2, 0, 1]
    assert read_sources(tmp_path / "out")[0] == str(tmp_path / "data" / "2.npz")


def test_keys_select_fields(tmp_path) -> None:
    write_samples(tmp_path / "src", [{"a": np.ones(2), "b": np.zeros(3), "c": np.int8(i)} for i in range(3)])
    convert([tmp_path / "src"], tmp_path / "out", keys=["c", "a"], workers=1)
    assert DatasetReader(tmp_path / "out").field_names == ("a", "c")


def test_missing_selected_key_names_the_file(tmp_path) -> None:
    write_samples(tmp_path / "src", [{"a": np.ones(2)}, {"a": np.ones(2), "b": np.ones(1)}])
    with pytest.raises(SourceError, match=r"s00000\.npz: no key 'b' \(has: 'a'\)"):
        convert([tmp_path / "src"], tmp_path / "out", keys=["b"])
    with pytest.raises(UnknownKeyError, match=r"^--keys names 'c', which no input file holds \("):
        convert([tmp_path / "src"], tmp_path / "out", keys=["c"])


@pytest.mark.parametrize(
    ("second", "message"),
    [
        (
            {"x": np.ones(3, np.float64), "y": np.int8(1)},
            r"s00001\.npz\[x\]: dtype float64 differs from float32 in .*s00000\.npz",
        ),
        (
            {"x": np.ones((3, 1), np.float32), "y": np.int8(1)},
            r"s00001\.npz\[x\]: 2-d array \(3, 1\) differs from the 1-d arrays",
        ),
        ({"x": np.ones(3, np.float32)}, r"s00001\.npz: keys differ from .*s00000\.npz \(missing 'y'\)"),
        ({"x": np.ones(3, np.float32), "y": np.int8(1), "z": np.int8(1)}, r"keys differ .*\(extra 'z'\)"),
    ],
    ids=["dtype", "ndim", "missing-key", "extra-key"],
)
def test_disagreeing_files_are_refused_naming_the_first_that_differs(tmp_path, second, message) -> None:
    first = {"x": np.ones(3, np.float32), "y": np.int8(0)}
    write_samples(tmp_path / "src", [first, second, second])
    with pytest.raises(SourceError, match=message):
        convert([tmp_path / "src"], tmp_path / "out", workers=1)
    assert not (tmp_path / "out").exists()


def test_big_and_little_endian_files_of_one_dtype_agree(tmp_path) -> None:
    write_samples(tmp_path / "src", [{"x": np.arange(3, dtype="<i4")}, {"x": np.arange(3, dtype=">i4")}])
    convert([tmp_path / "src"], tmp_path / "out", workers=1)
    assert DatasetReader(tmp_path / "out").index.field("x").dtype == np.dtype("<i4")


class _Marker:
    """Unpickling this creates a file: proof that a pickle ran."""

    def __init__(self, path: str) -> None:
        self.path = path

    def __reduce__(self):
        return (open, (self.path, "w"))


def test_object_arrays_are_refused_and_their_pickle_never_runs(tmp_path) -> None:
    marker = tmp_path / "pickle-ran"
    payload = np.empty(1, dtype=object)
    payload[0] = _Marker(str(marker))
    write_npz(tmp_path / "src" / "evil.npz", x=np.ones(2), payload=payload)
    with pytest.raises(SourceError, match=r"evil\.npz\[payload\]: dtype object holds pickled Python objects"):
        convert([tmp_path / "src"], tmp_path / "out", workers=1)
    assert not marker.exists()
    assert not (tmp_path / "out").exists()


def test_nothing_found_missing_paths_and_duplicates_are_refused(tmp_path) -> None:
    (tmp_path / "empty").mkdir()
    with pytest.raises(SourceError, match="no .npz or .npy files found in: .*empty"):
        convert([tmp_path / "empty"], tmp_path / "out")
    with pytest.raises(SourceError, match="nope.npz: no such file or directory"):
        convert([tmp_path / "nope.npz"], tmp_path / "out")
    path = write_npz(tmp_path / "one.npz", x=np.ones(1))
    with pytest.raises(SourceError, match="one.npz: given twice"):
        convert([path, tmp_path], tmp_path / "out")


def test_symlink_loops_in_input_directories_are_walked_once(tmp_path) -> None:
    write_npz(tmp_path / "src" / "a" / "1.npz", x=np.ones(1))
    os.symlink(tmp_path / "src", tmp_path / "src" / "a" / "loop")
    convert([tmp_path / "src"], tmp_path / "out", workers=1)
    assert len(read_sources(tmp_path / "out")) == 1


def _same_file_case(tmp_path: Path, case: str) -> tuple[list[Path | str], Path, Path]:
    """The inputs, the path refused and the path found first (the same file), for one case."""
    src, other, link = tmp_path / "src", tmp_path / "other", tmp_path / "link"
    write_npz(src / "a.npz", x=np.ones(1))
    if case == "file link in a directory":
        os.symlink(src / "a.npz", src / "b.npz")
        return [src], src / "b.npz", src / "a.npz"
    if case == "link inside a walk":
        write_npz(other / "c.npz", x=np.ones(1))
        os.symlink(other, src / "sub")
        return [other, src], src / "sub" / "c.npz", other / "c.npz"
    os.symlink(src, link)
    if case == "directory and a link to it":
        return [link / "a.npz", src], src / "a.npz", link / "a.npz"
    if case == "file then linked directory":
        return [src / "a.npz", link], link / "a.npz", src / "a.npz"
    (tmp_path / "list.txt").write_text("link/a.npz\n")
    return [f"@{tmp_path / 'list.txt'}", src], src / "a.npz", link / "a.npz"


@pytest.mark.parametrize(
    "case",
    [
        "file link in a directory",
        "directory and a link to it",
        "file then linked directory",
        "link inside a walk",
        "list file through a link",
    ],
)
def test_the_same_file_reached_through_symlinks_is_refused(tmp_path, case) -> None:
    inputs, refused, first = _same_file_case(tmp_path, case)
    with pytest.raises(SourceError) as caught:
        convert(inputs, tmp_path / "out", workers=1)
    assert (
        str(caught.value) == f"{refused}: is the same file as {first}; each sample file may appear only once"
    )
    assert not (tmp_path / "out").exists()


def test_a_path_through_a_linked_directory_is_kept_as_given(tmp_path) -> None:
    """Sources are named by the path they were found by (sorted by it), not by their real path."""
    write_samples(tmp_path / "real", [{"x": np.ones(1)}] * 3)
    os.symlink(tmp_path / "real", tmp_path / "link")
    convert([tmp_path / "link"], tmp_path / "out", workers=1)
    assert read_sources(tmp_path / "out") == [str(tmp_path / "link" / f"s{i:05d}.npz") for i in range(3)]


def test_a_relative_input_is_recorded_absolute_and_named_as_given(tmp_path, monkeypatch) -> None:
    write_samples(tmp_path / "src" / "sub", [{"x": np.ones(1)}] * 2)
    monkeypatch.chdir(tmp_path)
    convert(["src"], "out", workers=1)
    assert read_sources(tmp_path / "out") == [
        str(tmp_path / "src" / "sub" / f"s{i:05d}.npz") for i in range(2)
    ]
    os.symlink(tmp_path / "gone", tmp_path / "src" / "sub" / "link.npz")
    with pytest.raises(SourceError) as caught:
        convert(["./src/"], "again", workers=1)
    assert str(caught.value) == "./src/sub/link.npz: a broken link, not a regular file"


def test_discovery_resolves_each_directory_once_not_each_file(tmp_path, monkeypatch) -> None:
    """Resolving symlinks costs a system call per path component: once per directory, not per file."""
    for directory in ("a", "b"):
        write_samples(tmp_path / "src" / directory, [{"x": np.ones(1)}] * 20)
    calls: list[str] = []
    real_realpath = os.path.realpath

    def counted(path, *args, **kwargs):  # type: ignore[no-untyped-def]
        calls.append(os.fspath(path))
        return real_realpath(path, *args, **kwargs)

    monkeypatch.setattr(os.path, "realpath", counted)
    found = discover_sources([tmp_path / "src"])
    assert found == sorted(str(tmp_path / "src" / d / f"s{i:05d}.npz") for d in "ab" for i in range(20))
    assert len(calls) <= 3


def test_existing_output_is_refused_without_overwrite(tmp_path, small_dataset) -> None:
    out, _ = small_dataset
    before = blob_bytes(out)
    with pytest.raises(OutputError, match="already exists; pass --overwrite to replace it"):
        convert([tmp_path / "src"], out)
    assert blob_bytes(out) == before


def test_overwrite_replaces_a_dataset_but_never_other_directories(tmp_path, small_dataset) -> None:
    out, _ = small_dataset
    write_samples(tmp_path / "new", [{"z": np.arange(4)}])
    convert([tmp_path / "new"], out, overwrite=True, workers=1)
    assert DatasetReader(out).field_names == ("z",)
    assert leftovers(tmp_path) == []
    precious = tmp_path / "precious"
    precious.mkdir()
    (precious / "thesis.tex").write_text("do not delete")
    with pytest.raises(
        OutputError,
        match=r"exists and is not an npz2mmap dataset \(it holds neither index\.json nor manifest\.json\); choose another OUT \(--overwrite replaces only a dataset or an empty directory\)",
    ):
        convert([tmp_path / "new"], precious, overwrite=True)
    assert (precious / "thesis.tex").read_text() == "do not delete"


def test_a_bad_file_leaves_no_output_and_no_temporary_files(tmp_path) -> None:
    write_samples(tmp_path / "src", mixed_samples(5))
    (tmp_path / "src" / "s00003.npz").write_text("this is not a zip file")
    with pytest.raises(SourceError, match=r"s00003\.npz: not a valid zip/npz file"):
        convert([tmp_path / "src"], tmp_path / "out", workers=2)
    assert not (tmp_path / "out").exists()
    assert leftovers(tmp_path) == []


def test_a_crash_halfway_through_copying_leaves_the_old_dataset_intact(
    tmp_path, small_dataset, monkeypatch
) -> None:
    out, _ = small_dataset
    before = {name: (out / name).read_bytes() for name in ("data.npy", "index.json", "sources.jsonl")}
    real_copy = blob_writer._copy_file
    calls = []

    def crash_on_third(task, i, path, out, blob_path):
        calls.append(path)
        if len(calls) == 3:
            raise KeyboardInterrupt
        return real_copy(task, i, path, out, blob_path)

    monkeypatch.setattr(blob_writer, "_copy_file", crash_on_third)
    write_samples(tmp_path / "new", mixed_samples(6))
    with pytest.raises(KeyboardInterrupt):
        convert([tmp_path / "new"], out, overwrite=True, workers=1)
    assert {name: (out / name).read_bytes() for name in before} == before
    assert leftovers(tmp_path) == []


def test_align_places_every_region_on_the_boundary(tmp_path) -> None:
    write_samples(tmp_path / "src", mixed_samples(7))
    convert([tmp_path / "src"], tmp_path / "out", align=4096, workers=1)
    reader = DatasetReader(tmp_path / "out")
    for f in reader.index.fields:
        for region in (f.data, *f.tables().values()):
            assert (128 + region.offset) % 4096 == 0
    assert_same_array(np.array(reader.view("x", 6)), mixed_samples(7)[6]["x"])


def test_cast_stores_one_dtype_for_files_that_differ(tmp_path) -> None:
    wide = np.array([0.5, -(2.0**-20), 3.0, np.inf], dtype=np.float64)  # float32 holds each exactly
    narrow = np.array([1.5, 2.5, -1.0, np.nan], dtype=">f4")
    write_samples(tmp_path / "src", [{"x": wide}, {"x": narrow}])
    convert([tmp_path / "src"], tmp_path / "out", casts={"x": "float32"}, workers=1)
    reader = DatasetReader(tmp_path / "out")
    field = reader.index.field("x")
    assert field.dtype == np.dtype("<f4") and field.cast
    assert_same_array(np.array(reader.view("x", 0)), wide.astype(np.float32))
    assert_same_array(np.array(reader.view("x", 1)), narrow)
    report = verify(tmp_path / "out", sources=True)
    assert report.ok, report.problems


def test_cast_refuses_a_change_of_kind_and_unknown_keys(tmp_path) -> None:
    write_samples(tmp_path / "src", [{"x": np.ones(2)}, {"x": np.ones(2, np.float32)}])
    with pytest.raises(
        SourceError, match=r"s00000\.npz\[x\]: dtype float64 cannot be cast to int32 without changing kind"
    ):
        convert([tmp_path / "src"], tmp_path / "out", casts={"x": "int32"}, workers=1)
    with pytest.raises(SourceError, match="--cast names key\\(s\\) 'y' that are not converted"):
        convert([tmp_path / "src"], tmp_path / "out", casts={"y": "int32"}, workers=1)
    with pytest.raises(SourceError, match="use --cast x=float64 to store one dtype"):
        convert([tmp_path / "src"], tmp_path / "out", workers=1)
    assert not (tmp_path / "out").exists()


def test_list_files_skip_comments_and_a_list_that_is_a_pipe_is_refused(tmp_path) -> None:
    for i in range(2):
        write_npz(tmp_path / "data" / f"{i}.npz", v=np.int64(i))
    (tmp_path / "list.txt").write_text("# the training split\ndata/1.npz\n   # not this one: data/0.npz\n\n")
    convert([f"@{tmp_path / 'list.txt'}"], tmp_path / "out", workers=1)
    reader = DatasetReader(tmp_path / "out")
    assert [int(reader.view("v", i)) for i in range(len(reader))] == [1]
    # A path starting with # is named with ./ before it, as the docs say.
    write_npz(tmp_path / "data" / "#2.npz", v=np.int64(2))
    (tmp_path / "data" / "hash.txt").write_text(" #2.npz\n./#2.npz\n", encoding="utf-8")
    convert([f"@{tmp_path / 'data' / 'hash.txt'}"], tmp_path / "out3", workers=1)
    reader = DatasetReader(tmp_path / "out3")
    assert [int(reader.view("v", i)) for i in range(len(reader))] == [2]
    os.mkfifo(tmp_path / "pipe.txt")
    with pytest.raises(SourceError, match=r"pipe\.txt: list file is a pipe \(FIFO\), not a regular file"):
        convert([f"@{tmp_path / 'pipe.txt'}"], tmp_path / "out2", workers=1)


@pytest.mark.parametrize("separator", ["\u2028", "\x85", "\x1c", "\x0b", "\x0c"])
def test_a_list_line_ends_only_at_a_newline_never_inside_a_name(tmp_path, separator) -> None:
    # str.splitlines() would break the one name below into x.npz and y.npz, which exist too.
    named = f"x.npz{separator}y.npz"
    for i, name in enumerate([named, "x.npz", "y.npz", "z.npz", "w.npz"]):
        write_npz(tmp_path / "data" / name, v=np.int64(i))
    (tmp_path / "data" / "list.txt").write_bytes(f"{named}\r\nz.npz\rw.npz".encode())
    convert([f"@{tmp_path / 'data' / 'list.txt'}"], tmp_path / "out", workers=1)
    reader = DatasetReader(tmp_path / "out")
    assert [int(reader.view("v", i)) for i in range(len(reader))] == [0, 3, 4]


def dataset_bytes(out: Path) -> dict[str, bytes]:
    return {name: (out / name).read_bytes() for name in sorted(os.listdir(out))}


class Timeout(Exception):
    """What a ``signal.alarm`` handler raises in the timeout idiom."""


@pytest.mark.parametrize(
    ("interrupt_kind", "step", "workers"),
    [
        ("SIGINT", 5, 1),
        ("SIGINT taken by another thread", 7, 1),
        ("an alarm handler's exception", 13, 1),
        ("SIGINT", 29, 2),
        ("an alarm handler's exception", 31, 2),
        # Where the pool starts its thread and its processes, inside the standard library:
        # interrupts are held back there, to be raised once the start is whole.
        ("an alarm handler's exception, while the pool starts", 3, 2),
    ],
)
def test_a_ctrl_c_anywhere_in_a_conversion_caught_leaves_out_free_for_the_next(
    tmp_path, monkeypatch, interrupt_kind, step, workers, run_size
) -> None:
    """A Ctrl-C (or a timeout handler's exception) at every few lines of convert() in Python,
    caught by the caller: it is the exception raised, SIGINT is not blocked, OUT's lock is
    free, nothing is left beside OUT, OUT is the old dataset or the new one, and the same
    conversion run again succeeds."""
    monkeypatch.setattr(os, "fsync", lambda fd: None)  # durability is not under test: speed
    sources = write_samples(tmp_path / "src", [{"x": np.arange(i + 3, dtype=np.int32)} for i in range(3)])
    convert(sources[:1], tmp_path / "old", workers=1)
    convert(sources, tmp_path / "new", workers=1)
    old, new = dataset_bytes(tmp_path / "old"), dataset_bytes(tmp_path / "new")
    parent = tmp_path / "parent"
    parent.mkdir()
    for k in moments(step, run_size):
        out = parent / str(k) / "out"  # a parent each: listing it stays quick
        shutil.copytree(tmp_path / "old", out)
        raises = Timeout if "alarm" in interrupt_kind else None
        starts = "pool starts" in interrupt_kind
        how = {
            "other_thread": "thread" in interrupt_kind,
            "raises": raises,
            "pool_too": starts,
            "blocked_only": starts,
        }
        with Interrupt(k, opcodes=False, **how) as interrupt:
            try:
                convert(sources, out, workers=workers, overwrite=True)
            except (KeyboardInterrupt, Timeout):
                pass
        where = f"{interrupt_kind} at line {k}, {interrupt.where}"
        if not interrupt.fired:
            assert dataset_bytes(out) == new
            break
        assert not sigint_blocked(), where
        assert lock_is_free(out), where
        assert os.listdir(out.parent) == ["out"], where
        assert dataset_bytes(out) in (old, new), where
        convert(sources, out, workers=workers, overwrite=True)
        assert dataset_bytes(out) == new and left_beside(out) == [], where
    assert k > 100


@pytest.mark.parametrize("skip_bad", [False, True])
def test_an_alarm_handlers_timeout_anywhere_comes_out_as_itself_never_as_a_bad_file(
    tmp_path, skip_bad
) -> None:
    """TimeoutError is an OSError: raised by a signal handler at every few lines of a
    conversion and of opening its dataset, it comes out unchanged, and never makes a
    good file skipped or a good dataset bad."""
    sources = write_samples(tmp_path / "src", [{"x": np.arange(i + 3, dtype=np.int32)} for i in range(3)])
    convert(sources, tmp_path / "whole", workers=1)
    for k in itertools.count(0, 3):
        out = tmp_path / str(k) / "out"
        with Interrupt(k, opcodes=False, raises=TimeoutError) as interrupt:
            try:
                result = convert(sources, out, workers=1, skip_bad=skip_bad)
            except TimeoutError as exc:
                assert str(exc) == "alarm", interrupt.where
                continue
        if not interrupt.fired:
            break
        assert result.skipped == () and dataset_bytes(out) == dataset_bytes(tmp_path / "whole"), (
            interrupt.where
        )
    for k in itertools.count(0, 2):
        with Interrupt(k, opcodes=False, raises=TimeoutError) as interrupt:
            try:
                DatasetReader(tmp_path / "whole")
            except TimeoutError as exc:
                assert str(exc) == "alarm", interrupt.where
        if not interrupt.fired:
            break
    assert k > 20


def test_one_path_is_one_input_never_the_characters_of_its_name(tmp_path, monkeypatch) -> None:
    """convert("src", ...) converts src, as MmapDataset("data.mmap") opens one path: iterating the
    string would walk "s", "r", "c" (and "/" for an absolute path: the whole file system)."""
    write_npz(tmp_path / "src" / "a.npz", x=np.arange(3))
    monkeypatch.chdir(tmp_path)
    for given in ("src", tmp_path / "src", str(tmp_path / "src")):
        result = convert(given, tmp_path / "out", overwrite=True)
        assert read_sources(Path(result.out_dir)) == [str(tmp_path / "src" / "a.npz")]
    with pytest.raises(TypeError, match="^inputs must be a path or a list of paths"):
        convert(b"src", tmp_path / "other")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="^keys must be a list of keys, not 'x'"):
        convert(["src"], tmp_path / "other", keys="x")
    assert not (tmp_path / "other").exists()


def test_inputs_in_an_iterator_convert_as_a_list_and_a_set_is_refused(tmp_path) -> None:
    """An iterator was used up by the type check, then searched as no input at all; a set converted
    in the order of its hashes, so the samples' order changed with PYTHONHASHSEED."""
    paths = [str(write_npz(tmp_path / "src" / f"f{i}.npz", x=np.int64(i))) for i in range(6)]
    convert(paths, tmp_path / "listed", workers=1)
    for k, given in enumerate([iter(paths), (p for p in paths), tuple(paths)]):
        convert(given, tmp_path / f"out{k}", workers=1)
        assert dataset_bytes(tmp_path / f"out{k}") == dataset_bytes(tmp_path / "listed")
    with pytest.raises(TypeError, match=r"^inputs is a set, whose order changes from run to run, and the "
                       r"samples' order with it: give a list, such as sorted\(inputs\)$"):
        convert(set(paths), tmp_path / "set")
    with pytest.raises(ValueError, match=r"^inputs is empty: give at least one path$"):
        convert([], tmp_path / "none")
    assert not (tmp_path / "set").exists() and not (tmp_path / "none").exists()


@pytest.mark.parametrize(
    ("options", "error", "message"),
    [
        ({"keys": []}, ValueError, "keys is empty: name at least one key, or leave it None for every key"),
        ({"keys": ["x", ""]}, ValueError, "keys ['x', ''] names an empty key, which no file holds"),
        ({"keys": ["x", "a", "x"]}, ValueError, "keys ['x', 'a', 'x'] names 'x' twice: name each key once"),
        ({"workers": 0}, ValueError, "workers must be at least 1 (or None for one per core), got 0"),
        ({"workers": -3}, ValueError, "workers must be at least 1 (or None for one per core), got -3"),
        ({"workers": 1.5}, TypeError, "workers must be an integer (or None for one per core), not 1.5"),
        ({"workers": True}, TypeError, "workers must be an integer (or None for one per core), not True"),
        ({"casts": {"a": None}}, ValueError, "None is not a numpy dtype: name one, as 'float32'"),
        ({"rows": "false"}, TypeError, "rows must be True or False, not 'false'"),
        ({"skip_bad": 1}, TypeError, "skip_bad must be True or False, not 1"),
        ({"sample_dirs": "no"}, TypeError, "sample_dirs must be True or False, not 'no'"),
        ({"overwrite": None}, TypeError, "overwrite must be True or False, not None"),
        ({"align": "4096"}, TypeError, "align must be an integer, not '4096'"),
        ({"align": 4096.0}, TypeError, "align must be an integer, not 4096.0"),
        ({"align": None}, TypeError, "align must be an integer, not None"),
    ],
)
def test_convert_refuses_the_values_the_cli_refuses(tmp_path, options, error, message) -> None:
    """keys=[] converted every key and workers=-3 was taken, where --keys '' and --workers 0 are refused;
    casts={'a': None} stored a as float64 (numpy's dtype of None), rows='false' converted in rows
    mode, and align='4096' escaped as a comparison of str and int."""
    write_npz(tmp_path / "src" / "a.npz", a=np.arange(3), x=np.arange(3))
    with pytest.raises(error) as caught:
        convert([tmp_path / "src"], tmp_path / "out", **options)
    assert str(caught.value) == message
    assert not (tmp_path / "out").exists()


def test_keys_and_fixed_in_an_iterator_are_read_once_and_held(tmp_path) -> None:
    """fixed=iter(["a"]) was used up by its type check and held nothing: a file of another shape
    made the field ragged without a word; keys=iter(["a"]) selected nothing and blamed the file."""
    for i, n in enumerate([3, 3, 4]):
        write_npz(tmp_path / "src" / f"{i}.npz", a=np.zeros(n), b=np.int8(i))
    with pytest.raises(FixedShapeError, match=r"\[a\]: shape \(4,\) differs from \(3,\)"):
        convert([tmp_path / "src"], tmp_path / "out", fixed=iter(["a"]), workers=1)
    with pytest.raises(FixedShapeError):
        with Writer(tmp_path / "w", fixed=(k for k in ["a"])) as writer:
            for n in [3, 3, 4]:
                writer.append({"a": np.zeros(n)})
    result = convert([tmp_path / "src"], tmp_path / "keys", keys=map(str, ["b"]), workers=1)
    assert result.index.field_names == ("b",)
    assert not (tmp_path / "out").exists() and not (tmp_path / "w").exists()


def test_fixed_none_holds_no_key_as_keys_none_and_casts_none_select_and_cast_none(tmp_path) -> None:
    """convert(fixed=None) raised "fixed must be a list of keys, not None" where keys=None and
    casts=None mean the default."""
    for i, n in enumerate([3, 4]):
        write_npz(tmp_path / "src" / f"{i}.npz", a=np.zeros(n))
    result = convert([tmp_path / "src"], tmp_path / "out", keys=None, casts=None, fixed=None, workers=1)
    assert DatasetReader(result.out_dir).shapes("a").tolist() == [[3], [4]]
    with Writer(tmp_path / "w", casts=None, fixed=None) as writer:
        writer.append({"a": np.zeros(3)})
        writer.append({"a": np.zeros(4)})
    assert DatasetReader(tmp_path / "w").shapes("a").tolist() == [[3], [4]]


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"casts": [("b", "float64")]}, "casts must map keys to dtypes, as {'input': 'float32'}, not [('b', 'float64')]"),
        ({"fixed": "a"}, "fixed must be a list of keys, not 'a'"),
        ({"fixed": [1]}, "fixed must be a list of keys, not [1]"),
        ({"keys": 3}, "keys must be a list of keys, not 3"),
        ({"align": "4096"}, "align must be an integer, not '4096'"),
        ({"overwrite": "yes"}, "overwrite must be True or False, not 'yes'"),
    ],
)
def test_options_of_another_type_are_a_type_error_naming_them(tmp_path, options, message) -> None:
    """casts=[(key, dtype)] escaped as AttributeError: 'list' object has no attribute 'items'."""
    write_npz(tmp_path / "src" / "a.npz", a=np.zeros(3), b=np.int8(1))
    with pytest.raises(TypeError) as caught:
        convert([tmp_path / "src"], tmp_path / "out", **options)
    assert str(caught.value) == message
    if "keys" not in options:
        with pytest.raises(TypeError) as caught:
            Writer(tmp_path / "w", **options)
        assert str(caught.value) == message


def test_numpy_values_for_paths_and_numbers_are_taken_as_python_ones(tmp_path) -> None:
    """A directory named by numpy's str_ failed inside the walk; align=np.int64(4096) failed once
    the whole copy was done, writing the index; a dict's keys, which keep their order, were refused
    as a set."""
    write_npz(tmp_path / "src" / "a.npz", a=np.arange(3))
    convert([tmp_path / "src"], tmp_path / "plain", align=4096, workers=1)
    for k, inputs in enumerate([np.str_(tmp_path / "src"), np.array([str(tmp_path / "src")]),
                                {str(tmp_path / "src"): None}.keys()]):
        convert(inputs, tmp_path / f"out{k}", align=np.int64(4096), workers=np.int64(1))
        assert dataset_bytes(tmp_path / f"out{k}") == dataset_bytes(tmp_path / "plain")


def test_an_empty_or_bytes_out_is_refused_before_any_work(tmp_path) -> None:
    """Writer('') took every sample and failed only at close(), naming a path ''; a bytes OUT
    escaped as a str/bytes mix-up; source=5 named bytes as a way."""
    write_npz(tmp_path / "src" / "a.npz", a=np.arange(3))
    for make in (lambda out: convert([tmp_path / "src"], out), lambda out: Writer(out),
                 lambda out: merge([tmp_path / "src"], out)):
        with pytest.raises(ValueError, match=r"^out_dir is an empty path \(an unset shell variable\?\): name a directory$"):
            make("")
        with pytest.raises(TypeError, match=r"^out_dir must be a path \(str or os.PathLike\), not b'"):
            make(str(tmp_path / "out").encode())
    writer = Writer(tmp_path / "w")
    with pytest.raises(TypeError, match=r"^source must be a str or a path, not int$"):
        writer.append({"x": np.arange(2)}, source=5)
    writer.abort()
