"""Run in a subprocess by test_mutants.py: read each mutant every way a user can, one JSON line each.

For each dataset directory given, reads every sample through MmapDataset and
a 2-worker DataLoader, then runs inspect, inspect --sample 0, verify, warm
and merge --copy in process. An alarm ends any step that takes too long, so
a hang is reported as such instead of stopping the run.
"""

from __future__ import annotations

import hashlib
import json
import signal
import sys
import tempfile
import traceback
from pathlib import Path
from typing import Any

from click.testing import CliRunner
from torch.utils.data import DataLoader

from npz2mmap import MmapDataset
from npz2mmap.cli.commands import cli
from npz2mmap.errors import FormatError

STEP_SECONDS = 30


class Hang(Exception):
    pass


def _alarm(signum: int, frame: Any) -> None:
    raise Hang()


def raw_bytes(sample: dict) -> dict:
    return {name: (array.dtype.str, array.shape, array.tobytes()) for name, array in sample.items()}


def no_collate(sample: Any) -> Any:
    return sample


def read_all(path: str) -> str:
    """A digest of every sample's bytes through 2 DataLoader workers, or what went wrong."""
    opened = outcome(lambda: MmapDataset(path, transform=raw_bytes), "FormatError at open")
    if not isinstance(opened, MmapDataset):
        return opened
    return outcome(lambda: digest_of(opened), "FormatError")


def digest_of(ds: MmapDataset) -> str:
    loader = DataLoader(ds, batch_size=None, num_workers=2, collate_fn=no_collate, timeout=STEP_SECONDS)
    digest = hashlib.sha256()
    for sample in loader:
        for name in sorted(sample):
            digest.update(repr(sample[name]).encode())
    return "data:" + digest.hexdigest()


def outcome(step: Any, format_error: str) -> Any:
    """What ``step()`` returns, or a word for how it failed."""
    try:
        return step()
    except FormatError:
        return format_error
    except Hang:
        return "hang"
    except BaseException as exc:  # noqa: BLE001 - the probe reports anything else as a crash
        return f"crash:{type(exc).__name__}:{str(exc)[:200]}"


def run_command(*args: str) -> dict:
    result = CliRunner().invoke(cli, list(args))
    outcome = {"exit": result.exit_code, "output": result.output[-2000:]}
    if result.exception is not None and not isinstance(result.exception, SystemExit):
        if isinstance(result.exception, Hang):
            outcome["hang"] = True
        else:
            outcome["crash"] = "".join(traceback.format_exception(result.exception))[-2000:]
    return outcome


def probe(path: str) -> dict:
    report: dict[str, Any] = {"path": path}
    signal.alarm(STEP_SECONDS)
    try:
        report["read"] = read_all(path)
    finally:
        signal.alarm(0)
    with tempfile.TemporaryDirectory() as scratch:
        commands = {
            "inspect": ["inspect", path],
            "sample": ["inspect", path, "--sample", "0"],
            "verify": ["verify", path, "-q"],
            "warm": ["warm", path, "-q"],
            "merge": ["merge", path, "-o", str(Path(scratch) / "merged"), "--copy", "-q"],
        }
        for name, args in commands.items():
            signal.alarm(STEP_SECONDS)
            try:
                report[name] = run_command(*args)
            finally:
                signal.alarm(0)
        if report["merge"]["exit"] == 0:
            report["merged-verify"] = run_command("verify", str(Path(scratch) / "merged"), "-q")
    return report


def main() -> None:
    signal.signal(signal.SIGALRM, _alarm)
    for path in sys.argv[1:]:
        print(json.dumps(probe(path)), flush=True)


if __name__ == "__main__":
    main()
