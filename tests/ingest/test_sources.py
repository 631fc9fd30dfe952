"""Untrusted sources through the CLI: overflowing shapes, lying zip sizes, files swapped after the scan.

Each refusal is one line naming the file and key, exit code 1, no output and
the sources untouched.
"""

from __future__ import annotations

import hashlib
import os
import re
import subprocess
import sys
import zipfile
import zlib
from pathlib import Path

import hostile
import numpy as np
import pytest
from click.testing import CliRunner, Result
from conftest import COPY_PASS_HINT, no_hang, write_npz

from npz2mmap import fsutil
from npz2mmap.cli.commands import cli
from npz2mmap.errors import SourceError
from npz2mmap.format.index import MAX_NBYTES, MAX_PAYLOAD_NBYTES, checked_nbytes, representable_nbytes
from npz2mmap.ingest.npy_header import MemberHeader
from npz2mmap.ingest.sources import scan_source
from npz2mmap.read.reader import DatasetReader
from npz2mmap.write import publish
from npz2mmap.write.conversion import convert
from npz2mmap.write.layout import lay_out
from npz2mmap.write.plan import MAX_NUM_SAMPLES, build_plan


def digest(directory: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(directory.iterdir())}


def convert_cli(sources: Path, out: Path) -> Result:
    return CliRunner().invoke(cli, ["convert", str(sources), "-o", str(out), "--workers", "2"])


def assert_refused(result: Result, out: Path, where: str, message: str) -> None:
    """One line 'Error: <where>: <message...>', exit 1, no traceback and nothing at or beside OUT."""
    assert result.exit_code == 1, (result.output, result.exception)
    lines = result.output.splitlines()
    assert len(lines) == 1, result.output
    assert lines[0].startswith(f"Error: {where}: "), lines[0]
    assert re.search(message, lines[0]), lines[0]
    assert not out.exists()
    assert not [p for p in out.parent.iterdir() if publish.STAGING_MARK in p.name]


def header_text(descr: str, shape: tuple[int, ...]) -> str:
    return f"{{'descr': {descr!r}, 'fortran_order': False, 'shape': {shape!r}, }}"


# --- shapes numpy cannot represent --------------------------------------------

OVERFLOWING = {
    "(0, 2**63)": ("<f8", (0, 2**63)),
    "(2**64, 0)": ("<f8", (2**64, 0)),
    "(2**62, 2**62, 0)": ("<f8", (2**62, 2**62, 0)),
    "(2**60,) f8": ("<f8", (2**60,)),
    "(2**31, 2**31, 0)": ("<f8", (2**31, 2**31, 0)),
    "65 dimensions": ("|u1", (1,) * 65),
}


@pytest.mark.parametrize("case", list(OVERFLOWING))
def test_header_shapes_numpy_cannot_represent_are_named(tmp_path, case) -> None:
    descr, shape = OVERFLOWING[case]
    src = tmp_path / "src"
    hostile.zip_with(src / "bad.npz", {"x.npy": hostile.npy_with_header(header_text(descr, shape))})
    write_npz(src / "good.npz", x=np.zeros((1,) * min(len(shape), 32), dtype=descr))
    before = digest(src)
    result = convert_cli(src, tmp_path / "out")
    itemsize = np.dtype(descr).itemsize
    assert_refused(
        result,
        tmp_path / "out",
        f"{src / 'bad.npz'}[x]",
        re.escape(f"shape {shape} of {itemsize}-byte items is too large for numpy"),
    )
    assert digest(src) == before


def test_a_huge_number_in_a_header_is_quoted_briefly(tmp_path) -> None:
    bad = hostile.zip_with(
        tmp_path / "bad.npz", {"x.npy": hostile.npy_with_header(header_text("<f8", (10**4000,)))}
    )
    result = convert_cli(bad, tmp_path / "out")
    assert_refused(
        result, tmp_path / "out", f"{bad}[x]", r"shape \(1000000000.*\.\.\. of 8-byte items is too large"
    )
    assert len(result.output) < 600


def test_the_largest_zero_size_shape_numpy_accepts_converts_and_opens(tmp_path) -> None:
    src = tmp_path / "src"
    shape = ((2**63 - 1) // 8, 0)
    hostile.zip_with(src / "a.npz", {"x.npy": hostile.npy_with_header(header_text("<f8", shape))})
    assert np.load(src / "a.npz")["x"].shape == shape
    result = convert_cli(src, tmp_path / "out")
    assert result.exit_code == 0, result.output
    assert DatasetReader(tmp_path / "out").column("x").shape == (1, *shape)


@pytest.mark.parametrize(
    "shape",
    [(), (0,), (3, 4), (0, 2**63 - 1), (2**63 - 1, 0), (2**62, 2**62, 0), (2**31, 2**31, 0), (2**60,),
     (2**59, 0), (2**63,), (2**64, 0), (1,) * 64, (1,) * 65, (0,) * 65],
)  # fmt: skip
@pytest.mark.parametrize("itemsize", [1, 8])
def test_checked_nbytes_agrees_with_numpy(shape, itemsize) -> None:
    """numpy is the oracle: a zero-strided array of that shape needs no memory."""
    dtype = np.dtype(f"V{itemsize}")
    try:
        np.ndarray(shape, dtype, buffer=bytearray(itemsize), strides=(0,) * len(shape))
        numpy_nbytes: int | None = int(np.prod(shape, dtype=object)) * itemsize
    except (ValueError, OverflowError, TypeError):
        numpy_nbytes = None
    assert representable_nbytes(shape, itemsize) == numpy_nbytes
    if numpy_nbytes is None:
        with pytest.raises(SourceError, match=r"^f\[k\]: shape .* is too large for numpy"):
            checked_nbytes(shape, itemsize, "f[k]", SourceError)
    else:
        assert checked_nbytes(shape, itemsize, "f[k]") == numpy_nbytes


def test_payload_limit_is_the_largest_file() -> None:
    assert MAX_NBYTES == np.iinfo(np.int64).max and MAX_PAYLOAD_NBYTES == MAX_NBYTES - 128


# --- plan totals --------------------------------------------------------------


def test_a_fixed_field_too_large_for_numpy_as_a_whole_names_the_file_that_makes_it_so(tmp_path) -> None:
    """(2**62, 0) is fine in one file, but two samples make a (2, 2**62, 0) column numpy refuses."""
    src = tmp_path / "src"
    for name in ("a", "b", "c"):
        hostile.zip_with(
            src / f"{name}.npz", {"x.npy": hostile.npy_with_header(header_text("|u1", (2**62, 0)))}
        )
    with pytest.raises(ValueError, match="array is too big"):
        np.empty((2, 2**62, 0), np.uint8)
    result = convert_cli(src, tmp_path / "out")
    assert_refused(
        result, tmp_path / "out", f"{src / 'b.npz'}[x]", re.escape(f"shape (2, {2**62}, 0) of 1-byte items")
    )


def fake_header(shape: tuple[int, ...], dtype: str = "|u1") -> MemberHeader:
    nbytes = checked_nbytes(shape, np.dtype(dtype).itemsize, "fake")
    return MemberHeader("x", np.dtype(dtype), shape, False, 128, nbytes)


@pytest.mark.parametrize("sizes", [[2**62, 2**62], [2**61, 2**62, 2**62], [MAX_PAYLOAD_NBYTES - 100, 200]])
def test_a_field_whose_data_would_pass_the_payload_limit_names_the_file(sizes) -> None:
    """The int64 running sum would wrap (the first two cases) or pass what a file can hold."""
    shapes = np.array([[n] for n in sizes], dtype=np.int64)
    sources = [f"f{i}.npz" for i in range(len(sizes))]
    with pytest.raises(SourceError, match=rf"^f{len(sizes) - 1}\.npz\[x\]: with this file the field's data"):
        lay_out(sources, [("x", np.dtype("u1"), shapes, False)], 64)


def test_tables_past_the_payload_limit_are_refused() -> None:
    shapes = np.array([[MAX_PAYLOAD_NBYTES - 128]], dtype=np.int64)  # after the 64-byte identity
    with pytest.raises(SourceError, match=r"^field 'x' sample_crc32: the dataset would pass"):
        lay_out(["f0.npz"], [("x", np.dtype("u1"), shapes, False)], 64)


def test_rows_mode_refuses_more_samples_than_the_tables_can_index() -> None:
    files = [(f"f{i}.npz", {"x": fake_header((MAX_NUM_SAMPLES // 2 + 1,))}) for i in range(3)]
    with pytest.raises(SourceError, match=rf"^f1\.npz: brings the dataset past {MAX_NUM_SAMPLES} samples"):
        build_plan(iter(files), 64, rows=True)


def test_a_64_dimensional_array_leaves_no_room_for_the_sample_axis(tmp_path) -> None:
    write_npz(tmp_path / "src" / "a.npz", x=np.zeros((1,) * 64))
    result = convert_cli(tmp_path / "src", tmp_path / "out")
    assert_refused(
        result, tmp_path / "out", f"{tmp_path / 'src' / 'a.npz'}[x]", "no room for the sample axis"
    )
    result = CliRunner().invoke(
        cli, ["convert", str(tmp_path / "src"), "-o", str(tmp_path / "rows"), "--rows", "--workers", "1"]
    )
    assert result.exit_code == 0, result.output
    assert DatasetReader(tmp_path / "rows").column("x").shape == (1,) * 64


# --- zip sizes that lie -------------------------------------------------------

TIB = 1 << 40


def test_a_zip64_member_declaring_2_63_bytes_is_named_not_a_negative_payload(tmp_path) -> None:
    header = hostile.npy_with_header(header_text("<f8", (2**60,)))
    size = len(header) + 2**63
    bad = hostile.zip_declaring(tmp_path / "src" / "bad.npz", "x.npy", header + bytes(64), size, size)
    result = convert_cli(bad, tmp_path / "out")
    assert_refused(result, tmp_path / "out", f"{bad}[x]", "past the end of the")


def test_a_stored_zip64_member_lying_about_1_tib_is_named(tmp_path) -> None:
    header = hostile.npy_with_header(header_text("<f8", (TIB // 8,)))
    size = len(header) + TIB
    bad = hostile.zip_declaring(tmp_path / "src" / "bad.npz", "x.npy", header + bytes(64), size, size)
    result = convert_cli(bad, tmp_path / "out")
    assert_refused(
        result, tmp_path / "out", f"{bad}[x]", rf"member of {size} bytes would end at byte \d+, past the end"
    )


def test_a_deflated_member_declaring_more_than_deflate_can_expand_is_named(tmp_path) -> None:
    header = hostile.npy_with_header(header_text("<f8", (TIB // 8,)))
    packer = zlib.compressobj(9, zlib.DEFLATED, -15)
    stored = packer.compress(header + bytes(1 << 20)) + packer.flush()
    bad = hostile.zip_declaring(
        tmp_path / "src" / "bad.npz", "x.npy", stored, len(header) + TIB, method=zipfile.ZIP_DEFLATED
    )
    result = convert_cli(bad, tmp_path / "out")
    assert_refused(
        result,
        tmp_path / "out",
        f"{bad}[x]",
        rf"member declares {len(header) + TIB} bytes, more than its {len(stored)} deflated bytes can hold",
    )


def test_a_stored_member_whose_sizes_disagree_is_named(tmp_path) -> None:
    payload = hostile.npy_bytes(np.arange(4.0))
    bad = hostile.zip_declaring(tmp_path / "bad.npz", "x.npy", payload, len(payload) + 8)
    result = convert_cli(bad, tmp_path / "out")
    assert_refused(result, tmp_path / "out", f"{bad}[x]", "stored member declares .* but occupies")


def test_compressions_numpy_never_writes_are_refused(tmp_path) -> None:
    bad = hostile.zip_with(
        tmp_path / "bad.npz", {"x.npy": hostile.npy_bytes(np.arange(4.0))}, zipfile.ZIP_BZIP2
    )
    result = convert_cli(bad, tmp_path / "out")
    assert_refused(result, tmp_path / "out", f"{bad}[x]", "compression method 12 is not supported")


def test_real_deflated_members_at_a_high_ratio_convert(tmp_path) -> None:
    zeros = np.zeros(8 << 20, np.uint8)  # deflate packs these about 1000:1
    write_npz(tmp_path / "src" / "a.npz", compressed=True, x=zeros)
    assert convert_cli(tmp_path / "src", tmp_path / "out").exit_code == 0
    assert not DatasetReader(tmp_path / "out").column("x").any()


# --- sources swapped after the scan -------------------------------------------

SWAP_AFTER_SCAN = """
import os, resource, sys
from npz2mmap.cli.main import main
from npz2mmap.write import conversion

resource.setrlimit(resource.RLIMIT_AS, (4 << 30, 4 << 30))  # a read without bound fails, not the host
victim, replacement = sys.argv[1], sys.argv[2]
scan = conversion.Scan.run

def scan_then_swap(*args, **kwargs):
    plan = scan(*args, **kwargs)
    os.unlink(victim)
    if replacement == "fifo":
        os.mkfifo(victim)
    else:
        os.symlink(replacement, victim)
    return plan

conversion.Scan.run = scan_then_swap
sys.argv = ["npz2mmap", *sys.argv[3:]]
main()
"""


@pytest.mark.skipif(not hasattr(os, "mkfifo") or not os.path.exists("/dev/zero"), reason="POSIX only")
@pytest.mark.parametrize(
    ("replacement", "kind"), [("fifo", "a pipe (FIFO)"), ("/dev/zero", "a character device")]
)
def test_a_source_replaced_after_the_scan_by_a_pipe_or_device_is_refused(tmp_path, replacement, kind) -> None:
    src = tmp_path / "src"
    for i in range(3):
        write_npz(src / f"s{i}.npz", x=np.arange(10) + i)
    victim = src / "s1.npz"
    out = tmp_path / "out"
    result = subprocess.run(
        [sys.executable, "-c", SWAP_AFTER_SCAN, str(victim), replacement, "convert", str(src), "-o", str(out),
         "--workers", "1"],
        capture_output=True,
        text=True,
        timeout=120,  # a blocking open would hang forever
        env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)},
    )  # fmt: skip
    assert result.returncode == 1, result.stderr
    assert result.stderr.splitlines() == [f"Error: {victim}: {kind}, not a regular file{COPY_PASS_HINT}"]
    assert not out.exists()
    assert not [p for p in tmp_path.iterdir() if publish.STAGING_MARK in p.name]
    assert os.path.islink(victim) or victim.is_fifo()


# --- what the scan opens, and how -------------------------------------------------------------------




def recorded(monkeypatch, module: object, name: str) -> list[tuple[object, ...]]:
    """Record every call of ``module.name`` (still made) by its arguments."""
    calls: list[tuple[object, ...]] = []
    real = getattr(module, name)

    def record(*args: object, **kwargs: object) -> object:
        calls.append(args)
        return real(*args, **kwargs)

    monkeypatch.setattr(module, name, record)
    return calls


@pytest.mark.skipif(not hasattr(os, "mkfifo") or not os.path.exists("/dev/null"), reason="POSIX only")
@pytest.mark.parametrize("suffix", [".npz", ".npy"])
@pytest.mark.parametrize(("kind", "message"), [("fifo", "a pipe (FIFO)"), ("device", "a character device")])
def test_a_source_that_is_a_pipe_or_a_device_is_refused_without_being_opened(
    tmp_path, monkeypatch, suffix, kind, message
) -> None:
    """Opening a device may act (a tape rewinds, a watchdog starts): the stat before the open refuses it."""
    path = tmp_path / f"source{suffix}"
    if kind == "fifo":
        os.mkfifo(path)
    else:
        path.symlink_to("/dev/null")
    opened = recorded(monkeypatch, os, "open")
    with no_hang(), pytest.raises(SourceError) as caught:
        scan_source(str(path))
    assert str(caught.value) == f"{path}: {message}, not a regular file"
    assert opened == []


@pytest.mark.skipif(not hasattr(os, "mkfifo") or not os.path.exists("/dev/zero"), reason="POSIX only")
@pytest.mark.parametrize("suffix", [".npz", ".npy"])
@pytest.mark.parametrize(
    ("replacement", "message"),
    [("fifo", "a pipe (FIFO)"), ("/dev/zero", "a character device"), ("directory", "a directory")],
)
def test_a_pipe_device_or_directory_swapped_in_after_the_stat_is_refused_by_the_opened_descriptor(
    tmp_path, monkeypatch, suffix, replacement, message
) -> None:
    path = tmp_path / f"source{suffix}"
    if suffix == ".npy":
        np.save(path, np.arange(5))
    else:
        write_npz(path, x=np.arange(5))
    real_stat = os.stat

    def stat_then_swap(target: object, *args: object, **kwargs: object) -> os.stat_result:
        status = real_stat(target, *args, **kwargs)  # type: ignore[arg-type]
        if os.fspath(target) == str(path):  # type: ignore[arg-type]
            monkeypatch.setattr(os, "stat", real_stat)
            path.unlink()
            if replacement == "fifo":
                os.mkfifo(path)
            elif replacement == "directory":
                path.mkdir()
            else:
                path.symlink_to(replacement)
        return status

    monkeypatch.setattr(os, "stat", stat_then_swap)
    with no_hang(), pytest.raises(SourceError) as caught:
        scan_source(str(path))
    assert str(caught.value) == f"{path}: {message}, not a regular file"
    assert os.stat is real_stat  # the swap did happen between the checks


def test_an_npz_file_is_scanned_with_one_stat_one_open_one_fstat_and_one_read(tmp_path, monkeypatch) -> None:
    """Its descriptor, only ever read at an offset, keeps O_NONBLOCK: clearing it would change nothing."""
    path = tmp_path / "small.npz"
    write_npz(path, tokens=np.arange(700, dtype=np.int32), mask=np.ones(700, np.uint8))
    size = path.stat().st_size
    calls = {name: recorded(monkeypatch, os, name) for name in ("stat", "open", "fstat", "set_blocking")}
    reads = recorded(monkeypatch, fsutil, "read_at")
    headers, _ = scan_source(str(path))
    assert sorted(headers) == ["mask", "tokens"]
    assert {name: len(made) for name, made in calls.items()} == {
        "stat": 1,
        "open": 1,
        "fstat": 1,
        "set_blocking": 0,
    }
    assert [args[1:] for args in reads] == [(size, 0)]


def test_a_source_rewritten_after_the_scan_at_the_same_size_is_named_as_perhaps_changed(tmp_path) -> None:
    """Another file's bytes, of the same size, under the scanned name: only the CRC-32 tells."""
    src = tmp_path / "src"
    for i in range(3):
        write_npz(src / f"s{i}.npz", x=np.arange(10) + i)
    victim, other = src / "s1.npz", src / "s2.npz"
    assert victim.stat().st_size == other.stat().st_size
    out = tmp_path / "out"
    result = subprocess.run(
        [sys.executable, "-c", SWAP_AFTER_SCAN, str(victim), str(other), "convert", str(src), "-o", str(out),
         "--workers", "2"],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)},
    )  # fmt: skip
    assert result.returncode == 1, result.stderr
    assert result.stderr.splitlines() == [
        f"Error: {victim}[x]: Bad CRC-32 for file 'x.npy' (corrupt, or changed since it was scanned)"
        + COPY_PASS_HINT
    ]
    assert not out.exists()


def test_a_broken_link_is_named_alike_for_npz_and_npy_sources_under_skip_bad(tmp_path) -> None:
    (tmp_path / "src").mkdir()
    np.save(tmp_path / "src" / "good.npy", np.arange(2))
    for name in ("a.npz", "b.npy"):
        (tmp_path / "src" / name).symlink_to(tmp_path / "gone")
    result = convert([tmp_path / "src"], tmp_path / "out", skip_bad=True, workers=1)
    assert [reason for _, reason in result.skipped] == [
        f"{tmp_path / 'src' / name}: a broken link, not a regular file" for name in ("a.npz", "b.npy")
    ]
