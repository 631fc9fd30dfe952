""".npy headers longer than np.load's default 10,000 characters, with numpy's own material.

numpy's ``test_version_2_0`` saves a record of 500 fields (a 145,588-byte
header) and ``test_huge_header`` one of 10,001 (178,996 bytes); np.load reads
them only when ``max_header_size`` allows. npz2mmap refuses them by default
with a message naming the length and the way out (``max_header_size=`` in
Python, ``--max-header-size`` on the command line), accepts them when the
option allows, and reads them back exactly; the option has a hard upper bound.
"""

from __future__ import annotations

import io
import warnings
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner
from conftest import SKIP_BAD_HINT
from hostile import npy_with_header
from hypothesis import given, settings
from hypothesis import strategies as st

from npz2mmap.check.verify import verify
from npz2mmap.cli.commands import cli
from npz2mmap.errors import SourceError
from npz2mmap.ingest.npy_header import MAX_HEADER_SIZE_LIMIT, HeaderLimit, parse_npy_header
from npz2mmap.read.reader import DatasetReader
from npz2mmap.write import blob_writer
from npz2mmap.write.conversion import convert
from npz2mmap.write.writer import Writer

VERSION_2_HEADER_NBYTES = 145_588  # numpy's test_version_2_0 header
HUGE_HEADER_NBYTES = 178_996  # numpy's test_huge_header header


def version_2_0_array() -> np.ndarray:
    """The array of numpy's test_version_2_0, built as it builds it."""
    dt = [(f"{i}" * 100, float) for i in range(500)]  # numpy: ("%d" % i) * 100
    return np.ones(1000, dtype=dt)


def huge_header_array() -> np.ndarray:
    """The array of numpy's test_huge_header and test_huge_header_npz."""
    return np.array(1, dtype="i," * 10000 + "i")


def save(path: Path, array: np.ndarray) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # numpy: "Stored array in format 2.0"
        if path.suffix == ".npy":
            with open(path, "wb") as f:
                np.lib.format.write_array(f, array, version=(2, 0))
        else:
            np.savez(path, arr=array)
    return path


def numpy_load(path: Path, max_header_size: int) -> np.ndarray:
    loaded = np.load(path, max_header_size=max_header_size)
    if path.suffix == ".npy":
        return loaded
    with loaded:
        return loaded["arr"]


def key_of(path: Path) -> str:
    return "arr_0" if path.suffix == ".npy" else "arr"


def where(path: Path) -> str:
    return str(path) if path.suffix == ".npy" else f"{path}[arr]"


def cli_run(*args: object) -> tuple[int, str]:
    result = CliRunner().invoke(cli, [str(a) for a in args])
    return result.exit_code, result.output


def assert_reads_back_exactly(out: Path, source: np.ndarray, key: str) -> None:
    view = DatasetReader(out).view(key, 0)
    assert view.dtype == source.dtype.newbyteorder("<") and view.shape == source.shape
    assert view.tobytes() == np.ascontiguousarray(source).tobytes()


@pytest.mark.parametrize("name", ["s.npy", "s.npz"])
def test_numpys_500_field_record_is_refused_by_default_naming_the_keyword(tmp_path, name) -> None:
    path = save(tmp_path / "src" / name, version_2_0_array())
    with pytest.raises(SourceError) as raised:
        convert([path], tmp_path / "out", workers=1)
    assert str(raised.value) == (
        f"{where(path)}: .npy header of 145,588 bytes exceeds the limit of 10,000 (np.load's default); "
        "pass max_header_size=145588 if you trust this file" + SKIP_BAD_HINT
    )
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("name", ["s.npy", "s.npz"])
def test_numpys_500_field_record_is_refused_on_the_command_line_naming_the_option(tmp_path, name) -> None:
    path = save(tmp_path / "src" / name, version_2_0_array())
    code, output = cli_run("convert", "-q", "--workers", "1", path, "-o", tmp_path / "out")
    assert (code, output) == (
        1,
        f"Error: {where(path)}: .npy header of 145,588 bytes exceeds the limit of 10,000 (np.load's default); "
        f"pass --max-header-size 145588 if you trust this file{SKIP_BAD_HINT}\n",
    )
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("name", ["s.npy", "s.npz"])
def test_numpys_500_field_record_converts_with_the_option_and_reads_back_exactly(tmp_path, name) -> None:
    path = save(tmp_path / "src" / name, version_2_0_array())
    out = tmp_path / "out"
    convert([path], out, workers=1, max_header_size=VERSION_2_HEADER_NBYTES)
    assert_reads_back_exactly(out, numpy_load(path, 200_000), key_of(path))
    assert verify(out, sources=True, max_header_size=VERSION_2_HEADER_NBYTES).ok
    assert verify(out, sources=True).problems == [
        f"sample 0 ({path}): {where(path)}: .npy header of 145,588 bytes exceeds the limit of 10,000 "
        "(np.load's default); pass max_header_size=145588 if you trust this file"
    ]
    code, output = cli_run("verify", "-q", "--sources", "--max-header-size", VERSION_2_HEADER_NBYTES, out)
    assert (code, output) == (0, "")
    code, output = cli_run("verify", "-q", "--sources", out)
    assert code == 1 and "pass --max-header-size 145588 if you trust this file" in output


def test_one_character_short_of_the_header_is_refused_naming_the_limit_given(tmp_path) -> None:
    path = save(tmp_path / "src" / "s.npz", version_2_0_array())
    with pytest.raises(SourceError) as raised:
        convert([path], tmp_path / "out", workers=1, max_header_size=VERSION_2_HEADER_NBYTES - 1)
    assert str(raised.value) == (
        f"{path}[arr]: .npy header of 145,588 bytes exceeds the limit of 145,587; "
        "pass max_header_size=145588 if you trust this file" + SKIP_BAD_HINT
    )


@pytest.mark.parametrize("name", ["s.npy", "s.npz"])
def test_numpys_huge_header_is_refused_and_accepted_where_np_load_refuses_and_accepts_it(
    tmp_path, name
) -> None:
    """test_huge_header: refused by default and with 20,000; read with 180,000."""
    path = save(tmp_path / "src" / name, huge_header_array())
    for limit in (None, 20_000):
        with pytest.raises(
            SourceError, match=f"header of 178,996 bytes .* pass max_header_size={HUGE_HEADER_NBYTES} "
        ):
            convert([path], tmp_path / "out", workers=1, max_header_size=limit)
        with pytest.raises(ValueError, match="Header.*large"):
            numpy_load(path, limit or 10_000)
    code, _ = cli_run(
        "convert", "-q", "--max-header-size", 180_000, "--workers", "1", path, "-o", tmp_path / "out"
    )
    assert code == 0
    assert_reads_back_exactly(tmp_path / "out", numpy_load(path, 180_000), key_of(path))


def test_a_record_of_thousands_of_fields_from_a_writer_opens(tmp_path) -> None:
    """A Writer reads no header; what it stores must still fit the index readers accept."""
    array = huge_header_array()
    with Writer(tmp_path / "out") as w:
        w.append({"x": array})
    assert_reads_back_exactly(tmp_path / "out", array, "x")


def test_an_index_too_large_to_open_is_refused_before_the_copy(tmp_path, monkeypatch) -> None:
    """Many keys of records of thousands of fields describe themselves in index.json; readers
    accept at most MAX_INDEX_NBYTES of it (lowered here, so that a small dataset reaches it)."""
    monkeypatch.setattr(blob_writer, "MAX_INDEX_NBYTES", 150_000)
    path = save(tmp_path / "src" / "s.npz", version_2_0_array())
    with pytest.raises(SourceError) as raised:
        convert([path], tmp_path / "out", workers=1, max_header_size=VERSION_2_HEADER_NBYTES)
    message = str(raised.value)
    assert message.startswith(f"{tmp_path / 'out'}: index.json would be ")
    assert message.endswith(
        "bytes, more than the 150,000 a reader accepts (the dtype of field 'arr' alone takes 145,500); "
        "convert fewer keys"
    )
    assert not (tmp_path / "out").exists()
    with pytest.raises(SourceError, match="more than the 150,000 a reader accepts"):
        with Writer(tmp_path / "out") as w:
            w.append({"arr": version_2_0_array()[:1]})
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("bad", [0, MAX_HEADER_SIZE_LIMIT + 1])
def test_the_limit_has_a_hard_upper_bound(tmp_path, bad) -> None:
    path = save(tmp_path / "src" / "s.npz", np.arange(3))
    with pytest.raises(
        ValueError, match=f"max_header_size must be from 1 to 1,000,000 characters, found {bad:,}"
    ):
        convert([path], tmp_path / "out", max_header_size=bad)
    code, output = cli_run("convert", "--max-header-size", bad, path, "-o", tmp_path / "out")
    assert code == 2 and "Invalid value for '--max-header-size'" in output
    assert not (tmp_path / "out").exists()


def test_a_header_over_the_hard_bound_says_no_option_reads_it(tmp_path) -> None:
    path = tmp_path / "s.npy"
    path.write_bytes(npy_with_header(" " * MAX_HEADER_SIZE_LIMIT, version=(2, 0)))
    with pytest.raises(SourceError) as raised:
        convert([path], tmp_path / "out", workers=1, max_header_size=MAX_HEADER_SIZE_LIMIT)
    assert str(raised.value) == (
        f"{path}: .npy header of 1,000,001 bytes exceeds the limit of 1,000,000; "
        "npz2mmap reads no header over 1,000,000 characters" + SKIP_BAD_HINT
    )


def header_chars(raw: bytes, version: tuple[int, int]) -> int:
    """The length of a .npy header's text in characters, as np.load measures it."""
    start = 10 if version == (1, 0) else 12
    nbytes = int.from_bytes(raw[8:start], "little")
    return len(raw[start : start + nbytes].decode("utf-8" if version == (3, 0) else "latin1"))


@settings(max_examples=60, deadline=None)
@given(
    num_fields=st.integers(1, 300),
    name_chars=st.integers(1, 40),
    version=st.sampled_from([(1, 0), (2, 0), (3, 0)]),
    slack=st.integers(-40, 40),
)
def test_a_header_is_read_exactly_when_np_load_reads_it_with_that_max_header_size(
    num_fields: int, name_chars: int, version: tuple[int, int], slack: int
) -> None:
    """The oracle is np.load's own max_header_size, near the header's length on either side."""
    dtype = np.dtype([(f"{i:0{name_chars}d}\u00e9", "<f4") for i in range(num_fields)])
    buffer = io.BytesIO()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        try:
            np.lib.format.write_array(buffer, np.zeros(2, dtype), version=version)
        except ValueError:  # a header too long for version 1.0
            return
    raw = buffer.getvalue()
    limit = max(1, header_chars(raw, version) + slack)
    try:
        expected = np.load(io.BytesIO(raw), max_header_size=limit)
    except ValueError:
        expected = None
    try:
        ours = parse_npy_header(io.BytesIO(raw), "x", "test", HeaderLimit(limit))
    except SourceError as exc:
        assert expected is None, exc
        assert "exceeds the limit" in str(exc)
        return
    assert expected is not None and (ours.dtype, ours.shape) == (expected.dtype, expected.shape)


def test_a_long_utf8_header_is_measured_in_characters_as_np_load_measures_it(tmp_path) -> None:
    """1,500,001 bytes of a version 3.0 header may be 500,001 characters, which the hard bound allows."""
    path = tmp_path / "s.npy"
    path.write_bytes(npy_with_header("\u20ac" * 500_000, version=(3, 0)))
    with pytest.raises(SourceError) as raised:
        convert([path], tmp_path / "out", workers=1)
    assert str(raised.value) == (
        f"{path}: .npy header of 1,500,001 bytes exceeds the limit of 10,000 (np.load's default); "
        "pass max_header_size=1000000 if you trust this file" + SKIP_BAD_HINT
    )
    with pytest.raises(SourceError) as raised:
        convert([path], tmp_path / "out", workers=1, max_header_size=MAX_HEADER_SIZE_LIMIT)
    assert str(raised.value) == f"{path}: .npy header is not a valid Python literal{SKIP_BAD_HINT}"


def test_a_numpy_integer_is_taken_as_the_limit_it_is(tmp_path) -> None:
    """max_header_size=np.int64(500) was refused as 'not an integer'."""
    np.savez(tmp_path / "a.npz", x=np.zeros(3))
    convert([tmp_path / "a.npz"], tmp_path / "out", max_header_size=np.int64(500), workers=1)
    with pytest.raises(TypeError, match="^max_header_size must be an integer, not bool$"):
        convert([tmp_path / "a.npz"], tmp_path / "other", max_header_size=True)
