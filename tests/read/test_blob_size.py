"""A blob of the wrong size is named as such, at any size, by every reader and by verify."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
from click.testing import CliRunner
from conftest import GOLDEN_DIR
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from npz2mmap.check.verify import verify
from npz2mmap.cli.commands import cli
from npz2mmap.errors import FormatError
from npz2mmap.read.reader import DatasetReader

GOLDEN = GOLDEN_DIR / "v3"
HEADER_NBYTES = 128  # docs/FORMAT.md: the .npy header of data.npy is exactly 128 bytes


def expected_nbytes(dataset: Path) -> tuple[int, int]:
    """The size the index implies for data.npy, from index.json itself, and its payload_nbytes."""
    payload_nbytes = json.loads((dataset / "index.json").read_text())["payload_nbytes"]
    return HEADER_NBYTES + payload_nbytes, payload_nbytes


def resize(blob: Path, nbytes: int) -> bytes:
    """Truncate or extend (with zeros) ``blob`` in place to ``nbytes``; its bytes afterwards."""
    os.truncate(blob, nbytes)
    return blob.read_bytes()


def size_message(dataset: Path) -> str:
    """What a reader must say of ``dataset``'s blob, by its size on disk and its index alone."""
    blob = dataset / "data.npy"
    size = blob.stat().st_size
    expected, payload_nbytes = expected_nbytes(dataset)
    implied = f"the index expects {expected:,} ({HEADER_NBYTES} + payload_nbytes {payload_nbytes:,})"
    if size < expected:
        return f"{blob}: truncated: {size:,} bytes, but {implied}; convert its sources again"
    extra = size - expected
    return (
        f"{blob}: {extra:,} byte{'s' if extra > 1 else ''} too long: {size:,} bytes, but {implied}; "
        "convert its sources again"
    )


SIZES = {
    "empty": lambda expected: 0,
    "half the header": lambda expected: 64,
    "the header alone": lambda expected: HEADER_NBYTES,
    "one payload byte": lambda expected: HEADER_NBYTES + 1,
    "all but one identity byte": lambda expected: HEADER_NBYTES + 63,
    "the identity alone": lambda expected: HEADER_NBYTES + 64,
    "one byte short": lambda expected: expected - 1,
    "one byte more": lambda expected: expected + 1,
    "a page more": lambda expected: expected + 4096,
}


@pytest.mark.parametrize("case", SIZES)
def test_a_blob_of_the_wrong_size_is_named_with_both_sizes_by_the_reader_and_every_command(
    tmp_path, case
) -> None:
    dataset = tmp_path / "ds"
    shutil.copytree(GOLDEN, dataset)
    blob = dataset / "data.npy"
    left = resize(blob, SIZES[case](expected_nbytes(dataset)[0]))
    message = size_message(dataset)
    with pytest.raises(FormatError) as raised:
        DatasetReader(dataset)
    assert str(raised.value) == message
    assert verify(dataset).problems == [message]
    merged = tmp_path / "merged"
    for arguments in (
        ["inspect"],
        ["verify", "-q"],
        ["warm", "-q"],
        ["merge", "--copy", "-o", str(merged), "-q"],
    ):
        command = arguments[0]
        result = CliRunner().invoke(cli, [command, str(dataset), *arguments[1:]], catch_exceptions=False)
        assert result.exit_code == 1, (command, result.output)
        expected_output = f"Error: {message}\n"
        if command == "verify":
            expected_output = f"{message}\nError: {dataset}: 1 problem found\n"
        assert result.output == expected_output, command
    assert blob.read_bytes() == left  # readers never write to a blob
    assert sorted(p.name for p in dataset.iterdir()) == [
        "data.npy",
        "index.json",
        "skipped.jsonl",
        "sources.jsonl",
    ]
    assert not merged.exists()


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_any_wrong_size_is_reported_as_that_size_never_as_another_index(tmp_path, data) -> None:
    """Sizes below the header plus the identity, where the identity cannot be read, included."""
    dataset = tmp_path / "ds"
    shutil.rmtree(dataset, ignore_errors=True)
    shutil.copytree(GOLDEN, dataset)
    expected = expected_nbytes(dataset)[0]
    size = data.draw(st.integers(0, 2 * expected).filter(lambda n: n != expected), label="size")
    resize(dataset / "data.npy", size)
    with pytest.raises(FormatError) as raised:
        DatasetReader(dataset)
    assert str(raised.value) == size_message(dataset)
    assert verify(dataset).problems == [size_message(dataset)]
