"""The conversion's fast paths give exactly what the general paths give, and refuse what they refuse.

Header texts numpy writes skip the Python parser; the copy pass reads each
member through the location the scan recorded, with no zip parsing, and must
still find a corrupt member, a source changed since the scan, and write the
same bytes without pread/pwrite.
"""

from __future__ import annotations

import ast
import io
import os
import struct
import zipfile
import zlib
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from conftest import COPY_PASS_HINT, SKIP_BAD_HINT, write_samples
from hypothesis import given
from hypothesis import strategies as st

from npz2mmap import fsutil, pagecache
from npz2mmap.errors import SourceError
from npz2mmap.format.index import BLOB_HEADER_NBYTES
from npz2mmap.ingest import npy_header
from npz2mmap.ingest import npz as npzfile
from npz2mmap.progress import SilentProgress
from npz2mmap.read.reader import DatasetReader
from npz2mmap.write.conversion import convert

SHAPES = st.lists(st.integers(0, 10**19 - 1), max_size=4).map(tuple)  # longer numbers: the parser
DESCRS = st.sampled_from(["<f8", ">i4", "|u1", "|S10", "<U3", "<M8[ns]", "|b1", ">c16", "|V7", "<m8[s]"])


def header_text(descr: str, fortran: bool, shape: tuple[int, ...]) -> str:
    """A header as numpy writes it (format._wrap_header: padded with spaces, ending in a newline)."""
    text = repr({"descr": descr, "fortran_order": fortran, "shape": shape})[:-1] + ", }"
    return text + " " * (63 - (len(text) + 10) % 64) + "\n"


@given(DESCRS, st.booleans(), SHAPES)
def test_numpy_header_texts_skip_the_parser_and_read_as_the_parser_reads_them(descr, fortran, shape) -> None:
    text = header_text(descr, fortran, shape)
    assert npy_header._canonical_header(text) == ast.literal_eval(text)


def test_headers_numpy_saves_take_the_fast_path() -> None:
    for array in [np.zeros(()), np.zeros((3, 64, 64), ">f4"), np.zeros((2, 3), order="F"), np.zeros(0, "S5")]:
        stream = io.BytesIO()
        np.save(stream, array)
        raw = stream.getvalue()
        text = raw[10 : 10 + int.from_bytes(raw[8:10], "little")].decode("latin1")
        assert npy_header._canonical_header(text) == ast.literal_eval(text)


@given(DESCRS, st.booleans(), SHAPES, st.data())
def test_any_other_text_is_left_to_the_parser(descr, fortran, shape, data) -> None:
    """A text the fast path reads differently from the parser (or one it refuses) is never taken."""
    text = header_text(descr, fortran, shape)
    position = data.draw(st.integers(0, len(text)))
    edit = data.draw(st.sampled_from(["0", " ", ",", "'", "L", "\\", "\t", "#", "(", "1", "\x00", "é"]))
    edited = text[:position] + edit + text[position + data.draw(st.integers(0, 1)) :]
    fast = npy_header._canonical_header(edited)
    if fast is not None:
        assert fast == ast.literal_eval(edited)


# --- the copy reads members where the scan found them, and checks them -------------------------


class _EditBeforeCopy(SilentProgress):
    """Runs ``edit`` once the scan is done, as a user changing a source meanwhile could."""

    def __init__(self, edit: Callable[[], object]) -> None:
        self.edit = edit

    def stage(self, name: str, total_files: int, total_nbytes: int, unit: str = "files") -> None:
        if name == "copy":
            self.edit()


def flip_last_byte(path: Path) -> None:
    """Change the last byte of the file's first member's data: the zip directory stays as it was."""
    data = bytearray(path.read_bytes())
    with zipfile.ZipFile(path) as zf:
        info = zf.infolist()[0]
    name_and_extra = int.from_bytes(data[info.header_offset + 26 : info.header_offset + 28], "little")
    name_and_extra += int.from_bytes(data[info.header_offset + 28 : info.header_offset + 30], "little")
    end = info.header_offset + 30 + name_and_extra + info.compress_size
    data[end - 1] ^= 0xFF
    path.write_bytes(bytes(data))


def converted(tmp_path: Path, sources: Path, edit: Callable[[], object], **options: Any) -> str:
    """The error of a conversion whose sources are edited between scan and copy; nothing left behind."""
    with pytest.raises(SourceError) as caught:
        convert([sources], tmp_path / "out", workers=1, progress=_EditBeforeCopy(edit), **options)
    assert not (tmp_path / "out").exists()
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []
    message = str(caught.value)
    assert message.endswith(COPY_PASS_HINT), message  # the ways past it
    return message.removesuffix(COPY_PASS_HINT)


@pytest.mark.parametrize("compressed", [False, True])
def test_a_member_corrupted_after_the_scan_is_found_by_its_crc(tmp_path, compressed) -> None:
    paths = write_samples(tmp_path / "src", [{"x": np.arange(1000.0) + i} for i in range(3)], compressed)
    message = converted(tmp_path, tmp_path / "src", lambda: flip_last_byte(paths[1]))
    if compressed:  # a changed deflate stream fails to inflate, or inflates to other bytes
        assert message.startswith(f"{paths[1]}[x]: ") and "\n" not in message
    else:
        assert (
            message
            == f"{paths[1]}[x]: Bad CRC-32 for file 'x.npy' (corrupt, or changed since it was scanned)"
        )


def test_a_source_saved_again_with_another_shape_of_the_same_size_is_refused(tmp_path) -> None:
    """Same file size, a valid zip: the header the copy reads is not the one planned."""
    paths = write_samples(tmp_path / "src", [{"x": np.arange(6.0).reshape(2, 3)} for _ in range(2)])
    same_size = lambda: np.savez(paths[1], x=np.arange(6.0).reshape(3, 2))  # noqa: E731
    assert converted(tmp_path, tmp_path / "src", same_size) == f"{paths[1]}[x]: changed since it was scanned"


def test_a_source_saved_again_with_other_values_is_refused_by_the_crc_the_scan_read(tmp_path) -> None:
    """Same size, same header, a valid zip with its own right CRC: only the CRC the scan read tells."""
    paths = write_samples(tmp_path / "src", [{"x": np.arange(6.0)} for _ in range(2)])
    other_values = lambda: np.savez(paths[1], x=np.arange(6.0) + 1)  # noqa: E731
    assert converted(tmp_path, tmp_path / "src", other_values) == (
        f"{paths[1]}[x]: Bad CRC-32 for file 'x.npy' (corrupt, or changed since it was scanned)"
    )


def test_a_source_that_grew_or_shrank_after_the_scan_is_refused(tmp_path) -> None:
    paths = write_samples(tmp_path / "src", [{"x": np.arange(10.0)} for _ in range(2)])
    before = paths[1].stat().st_size
    longer = lambda: np.savez(paths[1], x=np.arange(11.0))  # noqa: E731
    after = before + 8
    assert converted(tmp_path, tmp_path / "src", longer) == (
        f"{paths[1]}[x]: changed since it was scanned (the file held {before} bytes, now {after})"
    )


@pytest.mark.parametrize("sample_dirs", [False, True])
def test_a_npy_source_given_another_header_after_the_scan_is_refused(tmp_path, sample_dirs) -> None:
    """A .npy file has no CRC: the header read by the copy must still be the one planned."""
    target = tmp_path / "src" / "s1" / "x.npy"
    for path in (tmp_path / "src" / "s0" / "x.npy", target):
        path.parent.mkdir(parents=True)
        np.save(path, np.arange(6.0).reshape(2, 3))
    message = converted(
        tmp_path,
        tmp_path / "src",
        lambda: np.save(target, np.arange(6.0).reshape(3, 2)),
        sample_dirs=sample_dirs,
    )
    assert message == f"{target}: changed since it was scanned (another .npy header)"


def test_a_field_of_a_sample_dir_removed_after_the_scan_is_named(tmp_path) -> None:
    for i in range(2):
        (tmp_path / "src" / f"s{i}").mkdir(parents=True)
        for key in ("x", "y"):
            np.save(tmp_path / "src" / f"s{i}" / f"{key}.npy", np.arange(3.0))
    gone = tmp_path / "src" / "s1"
    message = converted(tmp_path, tmp_path / "src", (gone / "y.npy").unlink, sample_dirs=True)
    assert message == f"{gone}[y]: key vanished since the file was scanned"


def test_a_source_replaced_by_another_kind_after_the_scan_is_refused(tmp_path) -> None:
    """An NPZ file replaced by a directory holding its bytes as x.npy (the same size, offsets and CRC
    would fit a sample directory's file), and a sample directory replaced by an NPZ file."""
    import os
    import shutil

    paths = write_samples(tmp_path / "src", [{"x": np.arange(6.0) + i} for i in range(2)])

    def npz_to_directory() -> None:
        os.rename(paths[1], tmp_path / "x.npy")
        paths[1].mkdir()
        os.rename(tmp_path / "x.npy", paths[1] / "x.npy")

    message = converted(tmp_path, tmp_path / "src", npz_to_directory)
    assert (
        message
        == f"{paths[1]}: changed since it was scanned (an NPZ file then, a directory of .npy files now)"
    )

    dirs = tmp_path / "dirs"
    for i in range(2):
        (dirs / f"s{i}").mkdir(parents=True)
        np.save(dirs / f"s{i}" / "x.npy", np.arange(6.0))

    def directory_to_file() -> None:
        shutil.rmtree(dirs / "s1")
        (dirs / "s1").write_bytes((dirs / "s0" / "x.npy").read_bytes())

    message = converted(tmp_path, dirs, directory_to_file, sample_dirs=True)
    assert message == (
        f"{dirs / 's1'}: changed since it was scanned (a directory of .npy files then, an NPZ file now)"
    )


@pytest.mark.parametrize("sample_dirs", [False, True])
@pytest.mark.parametrize(
    "rewritten",
    [np.arange(6, dtype=">i4").reshape(2, 3), np.asfortranarray(np.arange(6, dtype="<i4").reshape(2, 3))],
    ids=["byte-order", "fortran-order"],
)
def test_a_npy_header_rewritten_within_the_plan_is_refused(tmp_path, sample_dirs, rewritten) -> None:
    """The same size, shape and stored dtype, another header: a .npy file has no checksum, so the
    scan keeps its header's CRC-32 for the copy to compare."""
    target = tmp_path / "src" / "s1" / "x.npy"
    for path in (tmp_path / "src" / "s0" / "x.npy", target):
        path.parent.mkdir(parents=True)
        np.save(path, np.arange(6, dtype="<i4").reshape(2, 3))
    before = target.stat().st_size
    message = converted(
        tmp_path, tmp_path / "src", lambda: np.save(target, rewritten), sample_dirs=sample_dirs
    )
    assert target.stat().st_size == before
    assert message == f"{target}: changed since it was scanned (another .npy header)"


def test_a_npy_file_given_other_values_of_its_header_converts_as_it_reads_at_the_copy(tmp_path) -> None:
    """No checksum covers a .npy file's data: a same-size rewrite under the same header is copied
    exactly as it reads when copied (what the README promises), and verify --sources agrees."""
    from npz2mmap.check.verify import verify

    target = tmp_path / "src" / "b.npy"
    target.parent.mkdir()
    np.save(tmp_path / "src" / "a.npy", np.arange(6, dtype="<i4"))
    np.save(target, np.arange(6, dtype="<i4"))
    edit = lambda: np.save(target, np.arange(6, dtype="<i4") * 7)  # noqa: E731
    convert([tmp_path / "src"], tmp_path / "out", workers=1, progress=_EditBeforeCopy(edit))
    assert DatasetReader(tmp_path / "out").view("arr_0", 1).tolist() == (np.arange(6) * 7).tolist()
    assert verify(tmp_path / "out", sources=True).ok


@pytest.mark.parametrize("workers", [1, 2])
def test_skip_bad_leaves_out_files_changed_after_the_scan_and_keeps_the_rest_exact(tmp_path, workers) -> None:
    samples = [{"x": np.arange(300.0) + i, "n": np.arange(i % 7)} for i in range(40)]
    paths = write_samples(tmp_path / "src", samples)

    def edit() -> None:
        flip_last_byte(paths[3])
        np.savez(paths[20], x=np.arange(301.0), n=np.arange(6))

    result = convert(
        [tmp_path / "src"], tmp_path / "out", workers=workers, skip_bad=True, progress=_EditBeforeCopy(edit)
    )
    assert [path for path, _ in result.skipped] == [str(paths[3]), str(paths[20])]
    reader = DatasetReader(tmp_path / "out")
    kept = [s for k, s in enumerate(samples) if k not in (3, 20)]
    assert len(reader) == len(kept)
    for i, sample in enumerate(kept):
        for key, array in sample.items():
            assert reader.view(key, i).tobytes() == array.tobytes()


@pytest.mark.parametrize("workers", [1, 2])
def test_fixed_holds_the_shape_of_the_first_file_converted_when_the_first_scanned_is_found_bad_at_the_copy(
    tmp_path, workers
) -> None:
    """--fixed x took its shape from f0, which the copy then found corrupt (a CRC) and left out:
    f1..f4 were left out for differing from f0, and only the odd f5 was kept, with exit 0."""
    samples = [{"x": np.arange(3.0)}] + [{"x": np.arange(4.0) + i} for i in range(1, 5)] + [{"x": np.arange(3.0)}]
    paths = write_samples(tmp_path / "src", samples)
    truncated = dict(enumerate(samples))
    result = convert(
        [tmp_path / "src"], tmp_path / "out", workers=workers, skip_bad=True, fixed=["x"],
        progress=_EditBeforeCopy(lambda: flip_last_byte(paths[0])),
    )  # fmt: skip
    assert [path for path, _ in result.skipped] == [str(paths[0]), str(paths[5])]
    assert "Bad CRC-32" in result.skipped[0][1]
    assert result.skipped[1][1].startswith(f"{paths[5]}[x]: shape (3,) differs from (4,) in {paths[1]}")
    reader = DatasetReader(tmp_path / "out")
    assert [reader.view("x", i).tobytes() for i in range(len(reader))] == [
        truncated[k]["x"].tobytes() for k in (1, 2, 3, 4)
    ]
    assert reader.index.field("x").shape == (4,)


@pytest.mark.parametrize("num_parts", [2, 3, 4])
def test_parts_held_to_fixed_shapes_pass_over_an_earlier_file_only_the_copy_finds_bad(tmp_path, num_parts) -> None:
    """The parts after a first file whose CRC fails took its shape, which one conversion drops:
    merged, they kept one odd file of six good ones, and blamed the good ones."""
    from npz2mmap.write.merge import merge

    shapes = [3, 5, 4, 4, 4, 4, 3, 4]
    paths = write_samples(tmp_path / "src", [{"x": np.arange(float(n)) + k} for k, n in enumerate(shapes)])
    for bad in paths[:2]:
        flip_last_byte(bad)  # found only by the copy, which reads the members' bytes
    convert([tmp_path / "src"], tmp_path / "one", workers=1, skip_bad=True, fixed=["x"])
    for i in range(num_parts):
        convert([tmp_path / "src"], tmp_path / "p", workers=1, skip_bad=True, fixed=["x"], part=(i, num_parts))
    merge(sorted((tmp_path / "p").glob("part-*")), tmp_path / "merged", copy=True)
    for name in ("data.npy", "index.json", "sources.jsonl", "skipped.jsonl"):
        assert (tmp_path / "merged" / name).read_bytes() == (tmp_path / "one" / name).read_bytes(), name
    assert len(DatasetReader(tmp_path / "one")) == 5


@pytest.mark.parametrize("num_parts", [2, 4])
def test_parts_held_to_fixed_shapes_check_only_the_members_the_keys_take(tmp_path, num_parts) -> None:
    """An earlier file was passed over for a CRC error in a member --keys leaves out, which one
    conversion never reads: merged, the parts kept six samples where it kept two, x ragged."""
    from npz2mmap.write.merge import merge

    shapes = [3, 4, 4, 4, 4, 3, 4]
    samples = [{"y": np.arange(50.0), "x": np.arange(float(n))} for n in shapes]
    paths = write_samples(tmp_path / "src", samples)
    flip_last_byte(paths[0])  # its y, the first member: never read with --keys x
    options: dict[str, Any] = {"workers": 1, "skip_bad": True, "fixed": ["x"], "keys": ["x"]}
    convert([tmp_path / "src"], tmp_path / "one", **options)
    for i in range(num_parts):
        convert([tmp_path / "src"], tmp_path / "p", part=(i, num_parts), **options)
    merge(sorted((tmp_path / "p").glob("part-*")), tmp_path / "merged", copy=True)
    for name in ("data.npy", "index.json", "sources.jsonl", "skipped.jsonl"):
        assert (tmp_path / "merged" / name).read_bytes() == (tmp_path / "one" / name).read_bytes(), name
    assert len(DatasetReader(tmp_path / "one")) == 2


def test_a_member_whose_local_header_names_another_file_is_refused_as_zipfile_refuses_it(tmp_path) -> None:
    """The scan reads a stored member's .npy header without zipfile, but keeps zipfile's name check."""
    path = write_samples(tmp_path / "src", [{"x": np.arange(3.0)}])[0]
    data = path.read_bytes()
    start = data.index(b"PK\x03\x04") + 30
    assert data[start : start + 5] == b"x.npy"
    path.write_bytes(data[:start] + b"y" + data[start + 1 :])
    with zipfile.ZipFile(path) as zf, pytest.raises(zipfile.BadZipFile) as expected:
        zf.open("x.npy")
    with pytest.raises(SourceError) as caught:
        convert([path], tmp_path / "out", workers=1)
    assert str(caught.value) == f"{path}[x]: not a valid zip/npz file ({expected.value}){SKIP_BAD_HINT}"
    assert "File name in directory 'x.npy' and header b'y.npy' differ." in str(caught.value)


def test_a_batch_of_small_files_is_written_with_one_write_per_field(tmp_path, monkeypatch) -> None:
    """Samples of consecutive files lie back to back in each field: a batch gathers them into one write."""
    samples = [{"x": np.arange(i % 5 + 1, dtype=np.int32), "y": np.float64(i)} for i in range(60)]
    write_samples(tmp_path / "src", samples)
    writes: list[tuple[int, int]] = []
    real_write = fsutil.write_all_at

    def counted(fd: int, data: Any, offset: int) -> None:
        writes.append((offset, len(memoryview(data))))
        real_write(fd, data, offset)

    monkeypatch.setattr(fsutil, "write_all_at", counted)
    result = convert([tmp_path / "src"], tmp_path / "out", workers=1)
    regions = [(BLOB_HEADER_NBYTES + f.data.offset, f.data.nbytes) for f in result.index.fields]
    data_writes = [(o, n) for o, n in writes if any(start <= o < start + size for start, size in regions)]
    assert sorted(data_writes) == sorted(regions)
    reader = DatasetReader(tmp_path / "out")
    assert [reader.view("x", i).tobytes() for i in range(60)] == [s["x"].tobytes() for s in samples]


def test_every_byte_the_copy_writes_is_handed_to_writeback_at_once_without_waiting(
    tmp_path, monkeypatch
) -> None:
    """So the disk works during the copy and the final fsync finds little left: each write of the
    blob's data is followed by sync_file_range(WRITE) of exactly its bytes, which starts writeback
    and does not wait for it."""
    samples = [
        {"x": np.arange(i % 5 + 1, dtype=np.int32), "big": np.full(300_000 * (i == 3), i)} for i in range(40)
    ]
    write_samples(tmp_path / "src", samples)
    calls: list[tuple[str, int, int]] = []
    real_write = fsutil.write_all_at

    def write(fd: int, data: Any, offset: int) -> None:
        calls.append(("write", offset, len(memoryview(data))))
        real_write(fd, data, offset)

    def sync_file_range(fd: int, offset: int, nbytes: int, flags: int) -> int:
        assert flags == 2  # SYNC_FILE_RANGE_WRITE alone: start writeback, never wait
        calls.append(("writeback", offset, nbytes))
        return 0

    monkeypatch.setattr(fsutil, "write_all_at", write)
    monkeypatch.setattr(fsutil, "sync_file_range", sync_file_range)
    result = convert([tmp_path / "src"], tmp_path / "out", workers=1)
    starts = {BLOB_HEADER_NBYTES + f.data.offset: f.data.nbytes for f in result.index.fields}
    data_calls = [c for c in calls if any(s <= c[1] < s + n for s, n in starts.items())]
    writes = data_calls[0::2]
    assert data_calls[1::2] == [("writeback", offset, nbytes) for _, offset, nbytes in writes]
    assert {kind for kind, _, _ in writes} == {"write"}
    assert sum(nbytes for _, _, nbytes in writes) == sum(starts.values())
    assert any(nbytes > 1 << 20 for _, _, nbytes in writes)  # a member written on its own, not gathered


@pytest.mark.parametrize("workers", [1, 2])
def test_a_failing_sync_file_range_changes_nothing(tmp_path, monkeypatch, workers) -> None:
    samples = [{"x": np.arange(i % 5 + 1, dtype=np.int32), "y": np.float64(i)} for i in range(30)]
    write_samples(tmp_path / "src", samples)
    convert([tmp_path / "src"], tmp_path / "plain", workers=workers)
    monkeypatch.setattr(fsutil, "sync_file_range", lambda fd, offset, nbytes, flags: -1)
    convert([tmp_path / "src"], tmp_path / "failing", workers=workers)
    for name in ("data.npy", "index.json", "sources.jsonl"):
        assert (tmp_path / "failing" / name).read_bytes() == (tmp_path / "plain" / name).read_bytes()


@pytest.mark.parametrize("piece_nbytes", [None, 16], ids=["default-pieces", "16-byte-pieces"])
@pytest.mark.parametrize("num_names", [1, 20, 100, 300])  # headers of 128 bytes to 6.6 KB
def test_long_headers_of_deflated_members_are_inflated_piece_by_piece_and_read_exactly(
    tmp_path, monkeypatch, num_names, piece_nbytes
) -> None:
    """The scan inflates a deflated member's start a little at a time, only as far as its header;
    a header longer than one piece (or than one piece of stored bytes) still reads whole."""
    if piece_nbytes is not None:
        monkeypatch.setattr(npzfile, "HEADER_PIECE_NBYTES", piece_nbytes)
        monkeypatch.setattr(npzfile, "HEADER_INFLATE_NBYTES", piece_nbytes)
    dtype = np.dtype([(f"field_{k}", "<f4") for k in range(num_names)])
    rng = np.random.default_rng(num_names)
    values = [rng.random((i + 1, num_names), dtype=np.float32).view(dtype)[:, 0] for i in range(3)]
    (tmp_path / "src").mkdir()
    for i, value in enumerate(values):
        np.savez_compressed(tmp_path / "src" / f"{i}.npz", x=value)
    result = convert([tmp_path / "src"], tmp_path / "out", workers=1)
    assert result.index.num_samples == 3
    reader = DatasetReader(tmp_path / "out")
    for i in range(3):
        with np.load(tmp_path / "src" / f"{i}.npz") as npz:
            expected = npz["x"]
        assert reader.view("x", i).tobytes() == expected.tobytes()
        assert reader.view("x", i).dtype == expected.dtype


def _evict(paths: list[Path]) -> None:
    """Drop the files' pages from the page cache (they must be written back first)."""
    for path in paths:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def _resident_nbytes(path: Path) -> int | None:
    """Bytes of the file in the page cache, by mincore (independent of read_ahead's probe)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        return pagecache.resident_nbytes(fd, os.fstat(fd).st_size)
    finally:
        os.close(fd)


def _small_files(directory: Path, count: int) -> list[Path]:
    directory.mkdir()
    paths = [directory / f"{k:02d}.bin" for k in range(count)]
    for k, path in enumerate(paths):
        path.write_bytes(bytes([k]) * (5000 + k))
    return paths


@pytest.mark.skipif(not hasattr(os, "RWF_NOWAIT"), reason="needs a page cache that can be probed (Linux)")
def test_uncached_files_are_read_ahead_in_order_each_once_and_cached_ones_are_not(
    tmp_path, monkeypatch
) -> None:
    paths = _small_files(tmp_path / "files", 10)
    events: list[tuple[str, str]] = []
    real_advise = fsutil.posix_fadvise

    def advise(fd: int, offset: int, nbytes: int, advice: int) -> None:
        assert (offset, nbytes, advice) == (0, os.fstat(fd).st_size, os.POSIX_FADV_WILLNEED)
        events.append(("advise", os.readlink(f"/proc/self/fd/{fd}")))
        real_advise(fd, offset, nbytes, advice)

    monkeypatch.setattr(fsutil, "posix_fadvise", advise)
    names = [str(p) for p in paths]
    expected: list[tuple[str, str]] = []
    for k, name in enumerate(names):
        expected += [("advise", n) for n in names[k + 2 if k else 0 : k + 3]]
        expected.append(("read", name))
    # The probe's read that never waits still starts the kernel's own read of the page it
    # misses; a disk quick enough to finish it before the probe looks makes the file cached
    # (then nothing is advised, rightly). That race is retried, never the order asserted.
    for _ in range(20):  # a busy machine loses the race more often
        _evict(paths)
        if any(_resident_nbytes(path) for path in paths):
            pytest.skip("this file system keeps the files' pages cached (tmpfs?)")
        events.clear()
        for path in pagecache.read_ahead(names, ahead_files=3):
            events.append(("read", path))
        if any(kind == "advise" for kind, _ in events):
            break
    assert events == expected

    for path in paths:
        path.read_bytes()
    events.clear()
    assert list(pagecache.read_ahead(names, ahead_files=3)) == names
    assert events == []  # cached: no advice at all


@pytest.mark.skipif(not os.path.isdir("/proc/self/fd"), reason="names descriptors through /proc (Linux)")
def test_read_ahead_opens_only_regular_files_of_at_most_max_nbytes(tmp_path, monkeypatch) -> None:
    (tmp_path / "small").write_bytes(b"x" * 100)
    (tmp_path / "large").write_bytes(b"x" * 5000)
    (tmp_path / "empty").write_bytes(b"")
    (tmp_path / "dir").mkdir()
    os.mkfifo(tmp_path / "fifo")
    names = [str(tmp_path / n) for n in ("fifo", "small", "dir", "missing", "large", "empty")]
    opened: list[str] = []
    advised: list[str] = []
    real_open = os.open
    monkeypatch.setattr(fsutil.os, "open", lambda path, *a: opened.append(path) or real_open(path, *a))
    monkeypatch.setattr(
        fsutil, "posix_fadvise", lambda fd, *a: advised.append(os.readlink(f"/proc/self/fd/{fd}"))
    )
    monkeypatch.setattr(pagecache, "_is_cached", lambda path: False)
    monkeypatch.setattr(pagecache, "READ_AHEAD_MAX_FILE_NBYTES", 1000)
    assert list(pagecache.read_ahead(names, ahead_files=2)) == names  # no hang on the FIFO
    assert opened == advised == [str(tmp_path / "small")]


@pytest.mark.skipif(not os.path.isdir("/proc/self/fd"), reason="names descriptors through /proc (Linux)")
def test_read_ahead_asks_for_at_most_ahead_nbytes_beyond_the_file_being_read(tmp_path, monkeypatch) -> None:
    paths = [str(p) for p in _small_files(tmp_path / "files", 12)]  # 5,000 to 5,011 bytes each
    events: list[tuple[str, str]] = []
    monkeypatch.setattr(
        fsutil, "posix_fadvise", lambda fd, *a: events.append(("advise", os.readlink(f"/proc/self/fd/{fd}")))
    )
    monkeypatch.setattr(pagecache, "_is_cached", lambda path: False)
    for path in pagecache.read_ahead(paths, ahead_files=100, ahead_nbytes=12_000):
        events.append(("read", path))
    expected: list[tuple[str, str]] = []
    for k, path in enumerate(paths):  # three files ahead at first, then one more as each is read
        expected += [("advise", p) for p in paths[k + 2 if k else 0 : k + 3]]
        expected.append(("read", path))
    assert events == expected
    events.clear()
    for path in pagecache.read_ahead(paths, ahead_files=100, ahead_nbytes=1):
        events.append(("read", path))
    assert events == [e for path in paths for e in (("advise", path), ("read", path))]  # one at a time


def test_without_posix_fadvise_read_ahead_only_yields_the_paths(tmp_path, monkeypatch) -> None:
    paths = [str(p) for p in _small_files(tmp_path / "files", 4)]
    monkeypatch.setattr(fsutil, "posix_fadvise", None)
    monkeypatch.setattr(fsutil, "open_regular_sized", lambda path: pytest.fail("opened"))
    assert list(pagecache.read_ahead(paths)) == paths


@pytest.mark.skipif(not hasattr(os, "RWF_NOWAIT"), reason="needs a page cache that can be probed (Linux)")
def test_without_a_probe_of_the_page_cache_files_count_as_uncached(tmp_path, monkeypatch) -> None:
    paths = _small_files(tmp_path / "files", 4)
    for path in paths:
        path.read_bytes()
    names = [str(p) for p in paths]
    assert pagecache._is_cached(names[-1])
    monkeypatch.setattr(fsutil, "preadv", None)
    assert not pagecache._is_cached(names[-1])


@pytest.mark.parametrize("workers", [1, 2])
def test_a_conversion_read_ahead_writes_the_same_bytes(tmp_path, monkeypatch, workers) -> None:
    samples = [{"x": np.arange(i % 7 + 1, dtype=np.int32), "y": np.float64(i)} for i in range(80)]
    write_samples(tmp_path / "src", samples)
    convert([tmp_path / "src"], tmp_path / "plain", workers=workers)
    advised: list[int] = []
    real_advise = fsutil.posix_fadvise
    monkeypatch.setattr(fsutil, "posix_fadvise", lambda *a: advised.append(1) or real_advise(*a))
    monkeypatch.setattr(pagecache, "_is_cached", lambda path: False)
    convert([tmp_path / "src"], tmp_path / "ahead", workers=workers)
    if workers == 1:
        assert len(advised) == 2 * 80  # every file, in the scan and again in the copy
    for name in ("data.npy", "index.json", "sources.jsonl"):
        assert (tmp_path / "ahead" / name).read_bytes() == (tmp_path / "plain" / name).read_bytes()


def test_a_deflated_member_smaller_by_its_zip_size_than_its_header_ends_early_as_np_load_finds(
    tmp_path,
) -> None:
    """The header is read no further than the size the zip gives the member, as zipfile stops there,
    even when the deflate stream holds more."""
    buffer = io.BytesIO()
    np.save(buffer, np.zeros(3, dtype=[("x" * 300, "<i4")]))
    raw = buffer.getvalue()
    deflater = zlib.compressobj(6, zlib.DEFLATED, -15)
    stream = deflater.compress(raw) + deflater.flush()
    size, name, crc = 64, b"a.npy", zlib.crc32(raw[:64])
    local = struct.pack("<IHHHHHIIIHH", 0x04034B50, 20, 0, 8, 0, 0x21, crc, len(stream), size, len(name), 0)
    central = struct.pack(
        "<IHHHHHHIIIHHHHHII",
        0x02014B50,
        20,
        20,
        0,
        8,
        0,
        0x21,
        crc,
        len(stream),
        size,
        len(name),
        0,
        0,
        0,
        0,
        0,
        0,
    )
    end = struct.pack(
        "<IHHHHIIH", 0x06054B50, 0, 0, 1, 1, len(central) + len(name), len(local + name + stream), 0
    )
    path = tmp_path / "short.npz"
    path.write_bytes(local + name + stream + central + name + end)
    header_nbytes = 10 + int.from_bytes(raw[8:10], "little")
    with (
        pytest.raises(ValueError, match=f"expected {header_nbytes - 10} bytes got {size - 10}"),
        np.load(path) as npz,
    ):
        npz["a"]
    with pytest.raises(SourceError) as caught:
        convert([path], tmp_path / "out", workers=1)
    assert str(caught.value) == f"{path}[a]: ends early ({size - 10} of {header_nbytes - 10} bytes){SKIP_BAD_HINT}"
    assert not (tmp_path / "out").exists()
