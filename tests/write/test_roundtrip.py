"""Every array reads back bit-identical in dtype, shape and bytes to np.load of its source."""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path

import numpy as np
import pytest
from conftest import assert_same_array, write_samples
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from strategies import field_samples

from npz2mmap.read.reader import DatasetReader
from npz2mmap.write.conversion import convert

DTYPES = [
    "bool",
    "int8",
    "int16",
    "int32",
    "int64",
    "uint8",
    "uint16",
    "uint32",
    "uint64",
    "float16",
    "float32",
    "float64",
    "complex64",
    "complex128",
    "U7",
    "S5",
    "datetime64[s]",
    "datetime64[ns]",
    "timedelta64[ms]",
    [("x", "<i2"), ("y", ">f8", (2,)), ("name", "S3")],
]


def sample_array(dtype: np.dtype, shape: tuple[int, ...], seed: int) -> np.ndarray:
    raw = np.random.default_rng(seed).integers(
        0, 256, size=int(np.prod(shape)) * dtype.itemsize, dtype=np.uint8
    )
    array = raw.view(dtype).reshape(shape).copy()
    if dtype.kind == "b":
        array = raw[: array.size].reshape(shape) % 2 == 1
    if dtype.kind == "U":
        array = np.array(["héllo"[: seed % 5 + 1], "ab", "", "xyz"][: shape[0] if shape else 1], dtype=dtype)
    return array


def read_back(dataset: Path, name: str, i: int) -> np.ndarray:
    return np.array(DatasetReader(dataset).view(name, i))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_dtypes_round_trip_exactly(convert_samples, dtype) -> None:
    dtype = np.dtype(dtype)
    shape = (4,) if dtype.kind in "US" else (2, 3)
    samples = [{"a": sample_array(dtype, shape, seed)} for seed in range(3)]
    out = convert_samples(samples)
    for i, sample in enumerate(samples):
        assert_same_array(read_back(out, "a", i), sample["a"])


def test_nan_payloads_and_signed_zero_are_kept_bit_for_bit(convert_samples) -> None:
    bits = np.array([0x7FC00001, 0x7F800001, 0xFFC00000, 0x80000000], dtype=np.uint32)
    for dtype in ("<f4", ">f4"):
        values = bits.view("<f4").astype(dtype)
        out = convert_samples([{"a": values}])
        assert read_back(out, "a", 0).view(np.uint32).tolist() == bits.tolist()


def test_scalars_empty_arrays_and_one_sample(convert_samples) -> None:
    samples = [
        {"scalar": np.float64(2.5), "empty": np.zeros((0, 3), np.int16), "zero_d": np.array(7, np.uint8)}
    ]
    out = convert_samples(samples)
    reader = DatasetReader(out)
    assert len(reader) == 1
    for name, source in samples[0].items():
        assert_same_array(np.array(reader.view(name, 0)), np.asarray(source))


def test_ragged_fields_keep_each_shape(convert_samples) -> None:
    samples = [{"points": np.arange(n * 3, dtype=np.float32).reshape(n, 3)} for n in (5, 0, 1, 9)]
    out = convert_samples(samples)
    reader = DatasetReader(out)
    field = reader.index.field("points")
    assert field.ragged and field.ndim == 2
    for i, sample in enumerate(samples):
        assert_same_array(np.array(reader.view("points", i)), sample["points"])
    assert reader.table("points", "shapes").tolist() == [[5, 3], [0, 3], [1, 3], [9, 3]]


@pytest.mark.parametrize("compressed", [False, True], ids=["stored", "deflated"])
def test_big_endian_and_fortran_inputs_are_normalised(convert_samples, compressed) -> None:
    rng = np.random.default_rng(1)
    samples = [
        {
            "be": rng.standard_normal((4, 5)).astype(">f8"),
            "fortran": np.asfortranarray(rng.standard_normal((3, 4, 5)).astype(np.float32)),
            "be_fortran": np.asfortranarray(rng.integers(0, 1000, (6, 7)).astype(">i4")),
            "record": np.array([(1, (2.5, -1)), (3, (4, 5))], dtype=[("a", ">i4"), ("b", ">f2", (2,))]),
        }
        for _ in range(3)
    ]
    out = convert_samples(samples, compressed=compressed)
    reader = DatasetReader(out)
    for f in reader.index.fields:
        assert f.dtype == f.dtype.newbyteorder("<")
    for i, sample in enumerate(samples):
        for name, source in sample.items():
            stored = reader.view(name, i)
            assert stored.flags.c_contiguous
            assert_same_array(np.array(stored), source)


def test_large_fortran_member_is_streamed_in_pieces(convert_samples, monkeypatch) -> None:
    monkeypatch.setattr("npz2mmap.write.blob_writer.CHUNK_NBYTES", 256)
    monkeypatch.setattr("npz2mmap.ingest.npz.CHUNK_NBYTES", 256)
    source = np.asfortranarray(np.arange(5 * 7 * 11, dtype=">i8").reshape(5, 7, 11))
    flat = np.arange(300, dtype=">f4")
    out = convert_samples([{"f": source, "flat": flat}])
    assert_same_array(read_back(out, "f", 0), source)
    assert_same_array(read_back(out, "flat", 0), flat)


def test_compressed_and_uncompressed_give_the_same_blob(convert_samples) -> None:
    samples = [{"x": np.arange(100, dtype=np.float32) * i} for i in range(4)]
    plain = convert_samples(samples)
    packed = convert_samples(samples, compressed=True)
    assert (plain / "data.npy").read_bytes() == (packed / "data.npy").read_bytes()


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.integers(1, 4).flatmap(lambda n: st.lists(field_samples(n), min_size=1, max_size=3)))
def test_property_any_fields_round_trip(fields) -> None:
    tmp = Path(tempfile.mkdtemp())
    try:
        num_samples = len(fields[0])
        samples = [{f"k{j}": arrays[i] for j, arrays in enumerate(fields)} for i in range(num_samples)]
        write_samples(tmp / "src", samples)
        convert([tmp / "src"], tmp / "out", workers=1)
        reader = DatasetReader(tmp / "out")
        assert len(reader) == num_samples
        for i, sample in enumerate(samples):
            for name, source in sample.items():
                assert_same_array(np.array(reader.view(name, i)), source)
    finally:
        shutil.rmtree(tmp)
