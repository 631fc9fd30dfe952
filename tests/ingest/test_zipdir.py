"""Our reader of the zip directory against zipfile, the oracle: same entries, or a one-line SourceError.

Archives come from np.savez, np.savez_compressed and zipfile (comments,
prepended bytes, zip64 extras, a ZIP64 end record, directory entries, UTF-8
and cp437 names); mutants of them (flipped, truncated, inserted, overwritten
bytes) must be refused or read exactly as zipfile reads them, with every read
bounded by the file's size. The long run (``-m long``) tries many more examples.
"""

from __future__ import annotations

import io
import os
import pickle
import re
import struct
import subprocess
import sys
import tempfile
import tracemalloc
import zipfile
import zlib
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from unittest import mock

import numpy as np
import pytest
from click.testing import CliRunner
from conftest import sized
from hypothesis import assume, given
from hypothesis import strategies as st

from npz2mmap import DatasetReader, fsutil
from npz2mmap.cli.commands import cli
from npz2mmap.errors import SourceError
from npz2mmap.ingest import npz as npzfile
from npz2mmap.ingest import zip_directory
from npz2mmap.ingest.sources import open_source, scan_source

FIELDS = ("orig_filename", "filename", "flag_bits", "compress_type", "CRC", "compress_size", "file_size")
END = struct.Struct("<4s4H2LH")
ZIP64_END = struct.Struct("<4sQ2H2L4Q")
ZIP64_LOCATOR = struct.Struct("<4sLQL")
CENTRAL = struct.Struct("<4s4B4HL2L5H2L")


def oracle(data: bytes) -> list[tuple[object, ...]]:
    """What zipfile reads: each entry's fields, in directory order (raises what zipfile raises).

    From a real file: zipfile's seeks before the start fail there, where io.BytesIO would clamp them.
    """
    with tempfile.TemporaryFile() as fp:
        fp.write(data)
        fp.seek(0)
        with zipfile.ZipFile(fp) as zf:
            return [(*(getattr(i, f) for f in FIELDS), i.header_offset) for i in zf.infolist()]


@contextmanager
def opened(data: bytes) -> Iterator[int]:
    with tempfile.TemporaryFile() as fp:
        fp.write(data)
        fp.flush()
        yield fp.fileno()


def ours(data: bytes, whole: bool = True) -> list[tuple[object, ...]]:
    """What zipdir reads, whole or in windows; every read must lie inside the file."""
    reads: list[tuple[int, int]] = []
    real_read_at = fsutil.read_at

    def bounded_read_at(fd: int, nbytes: int, offset: int) -> bytes:
        reads.append((offset, nbytes))
        return real_read_at(fd, nbytes, offset)

    limit = zip_directory.WHOLE_FILE_MAX_NBYTES if whole else 0
    with (
        opened(data) as fd,
        mock.patch.object(fsutil, "read_at", bounded_read_at),
        mock.patch.object(zip_directory, "WHOLE_FILE_MAX_NBYTES", limit),
        mock.patch.object(zip_directory, "MIN_READ_NBYTES", zip_directory.MIN_READ_NBYTES if whole else 64),
        mock.patch.object(zip_directory, "TAIL_NBYTES", zip_directory.TAIL_NBYTES if whole else 100),
    ):
        try:
            entries = zip_directory.read_entries(zip_directory.FileView(fd, len(data), "a.npz"))
        finally:
            assert all(
                0 <= offset and 0 <= nbytes and offset + nbytes <= len(data) for offset, nbytes in reads
            )
    return [tuple(e) for e in entries]


def assert_refused_in_one_line(data: bytes, whole: bool = True) -> str:
    with pytest.raises(SourceError) as caught:
        ours(data, whole)
    message = str(caught.value)
    assert message.startswith("a.npz: ") and "\n" not in message
    return message


# --- archives -------------------------------------------------------------------------------------

names = st.one_of(
    st.text(st.characters(codec="ascii", exclude_characters="\0/"), min_size=1, max_size=12),
    st.text(st.characters(codec="cp437", exclude_characters="\0/"), min_size=1, max_size=12),
    st.text(st.characters(exclude_categories=("Cs",), exclude_characters="\0/"), min_size=1, max_size=12),
)


@st.composite
def numpy_archives(draw: st.DrawFn) -> bytes:
    keys = draw(st.lists(st.text("abcxyz_", min_size=1, max_size=6), max_size=4, unique=True))
    arrays = {
        k: np.arange(draw(st.integers(0, 300)), dtype=draw(st.sampled_from(["<i4", "u1", ">f8"])))
        for k in keys
    }
    buffer = io.BytesIO()
    (np.savez_compressed if draw(st.booleans()) else np.savez)(buffer, **arrays)
    return buffer.getvalue()


@st.composite
def zipfile_archives(draw: st.DrawFn) -> bytes:
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w") as zf:
        for name in draw(st.lists(names, max_size=draw(st.sampled_from([3, 40])), unique=True)):
            if draw(st.integers(0, 5)) == 0:
                zf.writestr(name.rstrip("/") + "/", b"")  # a directory entry
                continue
            data = draw(st.binary(max_size=200))
            method = draw(st.sampled_from([zipfile.ZIP_STORED, zipfile.ZIP_DEFLATED]))
            info = zipfile.ZipInfo(name)
            info.compress_type = method
            with zf.open(info, "w", force_zip64=draw(st.booleans())) as fp:
                fp.write(data)
        comment = draw(st.binary(max_size=300))
        assume(b"PK\x05\x06" not in comment)
        zf.comment = comment
    return buffer.getvalue()


def with_zip64_end(data: bytes) -> bytes:
    """The archive with a ZIP64 end record and locator before its end record, as a large one has."""
    end_offset = data.rindex(b"PK\x05\x06")
    _, _, _, count_here, count, dir_nbytes, dir_offset, comment_nbytes = END.unpack_from(data, end_offset)
    record = ZIP64_END.pack(b"PK\x06\x06", 44, 45, 45, 0, 0, count_here, count, dir_nbytes, dir_offset)
    locator = ZIP64_LOCATOR.pack(b"PK\x06\x07", 0, end_offset, 1)
    end = END.pack(b"PK\x05\x06", 0, 0, 0xFFFF, 0xFFFF, 0xFFFFFFFF, 0xFFFFFFFF, comment_nbytes)
    return data[:end_offset] + record + locator + end + data[end_offset + END.size :]


@st.composite
def archives(draw: st.DrawFn) -> bytes:
    data = draw(st.one_of(numpy_archives(), zipfile_archives()))
    if draw(st.booleans()):
        data = with_zip64_end(data)
    if draw(st.booleans()):
        data = draw(st.binary(min_size=1, max_size=100)) + data  # a self-extracting stub, say
    return data


# --- valid archives: the same entries as zipfile ------------------------------------------------


def test_every_field_of_every_entry_is_zipfiles(run_size) -> None:
    @sized(run_size, 60, 1500)
    @given(data=archives(), whole=st.booleans())
    def check(data: bytes, whole: bool) -> None:
        assert ours(data, whole) == oracle(data)

    check()


def test_the_forms_the_strategies_promise_are_read_as_zipfile_reads_them() -> None:
    """One of each, so a strategy that stopped producing one cannot hide it."""
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w", zipfile.ZIP_DEFLATED) as zf:
        zf.writestr("d/", b"")
        zf.writestr("é.npy", b"x" * 100)  # a UTF-8 name, flagged
        with zf.open("z.npy", "w", force_zip64=True) as fp:
            fp.write(b"zip64 extra")
        zf.comment = b"a comment"
    plain = buffer.getvalue()
    for data in (plain, b"stub" + plain, with_zip64_end(plain), b"\0" * 50 + with_zip64_end(plain)):
        for whole in (True, False):
            assert ours(data, whole) == oracle(data)
    entries = oracle(plain)
    assert [e[0] for e in entries] == ["d/", "é.npy", "z.npy"]
    assert entries[1][2] & 0x800  # the UTF-8 flag
    zip64_extra = struct.pack("<HHQQ", 1, 16, 11, entries[2][5])  # z.npy's local header: both sizes
    assert zip64_extra in plain


def test_cp437_names_are_decoded_as_zipfile_decodes_them() -> None:
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w") as zf:
        zf.writestr("A.npy", b"")
    data = buffer.getvalue().replace(b"A.npy", b"\x82.npy")
    assert ours(data) == oracle(data)
    assert ours(data)[0][0] == "é.npy"


def test_an_archive_with_no_members_is_read_as_empty() -> None:
    buffer = io.BytesIO()
    zipfile.ZipFile(buffer, "w").close()
    data = buffer.getvalue()
    assert ours(data) == oracle(data) == []
    assert ours(with_zip64_end(data)) == oracle(with_zip64_end(data)) == []


def zipfile_with_zip64_end(path: Path, num_members: int) -> bytes:
    """An archive zipfile writes with its own ZIP64 end record: it does for more than
    ZIP_FILECOUNT_LIMIT members, a limit lowered here."""
    limit = num_members - 1
    with mock.patch.object(zipfile, "ZIP_FILECOUNT_LIMIT", limit), zipfile.ZipFile(path, "w") as zf:
        for i in range(num_members):
            zf.writestr(f"{i}", b"")
    return path.read_bytes()


def test_many_members_are_read_from_zipfiles_own_zip64_end_record(tmp_path, run_size) -> None:
    num_members = run_size.of(300, zip_directory.MAX_ENTRIES)
    data = zipfile_with_zip64_end(tmp_path / "many.npz", num_members)
    assert data[-22 - 20 : -22].startswith(b"PK\x06\x07")  # zipfile wrote a ZIP64 end record
    assert ours(data) == oracle(data)
    assert len(ours(data, whole=False)) == num_members


# --- mutants: refused in one line, or read exactly as zipfile reads them --------------------------


@st.composite
def mutants(draw: st.DrawFn) -> bytes:
    data = bytearray(draw(archives()))
    end = data.rindex(b"PK\x05\x06")
    regions = [(max(0, end - 120), len(data))]  # end records and the directory's tail
    if b"PK\x01\x02" in data:
        regions.append((data.index(b"PK\x01\x02"), end))
    if b"PK\x03\x04" in data:
        first = data.index(b"PK\x03\x04")
        regions.append((first, first + 60))
    for _ in range(draw(st.integers(1, 3))):
        low, high = draw(st.sampled_from(regions))
        at = min(draw(st.integers(low, max(low, high - 1))), len(data) - 1)
        kind = draw(st.sampled_from(["flip", "truncate", "insert", "ff"]))
        if kind == "flip":
            data[at] ^= draw(st.integers(1, 255))
        elif kind == "truncate":
            del data[at:]
        elif kind == "insert":
            data[at:at] = draw(st.binary(min_size=1, max_size=8))
        else:
            data[at : at + draw(st.integers(1, 8))] = b"\xff" * draw(st.integers(1, 8))
        if not data:
            break
    return bytes(data)


def test_a_damaged_archive_is_refused_in_one_line_or_read_as_zipfile_reads_it(run_size) -> None:
    @sized(run_size, 150, 5000)
    @given(data=mutants(), whole=st.booleans())
    def check(data: bytes, whole: bool) -> None:
        try:
            entries = ours(data, whole)
        except SourceError as exc:
            assert str(exc).startswith("a.npz: ") and "\n" not in str(exc)
            return
        assert entries == oracle(data)

    check()


# --- hostile numbers --------------------------------------------------------------------------------


def one_member() -> bytes:
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w") as zf:
        zf.writestr("x.npy", b"data")
    return buffer.getvalue()


def with_end(data: bytes, **fields: int) -> bytes:
    """``data`` with fields of its end record replaced."""
    end_offset = data.rindex(b"PK\x05\x06")
    values = dict(
        zip(
            ["disk", "dir_disk", "count_here", "count", "dir_nbytes", "dir_offset", "comment"],
            END.unpack_from(data, end_offset)[1:],
            strict=True,
        )
    )
    values.update(fields)
    return data[:end_offset] + END.pack(b"PK\x05\x06", *values.values())


def with_zip64_fields(data: bytes, **fields: int) -> bytes:
    """``data`` (with a ZIP64 end record) with fields of that record replaced."""
    at = data.rindex(b"PK\x06\x06")
    values = list(ZIP64_END.unpack_from(data, at))
    names = [
        "sig",
        "size",
        "made",
        "needed",
        "disk",
        "dir_disk",
        "count_here",
        "count",
        "dir_nbytes",
        "dir_offset",
    ]
    for name, value in fields.items():
        values[names.index(name)] = value
    return data[:at] + ZIP64_END.pack(*values) + data[at + ZIP64_END.size :]


def test_a_directory_claiming_65535_entries_in_a_112_byte_file_is_refused() -> None:
    data = with_end(one_member(), count_here=65535, count=65535)
    assert len(data) == 112
    message = assert_refused_in_one_line(data)
    assert (
        message
        == "a.npz: not a valid zip/npz file (65535 entries cannot fit in a central directory of 51 bytes)"
    )
    assert len(oracle(data)) == 1  # zipfile ignores the count


@pytest.mark.parametrize("whole", [True, False])
@pytest.mark.parametrize(
    "fields, problem",
    [
        ({"count_here": 2**64 - 1, "count": 2**64 - 1}, "18446744073709551615 entries cannot fit"),
        ({"count_here": 2**32, "count": 2**32}, "4294967296 entries cannot fit"),
        ({"dir_nbytes": 2**64 - 1}, "Bad offset for central directory"),
        ({"dir_nbytes": 2**32 + 51}, "Bad offset for central directory"),
        ({"disk": 1}, "span multiple disks"),
        ({"count_here": 0}, "span multiple disks"),
        ({"count_here": 0, "count": 0}, "51 bytes is larger than 0 entries can be"),
    ],
)
def test_hostile_numbers_in_a_zip64_end_record_are_refused_in_one_line(fields, problem, whole) -> None:
    data = with_zip64_fields(with_zip64_end(one_member()), **fields)
    assert problem in assert_refused_in_one_line(data, whole)


@pytest.mark.parametrize("dir_offset", [2**32, 2**64 - 1])
def test_a_directory_offset_past_the_file_shifts_member_offsets_as_in_zipfile_and_the_scan_refuses_them(
    tmp_path, dir_offset
) -> None:
    """The directory lies before the end records whatever its offset says; the difference is
    taken for bytes prepended to the archive, so member offsets fall before the file's start."""
    data = with_zip64_fields(with_zip64_end(one_member()), dir_offset=dir_offset)
    entries = ours(data)
    assert entries == oracle(data) and entries[0][-1] == 39 - dir_offset
    path = tmp_path / "a.npz"
    path.write_bytes(data)
    with pytest.raises(SourceError) as caught:
        scan_source(str(path))
    assert (
        str(caught.value)
        == f"{path}[x]: member header at byte {39 - dir_offset} lies outside the {len(data)}-byte file"
    )


def test_a_zip64_locator_with_no_room_for_its_record_is_refused_as_zipfile_refuses_it() -> None:
    data = ZIP64_LOCATOR.pack(b"PK\x06\x07", 0, 0, 1) + END.pack(b"PK\x05\x06", 0, 0, 0, 0, 0, 0, 0)
    with pytest.raises(zipfile.BadZipFile, match="File is not a zip file"):
        oracle(data)
    assert assert_refused_in_one_line(data) == "a.npz: not a valid zip/npz file (File is not a zip file)"


def test_multi_disk_archives_are_refused_as_zipfile_refuses_them() -> None:
    data = with_zip64_end(one_member())
    at = data.rindex(b"PK\x06\x07")
    data = data[:at] + ZIP64_LOCATOR.pack(b"PK\x06\x07", 0, 0, 2) + data[at + ZIP64_LOCATOR.size :]
    with pytest.raises(zipfile.BadZipFile, match="span multiple disks"):
        oracle(data)
    assert "span multiple disks are not supported" in assert_refused_in_one_line(data)


@pytest.mark.parametrize("size", [0, 1, 21])
def test_files_too_small_for_an_end_record_are_not_zip_files(size) -> None:
    assert (
        assert_refused_in_one_line(b"P" * size)[len("a.npz: ") :]
        == "not a valid zip/npz file (File is not a zip file)"
    )


def test_a_zip64_extra_field_is_taken_only_for_marked_values_and_must_hold_them() -> None:
    data = one_member()
    at = data.rindex(b"PK\x01\x02")
    central = bytearray(data[at:])
    struct.pack_into("<L", central, 42, 0xFFFFFFFF)  # the local header offset, moved to the extra
    extra = struct.pack("<HHQ", 1, 8, 0)
    name_end = 46 + 5
    struct.pack_into("<H", central, 30, len(extra))
    patched = bytes(central[:name_end]) + extra + bytes(central[name_end:])
    end = patched.rindex(b"PK\x05\x06")
    good = data[:at] + patched[:end] + END.pack(b"PK\x05\x06", 0, 0, 1, 1, end, at, 0)
    assert ours(good) == oracle(good) and ours(good)[0][-1] == 0
    short = good.replace(extra, struct.pack("<HHL", 1, 4, 0) + b"\0" * 4)
    with pytest.raises(zipfile.BadZipFile, match="Header offset not found"):
        oracle(short)
    assert "Corrupt zip64 extra field. Header offset not found." in assert_refused_in_one_line(short)
    corrupt = good.replace(extra, struct.pack("<HH", 1, 20) + b"\0" * 8)
    assert "Corrupt extra field 0001 (size=20)" in assert_refused_in_one_line(corrupt)


def test_an_entry_reaching_past_the_directory_is_refused_where_zipfile_cuts_its_name() -> None:
    data = one_member()
    at = data.rindex(b"PK\x01\x02")
    data = data[: at + 28] + struct.pack("<H", 6) + data[at + 30 :]  # a name 1 byte longer
    assert [e[0] for e in oracle(data)] == ["x.npy"]  # zipfile reads it short, silently
    assert assert_refused_in_one_line(data) == "a.npz: not a valid zip/npz file (Truncated central directory)"


# --- the scan, end to end -----------------------------------------------------------------------------


def corpus(directory: Path) -> list[Path]:
    directory.mkdir()
    rng = np.random.default_rng(0)
    arrays = {
        "tokens": rng.integers(0, 50_000, 700).astype(np.int32),
        "mask": rng.integers(0, 2, 700).astype(np.uint8),
    }
    paths = []
    for name, save in (("plain", np.savez), ("deflated", np.savez_compressed)):
        for size in (10, 100_000):  # read whole, and in windows
            paths.append(directory / f"{name}{size}.npz")
            save(paths[-1], **{k: np.resize(v, size) for k, v in arrays.items()})
    zip64 = directory / "zip64.npz"
    zip64.write_bytes(with_zip64_end(paths[1].read_bytes()))
    return [*paths, zip64]


def test_the_scan_finds_each_members_header_and_bytes_where_numpy_and_zipfile_do(tmp_path) -> None:
    for path in corpus(tmp_path / "src"):
        headers, locations = scan_source(str(path))
        data = path.read_bytes()
        with zipfile.ZipFile(path) as zf:
            assert sorted(headers) == sorted(name.removesuffix(".npy") for name in zf.namelist())
            for key, header in headers.items():
                with zf.open(key + ".npy") as member:
                    array = np.lib.format.read_array(member)
                assert (header.dtype, header.shape, header.nbytes) == (array.dtype, array.shape, array.nbytes)
                info = zf.getinfo(key + ".npy")
                local = data[info.header_offset : info.header_offset + 30]
                name_nbytes, extra_nbytes = struct.unpack("<HH", local[26:30])
                location = locations[key]
                assert location.offset == info.header_offset + 30 + name_nbytes + extra_nbytes
                assert (location.stored_nbytes, location.nbytes, location.crc32) == (
                    info.compress_size,
                    info.file_size,
                    info.CRC,
                )
                stored = data[location.offset : location.offset + location.stored_nbytes]
                raw = zlib.decompress(stored, -15) if info.compress_type == zipfile.ZIP_DEFLATED else stored
                assert raw == zf.read(info)


def test_a_member_with_an_empty_name_is_a_one_line_error_not_a_crash(tmp_path) -> None:
    """zipfile's ZipInfo.is_dir() raised IndexError on it, which escaped as a traceback."""
    path = tmp_path / "src" / "bad.npz"
    path.parent.mkdir()
    buffer = io.BytesIO()
    np.savez(buffer, x=np.arange(3))
    data = buffer.getvalue().replace(b"x.npy", b"\0.npy")
    path.write_bytes(data)
    result = CliRunner().invoke(
        cli, ["convert", str(path.parent), "-o", str(tmp_path / "out"), "--workers", "1"]
    )
    assert result.exit_code == 1, result.output
    assert result.output.startswith(f"Error: {path}") and result.output.count("\n") == 1, result.output
    assert not (tmp_path / "out").exists()


def test_converting_and_verifying_sources_never_use_zipfile(tmp_path) -> None:
    """The library reads zip files with its own bounded reader; zipfile stays the tests' oracle."""
    corpus(tmp_path / "src")
    code = (
        "import zipfile\n"
        "def refuse(*args, **kwargs): raise AssertionError('zipfile.ZipFile was used')\n"
        "zipfile.ZipFile = refuse\n"
        "from npz2mmap.cli.commands import cli\n"
        f"cli(['convert', {str(tmp_path / 'src')!r}, '-o', {str(tmp_path / 'out')!r}, '-q', '--workers', '1'], standalone_mode=False)\n"
        f"cli(['verify', {str(tmp_path / 'out')!r}, '--sources'], standalone_mode=False)\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert "5 samples verified" in done.stdout


def test_a_header_longer_than_one_window_is_read_from_a_large_file(tmp_path) -> None:
    """A file above WHOLE_FILE_MAX_NBYTES is read in windows; a long .npy header spans several."""
    dtype = np.dtype([(f"field_with_a_long_name_{i:03d}", "u1") for i in range(200)])
    array = np.frombuffer(np.random.default_rng(1).bytes(200 * 1500), dtype)
    path = tmp_path / "large.npz"
    np.savez(path, x=array)
    assert path.stat().st_size > zip_directory.WHOLE_FILE_MAX_NBYTES
    headers, locations = scan_source(str(path))
    assert headers["x"].header_nbytes > zip_directory.MIN_READ_NBYTES
    assert (headers["x"].dtype, headers["x"].shape) == (array.dtype, array.shape)
    with zipfile.ZipFile(path) as zf:
        stored = path.read_bytes()[locations["x"].offset :][: locations["x"].stored_nbytes]
        assert stored == zf.read("x.npy")


def test_a_small_npz_file_is_scanned_with_one_read_and_one_fstat(tmp_path, monkeypatch) -> None:
    """Its end records, directory, local headers and .npy headers all come from one read of the whole file."""
    path = tmp_path / "small.npz"
    np.savez(path, tokens=np.arange(700, dtype=np.int32), mask=np.ones(700, np.uint8))
    reads: list[tuple[int, int]] = []
    fstats: list[int] = []
    real_read_at, real_fstat = fsutil.read_at, os.fstat

    def counted_read_at(fd: int, nbytes: int, offset: int) -> bytes:
        reads.append((offset, nbytes))
        return real_read_at(fd, nbytes, offset)

    def counted_fstat(fd: int) -> os.stat_result:
        fstats.append(fd)
        return real_fstat(fd)

    monkeypatch.setattr(fsutil, "read_at", counted_read_at)
    monkeypatch.setattr(os, "fstat", counted_fstat)
    headers, _ = scan_source(str(path))
    assert sorted(headers) == ["mask", "tokens"]
    assert reads == [(0, path.stat().st_size)] and len(fstats) == 1


# --- overlapping members (a zip bomb by overlap) ---------------------------------------------------

FIXED_TIME = (2020, 1, 1, 0, 0, 0)


def npy_bytes(array: np.ndarray) -> bytes:
    buffer = io.BytesIO()
    np.save(buffer, array)
    return buffer.getvalue()


def stored_zip(members: dict[str, bytes]) -> bytes:
    """A zip of stored members, in order, with a fixed time (so a member's local header is reproducible)."""
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w") as zf:
        for name, data in members.items():
            zf.writestr(zipfile.ZipInfo(name, FIXED_TIME), data)
    return buffer.getvalue()


def patch_central_entry(data: bytes, name: str, **fields: int) -> bytes:
    """Rewrite fields (crc32, compress_size, file_size, header_offset) of the central entry of ``name``."""
    offsets = {"crc32": 16, "compress_size": 20, "file_size": 24, "header_offset": 42}
    start = data.index(b"PK\x01\x02")
    while data[start + 46 : start + 46 + len(name)] != name.encode():
        start = data.index(b"PK\x01\x02", start + 4)
    patched = bytearray(data)
    for field, value in fields.items():
        struct.pack_into("<L", patched, start + offsets[field], value)
    return bytes(patched)


def running_into(following: bytes) -> tuple[np.ndarray, bytes, bytes]:
    """An array whose .npy bytes end in ``following``; the member bytes written (all but those), and
    the whole .npy bytes, which a reader gets by reading past the member into what follows it."""
    array = np.frombuffer(b"\x07" * 60 + following, np.uint8)
    whole = npy_bytes(array)
    return array, whole[: -len(following)], whole


def refused_as_overlap(path: Path) -> str:
    with pytest.raises(SourceError) as caught:
        scan_source(str(path))
    message = str(caught.value)
    assert "\n" not in message
    return message


def test_a_member_lying_inside_another_ones_bytes_is_refused(tmp_path) -> None:
    """b.npy's local header and data are also a.npy's data: two arrays from one set of bytes."""
    b_array = np.arange(10, dtype=np.int64)
    b_alone = stored_zip({"b.npy": npy_bytes(b_array)})
    b_local = b_alone[: b_alone.index(b"PK\x01\x02")]  # b's local header and data
    a_npy = npy_bytes(np.frombuffer(b_local, np.uint8))
    data = stored_zip({"a.npy": a_npy, "b.npy": npy_bytes(b_array)})
    inner_offset = 30 + len("a.npy") + (len(a_npy) - len(b_local))
    data = patch_central_entry(data, "b.npy", header_offset=inner_offset)
    path = tmp_path / "shared.npz"
    path.write_bytes(data)
    with np.load(path) as npz:  # what numpy reads (without newer zipfile's check): both arrays
        assert np.array_equal(npz["b"], b_array) and npz["a"].tobytes() == b_local
    assert refused_as_overlap(path) == (
        f"{path}: not a valid zip/npz file (members 'a' and 'b' overlap, bytes {inner_offset} "
        f"to {inner_offset + len(b_local)}: a possible zip bomb)"
    )


def test_a_member_whose_bytes_run_into_the_next_local_header_is_refused(tmp_path) -> None:
    a_array, a_written, a_npy = running_into(b"PK\x03\x04")
    data = stored_zip({"a.npy": a_written, "b.npy": npy_bytes(np.arange(3))})
    data = patch_central_entry(
        data, "a.npy", crc32=zlib.crc32(a_npy), compress_size=len(a_npy), file_size=len(a_npy)
    )
    path = tmp_path / "into-next.npz"
    path.write_bytes(data)
    with np.load(path) as npz:
        assert np.array_equal(npz["a"], a_array)
    b_start = 30 + len("a.npy") + len(a_written)
    assert refused_as_overlap(path) == (
        f"{path}: not a valid zip/npz file (members 'a' and 'b' overlap, bytes {b_start} "
        f"to {b_start + 4}: a possible zip bomb)"
    )


def archive_running_into_its_directory(tmp_path: Path) -> tuple[Path, bytes, np.ndarray]:
    """An archive whose member 'b' claims bytes up to the central directory's first entry, which
    np.load reads; its path, bytes and b's array."""
    b_array, b_written, b_npy = running_into(b"PK\x01\x02")
    data = stored_zip({"a.npy": npy_bytes(np.arange(3)), "b.npy": b_written})
    data = patch_central_entry(
        data, "b.npy", crc32=zlib.crc32(b_npy), compress_size=len(b_npy), file_size=len(b_npy)
    )
    path = tmp_path / "into-directory.npz"
    path.write_bytes(data)
    return path, data, b_array


def test_a_member_whose_bytes_run_into_the_central_directory_is_refused(tmp_path) -> None:
    path, data, b_array = archive_running_into_its_directory(tmp_path)
    with np.load(path) as npz:
        assert np.array_equal(npz["b"], b_array)
    directory_offset = data.index(b"PK\x01\x02")
    assert refused_as_overlap(path) == (
        f"{path}: not a valid zip/npz file (member 'b' runs into the central directory "
        f"at byte {directory_offset}: a possible zip bomb)"
    )


def test_a_member_that_is_not_asked_for_is_checked_too(tmp_path) -> None:
    path, _, _ = archive_running_into_its_directory(tmp_path)
    with pytest.raises(SourceError, match=r"member 'b' runs into the central directory"):
        scan_source(str(path), ["a"])


def unseekable_zip(arrays: dict[str, np.ndarray], compress: int) -> bytes:
    """Written as to a pipe: zipfile then follows each member with a data descriptor (flag bit 3)."""

    class Unseekable(io.RawIOBase):
        def __init__(self) -> None:
            self.buffer = bytearray()

        def writable(self) -> bool:
            return True

        def write(self, data) -> int:  # type: ignore[no-untyped-def, override]
            self.buffer += data
            return len(data)

    sink = Unseekable()
    with zipfile.ZipFile(sink, "w", compression=compress) as zf:
        for key, array in arrays.items():
            zf.writestr(key + ".npy", npy_bytes(array))
    return bytes(sink.buffer)


@pytest.mark.parametrize("compress", [zipfile.ZIP_STORED, zipfile.ZIP_DEFLATED])
def test_gaps_between_members_are_accepted(tmp_path, compress) -> None:
    """Data descriptors after each member's data leave gaps, no overlap."""
    arrays = {"x": np.arange(50, dtype=np.float32), "y": np.arange(7, dtype=np.uint8)}
    data = unseekable_zip(arrays, compress)
    with zipfile.ZipFile(io.BytesIO(data)) as zf:
        assert all(info.flag_bits & 0x8 for info in zf.infolist())
    path = tmp_path / "gaps.npz"
    path.write_bytes(data)
    headers, _ = scan_source(str(path))
    assert {key: (h.dtype, h.shape) for key, h in headers.items()} == {
        key: (array.dtype, array.shape) for key, array in arrays.items()
    }


def test_numpys_own_archives_never_overlap(run_size) -> None:
    @sized(run_size, 60, 1500)
    @given(data=numpy_archives())
    def check(data: bytes) -> None:
        with tempfile.TemporaryDirectory() as directory:
            path = Path(directory) / "a.npz"
            path.write_bytes(data)
            with np.load(path) as npz:
                if not npz.files:  # an NPZ of no arrays is a bad file, as --skip-bad leaves out
                    with pytest.raises(SourceError, match="holds no arrays$"):
                        scan_source(str(path))
                    return
                headers, _ = scan_source(str(path))
                assert {key: (h.dtype, h.shape) for key, h in headers.items()} == {
                    key: (npz[key].dtype, npz[key].shape) for key in npz.files
                }

    check()


def test_an_overlapping_archive_stays_refused_when_asked_again(tmp_path) -> None:
    """verify asks an open source for its keys, then its headers: each must meet the refusal."""
    path, _, _ = archive_running_into_its_directory(tmp_path)
    with open_source(str(path)) as source:
        for ask in (source.keys, lambda: source.header("a")):
            with pytest.raises(SourceError, match=r"member 'b' runs into the central directory"):
                ask()


def test_numpys_archives_are_checked_for_overlap_without_a_sort(tmp_path, monkeypatch) -> None:
    """numpy writes members in offset order: one pass over them, no sorted copy of the spans."""
    path = tmp_path / "a.npz"
    np.savez(path, a=np.arange(3), b=np.ones(4), c=np.zeros(2))

    def no_sort(*args: object, **kwargs: object) -> list[object]:
        raise AssertionError("the spans were sorted")

    monkeypatch.setattr(npzfile, "sorted", no_sort, raising=False)
    headers, _ = scan_source(str(path))
    assert sorted(headers) == ["a", "b", "c"]


def with_directory_reversed(data: bytes) -> bytes:
    """``data`` with its central directory's entries in reverse order (offsets unchanged)."""
    start, end = data.index(b"PK\x01\x02"), data.rindex(b"PK\x05\x06")
    entries, position = [], start
    while position < end:
        lengths = struct.unpack_from("<3H", data, position + 28)
        entries.append(data[position : position + 46 + sum(lengths)])
        position += len(entries[-1])
    return data[:start] + b"".join(reversed(entries)) + data[end:]


def test_members_listed_out_of_offset_order_are_checked_for_overlap_too(tmp_path) -> None:
    arrays = {"a": np.arange(5), "b": np.arange(7.0), "c": np.ones(2, np.int8)}
    data = with_directory_reversed(stored_zip({f"{k}.npy": npy_bytes(v) for k, v in arrays.items()}))
    path = tmp_path / "reversed.npz"
    path.write_bytes(data)
    headers, _ = scan_source(str(path))  # no overlap: accepted
    with np.load(path) as npz:
        assert npz.files == ["c", "b", "a"]
        assert {k: (h.dtype, h.shape) for k, h in headers.items()} == {
            k: (npz[k].dtype, npz[k].shape) for k in npz.files
        }
    b_start = data.index(b"PK\x03\x04", 1)
    path.write_bytes(patch_central_entry(data, "a.npy", header_offset=b_start))
    message = refused_as_overlap(path)
    assert re.fullmatch(
        rf"{re.escape(str(path))}: not a valid zip/npz file \(members '[ab]' and '[ab]' overlap, "
        rf"bytes {b_start} to \d+: a possible zip bomb\)",
        message,
    ), message


# --- bounded work on hostile directories ----------------------------------------------------------


def zip64_end(count: int, dir_nbytes: int, dir_offset: int) -> bytes:
    """A ZIP64 end record, its locator and a plain end record that defers to it."""
    record = ZIP64_END.pack(b"PK\x06\x06", 44, 45, 45, 0, 0, count, count, dir_nbytes, dir_offset)
    locator = ZIP64_LOCATOR.pack(b"PK\x06\x07", 0, dir_offset + dir_nbytes, 1)
    return record + locator + END.pack(b"PK\x05\x06", 0, 0, 0xFFFF, 0xFFFF, 0xFFFFFFFF, 0xFFFFFFFF, 0)


@contextmanager
def reads_at_most(nbytes: int) -> Iterator[list[int]]:
    """Fail any read of more than ``nbytes`` at once, before it allocates; yields the sizes read."""
    sizes: list[int] = []
    real_read_at = fsutil.read_at

    def bounded_read_at(fd: int, count: int, offset: int) -> bytes:
        sizes.append(count)
        assert count <= nbytes, f"a read of {count} bytes"
        return real_read_at(fd, count, offset)

    with mock.patch.object(fsutil, "read_at", bounded_read_at):
        yield sizes


def scan_refusal(path: Path) -> str:
    with pytest.raises(SourceError) as caught:
        scan_source(str(path))
    message = str(caught.value)
    assert message.startswith(f"{path}: ") and "\n" not in message
    return message


@pytest.mark.parametrize("file_nbytes", [int(2.95e9), int(2.5e9), int(1.5e9)])
def test_a_sparse_file_whose_directory_claims_the_whole_file_is_refused_without_reading_it(
    tmp_path, file_nbytes
) -> None:
    """One entry cannot fill gigabytes: refused by the claim, not by a read (or allocation) of it."""
    path = tmp_path / "sparse.npz"
    end = zip64_end(1, file_nbytes - 98, 0)
    with open(path, "wb") as f:
        f.truncate(file_nbytes - len(end))
        f.seek(file_nbytes - len(end))
        f.write(end)
    with reads_at_most(zip_directory.DIRECTORY_WINDOW_NBYTES):
        message = scan_refusal(path)
    assert message == (
        f"{path}: not a valid zip/npz file (a central directory of {file_nbytes - 98} bytes "
        "is larger than 1 entries can be)"
    )


def test_a_large_directory_not_starting_with_an_entry_is_refused_before_it_is_read(tmp_path) -> None:
    count = 10_000
    dir_nbytes = count * zip_directory.MAX_CENTRAL_ENTRY_NBYTES  # as large as 10,000 entries can be: 1.97 GB
    path = tmp_path / "sparse.npz"
    with open(path, "wb") as f:
        f.truncate(dir_nbytes)
        f.seek(dir_nbytes)
        f.write(zip64_end(count, dir_nbytes, 0))
    with reads_at_most(zip_directory.TAIL_NBYTES) as sizes:
        message = scan_refusal(path)
    assert message == f"{path}: not a valid zip/npz file (Bad magic number for central directory)"
    assert sum(sizes) <= zip_directory.TAIL_NBYTES + zip_directory.MIN_READ_NBYTES


def test_a_directory_larger_than_a_window_is_read_in_windows_as_zipfile_reads_it(tmp_path) -> None:
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w") as zf:
        for i in range(2000):
            zf.writestr(f"{i:04d}" + "n" * 700, b"")  # a directory of 1.5 MB
    data = buffer.getvalue()
    assert len(data) - data.index(b"PK\x01\x02") > 1.4 * zip_directory.DIRECTORY_WINDOW_NBYTES
    with reads_at_most(zip_directory.DIRECTORY_WINDOW_NBYTES):
        assert ours(data) == oracle(data)


def tiny_entries(count: int) -> bytes:
    """A directory of ``count`` entries with empty names and no data (no member), and its end records."""
    directory = CENTRAL.pack(b"PK\x01\x02", 20, 3, 20, 0, *[0] * 14) * count
    return directory + zip64_end(count, len(directory), 0)


def refusal_and_peak_memory(path: Path) -> tuple[str, int]:
    """The scan's refusal of ``path`` and the most memory Python held while it ran."""
    tracemalloc.start()
    try:
        message = scan_refusal(path)
        return message, tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


def test_more_entries_than_an_npz_file_may_have_are_refused_before_any_is_read(tmp_path) -> None:
    path = tmp_path / "many.npz"
    path.write_bytes(tiny_entries(zip_directory.MAX_ENTRIES + 1))
    message, peak = refusal_and_peak_memory(path)
    assert message == f"{path}: holds 65,536 zip entries, more than the 65,535 an NPZ file may have"
    assert peak < 1 << 20


def test_an_empty_key_stops_the_directory_at_its_entry(tmp_path) -> None:
    path = tmp_path / "empty-names.npz"
    path.write_bytes(tiny_entries(60_000))
    message, peak = refusal_and_peak_memory(path)
    assert message == f"{path}: field name '' is empty"
    assert peak < 3 << 20  # a window of the directory, not 60,000 entries


def test_more_entries_than_recorded_are_refused_at_the_first_extra_one() -> None:
    data = with_zip64_fields(
        with_zip64_end(stored_zip({"a.npy": b"1", "b.npy": b"2"})), count_here=1, count=1
    )
    assert assert_refused_in_one_line(data) == (
        "a.npz: not a valid zip/npz file (the central directory holds more than the 1 entries recorded)"
    )


def test_the_cli_refuses_a_hostile_directory_in_one_line_and_converts_the_rest_with_skip_bad(
    tmp_path,
) -> None:
    sources = tmp_path / "src"
    sources.mkdir()
    np.savez(sources / "a.npz", x=np.arange(3))
    (sources / "b.npz").write_bytes(tiny_entries(zip_directory.MAX_ENTRIES + 1))
    out = tmp_path / "out"
    for options in ([], ["--skip-bad"]):
        result = CliRunner().invoke(
            cli, ["convert", str(sources), "-o", str(out), "--workers", "2", *options]
        )
        if options:
            assert result.exit_code == 0, result.output
        else:
            assert result.exit_code == 1 and result.output.count("\n") == 1, result.output
            assert result.output.startswith(f"Error: {sources / 'b.npz'}: holds 65,536 zip entries")
            assert not out.exists()


# --- directory entries ----------------------------------------------------------------------------


def test_a_directory_entry_holding_an_array_is_converted_as_numpy_reads_it(tmp_path) -> None:
    """np.load gives it the key 'd/'; only an empty directory entry is no member."""
    d_array = np.array([1.5, 2.5])
    data = stored_zip({"a.npy": npy_bytes(np.arange(6)), "d/": npy_bytes(d_array), "e/": b""})
    path = tmp_path / "src" / "dirs.npz"
    path.parent.mkdir()
    path.write_bytes(data)
    with np.load(path) as npz:
        assert np.array_equal(npz["d/"], d_array) and npz["e/"] == b""
    out = tmp_path / "out"
    result = CliRunner().invoke(cli, ["convert", str(path.parent), "-o", str(out), "--workers", "1"])
    assert result.exit_code == 0, result.output
    reader = DatasetReader(str(out))
    assert reader.view("d/", 0).tobytes() == d_array.tobytes()
    assert sorted(f.name for f in reader.index.fields) == ["a", "d/"]


@pytest.mark.parametrize(
    ("prefix", "message"),
    [
        (b"#!/bin/sh\nexit 0\n", "its zip does not start at its first byte, and np.load reads no such file as an NPZ"),
        (pickle.dumps({"a": 1}), "its zip does not start at its first byte, and np.load reads no such file as an NPZ"),
        (npy_bytes(np.arange(3)), "it starts as a .npy file does, and np.load reads it as one array"),
    ],
    ids=["stub", "pickle", "npy"],
)
def test_bytes_before_the_zip_are_refused_as_np_load_refuses_or_reads_them_otherwise(tmp_path, prefix, message) -> None:
    """zipfile reads a zip after a self-extracting stub; np.load, the oracle, does not."""
    path = tmp_path / "prefixed.npz"
    np.savez(path, x=np.arange(5))
    path.write_bytes(prefix + path.read_bytes())
    with pytest.raises(SourceError) as refused:
        scan_source(str(path))
    assert str(refused.value) == f"{path}: not a valid zip/npz file: {message}" + (
        "; rename it to .npy to convert that array" if message.startswith("it starts") else
        " (bytes before it, a pickle say, are not converted)"
    )
    if message.startswith("it starts"):
        assert np.load(path).tolist() == [0, 1, 2]
    else:
        with pytest.raises(ValueError, match="allow_pickle"):
            np.load(path)

