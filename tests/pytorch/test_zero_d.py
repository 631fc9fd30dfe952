"""A 0-d field behaves one way on every path: a 0-d array per sample, shape (B,) per batch.

Oracles: the sources' own little-endian bytes (tests/corpus.py), torch's
``default_collate([ds[i] for i in batch])`` where torch has the dtype, and
``torch.from_numpy`` to tell which dtypes torch has.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from corpus import little_endian_bytes
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp
from strategies import padded_record_dtypes, scalar_dtypes
from torch.utils.data import ConcatDataset, DataLoader, default_collate

import npz2mmap
from npz2mmap import MmapDataset, MmapLoader, PaddedCollate, collate

NUM_SAMPLES = 5
BATCH = [3, 0, 4, 1]
RECORD = np.dtype({"names": ["a", "b"], "formats": ["u1", "<f8"]}, align=True)  # 7 padding bytes


def torch_has(dtype: np.dtype) -> bool:
    try:
        torch.from_numpy(np.empty(0, dtype=dtype))
    except (TypeError, ValueError):
        return False
    return True


def zero_d_dtypes() -> st.SearchStrategy[np.dtype]:
    """Every kind a 0-d field can have: numbers, bool, strings, datetimes, records with padding."""
    return st.one_of(scalar_dtypes(), padded_record_dtypes(depth=1), st.just(RECORD))


def write_dataset(path: Path, sources: dict[str, list[np.ndarray]]) -> None:
    with npz2mmap.Writer(path) as writer:
        for i in range(NUM_SAMPLES):
            writer.append({name: arrays[i] for name, arrays in sources.items()})


def as_bytes(value: Any) -> bytes:
    array = value.numpy() if isinstance(value, torch.Tensor) else np.asarray(value)
    return little_endian_bytes(np.ascontiguousarray(array))


# Each path gives one batch of BATCH from a dataset (fields selected by the caller), as users make it.
def default_collate_of_getitems(ds: MmapDataset) -> Any:
    return default_collate(ds.__getitems__(BATCH))


def npz2mmap_collate(ds: MmapDataset) -> Any:
    return collate(ds.__getitems__(BATCH))


def collate_of_samples(ds: MmapDataset) -> Any:
    return collate([ds[i] for i in BATCH])


def concat_data_loader(ds: MmapDataset) -> Any:
    """A ConcatDataset has no __getitems__: DataLoader hands collate a plain list of samples."""
    loader = DataLoader(ConcatDataset([ds]), batch_sampler=[BATCH], collate_fn=collate)
    return next(iter(loader))


def padded_collate(ds: MmapDataset) -> Any:
    return PaddedCollate()(ds.__getitems__(BATCH))


def data_loader(workers: int, collate_fn: Callable[[Any], Any] | None = None) -> Callable[[MmapDataset], Any]:
    def run(ds: MmapDataset) -> Any:
        loader = DataLoader(ds, batch_sampler=[BATCH], num_workers=workers, collate_fn=collate_fn)
        return next(iter(loader))

    return run


def mmap_loader(workers: int, prefetch: int = 0) -> Callable[[MmapDataset], Any]:
    def run(ds: MmapDataset) -> Any:
        with MmapLoader(
            ds,
            1,
            batch_sampler=[BATCH],
            num_workers=workers,
            prefetch=prefetch,
            multiprocessing_context="fork" if workers else None,
        ) as loader:
            batch = next(iter(loader))
            return {k: v.clone() if isinstance(v, torch.Tensor) else exact_copy(v) for k, v in batch.items()}

    return run


def exact_copy(array: np.ndarray) -> np.ndarray:
    """A copy with every byte (numpy's own copy of records leaves their padding undefined)."""
    return np.array(array.view(np.dtype((np.void, array.dtype.itemsize)))).view(array.dtype)


def identity(sample: Any) -> Any:
    return sample


def transformed(path: Callable[[MmapDataset], Any]) -> Callable[[MmapDataset], Any]:
    """The same path over the dataset with a transform, which reads samples one by one."""

    def run(ds: MmapDataset) -> Any:
        return path(MmapDataset(ds.path, fields=list(ds.fields), transform=identity))

    return run


IN_PROCESS = {
    "default_collate(ds.__getitems__)": default_collate_of_getitems,
    "collate(ds.__getitems__)": npz2mmap_collate,
    "PaddedCollate(ds.__getitems__)": padded_collate,
    "collate([ds[i], ...])": collate_of_samples,
    "DataLoader(ConcatDataset, collate_fn=collate)": concat_data_loader,
    "DataLoader": data_loader(0),
    "DataLoader(collate_fn=collate)": data_loader(0, collate),
    "MmapLoader(prefetch=0)": mmap_loader(0),
    "MmapLoader(thread)": mmap_loader(0, prefetch=2),
    "transform, DataLoader": transformed(data_loader(0)),
    "transform, DataLoader(collate_fn=collate)": transformed(data_loader(0, collate)),
    "transform, MmapLoader": transformed(mmap_loader(0)),
}
IN_WORKERS = {
    "DataLoader(num_workers=1)": data_loader(1),
    "DataLoader(num_workers=1, collate_fn=collate)": data_loader(1, collate),
    "MmapLoader(num_workers=1)": mmap_loader(1),
    "transform, DataLoader(num_workers=1)": transformed(data_loader(1)),
    "transform, MmapLoader(num_workers=1)": transformed(mmap_loader(1)),
}


def check_samples(ds: MmapDataset, sources: dict[str, list[np.ndarray]]) -> None:
    """ds[i] and ds.__getitems__ give each 0-d sample as a 0-d array of its bytes, never a numpy scalar."""
    gathered = ds.__getitems__(BATCH)
    for j, i in enumerate(BATCH):
        for name, arrays in sources.items():
            for sample in (ds[i][name], gathered[j][name]):
                assert isinstance(sample, np.ndarray) and sample.shape == ()
                assert sample.dtype == arrays[i].dtype.newbyteorder("<")
                assert as_bytes(sample) == little_endian_bytes(arrays[i])


def check_batch(batch: dict[str, Any], ds: MmapDataset, sources: dict[str, list[np.ndarray]]) -> None:
    """Each field (B,): a tensor where torch has its dtype (as default_collate of ds[i] makes), else numpy."""
    assert sorted(batch) == sorted(sources)
    for name, arrays in sources.items():
        value = batch[name]
        dtype = arrays[0].dtype.newbyteorder("<")
        assert tuple(value.shape) == (len(BATCH),)
        assert as_bytes(value) == b"".join(little_endian_bytes(arrays[i]) for i in BATCH)
        if torch_has(dtype):
            assert type(value) is torch.Tensor
            torch_collated = default_collate([ds[i][name] for i in BATCH])
            assert value.dtype == torch_collated.dtype and as_bytes(value) == as_bytes(torch_collated)
        else:
            assert type(value) is np.ndarray and value.dtype == dtype
            with pytest.raises(TypeError):  # where torch's own collate cannot: what the README says
                default_collate([ds[i][name] for i in BATCH])


def check_paths(
    paths: dict[str, Callable[[MmapDataset], Any]], root: Path, dtypes: list[np.dtype], data: Any
) -> None:
    sources = {
        f"f{k}": [data.draw(hnp.arrays(dtype, ())) for _ in range(NUM_SAMPLES)]
        for k, dtype in enumerate(dtypes)
    }
    write_dataset(root, sources)
    ds = MmapDataset(root)
    check_samples(ds, sources)
    for path in paths.values():
        check_batch(path(ds), ds, sources)
    for name in sources:  # a single field: the bare batch, as the dict's entry
        single = MmapDataset(root, fields=name)
        bare = default_collate(single.__getitems__(BATCH))
        check_batch({name: bare}, ds, {name: sources[name]})
        check_batch({name: collate(single.__getitems__(BATCH))}, ds, {name: sources[name]})


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(dtypes=st.lists(zero_d_dtypes(), min_size=1, max_size=3), data=st.data())
def test_a_0d_field_is_the_same_on_every_path(tmp_path, dtypes, data) -> None:
    check_paths(IN_PROCESS, tmp_path / f"d{len(list(tmp_path.iterdir()))}.mmap", dtypes, data)


@settings(max_examples=4, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(dtypes=st.lists(zero_d_dtypes(), min_size=2, max_size=4), data=st.data())
def test_a_0d_field_from_workers_is_the_same_as_in_process(tmp_path, dtypes, data) -> None:
    check_paths(IN_WORKERS, tmp_path / f"d{len(list(tmp_path.iterdir()))}.mmap", dtypes, data)


EVERY_KIND = [np.dtype(d) for d in ("<i8", "<u8", "<f2", "<c16", "?", "<U3", "S2", "<M8[D]", "<m8[s]")] + [
    RECORD
]


@pytest.mark.parametrize(
    "path", {**IN_PROCESS, **IN_WORKERS}.values(), ids={**IN_PROCESS, **IN_WORKERS}.keys()
)
def test_every_kind_of_0d_field_batches_as_one_array_of_its_samples(tmp_path, path) -> None:
    sources = {
        f"{k}_{dtype.kind}": [np.array(i + 1).astype(dtype) for i in range(NUM_SAMPLES)]
        for k, dtype in enumerate(EVERY_KIND)
    }
    write_dataset(tmp_path / "d.mmap", sources)
    ds = MmapDataset(tmp_path / "d.mmap")
    check_batch(path(ds), ds, sources)


def test_a_0d_string_through_the_dataloader_is_a_numpy_array_not_a_list_of_str(tmp_path) -> None:
    write_dataset(tmp_path / "d.mmap", {"name": [np.array(f"s{i}") for i in range(NUM_SAMPLES)]})
    batch = next(iter(DataLoader(MmapDataset(tmp_path / "d.mmap"), batch_size=2)))
    assert type(batch["name"]) is np.ndarray
    assert batch["name"].tolist() == ["s0", "s1"] and batch["name"].dtype == np.dtype("<U2")


def test_a_0d_uint64_through_the_dataloader_is_a_uint64_tensor(tmp_path) -> None:
    write_dataset(tmp_path / "d.mmap", {"n": [np.uint64(2**64 - 1 - i) for i in range(NUM_SAMPLES)]})
    batch = next(iter(DataLoader(MmapDataset(tmp_path / "d.mmap"), batch_size=2)))
    assert batch["n"].dtype == torch.uint64
    assert batch["n"].numpy().tolist() == [2**64 - 1, 2**64 - 2]


def test_a_string_field_of_any_shape_through_the_dataloader_is_stacked_as_numpy(tmp_path) -> None:
    words = [np.array([f"a{i}", f"bb{i}"]) for i in range(NUM_SAMPLES)]
    write_dataset(tmp_path / "d.mmap", {"words": words})
    ds = MmapDataset(tmp_path / "d.mmap")
    batch = next(iter(DataLoader(ds, batch_sampler=[BATCH])))
    assert type(batch["words"]) is np.ndarray and batch["words"].dtype == np.dtype("<U3")
    np.testing.assert_array_equal(batch["words"], np.stack([words[i] for i in BATCH]))
    np.testing.assert_array_equal(batch["words"], collate(ds.__getitems__(BATCH))["words"])


def test_collate_of_a_plain_list_stacks_a_0d_string_as_numpy(tmp_path) -> None:
    write_dataset(tmp_path / "d.mmap", {"s": [np.array(f"s{i}", "U2") for i in range(NUM_SAMPLES)]})
    ds = MmapDataset(tmp_path / "d.mmap")
    for batch in (collate([ds[0], ds[1]]), concat_data_loader(ds)):
        assert type(batch["s"]) is np.ndarray and batch["s"].dtype == np.dtype("<U2")
    assert collate([ds[0], ds[1]])["s"].tolist() == ["s0", "s1"]
    assert concat_data_loader(ds)["s"].tolist() == [f"s{i}" for i in BATCH]


def assert_same_batch(got: Any, expected: Any) -> None:
    """One type, dtype, shape and every byte (a record's padding too)."""
    assert type(got) is type(expected)
    if isinstance(expected, dict):
        assert list(got) == list(expected)
        for name in expected:
            assert_same_batch(got[name], expected[name])
        return
    assert got.dtype == expected.dtype and tuple(got.shape) == tuple(expected.shape)
    assert as_bytes(got) == as_bytes(expected)


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(dtypes=st.lists(zero_d_dtypes(), min_size=1, max_size=3), data=st.data())
def test_collate_of_a_plain_list_of_samples_equals_collate_of_the_gathered_batch(
    tmp_path, dtypes, data
) -> None:
    root = tmp_path / f"d{len(list(tmp_path.iterdir()))}.mmap"
    sources = {
        f"f{k}": [data.draw(hnp.arrays(d, ())) for _ in range(NUM_SAMPLES)] for k, d in enumerate(dtypes)
    }
    write_dataset(root, sources)
    for fields in (None, "f0"):
        ds = MmapDataset(root, fields=fields)
        expected = collate(ds.__getitems__(BATCH))
        assert_same_batch(collate([ds[i] for i in BATCH]), expected)
        assert_same_batch(concat_data_loader(ds), expected)


BIG_ENDIAN = [">f8", ">f4", ">i4", ">u2", ">c16", ">M8[s]", ">m8[ms]", ">U3", [("a", ">i2"), ("b", ">f8")]]


@pytest.mark.parametrize("dtype", BIG_ENDIAN, ids=str)
@pytest.mark.parametrize("shape", [(), (3,)])
def test_collate_of_big_endian_arrays_keeps_their_values(dtype, shape) -> None:
    """numpy stacks big-endian arrays into a native one: a byte copy must not be read back swapped."""
    rng = np.random.default_rng(0)
    count = max(1, int(np.prod(shape)))
    values = [np.frombuffer(rng.bytes(np.dtype(dtype).itemsize * count), dtype) for _ in range(2)]
    samples = [{"f": v.reshape(shape) if shape else v[0].copy().reshape(())} for v in values]
    samples = [{"f": np.asarray(s["f"], dtype=dtype)} for s in samples]
    out = npz2mmap.collate(samples)["f"]
    expected = np.stack([s["f"] for s in samples])  # numpy's values, in native order
    assert out.shape == expected.shape
    assert np.asarray(out).astype(expected.dtype).tobytes() == expected.tobytes()


def numpy_value_lists() -> st.SearchStrategy[list[Any]]:
    """Lists of numpy values a user's own list of samples may hold: one kind, in dtypes numpy
    promotes to one (strings of other widths, datetimes of other units, either byte order), as
    0-d arrays, arrays of one shape, or scalars (records, datetimes)."""
    kinds = st.sampled_from(
        [
            ["<U1", "<U4", ">U2"],
            ["<M8[D]", "<M8[h]", ">M8[s]"],
            ["<m8[ms]", ">m8[us]"],
            [">i4", "<i4"],
            [">f8", "<f8"],
            ["<S2", "|S5"],
            ["<f4", "<i8"],  # numpy: float64, where torch's promotion takes float32
            ["<i4", "<f4"],
            ["<i1", "<u1"],
            ["<f2", "<f8"],
        ]
    )

    @st.composite
    def lists(draw: st.DrawFn) -> list[Any]:
        dtypes = [np.dtype(d) for d in draw(kinds)]
        shape = draw(st.sampled_from([(), (2,)]))
        size = draw(st.integers(1, 4))
        values = [draw(hnp.arrays(draw(st.sampled_from(dtypes)), shape)) for _ in range(size)]
        as_scalars = shape == () and dtypes[0].kind in "Mm" and draw(st.booleans())
        return [v[()] for v in values] if as_scalars else values

    return lists()


@settings(max_examples=80, deadline=None)
@given(values=numpy_value_lists())
def test_collate_of_numpy_values_of_promotable_dtypes_is_numpys_stack(values) -> None:
    """A plain list (not a dataset's batch) of numpy values torch has no tensor for as they are:
    numpy's own stack of them, a tensor where torch has the (native) dtype."""
    expected = np.stack([np.asarray(v) for v in values])
    with np.errstate(all="ignore"):
        for got in (collate(values), collate([{"f": v} for v in values])["f"]):
            native = expected.dtype.newbyteorder("=")
            if expected.dtype.kind in "iuf":
                assert isinstance(got, torch.Tensor) and got.numpy().dtype == native
                assert np.array_equal(got.numpy(), expected.astype(native), equal_nan=True)
            else:
                assert type(got) is np.ndarray and got.dtype == native
                assert got.tobytes() == expected.astype(native).tobytes()


def test_collate_of_record_scalars_stacks_them() -> None:
    records = np.array([(1, 2.5), (3, -1.0)], dtype=[("a", "<i4"), ("b", "<f4")])
    got = collate(list(records))
    assert type(got) is np.ndarray and got.dtype == records.dtype and got.tobytes() == records.tobytes()
