"""The memory this process may use, and whether a dataset's blobs fit in it.

The page cache that holds a dataset is charged to the job's memory cgroup
(Slurm ``--mem``, a Kubernetes pod's limit, a systemd slice), so a dataset
larger than that limit, or than the machine's available memory, cannot stay
cached: every epoch reads it from the disk again, and a shuffled epoch reads
it sample by sample. The smallest of these limits counts: cgroup v2
``memory.max`` (of this process's cgroup and every ancestor), cgroup v1
``memory.limit_in_bytes`` (wherever ``/proc/self/mountinfo`` says they are
mounted), and ``MemAvailable`` of ``/proc/meminfo``; where none can be read
(macOS, Windows), the physical memory. Every file read here is a small
pseudo-file, read at most MAX_READ_NBYTES (mountinfo MAX_MOUNTINFO_NBYTES),
never one that blocks.
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterator
from dataclasses import dataclass

from ..text import human_bytes

# A dataset fits when its blobs take at most this share of the limit: the processes' own
# memory and every other file read count against the same limit.
FIT_FRACTION = 0.8
MAX_READ_NBYTES = 1 << 16
MAX_MOUNTINFO_NBYTES = 1 << 20  # a host with thousands of mounts lists them all
# cgroup v1 writes "no limit" as the largest page-aligned int64; v2 writes "max".
NO_LIMIT_V1 = 1 << 62


@dataclass(frozen=True)
class MemoryLimit:
    """A number of bytes this process may use, and where it comes from (for messages)."""

    nbytes: int
    source: str


def memory_limit(root: str = "/") -> MemoryLimit | None:
    """The smallest limit on the memory this process may use; None where none can be read.

    ``root`` is where ``/proc`` and ``/sys`` are looked for (tests give a fake tree).
    """
    found = [limit for limit in (*_cgroup_limits(root), _mem_available(root)) if limit is not None]
    if not found:
        found = [limit for limit in [_physical_memory()] if limit is not None]
    return min(found, key=lambda limit: limit.nbytes) if found else None


def fits_in_memory(nbytes: int, limit: MemoryLimit | None) -> bool:
    """Whether ``nbytes`` of blobs can stay in the page cache under ``limit`` (see FIT_FRACTION)."""
    return limit is None or nbytes <= limit.nbytes * FIT_FRACTION


def _read_small(path: str, limit: int = MAX_READ_NBYTES) -> str | None:
    """The text of a small pseudo-file, at most ``limit`` bytes of it, or None if it cannot be read."""
    try:
        with open(path, "rb") as file:
            return file.read(limit).decode("utf-8", "replace")
    except (OSError, ValueError):
        return None


# Where cgroup file systems are mounted when /proc/self/mountinfo does not say.
DEFAULT_MOUNTS = {
    "cgroup2": [("sys/fs/cgroup", "/"), ("sys/fs/cgroup/unified", "/")],
    "memory": [("sys/fs/cgroup/memory", "/")],
}


def _cgroup_limits(root: str) -> Iterator[MemoryLimit | None]:
    """The memory limits of this process's cgroups, v2 and v1, each the smallest along its path."""
    text = _read_small(os.path.join(root, "proc/self/cgroup")) or ""
    mounts = _cgroup_mounts(root)
    for line in text.splitlines():
        number, controllers, path = (line.split(":", 2) + ["", ""])[:3]
        if number == "0" and controllers == "":
            for mount, mount_root in mounts["cgroup2"]:
                yield _smallest_on_path(os.path.join(root, mount), _below(path, mount_root), "memory.max")
        elif "memory" in controllers.split(","):
            for mount, mount_root in mounts["memory"]:
                yield _smallest_on_path(
                    os.path.join(root, mount), _below(path, mount_root), "memory.limit_in_bytes"
                )


def _cgroup_mounts(root: str) -> dict[str, list[tuple[str, str]]]:
    """Where the cgroup v2 hierarchy and v1's memory controller are mounted, with the cgroup each
    mount shows as its root, from /proc/self/mountinfo (``DEFAULT_MOUNTS`` where it names none)."""
    found: dict[str, list[tuple[str, str]]] = {"cgroup2": [], "memory": []}
    text = _read_small(os.path.join(root, "proc/self/mountinfo"), MAX_MOUNTINFO_NBYTES) or ""
    for line in text.splitlines():
        fields, _, after = line.partition(" - ")
        before = fields.split(" ")
        kind = after.split(" ")
        if len(before) < 5 or len(kind) < 3:
            continue
        mount_root, mount_point = _unescape(before[3]), _unescape(before[4]).lstrip("/")
        if kind[0] == "cgroup2":
            found["cgroup2"].append((mount_point, mount_root))
        elif kind[0] == "cgroup" and "memory" in kind[2].split(","):
            found["memory"].append((mount_point, mount_root))
    return {key: mounts or DEFAULT_MOUNTS[key] for key, mounts in found.items()}


def _unescape(path: str) -> str:
    """A mountinfo path with its octal escapes (``\\040`` for a space) undone."""
    return re.sub(r"\\([0-7]{3})", lambda m: chr(int(m.group(1), 8)), path)


def _below(cgroup: str, mount_root: str) -> str:
    """The cgroup's path inside a mount that shows ``mount_root`` as its root."""
    mount_root = mount_root.rstrip("/")
    if mount_root and (cgroup == mount_root or cgroup.startswith(mount_root + "/")):
        return cgroup[len(mount_root) :] or "/"
    return cgroup


def _smallest_on_path(mount: str, cgroup: str, name: str) -> MemoryLimit | None:
    """The smallest ``name`` limit from the cgroup up to the mount's root (a container sees its
    own cgroup as the root, so a path that is not there is looked for from the root too)."""
    limits = []
    for directory in _ancestors(mount, cgroup):
        value = _parse_limit(_read_small(os.path.join(directory, name)))
        if value is not None:
            limits.append(MemoryLimit(value, os.path.join(directory, name)))
    return min(limits, key=lambda limit: limit.nbytes) if limits else None


def _ancestors(mount: str, cgroup: str) -> list[str]:
    parts = [part for part in cgroup.split("/") if part and part not in (".", "..")]
    return [os.path.join(mount, *parts[:depth]) for depth in range(len(parts), -1, -1)]


def _parse_limit(text: str | None) -> int | None:
    """A limit file's number of bytes; None for none ("max", v1's huge value) or unreadable text."""
    if text is None or not text.strip().isdigit() or len(text.strip()) > 19:
        return None
    value = int(text.strip())
    return value if 0 < value < NO_LIMIT_V1 else None


def _mem_available(root: str) -> MemoryLimit | None:
    text = _read_small(os.path.join(root, "proc/meminfo")) or ""
    for line in text.splitlines():
        name, _, rest = line.partition(":")
        fields = rest.split()
        if name == "MemAvailable" and len(fields) == 2 and fields[0].isdigit() and fields[1] == "kB":
            return MemoryLimit(int(fields[0][:16]) * 1024, "MemAvailable in /proc/meminfo")
    return None


def _physical_memory() -> MemoryLimit | None:
    try:
        nbytes = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (AttributeError, ValueError, OSError):
        return None
    return MemoryLimit(nbytes, "the physical memory") if nbytes > 0 else None


def larger_than_memory(where: str, nbytes: int, limit: MemoryLimit) -> str:
    """The one line that says a dataset does not fit, both sizes, and what to do."""
    return (
        f"{where}: its {human_bytes(nbytes)} are more than {FIT_FRACTION:.0%} of the "
        f"{human_bytes(limit.nbytes)} this process may use ({limit.source}), too much for the page "
        "cache to keep beside the processes' own memory, so every epoch reads it from the disk; "
        "samples are read exactly, each batch's at once, and MmapLoader issues the next batches' "
        "reads ahead; with a DataLoader, sampler=ShuffleSampler(ds) keeps the next samples' reads "
        "in flight; to shuffle at the disk's sequential speed, "
        "sampler=BlockShuffleSampler(len(ds), 256, interleave='auto', dataset=ds) (as many "
        "blocks of 256 samples at a time as two windows fit in a quarter of this memory); or "
        "raise the limit"
    )
