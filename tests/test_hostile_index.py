"""Forged indexes: numbers too large for numpy, deep dtypes, subarrays.

Each dataset is forged as a forger would make it (the blob identity names the
edited index), so the edit reaches validation. Every reader, ``verify``,
``inspect`` and ``merge --copy`` must answer with a one-line FormatError,
never another exception, never an output.
"""

from __future__ import annotations

import json
import re
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from click.testing import CliRunner
from conftest import rewrite_index, write_npz

from npz2mmap import MmapDataset
from npz2mmap.cli import cli
from npz2mmap.converter import convert
from npz2mmap.errors import FormatError, SourceError
from npz2mmap.reader import DatasetReader
from npz2mmap.spec import MAX_DTYPE_DEPTH, MAX_NBYTES, MAX_NDIM, parse_index
from npz2mmap.verify import verify

GOLDEN = Path(__file__).parent / "data" / "golden"
GOLDEN_TEXT = (GOLDEN / "v2" / "index.json").read_text()


def run(*args: object):
    return CliRunner().invoke(cli, [str(a) for a in args])


def golden_copy(tmp_path: Path) -> Path:
    dataset = tmp_path / "ds"
    shutil.copytree(GOLDEN / "v2", dataset)
    return dataset


def field(document: dict, name: str) -> dict:
    return next(f for f in document["fields"] if f["name"] == name)


def nested_records(depth: int, leaf: str) -> str:
    """The JSON text of a record dtype ``depth`` levels deep around ``leaf`` (too deep for json.dumps)."""
    return '[["a", ' * depth + json.dumps(leaf) + "]]" * depth


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
    "a 5000-digit integer": (
        GOLDEN_TEXT.replace('"num_samples": 3', '"num_samples": ' + "9" * 5000).encode(),
        "holds an integer of 5000 digits; no number in an index has more than 19",
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
        "holds an integer of 20 digits; no number in an index has more than 19",
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
