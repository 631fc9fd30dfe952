"""Directories of .npy files: one file one sample (field arr_0), or with --sample-dirs one directory one sample.

The oracle is np.load of each .npy file (the sample's bytes are its array's
C-order little-endian bytes, tests/corpus.py); equivalence is with the same
arrays saved by np.savez, which must convert to the very same bytes.
"""

from __future__ import annotations

import json
import os
import socket
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner
from conftest import COPY_PASS_HINT, SKIP_BAD_HINT, write_npz
from corpus import little_endian_bytes, raw_array
from hostile import npy_bytes, npy_with_header

from npz2mmap import fsutil
from npz2mmap.check.verify import verify
from npz2mmap.cli.commands import cli
from npz2mmap.errors import MismatchError, SourceError
from npz2mmap.ingest.sources import open_source
from npz2mmap.progress import SilentProgress
from npz2mmap.read.reader import DatasetReader
from npz2mmap.write.conversion import convert

RECORD = np.dtype({"names": ["a", "b"], "formats": [">i2", "<f8"], "offsets": [0, 4], "itemsize": 16})
DTYPES = [np.dtype("<f4"), np.dtype(">i8"), np.dtype("U3"), RECORD]


def arrays_of(dtype: np.dtype, seed: int) -> list[np.ndarray]:
    """Three arrays of raw bytes (padding included): fixed, then Fortran order, then another shape."""
    rng = np.random.default_rng(seed)
    return [
        raw_array(dtype, (2, 3), False, rng),
        raw_array(dtype, (2, 3), True, rng),
        raw_array(dtype, (4, 1), False, rng),
    ]


def save_npy(path: Path, array: np.ndarray) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    np.save(path, array)
    return path


def convert_cli(*args: str) -> tuple[int, str]:
    result = CliRunner().invoke(cli, ["convert", "-q", "--workers", "1", *args])
    return result.exit_code, result.output


def dataset_bytes(out: Path) -> tuple[bytes, bytes]:
    return (out / "data.npy").read_bytes(), (out / "index.json").read_bytes()


def assert_nothing_written(out: Path) -> None:
    assert not out.exists()
    assert [p.name for p in out.parent.iterdir() if p.name.startswith(".")] == []


# --- one .npy file, one sample ---------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_npy_files_store_the_bytes_np_load_reads(tmp_path, dtype) -> None:
    paths = [save_npy(tmp_path / "src" / f"{k}.npy", a) for k, a in enumerate(arrays_of(dtype, 1))]
    convert([tmp_path / "src"], tmp_path / "out", workers=2)
    reader = DatasetReader(tmp_path / "out")
    assert reader.field_names == ("arr_0",) and len(reader) == 3
    for i, path in enumerate(paths):
        assert reader.view("arr_0", i).tobytes() == little_endian_bytes(np.load(path))
    sources = (tmp_path / "out" / "sources.jsonl").read_text().splitlines()
    assert [json.loads(line) for line in sources] == [str(p) for p in paths]
    assert verify(tmp_path / "out", sources=True).ok


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_a_directory_of_npy_files_converts_exactly_as_the_same_arrays_saved_with_savez(
    tmp_path, dtype
) -> None:
    for k, array in enumerate(arrays_of(dtype, 2)):
        save_npy(tmp_path / "npy" / f"{k}.npy", array)
        np.savez(tmp_path / f"{k}.npz", array)  # the key np.savez gives a lone array: arr_0
        (tmp_path / "npz").mkdir(exist_ok=True)
        (tmp_path / f"{k}.npz").rename(tmp_path / "npz" / f"{k}.npz")
    convert([tmp_path / "npy"], tmp_path / "from-npy", workers=1)
    convert([tmp_path / "npz"], tmp_path / "from-npz", workers=1)
    assert dataset_bytes(tmp_path / "from-npy") == dataset_bytes(tmp_path / "from-npz")


def test_npz_and_npy_sources_mix_in_path_order(tmp_path) -> None:
    a = save_npy(tmp_path / "src" / "a.npy", np.arange(3.0))
    b = write_npz(tmp_path / "src" / "b.npz", arr_0=np.arange(3.0) + 10)
    listed = tmp_path / "list.txt"
    listed.write_text(f"{b}\n{a}\n")
    convert([f"@{listed}"], tmp_path / "out", workers=1)
    reader = DatasetReader(tmp_path / "out")
    assert [reader.view("arr_0", i).tolist() for i in range(2)] == [[10.0, 11.0, 12.0], [0.0, 1.0, 2.0]]


def test_npy_rows_are_samples(tmp_path) -> None:
    path = save_npy(tmp_path / "src" / "x.npy", np.arange(12, dtype=">i4").reshape(4, 3))
    convert([tmp_path / "src"], tmp_path / "out", workers=1, rows=True)
    reader = DatasetReader(tmp_path / "out")
    assert [reader.view("arr_0", i).tobytes() for i in range(4)] == [
        little_endian_bytes(row) for row in np.load(path)
    ]


def test_npy_files_whose_names_repeat_across_directories_get_the_sample_dirs_hint(tmp_path) -> None:
    for sample in ("s0", "s1"):
        save_npy(tmp_path / "train" / sample / "x.npy", np.zeros((5, 3), np.float32))
        save_npy(tmp_path / "train" / sample / "y.npy", np.zeros(5, np.int64))
    code, output = convert_cli(str(tmp_path / "train"), "-o", str(tmp_path / "out"))
    assert code == 1
    x0 = tmp_path / "train" / "s0" / "x.npy"
    assert output == (
        f"Error: 2 files disagree with the first, {x0}: "
        f"{tmp_path / 'train' / 's0' / 'y.npy'}[arr_0]: dtype int64 differs from float32 in {x0}; "
        f"{tmp_path / 'train' / 's1' / 'y.npy'}[arr_0]: dtype int64 differs from float32 in {x0}; "
        "use --cast arr_0=float64 to store one dtype, if every value fits it (each directory one sample? "
        "use --sample-dirs)\n"
    )
    assert_nothing_written(tmp_path / "out")
    assert convert_cli(str(tmp_path / "train"), "--sample-dirs", "-o", str(tmp_path / "out"))[0] == 0


def test_npy_files_that_disagree_in_a_flat_folder_get_no_sample_dirs_hint(tmp_path) -> None:
    save_npy(tmp_path / "flat" / "a.npy", np.zeros(3, np.float64))
    b = save_npy(tmp_path / "flat" / "b.npy", np.zeros(3, np.float32))
    code, output = convert_cli(str(tmp_path / "flat"), "-o", str(tmp_path / "out"))
    assert (code, output) == (
        1,
        f"Error: {b}[arr_0]: dtype float32 differs from float64 in {tmp_path / 'flat' / 'a.npy'}; "
        "use --cast arr_0=float64 to store one dtype\n",
    )
    assert_nothing_written(tmp_path / "out")


def test_a_npy_file_named_with_sample_dirs_is_a_usage_error(tmp_path) -> None:
    s0 = save_npy(tmp_path / "flat" / "s0.npy", np.zeros(3))
    code, output = convert_cli(str(s0), "--sample-dirs", "-o", str(tmp_path / "out"))
    assert code == 2
    assert output.splitlines()[-1] == (
        f"Error: {s0}: a .npy file named with --sample-dirs, where each sample is a directory of "
        ".npy files; name its directory instead"
    )
    assert_nothing_written(tmp_path / "out")
    (tmp_path / "list.txt").write_text("flat/s0.npy\n")
    with pytest.raises(SourceError) as caught:
        convert([f"@{tmp_path / 'list.txt'}"], tmp_path / "out", sample_dirs=True)
    assert str(caught.value).startswith(f"{tmp_path / 'list.txt'}, line 1: {s0}: a .npy file named with")
    assert_nothing_written(tmp_path / "out")


def test_npz_files_that_disagree_get_no_sample_dirs_hint(tmp_path) -> None:
    write_npz(tmp_path / "src" / "a.npz", x=np.zeros(3, np.float32))
    write_npz(tmp_path / "src" / "b.npz", x=np.zeros(3, np.int64))
    with pytest.raises(MismatchError) as caught:
        convert([tmp_path / "src"], tmp_path / "out", workers=1)
    assert "--sample-dirs" not in str(caught.value)


# --- bad .npy files ----------------------------------------------------------------

GOOD = npy_bytes(np.arange(8, dtype=np.float64))
BAD_NPY = {
    "zero-byte": (b"", "empty file (0 bytes), not a .npy array"),
    "bad-magic": (b"PK\x03\x04" + GOOD[4:], "not a .npy array (bad magic bytes)"),
    "cut-in-header": (GOOD[:20], "ends early (10 of 118 bytes)"),
    "malformed-header": (
        npy_with_header("{'descr': '<f8', 'shape': (8,"),
        ".npy header is not a valid Python literal",
    ),
    "claims-too-much": (
        npy_with_header("{'descr': '<f8', 'fortran_order': False, 'shape': (1000,), }", GOOD[128:]),
        "header declares 8000 data bytes but the file holds 64",
    ),
    "trailing-bytes": (
        GOOD + b"tail",
        "4 bytes follow the 64 data bytes its header declares; np.load would ignore them, npz2mmap does not: "
        "truncate the file to 192 bytes or save the array again",
    ),
    "object-dtype": (
        npy_with_header("{'descr': '|O', 'fortran_order': False, 'shape': (1,), }", b"\x80"),
        "dtype object holds pickled Python objects, which npz2mmap never loads; "
        "convert them to a numeric or fixed-width string array first",
    ),
}


@pytest.mark.parametrize("case", BAD_NPY)
def test_a_bad_npy_file_is_a_one_line_error_naming_it(tmp_path, case) -> None:
    data, message = BAD_NPY[case]
    save_npy(tmp_path / "src" / "a.npy", np.arange(8.0))
    bad = tmp_path / "src" / "b.npy"
    bad.write_bytes(data)
    code, output = convert_cli(str(tmp_path / "src"), "-o", str(tmp_path / "out"))
    assert (code, output) == (1, f"Error: {bad}: {message}{SKIP_BAD_HINT}\n")
    assert bad.read_bytes() == data
    assert_nothing_written(tmp_path / "out")


@pytest.mark.parametrize("case", BAD_NPY)
def test_skip_bad_leaves_out_a_bad_npy_file_or_sample_dir(tmp_path, case) -> None:
    data, message = BAD_NPY[case]
    save_npy(tmp_path / "src" / "s0" / "x.npy", np.arange(8.0))
    save_npy(tmp_path / "src" / "s1" / "x.npy", np.arange(8.0) + 1)
    (tmp_path / "src" / "s1" / "x.npy").write_bytes(data)
    save_npy(tmp_path / "src" / "s2" / "x.npy", np.arange(8.0) + 2)
    code, _ = convert_cli(str(tmp_path / "src"), "--sample-dirs", "--skip-bad", "-o", str(tmp_path / "out"))
    assert code == 0
    reader = DatasetReader(tmp_path / "out")
    assert [reader.view("x", i)[0] for i in range(len(reader))] == [0.0, 2.0]
    skipped = [json.loads(line) for line in (tmp_path / "out" / "skipped.jsonl").read_text().splitlines()]
    bad = tmp_path / "src" / "s1" / "x.npy"
    assert skipped == [{"path": str(bad.parent), "reason": f"{bad}: {message}"}]


NOT_REGULAR = {
    "fifo": "a pipe (FIFO), not a regular file",
    "dev-zero": "a character device, not a regular file",
    "broken-link": "a broken link, not a regular file",
    "socket": "a socket, not a regular file",
}


def put_in_place(path: Path, kind: str) -> None:
    if path.exists() or path.is_symlink():
        path.unlink()
    if kind == "fifo":
        os.mkfifo(path)
    elif kind == "dev-zero":
        path.symlink_to("/dev/zero")
    elif kind == "socket":
        if len(str(path)) > 100:  # sun_path holds 104-108 bytes
            pytest.skip("the temporary path is too long for a Unix socket")
        with socket.socket(socket.AF_UNIX) as listener:
            listener.bind(str(path))  # the socket file stays once it is closed
    else:
        path.symlink_to(path.parent / "gone.npy")


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="needs named pipes and /dev/zero")
@pytest.mark.parametrize("kind", NOT_REGULAR)
@pytest.mark.parametrize("mode", [[], ["--sample-dirs"]])
def test_a_pipe_device_or_broken_link_in_place_of_a_npy_is_refused_not_read(tmp_path, kind, mode) -> None:
    save_npy(tmp_path / "src" / "s0" / "x.npy", np.arange(3.0))
    target = tmp_path / "src" / "s1" / "x.npy"
    target.parent.mkdir()
    put_in_place(target, kind)
    code, output = convert_cli(str(tmp_path / "src"), *mode, "-o", str(tmp_path / "out"))
    way_out = SKIP_BAD_HINT if mode else ""  # a sample's file is read by the scan, which --skip-bad passes
    assert (code, output) == (1, f"Error: {target}: {NOT_REGULAR[kind]}{way_out}\n")
    assert_nothing_written(tmp_path / "out")


class _ReplaceBeforeCopy(SilentProgress):
    """Swaps a source for something else once the scan is done, as a hostile user could."""

    def __init__(self, target: Path, kind: str) -> None:
        self.target, self.kind = target, kind

    def stage(self, name: str, total_files: int, total_nbytes: int, unit: str = "files") -> None:
        if name == "copy":
            put_in_place(self.target, self.kind)


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="needs named pipes and /dev/zero")
@pytest.mark.parametrize("kind", ["fifo", "dev-zero"])
@pytest.mark.parametrize("sample_dirs", [False, True])
def test_a_npy_replaced_after_the_scan_is_refused_not_waited_on(tmp_path, kind, sample_dirs) -> None:
    save_npy(tmp_path / "src" / "s0" / "x.npy", np.arange(3.0))
    target = save_npy(tmp_path / "src" / "s1" / "x.npy", np.arange(3.0))
    with pytest.raises(SourceError) as caught:
        convert(
            [tmp_path / "src"],
            tmp_path / "out",
            workers=1,
            sample_dirs=sample_dirs,
            progress=_ReplaceBeforeCopy(target, kind),
        )
    assert str(caught.value) == f"{target}: {NOT_REGULAR[kind]}{COPY_PASS_HINT}"
    assert_nothing_written(tmp_path / "out")


def test_open_source_refuses_a_pipe_without_blocking(tmp_path) -> None:
    if not hasattr(os, "mkfifo"):
        pytest.skip("needs named pipes")
    os.mkfifo(tmp_path / "x.npy")
    with pytest.raises(SourceError, match="a pipe"), open_source(str(tmp_path / "x.npy")):
        pass
    assert fsutil.describe_kind(str(tmp_path / "x.npy")) == "a pipe (FIFO)"


# --- sample directories ------------------------------------------------------------


def test_sample_dirs_convert_exactly_as_savez_of_their_fields(tmp_path) -> None:
    rng = np.random.default_rng(3)
    for k in range(3):
        fields = {
            "image": raw_array(np.dtype(">f4"), (2, 3), k == 1, rng),
            "label": raw_array(np.dtype("<i8"), (), False, rng),
            "points": raw_array(RECORD, (k + 1,), False, rng),
        }
        for name, array in fields.items():
            save_npy(tmp_path / "dirs" / f"s{k}" / f"{name}.npy", array)
        (tmp_path / "dirs" / f"s{k}" / "notes.txt").write_text("ignored")
        write_npz(tmp_path / "npz" / f"s{k}.npz", **fields)
    convert([tmp_path / "dirs"], tmp_path / "from-dirs", workers=2, sample_dirs=True)
    convert([tmp_path / "npz"], tmp_path / "from-npz", workers=1)
    assert dataset_bytes(tmp_path / "from-dirs") == dataset_bytes(tmp_path / "from-npz")
    reader = DatasetReader(tmp_path / "from-dirs")
    for k in range(3):
        for name in ("image", "label", "points"):
            expected = little_endian_bytes(np.load(tmp_path / "dirs" / f"s{k}" / f"{name}.npy"))
            assert reader.view(name, k).tobytes() == expected
    sources = (tmp_path / "from-dirs" / "sources.jsonl").read_text().splitlines()
    assert [json.loads(line) for line in sources] == [str(tmp_path / "dirs" / f"s{k}") for k in range(3)]
    assert verify(tmp_path / "from-dirs", sources=True).ok


def test_nested_sample_dirs_are_samples_of_their_own_and_empty_dirs_are_not(tmp_path) -> None:
    save_npy(tmp_path / "src" / "x.npy", np.array([0]))
    save_npy(tmp_path / "src" / "b" / "x.npy", np.array([2]))
    save_npy(tmp_path / "src" / "a" / "x.npy", np.array([1]))
    (tmp_path / "src" / "c").mkdir()
    (tmp_path / "src" / "c" / "readme.txt").write_text("no arrays here")
    convert([tmp_path / "src"], tmp_path / "out", workers=1, sample_dirs=True)
    reader = DatasetReader(tmp_path / "out")
    assert [int(reader.view("x", i)[0]) for i in range(len(reader))] == [0, 1, 2]  # src, src/a, src/b


def test_sample_dirs_rows_convert_one_array_per_field(tmp_path) -> None:
    x = save_npy(tmp_path / "train" / "x.npy", np.arange(30, dtype=np.float32).reshape(5, 3, 2))
    y = save_npy(tmp_path / "train" / "y.npy", np.arange(5, dtype=">i8"))
    out = tmp_path / "out"
    code, _ = convert_cli(str(tmp_path / "train"), "--sample-dirs", "--rows", "-o", str(out))
    assert code == 0
    reader = DatasetReader(out)
    assert len(reader) == 5 and reader.field_names == ("x", "y")
    for i in range(5):
        assert reader.view("x", i).tobytes() == little_endian_bytes(np.load(x)[i])
        assert reader.view("y", i).tobytes() == little_endian_bytes(np.load(y)[i])
    assert json.loads((out / "sources.jsonl").read_text()) == [str(tmp_path / "train"), 5]
    assert verify(out, sources=True).ok


def test_keys_select_fields_of_sample_dirs(tmp_path) -> None:
    for k in range(2):
        save_npy(tmp_path / "src" / f"s{k}" / "x.npy", np.arange(3) + k)
        save_npy(tmp_path / "src" / f"s{k}" / f"extra{k}.npy", np.zeros(k + 1))
    convert([tmp_path / "src"], tmp_path / "out", workers=1, sample_dirs=True, keys=["x"])
    reader = DatasetReader(tmp_path / "out")
    assert reader.field_names == ("x",) and reader.view("x", 1).tolist() == [1, 2, 3]


def test_a_sample_dir_with_other_fields_is_named_in_the_key_mismatch(tmp_path) -> None:
    save_npy(tmp_path / "src" / "s0" / "x.npy", np.arange(3))
    save_npy(tmp_path / "src" / "s1" / "y.npy", np.arange(3))
    code, output = convert_cli(str(tmp_path / "src"), "--sample-dirs", "-o", str(tmp_path / "out"))
    assert (code, output) == (
        1,
        f"Error: {tmp_path / 'src' / 's1'}: keys differ from {tmp_path / 'src' / 's0'} "
        "(missing 'x'; extra 'y'); select common keys with --keys\n",
    )
    assert_nothing_written(tmp_path / "out")


# --- verify --sources --------------------------------------------------------------


@pytest.mark.parametrize("sample_dirs", [False, True])
def test_verify_sources_finds_an_edited_npy(tmp_path, sample_dirs) -> None:
    for k in range(3):
        save_npy(tmp_path / "src" / f"s{k}" / "x.npy", np.arange(4, dtype=np.float32) + k)
    convert([tmp_path / "src"], tmp_path / "out", workers=1, sample_dirs=sample_dirs)
    assert verify(tmp_path / "out", sources=True).ok
    edited = tmp_path / "src" / "s1" / "x.npy"
    np.save(edited, np.arange(4, dtype=np.float32) + 100)
    report = verify(tmp_path / "out", sources=True)
    source = edited.parent if sample_dirs else edited
    field = "x" if sample_dirs else "arr_0"
    assert report.problems == [f"sample 1 ({source}): field {field!r}: values differ from the source"]
    assert report.bad_samples == {"sources": [1]}


def test_sample_directories_count_their_npy_files_as_the_sources_size(tmp_path) -> None:
    """The 'much larger than its sources' note compares with the .npy files, not the directory entries."""
    for k in range(2):
        save_npy(tmp_path / "src" / f"s{k}" / "x.npy", np.zeros((100, 100)))
        (tmp_path / "src" / f"s{k}" / "notes.txt").write_text("ignored\n" * 10)
    result = convert(
        [tmp_path / "src"], tmp_path / "out", sample_dirs=True, workers=1, progress=SilentProgress()
    )
    expected = sum((tmp_path / "src" / f"s{k}" / "x.npy").stat().st_size for k in range(2))
    assert result.sources_nbytes == expected


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="needs named pipes and /dev/zero")
@pytest.mark.parametrize("mode", [[], ["--sample-dirs"]])
def test_skip_bad_skips_and_records_pipes_devices_and_broken_links_found_in_a_directory(
    tmp_path, mode
) -> None:
    save_npy(tmp_path / "src" / "s0" / "x.npy", np.arange(3.0))
    targets = {kind: tmp_path / "src" / f"s{k + 1}" / "x.npy" for k, kind in enumerate(NOT_REGULAR)}
    for kind, target in targets.items():
        target.parent.mkdir()
        put_in_place(target, kind)
    code, output = convert_cli(str(tmp_path / "src"), *mode, "--skip-bad", "-o", str(tmp_path / "out"))
    assert code == 0, output
    skipped_path = tmp_path / "out" / "skipped.jsonl"
    records = [json.loads(line) for line in skipped_path.read_text().splitlines()]
    expected_paths = [str(t.parent if mode else t) for t in targets.values()]
    assert records == [
        {"path": path, "reason": f"{target}: {NOT_REGULAR[kind]}"}
        for path, (kind, target) in zip(expected_paths, targets.items(), strict=True)
    ]
    assert (
        output
        == f"Warning: skipped {len(targets)} bad files, listed in {skipped_path}; the first: {records[0]['reason']}\n"
    )
    reader = DatasetReader(str(tmp_path / "out"))
    assert len(reader) == 1
    assert (
        reader.view(reader.field_names[0], 0).tobytes()
        == np.load(tmp_path / "src" / "s0" / "x.npy").tobytes()
    )


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="needs named pipes")
def test_skip_bad_skips_a_pipe_named_directly_but_not_a_missing_path(tmp_path) -> None:
    good = save_npy(tmp_path / "src" / "a.npy", np.arange(3.0))
    pipe = tmp_path / "src" / "b.npy"
    os.mkfifo(pipe)
    code, output = convert_cli(str(good), str(pipe), "--skip-bad", "-o", str(tmp_path / "out"))
    assert code == 0, output
    records = [json.loads(line) for line in (tmp_path / "out" / "skipped.jsonl").read_text().splitlines()]
    assert records == [{"path": str(pipe), "reason": f"{pipe}: {NOT_REGULAR['fifo']}"}]
    missing = tmp_path / "src" / "c.npy"
    code, output = convert_cli(str(good), str(missing), "--skip-bad", "-o", str(tmp_path / "out2"))
    assert (code, output.splitlines()[-1]) == (2, f"Error: {missing}: no such file or directory")
    assert_nothing_written(tmp_path / "out2")
