"""Where a MmapLoader is in its passes, as state_dict() saves it and load_state_dict() takes it back.

A state names the pass (epoch, seed), the batches yielded in it, the settings that fix the
order (batch size, sample count, shuffle, drop_last, the samplers' own settings) and the
samplers' states; a loader of other settings refuses it rather than resume a different order.
"""

from __future__ import annotations

import contextlib
import zlib
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from torch.utils.data import (
    BatchSampler,
    DistributedSampler,
    RandomSampler,
    SubsetRandomSampler,
    WeightedRandomSampler,
)

from .samplers import state_int

if TYPE_CHECKING:  # named in annotations only: the loader imports this module
    from .loader import MmapLoader


class Position:
    """Where the loader stands in its current pass, for state_dict and resuming."""

    def __init__(self) -> None:
        self.pass_epoch: int | None = None  # None: no pass begun and left unfinished
        self.batches_yielded = 0
        self.sampler_states: dict[str, Any] = {}
        self.resume_at = 0
        self.loaded: dict[str, Any] | None = None
        self.set_aside: dict[str, Any] | None = None  # a loaded state another epoch set aside
        # Per sampler, after a finished pass: its state then, and as that pass began.
        self.ended_sampler_states: dict[str, tuple[Any, Any]] = {}

    def start(self, loader: MmapLoader) -> int:
        """Begin a pass; return how many batches it skips (those a loaded state had yielded).

        A sampler given another epoch since the state was loaded (``sampler.set_epoch``, as
        ``loader.set_epoch`` does) drops the resume: its pass is a whole new epoch.
        """
        skip = self.resume_at if self.loaded is None or not _samplers_moved(loader, self.loaded) else 0
        self.resume_at, self.loaded, self.set_aside = 0, None, None
        self.pass_epoch, self.batches_yielded, self.sampler_states = loader.epoch, skip, {}
        return skip

    def choose_epoch(self, loader: MmapLoader, epoch: int) -> None:
        """``loader.set_epoch``: of the calls before a pass, the epoch chosen last decides, as
        for the samplers: a loaded state resumes if it is its epoch, and nothing otherwise."""
        state = self.loaded if self.loaded is not None else self.set_aside
        if state is not None and epoch == state.get("epoch"):
            self.loaded, self.set_aside = state, None
            self.resume_at = int(state.get("batches_yielded", 0))
        elif epoch != loader.epoch or state is not None:
            self.set_aside = state
            self.resume_at, self.loaded = 0, None

    def finish(self, loader: MmapLoader) -> None:
        """The pass is over: remember the samplers' states at its start and end (see ``state``)."""
        self.pass_epoch, self.batches_yielded = None, 0
        self.ended_sampler_states = {
            key: (sampler.state_dict(), self.sampler_states.get(key))
            for key, sampler in samplers_of(loader)
            if hasattr(sampler, "state_dict")
        }

    def note_sampler_states(self, loader: MmapLoader) -> None:
        """The samplers' states as this pass begins (they have just been iterated from the start);
        of a sampler with no state of its own but an epoch (DistributedSampler), that epoch."""
        for key, sampler in samplers_of(loader):
            # Ours begin a pass at its first item, not yet drawn: their state is the next pass's.
            ours = hasattr(sampler, "next_pass_state")
            state = sampler.next_pass_state() if ours else _sampler_state(sampler)
            if state is not None:
                self.sampler_states[key] = state

    def state(self, loader: MmapLoader) -> dict[str, Any]:
        if self.loaded is not None:
            return dict(self.loaded)
        if self.pass_epoch is None:
            return {
                "epoch": loader.epoch,
                "seed": loader.seed,
                "batches_yielded": 0,
                **_settings(loader),
                **self._next_pass_sampler_states(loader),
            }
        return {
            "epoch": self.pass_epoch,
            "seed": loader.seed,
            "batches_yielded": self.batches_yielded,
            **_settings(loader),
            **self.sampler_states,
        }

    def _next_pass_sampler_states(self, loader: MmapLoader) -> dict[str, Any]:
        """Between passes, each sampler's state as the next pass will begin it.

        A sampler untouched since it finished a pass begins the next one as it
        began that one (its own state counts the items it yielded); one given
        another epoch or state since then says so itself.
        """
        states = {}
        for key, sampler in samplers_of(loader):
            if hasattr(sampler, "next_pass_state"):  # ours: it knows which epoch it takes next
                states[key] = sampler.next_pass_state()
            elif hasattr(sampler, "state_dict"):
                now = sampler.state_dict()
                at_end, at_start = self.ended_sampler_states.get(key, (None, None))
                states[key] = at_start if at_start is not None and now == at_end else now
            elif (state := _sampler_state(sampler)) is not None:
                states[key] = state
        return states

    def load(self, loader: MmapLoader, state: dict[str, Any]) -> None:
        if not isinstance(state, dict):
            raise ValueError(f"loader state must be a dict, not {type(state).__name__}")
        _refuse_another_kind_of_state(state)
        epoch, seed, batches_yielded = (
            state_int(state, key, "loader state") for key in ("epoch", "seed", "batches_yielded")
        )
        unknown = sorted(map(str, state.keys() - _STATE_KEYS - {key for key, _ in samplers_of(loader)}))
        if unknown:
            raise ValueError(
                f"loader state has {', '.join(map(repr, unknown))}, which this loader does not write "
                "(a state of another loader, or of other samplers); resume with the loader it was saved from"
            )
        _check_same_settings(loader, state)  # before the seed: another shuffle says more than its seed
        if seed != loader.seed and loader.seed_given and loader.shuffle:  # else it decides nothing
            raise ValueError(f"loader state has seed {seed}, this loader has seed {loader.seed}")
        if epoch < 0:
            raise ValueError(f"loader state: epoch {epoch} is negative")
        if batches_yielded < 0:
            raise ValueError(f"loader state: batches_yielded {batches_yielded} is negative")
        if batches_yielded:
            _refuse_unrepeatable_samplers(loader)
        _check_within_the_pass(loader, batches_yielded)
        loader.epoch = epoch
        loader.seed = seed  # a loader given no seed drew one: the state's is the order's
        for key, sampler in samplers_of(loader):
            saved = state.get(key)
            sampler_epoch = saved.get("epoch") if isinstance(saved, dict) else None
            if hasattr(sampler, "set_epoch"):  # DistributedSampler: its order is the epoch's
                sampler.set_epoch(sampler_epoch if type(sampler_epoch) is int else epoch)
            if key in state and hasattr(sampler, "load_state_dict"):
                # its own epoch and position; set first, the state's epoch is the one set last
                sampler.load_state_dict(saved)
        self.resume_at, self.loaded = batches_yielded, dict(state)


def _refuse_another_kind_of_state(state: dict[str, Any]) -> None:
    """ValueError naming what a state is, for a sampler's or a StatefulDataLoader's given to MmapLoader."""
    if "batches_yielded" in state:
        return
    if "yielded" in state:
        kind = state.get("sampler")
        whose = f"a {kind}'s" if isinstance(kind, str) and kind else "a sampler's"
        raise ValueError(
            f"loader state is {whose} state, not a MmapLoader's: load it into that sampler, or save and "
            "load loader.state_dict()"
        )
    if any(str(key).startswith("_") for key in state):
        raise ValueError(
            "loader state is another loader's (torchdata's StatefulDataLoader's?), not a MmapLoader's: "
            "resume with the loader the state was saved from"
        )


def _check_within_the_pass(loader: MmapLoader, batches_yielded: int) -> None:
    """ValueError for a state past the end of its pass (where the loader knows its length)."""
    with contextlib.suppress(TypeError):  # a sampler of no length
        batches = len(loader)
        if batches_yielded > batches:
            raise ValueError(
                f"loader state: batches_yielded {batches_yielded} is past the end of a pass of "
                f"{batches} batches; resume with the loader the state was saved from"
            )


# What a loader's state holds besides its samplers' states (saved under _samplers' keys).
_STATE_KEYS = {"epoch", "seed", "batches_yielded", "batch_size", "num_samples", "shuffle", "drop_last"} | {
    "sampler_settings"
}


def _sampler_state(sampler: Any) -> dict[str, Any] | None:
    """A sampler's state to save: its own, or for one with only an epoch, ``{"epoch": e}``."""
    if hasattr(sampler, "state_dict"):
        return sampler.state_dict()
    epoch = getattr(sampler, "epoch", None)
    return {"epoch": epoch} if hasattr(sampler, "set_epoch") and type(epoch) is int else None


def _samplers_moved(loader: MmapLoader, loaded: dict[str, Any]) -> bool:
    """Whether a sampler's epoch differs from the one the loaded state gave it."""
    for key, sampler in samplers_of(loader):
        saved, now = loaded.get(key), _sampler_state(sampler)
        if isinstance(saved, dict) and isinstance(now, dict) and saved.get("epoch") != now.get("epoch"):
            return True
    return False


# What a state's batches mean: a state loaded into a loader of other settings would skip other samples.
_SETTINGS = ("batch_size", "num_samples", "shuffle", "drop_last")


def _settings(loader: MmapLoader) -> dict[str, Any]:
    return {
        "batch_size": loader.batch_size,
        "num_samples": len(loader.dataset),
        "shuffle": loader.shuffle,
        "drop_last": loader.drop_last,
        # a BatchSampler's own sampler is in its settings already (states of earlier versions lack it)
        "sampler_settings": {
            key: sampler_settings(sampler)
            for key, sampler in samplers_of(loader)
            if key != "batch_sampler.sampler"
        },
    }


def sampler_settings(sampler: Any) -> dict[str, Any]:
    """What makes a sampler's order, as far as can be seen from outside: its type, a
    DistributedSampler's world, rank, seed, shuffle and drop_last, a BatchSampler's batch size
    (and its sampler's), a sequence's length and a checksum of its indices, another's length.
    A sampler with a state_dict of its own names its settings there."""
    out: dict[str, Any] = {"type": type(sampler).__name__}
    if isinstance(sampler, BatchSampler):
        out.update(batch_size=sampler.batch_size, drop_last=sampler.drop_last)
        out["sampler"] = sampler_settings(sampler.sampler)
    elif isinstance(sampler, DistributedSampler):
        out.update(num_replicas=sampler.num_replicas, rank=sampler.rank, seed=sampler.seed)
        out.update(shuffle=sampler.shuffle, drop_last=sampler.drop_last, length=len(sampler))
    elif hasattr(sampler, "state_dict"):
        pass
    elif isinstance(sampler, (Sequence, np.ndarray, torch.Tensor)) and not isinstance(sampler, (str, bytes)):
        with contextlib.suppress(TypeError, ValueError, OverflowError):  # indices of another kind
            values = np.asarray(sampler, dtype=np.int64)
            out.update(length=len(values), crc32=zlib.crc32(values.astype("<i8").tobytes()))
    elif hasattr(sampler, "__len__"):
        with contextlib.suppress(TypeError):
            out["length"] = len(sampler)
    return out


def _check_same_settings(loader: MmapLoader, state: dict[str, Any]) -> None:
    """ValueError when the state was saved by a loader of other settings, or over samplers of
    other settings (a state without them, from an earlier version, is taken as it is)."""
    for key, value in _settings(loader).items():
        if key == "sampler_settings" and key in state:
            _check_same_samplers(state[key], value)
        elif key in state and state[key] != value:
            raise ValueError(
                f"loader state has {key} {state[key]!r}, this loader has {value!r}: its batches would be "
                "other samples; resume with the loader the state was saved from"
            )


def _check_same_samplers(saved: Any, now: dict[str, Any]) -> None:
    if not isinstance(saved, dict):
        raise ValueError(f"loader state: 'sampler_settings' must be a dict, found {saved!r}")
    for key in sorted(saved.keys() | now.keys()):
        was, is_now = saved.get(key), now.get(key)
        if was != is_now:
            raise ValueError(
                f"loader state was saved over {_described(key, was)}, this loader has "
                f"{_described(key, is_now)}: its batches would be other samples; resume with the "
                "sampler the state was saved with"
            )


def _described(key: str, settings: Any) -> str:
    if not isinstance(settings, dict):
        return f"no {key}"
    shown = ", ".join(f"{k}={v!r}" for k, v in settings.items() if k != "type")
    return f"{key}={settings.get('type')}({shown})"


# torch's samplers that draw a new order each pass and keep no state: a resume cannot continue one.
_RANDOM_SAMPLERS = (RandomSampler, SubsetRandomSampler, WeightedRandomSampler)


def _refuse_unrepeatable_samplers(loader: MmapLoader) -> None:
    """ValueError for a mid-pass resume over a sampler whose order cannot be drawn again."""
    for _, sampler in samplers_of(loader):
        inner = getattr(sampler, "sampler", sampler)  # a BatchSampler's
        for candidate in (sampler, inner):
            if isinstance(candidate, _RANDOM_SAMPLERS) and not hasattr(candidate, "state_dict"):
                raise ValueError(
                    f"{type(candidate).__name__} draws a new order each pass and keeps no state, so a resume "
                    "mid-pass cannot continue its order: use shuffle=True (with seed=), BlockShuffleSampler, "
                    "or a sampler with state_dict() (torchdata's StatefulDataLoader has such samplers)"
                )


def samplers_of(loader: MmapLoader) -> list[tuple[str, Any]]:
    """The loader's samplers by the key their state is saved under: its sampler or batch sampler,
    and a torch BatchSampler's own sampler (whose epoch and state make the batches' order)."""
    found = [
        (key, s)
        for key, s in (("sampler", loader.sampler), ("batch_sampler", loader.batch_sampler))
        if s is not None
    ]
    if isinstance(loader.batch_sampler, BatchSampler):
        found.append(("batch_sampler.sampler", loader.batch_sampler.sampler))
    return found
