"""MmapLoader with worker processes: batches written into a shared ring, read as views."""

from __future__ import annotations

import functools
import gc
import multiprocessing
import os
import pickle
import re
import signal
import subprocess
import sys
import threading
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from conftest import REPO_ROOT, write_samples
from torch.utils.data import DataLoader, DistributedSampler

import npz2mmap
from npz2mmap import (
    BlockShuffleSampler,
    LengthGroupedSampler,
    MmapDataset,
    MmapLoader,
    PaddedCollate,
    ShuffleSampler,
)
from npz2mmap.errors import WorkerError
from npz2mmap.pytorch import ring
from npz2mmap.pytorch.assemble import NewMemory
from npz2mmap.read.parts import PartsReader
from npz2mmap.write.conversion import convert

NUM_SAMPLES = 37
SHM_DIR = Path("/dev/shm")


@pytest.fixture(scope="module")
def dataset_dir(tmp_path_factory) -> Path:
    """37 samples: a fixed float image, the sample's own index as label, ragged tokens."""
    root = tmp_path_factory.mktemp("ring")
    rng = np.random.default_rng(13)
    samples = [
        {
            "input": rng.standard_normal((3, 4, 5)).astype(np.float32),
            "label": np.int64(i),
            "tokens": rng.integers(0, 1000, size=int(rng.integers(1, 9))).astype(np.int32),
        }
        for i in range(NUM_SAMPLES)
    ]
    write_samples(root / "src", samples)
    convert([root / "src"], root / "dataset", workers=1)
    return root


@pytest.fixture(scope="module")
def sources(dataset_dir) -> list[dict[str, np.ndarray]]:
    """The oracle: every source file loaded whole into RAM with np.load, sample i = file i."""
    out = []
    for path in sorted((dataset_dir / "src").glob("*.npz")):
        with np.load(path) as npz:
            out.append({key: npz[key] for key in npz.files})
    return out


def flip_and_scale(sample: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """A per-sample transform (module level, so spawn workers can import it)."""
    return {**sample, "input": sample["input"][:, ::-1] * 2}


def with_other_values(sample: dict[str, np.ndarray]) -> dict[str, Any]:
    """A transform whose values are not all arrays of one shape: each is collated as torch would."""
    label = int(sample["label"])
    return {
        "input": sample["input"].astype(np.float64) if label % 2 else sample["input"].astype(np.float32),
        "label": sample["label"],
        "tokens": sample["tokens"],
        "scale": 0.5 * label,
        "name": f"s{label}",
        "pair": (np.arange(3) * label, label),
    }


def add_one_to_inputs(batch: dict[str, Any]) -> dict[str, Any]:
    return {**batch, "input": batch["input"] + 1, "extra": ("kept", 7)}


def labels_and_inputs(samples: Any) -> dict[str, Any]:
    """A collate_fn: labels as one tensor, inputs as a list, plus a non-tensor leaf."""
    return {
        "label": torch.tensor([int(s["label"]) for s in samples]),
        "inputs": [torch.from_numpy(np.array(s["input"])) for s in samples],
        "note": "ok",
    }


class FailOn:
    """A transform that raises on one sample (its label), as a user's augmentation might."""

    def __init__(self, label: int, error: type[Exception] = ValueError) -> None:
        self.label = label
        self.error = error

    def __call__(self, sample: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        if int(sample["label"]) == self.label:
            raise self.error(f"bad sample {self.label}")
        return sample


class Unpicklable(Exception):
    def __init__(self, message: str, extra: object = None) -> None:  # pickling drops ``extra``: unpicklable
        super().__init__(message)
        self.extra = extra

    def __reduce__(self):  # type: ignore[no-untyped-def]
        raise TypeError("not picklable")


def clone(tree: Any) -> Any:
    if isinstance(tree, torch.Tensor):
        return tree.clone()
    if isinstance(tree, np.ndarray):
        return tree.copy()
    if isinstance(tree, dict):
        return {key: clone(value) for key, value in tree.items()}
    if isinstance(tree, (list, tuple)):
        return type(tree)(clone(value) for value in tree)
    return tree


def assert_same(a: Any, b: Any) -> None:
    """Exactly equal trees: same types, dtypes, shapes and values."""
    assert type(a) is type(b), (type(a), type(b))
    if isinstance(a, torch.Tensor):
        assert a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)
    elif isinstance(a, np.ndarray):
        assert a.dtype == b.dtype and a.shape == b.shape and a.tobytes() == b.tobytes()
    elif isinstance(a, dict):
        assert list(a) == list(b)
        for key in a:
            assert_same(a[key], b[key])
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b)
        for x, y in zip(a, b, strict=True):
            assert_same(x, y)
    else:
        assert a == b


def epochs(loader: MmapLoader, count: int = 2, set_epoch: bool = False) -> list[Any]:
    out = []
    for epoch in range(count):
        if set_epoch:
            loader.set_epoch(epoch)
        out.append([clone(batch) for batch in loader])
    return out


def check_against_sources(
    batch: dict[str, Any], sources: list[dict[str, np.ndarray]], transformed: bool
) -> None:
    """Each row equals its source file's arrays (found by the label, which is the sample index)."""
    for row, label in enumerate(batch["label"].tolist()):
        source = sources[label]
        expected = source["input"][:, ::-1] * 2 if transformed else source["input"]
        assert batch["input"][row].numpy().tobytes() == np.ascontiguousarray(expected).tobytes()
        if "tokens" in batch:
            assert batch["tokens"][row].numpy().tobytes() == source["tokens"].tobytes()


CONFIGS: dict[str, dict[str, Any]] = {
    "shuffle": {"shuffle": True, "seed": 5},
    "drop_last": {"shuffle": True, "drop_last": True, "seed": 0},
    "transform": {"shuffle": True, "dataset": {"transform": flip_and_scale}, "seed": 0},
    "other_values": {"dataset": {"transform": with_other_values}, "batch_size": 4},
    "batch_transform": {"batch_transform": add_one_to_inputs, "dataset": {"fields": ["input", "label"]}},
    "collate_fn": {"collate_fn": labels_and_inputs},
    "padded": {"collate_fn": PaddedCollate(mask=True), "shuffle": True, "seed": 0},
}


@pytest.mark.parametrize("num_workers", [1, 2])
@pytest.mark.parametrize("config", list(CONFIGS))
def test_batches_equal_the_single_process_loader_and_the_sources(
    dataset_dir, sources, config, num_workers
) -> None:
    options = dict(CONFIGS[config])
    ds = MmapDataset(dataset_dir / "dataset", **options.pop("dataset", {}))
    batch_size = options.pop("batch_size", 5)
    expected = epochs(MmapLoader(ds, batch_size, prefetch=0, **options))
    with MmapLoader(
        ds, batch_size, num_workers=num_workers, multiprocessing_context="fork" if num_workers else None, **options
    ) as loader:
        got = epochs(loader)
    assert_same(got, expected)
    expected_len = NUM_SAMPLES // batch_size if config == "drop_last" else -(-NUM_SAMPLES // batch_size)
    assert len(got[0]) == expected_len
    if config in ("shuffle", "drop_last", "transform"):
        assert labels(got[0]) != labels(got[1])
        for batch in got[0]:
            check_against_sources(batch, sources, transformed=config == "transform")
        seen = sorted(label for batch in labels(got[1]) for label in batch)
        if config == "drop_last":
            assert len(set(seen)) == len(seen) == NUM_SAMPLES // 5 * 5
        else:
            assert seen == list(range(NUM_SAMPLES))


def labels(batches: list[dict[str, Any]]) -> list[list[int]]:
    return [batch["label"].tolist() for batch in batches]


def loader_with_sampler(ds: MmapDataset, option: str, **options: Any) -> MmapLoader:
    if option == "sampler":
        return MmapLoader(ds, 4, sampler=BlockShuffleSampler(len(ds), 8, seed=2), **options)
    sampler = LengthGroupedSampler(ds.lengths("tokens"), 4, pool_batches=2, seed=2)
    return MmapLoader(ds, 4, batch_sampler=sampler, collate_fn=PaddedCollate(), **options)


@pytest.mark.parametrize("option", ["sampler", "batch_sampler"])
def test_samplers_and_set_epoch_give_the_single_process_order(dataset_dir, sources, option) -> None:
    ds = MmapDataset(dataset_dir / "dataset")
    expected = epochs(loader_with_sampler(ds, option, prefetch=0), set_epoch=True)
    with loader_with_sampler(ds, option, num_workers=2, multiprocessing_context="fork") as loader:
        got = epochs(loader, set_epoch=True)
    assert_same(got, expected)
    assert labels(got[0]) != labels(got[1])
    assert sorted(label for batch in labels(got[0]) for label in batch) == list(range(NUM_SAMPLES))
    for batch in got[0]:
        for row, label in enumerate(batch["label"].tolist()):
            assert batch["input"][row].numpy().tobytes() == sources[label]["input"].tobytes()


@pytest.mark.parametrize("method", ["spawn", "forkserver"])
def test_spawn_and_forkserver_workers_give_the_same_batches(dataset_dir, method) -> None:
    """Each worker imports torch: one worker, one small run."""
    ds = MmapDataset(dataset_dir / "dataset", transform=flip_and_scale)
    expected = epochs(MmapLoader(ds, 8, shuffle=True, seed=0, prefetch=0), count=1)
    before = shm_entries()
    with MmapLoader(ds, 8, shuffle=True, seed=0, num_workers=1, multiprocessing_context=method) as loader:
        got = epochs(loader, count=1)
        pids = worker_pids(loader)
    assert_same(got, expected)
    assert_no_shm_entry_of(before, [os.getpid(), *pids])


def worker_pids(loader: MmapLoader) -> list[int]:
    assert loader._workers is not None
    return [process.pid for process in loader._workers.pool.processes]


def shm_entries() -> set[str]:
    return set(os.listdir(SHM_DIR)) if SHM_DIR.is_dir() else set()


def assert_no_shm_entry_of(before: set[str], pids: list[int]) -> None:
    """No new /dev/shm entry made by these processes (others' tests may add their own meanwhile)."""
    new = shm_entries() - before
    ours = [name for name in new if any(re.search(rf"(?<!\d){pid}(?!\d)", name) for pid in pids)]
    assert ours == []


def test_the_ring_is_an_unlinked_file_and_nothing_is_left_in_dev_shm(dataset_dir) -> None:
    ds = MmapDataset(dataset_dir / "dataset")
    before = shm_entries()
    loader = MmapLoader(ds, 4, num_workers=2, multiprocessing_context="fork")
    for _ in loader:
        pids = worker_pids(loader)
        assert_no_shm_entry_of(before, [os.getpid(), *pids])
        if sys.platform.startswith("linux"):  # the block is a file in /dev/shm, mapped, its name gone
            maps = Path("/proc/self/maps").read_text().splitlines()
            ring = [line for line in maps if f"/pym-{os.getpid()}-" in line]
            assert ring and all(line.endswith("(deleted)") for line in ring)
    with pytest.raises(WorkerError):
        list(MmapLoader(MmapDataset(dataset_dir / "dataset", transform=FailOn(3)), 4, num_workers=1))
    loader.close()
    assert_no_shm_entry_of(before, [os.getpid(), *pids])


def test_a_batch_stays_valid_until_the_next_is_requested_and_only_reused_slots_change(dataset_dir) -> None:
    ds = MmapDataset(dataset_dir / "dataset", fields="input")
    expected = [clone(b) for b in MmapLoader(ds, 3, shuffle=True, seed=0, prefetch=0)]
    with MmapLoader(ds, 3, shuffle=True, seed=0, num_workers=2, prefetch=2, multiprocessing_context="fork") as loader:
        held = []
        for k, batch in enumerate(loader):
            time.sleep(0.002)  # let the workers run ahead into the free slots
            assert torch.equal(batch, expected[k])  # the batch in hand is never overwritten
            held.append(batch)
        num_slots = loader._workers.pool.ring.num_slots  # type: ignore[union-attr]
    assert num_slots == 4
    # The first batches' slots were reused by later batches; the last num_slots were not.
    changed = [k for k, batch in enumerate(held) if not torch.equal(batch, expected[k])]
    assert changed == list(range(len(held) - num_slots))
    assert batch.data_ptr() != expected[-1].data_ptr()


def test_a_worker_exception_names_worker_batch_and_samples_and_chains_the_original(dataset_dir) -> None:
    ds = MmapDataset(dataset_dir / "dataset", transform=FailOn(label=11))
    loader = MmapLoader(ds, 4, num_workers=2, multiprocessing_context="fork")
    yielded = []
    with pytest.raises(WorkerError) as caught:
        for batch in loader:
            yielded.append(batch["label"].tolist())
    assert yielded == [[0, 1, 2, 3], [4, 5, 6, 7]]  # every batch before the failing one, in order
    assert str(caught.value) == (
        "MmapLoader worker 0 failed on batch 2 (samples 8, 9, 10, 11): ValueError: bad sample 11"
    )
    original = caught.value.__cause__
    assert type(original) is ValueError and str(original) == "bad sample 11"
    assert "in __call__" in str(original.__cause__) and "ValueError: bad sample 11" in str(original.__cause__)
    pids = worker_pids(loader)  # the workers stay for the next pass
    assert all(os.path.exists(f"/proc/{pid}") for pid in pids) or sys.platform != "linux"
    loader.close()


def test_an_unpicklable_worker_exception_comes_as_its_traceback(dataset_dir) -> None:
    ds = MmapDataset(dataset_dir / "dataset", transform=FailOn(label=2, error=Unpicklable))
    with MmapLoader(ds, 4, num_workers=1, multiprocessing_context="fork") as loader:
        with pytest.raises(WorkerError, match=r"worker 0 failed on batch 0 \(samples 0, 1, 2, 3\)") as caught:
            list(loader)
    assert "Unpicklable: bad sample 2" in str(caught.value)
    assert "Traceback" in str(caught.value.__cause__) and "Unpicklable: bad sample 2" in str(
        caught.value.__cause__
    )


@pytest.mark.skipif(not hasattr(signal, "SIGKILL"), reason="no SIGKILL")
def test_a_worker_killed_mid_epoch_raises_within_seconds_and_the_next_pass_starts_anew(dataset_dir) -> None:
    ds = MmapDataset(dataset_dir / "dataset", fields="label")
    loader = MmapLoader(ds, 2, num_workers=2, multiprocessing_context="fork")
    batches = iter(loader)
    next(batches)
    victim = worker_pids(loader)[1]
    os.kill(victim, signal.SIGKILL)
    start = time.monotonic()
    with pytest.raises(
        RuntimeError, match=rf"MmapLoader worker 1 \(pid {victim}\) was killed by signal SIGKILL"
    ):
        for _ in batches:
            pass
    assert time.monotonic() - start < 10
    assert loader._workers is None  # stopped; the next pass starts new workers
    assert [b.tolist() for b in loader][:2] == [[0, 1], [2, 3]]
    loader.close()


def test_close_and_with_leave_no_process(dataset_dir) -> None:
    ds = MmapDataset(dataset_dir / "dataset", fields="label")
    with MmapLoader(ds, 4, num_workers=2, multiprocessing_context="fork") as loader:
        next(iter(loader))
        processes = list(loader._workers.pool.processes)  # type: ignore[union-attr]
        for batch in loader:  # a second pass keeps the same workers
            assert list(loader._workers.pool.processes) == processes  # type: ignore[union-attr]
            del batch
    assert all(process.exitcode is not None for process in processes)
    dropped = MmapLoader(ds, 4, num_workers=1, multiprocessing_context="fork")
    next(iter(dropped))
    processes = list(dropped._workers.pool.processes)  # type: ignore[union-attr]
    del dropped
    gc.collect()
    assert all(process.exitcode is not None for process in processes)


@pytest.mark.parametrize("num_workers,prefetch", [(0, 0), (0, 2), (2, 2)])
def test_resume_from_state_dict_equals_the_tail_of_an_uninterrupted_run(
    dataset_dir, num_workers, prefetch
) -> None:
    ds = MmapDataset(dataset_dir / "dataset", fields=["input", "label"])
    options = {"num_workers": num_workers, "prefetch": prefetch, "multiprocessing_context": "fork" if num_workers else None}
    with MmapLoader(ds, 4, shuffle=True, seed=1, **options) as whole:
        uninterrupted = epochs(whole, count=3)
    with MmapLoader(ds, 4, shuffle=True, seed=1, **options) as first:
        list(first)
        for k, _ in enumerate(first):
            if k == 3:
                state = first.state_dict()
                break
    assert state == {
        "epoch": 1,
        "seed": 1,
        "batches_yielded": 4,
        "batch_size": 4,
        "num_samples": 37,
        "shuffle": True,
        "drop_last": False,
        "sampler_settings": {},
    }
    with MmapLoader(ds, 4, shuffle=True, seed=1, **options) as resumed:
        resumed.load_state_dict(state)
        assert resumed.state_dict() == state
        tail = epochs(resumed, count=2)
    assert_same(tail, [uninterrupted[1][4:], uninterrupted[2]])


@pytest.mark.parametrize("context", ["spawn", "forkserver"])
def test_a_state_resumes_exactly_under_spawn_and_forkserver_workers(dataset_dir, context) -> None:
    """Workers that import the script afresh (and seed nothing of their own) continue a saved epoch
    exactly as a loader without workers would."""
    ds = MmapDataset(dataset_dir / "dataset", fields=["input", "label"])
    with MmapLoader(ds, 4, shuffle=True, seed=3) as whole:
        uninterrupted = epochs(whole, count=2)
    with MmapLoader(ds, 4, shuffle=True, seed=3) as first:
        for k, _ in enumerate(first):
            if k == 5:
                state = first.state_dict()
                break
    with MmapLoader(ds, 4, shuffle=True, seed=3, num_workers=2, multiprocessing_context=context) as resumed:
        resumed.load_state_dict(state)
        tail = epochs(resumed, count=2)
    assert_same(tail, [uninterrupted[0][6:], uninterrupted[1]])


def test_resume_skips_batches_without_loading_them_and_restores_sampler_state(dataset_dir) -> None:
    ds = MmapDataset(dataset_dir / "dataset", fields="label")
    calls = []

    def counting(batch: Any) -> Any:
        calls.append(batch)
        return batch

    def sampler() -> BlockShuffleSampler:
        return BlockShuffleSampler(len(ds), 8, seed=3)

    uninterrupted = epochs(MmapLoader(ds, 4, sampler=sampler(), prefetch=0), count=2, set_epoch=True)
    with MmapLoader(ds, 4, sampler=sampler(), seed=0, num_workers=2, multiprocessing_context="fork") as interrupted:
        interrupted.set_epoch(1)
        for k, _ in enumerate(interrupted):
            if k == 5:
                break
        state = interrupted.state_dict()
    assert state == {
        "epoch": 1,
        "seed": 0,
        "batches_yielded": 6,
        "batch_size": 4,
        "num_samples": 37,
        "shuffle": False,
        "drop_last": False,
        "sampler_settings": {"sampler": {"type": "BlockShuffleSampler"}},
        "sampler": {"sampler": "BlockShuffleSampler", "epoch": 1, "seed": 3, "yielded": 0, "num_samples": 37, "block_size": 8, "interleave": 1, "num_replicas": 1, "rank": 0, "drop_last": 0},
    }
    resumed = MmapLoader(ds, 4, sampler=sampler(), prefetch=0, batch_transform=counting)
    resumed.load_state_dict(state)
    resumed.set_epoch(1)  # as the training loop does again after resuming: the same epoch keeps the resume
    tail = [clone(b) for b in resumed]
    assert_same(tail, uninterrupted[1][6:])
    assert len(calls) == len(tail)  # the skipped batches were never loaded
    seeded = MmapLoader(ds, 4, sampler=sampler(), seed=0, prefetch=0)
    seeded.load_state_dict({**state, "seed": 4})  # the sampler gives the order: the seed decides nothing
    shuffled = MmapLoader(ds, 4, shuffle=True, seed=0, prefetch=0)
    with pytest.raises(ValueError, match="loader state has seed 4, this loader has seed 0"):
        shuffled.load_state_dict({**MmapLoader(ds, 4, shuffle=True, seed=4).state_dict(), "batches_yielded": 1})


@pytest.mark.parametrize("way", [{}, {"transform": flip_and_scale}, {"collate": True}])
def test_a_batch_larger_than_its_slot_goes_pickled_with_one_warning(dataset_dir, way) -> None:
    ds = MmapDataset(dataset_dir / "dataset", transform=way.get("transform"))
    options = {"collate_fn": labels_and_inputs} if way.get("collate") else {}
    expected = epochs(MmapLoader(ds, 5, prefetch=0, **options), count=1)
    with pytest.warns(
        RuntimeWarning, match="more than a ring slot's 128; .* pass a larger slot_nbytes"
    ) as caught:
        with MmapLoader(
            ds, 5, num_workers=1, slot_nbytes=128, multiprocessing_context="fork", **options
        ) as loader:
            got = epochs(loader, count=1)
    assert_same(got, expected)
    assert len([w for w in caught if "ring slot" in str(w.message)]) == 1


def test_a_bad_index_of_the_order_is_raised_in_its_turn(dataset_dir) -> None:
    ds = MmapDataset(dataset_dir / "dataset", fields="label")
    order = [0, 1, 2, 3, 4, 5, NUM_SAMPLES, 6]
    for num_workers in (0, 2):
        loader = MmapLoader(ds, 2, sampler=order, num_workers=num_workers, multiprocessing_context="fork" if num_workers else None)
        yielded = []
        with pytest.raises(
            IndexError, match=f"sample index {NUM_SAMPLES} is out of range for {NUM_SAMPLES} samples"
        ):
            for batch in loader:
                yielded.append(batch.tolist())
        assert yielded == [[0, 1], [2, 3], [4, 5]]
        loader.close()


def test_the_default_slot_holds_twice_the_largest_batch(dataset_dir) -> None:
    from npz2mmap.pytorch.slots import default_slot_nbytes

    ds = MmapDataset(dataset_dir / "dataset")
    longest = max(len(ds[i]["tokens"]) for i in range(len(ds)))
    per_sample = (60 * 4 + 64) + (8 + 64) + (longest * 4 + 64)
    assert default_slot_nbytes(ds, 10) == -(-(2 * 10 * per_sample + (1 << 20)) // 64) * 64


class FakeCudart:
    def __init__(self) -> None:
        self.calls: list[tuple[str, int, int]] = []

    def cudaHostRegister(self, address: int, nbytes: int, flags: int) -> int:  # noqa: N802 (CUDA's name)
        self.calls.append(("register", address, nbytes))
        return 0

    def cudaHostUnregister(self, address: int) -> int:  # noqa: N802
        self.calls.append(("unregister", address, 0))
        return 0


class FakeEvent:
    """A CUDA event that never passes by itself, as if the device lagged far behind: until
    ``synchronize()``, the batch in hand when it was recorded may still be being copied."""

    in_hand: list[tuple[torch.Tensor, torch.Tensor]] = []  # (the batch, a copy of it)
    synced: list[bool] = []

    def record(self) -> None:
        self.batch, self.copy = self.in_hand[-1]

    def query(self) -> bool:
        return False

    def synchronize(self) -> None:
        self.synced.append(torch.equal(self.batch, self.copy))


def test_pin_memory_registers_the_ring_once_and_refills_a_slot_only_after_its_copy(
    dataset_dir, monkeypatch
) -> None:
    """No GPU here: torch.cuda is faked; the batches must lie inside the registered range."""
    cudart = FakeCudart()
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "cudart", lambda: cudart)
    monkeypatch.setattr(torch.cuda, "Event", FakeEvent)
    ds = MmapDataset(dataset_dir / "dataset", fields="input")
    expected = [clone(b) for b in MmapLoader(ds, 4, prefetch=0)]
    with MmapLoader(ds, 4, num_workers=2, pin_memory=True, multiprocessing_context="fork") as loader:
        for _ in range(2):
            for k, batch in enumerate(loader):
                assert torch.equal(batch, expected[k])
                FakeEvent.in_hand.append((batch, batch.clone()))
                time.sleep(0.002)  # let the workers write into whatever slot they were given
                (kind, address, nbytes), *_ = cudart.calls
                assert address <= batch.data_ptr() < batch.data_ptr() + batch.nbytes <= address + nbytes
    assert [c[0] for c in cudart.calls] == ["register", "unregister"]
    assert cudart.calls[0][1] == cudart.calls[1][1]
    assert len(FakeEvent.synced) >= len(expected) and all(FakeEvent.synced)


TRAINER = """
import os, sys, time
from npz2mmap import MmapDataset, MmapLoader
loader = MmapLoader(MmapDataset(sys.argv[1], fields="label"), 2, num_workers=2, multiprocessing_context="fork")
for batch in loader:
    print(os.getpid(), *[p.pid for p in loader._workers.pool.processes], flush=True)
    time.sleep(60)
"""


def trainer_process(script: str, dataset_dir: Path, **options: Any) -> subprocess.Popen[str]:
    """``script`` run by a new Python on ``dataset_dir``'s dataset, this checkout importable."""
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT)}
    return subprocess.Popen(
        [sys.executable, "-c", script, str(dataset_dir / "dataset")],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
        **options,
    )


def start_trainer(dataset_dir: Path) -> tuple[subprocess.Popen[str], list[int]]:
    trainer = trainer_process(TRAINER, dataset_dir)
    assert trainer.stdout is not None
    pids = [int(pid) for pid in trainer.stdout.readline().split()]
    assert len(pids) == 3, trainer.stderr.read() if trainer.stderr else ""
    return trainer, pids


def wait_gone(pids: list[int], timeout_s: float = 10) -> list[int]:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        alive = [pid for pid in pids if Path(f"/proc/{pid}").exists() and "Z" not in _state(pid)]
        if not alive:
            return []
        time.sleep(0.05)
    return alive


def _state(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return "Z"


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_workers_exit_when_the_trainer_is_killed_and_leave_nothing_in_dev_shm(dataset_dir) -> None:
    before = shm_entries()
    trainer, pids = start_trainer(dataset_dir)
    trainer.kill()
    trainer.wait()
    assert wait_gone(pids[1:]) == []
    assert_no_shm_entry_of(before, pids)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_ctrl_c_stops_the_trainer_and_its_workers_with_no_worker_traceback(dataset_dir) -> None:
    trainer, pids = start_trainer(dataset_dir)
    for pid in pids:  # as a terminal's Ctrl-C reaches the whole process group
        os.kill(pid, signal.SIGINT)
    _, stderr = trainer.communicate(timeout=30)
    assert trainer.returncode != 0
    assert stderr.count("Traceback") == 1 and stderr.rstrip().endswith("KeyboardInterrupt"), stderr
    assert wait_gone(pids[1:]) == []


@pytest.mark.parametrize("num_workers,prefetch", [(0, 0), (0, 2), (2, 2)])
def test_leaving_a_pass_early_lets_the_next_pass_start_clean(dataset_dir, num_workers, prefetch) -> None:
    """One pass at a time, with workers or without: a second iterator would count its batches
    into the same state_dict, and a resume from it would skip batches neither yielded."""
    ds = MmapDataset(dataset_dir / "dataset", fields="label")
    expected = [b.tolist() for b in MmapLoader(ds, 3, prefetch=0)]
    options = {"num_workers": num_workers, "prefetch": prefetch, "multiprocessing_context": "fork" if num_workers else None}
    with MmapLoader(ds, 3, **options) as loader:
        for k, _ in enumerate(loader):
            if k == 1:
                break  # batches still in flight finish into their slots, then are dropped
        assert [b.tolist() for b in loader] == expected
        first = iter(loader)
        next(first)
        with pytest.raises(RuntimeError, match="one pass at a time"):
            next(iter(loader))
        assert loader.state_dict()["batches_yielded"] == 1  # the refused pass changed nothing
        saved = loader.state_dict()
        with pytest.raises(RuntimeError, match=r"^MmapLoader.load_state_dict during a pass: finish the pass"):
            loader.load_state_dict(saved)  # it would leave this pass as it is and skip the next one's batches
        assert [b.tolist() for b in first] == expected[1:]
        assert [b.tolist() for b in loader] == expected  # the next pass whole
        loader.load_state_dict(saved)  # between passes: the next pass resumes after batch 1
        assert [b.tolist() for b in loader] == expected[1:]


def test_a_transform_spawn_cannot_pickle_is_refused_and_leaves_no_worker(dataset_dir) -> None:
    ds = MmapDataset(dataset_dir / "dataset", transform=lambda sample: sample)
    loader = MmapLoader(ds, 4, num_workers=2, multiprocessing_context="spawn")
    children = set(multiprocessing.active_children())
    with pytest.raises((AttributeError, pickle.PicklingError), match="pickle"):
        next(iter(loader))
    assert loader._workers is None and set(multiprocessing.active_children()) == children
    loader.close()


def test_a_worker_that_cannot_start_stops_those_started(dataset_dir, monkeypatch) -> None:
    fork_process = multiprocessing.get_context("fork").Process
    started = []

    def start_once(self) -> None:  # type: ignore[no-untyped-def]
        if started:
            raise OSError(11, "Resource temporarily unavailable")
        multiprocessing.process.BaseProcess.start(self)
        started.append(self)

    monkeypatch.setattr(fork_process, "start", start_once)
    loader = MmapLoader(
        MmapDataset(dataset_dir / "dataset"), 4, num_workers=2, multiprocessing_context="fork"
    )
    with pytest.raises(OSError, match="Resource temporarily unavailable"):
        next(iter(loader))
    assert len(started) == 1 and started[0].exitcode is not None
    assert loader._workers is None


# Batches written straight into the slot: PaddedCollate, and ragged fields with the default collate.


@pytest.fixture(scope="module")
def parts_dir(tmp_path_factory, sources) -> list[Path]:
    """The same 37 samples as two parts (0..19, 20..36), read as one dataset."""
    root = tmp_path_factory.mktemp("ring-parts")
    out = []
    for name, chosen in (("a", sources[:20]), ("b", sources[20:])):
        write_samples(root / f"src-{name}", chosen)
        convert([root / f"src-{name}"], root / name, workers=1)
        out.append(root / name)
    return out


def padded_oracle(
    sources: list[dict[str, np.ndarray]], indices: list[int], pad_value: int, mask: bool
) -> dict[str, np.ndarray]:
    """What PaddedCollate must give for ``indices``, padded from np.load's arrays by plain numpy."""
    tokens = [sources[i]["tokens"] for i in indices]
    width = max(len(t) for t in tokens)
    padded = np.full((len(indices), width), pad_value, dtype=np.int32)
    for row, t in zip(padded, tokens, strict=True):
        row[: len(t)] = t
    lengths = np.array([len(t) for t in tokens], dtype=np.int64)
    out = {
        "input": np.stack([sources[i]["input"] for i in indices]),
        "label": np.array([sources[i]["label"] for i in indices], dtype=np.int64),
        "tokens": padded,
        "tokens_lengths": lengths,
    }
    if mask:
        out["tokens_mask"] = np.arange(width) < lengths[:, None]
    return out


def assert_padded_equals_oracle(batch: dict[str, Any], expected: dict[str, np.ndarray]) -> None:
    assert sorted(batch) == sorted(expected)
    for key, array in expected.items():
        got = batch[key].numpy()
        assert got.dtype == array.dtype and got.shape == array.shape, key
        assert got.tobytes() == array.tobytes(), key


def in_ring(loader: MmapLoader, tensor: torch.Tensor) -> bool:
    ring = loader._workers.pool.ring  # type: ignore[union-attr]
    start = ring.address()
    return start <= tensor.data_ptr() and tensor.data_ptr() + tensor.nbytes <= start + ring.nbytes


def refuse(*args: Any, **kwargs: Any) -> Any:
    raise AssertionError("a worker made a private copy of the batch")


# Duplicates, and the longest sample (index 2 has 8 tokens) beside short ones.
ORDER_WITH_DUPLICATES = [3, 3, 0, 36, 3, 17, 2, 2, 20, 19, 21, 5, 5, 5]


@pytest.mark.parametrize("num_workers", [1, 2])
@pytest.mark.parametrize("options", [{}, {"mask": True}, {"pad_value": -7, "mask": True}])
@pytest.mark.parametrize("parts", [False, True])
def test_padded_batches_are_written_straight_into_the_slot_exactly(
    dataset_dir, parts_dir, sources, monkeypatch, num_workers, options, parts
) -> None:
    path = parts_dir if parts else dataset_dir / "dataset"
    ds = MmapDataset(path, fields=["input", "label", "tokens"])
    collate_fn = PaddedCollate(**options)
    loader_options = {"sampler": ORDER_WITH_DUPLICATES, "collate_fn": collate_fn}
    expected = epochs(MmapLoader(ds, 4, prefetch=0, **loader_options), count=1)[0]
    # Forked workers inherit this: a worker that pads into memory of its own first fails.
    monkeypatch.setattr(NewMemory, "array", refuse)
    with MmapLoader(
        ds, 4, num_workers=num_workers, multiprocessing_context="fork" if num_workers else None, **loader_options
    ) as loader:
        got = []
        for batch in loader:
            assert all(in_ring(loader, tensor) for tensor in batch.values())
            got.append(clone(batch))
    assert_same(got, expected)
    for k, batch in enumerate(got):
        indices = ORDER_WITH_DUPLICATES[4 * k : 4 * k + 4]
        expected_batch = padded_oracle(
            sources, indices, options.get("pad_value", 0), options.get("mask", False)
        )
        assert_padded_equals_oracle(batch, expected_batch)


@pytest.mark.parametrize("num_workers", [1, 2])
@pytest.mark.parametrize("parts", [False, True])
def test_ragged_samples_are_packed_into_the_slot_one_copy_each(
    dataset_dir, parts_dir, sources, monkeypatch, num_workers, parts
) -> None:
    path = parts_dir if parts else dataset_dir / "dataset"
    ds = MmapDataset(path, fields=["tokens", "label"])
    expected = epochs(MmapLoader(ds, 4, prefetch=0, sampler=ORDER_WITH_DUPLICATES), count=1)[0]
    # No sample read on its own: the worker copies them from where the batch's rows lie.
    monkeypatch.setattr(PartsReader, "view", refuse)
    with MmapLoader(
        ds, 4, num_workers=num_workers, sampler=ORDER_WITH_DUPLICATES, multiprocessing_context="fork"
    ) as loader:
        got = []
        for batch in loader:
            assert all(in_ring(loader, tensor) for tensor in batch["tokens"])
            got.append(clone(batch))
    assert_same(got, expected)
    labels_seen = [label for batch in got for label in batch["label"].tolist()]
    assert labels_seen == ORDER_WITH_DUPLICATES
    for batch in got:
        for tokens, label in zip(batch["tokens"], batch["label"].tolist(), strict=True):
            assert (
                tokens.dtype == torch.int32 and tokens.numpy().tobytes() == sources[label]["tokens"].tobytes()
            )


@pytest.mark.parametrize("collate_fn", [None, PaddedCollate(mask=True, pad_value=9)])
def test_a_padded_or_ragged_batch_larger_than_its_slot_still_comes_exactly(dataset_dir, collate_fn) -> None:
    ds = MmapDataset(dataset_dir / "dataset")
    options = {"sampler": ORDER_WITH_DUPLICATES, "collate_fn": collate_fn}
    expected = epochs(MmapLoader(ds, 4, prefetch=0, **options), count=1)
    with pytest.warns(RuntimeWarning, match="more than a ring slot's 256"):
        with MmapLoader(
            ds, 4, num_workers=2, slot_nbytes=256, multiprocessing_context="fork", **options
        ) as loader:
            got = epochs(loader, count=1)
    assert_same(got, expected)


def test_state_dict_between_passes_carries_the_sampler_state(dataset_dir) -> None:
    ds = MmapDataset(dataset_dir / "dataset", fields="label")

    def loader_of(sampler: BlockShuffleSampler) -> MmapLoader:
        return MmapLoader(ds, 4, sampler=sampler, seed=0, prefetch=0)

    first = loader_of(BlockShuffleSampler(len(ds), 8, seed=3))
    assert first.state_dict()["sampler"] == {
        "sampler": "BlockShuffleSampler",
        "epoch": 0,
        "seed": 3,
        "yielded": 0,
        "num_samples": 37,
        "block_size": 8,
        "interleave": 1,
        "num_replicas": 1,
        "rank": 0,
        "drop_last": 0,
    }
    first.set_epoch(2)
    epoch_2 = [b.tolist() for b in first]
    state = first.state_dict()
    assert state == {
        "epoch": 2,
        "seed": 0,
        "batches_yielded": 0,
        "batch_size": 4,
        "num_samples": 37,
        "shuffle": False,
        "drop_last": False,
        "sampler_settings": {"sampler": {"type": "BlockShuffleSampler"}},
        # no set_epoch since: the next pass is this epoch again, from its start, as DistributedSampler's
        "sampler": {"sampler": "BlockShuffleSampler", "epoch": 2, "seed": 3, "yielded": 0, "num_samples": 37, "block_size": 8, "interleave": 1, "num_replicas": 1, "rank": 0, "drop_last": 0},
    }
    with pytest.warns(npz2mmap.errors.SameEpochWarning):
        next_pass = [b.tolist() for b in first]
    assert next_pass == epoch_2
    resumed = loader_of(BlockShuffleSampler(len(ds), 8, seed=3))
    resumed.load_state_dict(state)
    assert [b.tolist() for b in resumed] == next_pass
    first.set_epoch(3)  # after a pass, before the next: that epoch, from its start
    state = first.state_dict()
    assert state["sampler"] == {"sampler": "BlockShuffleSampler", "epoch": 3, "seed": 3, "yielded": 0, "num_samples": 37, "block_size": 8, "interleave": 1, "num_replicas": 1, "rank": 0, "drop_last": 0}
    resumed = loader_of(BlockShuffleSampler(len(ds), 8, seed=3))
    resumed.load_state_dict(state)
    resumed.set_epoch(3)
    third = [b.tolist() for b in first]
    assert [b.tolist() for b in resumed] == third != next_pass


def test_ragged_samples_of_any_ndim_and_dtypes_torch_lacks_are_packed_exactly(tmp_path) -> None:
    rng = np.random.default_rng(4)
    samples = [
        {
            "boxes": rng.standard_normal((int(rng.integers(0, 5)), 3)).astype(np.float64),
            "words": np.array(["ab", "cde", "f"][: int(rng.integers(0, 4))], dtype="<U3"),
            "label": np.int64(i),
        }
        for i in range(11)
    ]
    write_samples(tmp_path / "src", samples)
    convert([tmp_path / "src"], tmp_path / "dataset", workers=1)
    ds = MmapDataset(tmp_path / "dataset")
    order = [4, 4, 0, 10, 7, 1, 2, 9, 3]
    expected = epochs(MmapLoader(ds, 3, prefetch=0, sampler=order), count=1)
    with MmapLoader(ds, 3, num_workers=2, sampler=order, multiprocessing_context="fork") as loader:
        got = epochs(loader, count=1)
    assert_same(got, expected)
    for batch in got[0]:
        for row, label in enumerate(batch["label"].tolist()):
            assert batch["boxes"][row].numpy().tobytes() == samples[label]["boxes"].tobytes()
            words = batch["words"][row]
            assert type(words) is np.ndarray and words.tolist() == samples[label]["words"].tolist()


# Trainer side


class StopOn:
    """A transform that SIGSTOPs its own worker on one sample (a stuck worker, as a debugger or deadlock leaves it)."""

    def __init__(self, label: int) -> None:
        self.label = label

    def __call__(self, sample: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        if int(sample["label"]) == self.label:
            os.kill(os.getpid(), signal.SIGSTOP)
        return sample


class alarm_after:
    """Fail the test (TimeoutError) instead of hanging it, should the code under test never return."""

    def __init__(self, seconds: int) -> None:
        self.seconds = seconds

    def __enter__(self) -> None:
        def fail(*_: Any) -> None:
            raise TimeoutError(f"still waiting after {self.seconds} s")

        self.previous = signal.signal(signal.SIGALRM, fail)
        signal.alarm(self.seconds)

    def __exit__(self, *exc_info: object) -> None:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, self.previous)


def stopped_worker_loader(dataset_dir: Path, timeout: float = 3) -> MmapLoader:
    """Batch 1 (samples 3-5) goes to worker 1, which stops itself on sample 3 and never answers."""
    ds = MmapDataset(dataset_dir / "dataset", fields=["label"], transform=StopOn(3))
    return MmapLoader(ds, 3, num_workers=2, multiprocessing_context="fork", timeout=timeout)


@pytest.mark.skipif(not hasattr(signal, "SIGSTOP") or not hasattr(signal, "SIGALRM"), reason="POSIX signals")
def test_a_stuck_worker_raises_after_the_timeout_naming_it_and_the_workers_are_stopped(dataset_dir) -> None:
    loader = stopped_worker_loader(dataset_dir)
    batches = iter(loader)
    with alarm_after(60):
        assert next(batches)["label"].tolist() == [0, 1, 2]
        pids = [process.pid for process in loader._workers.pool.processes]  # type: ignore[union-attr]
        with pytest.raises(WorkerError) as caught:
            next(batches)
    assert str(caught.value) == (
        f"MmapLoader worker 1 (pid {pids[1]}) sent no batch 1 within the timeout of 3 s (its first batch: "
        "still starting? A spawned worker imports torch first); the workers were stopped"
    )
    assert loader._workers is None and wait_gone(pids) == []


@pytest.mark.skipif(not hasattr(signal, "SIGSTOP") or not hasattr(signal, "SIGALRM"), reason="POSIX signals")
def test_leaving_a_pass_waits_for_a_stuck_worker_at_most_the_timeout(dataset_dir) -> None:
    loader = stopped_worker_loader(dataset_dir)
    with alarm_after(60):
        for batch in loader:
            pids = [process.pid for process in loader._workers.pool.processes]  # type: ignore[union-attr]
            assert batch["label"].tolist() == [0, 1, 2]
            break  # batch 1 is in flight, with the stopped worker
    assert loader._workers is None and wait_gone(pids) == []


@pytest.mark.skipif(not hasattr(signal, "SIGSTOP") or not hasattr(signal, "SIGALRM"), reason="POSIX signals")
def test_leaving_a_pass_with_a_stuck_worker_and_no_timeout_stops_the_workers(
    dataset_dir, monkeypatch
) -> None:
    monkeypatch.setattr(ring, "DRAIN_TIMEOUT_S", 1.0)
    loader = stopped_worker_loader(dataset_dir, timeout=0)
    with alarm_after(60):
        for batch in loader:
            pids = [process.pid for process in loader._workers.pool.processes]  # type: ignore[union-attr]
            assert batch["label"].tolist() == [0, 1, 2]
            break
    assert loader._workers is None and wait_gone(pids) == []


@pytest.mark.parametrize(
    ("timeout", "error", "message"),
    [
        (-1, ValueError, "timeout must be from 0 to 10,000,000 seconds (0: no limit), got -1"),
        (float("nan"), ValueError, "timeout must be from 0 to 10,000,000 seconds (0: no limit), got nan"),
        (float("inf"), ValueError, "timeout must be from 0 to 10,000,000 seconds (0: no limit), got inf"),
        (1e12, ValueError, "timeout must be from 0 to 10,000,000 seconds (0: no limit), got 1000000000000.0"),
        (None, TypeError, "timeout must be a number of seconds (0: no limit), not None"),
        ("3", TypeError, "timeout must be a number of seconds (0: no limit), not '3'"),
    ],
)
def test_timeout_must_be_a_number_of_seconds_a_clock_can_wait(dataset_dir, timeout, error, message) -> None:
    with pytest.raises(error) as caught:
        MmapLoader(MmapDataset(dataset_dir / "dataset"), 3, num_workers=1, timeout=timeout)
    assert str(caught.value) == message


def collect_garbage(sample: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """A transform that runs the cyclic garbage collector in the worker, as any allocation may."""
    gc.collect()
    return sample


class Trainer:
    """Holds its loader in a reference cycle: dropped, it waits for the cyclic garbage collector."""

    def __init__(self, dataset_dir: Path) -> None:
        ds = MmapDataset(dataset_dir / "dataset", fields=["label"])
        self.loader = MmapLoader(ds, 4, num_workers=2, multiprocessing_context="fork")
        self.me = self


def test_a_dropped_loader_collected_in_another_loaders_forked_worker_leaves_its_workers_alone(
    dataset_dir, capfd
) -> None:
    gc.disable()  # as when the collector has not run since the first loader was dropped
    try:
        trainer = Trainer(dataset_dir)
        next(iter(trainer.loader))
        first_workers = list(trainer.loader._workers.pool.processes)  # type: ignore[union-attr]
        del trainer
        ds = MmapDataset(dataset_dir / "dataset", fields=["label"], transform=collect_garbage)
        with MmapLoader(ds, 4, num_workers=2, multiprocessing_context="fork") as second:
            labels = [label for batch in second for label in batch["label"].tolist()]
        assert labels == list(range(NUM_SAMPLES))
        # The second loader's workers collected a copy of the first: it must not have stopped the originals.
        assert all(process.is_alive() for process in first_workers)
        assert capfd.readouterr().err == ""
    finally:
        gc.enable()
        gc.collect()
    assert wait_gone([process.pid for process in first_workers]) == []


def test_a_ring_the_system_cannot_allocate_is_a_one_line_error_naming_its_size(dataset_dir) -> None:
    ds = MmapDataset(dataset_dir / "dataset", fields=["label"])
    loader = MmapLoader(ds, 4, num_workers=2, slot_nbytes=1 << 45, multiprocessing_context="fork")
    children = set(multiprocessing.active_children())
    with pytest.raises(WorkerError) as caught:
        next(iter(loader))
    message = str(caught.value)
    assert message.startswith(
        f"MmapLoader could not allocate its ring of {4 << 45} bytes (4 slots of slot_nbytes={1 << 45}): "
    )
    assert message.endswith("; pass a smaller slot_nbytes") and "\n" not in message
    assert loader._workers is None and set(multiprocessing.active_children()) == children


UNIMPORTABLE_COLLATE = """
import sys
from npz2mmap import MmapDataset, MmapLoader, collate
from npz2mmap.errors import WorkerError

if __name__ == "__main__":
    class Collate:  # the workers import this file as another module: they do not see it
        def __call__(self, samples):
            return collate(samples)

    for method in ("spawn", "forkserver"):
        loader = MmapLoader(MmapDataset(sys.argv[1], fields=["label"]), 4, num_workers=1,
                            collate_fn=Collate(), multiprocessing_context=method)
        try:
            next(iter(loader))
        except WorkerError as error:
            print(error, flush=True)
"""


@pytest.mark.skipif(os.name != "posix", reason="forkserver")
def test_a_worker_dying_before_its_first_batch_under_spawn_says_what_must_be_importable(
    dataset_dir, tmp_path
) -> None:
    script = tmp_path / "train.py"
    script.write_text(UNIMPORTABLE_COLLATE)
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT)}
    done = subprocess.run(
        [sys.executable, str(script), str(dataset_dir / "dataset")],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )
    lines = done.stdout.splitlines()
    assert len(lines) == 2, done.stdout + done.stderr
    for method, line in zip(("spawn", "forkserver"), lines, strict=True):
        assert re.fullmatch(
            rf"MmapLoader worker 0 \(pid \d+\) exited with code 1 before its first batch \(under {method}, "
            r"each worker imports the main script: start the loader under `if __name__ == \"__main__\":`, "
            r"and define the dataset, transforms and collate_fn at module level, outside that block and "
            r"outside functions\) while batch 0 was being loaded; the workers were stopped",
            line,
        ), line


def test_slots_are_sized_for_the_batch_samplers_own_batch_size(tmp_path) -> None:
    samples = [{"image": np.full((128, 128), i, dtype=np.float32)} for i in range(40)]  # 64 KiB each
    write_samples(tmp_path / "src", samples)
    convert([tmp_path / "src"], tmp_path / "dataset", workers=1)
    ds = MmapDataset(tmp_path / "dataset", fields="image")
    batches = torch.utils.data.BatchSampler(range(40), batch_size=32, drop_last=False)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a batch going pickled warns: here, none may
        with MmapLoader(
            ds, 1, batch_sampler=batches, num_workers=2, multiprocessing_context="fork"
        ) as loader:
            got = [batch.clone() for batch in loader]
    assert [b.shape[0] for b in got] == [32, 8]
    assert np.array_equal(torch.cat(got).numpy(), np.stack([s["image"] for s in samples]))
    lengths = LengthGroupedSampler([1] * 40, batch_size=32)
    assert MmapLoader(ds, 1, batch_sampler=lengths)._largest_batch_size() == 32


SPAWNING_TRAINER = """
import sys
from npz2mmap import MmapDataset, MmapLoader
loader = MmapLoader(MmapDataset(sys.argv[1], fields=["label"]), 2, num_workers=2, multiprocessing_context="spawn")
for batch in loader:
    pass
"""


def spawned_children(group: int) -> list[int]:
    """The pids of the process group's processes that multiprocessing spawned."""
    found = []
    for entry in Path("/proc").iterdir():
        try:
            if entry.name.isdigit() and os.getpgid(int(entry.name)) == group:
                if b"spawn_main" in (entry / "cmdline").read_bytes():
                    found.append(int(entry.name))
        except OSError:
            continue
    return found


def sigint_disposition(pid: int) -> str:
    """'ignored', 'caught' (Python's KeyboardInterrupt handler) or 'default', from /proc."""
    try:
        status = dict(line.split(":", 1) for line in Path(f"/proc/{pid}/status").read_text().splitlines())
    except OSError:
        return "default"
    bit = 1 << (signal.SIGINT - 1)
    if int(status["SigIgn"], 16) & bit:
        return "ignored"
    return "caught" if int(status["SigCgt"], 16) & bit else "default"


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_ctrl_c_while_spawn_workers_start_prints_no_worker_traceback_and_leaves_no_process(
    dataset_dir,
) -> None:
    trainer = trainer_process(SPAWNING_TRAINER, dataset_dir, start_new_session=True)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and trainer.poll() is None:
        # Both started, each past Python's start-up (a SIGINT before it would kill a worker silently),
        # and the trainer itself listens to Ctrl-C again (it ignores it while a worker starts).
        workers = spawned_children(trainer.pid)
        if (
            len(workers) == 2
            and all(sigint_disposition(pid) != "default" for pid in workers)
            and sigint_disposition(trainer.pid) != "ignored"
        ):
            break
        time.sleep(0.01)
    workers = spawned_children(trainer.pid)
    assert len(workers) == 2, "the workers did not start"
    os.killpg(trainer.pid, signal.SIGINT)  # as a terminal's Ctrl-C, while the workers still import torch
    _, stderr = trainer.communicate(timeout=60)
    assert trainer.returncode != 0
    assert stderr.count("Traceback") <= 1 and "spawn_main" not in stderr, stderr
    assert wait_gone(workers) == []


def test_a_pass_left_open_after_close_ends_quietly(dataset_dir) -> None:
    ds = MmapDataset(dataset_dir / "dataset", fields="label")
    with MmapLoader(ds, 3, num_workers=2, multiprocessing_context="fork") as loader:
        batches = iter(loader)
        assert next(batches).tolist() == [0, 1, 2]
    batches.close()  # batches were in flight when close() stopped the workers
    assert list(batches) == []


# Worker side


def tensors_of(tree: Any) -> list[torch.Tensor]:
    if isinstance(tree, torch.Tensor):
        return [tree]
    if isinstance(tree, dict):
        return [t for value in tree.values() for t in tensors_of(value)]
    if isinstance(tree, (list, tuple)):
        return [t for value in tree for t in tensors_of(value)]
    return []


@pytest.mark.parametrize("collate_fn", [None, PaddedCollate()], ids=["fields", "padded"])
def test_each_tensor_of_a_batch_owns_a_storage_of_its_bytes_in_the_ring(dataset_dir, collate_fn) -> None:
    ds = MmapDataset(dataset_dir / "dataset")
    with MmapLoader(ds, 4, num_workers=2, collate_fn=collate_fn, multiprocessing_context="fork") as loader:
        batch = next(iter(loader))
        tensors = tensors_of(batch)
        assert len(tensors) == (
            6 if collate_fn is None else 4
        )  # input, label, 4 token rows / tokens, lengths
        for tensor in tensors:
            assert in_ring(loader, tensor)  # still a view of the slot
            assert tensor.untyped_storage().nbytes() == tensor.nbytes
            assert tensor.untyped_storage().data_ptr() == tensor.data_ptr()
            restored = pickle.loads(pickle.dumps(tensor))
            assert restored.untyped_storage().nbytes() == tensor.nbytes and torch.equal(restored, tensor)
        assert len(pickle.dumps(batch)) < sum(t.nbytes for t in tensors) + 4096
        expected = MmapLoader(ds, 4, prefetch=0, collate_fn=collate_fn).load(np.arange(4))
        assert_same(clone(batch), expected)


def lock_beside_inputs(samples: Any) -> dict[str, Any]:
    return {"input": torch.zeros(100), "lock": threading.Lock()}  # 400 bytes: more than a 64-byte slot


class FailsToLoad:
    def __reduce__(self):  # type: ignore[no-untyped-def]
        return (int, ("notanint",))


def unloadable_beside_inputs(samples: Any) -> dict[str, Any]:
    return {"input": torch.zeros(100), "bad": FailsToLoad()}


@pytest.mark.parametrize(
    ("collate_fn", "slot_nbytes", "summary", "cause"),
    [
        (lock_beside_inputs, None, "TypeError: cannot pickle '_thread.lock' object", TypeError),
        (lock_beside_inputs, 64, "TypeError: cannot pickle '_thread.lock' object", TypeError),
        (
            unloadable_beside_inputs,
            None,
            "ValueError: invalid literal for int() with base 10: 'notanint'",
            ValueError,
        ),
        (
            unloadable_beside_inputs,
            64,
            "ValueError: invalid literal for int() with base 10: 'notanint'",
            ValueError,
        ),
    ],
    ids=["unpicklable-slot", "unpicklable-pickled", "unloadable-slot", "unloadable-pickled"],
)
def test_a_batch_that_cannot_be_pickled_or_unpickled_is_a_worker_error_and_the_workers_stay(
    dataset_dir, collate_fn, slot_nbytes, summary, cause
) -> None:
    ds = MmapDataset(dataset_dir / "dataset")
    loader = MmapLoader(
        ds, 4, num_workers=2, collate_fn=collate_fn, slot_nbytes=slot_nbytes, multiprocessing_context="fork"
    )
    with loader, warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # the batch larger than its slot
        for attempt in range(2):
            with pytest.raises(WorkerError) as caught:
                list(loader)
            assert (
                str(caught.value) == f"MmapLoader worker 0 failed on batch 0 (samples 0, 1, 2, 3): {summary}"
            )
            assert type(caught.value.__cause__) is cause
            # FailsToLoad fails in the trainer, the lock in the worker.
            in_trainer = "(unpickling the batch in the trainer)" in str(caught.value.__cause__.__cause__)
            assert in_trainer == (cause is ValueError)
            if attempt == 0:
                pids = worker_pids(loader)
        assert worker_pids(loader) == pids and all(p.is_alive() for p in loader._workers.pool.processes)  # type: ignore[union-attr]


def flip_only(sample: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """A transform giving a view with a negative stride (torch.from_numpy refuses it)."""
    return {**sample, "input": sample["input"][:, ::-1]}


def test_a_transform_giving_negative_strides_is_stacked_as_numpy_stacks_it(dataset_dir) -> None:
    """torch cannot view a negative stride; the batch is numpy's stack of the flipped samples,
    with workers, without, and through torch's DataLoader."""
    ds = MmapDataset(dataset_dir / "dataset", fields=["input", "label"], transform=flip_only)
    plain = MmapDataset(dataset_dir / "dataset", fields=["input", "label"])
    expected = [np.stack([plain[i]["input"][:, ::-1] for i in range(k, min(k + 4, len(ds)))]) for k in range(0, len(ds), 4)]
    alone = [batch["input"].numpy().copy() for batch in MmapLoader(ds, 4, prefetch=0)]
    with MmapLoader(ds, 4, num_workers=2, multiprocessing_context="fork") as loader:
        from_workers = [batch["input"].numpy().copy() for batch in loader]
    from_torch = [batch["input"].numpy() for batch in DataLoader(ds, 4)]
    for batches in (alone, from_workers, from_torch):
        assert len(batches) == len(expected)
        assert all(np.array_equal(got, want) for got, want in zip(batches, expected, strict=True))


class MarkedTensor(torch.Tensor):
    pass


def quantized(tensor: torch.Tensor) -> torch.Tensor:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # torch deprecates quantized tensors
        return torch.quantize_per_tensor(tensor, 0.1, 0, torch.qint8)


def values_a_view_would_change(samples: Any) -> dict[str, Any]:
    inputs = torch.from_numpy(np.stack([s["input"] for s in samples]))
    return {
        "grad": inputs.clone().requires_grad_(),
        "param": torch.nn.Parameter(inputs.clone()),
        "sub": inputs.clone().as_subclass(MarkedTensor),
        "conj": torch.tensor([1 + 2j, 3 - 1j]).conj(),
        "neg": torch.tensor([1 + 2j, 3 - 1j]).conj().imag,
        "itemless": np.zeros(3, dtype=np.dtype([])),
        "quantized": quantized(inputs),
        "plain": inputs,
    }


@pytest.mark.filterwarnings("ignore:TypedStorage is deprecated")  # torch's unpickling of a quantized tensor
def test_values_a_slot_view_would_change_come_as_without_workers(dataset_dir) -> None:
    ds = MmapDataset(dataset_dir / "dataset")
    expected = MmapLoader(ds, 4, prefetch=0, collate_fn=values_a_view_would_change).load(np.arange(4))
    assert expected["neg"].is_neg() and expected["conj"].is_conj()
    with MmapLoader(
        ds, 4, num_workers=2, collate_fn=values_a_view_would_change, multiprocessing_context="fork"
    ) as loader:
        batch = next(iter(loader))
        assert in_ring(loader, batch["plain"])
    for key, value in expected.items():
        got = batch[key]
        assert type(got) is type(value), key
        assert got.dtype == value.dtype and got.shape == value.shape, key
        if isinstance(value, torch.Tensor):
            assert got.requires_grad == value.requires_grad, key
            assert (got.is_conj(), got.is_neg()) == (value.is_conj(), value.is_neg()), key
            if value.is_quantized:
                assert (got.q_scale(), got.q_zero_point()) == (value.q_scale(), value.q_zero_point())
                assert torch.equal(got.int_repr(), value.int_repr())
                continue
            assert torch.equal(
                got.detach().resolve_conj().resolve_neg(), value.detach().resolve_conj().resolve_neg()
            )
        else:
            assert got.tobytes() == value.tobytes(), key


class RaiseOn:
    """A transform raising a BaseException (not an Exception) on one sample."""

    def __init__(self, label: int, error: BaseException) -> None:
        self.label = label
        self.error = error

    def __call__(self, sample: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        if int(sample["label"]) == self.label:
            raise self.error
        return sample


@pytest.mark.parametrize(
    ("error", "summary"), [(KeyboardInterrupt(), "KeyboardInterrupt"), (SystemExit(3), "SystemExit: 3")]
)
def test_keyboard_interrupt_or_system_exit_in_a_transform_is_a_worker_error(
    dataset_dir, error, summary, capfd
) -> None:
    ds = MmapDataset(dataset_dir / "dataset", transform=RaiseOn(9, error))
    with MmapLoader(ds, 4, num_workers=2, multiprocessing_context="fork") as loader:
        for attempt in range(2):
            yielded = []
            with pytest.raises(WorkerError) as caught:
                for batch in loader:
                    yielded.append(batch["label"].tolist())
            assert yielded == [[0, 1, 2, 3], [4, 5, 6, 7]]
            assert (
                str(caught.value)
                == f"MmapLoader worker 0 failed on batch 2 (samples 8, 9, 10, 11): {summary}"
            )
            assert type(caught.value.__cause__) is type(error)
            if attempt == 0:
                pids = worker_pids(loader)
        assert worker_pids(loader) == pids and all(p.is_alive() for p in loader._workers.pool.processes)  # type: ignore[union-attr]
    assert "Traceback" not in capfd.readouterr().err  # no worker printed one


def assert_epoch_resumes(make: Callable[[], MmapLoader], epoch: int, stop_after: int) -> list[Any]:
    """Read `epoch` whole, then stop after batch `stop_after` and resume from the state: the resumed
    batches are the rest of that epoch. Returns the whole epoch's batches as lists."""
    with make() as whole:
        whole.set_epoch(epoch)
        uninterrupted = [batch.tolist() for batch in whole]
    with make() as first:
        first.set_epoch(epoch)
        for k, _ in enumerate(first):
            if k == stop_after:
                state = first.state_dict()
                break
    with make() as resumed:
        resumed.load_state_dict(state)
        assert [batch.tolist() for batch in resumed] == uninterrupted[stop_after + 1 :]
    return uninterrupted


@pytest.mark.parametrize("num_workers", [0, 2])
@pytest.mark.parametrize("rank", [0, 2])
def test_resume_with_a_distributed_sampler_continues_the_saved_epoch(dataset_dir, num_workers, rank) -> None:
    """DistributedSampler keeps no state of its own, only set_epoch: the loader's state gives it
    the saved epoch again, so the resumed batches are that epoch's, not epoch 0's."""
    ds = MmapDataset(dataset_dir / "dataset", fields="label")

    def make() -> MmapLoader:
        sampler = DistributedSampler(ds, num_replicas=3, rank=rank, shuffle=True, seed=4)  # type: ignore[arg-type]
        return MmapLoader(ds, 3, sampler=sampler, num_workers=num_workers, multiprocessing_context="fork" if num_workers else None)

    assert_epoch_resumes(make, epoch=3, stop_after=1)


def noisy(sample: dict[str, Any]) -> dict[str, Any]:
    """A random augmentation drawing from torch's and numpy's global generators."""
    return {"label": sample["label"], "noise": np.float64(torch.rand(()).item() + np.random.random())}


@pytest.mark.parametrize("num_workers", [0, 2])
def test_worker_augmentations_repeat_after_torch_manual_seed(dataset_dir, num_workers) -> None:
    """As with DataLoader, the workers' seeds come from torch's default generator: the same
    torch.manual_seed gives the same augmentations, another gives others, and no two workers draw alike."""
    ds = MmapDataset(dataset_dir / "dataset", fields=["label"], transform=noisy)

    def run(seed: int) -> list[float]:
        torch.manual_seed(seed)
        np.random.seed(seed)
        with MmapLoader(ds, 4, num_workers=num_workers, multiprocessing_context="fork" if num_workers else None) as loader:
            return [float(v) for batch in loader for v in batch["noise"]]

    first, again, other = run(0), run(0), run(1)
    assert first == again and first != other
    assert len(set(first)) == len(first)


def editing_collate(batch: Any) -> Any:
    """A collate_fn that edits each sample dict first, as users remap labels or add keys."""
    for sample in batch:
        sample["label"] = sample["label"] + 1000
        sample["extra"] = np.int64(7)
    return torch.utils.data.default_collate(batch)


@pytest.mark.parametrize("loader_kind", ["DataLoader", "MmapLoader"])
@pytest.mark.parametrize("num_workers", [0, 2])
def test_a_collate_fn_that_edits_the_sample_dicts_keeps_its_edits(
    dataset_dir, loader_kind, num_workers
) -> None:
    """A batch's samples are handed out once each: edits to them reach the collated batch."""
    ds = MmapDataset(dataset_dir / "dataset", fields=["label", "tokens"])
    context = {"multiprocessing_context": "fork"} if num_workers else {}
    if loader_kind == "DataLoader":
        loader: Any = torch.utils.data.DataLoader(
            ds, batch_size=4, num_workers=num_workers, collate_fn=editing_collate, **context
        )
    else:
        loader = MmapLoader(
            ds, 4, num_workers=num_workers, collate_fn=editing_collate, **context
        )
    batch = next(iter(loader))
    assert batch["label"].tolist() == [1000, 1001, 1002, 1003] and batch["extra"].tolist() == [7] * 4
    gathered = ds.__getitems__([0, 1])
    gathered[1]["label"] = np.int64(-5)
    assert gathered[1] is gathered[-1] and npz2mmap.collate(gathered)["label"].tolist() == [0, -5]
    gathered = ds.__getitems__([0, 1])
    gathered[0]["label"] = np.int64(-4)
    assert PaddedCollate()(gathered)["label"].tolist() == [-4, 1]
    if isinstance(loader, MmapLoader):
        loader.close()


def test_padded_collate_refuses_tuple_samples_it_would_fuse() -> None:
    samples = [(np.zeros(2, np.float32), np.array([2**53 + 1, 0], np.int64)) for _ in range(2)]
    with pytest.raises(TypeError, match="^PaddedCollate takes samples that are dicts of arrays"):
        PaddedCollate()(samples)


def test_padded_collate_ragged_adds_to_the_datasets_own(dataset_dir) -> None:
    ds = MmapDataset(dataset_dir / "dataset", fields=["label", "tokens"])
    batch = PaddedCollate(ragged=["other"])(ds.__getitems__([0, 1]))
    assert "tokens_lengths" in batch


@pytest.mark.parametrize("num_workers", [0, 2])
def test_a_resume_over_torchs_random_sampler_is_refused(dataset_dir, num_workers) -> None:
    """RandomSampler draws a new order each pass and keeps no state: no resume can continue it."""
    ds = MmapDataset(dataset_dir / "dataset", fields="label")
    options = {"num_workers": num_workers, "multiprocessing_context": "fork" if num_workers else None}
    with MmapLoader(ds, 4, sampler=torch.utils.data.RandomSampler(ds), **options) as first:  # type: ignore[arg-type]
        for k, _ in enumerate(first):
            if k == 2:
                state = first.state_dict()
                break
    with MmapLoader(ds, 4, sampler=torch.utils.data.RandomSampler(ds), **options) as resumed:  # type: ignore[arg-type]
        with pytest.raises(ValueError, match="^RandomSampler draws a new order each pass and keeps no state"):
            resumed.load_state_dict(state)
        resumed.load_state_dict({**state, "batches_yielded": 0})  # a pass boundary needs no order
        assert sorted(v for b in resumed for v in b.tolist()) == list(range(len(ds)))


@pytest.mark.parametrize("num_workers", [0, 2])
def test_a_distributed_sampler_given_its_epoch_directly_resumes_that_epoch(dataset_dir, num_workers) -> None:
    """The README's DDP loop calls sampler.set_epoch, not the loader's: the state keeps the sampler's epoch."""
    ds = MmapDataset(dataset_dir / "dataset", fields="label")

    def make() -> MmapLoader:
        sampler = DistributedSampler(ds, num_replicas=2, rank=0, shuffle=True, seed=4)  # type: ignore[arg-type]
        return MmapLoader(ds, 3, sampler=sampler, num_workers=num_workers, multiprocessing_context="fork" if num_workers else None)

    with make() as whole:
        whole.sampler.set_epoch(5)  # type: ignore[union-attr]
        uninterrupted = [b.tolist() for b in whole]
    with make() as first:
        first.sampler.set_epoch(5)  # type: ignore[union-attr]
        for k, _ in enumerate(first):
            if k == 1:
                state = first.state_dict()
                break
    assert state["sampler"] == {"epoch": 5}
    with make() as resumed:
        resumed.load_state_dict(state)
        assert [b.tolist() for b in resumed] == uninterrupted[2:]
    with make() as moved:  # the sampler given another epoch after the load: a whole new epoch
        moved.load_state_dict(state)
        moved.sampler.set_epoch(6)  # type: ignore[union-attr]
        epoch_6 = DistributedSampler(ds, num_replicas=2, rank=0, shuffle=True, seed=4)  # type: ignore[arg-type]
        epoch_6.set_epoch(6)
        assert [v for b in moved for v in b.tolist()] == list(epoch_6)


@pytest.mark.parametrize(
    ("other", "message"),
    [
        ({"batch_size": 5}, "loader state has batch_size 4, this loader has 5"),
        ({"shuffle": False}, "loader state has shuffle True, this loader has False"),
        ({"drop_last": True}, "loader state has drop_last False, this loader has True"),
    ],
)
def test_a_state_from_a_loader_of_other_settings_is_refused(dataset_dir, other, message) -> None:
    ds = MmapDataset(dataset_dir / "dataset", fields="label")
    first = MmapLoader(ds, 4, shuffle=True, seed=1)
    next(iter(first))
    state = first.state_dict()
    options: dict[str, Any] = {"shuffle": True, "seed": 1, **other}
    with pytest.raises(ValueError, match=f"^{re.escape(message)}: its batches would be other samples"):
        MmapLoader(ds, options.pop("batch_size", 4), **options).load_state_dict(state)


def distributed(ds: Any, **options: Any) -> DistributedSampler:
    return DistributedSampler(ds, **{"num_replicas": 3, "rank": 1, "seed": 2, "shuffle": True, **options})


SAMPLER_CHANGES = {
    "world size": (distributed, lambda ds: distributed(ds, num_replicas=2), "num_replicas=3"),
    "rank": (distributed, lambda ds: distributed(ds, rank=0), "rank=1"),
    "seed": (distributed, lambda ds: distributed(ds, seed=5), "seed=2"),
    "drop_last": (distributed, lambda ds: distributed(ds, drop_last=True), "drop_last=False"),
    "type": (distributed, lambda ds: BlockShuffleSampler(len(ds), 8), "sampler=DistributedSampler("),
    "list length": (lambda ds: list(range(30)), lambda ds: list(range(20)), "length=30"),
    "list contents": (lambda ds: list(range(30)), lambda ds: list(range(30))[::-1], "sampler=list(length=30"),
    "tensor contents": (
        lambda ds: torch.arange(30),
        lambda ds: torch.arange(30).flip(0),
        "sampler=Tensor(length=30",
    ),
}


@pytest.mark.parametrize("change", SAMPLER_CHANGES, ids=list(SAMPLER_CHANGES))
def test_a_state_over_a_sampler_of_other_settings_is_refused(dataset_dir, change) -> None:
    """A DistributedSampler of another world, rank, seed or drop_last, another sampler, or a list of
    other indices would resume with other samples: refused, before any sampler state is loaded."""
    saved_with, loaded_into, saved_shown = SAMPLER_CHANGES[change]
    ds = MmapDataset(dataset_dir / "dataset", fields="label")
    first = MmapLoader(ds, 4, sampler=saved_with(ds))
    next(iter(first))
    state = first.state_dict()
    with pytest.raises(ValueError, match=rf"^loader state was saved over .*{re.escape(saved_shown)}.*, this loader has"):
        MmapLoader(ds, 4, sampler=loaded_into(ds)).load_state_dict(state)
    MmapLoader(ds, 4, sampler=saved_with(ds)).load_state_dict(state)  # the same settings resume


@pytest.mark.parametrize("other", ["batch size", "sampler"])
def test_a_state_over_a_batch_sampler_of_other_settings_is_refused(dataset_dir, other) -> None:
    ds = MmapDataset(dataset_dir / "dataset", fields="label")
    first = MmapLoader(ds, 8, batch_sampler=torch.utils.data.BatchSampler(range(37), 8, False))
    next(iter(first))
    state = first.state_dict()
    if other == "batch size":
        batches: Any = torch.utils.data.BatchSampler(range(37), 9, False)
    else:
        batches = LengthGroupedSampler(np.arange(1, 38), 8)
    with pytest.raises(ValueError, match=r"^loader state was saved over batch_sampler=BatchSampler\(batch_size=8"):
        MmapLoader(ds, 8, batch_sampler=batches).load_state_dict(state)


INNER_SAMPLERS = {
    "ShuffleSampler": lambda ds: ShuffleSampler(ds, seed=4),
    "BlockShuffleSampler": lambda ds: BlockShuffleSampler(len(ds), 5, seed=4),
    "DistributedSampler": lambda ds: distributed(ds),
}


@pytest.mark.parametrize("inner", INNER_SAMPLERS, ids=list(INNER_SAMPLERS))
@pytest.mark.parametrize("num_workers", [0, 2])
def test_a_batch_samplers_own_sampler_resumes_its_epoch(dataset_dir, inner, num_workers) -> None:
    """loader.set_epoch reaches a BatchSampler's sampler, and the state carries that sampler's
    epoch and state: a resume continues the saved epoch's order, not epoch 0's."""
    ds = MmapDataset(dataset_dir / "dataset", fields="label")

    def loader() -> MmapLoader:
        batches = torch.utils.data.BatchSampler(INNER_SAMPLERS[inner](ds), 4, False)
        return MmapLoader(ds, 4, batch_sampler=batches, num_workers=num_workers, multiprocessing_context="fork" if num_workers else None)

    uninterrupted = assert_epoch_resumes(loader, epoch=3, stop_after=2)
    with loader() as epoch_zero:
        assert [batch.tolist() for batch in epoch_zero] != uninterrupted  # the epoch does make the order


@pytest.mark.parametrize(
    ("saved", "loaded", "message"),
    [
        (lambda ds: ShuffleSampler(ds, seed=1), lambda ds: ShuffleSampler(ds, seed=2), "seed 1"),
        (lambda ds: BlockShuffleSampler(len(ds), 7), lambda ds: BlockShuffleSampler(len(ds), 8), "block_size 7"),
    ],
)
def test_a_state_over_a_batch_samplers_sampler_of_other_settings_is_refused(dataset_dir, saved, loaded, message):
    ds = MmapDataset(dataset_dir / "dataset", fields="label")
    first = MmapLoader(ds, 4, batch_sampler=torch.utils.data.BatchSampler(saved(ds), 4, False))
    next(iter(first))
    state = first.state_dict()
    with pytest.raises(ValueError, match=f"^sampler state has {message}"):
        MmapLoader(ds, 4, batch_sampler=torch.utils.data.BatchSampler(loaded(ds), 4, False)).load_state_dict(state)


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        ({"batches_yielded": 11}, "batches_yielded 11 is past the end of a pass of 10 batches"),
        ({"epoch": -1}, "epoch -1 is negative"),
        ({"zz": 0}, "loader state has 'zz', which this loader does not write"),
        ({"sampler": {}}, "loader state has 'sampler', which this loader does not write"),
    ],
)
def test_a_loader_state_past_its_pass_or_with_entries_it_does_not_write_is_refused(dataset_dir, edit, message):
    ds = MmapDataset(dataset_dir / "dataset", fields="label")
    first = MmapLoader(ds, 4, shuffle=True)
    next(iter(first))
    state = {**first.state_dict(), **edit}
    with pytest.raises(ValueError, match=re.escape(message)):
        MmapLoader(ds, 4, shuffle=True).load_state_dict(state)
    MmapLoader(ds, 4, shuffle=True).load_state_dict(first.state_dict())  # the state as written loads


def test_a_sampler_state_from_a_sampler_of_other_settings_is_refused() -> None:
    state = BlockShuffleSampler(37, 8, seed=1).state_dict()
    with pytest.raises(ValueError, match="^sampler state has block_size 8, this sampler has 6"):
        BlockShuffleSampler(37, 6, seed=1).load_state_dict(state)
    grouped = LengthGroupedSampler(np.arange(1, 38), 5, seed=1).state_dict()
    with pytest.raises(ValueError, match="^sampler state has batch_size 5, this sampler has 8"):
        LengthGroupedSampler(np.arange(1, 38), 8, seed=1).load_state_dict(grouped)
    with pytest.raises(ValueError, match="^sampler state has lengths_crc32 "):
        LengthGroupedSampler(np.arange(2, 39), 5, seed=1).load_state_dict(grouped)


@pytest.mark.parametrize(
    "options",
    [
        {"batch_sampler": [[0, 1]], "drop_last": True},
        {"batch_sampler": [[0, 1]], "shuffle": True},
        {"batch_sampler": [[0, 1]], "sampler": [0, 1]},
        {"sampler": [0, 1], "shuffle": True},
    ],
)
def test_order_options_that_would_be_ignored_are_refused(dataset_dir, options) -> None:
    ds = MmapDataset(dataset_dir / "dataset", fields="label")
    with pytest.raises(ValueError, match="cannot be used with"):
        MmapLoader(ds, 4, **options)


TORCH_PICKLES_NOT = [
    name
    for name in ("uint16", "uint32", "uint64", "complex32", "float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz")
    + ("float8_e5m2fnuz",)
    if hasattr(torch, name)
]


def labels_as(dtype_name: str) -> Callable[[Any], Any]:
    return functools.partial(_labels_as, dtype_name)


def _labels_as(dtype_name: str, samples: Any) -> dict[str, torch.Tensor]:
    """Labels of the dtype, plain and as views with the bits a slot view would lose (neg, conj, grad)."""
    dtype = getattr(torch, dtype_name)
    labels = torch.tensor([int(s["label"]) for s in samples]).to(dtype)
    batch = {"label": labels, "empty": torch.zeros((0, 2), dtype=dtype), "neg": labels.clone()._neg_view()}
    if dtype.is_complex:
        batch["conj"] = (labels * 1j).conj()
    if dtype.is_floating_point:
        batch["grad"] = labels.clone().requires_grad_()
    return batch


def stored(tensor: torch.Tensor) -> tuple[Any, ...]:
    """A tensor's dtype, shape, bits and the bytes of its memory (its conj and neg views undone)."""
    plain = tensor.detach()
    plain = plain.conj() if plain.is_conj() else plain
    plain = plain._neg_view() if plain.is_neg() else plain
    raw = plain.contiguous().reshape(-1).view(torch.uint8).tolist()
    return tensor.dtype, tuple(tensor.shape), tensor.is_conj(), tensor.is_neg(), tensor.requires_grad, raw


@pytest.mark.parametrize("slot_nbytes", [None, 1], ids=["in-slot", "larger-than-slot"])
@pytest.mark.parametrize("dtype_name", TORCH_PICKLES_NOT)
def test_tensors_of_a_dtype_torch_cannot_pickle_arrive_exact_with_their_bits(
    dataset_dir, dtype_name, slot_nbytes
) -> None:
    """Torch's own pickling refuses these dtypes, so their bytes go; a neg or conj view and
    requires_grad (which a view of a slot would lose) come as torch's pickling keeps them."""
    ds = MmapDataset(dataset_dir / "dataset", fields=["label"])
    collate_fn = labels_as(dtype_name)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # complex32 is experimental; a batch larger than its slot warns
        with MmapLoader(ds, 5, num_workers=1, collate_fn=collate_fn, slot_nbytes=slot_nbytes) as loader:
            got = [{key: stored(leaf) for key, leaf in batch.items()} for batch in loader]
        expected = [
            collate_fn([ds[i] for i in range(s, min(s + 5, len(ds)))]) for s in range(0, len(ds), 5)
        ]
    assert got == [{key: stored(leaf) for key, leaf in want.items()} for want in expected]


WEIGHT = torch.full((1,), 2.0, requires_grad=True)


def scaled_by_the_weight(batch: Any, detached: bool = False) -> dict[str, Any]:
    """A collate_fn computing with a tensor that requires grad: its output is part of a graph."""
    out = dict(npz2mmap.collate(batch))
    out["scaled"] = out["input"].mean(dim=(1, 2, 3)) * WEIGHT
    if detached:
        out["scaled"] = out["scaled"].detach()
    return out


@pytest.mark.parametrize("num_workers", [1, 2])
def test_a_tensor_of_an_autograd_graph_from_a_worker_is_refused_as_torch_refuses_it(
    dataset_dir, num_workers
) -> None:
    """It came back a leaf cut off from its graph, silently: backward() then never reached the weight."""
    ds = MmapDataset(dataset_dir / "dataset")
    with MmapLoader(ds, 4, collate_fn=scaled_by_the_weight, prefetch=0) as loader:  # in process: the graph
        scaled = next(iter(loader))["scaled"]
        scaled.sum().backward()
        assert WEIGHT.grad is not None and scaled.grad_fn is not None
    with MmapLoader(ds, 4, collate_fn=scaled_by_the_weight, num_workers=num_workers) as loader:
        with pytest.raises(WorkerError) as refused:
            next(iter(loader))
    assert str(refused.value).startswith(
        "MmapLoader worker 0 failed on batch 0 (samples 0, 1, 2, 3): RuntimeError: a tensor in the batch is "
        "part of an autograd graph (made by MulBackward0, it requires grad), which cannot cross from a worker "
        "process: its gradients would never reach the tensors it was computed from; detach() it in the "
        "collate_fn or transform, or compute it in the training loop"
    )
    detached = functools.partial(scaled_by_the_weight, detached=True)
    with MmapLoader(ds, 4, collate_fn=detached, num_workers=num_workers) as loader:
        got = next(iter(loader))["scaled"]
    assert got.grad_fn is None and not got.requires_grad
    torch.testing.assert_close(got, scaled.detach())


def test_the_shuffle_seed_comes_from_torchs_generator_as_dataloaders_and_resumes(dataset_dir) -> None:
    """seed=0 by default gave every new loader one order, where DataLoader's comes from torch."""
    ds = MmapDataset(dataset_dir / "dataset", fields="label")

    def order(loader: MmapLoader) -> list[int]:
        return [int(i) for batch in loader for i in batch]

    torch.manual_seed(1)
    first = order(MmapLoader(ds, 4, shuffle=True, prefetch=0))
    torch.manual_seed(1)
    assert order(MmapLoader(ds, 4, shuffle=True, prefetch=0)) == first  # torch.manual_seed decides it
    torch.manual_seed(2)
    other = MmapLoader(ds, 4, shuffle=True, prefetch=0)
    assert order(other) != first
    cut = MmapLoader(ds, 4, shuffle=True, prefetch=0)
    uninterrupted = order(MmapLoader(ds, 4, shuffle=True, prefetch=0, seed=cut.seed))
    for k, _ in enumerate(cut):
        if k == 2:
            break
    state = cut.state_dict()
    resumed = MmapLoader(ds, 4, shuffle=True, prefetch=0)  # a new process: another drawn seed...
    assert resumed.seed != cut.seed
    resumed.load_state_dict(state)  # ...and the state's taken, so the resume is exact
    assert order(resumed) == uninterrupted[12:]
    torch.manual_seed(3)
    drawn = torch.rand(2)
    torch.manual_seed(3)
    MmapLoader(ds, 4, prefetch=0)  # no shuffle: no seed drawn, the generator untouched (as DataLoader)
    assert torch.equal(torch.rand(2), drawn)


def test_a_dataset_that_is_no_mmap_dataset_is_refused_at_construction() -> None:
    """It was accepted, and iterating failed with an AttributeError."""
    with pytest.raises(TypeError) as refused:
        MmapLoader(list(range(5)), 2)
    assert str(refused.value) == (
        "MmapLoader reads an MmapDataset, not a list: wrap your data in torch's DataLoader instead, "
        "or open the converted dataset with MmapDataset(path)"
    )


@pytest.fixture(scope="module")
def wide_items(tmp_path_factory) -> Path:
    """16- and 8-byte items, ragged and fixed, after a 3-byte field: packed back to back in a
    slot, only an aligned slot start keeps them aligned."""
    out = tmp_path_factory.mktemp("wide") / "ds"
    with npz2mmap.Writer(out) as writer:
        for i in range(24):
            writer.append({
                "c": np.full(1 + i % 3, i + 1j, np.complex128),
                "d": np.full(5, i, np.float64),
                "u": np.full(3, i, np.uint8),
            })
    return out


@pytest.mark.parametrize("slot_nbytes", [1000, 1001, 1064, 3000, 4095, 5000])
@pytest.mark.parametrize("collate_fn", [None, PaddedCollate()], ids=["listed", "padded"])
def test_every_array_of_every_slot_is_aligned_whatever_slot_nbytes(wide_items, slot_nbytes, collate_fn) -> None:
    """slot_nbytes=1000 put slot 1 at byte 1000: its complex128 tensors were 8-byte aligned,
    and copying one killed the trainer with SIGSEGV."""
    ds = MmapDataset(wide_items)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # a batch over a small slot goes by pipe
        with MmapLoader(ds, 5, num_workers=1, slot_nbytes=slot_nbytes, collate_fn=collate_fn) as loader:
            misaligned = [
                (k, key, tensor.data_ptr() % 64)
                for k, batch in enumerate(loader)
                for key, value in batch.items()
                for tensor in (value if isinstance(value, list) else [value])
                if tensor.data_ptr() % tensor.element_size()
            ]
    assert misaligned == []
