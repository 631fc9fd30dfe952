"""Exact bytes: casts never change a value, record padding is kept, memory does not grow with itemsize.

The oracle is independent of the converter: each member's raw bytes read with
zipfile and numpy's own header reader, swapped to little-endian byte by byte
with a permutation built from the dtype's fields and offsets.
"""

from __future__ import annotations

import hashlib
import math
import shutil
import subprocess
import sys
import tempfile
import textwrap
import zipfile
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner, Result
from conftest import write_npz
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from strategies import padded_record_dtypes

from npz2mmap.check.verify import verify
from npz2mmap.cli.commands import cli
from npz2mmap.read.reader import DatasetReader
from npz2mmap.write.conversion import convert

SCRIPT = str(Path(sys.executable).parent / "npz2mmap")
Member = tuple[np.dtype, tuple[int, ...], bool, bytes]  # dtype, shape, fortran_order, raw data


def run(*args: object) -> Result:
    return CliRunner().invoke(cli, [str(a) for a in args])


def digest(directory: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(directory.iterdir())}


# --- the oracle ----------------------------------------------------------------


def write_raw_npz(path: Path, members: dict[str, Member], compressed: bool = False) -> Path:
    """An NPZ file whose members hold exactly the given bytes (np.save loses padding of Fortran arrays)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with zipfile.ZipFile(path, "w", zipfile.ZIP_DEFLATED if compressed else zipfile.ZIP_STORED) as zf:
        for key, (dtype, shape, fortran, data) in members.items():
            with zf.open(f"{key}.npy", "w") as fp:
                header = {
                    "descr": np.lib.format.dtype_to_descr(dtype),
                    "fortran_order": fortran,
                    "shape": shape,
                }
                np.lib.format.write_array_header_1_0(fp, header)
                fp.write(data)
    return path


def read_member(path: Path, key: str) -> Member:
    with zipfile.ZipFile(path) as zf, zf.open(f"{key}.npy") as fp:
        version = np.lib.format.read_magic(fp)
        read_header = (
            np.lib.format.read_array_header_1_0 if version == (1, 0) else np.lib.format.read_array_header_2_0
        )
        shape, fortran, dtype = read_header(fp)
        return dtype, shape, fortran, fp.read()


def swapped_ranges(dtype: np.dtype, offset: int = 0):
    """(offset, nbytes) of every big-endian value inside one element, nested records and subarrays too."""
    if dtype.names is not None:
        for name in dtype.names:
            field, field_offset = dtype.fields[name][:2]
            yield from swapped_ranges(field, offset + field_offset)
    elif dtype.subdtype is not None:
        base, shape = dtype.subdtype
        for k in range(math.prod(shape)):
            yield from swapped_ranges(base, offset + k * base.itemsize)
    elif dtype.byteorder == ">" or (dtype.byteorder == "=" and sys.byteorder == "big"):
        unit = dtype.itemsize // 2 if dtype.kind == "c" else 4 if dtype.kind == "U" else dtype.itemsize
        for start in range(offset, offset + dtype.itemsize, unit):
            yield start, unit


def expected_stored_bytes(path: Path, key: str) -> bytes:
    """The member's elements in C order, each one's bytes permuted so every value is little-endian."""
    dtype, shape, fortran, data = read_member(path, key)
    elements = np.frombuffer(data, np.uint8).reshape(-1, dtype.itemsize)
    if fortran:
        elements = elements[np.arange(len(elements)).reshape(shape[::-1]).T.reshape(-1)]
    permutation = np.arange(dtype.itemsize)
    for start, nbytes in swapped_ranges(dtype):
        permutation[start : start + nbytes] = permutation[start : start + nbytes][::-1]
    return elements[:, permutation].tobytes()


def stored_bytes(dataset: Path, name: str) -> bytes:
    """A field's whole data region as the blob holds it."""
    reader = DatasetReader(dataset)
    f = reader.index.field(name)
    return reader.payload[f.data.offset : f.data.end].tobytes()


def raw(array: np.ndarray) -> bytes:
    return np.ascontiguousarray(array).reshape(-1).view(np.uint8).tobytes()


# --- point: --cast never changes a value ------------------------------------------


@pytest.mark.parametrize(
    ("values", "dtype", "message"),
    [
        (
            np.array([1, 3_000_000_000]),
            "int32",
            "value 3000000000 at index (1,) does not survive the cast to int32: it would be stored as -1294967296 "
            "(--cast keeps only values that int32 represents exactly)",
        ),
        (
            np.array([[2.0], [1e300]]),
            "float32",
            "value 1e+300 at index (1, 0) does not survive the cast to float32: it would be stored as inf "
            "(--cast keeps only values that float32 represents exactly)",
        ),
        (
            np.array(0.1),
            "float32",
            "value 0.1 does not survive the cast to float32: it would be stored as 0.10000000149011612 "
            "(--cast keeps only values that float32 represents exactly)",
        ),
        (
            np.array([7, 4_294_967_295], dtype=np.uint32),
            "int32",
            "value 4294967295 at index (1,) does not survive the cast to int32: it would be stored as -1 "
            "(--cast keeps only values that int32 represents exactly)",
        ),
        (
            np.array([2**63], dtype=np.uint64),
            "int64",
            "value 9223372036854775808 at index (0,) does not survive the cast to int64: it would be stored "
            "as -9223372036854775808 (--cast keeps only values that int64 represents exactly)",
        ),
        (
            np.array(255, dtype=np.uint8),
            "int8",
            "value 255 does not survive the cast to int8: it would be stored as -1 "
            "(--cast keeps only values that int8 represents exactly)",
        ),
        (
            np.array(2**31 - 1, dtype=np.int32),
            "float32",
            "value 2147483647 does not survive the cast to float32: it would be stored as 2147483648.0 "
            "(--cast keeps only values that float32 represents exactly)",
        ),
        (  # numpy's own words were shown: 'ascii' codec can't decode byte 0xff in position 0: ...
            np.array([b"ok", b"\xff"], dtype="S2"),
            "U2",
            "value b'\\xff' at index (1,) has no <U2 form: bytes that are not ASCII are no text "
            "(--cast keeps only values that <U2 represents exactly)",
        ),
    ],
    ids=[
        "int-overflow",
        "float-overflow",
        "float-rounding",
        "unsigned-to-signed-32",
        "unsigned-to-signed-64",
        "unsigned-to-signed-8",
        "int-rounding-to-float",
        "bytes-not-ascii-to-text",
    ],
)
def test_a_cast_that_changes_a_value_is_refused_naming_file_key_and_value(
    tmp_path, values, dtype, message
) -> None:
    write_npz(tmp_path / "src" / "a.npz", x=np.zeros_like(values))
    bad = write_npz(tmp_path / "src" / "b.npz", x=values)
    before = digest(tmp_path / "src")
    result = run(
        "convert", tmp_path / "src", "-o", tmp_path / "out", "--cast", f"x={dtype}", "--workers", "2"
    )
    assert result.exit_code == 1
    assert result.output == f"Error: {bad}[x]: {message}\n"
    assert not (tmp_path / "out").exists()
    assert digest(tmp_path / "src") == before


def test_a_cast_keeps_exactly_representable_values_nan_and_nat(tmp_path) -> None:
    sources = {
        "f": (np.array([0.5, np.nan, -0.0, np.inf, -np.inf, 2.0**-20]), "float32"),
        "c": (np.array([complex(np.nan, 1), 2.5 - 1j], dtype=">c16"), "complex64"),
        "i": (np.array([-(2**31), 2**31 - 1], dtype=">i8"), "int32"),
        "t": (np.array(["NaT", "2020-01-01T00:00:01"], dtype="M8[ms]"), "M8[s]"),
        "s": (np.array([b"ab", b""], dtype="S2"), "U2"),
        # np.array([np.datetime64("NaT")]) is of no unit: NaT in any unit is it
        "g": (np.array([np.datetime64("NaT")] * 2), "M8[s]"),
        "d": (np.array([np.timedelta64("NaT")] * 2), "m8[ms]"),
    }
    write_npz(tmp_path / "src" / "a.npz", **{key: values for key, (values, _) in sources.items()})
    casts = {key: dtype for key, (_, dtype) in sources.items()}
    convert([tmp_path / "src"], tmp_path / "out", casts=casts, workers=1)
    reader = DatasetReader(tmp_path / "out")
    for key, (values, dtype) in sources.items():
        stored = reader.view(key, 0)
        assert stored.dtype == np.dtype(dtype).newbyteorder("<")
        assert raw(stored) == raw(values.astype(stored.dtype)), key
    report = verify(tmp_path / "out", sources=True)
    assert report.ok, report.problems


def test_a_cast_of_a_unitless_timedelta_that_is_not_nat_is_refused(tmp_path) -> None:
    """numpy's generic unit holds numbers of no unit: no unit's value is exactly one (NaT is NaT)."""
    bad = write_npz(tmp_path / "src" / "a.npz", x=np.array([np.timedelta64("NaT"), 5], dtype="m8"))
    result = run("convert", tmp_path / "src", "-o", tmp_path / "out", "--cast", "x=m8[s]")
    assert (result.exit_code, result.output) == (
        1,
        f"Error: {bad}[x]: value 5 generic time units at index (1,) has no unit, so no value of "
        "timedelta64[s] is exactly it (--cast keeps only values that timedelta64[s] represents exactly)\n",
    )
    assert not (tmp_path / "out").exists()


def test_a_cast_of_bytes_that_are_not_ascii_to_unicode_is_a_one_line_error(tmp_path) -> None:
    bad = write_npz(tmp_path / "src" / "a.npz", s=np.array([b"ok", "é".encode()], dtype="S2"))
    result = run("convert", tmp_path / "src", "-o", tmp_path / "out", "--cast", "s=<U2")
    assert result.exit_code == 1
    assert result.output == (
        f"Error: {bad}[s]: value b'\\xc3\\xa9' at index (1,) has no <U2 form: bytes that are not ASCII "
        "are no text (--cast keeps only values that <U2 represents exactly)\n"
    )
    assert not (tmp_path / "out").exists()


def test_verify_sources_reports_a_cast_that_changed_a_value(tmp_path) -> None:
    """What older versions stored for 3,000,000,000 cast to int32: the wrapped value."""
    source = write_npz(tmp_path / "src" / "a.npz", x=np.array([7, -1_294_967_296]))
    convert([tmp_path / "src"], tmp_path / "out", casts={"x": "int32"}, workers=1)
    write_npz(source, x=np.array([7, 3_000_000_000]))
    report = verify(tmp_path / "out", sources=True)
    assert report.problems == [
        f"sample 0 ({source}): {source}[x]: value 3000000000 at index (1,) does not survive the cast to "
        "int32: it would be stored as -1294967296 (--cast keeps only values that int32 represents exactly)"
    ]


# --- point: record padding is copied, values swapped ----------------------------

PADDED = np.dtype(
    {"names": ["a", "b", "c"], "formats": [">i2", ">f8", "S3"], "offsets": [0, 8, 16], "itemsize": 24}
)


def test_record_padding_is_copied_verbatim_and_values_swapped(tmp_path) -> None:
    data = bytes(range(1, 1 + 4 * 24))
    for name in ("p0", "p1"):
        write_raw_npz(tmp_path / "src" / f"{name}.npz", {"r": (PADDED, (2, 2), name == "p1", data)})
    element = [2, 1, *range(3, 9), *range(16, 8, -1), *range(17, 25)]  # hand-swapped first element
    convert([tmp_path / "src"], tmp_path / "w1", workers=1)
    convert([tmp_path / "src"], tmp_path / "w2", workers=2)
    blob = stored_bytes(tmp_path / "w1", "r")
    assert blob[:24] == bytes(element)
    # p1 is the same bytes in Fortran order: its C-order element (0, 1) is the file's third
    assert blob[96 + 24 : 96 + 48] == bytes(24 * 2 + b for b in element)
    assert (tmp_path / "w1" / "data.npy").read_bytes() == (tmp_path / "w2" / "data.npy").read_bytes()
    assert blob == b"".join(expected_stored_bytes(tmp_path / "src" / f"{n}.npz", "r") for n in ("p0", "p1"))
    report = verify(tmp_path / "w1", sources=True)
    assert report.ok, report.problems


@pytest.mark.parametrize(
    "dtype",
    [">U30", [("s", ">U13", (2,)), ("c", ">c16"), ("n", [("t", ">M8[s]"), ("b", "|b1")], (5,))]],
    ids=["long-string", "nested-record"],
)
def test_values_and_records_longer_than_a_chunk_are_swapped_in_pieces(tmp_path, monkeypatch, dtype) -> None:
    for module in ("ingest.npz", "ingest.elements", "write.blob_writer", "check.verify"):
        monkeypatch.setattr(f"npz2mmap.{module}.CHUNK_NBYTES", 48)
    dtype = np.dtype(dtype)
    assert dtype.itemsize > 48
    data = np.random.default_rng(3).bytes(6 * dtype.itemsize)
    write_raw_npz(tmp_path / "src" / "c.npz", {"x": (dtype, (2, 3), False, data)})
    write_raw_npz(tmp_path / "src" / "f.npz", {"x": (dtype, (2, 3), True, data)}, compressed=True)
    convert([tmp_path / "src"], tmp_path / "out", workers=1)
    expected = b"".join(expected_stored_bytes(tmp_path / "src" / f"{n}.npz", "x") for n in "cf")
    assert stored_bytes(tmp_path / "out", "x") == expected
    report = verify(tmp_path / "out", sources=True)
    assert report.ok, report.problems


def padded_dataset(tmp_path: Path, name: str) -> Path:
    """Three samples of a big-endian padded record, fixed (r) and ragged (g), with padding 0xAB."""
    data = np.frombuffer(bytes(range(256)) * 2, np.uint8)
    for k in range(3):
        element = data[k * 24 : k * 24 + 24 * (k + 1)].copy().reshape(k + 1, 24)
        element[:, 2:8] = 0xAB
        fixed = element[:1].tobytes()
        write_raw_npz(
            tmp_path / name / f"s{k}.npz",
            {"r": (PADDED, (), False, fixed), "g": (PADDED, (k + 1,), False, element.tobytes())},
        )
    convert([tmp_path / name], tmp_path / f"{name}.out", workers=1)
    return tmp_path / f"{name}.out"


def test_every_read_returns_raw_byte_exact_copies_of_records(tmp_path) -> None:
    from npz2mmap import MmapDataset
    from npz2mmap.read.parts import Parts, PartsReader

    parts = [padded_dataset(tmp_path, "a"), padded_dataset(tmp_path, "b")]
    reader = DatasetReader(parts[0])
    stored = {name: [raw(reader.view(name, i)) for i in range(3)] for name in ("r", "g")}
    assert all(b"\xab" * 6 in sample for sample in stored["r"])
    for ds in (MmapDataset(parts[0]), MmapDataset(parts[0], tensors=True)):
        for i in range(3):
            first, second = ds[i], ds[i]
            for name in ("r", "g"):
                assert raw(first[name]) == raw(second[name]) == stored[name][i]
                assert first[name].flags.writeable
    batch = MmapDataset(parts[0]).__getitems__([2, 0, 1])
    assert raw(batch.arrays["r"]) == b"".join(stored["r"][i] for i in (2, 0, 1))
    assert [raw(a) for a in batch.arrays["g"]] == [stored["g"][i] for i in (2, 0, 1)]
    assert raw(reader.gather("r", [0, 1, 2])) == b"".join(stored["r"])
    both = PartsReader(Parts(parts))
    assert raw(both.gather("r", [4, 0, 5, 1])) == b"".join(stored["r"][i] for i in (1, 0, 2, 1))
    assert [raw(a) for a in both.gather("g", [5, 0])] == [stored["g"][2], stored["g"][0]]


def _ragged_samples_of(batch, name: str, padded: bool) -> list[bytes]:
    """Each sample's bytes of ragged field ``name`` in a batch, however the collate arranged it."""
    if isinstance(batch, list):  # collate_fn=list: the samples as handed out
        return [raw(np.asarray(sample if not isinstance(sample, dict) else sample[name])) for sample in batch]
    value = batch if not isinstance(batch, dict) else batch[name]
    if padded:
        lengths = batch[f"{name}_lengths"].tolist()
        return [raw(np.asarray(value[j, :n])) for j, n in enumerate(lengths)]
    return [raw(np.asarray(sample)) for sample in value]


@pytest.mark.parametrize("tensors", [False, True])
@pytest.mark.parametrize("fields", [None, "g"])
@pytest.mark.parametrize("collate_fn", [None, "collate", "list", "padded"])
def test_batches_of_ragged_records_keep_every_byte_on_every_path(tmp_path, tensors, fields, collate_fn) -> None:
    """Record padding survives every batch path, with samples read one by one (tensors=True) too."""
    from torch.utils.data import DataLoader

    from npz2mmap import MmapDataset, MmapLoader, PaddedCollate, collate

    dataset = padded_dataset(tmp_path, "a")
    reader = DatasetReader(dataset)
    stored = [raw(reader.view("g", i)) for i in range(3)]
    function = {None: None, "collate": collate, "list": list, "padded": PaddedCollate()}[collate_fn]
    order = [2, 0, 1, 1]
    ds = MmapDataset(dataset, fields=fields, tensors=tensors)
    loaders = [DataLoader(ds, batch_sampler=[order], collate_fn=function)]
    if collate_fn in (None, "padded"):
        loaders.append(MmapLoader(ds, 4, sampler=order, prefetch=0, collate_fn=function))
    for loader in loaders:
        for batch in loader:
            assert _ragged_samples_of(batch, "g", collate_fn == "padded") == [stored[i] for i in order]


@pytest.mark.parametrize("chunk_nbytes", [None, 48], ids=["default-chunks", "48-byte-chunks"])
def test_property_records_are_stored_as_their_swapped_raw_bytes(monkeypatch, chunk_nbytes) -> None:
    if chunk_nbytes is not None:
        for module in ("ingest.npz", "ingest.elements", "write.blob_writer", "check.verify"):
            monkeypatch.setattr(f"npz2mmap.{module}.CHUNK_NBYTES", chunk_nbytes)
    check_records_round_trip()


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.data())
def check_records_round_trip(data) -> None:
    dtype = data.draw(padded_record_dtypes())
    num_files = data.draw(st.integers(1, 3))
    rows = data.draw(st.booleans())
    ndim = data.draw(st.integers(1 if rows else 0, 2))
    tmp = Path(tempfile.mkdtemp())
    try:
        for k in range(num_files):
            shape = tuple(data.draw(st.lists(st.integers(1, 3), min_size=ndim, max_size=ndim)))
            fortran = ndim > 1 and data.draw(st.booleans())
            seed = data.draw(st.integers(0, 2**32 - 1))
            raw_data = np.random.default_rng(seed).bytes(math.prod(shape) * dtype.itemsize)
            write_raw_npz(
                tmp / "src" / f"s{k}.npz", {"r": (dtype, shape, fortran, raw_data)}, compressed=k == 1
            )
        convert([tmp / "src"], tmp / "w1", rows=rows, workers=1)
        convert([tmp / "src"], tmp / "w2", rows=rows, workers=2)
        assert (tmp / "w1" / "data.npy").read_bytes() == (tmp / "w2" / "data.npy").read_bytes()
        expected = b"".join(expected_stored_bytes(tmp / "src" / f"s{k}.npz", "r") for k in range(num_files))
        assert stored_bytes(tmp / "w1", "r") == expected
        report = verify(tmp / "w1", sources=True)
        assert report.ok, report.problems
    finally:
        shutil.rmtree(tmp)


def test_verify_sources_names_the_changed_row_of_a_fortran_order_shard(tmp_path) -> None:
    data = bytes(range(1, 1 + 6 * 24))
    shard = write_raw_npz(tmp_path / "src" / "a.npz", {"r": (PADDED, (3, 2), True, data)})
    convert([tmp_path / "src"], tmp_path / "out", rows=True, workers=1)
    assert verify(tmp_path / "out", sources=True).ok
    changed = bytearray(data)
    changed[4 * 24 + 5] ^= 0xFF  # padding of file element 4: index (1, 1) in Fortran order
    write_raw_npz(shard, {"r": (PADDED, (3, 2), True, bytes(changed))})
    report = verify(tmp_path / "out", sources=True)
    assert report.problems == [
        f"sample 1 ({shard} row 1): field 'r': the values equal the source's, but record padding bytes differ"
    ]
    changed[4 * 24] ^= 0xFF  # a value byte of the same element
    write_raw_npz(shard, {"r": (PADDED, (3, 2), True, bytes(changed))})
    report = verify(tmp_path / "out", sources=True)
    assert report.problems == [f"sample 1 ({shard} row 1): field 'r': values differ from the source"]


# --- point: memory does not grow with the itemsize ----------------------------------

MEASURE = textwrap.dedent(
    """
    import resource, subprocess, sys
    done = subprocess.run(sys.argv[1:], capture_output=True, text=True)
    peak = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
    print(done.returncode, peak * (1 if sys.platform == "darwin" else 1024), done.stderr.replace("\\n", " "))
    """
)


def peak_rss_nbytes(*args: object) -> int:
    """Run the CLI in a fresh process tree and return its largest process's peak RSS."""
    command = [sys.executable, "-c", MEASURE, SCRIPT, *map(str, args)]
    code, peak, errors = subprocess.run(command, capture_output=True, text=True, check=True).stdout.split(
        " ", 2
    )
    assert code == "0", errors
    return int(peak)


def write_one_huge_element(path: Path, dtype: np.dtype, head: bytes = b"", tail: bytes = b"") -> Path:
    """A compressed NPZ of one element of ``dtype``: zeros, except ``head`` and ``tail``, streamed."""
    block = bytes(8 << 20)
    with zipfile.ZipFile(path, "w", zipfile.ZIP_DEFLATED, compresslevel=1) as zf:
        with zf.open("x.npy", "w", force_zip64=True) as fp:
            header = {"descr": np.lib.format.dtype_to_descr(dtype), "fortran_order": False, "shape": ()}
            np.lib.format.write_array_header_1_0(fp, header)
            fp.write(head)
            left = dtype.itemsize - len(head) - len(tail)
            while left:
                fp.write(block[: min(len(block), left)])
                left -= min(len(block), left)
            fp.write(tail)
    return path


def test_one_huge_void_element_converts_and_verifies_in_bounded_memory(tmp_path) -> None:
    dtype = np.dtype("V1000000000")
    source = write_one_huge_element(tmp_path / "huge.npz", dtype, head=b"first", tail=b"last")
    assert source.stat().st_size < 10 << 20
    assert peak_rss_nbytes("convert", source, "-o", tmp_path / "out", "--workers", "1", "-q") < 300 << 20
    reader = DatasetReader(tmp_path / "out")
    element = reader.view("x", 0).reshape(-1).view(np.uint8)
    assert element[:5].tobytes() == b"first" and element[-4:].tobytes() == b"last"
    # verify maps the blob (page cache counted in RSS once) but never holds the element in memory
    assert peak_rss_nbytes("verify", tmp_path / "out", "--sources") < dtype.itemsize + (300 << 20)


def test_a_big_endian_record_larger_than_a_chunk_streams_in_bounded_memory(tmp_path) -> None:
    dtype = np.dtype([("a", ">u4", (50_000_000,)), ("b", "|i1"), ("c", ">f8")])
    tail = np.array([(9, 7, 1.5)], dtype=[("a", ">u4"), ("b", "|i1"), ("c", ">f8")]).tobytes()
    source = write_one_huge_element(tmp_path / "big.npz", dtype, head=bytes([1, 2, 3, 4]), tail=tail)
    assert peak_rss_nbytes("convert", source, "-o", tmp_path / "out", "--workers", "1", "-q") < 300 << 20
    element = DatasetReader(tmp_path / "out").view("x", 0).reshape(-1).view(np.uint8)
    assert element[:4].tobytes() == bytes([4, 3, 2, 1])
    expected_tail = np.array([(9, 7, 1.5)], dtype=[("a", "<u4"), ("b", "|i1"), ("c", "<f8")]).tobytes()
    assert element[-len(tail) :].tobytes() == expected_tail
    report = verify(tmp_path / "out", sources=True)
    assert report.ok, report.problems


def test_a_cast_record_has_zero_padding_beside_sources_that_keep_their_own(tmp_path) -> None:
    """FORMAT.md: padding is copied from the source, but a source a cast converts gets zeros."""
    padded = np.dtype({"names": ["a", "b"], "formats": ["<i4", "<f8"], "offsets": [0, 8], "itemsize": 24})
    kept = np.zeros(1, padded)
    kept.view(np.uint8)[:] = 0xAB
    kept["a"], kept["b"] = 1, 0.5
    write_npz(tmp_path / "src" / "a.npz", x=kept)
    write_npz(tmp_path / "src" / "b.npz", x=np.array([(2, 1.5)], dtype=[("a", "<i4"), ("b", "<f8")]))
    convert([tmp_path / "src"], tmp_path / "out", casts={"x": padded}, workers=1)
    reader = DatasetReader(tmp_path / "out")
    first, second = (raw(reader.view("x", i)) for i in range(2))
    assert first == raw(kept)  # its own padding, 0xAB
    expected = np.zeros(1, padded)
    expected["a"], expected["b"] = 2, 1.5
    assert second == raw(expected) and second[4:8] == b"\0" * 4 and second[16:] == b"\0" * 8
