"""Every reader opens a dataset through the same checks: fail fast, in one line, never hang.

A dataset's files may be replaced by something that is not a file (a pipe
would block a reader forever, /dev/zero would feed it without end) or be
damaged (truncated, extended, edited, another dataset's blob). MmapDataset
and every command must refuse each with a FormatError naming the file, the
CLI with one line and exit code 1. Hangs and unbounded reads are caught by
running in a subprocess under a timeout and a memory limit.
"""

from __future__ import annotations

import json
import os
import resource
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner
from conftest import convert_part_at, raises_from_dataloader, write_samples
from torch.utils.data import DataLoader

from npz2mmap import MmapDataset
from npz2mmap.cli.commands import cli
from npz2mmap.errors import FormatError
from npz2mmap.format.index import BLOB_HEADER_NBYTES
from npz2mmap.write.conversion import convert
from npz2mmap.write.merge import merge

pytestmark = pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="needs named pipes")

TIMEOUT_SECONDS = 240
MEMORY_LIMIT_NBYTES = 2 << 30
DATASET_FILES = ("index.json", "data.npy", "sources.jsonl", "skipped.jsonl")
# (directory of the replaced file, file): the single dataset's files, the manifest, a part's files.
TARGETS = [("ds", name) for name in DATASET_FILES] + [("m", "manifest.json")]
TARGETS += [("p0", name) for name in DATASET_FILES]
NOT_A_FILE = {
    "fifo": "a pipe (FIFO), not a regular file",
    "dev-zero": "a character device, not a regular file",
    "directory": "a directory, not a regular file",
}
COMMANDS = ("dataset", "inspect", "verify", "warm", "merge")


@pytest.fixture(scope="module")
def datasets(tmp_path_factory) -> Path:
    """ds: a dataset; p0, p1: its two parts; m: a manifest naming them; twin: ds with other values."""
    root = tmp_path_factory.mktemp("datasets")
    samples = [
        {"x": np.arange(4, dtype=np.float32) + i, "t": np.arange(i + 1, dtype=np.int32)} for i in range(6)
    ]
    write_samples(root / "src", samples)
    convert([root / "src"], root / "tree" / "ds", workers=1)
    for part in range(2):
        convert_part_at([root / "src"], root / "tree" / f"p{part}", (part, 2), workers=1)
    merge([root / "tree" / "p0", root / "tree" / "p1"], root / "tree" / "m")
    write_samples(root / "other", [{"x": sample["x"] + 100, "t": sample["t"] + 100} for sample in samples])
    convert([root / "other"], root / "tree" / "twin", workers=1)
    return root / "tree"


def replace_by(path: Path, kind: str) -> None:
    path.unlink()
    if kind == "fifo":
        os.mkfifo(path)
    elif kind == "dev-zero":
        path.symlink_to("/dev/zero")
    else:
        path.mkdir()


def opened_path(case: Path, directory: str) -> Path:
    """What a user opens: the dataset itself, or the manifest directory for the manifest and its parts."""
    return case / ("ds" if directory == "ds" else "m")


CLI_DRIVER = """
import json, sys
from click.testing import CliRunner
from npz2mmap.cli.commands import cli
for args in json.loads(sys.argv[1]):
    print(json.dumps({"started": args}), flush=True)
    result = CliRunner().invoke(cli, args)
    unexpected = None if result.exception is None or isinstance(result.exception, SystemExit) else repr(result.exception)
    print(json.dumps({"exit_code": result.exit_code, "output": result.output, "unexpected": unexpected}), flush=True)
"""

DATASET_DRIVER = """
import json, sys
from npz2mmap import MmapDataset
from npz2mmap.errors import FormatError
for path in json.loads(sys.argv[1]):
    print(json.dumps({"started": path}), flush=True)
    try:
        MmapDataset(path)
        outcome = "opened"
    except FormatError as exc:
        outcome = f"FormatError: {exc}"
    except BaseException as exc:
        outcome = f"unexpected: {exc!r}"
    print(json.dumps({"outcome": outcome}), flush=True)
"""


def _limit_memory() -> None:
    resource.setrlimit(resource.RLIMIT_AS, (MEMORY_LIMIT_NBYTES, MEMORY_LIMIT_NBYTES))


def run_bounded(driver: str, jobs: list) -> list[dict]:
    """Run ``driver`` over ``jobs`` in a subprocess under a timeout and a memory limit; one result per job."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
    try:
        result = subprocess.run(
            [sys.executable, "-c", driver, json.dumps(jobs)],
            capture_output=True,
            text=True,
            timeout=TIMEOUT_SECONDS,
            preexec_fn=_limit_memory,
            env=env,
        )
    except subprocess.TimeoutExpired as exc:
        output = exc.stdout.decode() if isinstance(exc.stdout, bytes) else exc.stdout or ""
        started = [json.loads(line)["started"] for line in output.splitlines() if '"started"' in line]
        pytest.fail(f"hung (no answer in {TIMEOUT_SECONDS} s) on {started[-1] if started else 'start-up'}")
    lines = [json.loads(line) for line in result.stdout.splitlines()]
    results = [line for line in lines if "started" not in line]
    assert len(results) == len(jobs), (
        f"died ({result.returncode}) after {lines[-1:]}: {result.stderr[-2000:]}"
    )
    return results


def cli_arguments(command: str, case: Path, target: Path) -> list[str]:
    if command == "merge":
        return ["merge", str(target), "-o", str(case / "merged"), "--copy", "-q"]
    return [command, str(target)] + (["-q"] if command in ("verify", "warm") else [])


@pytest.mark.parametrize("command", COMMANDS)
def test_a_dataset_file_that_is_not_a_file_is_refused_by_every_reader(tmp_path, datasets, command) -> None:
    """A pipe, /dev/zero or a directory in place of any file: one error naming it, no wait, no growth."""
    cases = []
    for directory, name in TARGETS:
        for kind, message in NOT_A_FILE.items():
            case = tmp_path / f"{directory}-{name}-{kind}"
            shutil.copytree(datasets, case, symlinks=True)
            replace_by(case / directory / name, kind)
            cases.append((case, opened_path(case, directory), f"{case / directory / name}: {message}"))
    if command == "dataset":
        results = run_bounded(DATASET_DRIVER, [str(target) for _, target, _ in cases])
        for (_, target, expected), result in zip(cases, results, strict=True):
            assert result["outcome"] == f"FormatError: {expected}", target
        return
    results = run_bounded(CLI_DRIVER, [cli_arguments(command, case, target) for case, target, _ in cases])
    for (case, target, expected), result in zip(cases, results, strict=True):
        assert result["unexpected"] is None and result["exit_code"] == 1, (expected, result)
        if command == "verify":
            *problems, summary = result["output"].splitlines()
            counted = "1 problem" if len(problems) == 1 else f"{len(problems)} problems"
            assert summary == f"Error: {target}: {counted} found"
            assert any(problem.endswith(expected) for problem in problems), (expected, problems)
        else:
            assert result["output"] == f"Error: {expected}\n"
        assert not (case / "merged").exists()


def test_replacing_a_dataset_or_manifest_whose_index_is_a_pipe_is_refused_without_waiting(
    tmp_path, datasets
) -> None:
    """--overwrite looks inside OUT to tell whether it is ours: a pipe there is not, and is not read."""
    shutil.copytree(datasets, tmp_path / "tree", symlinks=True)
    tree = tmp_path / "tree"
    replace_by(tree / "ds" / "index.json", "fifo")
    replace_by(tree / "m" / "manifest.json", "fifo")
    jobs = [
        ["convert", str(tree.parent / "missing-src"), "-o", str(tree / "ds"), "--overwrite", "-q"],
        ["merge", str(tree / "p0"), str(tree / "p1"), "-o", str(tree / "m"), "--overwrite", "-q"],
    ]
    convert_result, merge_result = run_bounded(CLI_DRIVER, jobs)
    assert convert_result["exit_code"] == 1 and convert_result["output"] == (
        f"Error: {tree / 'ds'}: exists and is not an npz2mmap dataset "
        f"({tree / 'ds' / 'index.json'}: a pipe (FIFO), not a regular file); choose another OUT "
        "(--overwrite replaces only a dataset or an empty directory)\n"
    )
    manifest = tree / "m" / "manifest.json"
    assert merge_result["exit_code"] == 1 and merge_result["output"] == (
        f"Error: {manifest}: exists and is not ours ({manifest}: a pipe (FIFO), not a regular file); "
        "refusing to replace it\n"
    )
    assert (tree / "ds" / "index.json").is_fifo() and manifest.is_fifo()


def test_provenance_files_are_read_no_further_than_the_index_allows(tmp_path, datasets) -> None:
    """A gigabyte without a newline, or more lines than declared, stops the read at once."""
    cases = []
    for name, damage in [
        ("sources.jsonl", lambda path: (os.truncate(path, 0), os.truncate(path, 1 << 30))),  # sparse NULs
        ("sources.jsonl", lambda path: path.write_text(path.read_text() + '"extra"\n' * 100_000)),
        ("skipped.jsonl", lambda path: path.write_text('{"path": "a", "reason": "b"}\n' * 100_000)),
    ]:
        case = tmp_path / f"case{len(cases)}"
        shutil.copytree(datasets / "ds", case)
        damage(case / name)
        cases.append((case, case / name))
    results = run_bounded(CLI_DRIVER, [["verify", str(case), "-q"] for case, _ in cases])
    expected = [
        "line 1 is longer than 65536 bytes",
        "holds more than the 6 lines the index declares",
        "holds more than the 0 lines the index declares",
    ]
    for (case, path), message, result in zip(cases, expected, results, strict=True):
        assert result["exit_code"] == 1 and result["unexpected"] is None
        assert result["output"] == f"{path}: {message}\nError: {case}: 1 problem found\n"


def _truncate(blob: Path) -> None:
    blob.write_bytes(blob.read_bytes()[:-64])


def _extend(blob: Path) -> None:
    blob.write_bytes(blob.read_bytes() + bytes(64))


def _edit_header(blob: Path) -> None:
    data = bytearray(blob.read_bytes())
    data[BLOB_HEADER_NBYTES - 2] = ord("x")  # the header's padding, before its final newline
    blob.write_bytes(bytes(data))


def _edit_identity(blob: Path) -> None:
    data = bytearray(blob.read_bytes())
    data[BLOB_HEADER_NBYTES + 16] ^= 0x01  # the format version inside the identity
    blob.write_bytes(bytes(data))


def _link_to_another_blob(blob: Path) -> None:
    """A valid blob of the very same size and layout, holding other values."""
    blob.unlink()
    blob.symlink_to(blob.parent.parent / "twin" / "data.npy")


IDENTITY = "does not belong to the index read (index.json was edited, or the dataset was replaced"
BLOB_DAMAGE = {
    "truncated": (_truncate, "bytes, but the index expects"),
    "extended": (_extend, "bytes, but the index expects"),
    "header edited": (_edit_header, ".npy header does not match the index"),
    "identity edited": (_edit_identity, IDENTITY),
    "another dataset's blob": (_link_to_another_blob, IDENTITY),
}


@pytest.mark.parametrize("damage", BLOB_DAMAGE)
def test_a_damaged_blob_is_refused_by_every_reader_at_open(tmp_path, datasets, damage) -> None:
    """MmapDataset() itself raises, in the main process: no worker ever maps a blob that does not fit."""
    make_damage, message = BLOB_DAMAGE[damage]
    shutil.copytree(datasets, tmp_path / "tree", symlinks=True)
    ds = tmp_path / "tree" / "ds"
    blob = ds / "data.npy"
    make_damage(blob)
    with pytest.raises(FormatError) as raised:
        MmapDataset(ds)
    assert str(raised.value).startswith(f"{blob}: ") and message in str(raised.value)
    for command in COMMANDS[1:]:
        result = CliRunner().invoke(cli, cli_arguments(command, tmp_path, ds))
        assert result.exit_code == 1 and isinstance(result.exception, SystemExit), (command, result.output)
        lines = [line.removeprefix("Error: ") for line in result.output.splitlines()]
        assert any(line.startswith(f"{blob}: ") and message in line for line in lines), (command, lines)
        assert len(lines) == 1 or command == "verify", (command, lines)
    assert not (tmp_path / "merged").exists()


def test_a_blob_truncated_after_opening_but_before_mapping_is_an_error_in_the_workers(
    tmp_path, datasets
) -> None:
    """Workers map lazily, after checking the size again: a FormatError, never a SIGBUS."""
    shutil.copytree(datasets, tmp_path / "tree", symlinks=True)
    ds = tmp_path / "tree" / "ds"
    dataset = MmapDataset(ds, fields="x")
    _truncate(ds / "data.npy")
    loader = DataLoader(dataset, batch_size=2, num_workers=2, multiprocessing_context="fork")
    raises_from_dataloader(loader, FormatError, "bytes, but the index expects")


def test_a_manifest_is_read_with_bounds_and_checked_json_types(tmp_path, datasets) -> None:
    shutil.copytree(datasets, tmp_path / "tree", symlinks=True)
    manifest = tmp_path / "tree" / "m" / "manifest.json"
    document = json.loads(manifest.read_text())
    cases = {
        "version true": (json.dumps({**document, "version": True}), "manifest version True or keys"),
        "version 1.0": (json.dumps({**document, "version": 1.0}), "manifest version 1.0 or keys"),
        "nested": ("[" * 100_000 + "]" * 100_000, "JSON"),
        "long integer": ('{"version": ' + "9" * 5000 + "}", "digits"),
        "too large": (" " * (16 << 20) + json.dumps(document), "larger than 16777216 bytes"),
    }
    for name, (text, message) in cases.items():
        manifest.write_text(text)
        with pytest.raises(FormatError) as raised:
            MmapDataset(manifest.parent)
        assert str(raised.value).startswith(f"{manifest}: ") and message in str(raised.value), name
