"""The built-in example of scripts/convert.sh.

python scripts/example.py make DIR [--count N]   write N sample .npz files
python scripts/example.py load DATASET           iterate it with a 2-worker DataLoader
"""

from __future__ import annotations

import argparse
import json
import os
import time

import numpy as np

# Why the first epoch is slower: the rates differ by tens of times, and say nothing wrong.
EPOCH_NOTES = (
    "(cold: starts the 2 workers, which import torch, and reads the data from disk)",
    "(warm: the workers are running and the data is in the page cache)",
)


def make(out_dir: str, count: int) -> None:
    """Image-like input, a label and a ragged token sequence per file, from a fixed seed."""
    rng = np.random.default_rng(0)
    os.makedirs(out_dir, exist_ok=True)
    for i in range(count):
        np.savez(
            os.path.join(out_dir, f"sample_{i:06d}.npz"),
            input=rng.standard_normal((3, 64, 64), dtype=np.float32),
            label=np.int64(rng.integers(10)),
            tokens=rng.integers(0, 50_000, size=int(rng.integers(8, 256)), dtype=np.int32),
        )
    print(f"wrote {count:,} .npz files to {out_dir}")


def load(dataset: str) -> None:
    """Iterate two epochs with 2 spawned workers and check every sample against its source."""
    from torch.utils.data import DataLoader

    from npz2mmap import MmapDataset

    ds = MmapDataset(dataset, fields=["input", "label"])
    loader = DataLoader(
        ds,
        batch_size=64,
        shuffle=True,
        num_workers=2,
        multiprocessing_context="spawn",
        persistent_workers=True,
    )
    with open(os.path.join(dataset, "sources.jsonl"), encoding="utf-8") as fp:
        sources = [json.loads(line) for line in fp]
    for epoch in range(2):
        started = time.perf_counter()
        seen = 0
        first_shape = None
        for batch in loader:
            seen += len(batch["label"])
            first_shape = first_shape or tuple(batch["input"].shape)  # the last batch may be short
        rate = seen / (time.perf_counter() - started)
        print(
            f"epoch {epoch}: {seen:,} samples, {rate:,.0f} samples/s, "
            f"input batch {first_shape} {EPOCH_NOTES[min(epoch, 1)]}"
        )
    for i in (0, len(ds) // 2, len(ds) - 1):
        with np.load(sources[i], allow_pickle=False) as npz:
            assert np.array_equal(ds[i]["input"], npz["input"]), f"sample {i} differs from {sources[i]}"
    print("DataLoader returned every sample; spot checks match the source files")


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    commands = parser.add_subparsers(dest="command", required=True)
    make_cmd = commands.add_parser("make")
    make_cmd.add_argument("out_dir")
    make_cmd.add_argument("--count", type=int, default=1000)
    load_cmd = commands.add_parser("load")
    load_cmd.add_argument("dataset")
    args = parser.parse_args()
    if args.command == "make":
        make(args.out_dir, args.count)
    else:
        load(args.dataset)


if __name__ == "__main__":
    main()
