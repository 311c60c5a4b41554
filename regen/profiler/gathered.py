"""FSDP's unsharded parameters while a step is recorded (docs/internals.md "Parameters FSDP gathers").

FSDP2 allocates a unit's unsharded parameter storages (a resize, no op) right before its gathering op
(`opnames.gathers_parameters`) writes them, and frees them with another resize, to nothing, after the
unit's forward and after its backward. The recorder hands each storage a gathering op wrote to
`GatheredStorages.gathered`: the memory tracker counts it from then on instead of in the memory at start;
before every op `resharded` returns those resized to nothing since, which the tracker has counted as freed.
"""

from __future__ import annotations

import torch


class GatheredStorages:
    """The storages FSDP gathered parameters into that it has not resharded yet."""

    def __init__(self, tracker) -> None:
        self.tracker = tracker
        self._live: dict[int, object] = {}  # storage id -> StorageInfo (regen.profiler.capture)

    def gathered(self, info) -> None:
        if info.ref is not None and info.id not in self._live:
            self.tracker.gathered(info)
            self._live[info.id] = info

    def resharded(self) -> list:
        """The storages resized to nothing (or freed) since the last call, each told to the tracker."""
        done = [info for info in self._live.values()
                if info.ref.expired() or torch.UntypedStorage._new_with_weak_ptr(info.ref.cdata).nbytes() == 0]
        for info in done:
            self.tracker.resized(info, 0)
            del self._live[info.id]
        return done
