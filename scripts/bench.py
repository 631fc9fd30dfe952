"""Benchmark npz2mmap against the usual ways of feeding NPZ files to PyTorch.

    python scripts/bench.py                  # full run (about 10 minutes on 2 cores)
    python scripts/bench.py --quick          # a small smoke run (CI)
    python scripts/bench.py --scale          # also the scale section (10M samples, 1M files, 2 GiB member)
    python scripts/bench.py --only conversion --workload ragged --files 50000   # conversion alone
    python scripts/bench.py --only loaders --workdir DIR   # worker-process loaders alone (warm cache)
    python scripts/bench.py --only outofcore --workdir DIR # cold, in a memory cgroup (root; outofcore.py)

Everything is measured side by side in one run on workloads this script
generates from fixed seeds. Prints a markdown table and writes results.md,
results.json and results.png to --out.
"""

from __future__ import annotations

import argparse
import gc
import json
import multiprocessing
import os
import pickle
import platform
import shutil
import subprocess
import sys
import tempfile
import threading
import time
import warnings
import zlib
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from proctree import process_tree
from torch.utils.data import DataLoader, Dataset

from npz2mmap import MmapDataset, MmapLoader, collate
from npz2mmap.read.reader import DatasetReader

BATCH = 64
WARM_EPOCHS = 2  # the best of these is reported: the machine is shared and noisy
LOADER_WARM_EPOCHS = 6  # the loaders section's epochs are short (a tenth of a second)
ROOT = Path(__file__).resolve().parent.parent


# --- workloads ----------------------------------------------------------------


@dataclass(frozen=True)
class Workload:
    name: str
    count: int
    compressed: bool = False
    ragged: bool = False

    def sample(self, rng: np.random.Generator) -> dict[str, np.ndarray]:
        if self.ragged:
            length = int(rng.integers(64, 2049))
            return {
                "tokens": rng.integers(0, 50_000, size=length, dtype=np.int32),
                "mask": (rng.random(length) < 0.9).astype(np.uint8),
            }
        return {
            "input": rng.standard_normal((3, 64, 64), dtype=np.float32),
            "label": np.int64(rng.integers(1000)),
        }


WORKLOAD_NAMES = ("fixed", "ragged", "compressed")


def make_workload(work: Workload, root: Path) -> Path:
    """Write the workload's NPZ files once (deterministic), reusing them if present."""
    src = root / work.name / "npz"
    done = root / work.name / "npz.done"
    if done.exists():
        return src
    shutil.rmtree(src, ignore_errors=True)
    src.mkdir(parents=True)
    rng = np.random.default_rng(len(work.name))
    save = np.savez_compressed if work.compressed else np.savez
    for i in range(work.count):
        save(src / f"{i:07d}.npz", **work.sample(rng))
    done.touch()
    return src


def npz_paths(src: Path) -> list[str]:
    return sorted(str(p) for p in src.glob("*.npz"))


# --- memory: the sum of PSS over a process tree ---------------------------------




def pss_bytes(pid: int) -> tuple[int, int]:
    """(PSS, of which file-backed) of one process, in bytes."""
    values = {}
    try:
        with open(f"/proc/{pid}/smaps_rollup") as fp:
            for line in fp:
                key, _, rest = line.partition(":")
                if key in ("Pss", "Pss_File"):
                    values[key] = int(rest.split()[0]) * 1024
    except OSError:
        pass
    return values.get("Pss", 0), values.get("Pss_File", 0)


class PssSampler:
    """Samples the sum of PSS over a process (default: this one) and all its descendants; keeps the peak.

    File-backed PSS is page cache mapped by the processes (a memory map, the
    loaded libraries): shared by every process on the machine, counted once.
    """

    def __init__(self, interval: float = 0.05, root: int | None = None, active: bool = True) -> None:
        self.interval = interval
        self.active = active
        self.root = root if root is not None else os.getpid()
        self.peak = 0
        self.peak_file = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            samples = [pss_bytes(p) for p in process_tree(self.root)]
            total = sum(pss for pss, _ in samples)
            if total > self.peak:
                self.peak, self.peak_file = total, sum(file for _, file in samples)
            self._stop.wait(self.interval)

    def __enter__(self) -> PssSampler:
        if self.active:
            self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        if self.active:
            self._thread.join()


def drop_from_page_cache(paths: Iterable[Path | str]) -> None:
    """Evict files' clean pages with posix_fadvise(DONTNEED): a cold cache without root."""
    for path in paths:
        try:
            fd = os.open(path, os.O_RDONLY)
        except OSError:
            continue
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def files_under(*roots: Path) -> list[Path]:
    return [p for root in roots if root.exists() for p in root.rglob("*") if p.is_file()]


# --- the loaders under test ----------------------------------------------------------


def load_npz(path: str) -> dict[str, np.ndarray]:
    with np.load(path) as npz:
        return {key: npz[key] for key in npz.files}


class NaiveDataset(Dataset):
    """np.load of the NPZ file on every item."""

    def __init__(self, paths: list[str]) -> None:
        self.paths = paths

    def __len__(self) -> int:
        return len(self.paths)

    def __getitem__(self, i: int) -> dict[str, np.ndarray]:
        return load_npz(self.paths[i])


class LruDataset(NaiveDataset):
    """A per-worker cache of every loaded item: no locks, one copy per worker."""

    def __init__(self, paths: list[str]) -> None:
        super().__init__(paths)
        self.cache: dict[int, dict[str, np.ndarray]] = {}

    def __getitem__(self, i: int) -> dict[str, np.ndarray]:
        if i not in self.cache:
            self.cache[i] = load_npz(self.paths[i])
        return self.cache[i]


class ManagerDataset(NaiveDataset):
    """One shared Manager().dict() cache behind a Manager lock."""

    def __init__(self, paths: list[str], manager: Any) -> None:
        super().__init__(paths)
        self.cache = manager.dict()
        self.lock = manager.Lock()

    def __getitem__(self, i: int) -> dict[str, np.ndarray]:
        with self.lock:
            hit = self.cache.get(i)
        if hit is not None:
            return hit
        item = load_npz(self.paths[i])
        with self.lock:
            self.cache[i] = item
        return item


class DiskcacheDataset(NaiveDataset):
    """A shared diskcache.Cache (SQLite index, pickled values)."""

    def __init__(self, paths: list[str], directory: str) -> None:
        super().__init__(paths)
        self.directory = directory
        self._cache: Any = None

    def __getitem__(self, i: int) -> dict[str, np.ndarray]:
        import diskcache

        if self._cache is None:
            self._cache = diskcache.Cache(self.directory)
        item = self._cache.get(i)
        if item is None:
            item = load_npz(self.paths[i])
            self._cache.set(i, item)
        return item

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_cache": None}


class InRamBatches:
    """The upper bound: every array already in this process's RAM, batches by fancy indexing."""

    def __init__(self, arrays: dict[str, np.ndarray], seed: int = 0) -> None:
        self.arrays = arrays
        self.seed = seed
        self.epoch = 0

    def __iter__(self) -> Iterable[dict[str, torch.Tensor]]:
        count = len(next(iter(self.arrays.values())))
        order = np.random.default_rng((self.seed, self.epoch)).permutation(count)
        self.epoch += 1
        for start in range(0, count, BATCH):
            index = order[start : start + BATCH]
            yield {key: torch.from_numpy(array[index]) for key, array in self.arrays.items()}


def worker_loader(dataset: Any, workers: int, shuffle: bool = True, **kwargs: Any) -> DataLoader:
    # 4 workers on 2 cores, on purpose:
    warnings.filterwarnings("ignore", message="This DataLoader will create")
    return DataLoader(
        dataset,
        batch_size=BATCH,
        shuffle=shuffle,
        num_workers=workers,
        persistent_workers=workers > 0,
        **kwargs,
    )


def batch_count(batch: Any) -> int:
    if isinstance(batch, dict):
        batch = next(iter(batch.values()))
    return len(batch)


def ragged_collate(items: list[dict[str, np.ndarray]]) -> list[dict[str, np.ndarray]]:
    return items


# --- measuring one loader --------------------------------------------------------------


@dataclass
class Measured:
    loader: str
    workload: str
    workers: int
    cold_per_s: float = 0.0
    warm_per_s: float = 0.0
    first_batch_s: float = 0.0
    peak_pss_bytes: int = 0
    peak_pss_file_bytes: int = 0
    note: str = ""


def run_epochs(
    make: Callable[[], Iterable[Any]],
    cold_files: list[Path],
    row: Measured,
    pss_apart: bool = False,
    warm_epochs: int = WARM_EPOCHS,
) -> Measured:
    """Epoch 1 on a cold page cache, then the best of ``warm_epochs`` warm ones; the PSS peak over all.

    With ``pss_apart``, the PSS is sampled over one more epoch instead: reading
    every process's smaps takes CPU that worker processes would otherwise use.
    """
    gc.collect()
    drop_from_page_cache(cold_files)
    sampler = PssSampler(active=not pss_apart)
    with sampler:
        started = time.perf_counter()
        loader = make()
        for epoch in range(1 + warm_epochs):
            epoch_start = time.perf_counter()
            seen = sum(batch_count(batch) for batch in _first_noted(loader, row, started, epoch))
            rate = seen / (time.perf_counter() - epoch_start)
            if epoch == 0:
                row.cold_per_s = rate
            else:
                row.warm_per_s = max(row.warm_per_s, rate)
        if pss_apart:
            sampler = PssSampler()
            with sampler:
                for _ in loader:
                    pass
        close = getattr(loader, "close", None)  # MmapLoader's worker processes
        if close is not None:
            close()
        del loader
    row.peak_pss_bytes = sampler.peak
    row.peak_pss_file_bytes = sampler.peak_file
    return row


def _first_noted(loader: Iterable[Any], row: Measured, started: float, epoch: int) -> Iterable[Any]:
    """The loader's batches; the time to the very first is noted in ``row``."""
    for batch in loader:
        if epoch == 0 and not row.first_batch_s:
            row.first_batch_s = time.perf_counter() - started
        yield batch


# --- sections ----------------------------------------------------------------------------


def throughput_section(
    work: Workload, src: Path, dataset: Path, scratch: Path, quick: bool
) -> list[Measured]:
    paths = npz_paths(src)
    blob_files = files_under(dataset)
    fields = ["tokens", "mask"] if work.ragged else ["input", "label"]
    extra = {"collate_fn": ragged_collate} if work.ragged else {}
    loaders: dict[str, tuple[int, Callable[[], Iterable[Any]], list[Path]]] = {
        "np.load per item": (2, lambda: worker_loader(NaiveDataset(paths), 2, **extra), []),
        "per-worker LRU cache": (2, lambda: worker_loader(LruDataset(paths), 2, **extra), []),
        "MmapDataset per item": (
            2,
            lambda: worker_loader(MmapDataset(dataset, fields=fields), 2, **extra),
            blob_files,
        ),
        "MmapDataset batched, 2 workers": (
            2,
            lambda: worker_loader(MmapDataset(dataset, fields=fields), 2, collate_fn=collate),
            blob_files,
        ),
        "MmapDataset batched, no workers": (
            0,
            lambda: worker_loader(MmapDataset(dataset, fields=fields), 0, collate_fn=collate),
            blob_files,
        ),
        "MmapLoader (thread prefetch)": (
            0,
            lambda: MmapLoader(MmapDataset(dataset, fields=fields), BATCH, shuffle=True),
            blob_files,
        ),
        "MmapLoader (no thread)": (
            0,
            lambda: MmapLoader(MmapDataset(dataset, fields=fields), BATCH, shuffle=True, prefetch=0),
            blob_files,
        ),
    }
    if not work.ragged:
        manager = multiprocessing.Manager()
        cache_dir = scratch / f"diskcache-{work.name}"
        loaders["Manager().dict() + lock"] = (2, lambda: worker_loader(ManagerDataset(paths, manager), 2), [])
        loaders["diskcache"] = (2, lambda: worker_loader(DiskcacheDataset(paths, str(cache_dir)), 2), [])
        loaders["in-RAM fancy indexing (bound)"] = (0, lambda: InRamBatches(read_all(dataset, fields)), [])
    rows = []
    for name, (workers, make, extra_cold) in loaders.items():
        shutil.rmtree(scratch / f"diskcache-{work.name}", ignore_errors=True)
        cold = [Path(p) for p in paths] + extra_cold
        row = run_epochs(make, cold, Measured(name, work.name, workers))
        print(
            f"  {work.name:10s} {name:34s} cold {row.cold_per_s:>10,.0f}/s  warm {row.warm_per_s:>10,.0f}/s  "
            f"PSS {row.peak_pss_bytes / 1e6:>8,.0f} MB",
            flush=True,
        )
        rows.append(row)
    if not work.ragged:
        manager.shutdown()
    return rows


def read_all(dataset: Path, fields: list[str]) -> dict[str, np.ndarray]:
    reader = DatasetReader(dataset)
    return {name: np.array(reader.column(name)) for name in fields}


def memory_section(work: Workload, src: Path, dataset: Path, worker_counts: list[int]) -> list[Measured]:
    """The PSS sum with 1, 2, 4 workers: a per-worker cache grows, the mapping does not."""
    paths = npz_paths(src)
    rows = []
    for workers in worker_counts:
        for name, make in {
            "per-worker LRU cache": lambda w=workers: worker_loader(LruDataset(paths), w),
            "MmapDataset per item": lambda w=workers: worker_loader(
                MmapDataset(dataset, fields=["input", "label"]), w
            ),
        }.items():
            row = run_epochs(make, [], Measured(name, work.name, workers, note="memory"))
            print(f"  {workers} workers {name:24s} PSS {row.peak_pss_bytes / 1e6:,.0f} MB", flush=True)
            rows.append(row)
    return rows


def ranks_section(dataset: Path, rank_counts: list[int]) -> list[Measured]:
    """torchrun with 1, 2, 4 ranks x 2 workers: the PSS summed over all of them stays near one copy."""
    rows = []
    for ranks in rank_counts:
        command = [
            str(Path(sys.executable).parent / "torchrun"),
            "--standalone",
            f"--nproc_per_node={ranks}",
            __file__,
            "--child",
            "ddp",
            str(dataset),
        ]
        process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        with PssSampler(root=process.pid) as pss:
            stdout, stderr = process.communicate()
        if process.returncode != 0:
            raise RuntimeError(stderr[-3000:])
        rates = json.loads(stdout.strip().splitlines()[-1])
        row = Measured(
            "MmapDataset, DistributedSampler",
            "fixed",
            ranks * 2,
            note=f"{ranks} ranks",
            warm_per_s=rates["warm_per_s"],
            cold_per_s=rates["first_epoch_per_s"],
        )
        row.peak_pss_bytes, row.peak_pss_file_bytes = pss.peak, pss.peak_file
        print(
            f"  {ranks} ranks x 2 workers: PSS {pss.peak / 1e6:,.0f} MB ({pss.peak_file / 1e6:,.0f} mapped)",
            flush=True,
        )
        rows.append(row)
    return rows


def child_ddp(dataset: Path) -> dict[str, Any]:
    """One rank of ranks_section: two epochs with DistributedSampler and 2 workers; reports samples/s."""
    import torch.distributed as dist
    from torch.utils.data import DistributedSampler

    dist.init_process_group("gloo")
    ds = MmapDataset(dataset, fields=["input", "label"])
    sampler = DistributedSampler(ds, shuffle=True)
    loader = worker_loader(ds, 2, sampler=sampler, shuffle=False)
    rates = []
    for epoch in range(2):
        sampler.set_epoch(epoch)
        dist.barrier()
        started = time.perf_counter()
        for _ in loader:
            pass
        dist.barrier()
        rates.append(len(ds) / (time.perf_counter() - started))
    dist.destroy_process_group()
    return {"first_epoch_per_s": rates[0], "warm_per_s": rates[1]}


def advice_section(dataset: Path, quick: bool) -> list[Measured]:
    """Cold-cache random access: default readahead vs MADV_RANDOM, and block shuffling."""
    from npz2mmap import BlockShuffleSampler

    rows = []
    blob = files_under(dataset)
    count = len(MmapDataset(dataset))
    variants = {
        "shuffle, default readahead": lambda: MmapLoader(MmapDataset(dataset), BATCH, shuffle=True),
        "shuffle, MADV_RANDOM": lambda: MmapLoader(
            MmapDataset(dataset, advice="random"), BATCH, shuffle=True
        ),
        "block shuffle (1024), default": lambda: MmapLoader(
            MmapDataset(dataset), BATCH, sampler=BlockShuffleSampler(count, 1024)
        ),
        "sequential, MADV_SEQUENTIAL": lambda: MmapLoader(MmapDataset(dataset, advice="sequential"), BATCH),
    }
    for name, make in variants.items():
        row = run_epochs(make, blob, Measured(name, "fixed", 0, note="advice"))
        print(f"  {name:32s} cold {row.cold_per_s:>10,.0f}/s  warm {row.warm_per_s:>10,.0f}/s", flush=True)
        rows.append(row)
    return rows


# --- loaders: worker processes against the hand-off ------------------------------------


def light_transform(sample: dict[str, Any]) -> dict[str, Any]:
    """Flip and normalise one image: about what a light augmentation costs."""
    sample["input"] = (sample["input"][:, :, ::-1] - 0.5) / 0.25
    return sample


def heavy_transform(sample: dict[str, Any]) -> dict[str, Any]:
    """A transform of a few hundred microseconds per sample, as decoding or resizing costs."""
    x = sample["input"]
    for _ in range(HEAVY_ROUNDS):
        x = np.tanh(x)
    sample["input"] = x
    return sample


HEAVY_ROUNDS = 40  # about 250 us a sample here


class EmptyBatches(Dataset):
    """Items that are whole batches, new and never written: DataLoader's worker hand-off and nothing else.

    Each is a fresh tensor, as a collate inside a worker makes one, so each
    crosses to the trainer through its own shared-memory segment.
    """

    def __init__(self, count: int) -> None:
        self.count = count

    def __len__(self) -> int:
        return -(-self.count // BATCH)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {
            "input": torch.empty((BATCH, 3, 64, 64), dtype=torch.float32),
            "label": torch.empty(BATCH, dtype=torch.int64),
        }


class InRamPadded:
    """The bound for ragged batches: samples in RAM as flat arrays, each batch padded by one slice
    copy per sample (faster in RAM than any vectorised index at these lengths)."""

    def __init__(self, dataset: Path, fields: list[str], seed: int = 0) -> None:
        reader = DatasetReader(dataset)
        count = len(reader)
        self.flat = {name: np.concatenate([reader.view(name, i) for i in range(count)]) for name in fields}
        self.lengths = np.ascontiguousarray(reader.shapes(fields[0])[:, 0])
        self.starts = np.concatenate([[0], np.cumsum(self.lengths)[:-1]])
        self.seed = seed
        self.epoch = 0

    def __iter__(self) -> Iterable[dict[str, torch.Tensor]]:
        count = len(self.lengths)
        order = np.random.default_rng((self.seed, self.epoch)).permutation(count)
        self.epoch += 1
        for first in range(0, count, BATCH):
            index = order[first : first + BATCH]
            lengths = self.lengths[index]
            batch = {
                name: torch.from_numpy(self.pad(flat, index, lengths)) for name, flat in self.flat.items()
            }
            batch["lengths"] = torch.from_numpy(lengths)
            yield batch

    def pad(self, flat: np.ndarray, index: np.ndarray, lengths: np.ndarray) -> np.ndarray:
        padded = np.zeros((len(index), int(lengths.max())), dtype=flat.dtype)
        for row, start, length in zip(padded, self.starts[index].tolist(), lengths.tolist(), strict=True):
            row[:length] = flat[start : start + length]
        return padded


class InRamPaddedIndexed(InRamPadded):
    """The same samples in RAM, each batch padded by one vectorised element index per field
    (no Python loop over samples: slower in RAM than a slice per sample at these lengths)."""

    def pad(self, flat: np.ndarray, index: np.ndarray, lengths: np.ndarray) -> np.ndarray:
        valid = np.arange(int(lengths.max())) < lengths[:, None]
        ends = np.cumsum(lengths)
        source = np.repeat(self.starts[index] - (ends - lengths), lengths) + np.arange(int(ends[-1]))
        padded = np.zeros(valid.shape, dtype=flat.dtype)
        padded[valid] = flat[source]
        return padded


def first_samples(count: int, seed: int = 0) -> np.ndarray:
    """A fixed shuffled order of the first ``count`` samples (for the slow heavy-transform rows)."""
    return np.random.default_rng(seed).permutation(count)


def ring_loader(dataset: MmapDataset, workers: int, **options: Any) -> MmapLoader:
    """MmapLoader with worker processes and its ring of shared batch slots; shuffled without a sampler."""
    return MmapLoader(dataset, BATCH, shuffle="sampler" not in options, num_workers=workers, **options)


def single_loader(dataset: MmapDataset, **options: Any) -> MmapLoader:
    """MmapLoader in this process alone, no thread; shuffled without a sampler."""
    return MmapLoader(dataset, BATCH, shuffle="sampler" not in options, prefetch=0, **options)


def loaders_section(fixed: Path, ragged: Path | None, quick: bool) -> list[Measured]:
    """Warm page cache: the ring of shared batch slots against torch's hand-off, with transforms too."""
    from npz2mmap import PaddedCollate

    fields = ["input", "label"]
    count = len(MmapDataset(fixed))
    heavy = first_samples(min(count, 600 if quick else 4000))

    def ds(transform: Callable[[Any], Any] | None = None) -> MmapDataset:
        return MmapDataset(fixed, fields=fields, transform=transform)

    light = light_transform
    variants: list[tuple[str, int, str, Callable[[], Iterable[Any]]]] = [
        ("fixed", 0, "in-RAM gather (bound)", lambda: InRamBatches(read_all(fixed, fields))),
        ("fixed", 0, "MmapLoader, no workers (prefetch=0)", lambda: single_loader(ds())),
        ("fixed", 2, "DataLoader, empty batches (hand-off alone)", lambda: ready_loader(count)),
        ("fixed", 2, "DataLoader(MmapDataset) per item", lambda: worker_loader(ds(), 2)),
        ("fixed", 2, "DataLoader(MmapDataset) + collate", lambda: worker_loader(ds(), 2, collate_fn=collate)),
        ("fixed", 1, "MmapLoader, 1 worker (ring)", lambda: ring_loader(ds(), 1)),
        ("fixed", 2, "MmapLoader, 2 workers (ring)", lambda: ring_loader(ds(), 2)),
        ("fixed", 0, "light transform: DataLoader, no workers", lambda: worker_loader(ds(light), 0)),
        ("fixed", 2, "light transform: DataLoader, 2 workers", lambda: worker_loader(ds(light), 2)),
        ("fixed", 0, "light transform: MmapLoader, no workers", lambda: single_loader(ds(light))),
        ("fixed", 2, "light transform: MmapLoader, 2 workers (ring)", lambda: ring_loader(ds(light), 2)),
    ]
    for workers in (0, 1, 2):
        name = f"heavy transform: MmapLoader, {workers or 'no'} worker{'s' * (workers != 1)}"
        variants.append(
            ("fixed", workers, name + " (ring)" * (workers > 0), heavy_loader(fixed, fields, heavy, workers))
        )
    if ragged is not None:
        pad = {"collate_fn": PaddedCollate()}

        def tokens() -> MmapDataset:
            return MmapDataset(ragged, fields=["tokens", "mask"])

        variants += [
            ("ragged", 0, "in-RAM padded gather (bound)", lambda: InRamPadded(ragged, ["tokens", "mask"])),
            (
                "ragged",
                0,
                "in-RAM padded gather, one index",
                lambda: InRamPaddedIndexed(ragged, ["tokens", "mask"]),
            ),
            ("ragged", 0, "PaddedCollate: MmapLoader, no workers", lambda: single_loader(tokens(), **pad)),
            (
                "ragged",
                2,
                "PaddedCollate: MmapLoader, 2 workers (ring)",
                lambda: ring_loader(tokens(), 2, **pad),
            ),
            ("ragged", 2, "PaddedCollate: DataLoader, 2 workers", lambda: worker_loader(tokens(), 2, **pad)),
        ]
    rows = []
    for workload, workers, name, make in variants:
        row = Measured(name, workload, workers, note="loaders")
        run_epochs(make, [], row, pss_apart=True, warm_epochs=LOADER_WARM_EPOCHS)
        print(f"  {workload:7s} {name:48s} warm {row.warm_per_s:>10,.0f}/s", flush=True)
        rows.append(row)
    return rows


def ready_loader(count: int) -> DataLoader:
    """Two workers handing over new batches that cost nothing to make, with torch's default settings."""
    return DataLoader(
        EmptyBatches(count), batch_size=None, shuffle=True, num_workers=2, persistent_workers=True
    )


def heavy_loader(
    dataset: Path, fields: list[str], order: np.ndarray, workers: int
) -> Callable[[], MmapLoader]:
    """The heavy transform's loader over a fixed order of a few samples (the epochs would be long)."""

    def make() -> MmapLoader:
        ds = MmapDataset(dataset, fields=fields, transform=heavy_transform)
        return ring_loader(ds, workers, sampler=order) if workers else single_loader(ds, sampler=order)

    return make


@dataclass
class Conversion:
    """One workload converted side by side with the floor: reading and copying its files."""

    workload: str
    files: int
    source_bytes: int
    dataset_bytes: int
    workers: int  # of the "all workers" runs
    cat_cold_s: float
    cat_hot_s: float
    cp_sync_s: float  # cp -r of the sources, then sync, cold
    inflate_s: float  # zlib alone over every member's deflated bytes, one process (0: nothing deflated)
    convert_1_cold_s: float
    convert_1_hot_s: float
    convert_cold_s: float
    convert_hot_s: float


def timed(command: list[str] | str) -> float:
    started = time.perf_counter()
    subprocess.run(command, check=True, shell=isinstance(command, str), capture_output=True)
    return time.perf_counter() - started


DROP_CACHES = "/proc/sys/vm/drop_caches"


def can_drop_all_caches() -> bool:
    """Whether this process may empty the kernel's page cache (root on Linux)."""
    return os.access(DROP_CACHES, os.W_OK)


def cold(*roots: Path) -> list[Path]:
    """Write back every dirty page, then empty the page cache: all of it where the kernel lets us
    (drop_caches), else the pages of every file under ``roots`` (posix_fadvise(DONTNEED), which
    cannot evict pages still dirty: hence the sync first). Return the files."""
    paths = files_under(*roots)
    os.sync()
    if can_drop_all_caches():
        with open(DROP_CACHES, "w") as fp:
            fp.write("1\n")
    else:
        drop_from_page_cache(paths)
    return paths


def cat_all(src: Path) -> float:
    return timed(f"find '{src}' -type f -print0 | xargs -0 cat > /dev/null")


def cp_and_sync(src: Path, copy: Path) -> float:
    shutil.rmtree(copy, ignore_errors=True)
    cold(src)
    seconds = timed(f"cp -r '{src}' '{copy}' && sync")
    cold(copy)
    shutil.rmtree(copy)
    return seconds


def converted(src: Path, dataset: Path) -> Path:
    """``dataset``, converted from ``src`` unless a dataset is there already (for --only loaders)."""
    if not (dataset / "index.json").exists():
        subprocess.run(
            [
                str(Path(sys.executable).parent / "npz2mmap"),
                "convert",
                str(src),
                "-o",
                str(dataset),
                "-q",
                "--overwrite",
            ],
            check=True,
        )
    return dataset


def convert_cold_and_hot(src: Path, dataset: Path, workers: int) -> tuple[float, float]:
    """`npz2mmap convert` from a cold cache, then again with the sources cached (the output removed first)."""
    cli = str(Path(sys.executable).parent / "npz2mmap")
    command = [cli, "convert", str(src), "-o", str(dataset), "--workers", str(workers), "-q"]
    times = []
    for drop in (True, False):
        if dataset.exists():
            shutil.rmtree(dataset)
            os.sync()
        if drop:
            cold(src)
        times.append(timed(command))
    return times[0], times[1]


def inflate_alone(src: Path) -> float:
    """Seconds zlib takes to inflate every deflated member, in one process, its input already in memory."""
    import zipfile

    raw = []
    for path in sorted(src.rglob("*.npz")):
        with zipfile.ZipFile(path) as zf:
            for info in zf.infolist():
                if info.compress_type == zipfile.ZIP_DEFLATED:
                    with open(path, "rb") as fp:
                        fp.seek(info.header_offset + 26)
                        skip = int.from_bytes(fp.read(2), "little") + int.from_bytes(fp.read(2), "little")
                        fp.seek(skip, os.SEEK_CUR)
                        raw.append(fp.read(info.compress_size))
    started = time.perf_counter()
    for data in raw:
        zlib.decompressobj(-zlib.MAX_WBITS).decompress(data)
    return time.perf_counter() - started if raw else 0.0


def convert_section(work: Workload, src: Path, root: Path, workers: int) -> tuple[Path, Conversion]:
    """cat (cold, hot), cp -r + sync and convert (1 and all workers, cold and hot), side by side."""
    paths = files_under(src)
    source_bytes = sum(p.stat().st_size for p in paths)
    dataset = root / work.name / "dataset"
    cold(src)
    cat_cold = cat_all(src)
    cat_hot = cat_all(src)
    cp_sync = cp_and_sync(src, root / work.name / "cp-copy")
    one = convert_cold_and_hot(src, dataset, 1)
    every = convert_cold_and_hot(src, dataset, workers)
    size = sum(p.stat().st_size for p in files_under(dataset))
    inflate = inflate_alone(src) if work.compressed else 0.0
    row = Conversion(
        work.name, len(paths), source_bytes, size, workers, cat_cold, cat_hot, cp_sync, inflate, *one, *every
    )
    print(
        f"  {work.name:10s} cat {cat_cold:.1f}/{cat_hot:.1f} s, cp -r+sync {cp_sync:.1f} s, convert 1 worker "
        f"{one[0]:.1f}/{one[1]:.1f} s, {workers} workers {every[0]:.1f}/{every[1]:.1f} s (cold/hot)",
        flush=True,
    )
    return dataset, row


def scale_section(root: Path) -> dict[str, Any]:
    """Open cost at 10M samples, converter memory for 1M files and for a 2 GiB member."""
    out: dict[str, Any] = {}
    out.update(measure_in_child(["open-10m", str(root / "scale")]))
    out.update(measure_in_child(["convert-1m", str(root / "scale")]))
    out.update(measure_in_child(["convert-2gib", str(root / "scale")]))
    return out


def measure_in_child(args: list[str]) -> dict[str, Any]:
    result = subprocess.run([sys.executable, __file__, "--child", *args], capture_output=True, text=True)
    if result.returncode != 0:
        raise RuntimeError(result.stderr)
    return json.loads(result.stdout.strip().splitlines()[-1])


# --- children for the scale section (fresh processes, so RSS is theirs alone) --------------


def synthesize_ragged(dataset: Path, count: int) -> None:
    """A ragged dataset of ``count`` zero-filled samples (lengths 1..16), written by npz2mmap's own writer.

    Making 10 million NPZ files would take hours; the format is the same.
    """
    from npz2mmap.format.index import MIN_ALIGN
    from npz2mmap.write import blob_writer, publish
    from npz2mmap.write.plan import lay_out

    lengths = np.random.default_rng(2).integers(1, 17, size=count).reshape(-1, 1)
    plan = lay_out(
        [f"synthetic/{i}" for i in range(count)], [("tokens", np.dtype("<i4"), lengths, False)], MIN_ALIGN
    )
    crc_of_length = {n: zlib.crc32(bytes(4 * n)) for n in range(1, 17)}
    crcs = np.vectorize(crc_of_length.get, otypes=[np.uint32])(lengths[:, 0])
    with publish.output_lock(str(dataset)):
        staging = publish.make_staging_dir(str(dataset))
        try:
            blob_writer.create_blob(staging, plan.payload_nbytes)
            blob_writer.finish_dataset(staging, plan, [crcs])
            publish.publish(staging, str(dataset), overwrite=True)
        finally:
            publish.remove_staging(staging)


def child_open_10m(root: Path) -> dict[str, Any]:
    dataset = root / "ragged-10m"
    if not (dataset / "index.json").exists():
        synthesize_ragged(dataset, 10_000_000)
    rss_before = current_rss()
    started = time.perf_counter()
    ds = MmapDataset(dataset)
    ds[len(ds) - 1]
    seconds = time.perf_counter() - started
    return {
        "open_10m_samples_ms": seconds * 1000,
        "open_10m_rss_added_mb": (current_rss() - rss_before) / 1e6,
        "open_10m_pickled_bytes": len(pickle.dumps(ds)),
    }


def child_convert_1m(root: Path) -> dict[str, Any]:
    src = root / "small-1m"
    if not (root / "small-1m.done").exists():
        shutil.rmtree(src, ignore_errors=True)
        rng = np.random.default_rng(1)
        for i in range(1_000_000):
            directory = src / f"{i // 10_000:03d}"
            if i % 10_000 == 0:
                directory.mkdir(parents=True)
            np.savez(directory / f"{i:07d}.npz", x=rng.random(4, dtype=np.float32), y=np.int64(i))
        (root / "small-1m.done").touch()
    cp_sync = cp_and_sync(src, root / "small-1m-cp")
    cold(src)
    seconds, peak = convert_with_cli(src, root / "small-1m-dataset")
    return {
        "convert_1m_files_s": seconds,
        "convert_1m_cp_r_sync_s": cp_sync,
        "convert_1m_vs_cp_r": seconds / cp_sync,
        "convert_1m_largest_process_peak_rss_mb": peak / 1e6,
    }


def child_convert_2gib(root: Path) -> dict[str, Any]:
    src = root / "big-member.npz"
    if not src.exists():
        array = np.lib.format.open_memmap(root / "big.npy", mode="w+", dtype=np.float32, shape=(2**29,))
        array[:: 2**20] = 1.0
        del array
        import zipfile

        with zipfile.ZipFile(src, "w", zipfile.ZIP_STORED, allowZip64=True) as zf:
            zf.write(root / "big.npy", "x.npy")
        os.unlink(root / "big.npy")
    seconds, peak = convert_with_cli(src, root / "big-member-dataset")
    return {"convert_2gib_member_s": seconds, "convert_2gib_member_largest_process_peak_rss_mb": peak / 1e6}


PEAK_RSS_OF_COMMAND = (
    "import resource, subprocess, sys; subprocess.run(sys.argv[1:], check=True); "
    "print(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024)"
)


def convert_with_cli(src: Path, out: Path) -> tuple[float, int]:
    """Run `npz2mmap convert` under a small parent that reports the largest peak RSS of its processes.

    A child forked straight from this torch-importing process would count our memory as its own.
    """
    cli = str(Path(sys.executable).parent / "npz2mmap")
    command = [cli, "convert", str(src), "-o", str(out), "--overwrite", "-q"]
    started = time.perf_counter()
    result = subprocess.run(
        [sys.executable, "-c", PEAK_RSS_OF_COMMAND, *command], check=True, capture_output=True, text=True
    )
    return time.perf_counter() - started, int(result.stdout.strip())


def current_rss() -> int:
    with open("/proc/self/statm") as fp:
        return int(fp.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


# --- output ---------------------------------------------------------------------------------


@dataclass
class Report:
    machine: dict[str, Any]
    cold_cache: str
    conversion_cache: str = ""
    conversions: list[Conversion] = field(default_factory=list)
    throughput: list[Measured] = field(default_factory=list)
    memory: list[Measured] = field(default_factory=list)
    advice: list[Measured] = field(default_factory=list)
    loaders: list[Measured] = field(default_factory=list)
    ranks: list[Measured] = field(default_factory=list)
    scale: dict[str, Any] = field(default_factory=dict)


def machine_facts() -> dict[str, Any]:
    with open("/proc/meminfo") as fp:
        mem_kb = int(fp.readline().split()[1])
    return {
        "cpus": os.cpu_count(),
        "memory_gib": round(mem_kb / 2**20, 1),
        "python": platform.python_version(),
        "numpy": np.__version__,
        "torch": torch.__version__,
        "platform": platform.platform(),
    }


def ratio(value: float, reference: float) -> str:
    return f"{value / reference:.2f}×" if reference else "-"


def markdown(report: Report) -> str:
    m = report.machine
    lines = [
        f"Machine: {m['cpus']} cores, {m['memory_gib']} GiB, Python {m['python']}, numpy {m['numpy']}, "
        f"torch {m['torch']}. Batch size {BATCH}, shuffled. Cold epoch: {report.cold_cache}.",
        "",
        "| workload | loader | workers | cold epoch (samples/s) | warm epoch, best of 2 (samples/s) "
        "| vs in-RAM | vs np.load | first batch (s) | peak PSS sum (MB) | of which mapped files (MB) |",
        "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for work in dict.fromkeys(r.workload for r in report.throughput):
        rows = [r for r in report.throughput if r.workload == work]
        bound = next((r.warm_per_s for r in rows if "bound" in r.loader), 0.0)
        naive = next((r.warm_per_s for r in rows if r.loader == "np.load per item"), 0.0)
        for r in rows:
            lines.append(
                f"| {work} | {r.loader} | {r.workers} | {r.cold_per_s:,.0f} | {r.warm_per_s:,.0f} | "
                f"{ratio(r.warm_per_s, bound)} | {ratio(r.warm_per_s, naive)} | {r.first_batch_s:.2f} | "
                f"{r.peak_pss_bytes / 1e6:,.0f} | {r.peak_pss_file_bytes / 1e6:,.0f} |"
            )
    if report.memory:
        lines += [
            "",
            "Peak PSS summed over the main process and all workers over two epochs, in MB "
            "(in brackets: of which mapped files, i.e. page cache shared by all processes):",
            "",
        ]
        counts = sorted({r.workers for r in report.memory})
        lines.append("| loader | " + " | ".join(f"{c} worker(s)" for c in counts) + " |")
        lines.append("| --- |" + " ---: |" * len(counts))
        for name in dict.fromkeys(r.loader for r in report.memory):
            cells = [
                f"{r.peak_pss_bytes / 1e6:,.0f} ({r.peak_pss_file_bytes / 1e6:,.0f})"
                for c in counts
                for r in report.memory
                if r.loader == name and r.workers == c
            ]
            lines.append(f"| {name} | " + " | ".join(cells) + " |")
    if report.ranks:
        lines += [
            "",
            "DDP (torchrun, gloo, 2 DataLoader workers per rank), fixed workload; PSS summed over "
            "torchrun, all ranks and all workers:",
            "",
            "| ranks | epoch 1 (samples/s) | epoch 2 (samples/s) | peak PSS sum (MB) "
            "| of which mapped files (MB) |",
            "| ---: | ---: | ---: | ---: | ---: |",
        ]
        lines += [
            f"| {r.workers // 2} | {r.cold_per_s:,.0f} | {r.warm_per_s:,.0f} | "
            f"{r.peak_pss_bytes / 1e6:,.0f} | {r.peak_pss_file_bytes / 1e6:,.0f} |"
            for r in report.ranks
        ]
    if report.advice:
        lines += ["", "Access hints and sample order, MmapLoader on the fixed workload:", ""]
        lines += [
            "| order and hint | cold epoch (samples/s) | warm epoch (samples/s) |",
            "| --- | ---: | ---: |",
        ]
        lines += [f"| {r.loader} | {r.cold_per_s:,.0f} | {r.warm_per_s:,.0f} |" for r in report.advice]
    lines += loader_lines(report)
    lines += conversion_lines(report)
    if report.scale:
        lines += ["", "Scale:", ""] + [
            f"- {key}: {value:,.1f}" if isinstance(value, float) else f"- {key}: {value:,}"
            for key, value in report.scale.items()
        ]
    return "\n".join(lines) + "\n"


def loader_lines(report: Report) -> list[str]:
    """The loaders section: warm epochs, each against the in-RAM bound of its workload and against
    MmapLoader in one process with the same transform."""
    if not report.loaders:
        return []
    lines = [
        "",
        f"Loaders with worker processes, warm page cache, batch {BATCH}, best of {LOADER_WARM_EPOCHS} "
        "epochs (PSS sampled over one more epoch: sampling takes the workers' CPU):",
        "",
        "| workload | loader | workers | samples/s | vs in-RAM bound "
        "| vs MmapLoader, no workers, same transform | peak PSS sum (MB) | of which mapped files (MB) |",
        "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    rows = report.loaders
    for r in rows:
        bound = next((b.warm_per_s for b in rows if b.workload == r.workload and "bound" in b.loader), 0.0)
        kind = r.loader.split(":")[0] if ":" in r.loader else ""
        alone = next(
            (
                b.warm_per_s
                for b in rows
                if b.workload == r.workload
                and b.workers == 0
                and "MmapLoader" in b.loader
                and (b.loader.split(":")[0] if ":" in b.loader else "") == kind
            ),
            0.0,
        )
        lines.append(
            f"| {r.workload} | {r.loader} | {r.workers} | {r.warm_per_s:,.0f} | {ratio(r.warm_per_s, bound)} "
            f"| {ratio(r.warm_per_s, alone)} | {r.peak_pss_bytes / 1e6:,.0f} "
            f"| {r.peak_pss_file_bytes / 1e6:,.0f} |"
        )
    return lines


def conversion_lines(report: Report) -> list[str]:
    lines: list[str] = []
    if report.conversions:
        lines += ["", f"Conversion against copying the same files, {report.conversion_cache}:", ""]
        lines += [
            "| workload | files | NPZ (MB) | dataset (MB) | `cat` cold / hot (s) | `cp -r` + sync, cold (s) "
            "| convert 1 worker, cold / hot (s) | convert N workers, cold / hot (s) | N | N workers cold "
            "vs `cp -r` | hot vs hot `cat` | files/s (N, cold) | inflate alone, 1 process (s) |",
            "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
        ]
        lines += [
            f"| {c.workload} | {c.files:,} | {c.source_bytes / 1e6:,.0f} | {c.dataset_bytes / 1e6:,.0f} | "
            f"{c.cat_cold_s:.2f} / {c.cat_hot_s:.2f} | {c.cp_sync_s:.2f} | "
            f"{c.convert_1_cold_s:.2f} / {c.convert_1_hot_s:.2f} | "
            f"{c.convert_cold_s:.2f} / {c.convert_hot_s:.2f} | "
            f"{c.workers} | {ratio(c.convert_cold_s, c.cp_sync_s)} | {ratio(c.convert_hot_s, c.cat_hot_s)} | "
            f"{c.files / c.convert_cold_s:,.0f} | {f'{c.inflate_s:.2f}' if c.inflate_s else '-'} |"
            for c in report.conversions
        ]
    return lines


def chart(report: Report, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [r for r in report.throughput if r.workload == "fixed"] or report.throughput
    names = [r.loader for r in rows]
    fig, (left, right) = plt.subplots(1, 2, figsize=(13, 0.45 * len(rows) + 1.6))
    left.barh(names, [r.warm_per_s for r in rows], color="tab:blue", label="warm")
    left.barh(names, [r.cold_per_s for r in rows], color="tab:orange", alpha=0.7, label="cold")
    left.set_xscale("log")
    left.set_xlabel("samples/s (log scale)")
    left.legend(loc="upper right")
    left.invert_yaxis()
    private = [(r.peak_pss_bytes - r.peak_pss_file_bytes) / 1e6 for r in rows]
    right.barh(names, private, color="tab:green", label="private (anonymous)")
    right.barh(
        names,
        [r.peak_pss_file_bytes / 1e6 for r in rows],
        left=private,
        color="tab:green",
        alpha=0.35,
        label="mapped files (shared page cache)",
    )
    right.set_xlabel("peak PSS summed over processes (MB)")
    right.legend(loc="lower right")
    right.set_yticks([])
    right.invert_yaxis()
    fig.suptitle(
        f"{rows[0].workload if rows else ''} workload, batch {BATCH}, {report.machine['cpus']} cores"
    )
    fig.tight_layout()
    fig.savefig(path, dpi=110)


# --- main ------------------------------------------------------------------------------------


def outofcore_main(args: argparse.Namespace, workdir: Path, work: Workload) -> None:
    """--only outofcore: the fixed workload converted once, then scripts/outofcore.py's section."""
    import outofcore

    src = make_workload(work, workdir)
    dataset = converted(src, workdir / work.name / "dataset")
    rows, info = outofcore.outofcore_section(
        dataset,
        src,
        workdir / work.name,
        read_aheads=args.read_ahead_kb,
        limit_mb=args.limit_mb,
        only=args.loader,
        max_samples=600 if args.quick else outofcore.MAX_SAMPLES,
        max_seconds=3.0 if args.quick else outofcore.MAX_SECONDS,
    )
    text = outofcore.write(rows, info, args.out)
    print(text)
    if args.workdir is None:
        shutil.rmtree(workdir, ignore_errors=True)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--quick", action="store_true", help="small workloads: a smoke run of every path")
    parser.add_argument("--scale", action="store_true", help="also run the scale section (slow, ~10 GB disk)")
    parser.add_argument("--out", type=Path, default=ROOT / "bench-results")
    parser.add_argument(
        "--workdir", type=Path, default=None, help="where workloads live (default: a temp dir)"
    )
    parser.add_argument(
        "--only", choices=["conversion", "loaders", "outofcore"], help="run only this section"
    )
    parser.add_argument(
        "--limit-mb", type=int, help="outofcore: the cgroup's limit (default: own use + 40%% of the data)"
    )
    parser.add_argument(
        "--read-ahead-kb",
        type=int,
        action="append",
        help="outofcore: read_ahead_kb settings to run (repeatable; default: the device's own and 128)",
    )
    parser.add_argument(
        "--loader", action="append", help="outofcore: only loaders whose name contains this (repeatable)"
    )
    parser.add_argument(
        "--workload", action="append", choices=WORKLOAD_NAMES, help="only these workloads (repeatable)"
    )
    parser.add_argument("--files", type=int, help="files per chosen workload (default: by --quick)")
    parser.add_argument("--child", nargs=2, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        task, root = args.child
        children = {
            "open-10m": child_open_10m,
            "convert-1m": child_convert_1m,
            "convert-2gib": child_convert_2gib,
            "ddp": child_ddp,
        }
        Path(root).mkdir(parents=True, exist_ok=True)
        result = children[task](Path(root))
        if os.environ.get("RANK", "0") == "0":  # one line from torchrun's ranks, not several at once
            print(json.dumps(result))
        return
    sys.path.insert(0, str(Path(__file__).parent))
    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="npz2mmap-bench-"))
    count = 600 if args.quick else 20_000
    workloads = [
        Workload("fixed", args.files or count),
        Workload("ragged", args.files or count // 2, ragged=True),
        Workload("compressed", args.files or count // 4, compressed=True),
    ]
    workloads = [w for w in workloads if w.name in (args.workload or WORKLOAD_NAMES)]
    if args.only == "outofcore":
        outofcore_main(
            args, workdir, workloads[0] if args.workload else Workload("fixed", args.files or count)
        )
        return
    cores = os.cpu_count() or 1
    report = Report(machine_facts(), "pages of the files read evicted with posix_fadvise(DONTNEED) before it")
    if can_drop_all_caches():
        report.conversion_cache = (
            "dirty pages written back and the whole page cache dropped before each cold step"
        )
    elif hasattr(os, "posix_fadvise"):
        report.conversion_cache = (
            "dirty pages written back and every source and output file's pages evicted with "
            "posix_fadvise(DONTNEED) before each cold step (not root: the rest of the page cache stays)"
        )
    else:
        report.conversion_cache = "page cache NOT dropped (no posix_fadvise here): cold figures are hot"
    args.out.mkdir(parents=True, exist_ok=True)
    datasets = {}
    print(f"workloads in {workdir}", flush=True)
    for work in workloads:
        src = make_workload(work, workdir)
        if args.only == "loaders":
            datasets[work.name] = converted(src, workdir / work.name / "dataset")
            continue
        datasets[work.name], row = convert_section(work, src, workdir, cores)
        report.conversions.append(row)
    if args.only == "loaders":
        report.loaders = loaders_section(datasets["fixed"], datasets.get("ragged"), args.quick)
        text = "\n".join(loader_lines(report)) + "\n"
        print(text)
        (args.out / "loaders.md").write_text(text)
        (args.out / "loaders.json").write_text(json.dumps([asdict(r) for r in report.loaders], indent=1))
        return
    if args.only == "conversion":
        text = "\n".join(conversion_lines(report)) + "\n"
        print(text)
        (args.out / "conversion.md").write_text(text)
        rows = [asdict(c) for c in report.conversions]
        (args.out / "conversion.json").write_text(json.dumps(rows, indent=1))
        if args.workdir is None:
            shutil.rmtree(workdir, ignore_errors=True)
        return
    for work in workloads:
        report.throughput += throughput_section(
            work, workdir / work.name / "npz", datasets[work.name], workdir, args.quick
        )
    report.loaders = loaders_section(datasets["fixed"], datasets.get("ragged"), args.quick)
    report.memory = memory_section(
        workloads[0], workdir / "fixed" / "npz", datasets["fixed"], [1, 2] if args.quick else [1, 2, 4]
    )
    report.ranks = ranks_section(datasets["fixed"], [1, 2] if args.quick else [1, 2, 4])
    report.advice = advice_section(datasets["fixed"], args.quick)
    if args.scale:
        report.scale = scale_section(workdir)
    text = markdown(report)
    print("\n" + text)
    (args.out / "results.md").write_text(text)
    (args.out / "results.json").write_text(json.dumps(asdict(report), indent=1))
    chart(report, args.out / "results.png")
    print(f"wrote {args.out / 'results.md'}, results.json and results.png")
    if args.workdir is None:
        shutil.rmtree(workdir, ignore_errors=True)


if __name__ == "__main__":
    main()
