"""A real torchrun launch: 2 ranks (gloo, CPU) x 2 DataLoader workers over a 2-part dataset."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
from conftest import write_samples

from npz2mmap.write.conversion import convert
from npz2mmap.write.merge import merge

TORCHRUN = Path(sys.executable).parent / "torchrun"

TRAIN = textwrap.dedent("""
    import sys
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel
    from torch.utils.data import DataLoader, DistributedSampler
    from npz2mmap import MmapDataset

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    ds = MmapDataset(sys.argv[1], fields=["x", "id"])
    sampler = DistributedSampler(ds, shuffle=True, seed=1)
    loader = DataLoader(ds, batch_size=4, sampler=sampler, num_workers=2, persistent_workers=True)
    model = DistributedDataParallel(torch.nn.Linear(6, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    for epoch in range(2):
        sampler.set_epoch(epoch)
        seen = []
        for batch in loader:
            loss = model(batch["x"].reshape(-1, 6)).square().mean()
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            for i, x in zip(batch["id"].tolist(), batch["x"]):
                assert torch.equal(x, torch.from_numpy(ds[i]["x"])), i
            seen += batch["id"].tolist()
        everyone = [None] * world
        dist.all_gather_object(everyone, seen)
        if rank == 0:
            ids = sorted(i for part in everyone for i in part)
            assert ids == list(range(len(ds))), ids
            print(f"epoch {epoch}: {len(ids)} samples, each exactly once, over {world} ranks", flush=True)
    dist.destroy_process_group()
""")


def test_torchrun_ddp_sees_every_sample_once_per_epoch(tmp_path) -> None:
    rng = np.random.default_rng(3)
    write_samples(
        tmp_path / "src", [{"x": rng.random((2, 3), dtype=np.float32), "id": np.int64(i)} for i in range(48)]
    )
    for i in range(2):
        convert([tmp_path / "src"], tmp_path / "data", part=(i, 2), workers=1)
    merge(sorted((tmp_path / "data").iterdir()), tmp_path / "data")
    (tmp_path / "train.py").write_text(TRAIN)
    result = subprocess.run(
        [
            str(TORCHRUN),
            "--standalone",
            "--nproc_per_node=2",
            str(tmp_path / "train.py"),
            str(tmp_path / "data"),
        ],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.splitlines() == [
        "epoch 0: 48 samples, each exactly once, over 2 ranks",
        "epoch 1: 48 samples, each exactly once, over 2 ranks",
    ]
