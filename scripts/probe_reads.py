"""Ways to read a random batch's exact byte ranges from a blob larger than the cache may hold.

    python scripts/probe_reads.py --workdir DIR     # DIR as for bench.py (its fixed/dataset is used)

Same conditions as bench.py's out-of-core section (scripts/outofcore.py): each strategy
runs in a child process inside a memory cgroup limited to the child's own use + 40 % of
the data, after the page cache was dropped, at the device's own read_ahead_kb and at 128.
A sample is one float32 (3, 64, 64) image, 48 KiB, at its offset in the blob (the labels,
160 KB for all, are read once up front); batches are 64 samples of a random permutation,
gathered into one preallocated (64, 49152) byte buffer. Strategies:

    mmap                     page faults on a plain mapping (default advice): the baseline
    mmap+random              madvise(MADV_RANDOM) on the whole mapping, then the same copy
    mmap+random+willneed:k   also madvise(MADV_WILLNEED) each sample's range k batches ahead
                             (k=0: the batch's own ranges, just before its copy: all a worker
                             that sees one batch at a time can do)
    pread:T                  os.preadv of each sample into the batch buffer, T threads
    fadvise:k+pread          posix_fadvise(WILLNEED) each sample's range k batches ahead, then preadv
    fadvise:k+mmap           the same ahead, then the copy from a plain mapping
    uring:D                  io_uring reads (the liburing package), D in flight, if it imports

Root only. Prints a table and writes probe_reads.md / probe_reads.json to --out.
"""

from __future__ import annotations

import argparse
import json
import mmap
import os
import resource
import sys
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).parent))

import outofcore  # noqa: E402

BATCH = 64
SAMPLE = outofcore.SAMPLE_BYTES
PAGE = mmap.PAGESIZE


def strategies() -> list[str]:
    names = ["mmap", "mmap+random"]
    names += [f"mmap+random+willneed:{k}" for k in (0, 1, 2, 4, 8)]
    names += [f"pread:{t}" for t in (1, 4, 8, 16, 32)]
    names += [f"fadvise:{k}+pread" for k in (0, 1, 2, 4, 8)]
    names += [f"fadvise:{k}+mmap" for k in (0, 4)]
    try:
        import liburing  # noqa: F401

        names += ["uring:64", "uring:128"]
    except ImportError:
        pass
    return names


# --- the child: one strategy ---------------------------------------------------------------


class Blob:
    def __init__(self, dataset: Path) -> None:
        path, self.offset, self.count = outofcore._blob(dataset)
        self.fd = os.open(path, os.O_RDONLY)
        self.map = mmap.mmap(self.fd, 0, prot=mmap.PROT_READ)
        size = self.count * SAMPLE
        self.images = np.frombuffer(self.map, np.uint8, size, self.offset).reshape(self.count, SAMPLE)
        index = json.loads((dataset / "index.json").read_text())
        label = next(f for f in index["fields"] if f["name"] == "label")["data"]
        self.labels = np.frombuffer(os.pread(self.fd, label["nbytes"], label["offset"]), np.int64)

    def start(self, i: int) -> int:
        return self.offset + int(i) * SAMPLE

    def advise_pages(self, idx: np.ndarray, advice: int) -> None:
        """madvise on each sample's range, widened to whole pages."""
        for i in idx:
            start = self.start(i)
            first = start - start % PAGE
            self.map.madvise(advice, first, start + SAMPLE - first)

    def fadvise(self, idx: np.ndarray) -> None:
        for i in idx:
            os.posix_fadvise(self.fd, self.start(i), SAMPLE, os.POSIX_FADV_WILLNEED)


def ahead(batches: list[np.ndarray], k: int, advise: Callable[[np.ndarray], None]) -> Iterator[np.ndarray]:
    """The batches, each one's successor k batches on advised before it is yielded."""
    for j in range(min(k, len(batches))):
        advise(batches[j])
    for j, idx in enumerate(batches):
        if j + k < len(batches):
            advise(batches[j + k])
        yield idx


def run(name: str, blob: Blob, batches: list[np.ndarray]) -> Iterator[int]:
    """Gather each batch into ``out``; yields samples gathered."""
    out = np.empty((BATCH, SAMPLE), np.uint8)
    kind, _, arg = name.partition(":")
    if name.startswith("mmap"):
        if "random" in name:
            blob.map.madvise(mmap.MADV_RANDOM)
        order: Iterator[np.ndarray] = iter(batches)
        if "willneed" in name:
            k = int(arg)
            order = ahead(batches, k, lambda idx: blob.advise_pages(idx, mmap.MADV_WILLNEED))
        for idx in order:
            np.take(blob.images, idx, axis=0, out=out[: len(idx)])
            yield len(idx)
    elif kind == "pread":
        threads = int(arg)
        rows = [memoryview(out[j]) for j in range(BATCH)]

        def read(job: tuple[int, int]) -> int:
            j, i = job
            return os.preadv(blob.fd, [rows[j]], blob.start(i))

        if threads == 1:
            for idx in batches:
                for j, i in enumerate(idx):
                    read((j, i))
                yield len(idx)
            return
        with ThreadPoolExecutor(threads) as pool:
            for idx in batches:
                list(pool.map(read, enumerate(idx)))
                yield len(idx)
    elif kind == "fadvise":
        k_text, _, then = arg.partition("+")
        order = ahead(batches, int(k_text), blob.fadvise)
        for idx in order:
            if then == "pread":
                for j, i in enumerate(idx):
                    os.preadv(blob.fd, [memoryview(out[j])], blob.start(i))
            else:
                np.take(blob.images, idx, axis=0, out=out[: len(idx)])
            yield len(idx)
    elif kind == "uring":
        yield from _uring(blob, batches, out, int(arg))
    else:
        raise ValueError(name)


def _uring(blob: Blob, batches: list[np.ndarray], out: np.ndarray, depth: int) -> Iterator[int]:
    """io_uring reads, ``depth`` in flight across batch boundaries; the liburing binding reads into
    bytearrays only, so each sample is copied from its slot into the batch (48 KiB, ~5 us)."""
    import liburing as lu

    ring, cqe = lu.Ring(), lu.Cqe()
    lu.io_uring_queue_init(max(depth, 8), ring)
    slots = [bytearray(SAMPLE) for _ in range(depth)]
    outs = [out] + [np.empty_like(out) for _ in range(depth // BATCH + 1)]  # batches overlap in flight
    free = list(range(depth))
    jobs = [(b, j, int(i)) for b, idx in enumerate(batches) for j, i in enumerate(idx)]
    pending: dict[int, tuple[int, int]] = {}
    done_in = [0] * len(batches)
    next_job = 0
    finished = 0
    try:
        while finished < len(batches):
            while free and next_job < len(jobs):
                b, j, i = jobs[next_job]
                slot = free.pop()
                sqe = lu.io_uring_get_sqe(ring)
                lu.io_uring_prep_read(sqe, blob.fd, slots[slot], blob.start(i))
                sqe.user_data = slot
                pending[slot] = (b, j)
                next_job += 1
            lu.io_uring_submit(ring)
            lu.io_uring_wait_cqe(ring, cqe)
            while True:
                entry = cqe[0]
                slot = entry.user_data
                if entry.res != SAMPLE:
                    raise OSError(f"io_uring read returned {entry.res}")
                lu.io_uring_cqe_seen(ring, entry)
                b, j = pending.pop(slot)
                outs[b % len(outs)][j] = np.frombuffer(slots[slot], np.uint8)
                free.append(slot)
                done_in[b] += 1
                while finished < len(batches) and done_in[finished] == len(batches[finished]):
                    yield len(batches[finished])
                    finished += 1
                if lu.io_uring_cq_ready(ring) == 0:
                    break
                lu.io_uring_wait_cqe(ring, cqe)
    finally:
        lu.io_uring_queue_exit(ring)


def child(args: list[str]) -> None:
    name, dataset, max_samples, max_seconds = args
    blob = Blob(Path(dataset))
    order = np.random.default_rng(0).permutation(blob.count)
    batches = [order[s : s + BATCH] for s in range(0, min(blob.count, int(max_samples)), BATCH)]
    print("ready", flush=True)
    if sys.stdin.readline().strip() != "go":
        return
    r0, io0 = resource.getrusage(resource.RUSAGE_SELF), outofcore.tree_read_bytes(os.getpid())
    seen = 0
    started = time.perf_counter()
    deadline = started + float(max_seconds)
    gen = run(name, blob, batches)
    for n in gen:
        seen += n
        if time.perf_counter() > deadline:
            break
    seconds = time.perf_counter() - started
    r1, io1 = resource.getrusage(resource.RUSAGE_SELF), outofcore.tree_read_bytes(os.getpid())
    print(
        json.dumps(
            {
                "samples": seen,
                "seconds": seconds,
                "user_s": r1.ru_utime - r0.ru_utime,
                "sys_s": r1.ru_stime - r0.ru_stime,
                "tree_read_bytes": io1 - io0,
            }
        ),
        flush=True,
    )
    sys.stdin.readline()
    os._exit(0)


# --- the parent ------------------------------------------------------------------------------


@dataclass
class Probe:
    strategy: str
    read_ahead_kb: int
    samples: int = 0
    seconds: float = 0.0
    per_s: float = 0.0
    amplification: float = 0.0  # this process's /proc/self/io read_bytes
    device_amplification: float = 0.0  # the whole device's meanwhile
    user_s: float = 0.0
    sys_s: float = 0.0
    cpu_us_per_sample: float = 0.0
    note: str = ""


def probe(
    dataset: Path, read_aheads: list[int | None], names: list[str], max_samples: int, max_seconds: float
) -> tuple[list[Probe], dict[str, object]]:
    why = outofcore.can_run()
    if why:
        print(f"probe skipped: {why}")
        return [], {"skipped": why}
    blob_path = dataset / "data.npy"
    device = outofcore.block_device(blob_path)
    data_bytes = blob_path.stat().st_size
    own_ra = int(outofcore.read_ahead_file(device).read_text())
    settings = [own_ra if ra is None else ra for ra in read_aheads]
    info: dict[str, object] = {
        "device": device,
        "data_bytes": data_bytes,
        "idle_read_bytes_per_s": outofcore.idle_read_rate(device),
    }
    rows = []
    cgroup = outofcore.MemoryCgroup(f"npz2mmap-probe-{os.getpid()}")
    info["cgroup"] = f"{cgroup.version}: {cgroup.path}"
    try:
        for kb in settings:
            with outofcore.read_ahead(device, kb):
                for name in names:
                    row = Probe(name, kb)
                    try:
                        result = outofcore.run_in_cgroup(
                            [name, str(dataset), str(max_samples), str(max_seconds)],
                            cgroup,
                            device,
                            lambda own: own + int(outofcore.CACHE_FRACTION * data_bytes),
                            [blob_path],
                            script=__file__,
                        )
                    except RuntimeError as error:
                        row.note = str(error)
                        print(f"  ra {kb:>5} {name:26s} failed: {error}", flush=True)
                        rows.append(row)
                        continue
                    row.samples, row.seconds = result["samples"], result["seconds"]
                    row.user_s, row.sys_s = result["user_s"], result["sys_s"]
                    row.per_s = row.samples / row.seconds
                    row.amplification = result["tree_read_bytes"] / (row.samples * SAMPLE)
                    row.device_amplification = result["read_bytes"] / (row.samples * SAMPLE)
                    row.cpu_us_per_sample = (row.user_s + row.sys_s) / row.samples * 1e6
                    print(
                        f"  ra {kb:>5} {name:26s} {row.per_s:>8,.0f}/s  "
                        f"read/delivered {row.amplification:6.2f} (device {row.device_amplification:5.2f})"
                        f"  CPU {row.cpu_us_per_sample:6.1f} us/sample (user {row.user_s:.2f} s, "
                        f"sys {row.sys_s:.2f} s)",
                        flush=True,
                    )
                    rows.append(row)
    finally:
        cgroup.remove()
    return rows, info


def lines(rows: list[Probe], info: dict[str, object]) -> list[str]:
    settings = list(dict.fromkeys(r.read_ahead_kb for r in rows))
    out = [
        f"Exact-range reads of random batches of {BATCH} (48 KiB samples), cold, memory cgroup "
        f"= own use + 40 % of the data; bytes read: the process's /proc/self/io read_bytes (in brackets: "
        f"the whole device's, /sys/block/{info['device']}/stat):",
        "",
        "| strategy | "
        + " | ".join(
            f"ra {kb} KB: samples/s | read/delivered (device) | CPU µs/sample (sys share)" for kb in settings
        )
        + " |",
        "| --- |" + " ---: | ---: | ---: |" * len(settings),
    ]
    for name in dict.fromkeys(r.strategy for r in rows):
        cells = []
        for kb in settings:
            r = next((r for r in rows if r.strategy == name and r.read_ahead_kb == kb), None)
            if r is None or not r.samples:
                cells.append("- | - | -")
            else:
                share = r.sys_s / (r.user_s + r.sys_s) if r.user_s + r.sys_s else 0
                cells.append(
                    f"{r.per_s:,.0f} | {r.amplification:.2f} ({r.device_amplification:.2f}) "
                    f"| {r.cpu_us_per_sample:.0f} ({share:.0%})"
                )
        out.append(f"| {name} | " + " | ".join(cells) + " |")
    return out


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--workdir", type=Path, required=True, help="bench.py's workdir (fixed/dataset)")
    parser.add_argument("--out", type=Path, default=Path(__file__).resolve().parent.parent / "bench-results")
    parser.add_argument(
        "--read-ahead-kb", type=int, action="append", help="default: the device's own and 128"
    )
    parser.add_argument("--strategy", action="append", help="only these strategies (repeatable)")
    parser.add_argument("--samples", type=int, default=2560, help="samples per strategy at most")
    parser.add_argument("--seconds", type=float, default=8.0, help="seconds per strategy at most")
    args = parser.parse_args()
    names = args.strategy or strategies()
    rows, info = probe(
        args.workdir / "fixed" / "dataset",
        args.read_ahead_kb or [None, 128],
        names,
        args.samples,
        args.seconds,
    )
    if not rows:
        return
    text = "\n".join(lines(rows, info)) + "\n"
    print("\n" + text)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "probe_reads.md").write_text(text)
    (args.out / "probe_reads.json").write_text(
        json.dumps({"info": info, "rows": [asdict(r) for r in rows]}, indent=1)
    )


if __name__ == "__main__":
    if len(sys.argv) > 2 and sys.argv[1] == "--child":
        child(sys.argv[2:])
    else:
        main()
