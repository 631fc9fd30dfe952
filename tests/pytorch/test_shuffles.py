"""The shuffles for data larger than memory: BlockShuffleSampler(interleave=, dataset=) and ShuffleSampler.

Oracles: the epoch's order against its definition (every sample once, the
shares of DistributedSampler under DDP, each window drawn from its own
blocks), the reads each sampler asks for against the order it then yields,
and batches through DataLoader against the source files' bytes.
"""

from __future__ import annotations

import multiprocessing
import re
from collections import Counter
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from conftest import write_npz
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.utils.data import DataLoader

import npz2mmap
from npz2mmap import BlockShuffleSampler, MmapDataset, ShuffleSampler
from npz2mmap.pytorch import dataset, samplers
from npz2mmap.pytorch.samplers import READ_CHUNK
from npz2mmap.read import reader
from npz2mmap.read.memory import MemoryLimit

sampler_settings = st.fixed_dictionaries(
    {
        "num_samples": st.integers(0, 300),
        "block_size": st.integers(1, 40),
        "interleave": st.integers(1, 6),
        "world": st.integers(1, 4),
        "drop_last": st.booleans(),
        "epoch": st.integers(0, 3),
    }
)


def epoch_orders(kind: str, case: dict[str, Any]) -> list[list[int]]:
    """One epoch of every rank's sampler."""
    orders = []
    for rank in range(case["world"]):
        common = {"num_replicas": case["world"], "rank": rank, "drop_last": case["drop_last"]}
        if kind == "block":
            sampler: Any = BlockShuffleSampler(
                case["num_samples"], case["block_size"], seed=5, interleave=case["interleave"], **common
            )
        else:
            sampler = ShuffleSampler(case["num_samples"], seed=5, **common)
        sampler.set_epoch(case["epoch"])
        orders.append(list(sampler))
        assert len(orders[-1]) == len(sampler)
    return orders


@pytest.mark.parametrize("kind", ["block", "shuffle"])
@settings(max_examples=120, deadline=None)
@given(case=sampler_settings)
def test_ranks_share_an_epoch_as_distributed_sampler_does(kind, case) -> None:
    n, world = case["num_samples"], case["world"]
    orders = epoch_orders(kind, case)
    share = n // world if case["drop_last"] else -(-n // world)
    assert [len(order) for order in orders] == [share] * world  # DDP needs as many steps on every rank
    counts = Counter(i for order in orders for i in order)
    assert set(counts) <= set(range(n))
    if case["drop_last"]:
        assert max(counts.values(), default=1) == 1 and len(counts) == share * world
    else:
        assert set(counts) == set(range(n)) and sum(counts.values()) - n < world


@settings(max_examples=120, deadline=None)
@given(case=sampler_settings)
def test_each_window_draws_from_its_own_few_blocks(case) -> None:
    """Cut at the window sizes, a rank's order is each window's samples, from at most
    ``interleave`` blocks (plus the pieces at a share's edges), never mixed with another window's."""
    case = {**case, "world": 1, "drop_last": False}
    sampler = BlockShuffleSampler(
        case["num_samples"], case["block_size"], seed=5, interleave=case["interleave"]
    )
    sampler.set_epoch(case["epoch"])
    windows = sampler.windows(np.random.default_rng((5, case["epoch"])))
    order, position = list(sampler), 0
    for window in windows:
        size = sum(stop - start for start, stop in window)
        drawn = order[position : position + size]
        position += size
        assert sorted(drawn) == sorted(i for start, stop in window for i in range(start, stop))
        assert len({i // case["block_size"] for i in drawn}) <= case["interleave"]
    assert position == len(order) == case["num_samples"]


def test_interleaving_mixes_batches_from_many_blocks() -> None:
    """The point of interleave: a batch of 64 draws from many blocks, where one block at a time gives one."""

    def mean_blocks_per_batch(sampler: BlockShuffleSampler) -> float:
        order = np.array(list(sampler))
        return float(np.mean([len(set(b // 256)) for b in np.array_split(order, len(order) // 64)]))

    assert mean_blocks_per_batch(BlockShuffleSampler(16_384, 256)) <= 1.1
    assert mean_blocks_per_batch(BlockShuffleSampler(16_384, 256, interleave=16)) >= 14


class RecordingDataset:
    """Stands for an MmapDataset that reads exactly: records each read the sampler asks for."""

    exact_reads = True
    fields = ("x",)

    def __init__(self, num_samples: int) -> None:
        self.num_samples = num_samples
        self.asked: list[np.ndarray] = []
        self.reader = self

    def __len__(self) -> int:
        return self.num_samples

    def will_need(self, names: Any, indices: np.ndarray) -> int:
        assert tuple(names) == self.fields
        self.asked.append(np.array(indices))
        return 1


@pytest.mark.parametrize("read_ahead", [0, 1, 63, 64, 200])
@pytest.mark.parametrize("skip", [0, 5, 130])
def test_shuffle_sampler_asks_for_each_sample_read_ahead_before_yielding_it(read_ahead, skip) -> None:
    ds = RecordingDataset(300)
    reference = list(ShuffleSampler(300, seed=2))
    sampler = ShuffleSampler(ds, seed=2, read_ahead=read_ahead)
    sampler.load_state_dict({"epoch": 0, "seed": 2, "yielded": skip})
    yielded = []
    for index in sampler:
        asked = [int(i) for a in ds.asked for i in a]
        if read_ahead:
            assert index in asked  # asked for before it is yielded...
            assert len(asked) <= len(yielded) + read_ahead + READ_CHUNK  # ...within the budget
        yielded.append(index)
    assert yielded == reference[skip:]
    asked = [int(i) for a in ds.asked for i in a]
    assert asked == (reference[skip:] if read_ahead else [])  # each once, none of the skipped


def test_block_sampler_asks_for_a_window_whole_before_its_first_sample() -> None:
    ds = RecordingDataset(1000)
    sampler = BlockShuffleSampler(1000, 50, seed=4, interleave=3, dataset=ds)
    windows = sampler.windows(np.random.default_rng((4, 0)))
    whole = [sorted(i for start, stop in window for i in range(start, stop)) for window in windows]
    position, ends = 0, np.cumsum([len(w) for w in whole])
    for index in sampler:
        k = int(np.searchsorted(ends, position, side="right"))  # the window this sample is in
        assert index in whole[k]
        asked = [sorted(a.tolist()) for a in ds.asked]
        assert asked == whole[: min(k + 2, len(whole))]  # this window and the next, each whole
        position += 1


@pytest.fixture(scope="module")
def exact_dataset(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[np.ndarray]]:
    root = tmp_path_factory.mktemp("shuffles")
    rng = np.random.default_rng(0)
    images = [rng.integers(0, 255, (3, 8, 8), dtype=np.uint8) for _ in range(150)]
    for i, image in enumerate(images):
        write_npz(root / "src" / f"{i:03d}.npz", image=image, label=np.int64(i))
    npz2mmap.convert([root / "src"], root / "dataset")
    return root / "dataset", images


@pytest.mark.parametrize("madvise", ["present", "missing"])
@pytest.mark.parametrize("num_workers", [0, 2])
@pytest.mark.parametrize("kind", ["block", "shuffle"])
def test_batches_through_the_read_ahead_samplers_are_the_sources(
    exact_dataset, monkeypatch, madvise, num_workers, kind
) -> None:
    path, images = exact_dataset
    if madvise == "missing":  # as on Windows: no hints, each sample read as it is copied
        monkeypatch.setattr(reader, "ADVICE", {})
        monkeypatch.setattr(dataset, "ADVICE", {})
    ds = MmapDataset(path, reads="exact")
    if kind == "block":
        sampler: Any = BlockShuffleSampler(len(ds), 16, seed=1, interleave=3, dataset=ds)
    else:
        sampler = ShuffleSampler(ds, seed=1, read_ahead=40)
    order = list(sampler)
    sampler.set_epoch(0)  # the same epoch again (without it, the next pass is the next epoch)
    context = {"multiprocessing_context": "fork"} if num_workers else {}
    loader = DataLoader(ds, batch_size=8, sampler=sampler, num_workers=num_workers, **context)
    labels, got = [], []
    for batch in loader:
        labels += batch["label"].tolist()
        got += list(batch["image"].numpy())
    assert labels == order and sorted(order) == list(range(len(images)))
    assert all(g.tobytes() == images[i].tobytes() for g, i in zip(got, labels, strict=True))


@pytest.mark.parametrize("num_workers", [0, 2])
@pytest.mark.parametrize("kind", ["block", "shuffle"])
def test_mmap_loader_resumes_the_read_ahead_samplers_exactly(exact_dataset, num_workers, kind) -> None:
    path, _ = exact_dataset
    ds = MmapDataset(path, fields="label", reads="exact")

    def make() -> npz2mmap.MmapLoader:
        if kind == "block":
            sampler: Any = BlockShuffleSampler(
                len(ds), 16, seed=1, interleave=3, dataset=ds, num_replicas=2, rank=1
            )
        else:
            sampler = ShuffleSampler(ds, seed=1, read_ahead=20, num_replicas=2, rank=1)
        context = {"multiprocessing_context": "fork"} if num_workers else {}
        return npz2mmap.MmapLoader(ds, 8, sampler=sampler, num_workers=num_workers, **context)

    with make() as whole:
        whole.set_epoch(2)
        uninterrupted = [b.tolist() for b in whole]
    for cut in (1, 4):
        with make() as first:
            first.set_epoch(2)
            for k, _ in enumerate(first):
                if k == cut - 1:
                    state = first.state_dict()
                    break
        with make() as resumed:
            resumed.load_state_dict(state)
            assert [b.tolist() for b in resumed] == uninterrupted[cut:]


@pytest.mark.parametrize(
    ("options", "error", "message"),
    [
        ({"seed": 1.5}, TypeError, "seed must be an int, not 1.5"),
        ({"seed": True}, TypeError, "seed must be an int, not True"),
        ({"seed": -1}, ValueError, "seed must be at least 0"),
        ({"batch_size": True}, TypeError, "batch_size must be an int, not True"),
        ({"prefetch": 2.0}, TypeError, "prefetch must be an int, not 2.0"),
        ({"batch_size": 0}, ValueError, "batch_size must be at least 1, got 0"),
        ({"prefetch": -1}, ValueError, "prefetch must be at least 0, got -1"),
        ({"num_workers": -2}, ValueError, "num_workers must be at least 0, got -2"),
        ({"read_ahead": -1}, ValueError, "read_ahead must be at least 0, got -1"),
        (
            {"num_workers": 1, "multiprocessing_context": "bogus"},
            ValueError,
            "multiprocessing_context must name a start method of this platform "
            f"({', '.join(multiprocessing.get_all_start_methods())}), not 'bogus'",
        ),
        (
            {"num_workers": 1, "multiprocessing_context": 1},
            TypeError,
            "multiprocessing_context must be a start method's name or a multiprocessing context, not 1",
        ),
        (
            {"multiprocessing_context": "spawn"},
            ValueError,
            "multiprocessing_context is for worker processes, which num_workers=0 does not start: "
            "pass num_workers=1 or more, or leave multiprocessing_context out",
        ),
    ],
)
def test_mmap_loader_checks_its_numbers_when_made(exact_dataset, options, error, message) -> None:
    """As DataLoader does: at construction, not from numpy's generator (or multiprocessing) at the
    first batch."""
    ds = MmapDataset(exact_dataset[0])
    with pytest.raises(error, match=f"^{re.escape(message)}"):
        npz2mmap.MmapLoader(ds, **{"batch_size": 4, **options})


def limited_to(monkeypatch: pytest.MonkeyPatch, nbytes: int) -> None:
    """Make the memory this process may use ``nbytes`` for the auto-sized window."""
    monkeypatch.setattr(samplers, "memory_limit", lambda: MemoryLimit(nbytes, "a test's limit"))


@pytest.mark.parametrize("limit_blocks, expected", [(0, 1), (3, 3), (5.9, 5), (10**6, 10)])
def test_an_auto_window_holds_two_windows_in_a_quarter_of_the_memory(
    exact_dataset, monkeypatch, limit_blocks, expected
) -> None:
    path, _ = exact_dataset
    ds = MmapDataset(path)
    blob = sum(index.blob_nbytes for index in ds.parts.indexes)
    block_nbytes = 16 * (blob // len(ds))
    limited_to(monkeypatch, int(limit_blocks * block_nbytes * 2 / samplers.WINDOW_FRACTION))
    sampler = BlockShuffleSampler(len(ds), 16, interleave="auto", dataset=ds)
    assert sampler.interleave == expected  # 150 samples: 10 blocks of 16 at most
    assert sorted(sampler) == list(range(len(ds)))


def test_an_auto_window_needs_the_dataset() -> None:
    with pytest.raises(ValueError, match=r"interleave='auto' sizes the window .* pass dataset=ds"):
        BlockShuffleSampler(100, 16, interleave="auto")


@pytest.mark.parametrize("saved_with", [1, 3])
def test_an_auto_window_resumes_with_the_interleave_it_was_saved_with(
    exact_dataset, monkeypatch, saved_with
) -> None:
    path, _ = exact_dataset
    ds = MmapDataset(path)
    blob = sum(index.blob_nbytes for index in ds.parts.indexes)
    block_limit = 16 * (blob // len(ds)) * 2 / samplers.WINDOW_FRACTION
    limited_to(monkeypatch, int(saved_with * block_limit))
    saved = BlockShuffleSampler(len(ds), 16, seed=4, interleave="auto", dataset=ds)
    order = list(saved)
    saved.set_epoch(0)  # the same epoch again
    saved_iter = iter(saved)
    for _ in range(37):
        next(saved_iter)
    state = saved.state_dict()
    limited_to(monkeypatch, int(7 * block_limit))  # another machine: it would choose 7
    resumed = BlockShuffleSampler(len(ds), 16, seed=4, interleave="auto", dataset=ds)
    assert resumed.interleave == 7
    resumed.load_state_dict(state)
    assert resumed.interleave == saved_with and list(resumed) == order[37:]
    fixed = BlockShuffleSampler(len(ds), 16, seed=4, interleave=7, dataset=ds)
    with pytest.raises(ValueError, match=f"sampler state has interleave {saved_with}, this sampler has 7"):
        fixed.load_state_dict(state)


def test_a_block_sampler_given_a_dataset_of_another_size_is_refused(exact_dataset) -> None:
    """BlockShuffleSampler(5, dataset=ds) of a 150-sample ds yielded samples 0..4 only."""
    ds = MmapDataset(exact_dataset[0])
    message = f"num_samples is 5 but the dataset has {len(ds)} samples: pass len(ds)"
    with pytest.raises(ValueError, match=f"^{re.escape(message)}$"):
        BlockShuffleSampler(5, dataset=ds)
    assert sorted(BlockShuffleSampler(len(ds), dataset=ds)) == list(range(len(ds)))
