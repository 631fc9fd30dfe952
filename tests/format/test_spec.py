"""The format: golden bytes, the blob header, and index validation."""

from __future__ import annotations

import hashlib
import json
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from conftest import GOLDEN_DIR

from npz2mmap.errors import FormatError
from npz2mmap.format import dtypes, index
from npz2mmap.read.reader import DatasetReader
from npz2mmap.write.conversion import convert

GOLDEN = GOLDEN_DIR


def without_tool_version(index_text: str) -> dict:
    document = json.loads(index_text)
    document["provenance"].pop("tool_version")
    return document


def without_digest(blob: bytes) -> bytes:
    digest_at = index.BLOB_HEADER_NBYTES + len(index.IDENTITY_MAGIC) + 4
    return blob[:digest_at] + blob[digest_at + 32 :]


def test_converting_the_golden_sources_reproduces_the_golden_bytes(tmp_path) -> None:
    convert([GOLDEN / "src"], tmp_path / "out", workers=2)
    blob = (tmp_path / "out" / "data.npy").read_bytes()
    assert without_digest(blob) == without_digest((GOLDEN / "v3" / "data.npy").read_bytes())
    index_text = (tmp_path / "out" / "index.json").read_bytes()
    assert without_tool_version(index_text.decode()) == without_tool_version(
        (GOLDEN / "v3" / "index.json").read_text()
    )
    identity = blob[index.BLOB_HEADER_NBYTES : index.BLOB_HEADER_NBYTES + index.IDENTITY_NBYTES]
    assert identity == b"npz2mmap-blob\0\0\0" + (3).to_bytes(4, "little") + hashlib.sha256(
        index_text
    ).digest() + bytes(12)


def test_a_version_1_dataset_is_refused_with_what_to_do(tmp_path) -> None:
    with pytest.raises(
        FormatError,
        match=r"format version 1 is not supported by this reader "
        r"\(supports 2, 3\); convert the sources again",
    ):
        DatasetReader(GOLDEN / "v1")


@pytest.mark.parametrize("version", ["v3", "v2"])
def test_the_golden_dataset_reads_as_written(version) -> None:
    reader = DatasetReader(GOLDEN / version)
    assert len(reader) == 3 and reader.field_names == ("image", "label", "points")
    assert reader.column("image").tolist() == [
        [[0, 1, 2], [3, 4, 5]],
        [[6, 7, 8], [9, 10, 11]],
        [[255, 254, 253], [0, 0, 0]],
    ]
    assert reader.column("label").tolist() == [10, -1, 2**40]
    assert reader.view("points", 0).shape == (0, 2)
    assert reader.view("points", 1).tolist() == [[1.5, -2.0]]
    assert reader.view("points", 2).tolist() == [[0.25, 0.5], [3.0, 4.0]]
    assert reader.view("points", 2).dtype == np.dtype("<f4")
    # Version 3 records that points are (k, 2); a version 2 reader's tables say the same.
    assert reader.sample_shape("points") == (None, 2) and reader.sample_shape("image") == (2, 3)
    assert reader.index.version == int(version[1:])


def test_a_ragged_fields_shape_is_recorded_null_where_samples_differ() -> None:
    document = json.loads((GOLDEN / "v3" / "index.json").read_text())
    assert field(document, "points")["shape"] == [None, 2]
    assert "shape" not in field(json.loads((GOLDEN / "v2" / "index.json").read_text()), "points")


def test_numpy_alone_opens_the_blob() -> None:
    script = (
        "import sys, numpy as np\n"
        f"blob = np.load({str(GOLDEN / 'v2' / 'data.npy')!r}, mmap_mode='r')\n"
        "assert 'npz2mmap' not in sys.modules\n"
        "print(blob.dtype, blob.shape, bytes(blob[:12]).hex())\n"
    )
    result = subprocess.run([sys.executable, "-I", "-c", script], capture_output=True, text=True, check=True)
    assert result.stdout.split() == ["uint8", "(576,)", b"npz2mmap-blo".hex()]


@pytest.mark.parametrize("payload_nbytes", [0, 1, 512, 10**12, 2**63 - 1])
def test_blob_header_is_128_bytes_and_what_numpy_reads(tmp_path, payload_nbytes) -> None:
    header = index.blob_header(payload_nbytes)
    assert len(header) == index.BLOB_HEADER_NBYTES == 128
    path = tmp_path / "h.npy"
    path.write_bytes(header)
    with open(path, "rb") as fp:
        assert np.lib.format.read_magic(fp) == (1, 0)
        assert np.lib.format.read_array_header_1_0(fp) == ((payload_nbytes,), False, np.dtype("u1"))


def golden_copy(tmp_path: Path) -> Path:
    target = tmp_path / "ds"
    shutil.copytree(GOLDEN / "v3", target)
    return target


def edit_index(dataset: Path, edit) -> None:
    document = json.loads((dataset / "index.json").read_text())
    edit(document)
    (dataset / "index.json").write_text(json.dumps(document))


def field(document: dict, name: str) -> dict:
    return next(f for f in document["fields"] if f["name"] == name)


INDEX_EDITS = [
    (lambda d: d.update(format="other"), "format is 'other', expected 'npz2mmap'"),
    (
        lambda d: d.update(version=4),
        "format version 4 is not supported by this reader \\(supports 2, 3\\); upgrade",
    ),
    (lambda d: field(d, "points").pop("shape"), "\\(.points.\\): missing key\\(s\\) 'shape'"),
    (lambda d: d.update(version=2), "unexpected key\\(s\\) 'shape'"),
    (lambda d: field(d, "points").update(shape=[None]), "shape \\[None\\] does not have ndim 2"),
    (lambda d: field(d, "points").update(shape=[3, 2]), "must be null in a dimension in which samples differ"),
    (lambda d: field(d, "points").update(shape=[None, -1]), "shape must be at least 0, found -1"),
    (lambda d: field(d, "points").update(shape=[None, 2.0]), "shape must be an integer, found float"),
    (lambda d: field(d, "points").update(shape=None), "shape must be list, found NoneType"),
    (lambda d: d.update(version="1"), "version must be an integer, found str"),
    (lambda d: d.pop("num_samples"), "missing key\\(s\\) 'num_samples'"),
    (lambda d: d.update(extra=1), "unexpected key\\(s\\) 'extra'"),
    (lambda d: d.update(num_samples=True), "num_samples must be an integer, found bool"),
    (
        lambda d: d.update(num_samples=4),
        "\\(.image.\\): sample_crc32 holds 12 bytes, expected 16 for 4 samples",
    ),
    (lambda d: d.update(align=100), "align must be a power of two"),
    (lambda d: d.update(fields={}), "fields must be list, found dict"),
    (lambda d: field(d, "image").update(dtype="|O"), "holds Python objects"),
    (lambda d: field(d, "image").update(dtype=">u2"), "is not little-endian"),
    (lambda d: field(d, "image").update(dtype="nonsense"), "is not a valid numpy descr"),
    (lambda d: field(d, "image").update(kind="sparse"), "kind is 'sparse'"),
    (lambda d: field(d, "image").update(shape=[2, -3]), "shape must be at least 0, found -3"),
    (lambda d: field(d, "image").update(shape=[2]), "shape \\[2\\] does not have ndim 2"),
    (lambda d: field(d, "image")["data"].update(offset=1), "is not 64-byte aligned"),
    (lambda d: field(d, "image")["data"].update(offset=576), "ends at 594, past the payload of 576 bytes"),
    (lambda d: field(d, "label")["data"].update(offset=0), "overlaps"),
    (lambda d: field(d, "points").pop("offsets"), "missing key\\(s\\) 'offsets'"),
    (lambda d: field(d, "points")["offsets"].update(crc32=-1), "crc32 must be at least 0"),
    (lambda d: d["fields"].append(d["fields"][0]), "field names are not unique"),
    (lambda d: field(d, "points").update(ndim=0), "a ragged field needs ndim of at least 1"),
]


@pytest.mark.parametrize(("edit", "message"), INDEX_EDITS, ids=[m for _, m in INDEX_EDITS])
def test_invalid_indexes_are_refused_with_a_clear_message(tmp_path, edit, message) -> None:
    dataset = golden_copy(tmp_path)
    edit_index(dataset, edit)
    with pytest.raises(FormatError, match=message):
        DatasetReader(dataset)


@pytest.mark.parametrize(
    ("content", "message"),
    [
        (b"", "not valid JSON"),
        (b"{not json", "not valid JSON"),
        (b"\xff\xfe", "not valid JSON"),
        (b"[1, 2]", "expected a JSON object, found list"),
    ],
)
def test_unreadable_index_files_are_refused(tmp_path, content, message) -> None:
    dataset = golden_copy(tmp_path)
    (dataset / "index.json").write_bytes(content)
    with pytest.raises(FormatError, match=message):
        DatasetReader(dataset)


@pytest.mark.parametrize(
    ("damage", "message"),
    [
        (lambda p: p.unlink(), "data.npy: missing"),
        (lambda p: p.write_bytes(p.read_bytes()[:-1]), "703 bytes, but the index expects 704"),
        (lambda p: p.write_bytes(p.read_bytes() + b"\0"), "705 bytes, but the index expects 704"),
        (
            lambda p: p.write_bytes(p.read_bytes().replace(b"(576,)", b"(577,)")),
            "header does not match the index",
        ),
    ],
    ids=["missing", "truncated", "extended", "header"],
)
def test_a_blob_that_does_not_match_the_index_is_refused_before_mapping(tmp_path, damage, message) -> None:
    dataset = golden_copy(tmp_path)
    damage(dataset / "data.npy")
    with pytest.raises(FormatError, match=message):
        DatasetReader(dataset)


def test_dtypes_survive_the_json_round_trip() -> None:
    for dtype in [
        "<f4",
        "|b1",
        "<U3",
        "|S2",
        "<M8[us]",
        "<c16",
        [("a", "<i2"), ("b", [("c", "<f8"), ("d", "|u1", (2, 3))])],
        {"names": ["x", "y"], "formats": ["<i4", "<i2"], "offsets": [0, 8], "itemsize": 16},
        [("c", ("<f8", (5,)), (2,))],
        [
            (
                "x",
                np.dtype(
                    (np.dtype({"names": ["a"], "formats": ["i1"], "offsets": [4], "itemsize": 8}), (3,))
                ),
                (4,),
            )
        ],
    ]:
        dtype = np.dtype(dtype)
        assert dtypes.dtype_from_json(json.loads(json.dumps(dtypes.dtype_to_json(dtype))), "test") == dtype


def test_corrupt_ragged_tables_raise_on_access_instead_of_reading_out_of_bounds(tmp_path) -> None:
    dataset = golden_copy(tmp_path)
    blob = bytearray((dataset / "data.npy").read_bytes())
    offsets_at = index.BLOB_HEADER_NBYTES + 448  # the golden 'points' offsets table
    blob[offsets_at + 16 : offsets_at + 24] = (10**6).to_bytes(8, "little")
    (dataset / "data.npy").write_bytes(bytes(blob))
    reader = DatasetReader(dataset)
    assert reader.view("points", 0).shape == (0, 2)
    with pytest.raises(FormatError, match="field 'points' sample 1: tables are corrupt"):
        reader.view("points", 1)
