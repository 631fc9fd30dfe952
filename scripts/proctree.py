"""A process and its descendants, from /proc (Linux): shared by bench.py and outofcore.py,
which must not import torch for it."""

from __future__ import annotations

import os


def process_tree(pid: int) -> list[int]:
    """``pid`` and every live descendant, read from /proc/PID/task/*/children."""
    pids, pending = [], [pid]
    while pending:
        current = pending.pop()
        pids.append(current)
        try:
            for task in os.listdir(f"/proc/{current}/task"):
                with open(f"/proc/{current}/task/{task}/children") as fp:
                    pending.extend(int(c) for c in fp.read().split())
        except OSError:
            continue
    return pids
