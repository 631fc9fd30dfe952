"""The shipped samplers: mid-epoch resume (state_dict protocol) and LengthGroupedSampler under DDP.

The oracle for a resume is the same sampler run through the same epoch
without interruption: the resumed loader must yield exactly its remaining
batches, in order.
"""

from __future__ import annotations

import re
import warnings
from collections import Counter
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
from torch.utils.data import DataLoader

from npz2mmap import BlockShuffleSampler, LengthGroupedSampler, ShuffleSampler
from npz2mmap.errors import SameEpochWarning

NUM_SAMPLES = 37
LENGTHS = np.random.default_rng(7).integers(1, 500, size=NUM_SAMPLES)


def block_sampler() -> BlockShuffleSampler:
    return BlockShuffleSampler(NUM_SAMPLES, block_size=5, seed=3)


def length_sampler(**kwargs: int) -> LengthGroupedSampler:
    return LengthGroupedSampler(LENGTHS, batch_size=4, pool_batches=2, seed=3, **kwargs)


def loader_over(sampler: BlockShuffleSampler | LengthGroupedSampler | ShuffleSampler) -> DataLoader:
    dataset = list(range(NUM_SAMPLES))
    if isinstance(sampler, LengthGroupedSampler):
        return DataLoader(dataset, batch_sampler=sampler, collate_fn=list)
    return DataLoader(dataset, batch_size=4, sampler=sampler, collate_fn=list)


SAMPLERS: dict[str, Callable[[], BlockShuffleSampler | LengthGroupedSampler | ShuffleSampler]] = {
    "block_shuffle": block_sampler,
    "length_grouped": length_sampler,
    "length_grouped_rank_1_of_3": lambda: length_sampler(num_replicas=3, rank=1),
    "block_interleaved_rank_1_of_3": lambda: BlockShuffleSampler(
        NUM_SAMPLES, 5, seed=3, interleave=3, num_replicas=3, rank=1
    ),
    "shuffle": lambda: ShuffleSampler(NUM_SAMPLES, seed=3),
    "shuffle_rank_2_of_3": lambda: ShuffleSampler(NUM_SAMPLES, seed=3, num_replicas=3, rank=2),
}


@pytest.mark.parametrize("make_sampler", SAMPLERS.values(), ids=SAMPLERS.keys())
@pytest.mark.parametrize("stop_after", [0, 1, 3])
def test_a_dataloader_over_a_restored_sampler_yields_the_rest_of_the_epoch(make_sampler, stop_after) -> None:
    reference = make_sampler()
    reference.set_epoch(2)
    whole_epoch = list(loader_over(reference))
    reference.set_epoch(3)
    next_epoch = list(loader_over(reference))

    interrupted = make_sampler()
    interrupted.set_epoch(2)
    batches = iter(loader_over(interrupted))
    seen = [next(batches) for _ in range(stop_after)]
    state = interrupted.state_dict()
    assert seen == whole_epoch[:stop_after]

    resumed = make_sampler()  # a new process: epoch 0 until the state says otherwise
    resumed.load_state_dict(state)
    resumed.set_epoch(2)  # the usual loop sets the epoch again; the resume survives it
    assert list(loader_over(resumed)) == whole_epoch[stop_after:]
    resumed.set_epoch(3)
    assert list(loader_over(resumed)) == next_epoch


def test_a_resume_is_dropped_when_another_epoch_is_chosen() -> None:
    reference = length_sampler()
    reference.set_epoch(5)
    epoch_5 = list(reference)
    sampler = length_sampler()
    sampler.load_state_dict({"epoch": 4, "seed": 3, "yielded": 2})
    sampler.set_epoch(5)
    assert list(sampler) == epoch_5


@pytest.mark.parametrize(
    ("state", "message"),
    [
        ({"epoch": 1, "seed": 4, "yielded": 0}, "sampler state has seed 4, this sampler has seed 3"),
        ({"epoch": 1, "seed": 3, "yielded": NUM_SAMPLES + 1}, f"yielded 38 is outside 0..{NUM_SAMPLES}"),
        ({"epoch": 1, "seed": 3, "yielded": -1}, "yielded -1 is outside"),
        ({"epoch": 1, "seed": 3}, "'yielded' must be an integer, found None"),
        ({"epoch": 1.5, "seed": 3, "yielded": 0}, "'epoch' must be an integer, found 1.5"),
        ({"epoch": -1, "seed": 3, "yielded": 0}, "sampler state: epoch -1 is negative"),
        (
            {"epoch": 1, "seed": 3, "yielded": 0, "pool": 4},  # a LengthGroupedSampler's
            "sampler state has 'pool', which BlockShuffleSampler does not write",
        ),
    ],
)
def test_a_state_this_sampler_did_not_write_is_refused(state, message) -> None:
    sampler = block_sampler()
    with pytest.raises(ValueError, match=message.replace(".", r"\.")):
        sampler.load_state_dict(state)
    assert list(sampler) == list(block_sampler())  # nothing half-loaded


@pytest.mark.parametrize("num_workers", [0, 2])
@pytest.mark.parametrize("make_sampler", SAMPLERS.values(), ids=SAMPLERS.keys())
def test_stateful_dataloader_resumes_at_the_exact_next_batch(make_sampler, num_workers) -> None:
    stateful = pytest.importorskip("torchdata.stateful_dataloader")

    def loader(sampler):
        dataset = list(range(NUM_SAMPLES))
        if isinstance(sampler, LengthGroupedSampler):
            kwargs = {"batch_sampler": sampler}
        else:
            kwargs = {"batch_size": 4, "sampler": sampler}
        return stateful.StatefulDataLoader(dataset, num_workers=num_workers, collate_fn=list, **kwargs)

    reference = make_sampler()
    reference.set_epoch(1)
    whole_epoch = list(loader(reference))
    interrupted = make_sampler()
    interrupted.set_epoch(1)
    running = loader(interrupted)
    batches = iter(running)
    assert [next(batches) for _ in range(3)] == whole_epoch[:3]
    state = running.state_dict()
    del batches

    resumed = loader(make_sampler())
    resumed.load_state_dict(state)
    assert list(resumed) == whole_epoch[3:]


def rank_batches(num_samples: int, world_size: int, drop_last: bool) -> list[list[list[int]]]:
    lengths = LENGTHS[:num_samples]
    samplers = [
        LengthGroupedSampler(
            lengths,
            batch_size=4,
            pool_batches=100,
            drop_last=drop_last,
            seed=9,
            num_replicas=world_size,
            rank=r,
        )
        for r in range(world_size)
    ]
    for sampler in samplers:
        sampler.set_epoch(1)
    batches = [list(sampler) for sampler in samplers]
    assert [len(b) for b in batches] == [len(s) for s in samplers]
    return batches


@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
@pytest.mark.parametrize("num_samples", [0, 1, 3, 17, NUM_SAMPLES])
def test_ranks_share_every_sample_and_pad_like_distributed_sampler(world_size, num_samples) -> None:
    per_rank = rank_batches(num_samples, world_size, drop_last=False)
    assert len({len(batches) for batches in per_rank}) == 1  # DDP needs as many steps on every rank
    share = -(-num_samples // world_size)
    assert len(per_rank[0]) == -(-share // 4)
    counts = Counter(i for batches in per_rank for batch in batches for i in batch)
    assert set(counts) == set(range(num_samples))
    assert sum(counts.values()) == share * world_size  # each rank has the same share...
    assert sum(counts.values()) - num_samples < world_size  # ...padded by fewer than world_size repeats


@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
@pytest.mark.parametrize("num_samples", [0, 3, 17, NUM_SAMPLES])
def test_ranks_with_drop_last_leave_out_the_remainder_and_repeat_nothing(world_size, num_samples) -> None:
    per_rank = rank_batches(num_samples, world_size, drop_last=True)
    assert len({len(batches) for batches in per_rank}) == 1
    all_indices = [i for batches in per_rank for batch in batches for i in batch]
    assert len(all_indices) == len(set(all_indices))
    assert all(len(batch) == 4 for batches in per_rank for batch in batches)
    assert len(all_indices) == world_size * (num_samples // world_size // 4 * 4)


@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
def test_each_rank_batches_neighbouring_lengths(world_size) -> None:
    """With one pool per rank, a rank's batches cut its sorted lengths into consecutive runs."""
    for batches in rank_batches(NUM_SAMPLES, world_size, drop_last=False):
        runs = sorted((sorted(LENGTHS[batch].tolist()) for batch in batches), key=lambda run: run[0])
        for before, after in zip(runs, runs[1:], strict=False):
            assert before[-1] <= after[0]


def test_ranks_draw_a_new_split_each_epoch() -> None:
    sampler = length_sampler(num_replicas=2, rank=0)
    first = sorted(i for batch in sampler for i in batch)
    sampler.set_epoch(1)
    assert sorted(i for batch in sampler for i in batch) != first


def test_rank_and_world_size_come_from_torch_distributed(monkeypatch) -> None:
    monkeypatch.setattr("torch.distributed.is_initialized", lambda: True)
    monkeypatch.setattr("torch.distributed.get_world_size", lambda: 3)
    monkeypatch.setattr("torch.distributed.get_rank", lambda: 2)
    sampler = length_sampler()
    assert (sampler.num_replicas, sampler.rank) == (3, 2)
    assert list(sampler) == list(length_sampler(num_replicas=3, rank=2))


@pytest.mark.parametrize(("num_replicas", "rank"), [(2, 2), (2, -1), (0, 0)])
def test_a_rank_outside_the_world_is_refused(num_replicas, rank) -> None:
    with pytest.raises(
        ValueError, match=f"rank must be in 0..num_replicas-1, got rank {rank} of {num_replicas}"
    ):
        length_sampler(num_replicas=num_replicas, rank=rank)


@pytest.mark.parametrize("state", [None, [], "epoch"])
def test_a_state_that_is_not_a_dict_is_a_value_error(state) -> None:
    from npz2mmap import BlockShuffleSampler

    with pytest.raises(ValueError, match="sampler state must be a dict"):
        BlockShuffleSampler(10).load_state_dict(state)


@pytest.mark.parametrize(
    ("make", "message"),
    [
        (lambda: BlockShuffleSampler(10, 2.5), "block_size must be an integer >= 1, not 2.5"),
        (lambda: BlockShuffleSampler(10, True), "block_size must be an integer >= 1, not True"),
        (lambda: BlockShuffleSampler(10, 2, interleave=0), "interleave must be an integer >= 1, not 0"),
        (lambda: BlockShuffleSampler(-1), "num_samples must be an integer >= 0, not -1"),
        (lambda: BlockShuffleSampler(10, seed=-1), "seed must be an integer >= 0, not -1"),
        (lambda: BlockShuffleSampler(10, drop_last="no"), "drop_last must be True or False, not 'no'"),
        (lambda: ShuffleSampler(-1), "num_samples must be an integer >= 0, not -1"),
        (lambda: ShuffleSampler(10, seed=True), "seed must be an integer >= 0, not True"),
        (lambda: ShuffleSampler(10, num_replicas=True), "num_replicas must be an integer, not True"),
        (lambda: LengthGroupedSampler(np.ones(4), 0), "batch_size must be an integer >= 1, not 0"),
        (lambda: BlockShuffleSampler(10).set_epoch(1.5), "epoch must be an integer >= 0, not 1.5"),
        (lambda: ShuffleSampler(10).set_epoch(-1), "epoch must be an integer >= 0, not -1"),
    ],
)
def test_sampler_arguments_are_checked_with_a_message_naming_them(make, message) -> None:
    """A bool or float is no count, and "no" is no flag: each refused naming the argument."""
    with pytest.raises(ValueError, match=f"^{re.escape(message)}$"):
        make()
    assert list(BlockShuffleSampler(np.int64(4), np.int64(2), np.int64(1))) != []  # numpy's integers are counts


@pytest.mark.parametrize(
    "other",
    [
        {"interleave": 8},
        {"num_replicas": 2, "rank": 0},
        {"drop_last": True},
    ],
    ids=["interleave", "replicas", "drop_last"],
)
def test_a_block_sampler_state_of_default_settings_is_refused_by_one_of_others(other) -> None:
    """Both ways: a state's settings are all written, so none is taken as the loading sampler's."""
    default = BlockShuffleSampler(NUM_SAMPLES, 5, seed=3)
    changed = BlockShuffleSampler(NUM_SAMPLES, 5, seed=3, **other)
    key = next(iter(other))
    for saved, loading in ((default, changed), (changed, default)):
        with pytest.raises(ValueError, match=f"^sampler state has {key} "):
            loading.load_state_dict(saved.state_dict())


def test_a_first_version_block_sampler_state_resumes_only_its_own_settings() -> None:
    """States written before interleave and DDP existed hold num_samples and block_size alone."""
    old = {"epoch": 0, "seed": 3, "yielded": 10, "num_samples": NUM_SAMPLES, "block_size": 5}
    default = BlockShuffleSampler(NUM_SAMPLES, 5, seed=3)
    default.load_state_dict(old)
    assert list(default) == list(BlockShuffleSampler(NUM_SAMPLES, 5, seed=3))[10:]
    with pytest.raises(ValueError, match="^sampler state has interleave 1, this sampler has 8"):
        BlockShuffleSampler(NUM_SAMPLES, 5, seed=3, interleave=8).load_state_dict(old)


def epochs_through(loader: Any, num_epochs: int, set_epoch: Callable[[int], None] | None = None) -> list[list]:
    passes = []
    for epoch in range(num_epochs):
        if set_epoch is not None:
            set_epoch(epoch)
        passes.append([item for batch in loader for item in batch])
    return passes


@pytest.mark.parametrize("make_sampler", SAMPLERS.values(), ids=SAMPLERS.keys())
def test_set_epoch_gives_each_epoch_its_order_and_a_pass_without_it_warns(make_sampler) -> None:
    """As DistributedSampler: the order is the epoch's. A loop that never called set_epoch trained on one
    order every epoch without a word; the second pass over an epoch run to its end now says so, once."""
    import warnings

    from npz2mmap.errors import SameEpochWarning

    told = make_sampler()
    passes = epochs_through(loader_over(told), 4, told.set_epoch)
    assert len({tuple(p) for p in passes}) == 4  # four orders
    if told.num_replicas == 1:
        assert all(sorted(p) == sorted(passes[0]) for p in passes)  # of the same samples
    again = make_sampler()  # the same epoch, given again, is the same order
    assert epochs_through(loader_over(again), 2, lambda _: again.set_epoch(2)) == [passes[2]] * 2
    untold = make_sampler()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert epochs_through(loader_over(untold), 3) == [passes[0]] * 3
    assert [str(w.message) for w in caught] == [
        f"{type(untold).__name__}: another pass over epoch 0, in the same order: call sampler.set_epoch(epoch) "
        "before each epoch for a new one, as with DistributedSampler"
    ]
    assert all(w.category is SameEpochWarning for w in caught)


@pytest.mark.parametrize("make_sampler", SAMPLERS.values(), ids=SAMPLERS.keys())
def test_mmap_loader_over_a_sampler_gives_the_epochs_it_is_told_and_resumes_the_next_one(
    make_sampler, tmp_path
) -> None:
    from npz2mmap import MmapDataset, MmapLoader, Writer

    with Writer(tmp_path / "ds") as writer:
        for i in range(NUM_SAMPLES):
            writer.append({"i": np.int64(i)})
    ds = MmapDataset(tmp_path / "ds")
    sampler = make_sampler()
    batching = {"batch_sampler": sampler} if isinstance(sampler, LengthGroupedSampler) else {"sampler": sampler}
    loader = MmapLoader(ds, 4, **batching, prefetch=0)
    expected_sampler = make_sampler()
    expected = epochs_through(loader_over(expected_sampler), 3, expected_sampler.set_epoch)
    got = []
    for epoch in range(2):
        loader.set_epoch(epoch)
        got.append([int(i) for batch in loader for i in batch["i"]])
    loader.set_epoch(2)
    state = loader.state_dict()  # between passes: the third epoch, from its start
    twin = make_sampler()
    resumed = MmapLoader(ds, loader.batch_size, **{key: twin for key in batching}, prefetch=0)
    resumed.load_state_dict(state)
    got.append([int(i) for batch in resumed for i in batch["i"]])
    assert got == expected


@pytest.mark.parametrize("make_sampler", SAMPLERS.values(), ids=SAMPLERS.keys())
def test_a_state_saved_at_the_end_of_an_epoch_resumes_with_the_next_epoch_set(make_sampler) -> None:
    """DistributedSampler's loop: for epoch in range(start, n): sampler.set_epoch(epoch). A state
    saved at an epoch's end has yielded all; resuming at the next epoch, or at this one, is exact."""
    sampler = make_sampler()
    sampler.set_epoch(4)
    list(sampler)
    state = sampler.state_dict()
    assert (state["epoch"], state["yielded"]) == (4, len(sampler))
    sampler.set_epoch(5)
    epoch_5 = list(sampler)
    for resume_at in (4, 5):  # the loop restarts at the epoch saved, or the one after it
        restored = make_sampler()
        restored.load_state_dict(state)
        passes = []
        for epoch in range(resume_at, 6):
            restored.set_epoch(epoch)
            passes.append(list(restored))
        assert passes == ([[]] if resume_at == 4 else []) + [epoch_5]  # the rest of epoch 4 is nothing


@pytest.mark.parametrize("persistent_workers", [False, True])
@pytest.mark.parametrize("told", [False, True], ids=["no set_epoch", "set_epoch"])
@pytest.mark.parametrize("make_sampler", SAMPLERS.values(), ids=SAMPLERS.keys())
def test_dataloader_workers_give_the_epochs_one_process_gives(make_sampler, told, persistent_workers) -> None:
    """torch's loader with workers makes an iterator of the sampler it never reads before the one it
    does: taken as a pass, it skipped every other epoch, and set_epoch(e) gave epoch e + 1."""
    expected_sampler = make_sampler()
    expected = epochs_through(loader_over(expected_sampler), 3, expected_sampler.set_epoch if told else None)
    sampler = make_sampler()
    dataset = list(range(NUM_SAMPLES))
    batching = (
        {"batch_sampler": sampler} if isinstance(sampler, LengthGroupedSampler) else {"batch_size": 4, "sampler": sampler}
    )
    loader = DataLoader(
        dataset, **batching, collate_fn=list, num_workers=2, persistent_workers=persistent_workers,
        multiprocessing_context="fork",
    )
    assert epochs_through(loader, 3, sampler.set_epoch if told else None) == expected


def test_mmap_loader_over_a_batch_sampler_of_ours_resumes_a_later_pass_exactly(tmp_path) -> None:
    """A state taken mid-pass in a pass after the first held the inner sampler's state at the end of the
    pass before: the resumed loader yielded nothing more of the epoch, then repeated it."""
    from torch.utils.data import BatchSampler

    from npz2mmap import MmapDataset, MmapLoader, Writer

    with Writer(tmp_path / "ds") as writer:
        for i in range(NUM_SAMPLES):
            writer.append({"i": np.int64(i)})
    ds = MmapDataset(tmp_path / "ds")

    def loader() -> MmapLoader:
        return MmapLoader(ds, 4, batch_sampler=BatchSampler(ShuffleSampler(NUM_SAMPLES, seed=3), 4, False), seed=0)

    def indices(batches: Any) -> list[list[int]]:
        return [batch["i"].tolist() for batch in batches]

    uninterrupted = loader()
    passes = [indices(uninterrupted) for _ in range(3)]
    for cut in [0, 3]:
        interrupted = loader()
        indices(interrupted)  # the first pass, whole
        taken = []
        for k, batch in enumerate(interrupted):
            taken.append(batch["i"].tolist())
            if k == cut:
                break
        resumed = loader()
        resumed.load_state_dict(interrupted.state_dict())
        assert taken + indices(resumed) == passes[1]
        assert indices(resumed) == passes[2]


@pytest.mark.parametrize("make_sampler", SAMPLERS.values(), ids=SAMPLERS.keys())
def test_a_state_of_another_epoch_than_the_one_set_resumes_nothing_whichever_came_first(make_sampler) -> None:
    """StatefulDataLoader loads a state as its next pass starts, after the loop's set_epoch: the
    state saved at epoch 4's end won over set_epoch(5), and epoch 5 was an empty pass."""
    reference = make_sampler()
    reference.set_epoch(5)
    epoch_5 = list(reference)
    finished = make_sampler()
    finished.set_epoch(4)
    list(finished)
    for set_first in (True, False):
        restored = make_sampler()
        if set_first:
            restored.set_epoch(5)
        restored.load_state_dict(finished.state_dict())
        if not set_first:
            restored.set_epoch(5)
        assert list(restored) == epoch_5
    mid_epoch = make_sampler()
    mid_epoch.set_epoch(5)
    it = iter(mid_epoch)
    taken = [next(it) for _ in range(3)]
    restored = make_sampler()
    restored.set_epoch(5)  # the same epoch: the state resumes it
    restored.load_state_dict(mid_epoch.state_dict())
    assert taken + list(restored) == epoch_5


def stateful_loop(make_sampler: Callable[[], Any], num_workers: int) -> tuple[Any, Any]:
    stateful = pytest.importorskip("torchdata.stateful_dataloader")
    sampler = make_sampler()
    batching = (
        {"batch_sampler": sampler} if isinstance(sampler, LengthGroupedSampler) else {"batch_size": 4, "sampler": sampler}
    )
    loader = stateful.StatefulDataLoader(
        list(range(NUM_SAMPLES)), **batching, collate_fn=list, num_workers=num_workers,
        multiprocessing_context="fork" if num_workers else None,
    )
    return sampler, loader


def run_until(make_sampler: Callable[[], Any], num_workers: int, cut: tuple[str, int, int]) -> tuple[list, dict]:
    """The loop for epoch in range(3): sampler.set_epoch(epoch); for batch in loader, with a state
    taken at the cut: ("start", e, 0) after set_epoch(e), ("in", e, k) after batch k, ("end", e, 0)."""
    sampler, loader = stateful_loop(make_sampler, num_workers)
    seen: list = []
    for epoch in range(3):
        sampler.set_epoch(epoch)
        if cut == ("start", epoch, 0):
            return seen, loader.state_dict()
        for step, batch in enumerate(loader):
            seen.append(batch)
            if cut == ("in", epoch, step):
                return seen, loader.state_dict()
        if cut == ("end", epoch, 0):
            return seen, loader.state_dict()
    raise AssertionError(f"no cut {cut}")


def resume_from(make_sampler: Callable[[], Any], num_workers: int, state: dict, epoch: int) -> list:
    sampler, loader = stateful_loop(make_sampler, num_workers)
    loader.load_state_dict(state)
    resumed = []
    for e in range(epoch, 3):
        sampler.set_epoch(e)
        resumed += list(loader)
    return resumed


@pytest.mark.parametrize("num_workers", [0, 1, 2])
@pytest.mark.parametrize("make_sampler", [block_sampler, length_sampler], ids=["block_shuffle", "length_grouped"])
def test_stateful_dataloader_resumes_a_loop_that_sets_each_epoch_at_every_cut(make_sampler, num_workers) -> None:
    """Against the uninterrupted loop: a cut resumed at its epoch gives the rest, resumed at a later
    epoch gives that epoch whole. A state saved at an epoch's end (or last batch) resumed at the next
    epoch gave an empty pass, or with workers the finished epoch again; saved at an epoch's start
    (after set_epoch, before the pass), with workers, the epoch before it again. DistributedSampler
    gives each of these whole, but for the last batch resumed later, which torchdata fast-forwards."""
    sampler, loader = stateful_loop(make_sampler, 0)
    epochs = []
    for epoch in range(3):
        sampler.set_epoch(epoch)
        epochs.append(list(loader))
    last = len(epochs[0]) - 1
    cuts = [("start", e, 0) for e in (0, 1, 2)] + [("end", e, 0) for e in (0, 1)]
    cuts += [("in", e, k) for e in (0, 1) for k in (0, last // 2, last)]
    for cut in cuts:
        kind, cut_epoch, step = cut
        seen, state = run_until(make_sampler, num_workers, cut)
        finished = kind == "end" or (kind == "in" and step == last)
        for epoch in {cut_epoch, cut_epoch + 1} - ({3} if kind == "start" else set()):
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always", SameEpochWarning)
                resumed = resume_from(make_sampler, num_workers, state, epoch)
            uninterrupted = [batch for e in epochs[epoch:] for batch in e]
            if epoch == cut_epoch and finished:  # the rest is nothing, or torchdata's new pass, said
                warned = any(issubclass(w.category, SameEpochWarning) for w in caught)
                assert resumed == uninterrupted[len(epochs[epoch]) :] or (
                    warned and resumed == uninterrupted
                ), cut
            elif epoch == cut_epoch and kind == "in":
                assert seen[-step - 1 :] + resumed == uninterrupted, cut  # the epoch's first batches, then the rest
            else:
                assert resumed == uninterrupted, (cut, epoch)


@pytest.mark.parametrize("own_shuffle", [True, False], ids=["shuffle=True", "sampler=ShuffleSampler"])
def test_mmap_loader_takes_the_call_made_last_of_set_epoch_and_load_state_dict(tmp_path, own_shuffle) -> None:
    """MmapLoader loads at once, so the later call wins, with its own shuffle as with a sampler of
    ours (which under StatefulDataLoader prefers an epoch set before a load)."""
    from npz2mmap import MmapDataset, MmapLoader, Writer

    with Writer(tmp_path / "ds") as writer:
        for i in range(20):
            writer.append({"i": np.int64(i)})
    ds = MmapDataset(tmp_path / "ds")

    def loader() -> MmapLoader:
        if own_shuffle:
            return MmapLoader(ds, 4, shuffle=True, seed=3)
        return MmapLoader(ds, 4, sampler=ShuffleSampler(20, seed=3))

    reference = loader()
    epochs = []
    for epoch in range(6):
        reference.set_epoch(epoch)
        epochs.append([batch["i"].tolist() for batch in reference])
    interrupted = loader()
    interrupted.set_epoch(3)
    batches = iter(interrupted)
    assert [next(batches)["i"].tolist() for _ in range(2)] == epochs[3][:2]
    state = interrupted.state_dict()
    del batches
    for set_first in (True, False):
        resumed = loader()
        if set_first:
            resumed.set_epoch(5)
        resumed.load_state_dict(state)
        if not set_first:
            resumed.set_epoch(5)
        assert [batch["i"].tolist() for batch in resumed] == (epochs[3][2:] if set_first else epochs[5])
    for detour in ([5, 3], [0, 3], [3, 3]):  # loaded, then the state's epoch chosen last: it resumes
        resumed = loader()
        resumed.load_state_dict(state)
        for epoch in detour:
            resumed.set_epoch(epoch)
        assert [batch["i"].tolist() for batch in resumed] == epochs[3][2:], detour


@pytest.mark.parametrize("make_sampler", SAMPLERS.values(), ids=SAMPLERS.keys())
def test_set_epoch_of_the_running_pass_leaves_its_count_alone(make_sampler) -> None:
    """set_epoch(e) during a pass of epoch e reset the state to 'yielded 0' while the pass went on:
    a checkpoint later in it resumed from the epoch's start, and batches were trained twice."""
    reference = make_sampler()
    reference.set_epoch(0)
    whole = list(reference)
    sampler = make_sampler()
    running = iter(sampler)
    taken = [next(running) for _ in range(2)]
    sampler.set_epoch(0)  # the epoch this pass yields: nothing changes
    taken.append(next(running))
    state = sampler.state_dict()
    assert state["yielded"] == 3
    restored = make_sampler()
    restored.load_state_dict(state)
    restored.set_epoch(0)
    assert taken + list(restored) == whole
    assert taken + list(running) == whole  # the running pass itself goes on as it was


@pytest.mark.parametrize("num_workers", [0, 1, 2])
def test_stateful_dataloader_with_set_epoch_after_iter_resumes_exactly(num_workers) -> None:
    """Lightning's order at a fit's first epoch: iter(loader), then sampler.set_epoch(0)."""
    sampler, loader = stateful_loop(block_sampler, num_workers)
    sampler.set_epoch(0)
    whole = list(loader)
    for set_after in (0, 2):
        sampler, loader = stateful_loop(block_sampler, num_workers)
        batches = iter(loader)
        taken = [next(batches) for _ in range(set_after)]
        sampler.set_epoch(0)
        taken += [next(batches) for _ in range(5 - set_after)]
        state = loader.state_dict()
        del batches, loader
        assert resume_from(block_sampler, num_workers, state, 0)[: len(whole) - 5] == whole[5:]


@pytest.mark.parametrize("make_sampler", SAMPLERS.values(), ids=SAMPLERS.keys())
def test_the_epoch_chosen_last_decides_whatever_was_set_before(make_sampler) -> None:
    """set_epoch(1) then set_epoch(0) inside an epoch-0 pass reset its count to 0; a state of epoch 1
    loaded, then set_epoch(2) and set_epoch(1), resumed nothing though epoch 1 was chosen last."""
    epochs = []
    for epoch in (0, 1):
        reference = make_sampler()
        reference.set_epoch(epoch)
        epochs.append(list(reference))
    sampler = make_sampler()
    running = iter(sampler)
    taken = [next(running) for _ in range(2)]
    sampler.set_epoch(1)
    assert sampler.state_dict()["yielded"] == 0  # epoch 1's next pass, from its start
    sampler.set_epoch(0)  # the epoch the pass yields: its count again
    assert (sampler.state_dict()["epoch"], sampler.state_dict()["yielded"]) == (0, 2)
    taken.append(next(running))
    restored = make_sampler()
    restored.load_state_dict(sampler.state_dict())
    assert taken + list(restored) == epochs[0]
    mid_epoch_1 = make_sampler()
    mid_epoch_1.set_epoch(1)
    batches = iter(mid_epoch_1)
    first = [next(batches) for _ in range(2)]
    state = mid_epoch_1.state_dict()
    for detour in ([2, 1], [0, 1]):
        for load_first in (True, False):
            restored = make_sampler()
            if load_first:
                restored.load_state_dict(state)
            for epoch in detour:
                restored.set_epoch(epoch)
            if not load_first:
                restored.load_state_dict(state)
            assert first + list(restored) == epochs[1], (detour, load_first)



def test_a_state_of_another_kind_of_sampler_is_refused_even_one_whose_settings_fit() -> None:
    """A ShuffleSampler's state, whose settings a BlockShuffleSampler also has, was taken for an earlier
    version's: that epoch trained 5 samples twice and 5 never."""
    shuffle = ShuffleSampler(NUM_SAMPLES, seed=3)
    shuffle.set_epoch(1)
    state = shuffle.state_dict()
    assert state["sampler"] == "ShuffleSampler"
    with pytest.raises(ValueError, match="sampler state is a ShuffleSampler's, this sampler is a BlockShuffleSampler"):
        block_sampler().load_state_dict(state)
    earlier = {key: value for key, value in state.items() if key != "sampler"}  # an earlier version's
    with pytest.raises(ValueError, match="sampler state has no block_size, which every BlockShuffleSampler state"):
        block_sampler().load_state_dict(earlier)  # every BlockShuffleSampler state held block_size
    restored = ShuffleSampler(NUM_SAMPLES, seed=3)
    restored.load_state_dict(earlier)
    restored.set_epoch(1)
    assert list(restored) == list(shuffle)


def test_a_loader_state_of_another_shuffle_says_so_before_its_seed(tmp_path) -> None:
    """A non-shuffling loader's state loaded into a shuffling one said "seed 0 vs seed 3"; the
    seed given as told, it then said the shuffle differs."""
    from npz2mmap import MmapDataset, MmapLoader, Writer

    with Writer(tmp_path / "ds") as writer:
        for i in range(12):
            writer.append({"i": np.int64(i)})
    ds = MmapDataset(tmp_path / "ds")
    plain = MmapLoader(ds, 4)
    state = plain.state_dict()
    with pytest.raises(ValueError) as refused:
        MmapLoader(ds, 4, shuffle=True, seed=3).load_state_dict(state)
    assert str(refused.value) == (
        "loader state has shuffle False, this loader has True: its batches would be other samples; "
        "resume with the loader the state was saved from"
    )


@pytest.mark.parametrize("through", ["sampler", "DataLoader"])
def test_same_epoch_warning_points_at_the_users_own_line(through) -> None:
    """Through a DataLoader it named torch's sampler.py, so the default filter showed one warning for
    two loaders repeating an epoch."""
    from npz2mmap.errors import SameEpochWarning

    sampler = ShuffleSampler(NUM_SAMPLES, seed=3)
    passes: Any = sampler if through == "sampler" else loader_over(sampler)
    list(passes)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        list(passes)  # the second pass over epoch 0, without set_epoch
    [warning] = [w for w in caught if issubclass(w.category, SameEpochWarning)]
    assert warning.filename == __file__


@pytest.mark.parametrize("make_sampler", SAMPLERS.values(), ids=SAMPLERS.keys())
def test_set_epoch_of_a_running_pass_does_not_choose_the_next_passes_epoch(make_sampler) -> None:
    """Lightning's first epoch calls set_epoch(0) inside the pass; a state of epoch 1 loaded after it
    ended was then ignored, and epoch 0 ran again whole."""
    reference = make_sampler()
    reference.set_epoch(1)
    epoch_1 = list(reference)
    saved = make_sampler()
    saved.set_epoch(1)
    batches = iter(saved)
    first = [next(batches) for _ in range(2)]
    state = saved.state_dict()
    sampler = make_sampler()
    running = iter(sampler)
    next(running)
    sampler.set_epoch(0)  # the running pass's own epoch
    list(running)
    sampler.load_state_dict(state)
    assert first + list(sampler) == epoch_1


def test_a_sampler_state_given_to_a_loader_is_named_as_one(tmp_path) -> None:
    """It said "'batches_yielded' must be an integer, found None"."""
    from npz2mmap import MmapDataset, MmapLoader, Writer

    with Writer(tmp_path / "ds") as writer:
        for i in range(12):
            writer.append({"i": np.int64(i)})
    sampler = ShuffleSampler(12, seed=3)
    loader = MmapLoader(MmapDataset(tmp_path / "ds"), 4, sampler=sampler)
    with pytest.raises(ValueError) as refused:
        loader.load_state_dict(sampler.state_dict())
    assert str(refused.value) == (
        "loader state is a ShuffleSampler's state, not a MmapLoader's: load it into that sampler, or save "
        "and load loader.state_dict()"
    )
    with pytest.raises(ValueError, match="another loader's .torchdata's StatefulDataLoader's"):
        loader.load_state_dict({"_snapshot": {}, "_steps_since_snapshot": 0})


@pytest.mark.parametrize(
    "make",
    [
        lambda: ShuffleSampler(10, num_replicas=2),
        lambda: BlockShuffleSampler(10, 2, num_replicas=2),
        lambda: LengthGroupedSampler(np.arange(10), 2, num_replicas=2),
    ],
    ids=["ShuffleSampler", "BlockShuffleSampler", "LengthGroupedSampler"],
)
def test_a_world_size_without_a_rank_outside_a_process_group_is_refused(make) -> None:
    """num_replicas=2 with no rank and no process group read as rank 0 on every process: each
    read the same half and the other half was never read. DistributedSampler raises there."""
    message = (
        "num_replicas=2 without rank: pass rank= (this process's place in 0..1), "
        "or initialise torch.distributed's process group, which gives both"
    )
    with pytest.raises(ValueError, match=f"^{re.escape(message)}$"):
        make()


@pytest.mark.parametrize(
    ("lengths", "error", "message"),
    [
        (np.array([3, -1, 2]), ValueError, "lengths must be at least 0; sample 1 has -1"),
        (np.array([1.5, 2.0]), TypeError, "lengths must be integers, as ds.lengths(field) gives, not float64"),
        (np.array([True, False]), TypeError, "lengths must be integers, as ds.lengths(field) gives, not bool"),
        (np.zeros((2, 2, 2), int), ValueError, "lengths must be one length (1-d) or one shape (2-d) per sample, not 3-d"),
        (np.int64(3), ValueError, "lengths must be one length (1-d) or one shape (2-d) per sample, not 0-d"),
        (np.array([[1, -2]]), ValueError, "lengths must be at least 0; sample 0 has -2"),
    ],
)
def test_lengths_that_are_not_lengths_are_refused(lengths, error, message) -> None:
    """Negative, fractional and 3-d lengths made batches without a word."""
    with pytest.raises(error, match=f"^{re.escape(message)}$"):
        LengthGroupedSampler(lengths, 2)


def test_lengths_of_no_samples_give_no_batches_whatever_their_dtype() -> None:
    assert list(LengthGroupedSampler([], 2)) == []

