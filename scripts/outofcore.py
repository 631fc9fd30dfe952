"""The out-of-core section of bench.py: loaders on a dataset that does not fit in the memory they may use.

Each loader runs in a child process moved into a memory cgroup before it starts
(its workers inherit it), after the whole page cache was dropped. Once the child
has set up its loader (two warm-up batches), the cgroup's limit is set to what
the child uses then plus a fraction (default 40 %) of the dataset: the page cache
can hold about that much of the data. Then the child reads a bounded number of
batches and reports samples/s and its process tree's CPU time; the parent counts
the bytes read from the device holding the data meanwhile.

Bytes read are the sum of /proc/PID/io read_bytes over the child's process
tree (what its reads, faults, readahead and hints submitted to storage): it is
the loader's own, while the device's counter (/sys/block/<dev>/stat sectors
read x512, kept as a cross-check, as is /proc/vmstat pgpgin, which agrees with
it) also counts whatever else the machine reads meanwhile. The blkio cgroup
counters stay at 0 for buffered reads on this kernel, and v1 memory.stat has
no read counter.

Root only (cgroups, drop_caches, read_ahead_kb); otherwise the section is skipped.
"""

from __future__ import annotations

import gc
import itertools
import json
import os
import resource
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np
from proctree import process_tree

BATCH = 64
SAMPLE_BYTES = 3 * 64 * 64 * 4  # the image; the 8-byte label lives in another column
DELIVERED_BYTES = SAMPLE_BYTES + 8
CACHE_FRACTION = 0.4
MAX_SAMPLES = 6400  # per loader; or MAX_SECONDS, whichever comes first
MAX_SECONDS = 15.0
FLOOR_SAMPLES = 12_000
DROP_CACHES = "/proc/sys/vm/drop_caches"
INTERLEAVED_BLOCK, INTERLEAVED_BLOCKS = 256, 8  # windows of 2,048 samples, 100 MB of this data
INTERLEAVED_MMAP = "MmapLoader(sampler=BlockShuffleSampler(n, 256, interleave=8, dataset=ds)), 2 workers"
INTERLEAVED_DATA = "DataLoader(MmapDataset, sampler=BlockShuffleSampler(..., dataset=ds)), 2 workers"
DATALOADER_CEILING = "ceiling: DataLoader, 2 workers, the same batches made with no reads"


# --- cgroups -----------------------------------------------------------------------


def cgroup_root() -> tuple[str, Path] | None:
    """('v2', mount) if a v2 hierarchy has the memory controller, else ('v1', memory mount), else None."""
    for mount in (Path("/sys/fs/cgroup"), Path("/sys/fs/cgroup/unified")):
        try:
            if "memory" in (mount / "cgroup.controllers").read_text().split():
                return "v2", mount
        except OSError:
            continue
    v1 = Path("/sys/fs/cgroup/memory")
    if (v1 / "memory.limit_in_bytes").exists():
        return "v1", v1
    return None


def own_cgroup(version: str) -> str:
    """This process's cgroup path in that hierarchy ('/a/b'), from /proc/self/cgroup."""
    for line in Path("/proc/self/cgroup").read_text().splitlines():
        hid, controllers, path = line.split(":", 2)
        if (version == "v2" and hid == "0") or (version == "v1" and "memory" in controllers.split(",")):
            return path
    return "/"


class MemoryCgroup:
    """A memory cgroup nested in this process's own; removed by remove() (its processes moved out first)."""

    def __init__(self, name: str) -> None:
        found = cgroup_root()
        if found is None:
            raise RuntimeError("no memory cgroup controller")
        self.version, mount = found
        self.parent = mount / own_cgroup(self.version).lstrip("/")
        self.path = self.parent / name
        if self.version == "v2":
            # a child's memory controller needs it enabled in the parent's subtree_control
            control = self.parent / "cgroup.subtree_control"
            if "memory" not in control.read_text().split():
                control.write_text("+memory")
        self.path.mkdir(exist_ok=True)
        self.limit = 0

    def procs_file(self) -> str:
        return str(self.path / "cgroup.procs")

    def join(self) -> None:
        """Move the calling process in (a preexec_fn: the child enters before it execs)."""
        with open(self.procs_file(), "w") as fp:
            fp.write(str(os.getpid()))

    def set_limit(self, nbytes: int) -> None:
        self.limit = nbytes
        name = "memory.max" if self.version == "v2" else "memory.limit_in_bytes"
        (self.path / name).write_text(str(nbytes))

    def unlimit(self) -> None:
        name = "memory.max" if self.version == "v2" else "memory.limit_in_bytes"
        (self.path / name).write_text("max" if self.version == "v2" else "-1")
        self.limit = 0

    def usage(self) -> int:
        name = "memory.current" if self.version == "v2" else "memory.usage_in_bytes"
        return int((self.path / name).read_text())

    def stat(self) -> dict[str, int]:
        out = {}
        for line in (self.path / "memory.stat").read_text().splitlines():
            key, _, value = line.partition(" ")
            out[key] = int(value)
        return out

    def page_cache(self) -> int:
        stat = self.stat()
        return stat.get("file", stat.get("cache", 0))

    def pids(self) -> list[int]:
        try:
            return [int(p) for p in (self.path / "cgroup.procs").read_text().split()]
        except OSError:
            return []

    def end_processes(self, timeout: float = 20.0) -> None:
        """SIGKILL every process in this cgroup (all started by us, its only users), until none is left."""
        deadline = time.monotonic() + timeout
        while (pids := self.pids()) and time.monotonic() < deadline:
            for pid in pids:
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            time.sleep(0.05)
        if self.pids():
            print(f"  processes left in {self.path}: {self.pids()}", file=sys.stderr)

    def remove(self) -> None:
        """End any process left, then rmdir (retried: the kernel frees it lazily)."""
        self.end_processes()
        for _ in range(50):
            try:
                self.path.rmdir()
                return
            except FileNotFoundError:
                return
            except OSError:
                time.sleep(0.1)
        print(f"  could not remove cgroup {self.path}", file=sys.stderr)


# --- the device: read-ahead and bytes read -----------------------------------------------


def block_device(path: Path) -> str:
    """The name under /sys/block of the disk holding ``path`` (a partition's parent disk)."""
    dev = os.stat(path).st_dev
    sysdev = Path(f"/sys/dev/block/{os.major(dev)}:{os.minor(dev)}").resolve()
    if (sysdev / "partition").exists():
        sysdev = sysdev.parent
    return sysdev.name


def pgpgin_bytes() -> int:
    """/proc/vmstat pgpgin (KiB read from every block device since boot), in bytes: a cross-check."""
    for line in Path("/proc/vmstat").read_text().splitlines():
        key, _, value = line.partition(" ")
        if key == "pgpgin":
            return int(value) * 1024
    return 0


def device_read_bytes(device: str) -> int:
    """Bytes read from the device since boot: /sys/block/<dev>/stat's sectors read (always 512 bytes)."""
    fields = Path(f"/sys/block/{device}/stat").read_text().split()
    return int(fields[2]) * 512


def read_ahead_file(device: str) -> Path:
    return Path(f"/sys/block/{device}/queue/read_ahead_kb")


@contextmanager
def read_ahead(device: str, kb: int) -> Iterator[None]:
    """The device's read_ahead_kb set to ``kb``, and always put back."""
    path = read_ahead_file(device)
    old = path.read_text().strip()
    try:
        path.write_text(str(kb))
        yield
    finally:
        path.write_text(old)


def resident_bytes(paths: list[Path]) -> int:
    """Bytes of these files in the page cache (util-linux fincore; 0 without it)."""
    if not paths or shutil.which("fincore") is None:
        return 0
    total = 0
    for start in range(0, len(paths), 2000):
        result = subprocess.run(
            ["fincore", "--bytes", "--noheadings", "--output", "RES", *map(str, paths[start : start + 2000])],
            capture_output=True,
            text=True,
        )
        total += sum(int(v) for v in result.stdout.split() if v.isdigit())
    return total


def drop_caches() -> None:
    os.sync()
    with open(DROP_CACHES, "w") as fp:
        fp.write("3\n")


def can_run() -> str:
    """'' when the section can run here, else why not."""
    if sys.platform != "linux":
        return "Linux only"
    if os.geteuid() != 0:
        return "needs root (a memory cgroup, drop_caches, read_ahead_kb)"
    if cgroup_root() is None:
        return "no memory cgroup controller (v2 or v1)"
    return ""


# --- measurements, on both sides of the child boundary -----------------------------------


@dataclass
class OutOfCore:
    loader: str
    read_ahead_kb: int
    samples: int = 0
    seconds: float = 0.0
    per_s: float = 0.0
    read_bytes: int = 0  # the child's process tree (/proc/PID/io)
    device_read_bytes: int = 0  # the whole device meanwhile (/sys/block/DEV/stat)
    delivered_bytes: int = 0
    amplification: float = 0.0
    device_amplification: float = 0.0
    cpu_s: float = 0.0
    own_bytes: int = 0
    limit_bytes: int = 0
    end_cache_bytes: int = 0
    pgpgin_bytes: int = 0
    note: str = ""


def tree_read_bytes(root: int) -> int:
    """Bytes a process and its live descendants caused to be read from storage (/proc/PID/io
    read_bytes, counted when each read or readahead is submitted, for all of a process's threads)."""
    total = 0
    for pid in process_tree(root):
        try:
            with open(f"/proc/{pid}/io") as fp:
                for line in fp:
                    if line.startswith("read_bytes:"):
                        total += int(line.split()[1])
        except OSError:
            continue
    return total


def tree_cpu_seconds(root: int) -> float:
    """utime + stime of a process and all its live descendants."""
    tick = os.sysconf("SC_CLK_TCK")
    total = 0
    for pid in process_tree(root):
        try:
            with open(f"/proc/{pid}/stat") as fp:
                fields = fp.read().rsplit(")", 1)[1].split()
            total += int(fields[11]) + int(fields[12])
        except (OSError, IndexError):
            continue
    return total / tick


def run_in_cgroup(
    child_args: list[str],
    cgroup: MemoryCgroup,
    device: str,
    limit_of: Callable[[int], int],
    data_files: list[Path],
    script: str = __file__,
    preset_limit: int | None = None,
) -> dict[str, Any]:
    """Start ``child_args`` (``script``'s --child, by default this file's) in the cgroup, wait for its
    "ready", set the limit, let it run, and return its JSON result with the device's bytes read.

    With ``preset_limit`` the limit is set before the child starts, as a job's is, so that what
    the loader sees of it at start (npz2mmap's fit check) is what a user's would."""
    cgroup.unlimit()
    drop_caches()
    if preset_limit is not None:
        cgroup.set_limit(preset_limit)
    proc = subprocess.Popen(
        [sys.executable, script, "--child", *child_args],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        preexec_fn=cgroup.join,
    )
    assert proc.stdin is not None and proc.stdout is not None
    try:
        line = proc.stdout.readline()
        if line.strip() != "ready":
            proc.wait()
            raise RuntimeError(f"child {child_args[0]} failed before it was ready ({line.strip()!r})")
        # its own use: what the cgroup holds less the data's pages the warm-up brought in
        own = cgroup.usage() - resident_bytes(data_files)
        limit = limit_of(own) if preset_limit is None else preset_limit
        cgroup.set_limit(limit)
        before, before_pgpgin = device_read_bytes(device), pgpgin_bytes()
        proc.stdin.write("go\n")
        proc.stdin.flush()
        end_cache = 0
        result_line = ""
        while True:  # the child prints its result and then waits for "exit": count reads before teardown
            line = proc.stdout.readline()
            if not line:
                break
            if line.startswith("{"):
                result_line = line
                break
        read, pgpgin = device_read_bytes(device) - before, pgpgin_bytes() - before_pgpgin
        try:
            end_cache = cgroup.page_cache()
        except OSError:
            pass
        proc.stdin.write("exit\n")
        proc.stdin.flush()
        proc.wait(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        # workers outlive a child that exits at once, still mapping the data: their pages would
        # survive the next drop_caches, so every process left in the cgroup is ended first
        cgroup.end_processes()
    if not result_line:
        raise RuntimeError(f"child {child_args[0]} exited {proc.returncode} without a result")
    result = json.loads(result_line)
    result.update(
        read_bytes=read, pgpgin_bytes=pgpgin, own_bytes=own, limit_bytes=limit, end_cache_bytes=end_cache
    )
    return result


# --- the loaders, inside the child ---------------------------------------------------------


def _fields() -> list[str]:
    return ["input", "label"]


def _count(batch: Any) -> int:
    if isinstance(batch, dict):
        return len(next(iter(batch.values())))
    if isinstance(batch, (list, tuple)):
        return len(batch[0])
    return len(batch)


def _mmap_loader(
    dataset: Path, advice: str | None = None, reads: str = "auto", **options: Any
) -> Iterator[Any]:
    from npz2mmap import MmapDataset, MmapLoader

    ds = MmapDataset(dataset, fields=_fields(), advice=advice, reads=reads)
    loader = MmapLoader(ds, BATCH, **options)
    try:
        yield from loader
    finally:
        loader.close()


def _data_loader(dataset: Path, advice: str | None = None, reads: str = "auto") -> Iterator[Any]:
    from torch.utils.data import DataLoader

    from npz2mmap import MmapDataset

    loader = DataLoader(
        MmapDataset(dataset, fields=_fields(), advice=advice, reads=reads),
        batch_size=BATCH,
        shuffle=True,
        num_workers=2,
        persistent_workers=True,
    )
    yield from loader


def _data_loader_ceiling(dataset: Path) -> Iterator[Any]:
    """DataLoader's own cost under the same limit: batches of the dataset's size and fields made
    in shared memory in each worker, as MmapDataset makes them, with no reads at all."""
    from torch.utils.data import DataLoader, Dataset, get_worker_info

    from npz2mmap import MmapDataset
    from npz2mmap.pytorch.assemble import NewMemory

    num_samples = len(MmapDataset(dataset, fields=_fields()))

    class NoReads(Dataset[Any]):
        def __len__(self) -> int:
            return num_samples

        def __getitems__(self, indices: list[int]) -> dict[str, Any]:
            destination = NewMemory(shared=get_worker_info() is not None)
            _, image = destination.array(np.dtype(np.float32), (len(indices), 3, 64, 64))
            _, label = destination.array(np.dtype(np.int64), (len(indices),))
            image.zero_(), label.zero_()
            return {"input": image, "label": label}

    loader = DataLoader(
        NoReads(), BATCH, shuffle=True, num_workers=2, persistent_workers=True, collate_fn=_as_made
    )
    yield from loader


def _as_made(batch: Any) -> Any:
    return batch


def _block_loader(dataset: Path) -> Iterator[Any]:
    from npz2mmap import BlockShuffleSampler, MmapDataset, MmapLoader

    ds = MmapDataset(dataset, fields=_fields())
    loader = MmapLoader(ds, BATCH, sampler=BlockShuffleSampler(len(ds)))
    yield from loader


def interleaved_sampler(ds: Any) -> Any:
    """The larger-than-memory shuffle as the README sizes it: two windows well inside the cache."""
    from npz2mmap import BlockShuffleSampler

    return BlockShuffleSampler(len(ds), INTERLEAVED_BLOCK, interleave=INTERLEAVED_BLOCKS, dataset=ds)


def _interleaved_loader(dataset: Path, data_loader: bool) -> Iterator[Any]:
    from torch.utils.data import DataLoader

    from npz2mmap import MmapDataset, MmapLoader

    ds = MmapDataset(dataset, fields=_fields())
    if data_loader:
        sampler = interleaved_sampler(ds)
        yield from DataLoader(ds, BATCH, sampler=sampler, num_workers=2, persistent_workers=True)
        return
    loader = MmapLoader(ds, BATCH, sampler=interleaved_sampler(ds), num_workers=2)
    try:
        yield from loader
    finally:
        loader.close()


def _shuffle_sampler_loader(dataset: Path) -> Iterator[Any]:
    from torch.utils.data import DataLoader

    from npz2mmap import MmapDataset, ShuffleSampler

    ds = MmapDataset(dataset, fields=_fields())
    yield from DataLoader(ds, BATCH, sampler=ShuffleSampler(ds), num_workers=2, persistent_workers=True)


def _npz_loader(npz: Path) -> Iterator[Any]:
    from bench import NaiveDataset, npz_paths, worker_loader

    yield from worker_loader(NaiveDataset(npz_paths(npz)), 2)


def _litdata_loader(root: Path) -> Iterator[Any]:
    import litdata

    ds = litdata.StreamingDataset(str(root), shuffle=True)
    yield from litdata.StreamingDataLoader(ds, batch_size=BATCH, num_workers=2)


def stub_torchvision() -> None:
    """Mosaic's package imports torchvision for its vision datasets, unused here; the PyPI wheel
    of torchvision does not load against a CPU-only torch, so stand-ins take its place."""
    import importlib.machinery
    import types

    for name in (
        "torchvision",
        "torchvision.datasets",
        "torchvision.transforms",
        "torchvision.transforms.functional",
    ):
        module = sys.modules.setdefault(name, types.ModuleType(name))
        module.__spec__ = importlib.machinery.ModuleSpec(name, None)  # transformers looks for it
    sys.modules["torchvision.datasets"].VisionDataset = object  # type: ignore[attr-defined]
    sys.modules["torchvision.datasets"].CIFAR10 = object  # type: ignore[attr-defined]
    sys.modules["torchvision.transforms.functional"].to_tensor = None  # type: ignore[attr-defined]


def _mosaic_loader(root: Path) -> Iterator[Any]:
    try:
        import streaming
    except (ImportError, RuntimeError):
        stub_torchvision()
        import streaming
    from streaming.base.util import clean_stale_shared_memory
    from torch.utils.data import DataLoader

    clean_stale_shared_memory()
    ds = streaming.StreamingDataset(local=str(root), shuffle=True, batch_size=BATCH)
    yield from DataLoader(ds, batch_size=BATCH, num_workers=2)


def _blob(dataset: Path) -> tuple[Path, int, int]:
    """The blob, the byte offset of the image field and the sample count."""
    index = json.loads((dataset / "index.json").read_text())
    field = next(f for f in index["fields"] if f["name"] == "input")
    return (
        dataset / "data.npy",
        int(field["data"]["offset"]),
        int(index.get("num_samples", 0)) or (int(field["data"]["nbytes"]) // SAMPLE_BYTES),
    )


def _sequential(dataset: Path) -> Iterator[int]:
    """dd bs=8M: 8 MiB reads from the start of the blob; yields samples' worth of bytes."""
    blob, _, _ = _blob(dataset)
    fd = os.open(blob, os.O_RDONLY)
    buf = bytearray(8 << 20)
    try:
        while True:
            n = os.readv(fd, [buf])
            if n <= 0:
                return
            yield n // SAMPLE_BYTES
    finally:
        os.close(fd)


def _random_preads(dataset: Path, in_flight: int) -> Iterator[int]:
    """Sample-sized preads of a random permutation, ``in_flight`` always queued (a thread pool), with
    the kernel's read-ahead off for the descriptor (POSIX_FADV_RANDOM): the disk's own random speed."""
    from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait

    blob, offset, count = _blob(dataset)
    order = np.random.default_rng(0).permutation(count)
    fd = os.open(blob, os.O_RDONLY)
    if hasattr(os, "posix_fadvise"):
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_RANDOM)
    free = [bytearray(SAMPLE_BYTES) for _ in range(in_flight)]

    def read(buffer: bytearray, i: int) -> bytearray:
        os.preadv(fd, [buffer], offset + int(i) * SAMPLE_BYTES)
        return buffer

    try:
        if in_flight == 1:
            for i in order:
                read(free[0], i)
                yield 1
            return
        with ThreadPoolExecutor(in_flight) as pool:
            pending: set[Future[bytearray]] = set()
            done_count = 0
            for i in order:
                if not free:
                    finished, pending = wait(pending, return_when=FIRST_COMPLETED)
                    free.extend(f.result() for f in finished)
                    done_count += len(finished)
                    if done_count >= BATCH:
                        yield done_count
                        done_count = 0
                pending.add(pool.submit(read, free.pop(), i))
            wait(pending)
            yield done_count + len(pending)
    finally:
        os.close(fd)


def _batch_preads(dataset: Path, batches: int) -> Iterator[int]:
    """Sample-sized preads of a random permutation a batch at a time, ``batches`` batches in
    flight, each asked for whole once the oldest is in (POSIX_FADV_RANDOM): the most a loader
    reading only the batches it is making can get, as DataLoader workers do, one batch each."""
    from concurrent.futures import ThreadPoolExecutor, wait

    blob, offset, count = _blob(dataset)
    order = np.random.default_rng(0).permutation(count)
    fd = os.open(blob, os.O_RDONLY)
    if hasattr(os, "posix_fadvise"):
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_RANDOM)

    def read(i: int) -> None:
        os.preadv(fd, [bytearray(SAMPLE_BYTES)], offset + int(i) * SAMPLE_BYTES)

    try:
        with ThreadPoolExecutor(BATCH * batches) as pool:
            starts = iter(range(0, count, BATCH))
            flying = [
                [pool.submit(read, i) for i in order[s : s + BATCH]]
                for s in itertools.islice(starts, batches)
            ]
            while flying:
                oldest = flying.pop(0)
                wait(oldest)
                yield len(oldest)
                start = next(starts, None)
                if start is not None:
                    flying.append([pool.submit(read, i) for i in order[start : start + BATCH]])
    finally:
        os.close(fd)


def loaders(dataset: Path, npz: Path, formats: Path) -> dict[str, Callable[[], Iterator[Any]]]:
    """Every loader of the section by name; the floors yield sample counts instead of batches."""
    out: dict[str, Callable[[], Iterator[Any]]] = {
        "floor: sequential 8 MiB reads (dd bs=8M)": lambda: _sequential(dataset),
        "floor: random sample preads, 32 in flight": lambda: _random_preads(dataset, 32),
        "floor: random sample preads, 1 in flight": lambda: _random_preads(dataset, 1),
        "floor: random sample preads, 2 batches of 64 at a time": lambda: _batch_preads(dataset, 2),
        "MmapLoader(shuffle=False)": lambda: _mmap_loader(dataset, shuffle=False),
        "MmapLoader(shuffle=True, prefetch=0)": lambda: _mmap_loader(dataset, shuffle=True, prefetch=0),
        "MmapLoader(shuffle=True, num_workers=2)": lambda: _mmap_loader(dataset, shuffle=True, num_workers=2),
        "DataLoader(MmapDataset, shuffle=True, num_workers=2)": lambda: _data_loader(dataset),
        DATALOADER_CEILING: lambda: _data_loader_ceiling(dataset),
        "MmapLoader(shuffle=True, num_workers=2), reads='mapped'": lambda: _mmap_loader(
            dataset, reads="mapped", shuffle=True, num_workers=2
        ),
        "DataLoader(MmapDataset(reads='mapped')), 2 workers": lambda: _data_loader(dataset, reads="mapped"),
        "MmapLoader(shuffle=True, num_workers=2), advice='random', reads='mapped'": lambda: _mmap_loader(
            dataset, "random", "mapped", shuffle=True, num_workers=2
        ),
        "MmapLoader(sampler=BlockShuffleSampler(n))": lambda: _block_loader(dataset),
        "DataLoader(MmapDataset, sampler=ShuffleSampler(ds)), 2 workers": lambda: _shuffle_sampler_loader(
            dataset
        ),
        INTERLEAVED_MMAP: lambda: _interleaved_loader(dataset, data_loader=False),
        INTERLEAVED_DATA: lambda: _interleaved_loader(dataset, data_loader=True),
        "np.load of the NPZ per item, 2 workers": lambda: _npz_loader(npz),
    }
    if (formats / "litdata.done").exists():
        out["LitData StreamingDataset(shuffle=True), 2 workers"] = lambda: _litdata_loader(
            formats / "litdata"
        )
    if (formats / "mosaic.done").exists():
        out["Mosaic StreamingDataset(shuffle=True), 2 workers"] = lambda: _mosaic_loader(formats / "mosaic")
    return out


def child(args: list[str]) -> None:
    """Run one loader: two warm-up batches, "ready", wait for "go", then the bounded timed run."""
    name, dataset, npz, formats, max_samples, max_seconds = args
    sys.path.insert(0, str(Path(__file__).parent))
    floor = name.startswith("floor")
    make = loaders(Path(dataset), Path(npz), Path(formats))[name]
    batches = make()
    for _ in range(0 if floor else 2):
        next(batches)
    print("ready", flush=True)
    if sys.stdin.readline().strip() != "go":
        return
    cpu0, io0 = tree_cpu_seconds(os.getpid()), tree_read_bytes(os.getpid())
    self0 = resource.getrusage(resource.RUSAGE_SELF)
    seen = 0
    started = time.perf_counter()
    deadline = started + float(max_seconds)
    for item in batches:
        seen += item if floor else _count(item)
        if seen >= int(max_samples) or time.perf_counter() > deadline:
            break
    seconds = time.perf_counter() - started
    cpu, io = tree_cpu_seconds(os.getpid()) - cpu0, tree_read_bytes(os.getpid()) - io0
    self1 = resource.getrusage(resource.RUSAGE_SELF)
    self_cpu = self1.ru_utime + self1.ru_stime - self0.ru_utime - self0.ru_stime
    result = {"samples": seen, "seconds": seconds, "cpu_s": max(cpu, self_cpu), "tree_read_bytes": io}
    print(json.dumps(result), flush=True)
    sys.stdin.readline()  # "exit": the parent has read the device's counters
    os._exit(0)  # workers of every kind are ended with us; no slow teardown


# --- other formats, converted once ---------------------------------------------------------


class _Samples:
    """The dataset's samples as dicts, opened lazily (picklable for LitData's workers)."""

    def __init__(self, dataset: Path) -> None:
        self.dataset = dataset
        self._reader: Any = None

    def __call__(self, i: int) -> dict[str, Any]:
        from npz2mmap.read.reader import DatasetReader

        if self._reader is None:
            self._reader = DatasetReader(self.dataset)
        return {
            "input": np.array(self._reader.view("input", i)),
            "label": int(self._reader.view("label", i)),
        }


def convert_formats(dataset: Path, formats: Path) -> list[str]:
    """LitData's and Mosaic's formats of the same data, once (kept in ``formats``); notes on failures."""
    notes = []
    formats.mkdir(parents=True, exist_ok=True)
    count = _blob(dataset)[2]
    samples = _Samples(dataset)
    if not (formats / "litdata.done").exists():
        try:
            import litdata

            shutil.rmtree(formats / "litdata", ignore_errors=True)
            litdata.optimize(
                fn=samples,
                inputs=list(range(count)),
                output_dir=str(formats / "litdata"),
                chunk_bytes="64MB",
                num_workers=2,
            )
            (formats / "litdata.done").touch()
        except Exception as error:  # an optional comparison: note it and go on
            notes.append(f"LitData skipped: {type(error).__name__}: {error}")
    if not (formats / "mosaic.done").exists():
        try:
            try:
                import streaming
            except (ImportError, RuntimeError):
                stub_torchvision()
                import streaming
            shutil.rmtree(formats / "mosaic", ignore_errors=True)
            columns = {"input": "ndarray:float32:3,64,64", "label": "int64"}
            with streaming.MDSWriter(out=str(formats / "mosaic"), columns=columns, size_limit="64mb") as out:
                for i in range(count):
                    out.write(samples(i))
            (formats / "mosaic.done").touch()
        except Exception as error:
            notes.append(f"Mosaic skipped: {type(error).__name__}: {error}")
    # drop the mapping: drop_caches leaves mapped pages, and the loaders must start cold
    samples._reader = None
    gc.collect()
    return notes


# --- the section ----------------------------------------------------------------------------


def idle_read_rate(device: str, seconds: float = 3.0) -> float:
    """Bytes/s read from the device by everything else on the machine while we wait."""
    before = device_read_bytes(device)
    time.sleep(seconds)
    return (device_read_bytes(device) - before) / seconds


def outofcore_section(
    dataset: Path,
    npz: Path,
    workdir: Path,
    read_aheads: list[int | None] | None = None,
    limit_mb: int | None = None,
    only: list[str] | None = None,
    max_samples: int = MAX_SAMPLES,
    max_seconds: float = MAX_SECONDS,
) -> tuple[list[OutOfCore], dict[str, Any]]:
    """Every loader at each read-ahead (None: the device's own), in a memory cgroup, cold."""
    why = can_run()
    if why:
        print(f"  out-of-core section skipped: {why}", flush=True)
        return [], {"skipped": why}
    formats = workdir / "formats"
    notes = convert_formats(dataset, formats)
    for note in notes:
        print(f"  {note}", flush=True)
    device = block_device(dataset / "data.npy")
    data_bytes = (dataset / "data.npy").stat().st_size
    own_ra = int(read_ahead_file(device).read_text())
    settings = [own_ra if ra is None else ra for ra in (read_aheads or [None, 128])]
    names = list(loaders(dataset, npz, formats))
    if only:
        names = [n for n in names if any(word.lower() in n.lower() for word in only)]
    idle = idle_read_rate(device)
    info: dict[str, Any] = {
        "device": device,
        "machine_read_ahead_kb": own_ra,
        "data_bytes": data_bytes,
        "cache_fraction": CACHE_FRACTION,
        "max_seconds": max_seconds,
        "max_samples": max_samples,
        "limit_mb": limit_mb,
        "idle_read_bytes_per_s": idle,
        "notes": notes,
    }
    rows: list[OutOfCore] = []
    cgroup = MemoryCgroup(f"npz2mmap-outofcore-{os.getpid()}")
    info["cgroup"] = f"{cgroup.version}: {cgroup.path}"
    print(
        f"  cgroup {cgroup.version} at {cgroup.path}; device {device}, idle reads {idle / 1e6:.2f} MB/s",
        flush=True,
    )
    previous = signal.getsignal(signal.SIGTERM)
    signal.signal(signal.SIGTERM, signal.default_int_handler)  # a kill also runs the finally blocks
    try:
        for kb in settings:
            with read_ahead(device, kb):
                for name in names:
                    rows.append(
                        _one(
                            name,
                            kb,
                            dataset,
                            npz,
                            formats,
                            cgroup,
                            device,
                            data_bytes,
                            limit_mb,
                            max_samples,
                            max_seconds,
                        )
                    )
    finally:
        cgroup.remove()
        signal.signal(signal.SIGTERM, previous)
    return rows, info


def data_files(name: str, dataset: Path, npz: Path, formats: Path) -> list[Path]:
    """The files a loader reads its samples from."""
    if "NPZ" in name:
        return sorted(npz.glob("*.npz"))
    for kind in ("litdata", "mosaic"):
        if kind in name.lower():
            return sorted(p for p in (formats / kind).rglob("*") if p.is_file())
    return [dataset / "data.npy"]


def _one(
    name: str,
    kb: int,
    dataset: Path,
    npz: Path,
    formats: Path,
    cgroup: MemoryCgroup,
    device: str,
    data_bytes: int,
    limit_mb: int | None,
    max_samples: int,
    max_seconds: float,
) -> OutOfCore:
    row = OutOfCore(name, kb)
    floor = name.startswith("floor")
    samples = FLOOR_SAMPLES if floor else max_samples
    args = [name, str(dataset), str(npz), str(formats), str(samples), str(max_seconds)]

    def limit_of(own: int) -> int:
        return limit_mb * 2**20 if limit_mb else own + int(CACHE_FRACTION * data_bytes)

    files = data_files(name, dataset, npz, formats)
    try:
        preset = None
        if not floor and not limit_mb:  # a short run measures the loader's own use, to set the limit first
            probe = [name, str(dataset), str(npz), str(formats), "1", "0.1"]
            preset = limit_of(run_in_cgroup(probe, cgroup, device, limit_of, files)["own_bytes"])
        result = run_in_cgroup(args, cgroup, device, limit_of, files, preset_limit=preset)
    except (RuntimeError, subprocess.TimeoutExpired) as error:
        row.note = str(error)
        print(f"  ra {kb:>5} KB {name:58s} failed: {error}", flush=True)
        return row
    row.samples, row.seconds, row.cpu_s = result["samples"], result["seconds"], result["cpu_s"]
    row.read_bytes, row.device_read_bytes = result["tree_read_bytes"], result["read_bytes"]
    row.own_bytes = result["own_bytes"]
    row.limit_bytes, row.end_cache_bytes = result["limit_bytes"], result["end_cache_bytes"]
    row.pgpgin_bytes = result["pgpgin_bytes"]
    row.per_s = row.samples / row.seconds if row.seconds else 0.0
    row.delivered_bytes = row.samples * (SAMPLE_BYTES if floor else DELIVERED_BYTES)
    if row.delivered_bytes:
        row.amplification = row.read_bytes / row.delivered_bytes
        row.device_amplification = row.device_read_bytes / row.delivered_bytes
    print(
        f"  ra {kb:>5} KB {name:58s} {row.per_s:>9,.0f}/s  read/delivered {row.amplification:6.2f} "
        f"(device {row.device_amplification:6.2f})  "
        f"CPU {row.cpu_s / row.seconds if row.seconds else 0:4.2f} cores  own {row.own_bytes / 1e6:4.0f} MB  "
        f"limit {row.limit_bytes / 1e6:4.0f} MB",
        flush=True,
    )
    return row


def outofcore_lines(rows: list[OutOfCore], info: dict[str, Any]) -> list[str]:
    if not rows:
        return [f"Out-of-core section skipped: {info.get('skipped', '')}"] if info else []
    settings = list(dict.fromkeys(r.read_ahead_kb for r in rows))
    lines = [
        "",
        f"Out of core: dataset {info['data_bytes'] / 1e6:,.0f} MB on {info['device']}, each loader in a "
        f"memory cgroup ({info['cgroup'].split(':')[0]}) limited to its own use after 2 warm-up batches + "
        f"{info['cache_fraction']:.0%} of the data, page cache dropped before each; at most "
        f"{info.get('max_samples', MAX_SAMPLES):,} samples (floors {FLOOR_SAMPLES:,}) or "
        f"{info.get('max_seconds', MAX_SECONDS):.0f} s each; "
        "bytes read: the loader's process tree's /proc/PID/io read_bytes; in brackets the whole "
        f"device's, /sys/block/{info['device']}/stat (machine-wide; idle before the run "
        f"{info['idle_read_bytes_per_s'] / 1e6:.2f} MB/s):",
        "",
        "| loader | "
        + " | ".join(
            f"read_ahead_kb {kb}: samples/s | read/delivered (device) | CPU cores" for kb in settings
        )
        + " |",
        "| --- |" + " ---: | ---: | ---: |" * len(settings),
    ]
    for name in dict.fromkeys(r.loader for r in rows):
        cells = []
        for kb in settings:
            r = next((r for r in rows if r.loader == name and r.read_ahead_kb == kb), None)
            if r is None or not r.seconds:
                cells.append("- | - | -")
            else:
                cells.append(
                    f"{r.per_s:,.0f} | {r.amplification:.2f} ({r.device_amplification:.2f}) "
                    f"| {r.cpu_s / r.seconds:.2f}"
                )
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    return lines


def mixing(order: np.ndarray, region: int = 1024) -> tuple[float, float]:
    """How well an epoch's order mixes: the mean number of distinct regions of ``region``
    neighbouring samples per batch (a full shuffle of 20,000 draws 64 batch members from
    about 20 regions), and the rank correlation between a sample's position and its index."""
    batches = [order[k : k + BATCH] for k in range(0, len(order), BATCH)]
    distinct = float(np.mean([len(np.unique(b // region)) for b in batches]))
    ranks = np.empty(len(order))
    ranks[order] = np.arange(len(order))
    correlation = float(np.corrcoef(np.arange(len(order)), ranks)[0, 1]) if len(order) > 1 else 0.0
    return distinct, correlation


def mixing_lines(num_samples: int = 20_000) -> list[str]:
    """The mixing of each shuffle of the section, over one epoch of the workload."""
    from npz2mmap import BlockShuffleSampler, ShuffleSampler

    samplers = {
        "full shuffle (`shuffle=True`, `ShuffleSampler`)": ShuffleSampler(num_samples),
        "`BlockShuffleSampler(n)` (blocks of 1,024, one at a time)": BlockShuffleSampler(num_samples),
        f"`BlockShuffleSampler(n, {INTERLEAVED_BLOCK}, interleave={INTERLEAVED_BLOCKS})`": (
            BlockShuffleSampler(num_samples, INTERLEAVED_BLOCK, interleave=INTERLEAVED_BLOCKS)
        ),
    }
    lines = [
        "",
        f"Mixing over one epoch of {num_samples:,} samples, batches of {BATCH}: distinct regions of 1,024 "
        "neighbouring samples per batch (more is better mixed), and the correlation between a sample's "
        "position in the epoch and its index (0 for a full shuffle):",
        "",
        "| shuffle | regions per batch | position/index correlation |",
        "| --- | ---: | ---: |",
    ]
    for name, sampler in samplers.items():
        distinct, correlation = mixing(np.array(list(sampler)))
        lines.append(f"| {name} | {distinct:.1f} | {correlation:+.3f} |")
    return lines


def write(rows: list[OutOfCore], info: dict[str, Any], out: Path) -> str:
    text = "\n".join(outofcore_lines(rows, info) + (mixing_lines() if rows else [])) + "\n"
    out.mkdir(parents=True, exist_ok=True)
    (out / "outofcore.md").write_text(text)
    (out / "outofcore.json").write_text(
        json.dumps({"info": info, "rows": [asdict(r) for r in rows]}, indent=1)
    )
    return text


if __name__ == "__main__":
    if len(sys.argv) > 2 and sys.argv[1] == "--child":
        child(sys.argv[2:])
