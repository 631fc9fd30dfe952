"""verify: any flipped byte is caught and named; sources are compared bit for bit."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
from conftest import GOLDEN_DIR, write_npz

from npz2mmap.check.verify import verify
from npz2mmap.errors import FormatError
from npz2mmap.format.index import BLOB_HEADER_NBYTES
from npz2mmap.read.reader import DatasetReader

GOLDEN = GOLDEN_DIR / "v3"


def flip_byte(path: Path, file_offset: int) -> None:
    data = bytearray(path.read_bytes())
    data[file_offset] ^= 0x01
    path.write_bytes(bytes(data))


def data_file_offset(dataset: Path, field: str, sample: int) -> int:
    reader = DatasetReader(dataset)
    f = reader.index.field(field)
    within = sample * f.stride if not f.ragged else int(reader.table(field, "offsets")[sample])
    return BLOB_HEADER_NBYTES + f.data.offset + within


def test_a_sound_dataset_verifies_with_its_sources(small_dataset) -> None:
    out, _ = small_dataset
    report = verify(out, sources=True)
    assert report.ok, report.problems
    assert report.sources_checked and report.num_samples == 6


def test_a_flipped_sample_byte_names_the_field_and_sample(small_dataset) -> None:
    out, _ = small_dataset
    flip_byte(out / "data.npy", data_file_offset(out, "input", 4) + 7)
    flip_byte(out / "data.npy", data_file_offset(out, "tokens", 2))
    report = verify(out)
    assert report.bad_samples == {"input": [4], "tokens": [2]}
    assert "field 'input': 1 sample does not match its checksum: 4" in report.problems


def test_every_single_flipped_byte_of_the_blob_is_detected(tmp_path) -> None:
    size = (GOLDEN / "data.npy").stat().st_size
    for offset in range(size):
        dataset = tmp_path / f"flip{offset}"
        shutil.copytree(GOLDEN, dataset)
        flip_byte(dataset / "data.npy", offset)
        assert not verify(dataset).ok, f"flipping byte {offset} went unnoticed"
        shutil.rmtree(dataset)


def test_corrupt_tables_padding_and_size_are_reported(tmp_path) -> None:
    cases = {
        "table": (
            lambda d: flip_byte(d / "data.npy", BLOB_HEADER_NBYTES + 448 + 8),
            "the offsets table is corrupt",
        ),
        "padding": (
            lambda d: flip_byte(d / "data.npy", BLOB_HEADER_NBYTES + 100),
            "padding at blob offset 210..256 is not zero",
        ),
        "truncated": (
            lambda d: (d / "data.npy").write_bytes((d / "data.npy").read_bytes()[:-64]),
            "640 bytes, but the index expects 704",
        ),
        "extended": (
            lambda d: (d / "data.npy").write_bytes((d / "data.npy").read_bytes() + b"\0" * 64),
            "768 bytes, but the index expects 704",
        ),
    }
    for name, (damage, message) in cases.items():
        dataset = tmp_path / name
        shutil.copytree(GOLDEN, dataset)
        damage(dataset)
        report = verify(dataset)
        assert any(message in p for p in report.problems), (name, report.problems)


def test_an_edited_index_is_reported(tmp_path) -> None:
    dataset = tmp_path / "ds"
    shutil.copytree(GOLDEN, dataset)
    document = json.loads((dataset / "index.json").read_text())
    document["fields"][1]["sample_crc32"]["crc32"] += 1
    (dataset / "index.json").write_text(json.dumps(document))
    assert verify(dataset).problems == [
        f"{dataset / 'data.npy'}: does not belong to the index read (index.json was edited, or the dataset "
        "was replaced after it was opened); open it again, or run npz2mmap verify",
        "field 'label': the sample_crc32 table is corrupt (checksum mismatch)",
    ]


def test_sources_that_changed_since_conversion_are_named(small_dataset) -> None:
    out, sources = small_dataset
    with np.load(sources[3]) as npz:
        arrays = dict(npz)
    arrays["input"] = arrays["input"] + 1
    write_npz(sources[3], **arrays)
    sources[5].unlink()
    report = verify(out, sources=True)
    assert report.bad_samples == {"sources": [3, 5]}
    assert report.problems[0] == f"sample 3 ({sources[3]}): field 'input': values differ from the source"
    assert report.problems[1].startswith(f"sample 5 ({sources[5]}): {sources[5]}: No such file or directory")


INDEX_EDITS_OF_THE_SAME_SIZE = {
    "dtype": lambda d: d["fields"][1].update(dtype="<u8"),
    "shape": lambda d: d["fields"][0].update(shape=[3, 2]),
    "names swapped": lambda d: (d["fields"][0].update(name="label"), d["fields"][1].update(name="image")),
    "whitespace": None,
}


@pytest.mark.parametrize("edit", INDEX_EDITS_OF_THE_SAME_SIZE, ids=list(INDEX_EDITS_OF_THE_SAME_SIZE))
def test_an_index_edited_into_another_valid_index_is_refused_at_open_and_by_verify(tmp_path, edit) -> None:
    dataset = tmp_path / "ds"
    shutil.copytree(GOLDEN, dataset)
    text = (dataset / "index.json").read_text()
    if INDEX_EDITS_OF_THE_SAME_SIZE[edit] is None:
        edited = text.replace('"align": 64', '"align":  64')
    else:
        document = json.loads(text)
        INDEX_EDITS_OF_THE_SAME_SIZE[edit](document)
        edited = json.dumps(document, sort_keys=True, indent=1) + "\n"
    assert edited != text
    (dataset / "index.json").write_text(edited)
    with pytest.raises(FormatError, match="does not belong to the index read"):
        DatasetReader(dataset)
    assert "does not belong to the index read" in verify(dataset).problems[0]
