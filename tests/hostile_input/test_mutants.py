"""Hundreds of damaged copies of a real dataset, read every way a user can.

Through MmapDataset with 2 DataLoader workers and through every command, each
mutant must give the original data or a FormatError (one-line errors from the
CLI): never a hang, never another exception, never different data with exit
0. Forged mutants (index and identity rewritten together) may read other
data but must still fail cleanly. The probe runs in subprocesses under a
memory limit. A long test (``-m long``): 60 index edits, then 600.
"""

from __future__ import annotations

import json
import os
import resource
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from conftest import TESTS_DIR
from mutants import Mutant, all_mutants, make_base, materialise

pytestmark = pytest.mark.long  # a minute and a half of mutant datasets, each read by every command

PROBE = TESTS_DIR / "mutant_probe.py"
MEMORY_LIMIT_NBYTES = 8 << 30


def _limit_memory() -> None:
    resource.setrlimit(resource.RLIMIT_AS, (MEMORY_LIMIT_NBYTES, MEMORY_LIMIT_NBYTES))


def run_probe(paths: list[Path]) -> list[dict]:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(PROBE.parent), *sys.path])}
    result = subprocess.run(
        [sys.executable, str(PROBE), *map(str, paths)],
        capture_output=True,
        text=True,
        timeout=60 + 20 * len(paths),
        preexec_fn=_limit_memory,
        env=env,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    return [json.loads(line) for line in result.stdout.splitlines()]


@pytest.fixture(scope="module", params=[60, 600], ids=["60-edits", "600-edits"])
def probed(tmp_path_factory, request) -> tuple[dict, list[tuple[Mutant, dict]]]:
    root = tmp_path_factory.mktemp("mutants")
    base = make_base(root)
    mutants = all_mutants(base, index_edits=request.param)
    paths = [materialise(base, m, root / f"m{k:04d}") for k, m in enumerate(mutants)]
    chunks = [paths[k::2] for k in range(2)]
    with ThreadPoolExecutor(2) as pool:
        reports = [r for chunk in pool.map(run_probe, [[base], *chunks]) for r in chunk]
    by_path = {r["path"]: r for r in reports}
    return by_path[str(base)], [(m, by_path[str(p)]) for m, p in zip(mutants, paths, strict=True)]


COMMANDS = ("inspect", "sample", "verify", "warm", "merge")


def test_the_unharmed_dataset_reads_and_every_command_succeeds(probed) -> None:
    base, _ = probed
    assert base["read"].startswith("data:")
    assert {name: base[name]["exit"] for name in COMMANDS} == dict.fromkeys(COMMANDS, 0)


def test_no_mutant_hangs_or_crashes_any_reader_or_command(probed) -> None:
    _, results = probed
    failures = []
    for mutant, report in results:
        if report["read"] == "hang" or report["read"].startswith("crash:"):
            failures.append((mutant.name, "read", report["read"]))
        for name in (*COMMANDS, "merged-verify"):
            outcome = report.get(name)
            if outcome is None:
                continue
            if "crash" in outcome or "hang" in outcome or outcome["exit"] not in (0, 1):
                failures.append((mutant.name, name, outcome))
            elif outcome["exit"] == 1 and not outcome["output"].splitlines()[-1].startswith("Error: "):
                failures.append((mutant.name, name, outcome["output"]))
    assert failures == []


def test_no_mutant_reads_other_data_without_an_error(probed) -> None:
    base, results = probed
    failures = []
    for mutant, report in results:
        if mutant.forged:
            continue
        # Readers do not recompute sample checksums (verify does): a changed data byte reads as it is.
        changed_data = mutant.name.startswith("blob-flip-")
        if report["read"] not in (base["read"], "FormatError", "FormatError at open") and not changed_data:
            failures.append((mutant.name, "read returned other data"))
        if report["verify"]["exit"] == 0 and report["read"] != base["read"]:
            failures.append((mutant.name, "verify passed a dataset that reads differently"))
        if report["warm"]["exit"] == 0 and report["read"] == "FormatError at open":
            failures.append((mutant.name, "warm passed a dataset that does not open"))
    assert failures == []


def test_verify_finds_every_changed_blob_byte(probed) -> None:
    _, results = probed
    missed = [m.name for m, r in results if m.name.startswith("blob-") and r["verify"]["exit"] == 0]
    assert missed == []
