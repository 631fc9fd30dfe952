"""Forged indexes and tables: numbers too large for numpy, deep dtypes, subarrays.

Each dataset is forged as a forger would make it (the blob identity names the
edited index, table checksums match the edited tables), so the edit reaches
validation. Every reader, ``verify``, ``inspect`` and ``merge --copy`` must
answer with a one-line FormatError, never another exception, never an output.
"""

from __future__ import annotations

import json
import re
import shutil
import zlib
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from click.testing import CliRunner
from conftest import GOLDEN_DIR, raises_from_dataloader, rewrite_blob, rewrite_index, write_npz

from npz2mmap import MmapDataset
from npz2mmap.check.verify import verify
from npz2mmap.cli.commands import cli
from npz2mmap.errors import FormatError, SourceError
from npz2mmap.format.dtypes import MAX_DTYPE_DEPTH
from npz2mmap.format.index import MAX_NBYTES, MAX_NDIM, parse_index
from npz2mmap.read.reader import DatasetReader
from npz2mmap.write.conversion import convert

GOLDEN = GOLDEN_DIR
GOLDEN_TEXT = (GOLDEN / "v3" / "index.json").read_text()
POINTS_OFFSETS_OFFSET = 448  # the golden 'points' offsets table: 0, 0, 8, 24 as <i8
POINTS_SHAPES_OFFSET = 512  # the golden 'points' shapes table: rows (0, 2), (1, 2), (2, 2) of <i8


def run(*args: object):
    return CliRunner().invoke(cli, [str(a) for a in args])


def golden_copy(tmp_path: Path) -> Path:
    dataset = tmp_path / "ds"
    shutil.copytree(GOLDEN / "v3", dataset)
    return dataset


def field(document: dict, name: str) -> dict:
    return next(f for f in document["fields"] if f["name"] == name)


def nested_records(depth: int, leaf: str) -> str:
    """The JSON text of a record dtype ``depth`` levels deep around ``leaf`` (too deep for json.dumps)."""
    return '[["a", ' * depth + json.dumps(leaf) + "]]" * depth


def nested_subarrays(depth: int, leaf: str) -> str:
    """The JSON text of a record whose member is a subarray of a subarray ... ``depth`` levels deep."""
    return '[["a", ' + "[" * depth + json.dumps(leaf) + ", [1]]" * depth + "]]"


def with_label_dtype(descr_text: str) -> bytes:
    """The golden index with the <i8 'label' field's dtype replaced by raw JSON text."""
    assert GOLDEN_TEXT.count('"dtype": "<i8"') == 1
    return GOLDEN_TEXT.replace('"dtype": "<i8"', f'"dtype": {descr_text}').encode()


def set_field(name: str, **values: Any) -> Callable[[dict], None]:
    return lambda document: field(document, name).update(values)


FORGED_INDEXES: dict[str, tuple[Callable[[dict], Any] | bytes, str]] = {
    "records nested 33 deep": (
        with_label_dtype(nested_records(33, "<i8")),
        "fields[1] ('label'): dtype nests records more than 32 levels deep",
    ),
    "records nested 450 deep": (
        with_label_dtype(nested_records(450, "<i8")),
        "fields[1] ('label'): dtype nests records more than 32 levels deep",
    ),
    "subarrays nested 64 deep in a record": (
        with_label_dtype(nested_subarrays(64, "<i8")),
        "fields[1] ('label'): dtype nests records and subarrays more than 64 levels deep",
    ),
    "subarrays nested 450 deep in a record": (
        with_label_dtype(nested_subarrays(450, "<i8")),
        "fields[1] ('label'): dtype nests records and subarrays more than 64 levels deep",
    ),
    "a 5000-digit integer": (
        GOLDEN_TEXT.replace('"num_samples": 3', '"num_samples": ' + "9" * 5000).encode(),
        "holds an integer of 5000 digits; no number npz2mmap reads has more than 19",
    ),
    "a subarray dtype": (
        set_field("image", dtype="(3,)|u1", ndim=1, shape=[2]),
        "fields[0] ('image'): dtype '(3,)|u1' is a subarray dtype; a field's shape belongs in 'shape'",
    ),
    "64 dimensions per sample": (
        set_field("label", ndim=MAX_NDIM, shape=[1] * MAX_NDIM),
        f"fields[1] ('label'): ndim {MAX_NDIM} leaves no room for the sample axis "
        f"(numpy allows {MAX_NDIM} dimensions)",
    ),
    "a column of 3 x 2**62 x 0": (
        lambda d: field(d, "image").update(shape=[2**62, 0], data={"offset": 64, "nbytes": 0}),
        f"fields[0] ('image'): all samples: shape (3, {2**62}, 0) of 1-byte items is too large for numpy",
    ),
    "num_samples 2**64": (
        lambda d: d.update(num_samples=2**64),
        "holds an integer of 20 digits; no number npz2mmap reads has more than 19",
    ),
    "num_samples 2**63": (
        lambda d: d.update(num_samples=2**63),
        f"num_samples must be at most {MAX_NBYTES}, found {2**63}",
    ),
    "payload_nbytes 2**63": (
        lambda d: d.update(payload_nbytes=2**63),
        f"payload_nbytes must be at most {MAX_NBYTES - 128}, found {2**63}",
    ),
    "a region offset of 2**63": (
        lambda d: field(d, "label")["data"].update(offset=2**63),
        f"fields[1] ('label'): data: offset must be at most {MAX_NBYTES - 128}, found {2**63}",
    ),
}


@pytest.mark.parametrize("case", FORGED_INDEXES, ids=list(FORGED_INDEXES))
def test_a_forged_index_is_a_one_line_format_error_everywhere(tmp_path, case) -> None:
    edit, message = FORGED_INDEXES[case]
    dataset = golden_copy(tmp_path)
    rewrite_index(dataset, edit)
    pattern = re.escape(message)
    with pytest.raises(FormatError, match=pattern):
        DatasetReader(dataset)
    with pytest.raises(FormatError, match=pattern):
        MmapDataset(dataset)
    problems = verify(dataset).problems
    assert len(problems) == 1 and message in problems[0], problems
    for command in (
        ["inspect", dataset],
        ["verify", dataset],
        ["merge", dataset, "-o", tmp_path / "m", "--copy"],
    ):
        result = run(*command)
        assert result.exit_code == 1, (command, result.output)
        assert isinstance(result.exception, SystemExit)
        assert message in result.output and "Traceback" not in result.output
    assert not (tmp_path / "m").exists()


def test_an_index_document_with_numbers_or_nesting_beyond_any_limit_is_a_format_error() -> None:
    """parse_index takes decoded documents too: a huge int or a deep list must not escape as ValueError."""
    document = json.loads(GOLDEN_TEXT)
    document["num_samples"] = 10**5000
    with pytest.raises(FormatError, match=r"num_samples must be at most \d+, found a 16610-bit integer"):
        parse_index(document, "test")
    document = json.loads(GOLDEN_TEXT)
    deep: Any = "<i8"
    for _ in range(5000):
        deep = [["a", deep]]
    field(document, "label")["dtype"] = deep
    with pytest.raises(FormatError, match="dtype nests records more than 32 levels deep"):
        parse_index(document, "test")


def forge_points_shapes(dataset: Path, rows: list[list[int]]) -> None:
    """Write rows into the 'points' shapes table and record the table's new checksum, as a forger can."""
    table = np.array(rows, dtype="<i8").tobytes()
    rewrite_blob(dataset, POINTS_SHAPES_OFFSET, table)
    rewrite_index(dataset, lambda d: field(d, "points")["shapes"].update(crc32=zlib.crc32(table)))


HUGE_ROWS = {
    # Sample 0 is (0, 2) and 0 bytes long: rows of 0 elements, for numpy too large.
    "(0, 2**62)": ([[0, 2**62], [1, 2], [2, 2]], f"(0, {2**62})"),
    # The product wraps to 0 in int64 arithmetic.
    "(2**32, 2**32)": ([[2**32, 2**32], [1, 2], [2, 2]], f"({2**32}, {2**32})"),
    # inspect's length histogram spanned -2**63..2: an int64 overflow.
    "(-2**63, 0)": ([[-(2**63), 0], [1, 2], [2, 2]], f"({-(2**63)}, 0)"),
}


@pytest.mark.parametrize("case", HUGE_ROWS, ids=list(HUGE_ROWS))
def test_a_shapes_row_too_large_for_numpy_is_named_by_readers_verify_and_merge(tmp_path, case) -> None:
    rows, shown = HUGE_ROWS[case]
    dataset = golden_copy(tmp_path)
    forge_points_shapes(dataset, rows)
    reader = DatasetReader(dataset)  # opening reads no table
    with pytest.raises(
        FormatError, match=re.escape("field 'points' sample 0: tables are corrupt (bytes 0..0")
    ):
        reader.view("points", 0)
    with np.load(GOLDEN / "src" / "1.npz") as source:
        assert reader.view("points", 1).tobytes() == source["points"].astype("<f4").tobytes()
    dataset_reader = MmapDataset(dataset)
    with pytest.raises(FormatError, match="field 'points' sample 0: tables are corrupt"):
        dataset_reader[0]
    with pytest.raises(FormatError, match=re.escape(f"field 'points': sample 0 has shape {shown}")):
        dataset_reader.lengths("points")
    assert verify(dataset).problems == [
        f"field 'points': sample 0 has shape {shown}, which no numpy array of 4-byte items can have"
    ]
    for command in (["merge", dataset, "-o", tmp_path / "merged", "--copy"], ["inspect", dataset]):
        result = run(*command)
        assert result.exit_code == 1, (command, result.output)
        assert result.output == (
            f"Error: {dataset}: field 'points': sample 0 has shape {shown}, which no numpy array of "
            "4-byte items can have; run npz2mmap verify\n"
        )
    assert not (tmp_path / "merged").exists()


def test_offsets_whose_int64_differences_wrap_are_reported_not_raised(tmp_path) -> None:
    """Offsets 0, 2**63 - 4, -8, 24 differ by 2**63 - 4, 2**63 - 4 (wrapped) and 32, all matching the shapes."""
    dataset = golden_copy(tmp_path)
    offsets = np.array([0, 2**63 - 4, -8, 24], dtype="<i8").tobytes()
    rewrite_blob(dataset, POINTS_OFFSETS_OFFSET, offsets)
    rewrite_index(dataset, lambda d: field(d, "points")["offsets"].update(crc32=zlib.crc32(offsets)))
    forge_points_shapes(dataset, [[2**61 - 1, 1], [2**61 - 1, 1], [4, 2]])
    assert verify(dataset).problems == ["field 'points': offsets decrease at sample 1"]
    with pytest.raises(FormatError, match="field 'points' sample 1: tables are corrupt"):
        DatasetReader(dataset).view("points", 1)


@pytest.mark.parametrize(
    ("field_name", "table", "payload_offset"),
    [("points", "shapes", POINTS_SHAPES_OFFSET), ("label", "sample_crc32", 320)],
)
def test_merge_copy_refuses_a_part_whose_table_checksum_fails(
    tmp_path, field_name, table, payload_offset
) -> None:
    """Before, merge --copy built a dataset from the corrupt table, under a fresh checksum, and exited 0."""
    dataset = golden_copy(tmp_path)
    rewrite_blob(dataset, payload_offset, np.array([5, 2], dtype="<i8").tobytes())
    result = run("merge", dataset, "-o", tmp_path / "merged", "--copy")
    assert result.exit_code == 1
    assert result.output == (
        f"Error: {dataset}: field {field_name!r}: the {table} table is corrupt (checksum mismatch); "
        "run npz2mmap verify\n"
    )
    assert not (tmp_path / "merged").exists()
    assert verify(dataset).problems == [
        f"field {field_name!r}: the {table} table is corrupt (checksum mismatch)"
    ]


def test_merge_copy_refuses_a_part_whose_offsets_and_shapes_disagree(tmp_path) -> None:
    dataset = golden_copy(tmp_path)
    forge_points_shapes(dataset, [[0, 2], [2, 2], [1, 2]])  # rows 1 and 2 swapped: 16 and 8 bytes
    result = run("merge", dataset, "-o", tmp_path / "merged", "--copy")
    assert result.exit_code == 1
    assert result.output == (
        f"Error: {dataset}: field 'points': shape x itemsize differs from the byte count at sample 1 "
        "(shape (2, 2) of 4-byte items, 8 bytes); run npz2mmap verify\n"
    )
    assert not (tmp_path / "merged").exists()


def test_a_data_file_that_is_a_directory_is_a_format_error(tmp_path) -> None:
    dataset = golden_copy(tmp_path)
    (dataset / "data.npy").unlink()
    (dataset / "data.npy").mkdir()
    with pytest.raises(FormatError, match="data.npy: a directory, not a regular file"):
        DatasetReader(dataset)
    assert "a directory, not a regular file" in verify(dataset).problems[0]
    assert run("inspect", dataset).exit_code == 1


def nested_dtype(depth: int) -> np.dtype:
    dtype = np.dtype("<i8")
    for _ in range(depth):
        dtype = np.dtype([("a", dtype)])
    return dtype


def nested_subarray_record(levels: int) -> np.dtype:
    """A record whose one member is a subarray of a subarray ... nesting ``levels`` levels in all."""
    member = np.dtype("<i8")
    for _ in range(levels - 1):
        member = np.dtype((member, (1,)))
    return np.dtype([("a", member)])


def test_subarrays_nested_to_the_limit_convert_and_read_back_and_deeper_are_refused(tmp_path) -> None:
    """numpy keeps a subarray of a subarray unflattened inside a record; each level counts."""
    limit = 2 * MAX_DTYPE_DEPTH
    write_npz(tmp_path / "ok" / "a.npz", x=np.zeros(2, nested_subarray_record(limit)))
    convert([tmp_path / "ok"], tmp_path / "ok-out", workers=1)
    stored = DatasetReader(tmp_path / "ok-out").view("x", 0)
    assert stored.dtype == nested_subarray_record(limit) and stored.tobytes() == bytes(16)
    source = write_npz(tmp_path / "deep" / "a.npz", x=np.zeros(2, nested_subarray_record(limit + 1)))
    with pytest.raises(SourceError) as raised:
        convert([tmp_path / "deep"], tmp_path / "deep-out", workers=1)
    assert str(raised.value) == (
        f"{source}[x]: dtype nests records and subarrays more than {limit} levels deep, more than a dataset may hold"
    )
    assert not (tmp_path / "deep-out").exists()


def test_records_nested_to_the_limit_convert_and_read_back_and_deeper_are_refused(tmp_path) -> None:
    """The converter refuses what readers would refuse, naming the file and key."""
    write_npz(tmp_path / "ok" / "a.npz", x=np.arange(3).view(nested_dtype(MAX_DTYPE_DEPTH)))
    convert([tmp_path / "ok"], tmp_path / "ok-out", workers=1)
    stored = DatasetReader(tmp_path / "ok-out").view("x", 0)
    assert stored.dtype == nested_dtype(MAX_DTYPE_DEPTH) and stored.tobytes() == np.arange(3).tobytes()
    source = write_npz(tmp_path / "deep" / "a.npz", x=np.arange(3).view(nested_dtype(MAX_DTYPE_DEPTH + 1)))
    with pytest.raises(SourceError) as raised:
        convert([tmp_path / "deep"], tmp_path / "deep-out", workers=1)
    assert str(raised.value) == (
        f"{source}[x]: dtype nests records more than {MAX_DTYPE_DEPTH} levels deep, more than a dataset may hold"
    )
    assert not (tmp_path / "deep-out").exists()


def test_a_shapes_row_too_large_for_numpy_is_a_format_error_in_dataloader_workers(tmp_path) -> None:
    from torch.utils.data import DataLoader

    dataset = golden_copy(tmp_path)
    forge_points_shapes(dataset, HUGE_ROWS["(0, 2**62)"][0])
    loader = DataLoader(MmapDataset(dataset, fields="points"), batch_size=None, num_workers=2)
    raises_from_dataloader(loader, FormatError, re.escape("field 'points' sample 0: tables are corrupt"))


@pytest.mark.parametrize(
    ("text", "message"),
    [
        (
            '{"format": "npz2mmap-parts", "version": ' + "9" * 5000 + ', "parts": ["a"]}',
            "holds an integer of 5000 digits",
        ),
        (
            '{"format": "npz2mmap-parts", "version": 1, "parts": ' + "[" * 5000 + "]" * 5000 + "}",
            "JSON nested too deeply",
        ),
    ],
    ids=["5000 digits", "nested 5000 deep"],
)
def test_a_manifest_with_a_huge_number_or_deep_nesting_is_a_format_error(tmp_path, text, message) -> None:
    (tmp_path / "manifest.json").write_text(text)
    with pytest.raises(FormatError, match=f"manifest.json: {message}"):
        MmapDataset(tmp_path)
    result = run("inspect", tmp_path)
    assert result.exit_code == 1 and result.output.count("\n") == 1, result.output


def test_a_sample_shape_the_index_does_not_record_is_named_by_readers_and_verify(tmp_path) -> None:
    """points is recorded [null, 2]: a row (4, 1) has the bytes of (2, 2), and only the recorded
    shape tells it is wrong; a padded batch would otherwise take it as 4 points of 1 coordinate."""
    dataset = golden_copy(tmp_path)
    forge_points_shapes(dataset, [[0, 2], [1, 2], [4, 1]])
    reader = DatasetReader(dataset)
    with pytest.raises(FormatError, match=re.escape("field 'points' sample 2: tables are corrupt (bytes 8..24")):
        reader.view("points", 2)
    with pytest.raises(FormatError, match="field 'points' sample 2: tables are corrupt"):
        reader.ragged_rows("points", [1, 2])
    assert reader.view("points", 1).tolist() == [[1.5, -2.0]]
    assert verify(dataset).problems == [
        "field 'points': shape records 2 in dimension 1 for every sample, but sample 2 has 1"
    ]


def test_a_recorded_null_where_every_sample_agrees_is_named_by_verify(tmp_path) -> None:
    dataset = golden_copy(tmp_path)
    rewrite_index(dataset, lambda d: field(d, "points").update(shape=[None, None]))
    assert DatasetReader(dataset).sample_shape("points") == (None, None)
    assert verify(dataset).problems == [
        "field 'points': shape records that samples differ in dimension 1, but every one has 2"
    ]
    with pytest.raises(FormatError, match=re.escape(  # it said the samples differ in dimensions 0, 1
        "field 'points': shape records that samples differ in dimension 1, but every one has 2; run npz2mmap verify"
    )):
        MmapDataset(dataset).lengths("points")
