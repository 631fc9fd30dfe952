"""What a worker loader hands out lives on its own: kept batches stay intact, every batch is a new object."""

from __future__ import annotations

import gc
import multiprocessing.heap
import os
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from conftest import write_samples
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from npz2mmap import MmapDataset, MmapLoader
from npz2mmap.converter import convert

NUM_SAMPLES = 24
BATCH_SIZE = 8
TINY_SLOT_NBYTES = 1024  # the batch (384 + 64 bytes) fits, with little to spare


@pytest.fixture(scope="module")
def dataset_path(tmp_path_factory) -> Path:
    """24 samples: a float input and the sample's own index as label."""
    root = tmp_path_factory.mktemp("lifetime")
    rng = np.random.default_rng(3)
    samples = [
        {"input": rng.standard_normal((3, 4)).astype(np.float32), "label": np.int64(i)}
        for i in range(NUM_SAMPLES)
    ]
    write_samples(root / "src", samples)
    convert([root / "src"], root / "dataset", workers=1)
    return root / "dataset"


def copied(batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {key: value.clone() for key, value in batch.items()}


class LeftTheLoop(Exception):
    pass


def keep_a_batch(ds: MmapDataset, ending: str, stop_at: int, **options: Any) -> tuple[Any, Any]:
    """Iterate a worker loader, keep batch ``stop_at`` (and a copy taken then), end the loader by ``ending``."""
    kept: list[Any] = []

    def run(loader: MmapLoader) -> None:
        for number, batch in enumerate(loader):
            kept[:] = [batch, copied(batch)]
            if number == stop_at:
                if ending == "raise":
                    raise LeftTheLoop
                break

    options = {"num_workers": 1, "multiprocessing_context": "fork", **options}
    if ending == "with":
        with MmapLoader(ds, BATCH_SIZE, **options) as loader:
            run(loader)
    elif ending == "close":
        loader = MmapLoader(ds, BATCH_SIZE, **options)
        run(loader)
        loader.close()
    elif ending == "del":
        loader = MmapLoader(ds, BATCH_SIZE, **options)
        run(loader)
        del loader
        gc.collect()
    else:
        try:
            run(MmapLoader(ds, BATCH_SIZE, **options))
        except LeftTheLoop:
            pass
        gc.collect()
    return kept[0], kept[1]


def use_the_heap_and_another_ring(ds: MmapDataset) -> list[Any]:
    """What may take freed shared memory: multiprocessing's heap, filled, and another loader's ring."""
    blocks = []
    for nbytes in (1024, 1 << 20, 3 << 20):
        block = multiprocessing.heap.BufferWrapper(nbytes)
        memory = block.create_memoryview()
        memory[:] = b"\xff" * nbytes
        blocks.append(block)
    with MmapLoader(ds, BATCH_SIZE, num_workers=1, shuffle=True, seed=1) as other:
        for _ in other:
            pass
    return blocks


def assert_intact(kept: list[tuple[Any, Any]]) -> None:
    for batch, copy in kept:
        for key in copy:
            assert torch.equal(batch[key], copy[key]), (key, batch[key], copy[key])


def test_a_kept_batch_is_not_overwritten_by_the_next_loader(dataset_path) -> None:
    ds = MmapDataset(dataset_path)
    with MmapLoader(ds, BATCH_SIZE, num_workers=1) as loader:
        for batch in loader:
            kept = batch
            break
    for _ in MmapLoader(ds, BATCH_SIZE, num_workers=1, shuffle=True, seed=1):
        pass
    assert kept["label"].tolist() == list(range(BATCH_SIZE))


ENDINGS = ["close", "with", "del", "raise"]


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    loaders=st.lists(
        st.tuples(
            st.sampled_from([1, 2]),
            st.sampled_from([TINY_SLOT_NBYTES, None]),
            st.sampled_from(ENDINGS),
            st.integers(0, NUM_SAMPLES // BATCH_SIZE - 1),
        ),
        min_size=1,
        max_size=3,
    )
)
def test_batches_kept_past_their_loaders_end_stay_as_yielded(dataset_path, loaders) -> None:
    """However a loader ends, the batch in hand then keeps its values while others use shared memory."""
    ds = MmapDataset(dataset_path)
    kept = []
    for num_workers, slot_nbytes, ending, stop_at in loaders:
        kept.append(keep_a_batch(ds, ending, stop_at, num_workers=num_workers, slot_nbytes=slot_nbytes))
        assert_intact(kept)
    blocks = use_the_heap_and_another_ring(ds)
    assert_intact(kept)
    del blocks


def test_the_ring_is_unmapped_with_the_last_tensor_viewing_it(dataset_path) -> None:
    """Kept batches hold the ring's memory, and only they: dropping them frees it."""
    ds = MmapDataset(dataset_path)
    before = ring_mappings()
    batch, _ = keep_a_batch(ds, "close", 0)
    assert len(ring_mappings() - before) == 1
    del batch
    gc.collect()
    assert ring_mappings() - before == set()


def ring_mappings() -> set[str]:
    """The address ranges of this process's rings (unlinked pym-PID-* files; Linux)."""
    path = Path("/proc/self/maps")
    if not path.exists():
        pytest.skip("reads /proc/self/maps")
    marker = f"/pym-{os.getpid()}-"
    return {line.split()[0] for line in path.read_text().splitlines() if marker in line}
