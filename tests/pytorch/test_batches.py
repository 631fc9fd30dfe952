"""The batch path: __getitems__ + collate, MmapLoader, BlockShuffleSampler."""

from __future__ import annotations

import re

import numpy as np
import pytest
import torch
from conftest import assert_same_array, raises_from_dataloader, write_samples
from torch.utils.data import DataLoader, default_collate

from npz2mmap import BlockShuffleSampler, MmapDataset, MmapLoader, PaddedCollate, collate
from npz2mmap.errors import FormatError
from npz2mmap.pytorch.gathered import GatheredBatch
from npz2mmap.read.reader import DatasetReader
from npz2mmap.write.conversion import convert


def sources_by_label(sources):
    out = {}
    for path in sources:
        with np.load(path) as npz:
            out[int(npz["label"])] = {key: npz[key] for key in npz.files}
    return out


def test_getitems_gathers_each_field_once_and_collate_shares_its_memory(small_dataset) -> None:
    out, sources = small_dataset
    ds = MmapDataset(out, fields=["input", "label"])
    batch = ds.__getitems__([4, 0, -1, 2])
    assert isinstance(batch, GatheredBatch) and len(batch) == 4
    expected = sources_by_label(sources)
    assert batch.arrays["label"].tolist() == [4, 0, 5, 2]
    for j, label in enumerate([4, 0, 5, 2]):
        assert_same_array(batch[j]["input"], expected[label]["input"])
    gathered_at = batch.arrays["input"].ctypes.data
    tensors = collate(batch)
    assert tensors["input"].data_ptr() == gathered_at  # the batch is the gathered memory, no copy
    assert batch.arrays["input"].ctypes.data != gathered_at  # which is the batch's alone now
    assert tensors["input"].shape == (4, 3, 4, 5) and tensors["label"].dtype == torch.int64
    default = default_collate(batch)
    assert torch.equal(default["input"], tensors["input"]) and torch.equal(default["label"], tensors["label"])


def test_gathered_batches_are_copies_safe_to_edit(small_dataset) -> None:
    out, _ = small_dataset
    ds = MmapDataset(out, fields="input")
    first = collate(ds.__getitems__([1, 2]))
    first += 100
    assert torch.equal(collate(ds.__getitems__([1, 2])), torch.from_numpy(np.stack([ds[1], ds[2]])))


def test_contiguous_runs_and_scattered_indices_give_the_same_rows(small_dataset) -> None:
    out, _ = small_dataset
    reader = DatasetReader(out)
    column = reader.column("input")
    assert np.array_equal(reader.gather("input", [1, 2, 3, 4]), column[1:5])
    assert np.array_equal(reader.gather("input", [5, 1, 3]), column[[5, 1, 3]])
    target = np.empty((2, 3, 4, 5), np.float32)
    assert reader.gather("input", [0, 5], out=target) is target
    with pytest.raises(IndexError, match="sample index 6 is out of range for 6 samples"):
        reader.gather("input", [0, 6])


def test_ragged_fields_collate_to_lists_and_transforms_still_apply(small_dataset) -> None:
    out, sources = small_dataset
    expected = sources_by_label(sources)
    batch = collate(MmapDataset(out, fields=["tokens", "label"]).__getitems__([3, 1]))
    assert [t.tolist() for t in batch["tokens"]] == [
        expected[3]["tokens"].tolist(),
        expected[1]["tokens"].tolist(),
    ]
    doubled = MmapDataset(out, fields="label", transform=lambda a: a * 2)
    assert collate(doubled.__getitems__([1, 2])).tolist() == [2, 4]


@pytest.mark.parametrize("workers", [0, 2])
def test_default_collate_lists_ragged_fields_as_the_quick_start_uses_it(small_dataset, workers) -> None:
    """DataLoader(MmapDataset(path)) with no collate_fn works on ragged data: one tensor per sample."""
    out, sources = small_dataset
    expected = sources_by_label(sources)
    loader = DataLoader(MmapDataset(out), batch_size=4, num_workers=workers)
    batches = list(loader)
    assert [len(b["tokens"]) for b in batches] == [4, 2]
    for batch in batches:
        assert batch["input"].shape[1:] == (3, 4, 5) and isinstance(batch["tokens"], list)
        for label, tokens in zip(batch["label"].tolist(), batch["tokens"], strict=True):
            assert tokens.dtype == torch.int32
            assert tokens.numpy().tobytes() == expected[label]["tokens"].tobytes()
    single = default_collate(MmapDataset(out, fields="tokens").__getitems__([2, 0]))
    assert [t.tolist() for t in single] == [expected[2]["tokens"].tolist(), expected[0]["tokens"].tolist()]


@pytest.mark.parametrize("workers", [0, 2])
def test_dataloader_with_the_batch_path_returns_exactly_the_sources(small_dataset, workers) -> None:
    out, sources = small_dataset
    expected = sources_by_label(sources)
    loader = DataLoader(
        MmapDataset(out, fields=["input", "label"]),
        batch_size=4,
        shuffle=True,
        num_workers=workers,
        collate_fn=collate,
    )
    seen = []
    for batch in loader:
        for label, image in zip(batch["label"].tolist(), batch["input"], strict=True):
            assert_same_array(image.numpy(), expected[label]["input"])
            seen.append(label)
    assert sorted(seen) == list(range(6))


def test_mmap_loader_visits_every_sample_once_per_epoch_in_a_new_order(small_dataset) -> None:
    out, sources = small_dataset
    expected = sources_by_label(sources)
    loader = MmapLoader(MmapDataset(out, fields=["input", "label"]), batch_size=4, shuffle=True, seed=3)
    assert len(loader) == 2
    orders = []
    for _ in range(2):
        order = []
        for batch in loader:
            assert isinstance(batch["input"], torch.Tensor)
            for label, image in zip(batch["label"].tolist(), batch["input"], strict=True):
                assert_same_array(image.numpy(), expected[label]["input"])
                order.append(label)
        assert sorted(order) == list(range(6))
        orders.append(order)
    assert orders[0] != orders[1]
    loader.set_epoch(0)
    assert [int(x) for b in loader for x in b["label"]] == orders[0]


def test_mmap_loader_drop_last_sampler_and_single_field(small_dataset) -> None:
    out, _ = small_dataset
    ds = MmapDataset(out, fields="label")
    assert [b.tolist() for b in MmapLoader(ds, batch_size=4, drop_last=True)] == [[0, 1, 2, 3]]
    assert [b.tolist() for b in MmapLoader(ds, batch_size=4, sampler=[5, 4, 3])] == [[5, 4, 3]]
    ragged = next(iter(MmapLoader(MmapDataset(out, fields="tokens"), batch_size=3)))
    assert [len(t) for t in ragged] == [1, 2, 3]
    threaded = MmapLoader(ds, batch_size=4, shuffle=True, seed=9)
    unthreaded = MmapLoader(ds, batch_size=4, shuffle=True, seed=9, prefetch=0)
    assert [b.tolist() for b in threaded] == [b.tolist() for b in unthreaded]


@pytest.mark.parametrize("prefetch", [0, 2])
@pytest.mark.parametrize(
    ("option", "indices", "error", "message"),
    [
        ("sampler", [1, 0.9, 2.5], TypeError, "sample index 0.9 is a float, not an integer"),
        ("sampler", [True, 1], TypeError, "sample index True is a bool, not an integer"),
        ("sampler", [[3, 1], [0, 2]], TypeError, "sample index [3, 1] is a list, not an integer"),
        ("sampler", [0, 2**63], IndexError, "sample index 9223372036854775808 is out of range for 6 samples"),
        ("batch_sampler", [[0.9, 1.9]], TypeError, "sample index 0.9 is a float, not an integer"),
        (
            "batch_sampler",
            [np.array([1.0])],
            TypeError,
            "sample indices must be integers, not an array of float64",
        ),
        ("batch_sampler", [[-(2**64)]], IndexError, "sample index -18446744073709551616 is out of range"),
    ],
)
def test_mmap_loader_refuses_samplers_that_yield_no_integers(
    small_dataset, prefetch, option, indices, error, message
) -> None:
    """numpy used to truncate 0.9 to sample 0, and overflow on 2**63."""
    ds = MmapDataset(small_dataset[0], fields="label")
    loader = MmapLoader(ds, batch_size=2, prefetch=prefetch, **{option: indices})
    with pytest.raises(error, match=re.escape(message)):
        list(loader)


def test_mmap_loader_batches_a_sampler_of_numpy_integers(small_dataset) -> None:
    ds = MmapDataset(small_dataset[0], fields="label")
    sampler = [np.int64(5), np.uint8(4), np.int32(-1), 3, 0]
    assert [b.tolist() for b in MmapLoader(ds, batch_size=2, sampler=sampler)] == [[5, 4], [5, 3], [0]]
    assert [b.tolist() for b in MmapLoader(ds, batch_size=2, sampler=sampler, drop_last=True)] == [
        [5, 4],
        [5, 3],
    ]


def test_mmap_loader_raises_errors_from_its_thread_and_stops_when_left(small_dataset, monkeypatch) -> None:
    out, _ = small_dataset
    loader = MmapLoader(MmapDataset(out, fields="label"), batch_size=1, prefetch=1)
    for _ in loader:
        break  # leaving early must not hang
    calls = []

    def failing_gather(self, name, indices, out=None):
        calls.append(name)
        raise FormatError("field 'label' sample 2: tables are corrupt")

    monkeypatch.setattr("npz2mmap.read.reader.DatasetReader.gather", failing_gather)
    with pytest.raises(FormatError, match="tables are corrupt"):
        list(loader)
    assert calls


def test_block_shuffle_sampler_covers_everything_block_by_block() -> None:
    sampler = BlockShuffleSampler(10, block_size=4, seed=1)
    first = list(sampler)
    assert sorted(first) == list(range(10)) and len(sampler) == 10
    blocks = [i // 4 for i in first]
    assert blocks == sorted(blocks, key=lambda b: blocks.index(b))  # each block read in one stretch
    sampler.set_epoch(1)
    assert list(sampler) != first and sorted(sampler) == list(range(10))


def test_advice_is_checked_and_applied(small_dataset) -> None:
    out, _ = small_dataset
    with pytest.raises(ValueError, match="advice must be one of"):
        MmapDataset(out, advice="fast")
    ds = MmapDataset(out, advice="random")
    assert ds[0]["label"] == 0


def add_one(sample):
    """A transform that keeps every shape, ragged ones included."""
    if isinstance(sample, dict):
        return {name: array + 1 for name, array in sample.items()}
    return sample + 1


TRANSFORMED_RAGGED = (
    r"field 'tokens' is ragged and the transform left it in shapes \(1,\) and \(4,\) in one batch, "
    r"which torch's default collate cannot stack: pass collate_fn=npz2mmap\.collate \(ragged fields as "
    r"lists of tensors\) or collate_fn=npz2mmap\.PaddedCollate\(\) \(padded\) to the DataLoader, or have "
    r"the transform return one shape"
)


@pytest.mark.parametrize("workers", [0, 2])
@pytest.mark.parametrize("fields", [None, "tokens"])
def test_default_collate_of_transformed_ragged_samples_says_what_to_write(
    small_dataset, workers, fields
) -> None:
    out, _ = small_dataset
    loader = DataLoader(MmapDataset(out, fields=fields, transform=add_one), batch_size=4, num_workers=workers)
    raises_from_dataloader(loader, ValueError, TRANSFORMED_RAGGED)


def test_transformed_ragged_samples_come_as_lists_with_npz2mmap_collate(small_dataset) -> None:
    out, sources = small_dataset
    expected = sources_by_label(sources)
    ds = MmapDataset(out, transform=add_one)
    for loader in (DataLoader(ds, batch_size=4, collate_fn=collate), MmapLoader(ds, 4)):
        batch = next(iter(loader))
        assert [t.tolist() for t in batch["tokens"]] == [
            (expected[i]["tokens"] + 1).tolist() for i in range(4)
        ]
        assert batch["label"].tolist() == [1, 2, 3, 4]
        assert torch.equal(
            batch["input"], torch.from_numpy(np.stack([expected[i]["input"] + 1 for i in range(4)]))
        )
    single = next(
        iter(DataLoader(MmapDataset(out, fields="tokens", transform=add_one), 4, collate_fn=collate))
    )
    assert [t.tolist() for t in single] == [(expected[i]["tokens"] + 1).tolist() for i in range(4)]


def test_a_transform_that_makes_a_ragged_field_fixed_still_stacks_by_default(small_dataset) -> None:
    out, sources = small_dataset
    expected = sources_by_label(sources)
    ds = MmapDataset(out, transform=lambda sample: {"tokens": np.resize(sample["tokens"], 3)})
    batch = next(iter(DataLoader(ds, batch_size=4)))
    assert batch["tokens"].tolist() == [np.resize(expected[i]["tokens"], 3).tolist() for i in range(4)]


def _identity(sample):
    return sample


@pytest.mark.parametrize("how", ["MmapLoader", "MmapLoader workers", "DataLoader", "DataLoader collate"])
def test_a_transform_keeps_fields_of_dtypes_torch_lacks_as_numpy_as_without_one(tmp_path, how) -> None:
    record = np.dtype([("a", "<i2"), ("b", "<f8")])
    sources = [
        {
            "x": np.full(3, i, dtype=np.float32),
            "u": np.array([f"w{i}", "zz"], dtype="<U4"),
            "r": np.array([(i, 0.5)], dtype=record),
        }
        for i in range(6)
    ]
    write_samples(tmp_path / "src", sources)
    convert([tmp_path / "src"], tmp_path / "ds")
    ds = MmapDataset(tmp_path / "ds", transform=_identity)
    if how.startswith("MmapLoader"):
        loader = MmapLoader(ds, 4, num_workers=2 if how.endswith("workers") else 0)
    else:
        loader = DataLoader(ds, batch_size=4, collate_fn=collate if how.endswith("collate") else None)
    batch = next(iter(loader))
    assert isinstance(batch["x"], torch.Tensor)
    assert batch["x"].tolist() == [[float(i)] * 3 for i in range(4)]
    for name in ("u", "r"):
        assert type(batch[name]) is np.ndarray, name
        assert_same_array(batch[name], np.stack([s[name] for s in sources[:4]]))
    if hasattr(loader, "close"):
        loader.close()


def _collate_noting_shared_memory(batch):
    """collate, plus which of its tensors were made in shared memory (checked inside the worker)."""
    out = PaddedCollate()(batch) if batch.ragged else collate(batch)
    return out, {name: value.is_shared() for name, value in out.items() if isinstance(value, torch.Tensor)}


@pytest.mark.parametrize("ragged", [False, True])
def test_a_dataloader_worker_gathers_the_batch_straight_into_shared_memory(tmp_path, ragged) -> None:
    sources = [
        {"x": np.arange(i, i + (2 + i % 3 if ragged else 3), dtype=np.float32), "y": np.int64(i)}
        for i in range(10)
    ]
    write_samples(tmp_path / "src", sources)
    convert([tmp_path / "src"], tmp_path / "ds")
    ds = MmapDataset(tmp_path / "ds")
    loader = DataLoader(ds, batch_size=4, num_workers=2, collate_fn=_collate_noting_shared_memory)
    seen = 0
    for batch, shared in loader:
        assert shared == ({"x": True, "x_lengths": True, "y": True} if ragged else {"x": True, "y": True})
        for row, label in enumerate(batch["y"].tolist()):
            source = sources[label]["x"]
            assert batch["x"][row, : len(source)].numpy().tobytes() == source.tobytes()
            assert not batch["x"][row, len(source) :].any()
        seen += len(batch["y"])
    assert seen == len(sources)
    batch, shared = _collate_noting_shared_memory(ds.__getitems__([0, 1]))  # not in a worker: private
    assert not any(shared.values())


def test_without_torchs_shared_storage_a_dataloader_worker_gathers_privately(tmp_path, monkeypatch) -> None:
    """A torch lacking the private call the gather into shared memory uses: the same batches, copied."""
    monkeypatch.delattr(torch.TypedStorage, "_new_shared")
    sources = [{"x": np.arange(i, i + 3, dtype=np.float32), "y": np.int64(i)} for i in range(6)]
    write_samples(tmp_path / "src", sources)
    convert([tmp_path / "src"], tmp_path / "ds")
    loader = DataLoader(MmapDataset(tmp_path / "ds"), batch_size=4, num_workers=1, collate_fn=collate)
    batches = list(loader)
    assert [b["y"].tolist() for b in batches] == [[0, 1, 2, 3], [4, 5]]
    assert torch.equal(
        torch.cat([b["x"] for b in batches]), torch.from_numpy(np.stack([s["x"] for s in sources]))
    )


def test_torchs_default_collate_of_a_gathered_batch_copies_no_fixed_field(small_dataset) -> None:
    """DataLoader's default collate takes the gathered arrays as the batch's tensors (torch.stack
    of the sample views made a second copy); of the samples in a list of one's own, it stacks."""
    out, sources = small_dataset
    ds = MmapDataset(out)
    gathered = ds.__getitems__([4, 1, 1])
    gathered_at = {name: gathered.arrays[name].ctypes.data for name in ("input", "label")}
    batch = default_collate(gathered)
    for name in ("input", "label"):
        assert batch[name].data_ptr() == gathered_at[name]
    rearranged = default_collate(list(gathered))
    assert rearranged["input"].data_ptr() != batch["input"].data_ptr()
    for name in ("input", "label"):
        assert torch.equal(rearranged[name], batch[name])
    assert [t.tolist() for t in rearranged["tokens"]] == [t.tolist() for t in batch["tokens"]]
    assert batch["label"].tolist() == [4, 1, 1]


def test_the_column_of_a_ragged_field_is_a_usage_error_not_a_damaged_dataset(tmp_path) -> None:
    write_samples(tmp_path / "src", [{"tokens": np.arange(n)} for n in (1, 3)])
    convert([tmp_path / "src"], tmp_path / "ds", workers=1)
    with pytest.raises(ValueError) as raised:
        DatasetReader(tmp_path / "ds").column("tokens")
    assert not isinstance(raised.value, FormatError)  # FormatError says the dataset is damaged
    assert str(raised.value) == (
        "field 'tokens' is ragged, so it has no column: read it sample by sample "
        "(view('tokens', i)) or as padded rows (ragged_rows('tokens', indices))"
    )
