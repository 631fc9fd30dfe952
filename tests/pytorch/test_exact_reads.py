"""Data larger than memory: the limit found, the warning given once, and exact reads issued
ahead that deliver the sources' bytes on every read path, with or without madvise."""

from __future__ import annotations

import contextlib
import json
import mmap
import os
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from conftest import convert_part_at, write_samples
from torch.utils.data import DataLoader

import npz2mmap
from npz2mmap import MmapDataset, MmapLoader, PaddedCollate, collate
from npz2mmap.errors import LargerThanMemoryWarning
from npz2mmap.format.index import BLOB_HEADER_NBYTES
from npz2mmap.pytorch import dataset
from npz2mmap.read import reader
from npz2mmap.read.memory import MemoryLimit, fits_in_memory, memory_limit
from npz2mmap.write.conversion import convert
from npz2mmap.write.merge import merge

NUM_SAMPLES = 41
FIELDS = ["input", "label", "tokens"]


def fake_tree(root: Path, files: dict[str, str]) -> Path:
    for name, text in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text)
    return root


MEMINFO = "MemTotal:       24000000 kB\nMemAvailable:   20000000 kB\n"


@pytest.mark.parametrize(
    ("files", "expected"),
    [
        (
            {"proc/self/cgroup": "0::/job/step\n", "proc/meminfo": MEMINFO},
            (20000000 * 1024, "MemAvailable in /proc/meminfo"),
        ),
        (
            {
                "proc/self/cgroup": "0::/job/step\n",
                "proc/meminfo": MEMINFO,
                "sys/fs/cgroup/job/memory.max": "671088640\n",
                "sys/fs/cgroup/job/step/memory.max": "max\n",
            },
            (671088640, "sys/fs/cgroup/job/memory.max"),
        ),
        (
            {  # a container sees its own cgroup as the root of the mount
                "proc/self/cgroup": "0::/kubepods/pod1/abc\n",
                "proc/meminfo": MEMINFO,
                "sys/fs/cgroup/memory.max": "1073741824\n",
            },
            (1073741824, "sys/fs/cgroup/memory.max"),
        ),
        (
            {
                "proc/self/cgroup": "12:cpu:/\n4:memory:/slurm/uid_0/job_7\n",
                "proc/meminfo": MEMINFO,
                "sys/fs/cgroup/memory/slurm/uid_0/job_7/memory.limit_in_bytes": "2147483648\n",
                "sys/fs/cgroup/memory/memory.limit_in_bytes": "9223372036854771712\n",
            },
            (2147483648, "sys/fs/cgroup/memory/slurm/uid_0/job_7/memory.limit_in_bytes"),
        ),
        (
            {  # cgroup2 mounted elsewhere, as /proc/self/mountinfo says (with an escaped space)
                "proc/self/cgroup": "0::/job/step\n",
                "proc/self/mountinfo": "22 1 0:21 / /proc rw - proc proc rw\n"
                "30 25 0:26 / /run/my\\040cg rw,nosuid shared:9 - cgroup2 cgroup2 rw,nsdelegate\n",
                "proc/meminfo": MEMINFO,
                "run/my cg/job/memory.max": "671088640\n",
                "sys/fs/cgroup/job/memory.max": "9999999999\n",
            },
            (671088640, "run/my cg/job/memory.max"),
        ),
        (
            {  # a v1 memory mount that shows a cgroup below the hierarchy's root as its own root
                "proc/self/cgroup": "4:memory:/slurm/uid_0/job_7\n",
                "proc/self/mountinfo": "31 25 0:27 /slurm /cg/mem rw - cgroup cgroup rw,memory\n",
                "proc/meminfo": MEMINFO,
                "cg/mem/uid_0/job_7/memory.limit_in_bytes": "2147483648\n",
            },
            (2147483648, "cg/mem/uid_0/job_7/memory.limit_in_bytes"),
        ),
        (
            {  # garbage in limit files and meminfo is no limit
                "proc/self/cgroup": "0::/a\n",
                "proc/meminfo": "MemAvailable: lots kB\n",
                "sys/fs/cgroup/a/memory.max": "-5\n",
                "sys/fs/cgroup/memory.max": "9" * 40 + "\n",
            },
            None,
        ),
    ],
)
def test_memory_limit_is_the_smallest_the_process_is_under(tmp_path, monkeypatch, files, expected) -> None:
    root = fake_tree(tmp_path, files)
    monkeypatch.setattr(npz2mmap.read.memory, "_physical_memory", lambda: None)
    found = memory_limit(str(root))
    if expected is None:
        assert found is None
    else:
        assert found is not None and found.nbytes == expected[0] and found.source.endswith(expected[1])


def test_fits_in_memory_leaves_room_for_the_processes() -> None:
    limit = MemoryLimit(1000, "test")
    assert fits_in_memory(800, limit) and not fits_in_memory(801, limit) and fits_in_memory(10**18, None)


@pytest.fixture(scope="module")
def samples() -> list[dict[str, np.ndarray]]:
    rng = np.random.default_rng(5)
    return [
        {
            "input": rng.standard_normal((3, 64, 5)).astype(np.float32),  # 3,840 bytes: pages apart
            "label": np.int64(i),
            "tokens": rng.integers(0, 1000, size=int(rng.integers(1, 3000))).astype(np.int32),
        }
        for i in range(NUM_SAMPLES)
    ]


@pytest.fixture(scope="module", params=[1, 3], ids=["one part", "three parts"])
def converted(request, tmp_path_factory, samples) -> Path:
    root = tmp_path_factory.mktemp("exact")
    write_samples(root / "src", samples)
    if request.param == 1:
        convert([root / "src"], root / "ds", workers=1)
        return root / "ds"
    parts = [convert_part_at([root / "src"], root / f"p{i}", (i, 3), workers=1) for i in range(3)]
    merge(parts, root / "ds")
    return root / "ds"


def as_numpy(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return value.numpy()
    if isinstance(value, dict):
        return {k: as_numpy(v) for k, v in value.items()}
    if isinstance(value, list):
        return [as_numpy(v) for v in value]
    return value


def expected_batch(samples: list[dict[str, np.ndarray]], indices: list[int], padded: bool) -> dict[str, Any]:
    """The oracle: the source arrays, stacked, ragged ones listed (or padded with mask)."""
    out: dict[str, Any] = {
        "input": np.stack([samples[i]["input"] for i in indices]),
        "label": np.array([samples[i]["label"] for i in indices]),
    }
    tokens = [samples[i]["tokens"] for i in indices]
    if not padded:
        out["tokens"] = tokens
        return out
    longest = max(len(t) for t in tokens)
    out["tokens"] = np.stack([np.pad(t, (0, longest - len(t))) for t in tokens])
    return out


def assert_batch(got: Any, expected: dict[str, Any]) -> None:
    got = as_numpy(got)
    for name, value in expected.items():
        if isinstance(value, list):
            assert [v.tobytes() for v in got[name]] == [v.tobytes() for v in value], name
        else:
            assert np.asarray(got[name]).tobytes() == value.tobytes(), name


def loaders(ds: MmapDataset, order: list[int]) -> dict[str, tuple[Any, bool]]:
    """Every read path, each with its batches in ``order`` (a sampler), and whether it pads."""
    sampler = list(order)
    return {
        "DataLoader, no workers": (DataLoader(ds, 8, sampler=sampler, collate_fn=collate), False),
        "DataLoader, 2 workers": (
            DataLoader(
                ds, 8, sampler=sampler, collate_fn=collate, num_workers=2, multiprocessing_context="fork"
            ),
            False,
        ),
        "DataLoader, PaddedCollate": (DataLoader(ds, 8, sampler=sampler, collate_fn=PaddedCollate()), True),
        "MmapLoader(prefetch=0)": (MmapLoader(ds, 8, sampler=sampler, prefetch=0), False),
        "MmapLoader(prefetch=2)": (MmapLoader(ds, 8, sampler=sampler), False),
        "MmapLoader(num_workers=2)": (
            MmapLoader(ds, 8, sampler=sampler, num_workers=2, multiprocessing_context="fork"),
            False,
        ),
        "MmapLoader(PaddedCollate, num_workers=1)": (
            MmapLoader(
                ds,
                8,
                sampler=sampler,
                collate_fn=PaddedCollate(),
                num_workers=1,
                multiprocessing_context="fork",
            ),
            True,
        ),
    }


@pytest.mark.parametrize("reads", ["exact", "mapped"])
def test_every_read_path_delivers_the_sources_bytes(monkeypatch, converted, samples, reads) -> None:
    """Batch by batch against the sources; with exact reads each in-process path asks for them."""
    order = [int(i) for i in np.random.default_rng(3).permutation(NUM_SAMPLES)]
    ds = MmapDataset(converted, fields=FIELDS, reads=reads)
    assert ds.exact_reads == (reads == "exact")
    asked: list[int] = []
    will_need = npz2mmap.read.parts.PartsReader.will_need

    def counted(self: Any, names: Any, indices: Any) -> int:
        asked.append(len(indices))
        return will_need(self, names, indices)

    monkeypatch.setattr(npz2mmap.read.parts.PartsReader, "will_need", counted)
    for name, (loader, padded) in loaders(ds, order).items():
        asked.clear()
        batches = [order[k : k + 8] for k in range(0, NUM_SAMPLES, 8)]
        seen = 0
        for batch, indices in zip(loader, batches, strict=True):  # a ring's batch lives until the next
            assert_batch(batch, expected_batch(samples, indices, padded))
            seen += 1
        assert seen == len(batches), name
        if "2 workers" not in name:  # workers ask in their own processes
            assert sum(asked) == (NUM_SAMPLES if reads == "exact" else 0), name
        if isinstance(loader, MmapLoader):
            loader.close()


class RecordingMap:
    """Stands in for a reader's mapping where only madvise is called: records each request."""

    def __init__(self) -> None:
        self.requests: list[tuple[int, int, int]] = []

    def madvise(self, option: int, start: int = 0, length: int = 0) -> None:
        self.requests.append((option, start, length))


def oracle_pages(dataset_dir: Path, names: list[str], indices: list[int]) -> set[int]:
    """The pages holding these samples' bytes, from index.json and the blob's own tables."""
    index = json.loads((dataset_dir / "index.json").read_text())
    blob = np.fromfile(dataset_dir / "data.npy", dtype=np.uint8)
    pages = set()
    for field in index["fields"]:
        if field["name"] not in names:
            continue
        base = BLOB_HEADER_NBYTES + field["data"]["offset"]
        if field["kind"] == "fixed":
            stride = field["data"]["nbytes"] // index["num_samples"]
            ranges = [(base + i * stride, base + (i + 1) * stride) for i in indices]
        else:
            at = BLOB_HEADER_NBYTES + field["offsets"]["offset"]
            offsets = blob[at : at + field["offsets"]["nbytes"]].view("<i8")
            ranges = [(base + int(offsets[i]), base + int(offsets[i + 1])) for i in indices]
        for start, end in ranges:
            pages.update(range(start // mmap.PAGESIZE, -(-end // mmap.PAGESIZE)))
    return pages


@pytest.mark.parametrize("call", ["posix_fadvise", "madvise"])
def test_will_need_asks_for_exactly_the_pages_of_the_samples(tmp_path, monkeypatch, samples, call) -> None:
    """posix_fadvise on Linux (it lets other threads run while the disk is busy); madvise where
    there is none (macOS), tested here with posix_fadvise removed."""
    write_samples(tmp_path / "src", samples)
    convert([tmp_path / "src"], tmp_path / "ds", workers=1)
    if call == "madvise":
        monkeypatch.delattr(os, "posix_fadvise", raising=False)
    one = npz2mmap.DatasetReader(tmp_path / "ds")
    recorder = RecordingMap()
    if call == "madvise":
        one._mmap = recorder  # type: ignore[assignment]
    else:
        blob = os.stat(tmp_path / "ds" / "data.npy")

        def fadvise(fd: int, start: int, length: int, option: int) -> None:
            assert option == os.POSIX_FADV_WILLNEED and os.fstat(fd).st_ino == blob.st_ino
            recorder.madvise(mmap.MADV_WILLNEED, start, length)

        monkeypatch.setattr(os, "posix_fadvise", fadvise)
    cases = [(FIELDS, [0, 7, 3, 40]), (["tokens"], [5]), (["input", "label"], list(range(20)))]
    cases.append((["tokens"], list(range(NUM_SAMPLES))))  # one run of more than WILL_NEED_CHUNK
    for names, indices in cases:
        recorder.requests.clear()
        made = one.will_need(names, np.array(indices, dtype=np.int64))
        assert made == len(recorder.requests)
        asked: set[int] = set()
        for option, start, length in recorder.requests:
            assert option == mmap.MADV_WILLNEED and start % mmap.PAGESIZE == 0 and length % mmap.PAGESIZE == 0
            assert not asked & set(range(start // mmap.PAGESIZE, (start + length) // mmap.PAGESIZE))
            asked.update(range(start // mmap.PAGESIZE, (start + length) // mmap.PAGESIZE))
        assert asked == oracle_pages(tmp_path / "ds", names, indices)
        starts = [start for _, start, _ in recorder.requests]
        assert starts == sorted(starts)
        assert all(
            length <= reader.WILL_NEED_CHUNK for _, _, length in recorder.requests
        )  # Linux reads no more
        for (_, start, length), (_, after, _) in zip(recorder.requests, recorder.requests[1:], strict=False):
            assert start + length < after or length == reader.WILL_NEED_CHUNK  # runs joined, then cut
        if names == ["tokens"] and len(indices) == NUM_SAMPLES:
            assert max(length for _, _, length in recorder.requests) == reader.WILL_NEED_CHUNK


def test_without_madvise_exact_reads_ask_nothing_and_deliver_the_same(
    monkeypatch, converted, samples
) -> None:
    """Windows' mmap has no madvise: the same batches, read as they are copied."""
    monkeypatch.setattr(reader, "ADVICE", {})
    monkeypatch.setattr(dataset, "ADVICE", {})
    ds = MmapDataset(converted, fields=FIELDS, reads="exact")
    assert all(r.will_need(FIELDS, np.arange(3)) == 0 for r in ds.reader.readers)
    order = list(range(NUM_SAMPLES))[::-1]
    with MmapLoader(ds, 8, sampler=order) as loader:
        for batch, k in zip(loader, range(0, NUM_SAMPLES, 8), strict=True):
            assert_batch(batch, expected_batch(samples, order[k : k + 8], False))


def test_a_dataset_larger_than_memory_warns_once_naming_both_sizes(monkeypatch, converted) -> None:
    monkeypatch.setattr(dataset, "memory_limit", lambda: MemoryLimit(4096, "the cgroup's memory.max (test)"))
    monkeypatch.setattr(dataset, "_warned_larger_than_memory", set())
    with pytest.warns(LargerThanMemoryWarning) as caught:
        auto = MmapDataset(converted)
        again = MmapDataset(converted, fields="label")
        mapped = MmapDataset(converted, reads="mapped")
    assert len(caught) == 1
    message = str(caught[0].message)
    assert message.startswith(f"{converted}: its ")
    assert "are more than 80% of the 4.1 kB this process may use (the cgroup's memory.max (test))" in message
    assert "sampler=ShuffleSampler(ds)" in message
    assert "sampler=BlockShuffleSampler(len(ds), 256, interleave='auto', dataset=ds)" in message
    assert caught[0].filename == __file__  # the user's line
    assert auto.exact_reads and again.exact_reads and not mapped.exact_reads
    monkeypatch.setattr(dataset, "memory_limit", lambda: MemoryLimit(1 << 40, "test"))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert not MmapDataset(converted).exact_reads and MmapDataset(converted, reads="exact").exact_reads
    with pytest.raises(ValueError, match="reads must be one of 'auto', 'exact', 'mapped', not 'fast'"):
        MmapDataset(converted, reads="fast")


@pytest.mark.parametrize("num_workers", [0, 2])
@pytest.mark.parametrize("read_ahead", [0, 1, 4])
def test_resume_with_reads_issued_ahead_is_exact(converted, num_workers, read_ahead) -> None:
    ds = MmapDataset(converted, fields="label", reads="exact")
    options = {"num_workers": num_workers, "read_ahead": read_ahead, "multiprocessing_context": "fork" if num_workers else None}
    with MmapLoader(ds, 4, shuffle=True, seed=2, **options) as whole:
        uninterrupted = [b.tolist() for b in whole]
    with MmapLoader(ds, 4, shuffle=True, seed=2, **options) as first:
        for k, _ in enumerate(first):
            if k == 3:
                state = first.state_dict()
                break
    with MmapLoader(ds, 4, shuffle=True, seed=2, **options) as resumed:
        resumed.load_state_dict(state)
        assert [b.tolist() for b in resumed] == uninterrupted[4:]


def test_a_sampler_error_comes_in_its_turn_whatever_is_read_ahead(converted) -> None:
    ds = MmapDataset(converted, fields="label", reads="exact")

    def order() -> Any:
        yield from range(10)
        raise RuntimeError("the sampler broke")

    got = []
    with pytest.raises(RuntimeError, match="the sampler broke"):
        for batch in MmapLoader(ds, 4, sampler=order(), read_ahead=4, prefetch=0):
            got.append(batch.tolist())
    assert got == [[0, 1, 2, 3], [4, 5, 6, 7]]
    with pytest.raises(IndexError):
        list(MmapLoader(ds, 4, sampler=[0, 1, 2, 3, 10**6], read_ahead=4))


@pytest.mark.parametrize("command", [["inspect"], ["inspect", "--json"], ["warm", "-q"]])
def test_inspect_and_warm_say_when_the_dataset_does_not_fit(monkeypatch, converted, command) -> None:
    from click.testing import CliRunner

    from npz2mmap.cli import commands
    from npz2mmap.cli.commands import cli

    monkeypatch.setattr(commands, "memory_limit", lambda: MemoryLimit(4096, "the cgroup's memory.max (test)"))
    result = CliRunner().invoke(cli, [command[0], str(converted), *command[1:]])
    assert result.exit_code == 0
    [line] = result.stderr.splitlines()
    assert line.startswith(f"Warning: {converted}: its ") and "(the cgroup's memory.max (test))" in line
    if "--json" in command:
        json.loads(result.stdout)  # stdout stays JSON
    monkeypatch.setattr(commands, "memory_limit", lambda: MemoryLimit(1 << 40, "test"))
    assert CliRunner().invoke(cli, [command[0], str(converted), *command[1:]]).stderr == ""


def test_a_field_named_twice_is_refused(converted) -> None:
    with pytest.raises(ValueError, match="^fields names 'tokens' twice; name each field once$"):
        MmapDataset(converted, fields=["tokens", "label", "tokens"])


@pytest.mark.parametrize("read_ahead", [1.5, True, "4"])
def test_read_ahead_is_a_number_of_batches(converted, read_ahead) -> None:
    with pytest.raises(TypeError, match="^read_ahead must be an int"):
        MmapLoader(MmapDataset(converted, fields="label"), 4, read_ahead=read_ahead)


def test_an_empty_field_list_is_refused_not_taken_for_every_field(converted) -> None:
    with pytest.raises(ValueError, match="^fields is empty: name at least one field"):
        MmapDataset(converted, fields=[])
    assert MmapDataset(converted, fields=iter(["label"])).fields == ("label",)


@pytest.mark.parametrize("label", ["a\0b", "\ud800"])
def test_verify_sources_counts_a_label_that_is_no_file_name_as_not_compared(tmp_path, label) -> None:
    from click.testing import CliRunner

    from npz2mmap.cli.commands import cli

    with npz2mmap.Writer(tmp_path / "w") as w:
        w.append({"x": np.arange(3)}, source=label)
    result = CliRunner().invoke(cli, ["verify", str(tmp_path / "w"), "--sources"])
    assert result.exit_code == 0 and "Traceback" not in result.output
    assert result.output == (
        f"OK: {tmp_path / 'w'}: 1 sample verified (checksums, tables, padding); 1 sample of 1 names as "
        "source a label, a file of no sample or one other samples share (npz2mmap.Writer's source=), and "
        "was not compared\n"
    )


@pytest.mark.skipif(not os.path.isdir("/proc/self/fd"), reason="counts /proc/self/fd")
def test_the_hints_descriptor_goes_with_its_dataset(converted) -> None:
    """The blob is opened once per mapping: the descriptor checked is the one exact reads hint
    through, and it is closed with the mapping: none is left by a dataset dropped after a loader
    closed."""
    import gc

    def blob_fds() -> int:
        fds = f"/proc/{os.getpid()}/fd"
        links = []
        for fd in os.listdir(fds):
            with contextlib.suppress(OSError):  # the listing's own descriptor is gone by now
                links.append(os.readlink(f"{fds}/{fd}"))
        return sum(link.endswith("data.npy") for link in links)

    gc.collect()  # datasets earlier tests dropped close their descriptors now, not during this test
    before = blob_fds()
    ds = MmapDataset(converted, fields=FIELDS, reads="exact")
    parts = len(ds.reader.readers)
    ds.__getitems__(list(range(NUM_SAMPLES)))
    ds.__getitems__([1, 2])
    assert blob_fds() == before + 2 * parts  # the mappings' own duplicates, and the ones checked
    with MmapLoader(ds, 4, shuffle=True, num_workers=1, multiprocessing_context="fork") as loader:
        for _ in loader:
            pass
    del ds, loader
    gc.collect()
    assert blob_fds() == before
