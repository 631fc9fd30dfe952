"""Bad input: a one-line error naming the file and problem, nothing left behind, sources untouched."""

from __future__ import annotations

import errno
import hashlib
import json
import os
import shutil
from pathlib import Path

import hostile
import numpy as np
import pytest
from click.testing import CliRunner
from conftest import write_npz, write_samples
from hypothesis import example, given, settings
from hypothesis import strategies as st

from npz2mmap import fsutil
from npz2mmap.check.verify import verify
from npz2mmap.cli.commands import cli
from npz2mmap.errors import OutputError, SourceError
from npz2mmap.format import provenance
from npz2mmap.ingest.npy_header import MemberHeader
from npz2mmap.read.reader import DatasetReader
from npz2mmap.write import blob_writer, publish
from npz2mmap.write.conversion import convert
from npz2mmap.write.plan import build_plan

BAD_FILES = {
    "zero-byte": (hostile.zero_byte, r"bad\.npz: not a valid zip/npz file \(File is not a zip file\)"),
    "text": (hostile.text_file, r"bad\.npz: not a valid zip/npz file"),
    "npy-renamed": (hostile.npy_renamed, r"bad\.npz: not a valid zip/npz file"),
    "truncated": (hostile.truncated_zip, r"bad\.npz: not a valid zip/npz file"),
    "crc": (
        hostile.crc_mismatch,
        r"bad\.npz\[x\]: Bad CRC-32 for file 'x\.npy' \(corrupt, or changed since it was scanned\)",
    ),
    "not-npy": (
        hostile.not_npy_member,
        r"bad\.npz\[x\]: not a \.npy array \(bad magic bytes\); np\.load gives such a member as raw bytes, "
        r"not an array: name the keys to convert with --keys; --skip-bad leaves such files out$",
    ),
    "npy-before-a-zip": (
        hostile.npy_before_a_zip,
        r"bad\.npz: not a valid zip/npz file: it starts as a \.npy file does, and np\.load reads it as one "
        r"array; rename it to \.npy to convert that array; --skip-bad leaves such files out$",
    ),
    "short-text-member": (hostile.short_text_member, r"bad\.npz\[readme\.txt\]: not a \.npy array \(bad magic"),
    "empty-member": (hostile.empty_member, r"bad\.npz\[x\]: empty, not a \.npy array; np\.load gives"),
    "malformed-header": (
        hostile.malformed_header,
        r"bad\.npz\[x\]: \.npy header is not a valid Python literal",
    ),
    "claims-too-much": (
        hostile.header_claims_too_much,
        r"bad\.npz\[x\]: header declares 8000000000000 data bytes but the member holds 64",
    ),
    "code-in-header": (
        hostile.header_with_code,
        r"bad\.npz\[x\]: \.npy header is not a valid Python literal",
    ),
}


def digest(directory: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(directory.iterdir())}


def staging_leftovers(parent: Path) -> list[str]:
    return [
        p.name for p in parent.iterdir() if publish.STAGING_MARK in p.name or publish.RETIRED_MARK in p.name
    ]


@pytest.fixture
def good_sources(tmp_path) -> Path:
    write_samples(tmp_path / "src", [{"x": np.arange(100, dtype=np.int64) + i} for i in range(4)])
    return tmp_path / "src"


@pytest.mark.parametrize("case", list(BAD_FILES))
def test_each_bad_file_is_named_with_its_problem(tmp_path, good_sources, monkeypatch, case) -> None:
    build, message = BAD_FILES[case]
    build(good_sources / "bad.npz")
    before = digest(good_sources)
    monkeypatch.chdir(tmp_path)
    result = CliRunner().invoke(
        cli, ["convert", str(good_sources), "-o", str(tmp_path / "out"), "--workers", "2"]
    )
    assert result.exit_code == 1, result.output
    lines = result.output.splitlines()
    assert len(lines) == 1 and lines[0].startswith("Error: ")
    assert str(good_sources / "bad.npz") in lines[0]
    assert pytest.importorskip("re").search(message, lines[0]), lines[0]
    assert not (tmp_path / "out").exists()
    assert staging_leftovers(tmp_path) == []
    assert digest(good_sources) == before
    assert not (tmp_path / "pwned").exists()


def test_debug_shows_the_traceback(tmp_path, good_sources) -> None:
    hostile.zero_byte(good_sources / "bad.npz")
    result = CliRunner().invoke(cli, ["--debug", "convert", str(good_sources), "-o", str(tmp_path / "out")])
    assert result.exit_code == 1
    assert isinstance(result.exception, SourceError)


def test_unreadable_files_are_named(tmp_path, good_sources, monkeypatch) -> None:
    real_open = os.open
    victim = str(good_sources / "s00002.npz")

    def deny(path, *args, **kwargs):
        if os.fspath(path) == victim:
            raise PermissionError(errno.EACCES, "Permission denied", victim)
        return real_open(path, *args, **kwargs)

    monkeypatch.setattr(os, "open", deny)
    with pytest.raises(SourceError, match=r"s00002\.npz: Permission denied"):
        convert([good_sources], tmp_path / "out", workers=1)
    assert not (tmp_path / "out").exists()


def test_a_broken_symlink_given_as_input_is_named(tmp_path) -> None:
    os.symlink(tmp_path / "gone.npz", tmp_path / "link.npz")
    with pytest.raises(SourceError, match=r"link\.npz: a broken link, not a regular file or directory"):
        convert([tmp_path / "link.npz"], tmp_path / "out")


def test_output_inside_an_input_directory_is_refused(good_sources) -> None:
    with pytest.raises(OutputError, match="is inside the input directory"):
        convert([good_sources], good_sources / "sub" / "out")
    assert not (good_sources / "sub").exists()


def test_a_full_disk_is_a_clean_error_and_removes_temporary_files(
    tmp_path, good_sources, monkeypatch
) -> None:
    real_pwrite = os.pwrite
    calls = []

    def fill_up(fd, data, offset):
        calls.append(offset)
        if len(calls) > 2:
            raise OSError(errno.ENOSPC, "No space left on device")
        return real_pwrite(fd, data, offset)

    monkeypatch.setattr(fsutil, "pwrite", fill_up)
    with pytest.raises(OutputError, match=r"out: cannot write the dataset \(No space left on device\)"):
        convert([good_sources], tmp_path / "out", workers=1)
    assert not (tmp_path / "out").exists()
    assert staging_leftovers(tmp_path) == []


def written_nbytes(dataset: Path) -> int:
    """What a conversion wrote: every file of the dataset, from the file system."""
    return sum(path.stat().st_size for path in dataset.iterdir())


def long_path_sources(tmp_path: Path, count: int, num_values: int) -> Path:
    """``count`` small .npy files under a ~600-character path: sources.jsonl outweighs their arrays."""
    top = tmp_path / "src"
    deep = top / ("d" * 200) / ("e" * 200) / ("f" * 150)
    deep.mkdir(parents=True)
    for i in range(count):
        np.save(deep / f"{i:04d}.npy", np.full(num_values, i, dtype=np.float64))
    return top


def test_the_free_space_check_counts_sources_jsonl(tmp_path, monkeypatch) -> None:
    src = long_path_sources(tmp_path, 50, 1)
    convert([src], tmp_path / "ref", workers=1)
    all_nbytes = written_nbytes(tmp_path / "ref")
    sources_nbytes = (tmp_path / "ref" / "sources.jsonl").stat().st_size
    assert sources_nbytes > (tmp_path / "ref" / "data.npy").stat().st_size  # the check must count it
    real_disk_usage = shutil.disk_usage
    monkeypatch.setattr(shutil, "disk_usage", lambda p: real_disk_usage(p)._replace(free=all_nbytes - 1))
    result = CliRunner().invoke(cli, ["convert", str(src), "-o", str(tmp_path / "out")])
    assert result.exit_code == 1
    assert result.output.startswith(f"Error: {tmp_path / 'out'}: the dataset needs ")
    assert result.output.endswith(
        f"{all_nbytes - 1:,} bytes ({(all_nbytes - 1) / 1e3:.1f} kB) free on its file system\n"
    )
    assert sorted(os.listdir(tmp_path)) == ["ref", "src"]


def test_long_source_paths_on_a_really_small_filesystem(tmp_path) -> None:
    """On a 1 MiB tmpfs the blob fits but not with sources.jsonl: refused before writing a byte."""
    src = long_path_sources(tmp_path, 600, 160)  # ~0.8 MB of blob, ~0.4 MB of sources.jsonl
    convert([src], tmp_path / "ref", workers=1)
    assert (tmp_path / "ref" / "data.npy").stat().st_size < 1 << 20 < written_nbytes(tmp_path / "ref")
    mount = tmp_path / "small"
    mount.mkdir()
    if os.system(f"mount -t tmpfs -o size=1m tmpfs {mount} 2>/dev/null") != 0:
        pytest.skip("cannot mount a tmpfs here")
    try:
        result = CliRunner().invoke(cli, ["convert", str(src), "-o", str(mount / "out")])
        assert result.exit_code == 1
        assert result.output.startswith(f"Error: {mount / 'out'}: the dataset needs ")
        needed = int(result.output.split(" the dataset needs ")[1].split(" bytes")[0].replace(",", ""))
        assert written_nbytes(tmp_path / "ref") <= needed
        assert result.output.endswith(" free on its file system\n")
        assert os.listdir(mount) == []
    finally:
        os.system(f"umount {mount}")


# Paths as the file system gives them: mostly printable ASCII (quotes and backslashes included),
# any other text, and lone surrogates for undecodable bytes.
AWKWARD_PATHS = st.text(
    st.one_of(
        st.characters(min_codepoint=0x20, max_codepoint=0x7E),
        st.characters(),
        st.sampled_from('"\\\t\n\x7f\udcff\U0001f600é'),
    )
)


@settings(max_examples=200, deadline=None)
@example([('a\\b"c', 10), ("é\n", 123456)], True)
@given(st.lists(st.tuples(AWKWARD_PATHS, st.integers(1, 10**6)), min_size=1, max_size=8), st.booleans())
def test_the_size_of_sources_jsonl_is_known_exactly_before_it_is_written(files, rows) -> None:
    """The free-space check sizes sources.jsonl without building its lines: exactly the bytes written."""
    scanned = [(f"{k}{path}", {"x": _header((num_rows,))}) for k, (path, num_rows) in enumerate(files)]
    plan = build_plan(scanned, 64, rows=rows)
    written = "".join(provenance.source_lines(plan)).encode("utf-8")
    assert provenance.source_lines_nbytes(plan) == len(written)


def _header(shape: tuple[int, ...]) -> MemberHeader:
    return MemberHeader("x", np.dtype("u1"), shape, False, 128, int(np.prod(shape)))


def test_a_full_disk_found_late_says_the_sizes(tmp_path, good_sources, monkeypatch) -> None:
    real_write_file = blob_writer._write_file

    def full_disk(path: str, lines: object) -> None:
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(blob_writer, "_write_file", full_disk)
    with pytest.raises(OutputError) as caught:
        convert([good_sources], tmp_path / "out", workers=1)
    message = str(caught.value)
    assert message.startswith(f"{tmp_path / 'out'}: cannot write the dataset (No space left on device): ")
    monkeypatch.setattr(blob_writer, "_write_file", real_write_file)
    convert([good_sources], tmp_path / "ref", workers=1)
    needed = int(message.split(" the dataset needs ")[1].split(" bytes")[0].replace(",", ""))
    assert written_nbytes(tmp_path / "ref") <= needed
    assert message.endswith(" free when the conversion began")
    assert not (tmp_path / "out").exists()
    assert staging_leftovers(tmp_path) == []


def test_a_really_full_filesystem(tmp_path, good_sources) -> None:
    """On a 256 KiB tmpfs, where the machine lets us mount one."""
    mount = tmp_path / "small"
    mount.mkdir()
    if os.system(f"mount -t tmpfs -o size=256k tmpfs {mount} 2>/dev/null") != 0:
        pytest.skip("cannot mount a tmpfs here")
    try:
        write_samples(tmp_path / "big", [{"x": np.zeros(100_000)} for _ in range(2)])
        convert([tmp_path / "big"], tmp_path / "ref")
        blob_nbytes = (tmp_path / "ref" / "data.npy").stat().st_size
        result = CliRunner().invoke(cli, ["convert", str(tmp_path / "big"), "-o", str(mount / "out")])
        assert result.exit_code == 1
        needed = int(result.output.split(" the dataset needs ")[1].split(" bytes")[0].replace(",", ""))
        assert blob_nbytes < needed < blob_nbytes + 4096  # the blob and the small files beside it
        assert result.output.endswith(" kB) free on its file system\n")
        assert os.listdir(mount) == []
    finally:
        os.system(f"umount {mount}")


def read_skipped(dataset: Path) -> list[dict]:
    return [json.loads(line) for line in (dataset / "skipped.jsonl").read_text().splitlines()]


@pytest.mark.parametrize("workers", [1, 2])
def test_skip_bad_converts_the_good_files_and_records_the_bad(tmp_path, good_sources, workers) -> None:
    hostile.zero_byte(good_sources / "s00001.npz")  # found bad while scanning
    hostile.crc_mismatch(good_sources / "s00003.npz")  # found bad only while copying
    result = CliRunner().invoke(
        cli,
        ["convert", str(good_sources), "-o", str(tmp_path / "out"), "--skip-bad", "--workers", str(workers)],
    )
    assert result.exit_code == 0, result.output
    assert f"Warning: skipped 2 bad files, listed in {tmp_path / 'out' / 'skipped.jsonl'}" in result.output
    reader = DatasetReader(tmp_path / "out")
    assert len(reader) == 2 and reader.index.num_skipped == 2
    assert [int(reader.view("x", i)[0]) for i in range(2)] == [0, 2]
    skipped = read_skipped(tmp_path / "out")
    assert [s["path"] for s in skipped] == [
        str(good_sources / "s00001.npz"),
        str(good_sources / "s00003.npz"),
    ]
    assert "File is not a zip file" in skipped[0]["reason"] and "Bad CRC-32" in skipped[1]["reason"]
    assert verify(tmp_path / "out", sources=True).ok


@pytest.mark.parametrize("workers", [1, 2])
def test_skipped_files_are_listed_in_input_order_whichever_pass_found_them(
    tmp_path, good_sources, workers
) -> None:
    hostile.crc_mismatch(good_sources / "s00001.npz")  # found bad only while copying
    hostile.zero_byte(good_sources / "s00002.npz")  # found bad while scanning
    hostile.crc_mismatch(good_sources / "s00003.npz")
    convert([good_sources], tmp_path / "out", skip_bad=True, workers=workers)
    assert [s["path"] for s in read_skipped(tmp_path / "out")] == [
        str(good_sources / f"s0000{k}.npz") for k in (1, 2, 3)
    ]


def test_skip_bad_with_nothing_usable_is_an_error(tmp_path) -> None:
    """The message says why, by the first file left out, whatever kind of file the inputs are."""
    hostile.zero_byte(tmp_path / "a.npz")
    (tmp_path / "b.npy").write_bytes(b"\x93NUMPY")
    with pytest.raises(SourceError) as refused:
        convert([tmp_path / "a.npz", tmp_path / "b.npy"], tmp_path / "out", skip_bad=True)
    assert str(refused.value).startswith(
        f"no usable input: --skip-bad left out all 2; the first: {tmp_path / 'a.npz'}: "
    )
    assert not (tmp_path / "out").exists()


def test_skip_bad_does_not_skip_files_that_disagree(tmp_path, good_sources) -> None:
    write_samples(tmp_path / "odd", [{"x": np.ones(3, np.float32)}])
    with pytest.raises(SourceError, match="dtype float32 differs from int64"):
        convert([good_sources, tmp_path / "odd"], tmp_path / "out", skip_bad=True, workers=1)


@pytest.mark.parametrize("workers", [1, 2])
def test_skip_bad_does_not_skip_files_whose_values_a_cast_cannot_keep(tmp_path, workers) -> None:
    write_samples(tmp_path / "src", [{"v": np.array([value], np.float64)} for value in (0.5, 0.1, 0.25)])
    with pytest.raises(
        SourceError, match=r"s00001\.npz\[v\]: .*--cast keeps only values that float32 represents exactly"
    ):
        convert([tmp_path / "src"], tmp_path / "out", casts={"v": "float32"}, skip_bad=True, workers=workers)
    assert not (tmp_path / "out").exists()


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="needs FIFOs (POSIX)")
@pytest.mark.parametrize("workers", [1, 2])
def test_skip_bad_lists_a_pipe_or_device_reached_by_two_names_twice(tmp_path, good_sources, workers) -> None:
    os.mkfifo(tmp_path / "pipe")
    for name, target in [
        ("p1.npz", "pipe"),
        ("p2.npz", "pipe"),
        ("z1.npz", "/dev/zero"),
        ("z2.npz", "/dev/zero"),
    ]:
        os.symlink(tmp_path / target, good_sources / name)
    result = convert([good_sources], tmp_path / "out", skip_bad=True, workers=workers)
    assert [Path(path).name for path, _ in result.skipped] == ["p1.npz", "p2.npz", "z1.npz", "z2.npz"]
    assert [Path(s["path"]).name for s in read_skipped(tmp_path / "out")] == [
        "p1.npz",
        "p2.npz",
        "z1.npz",
        "z2.npz",
    ]
    assert len(DatasetReader(tmp_path / "out")) == 4


def test_a_file_reached_by_two_names_is_still_refused_with_skip_bad(tmp_path, good_sources) -> None:
    os.symlink(good_sources / "s00000.npz", good_sources / "again.npz")
    with pytest.raises(SourceError, match=r"s00000\.npz: is the same file as .*again\.npz"):
        convert([good_sources], tmp_path / "out", skip_bad=True, workers=1)


def test_pipes_and_broken_links_named_npz_in_a_directory_are_named(tmp_path, good_sources) -> None:
    os.mkfifo(good_sources / "pipe.npz")
    with pytest.raises(SourceError, match=r"pipe\.npz: a pipe \(FIFO\), not a regular file"):
        convert([good_sources], tmp_path / "out", workers=1)
    os.unlink(good_sources / "pipe.npz")
    os.symlink(tmp_path / "gone", good_sources / "link.npz")
    with pytest.raises(SourceError, match=r"link\.npz: a broken link, not a regular file"):
        convert([good_sources], tmp_path / "out", workers=1)


@pytest.mark.parametrize("workers", [1, 2])
def test_skip_bad_does_not_leave_out_files_lacking_a_selected_key(tmp_path, workers) -> None:
    """A file without a --keys key disagrees with the others on keys: an error, as without --keys."""
    for k in range(6):
        arrays = {"x": np.arange(3), **({"z": np.int64(k)} if k % 2 == 0 else {})}
        write_npz(tmp_path / "src" / f"f{k}.npz", **arrays)
    with pytest.raises(SourceError) as refused:
        convert([tmp_path / "src"], tmp_path / "out", keys=["x", "z"], skip_bad=True, workers=workers)
    src = tmp_path / "src"
    assert str(refused.value) == (  # every such file, in one message
        f"3 files disagree with the first, {src / 'f0.npz'}: {src / 'f1.npz'}: no key 'z' (has: 'x'); "
        f"{src / 'f3.npz'}: no key 'z' (has: 'x'); {src / 'f5.npz'}: no key 'z' (has: 'x')"
    )
    assert not (tmp_path / "out").exists()
