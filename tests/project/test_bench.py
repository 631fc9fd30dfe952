"""The benchmark script runs end to end in its quick mode and writes its three outputs."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from conftest import REPO_ROOT

SCRIPT = REPO_ROOT / "scripts" / "bench.py"


@pytest.mark.long
def test_quick_benchmark_writes_table_json_and_chart(tmp_path) -> None:
    result = subprocess.run(
        [
            sys.executable,
            str(SCRIPT),
            "--quick",
            "--out",
            str(tmp_path / "out"),
            "--workdir",
            str(tmp_path / "w"),
        ],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    table = (tmp_path / "out" / "results.md").read_text()
    for loader in [
        "np.load per item",
        "per-worker LRU cache",
        "Manager().dict() + lock",
        "diskcache",
        "MmapDataset per item",
        "MmapDataset batched, no workers",
        "MmapLoader (thread prefetch)",
        "in-RAM fancy indexing (bound)",
    ]:
        assert f"| fixed | {loader} |" in table, loader
    report = json.loads((tmp_path / "out" / "results.json").read_text())
    assert {row["workload"] for row in report["throughput"]} == {"fixed", "ragged", "compressed"}
    assert all(row["warm_per_s"] > 0 and row["peak_pss_bytes"] > 0 for row in report["throughput"])
    for workload, loader in [
        ("fixed", "in-RAM gather (bound)"),
        ("fixed", "DataLoader, empty batches (hand-off alone)"),
        ("fixed", "MmapLoader, 2 workers (ring)"),
        ("fixed", "light transform: MmapLoader, 2 workers (ring)"),
        ("fixed", "heavy transform: MmapLoader, 2 workers (ring)"),
        ("ragged", "in-RAM padded gather (bound)"),
        ("ragged", "PaddedCollate: MmapLoader, 2 workers (ring)"),
    ]:
        assert f"| {workload} | {loader} |" in table, loader
    assert report["loaders"] and all(row["warm_per_s"] > 0 for row in report["loaders"])
    assert (tmp_path / "out" / "results.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "Conversion against copying the same files, dirty pages written back and " in table
    conversions = {row["workload"]: row for row in report["conversions"]}
    assert set(conversions) == {"fixed", "ragged", "compressed"}
    for row in conversions.values():
        assert row["files"] > 0 and row["cat_cold_s"] > 0 and row["cp_sync_s"] > 0
        assert row["convert_1_cold_s"] > 0 and row["convert_hot_s"] > 0 and row["dataset_bytes"] > 0
        assert f"| {row['workload']} | {row['files']:,} |" in table
    assert conversions["compressed"]["inflate_s"] > 0 and conversions["fixed"]["inflate_s"] == 0
