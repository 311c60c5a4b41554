"""The swap engine's interface: the copies between one device and the host pool that the swap queue
(queue.py) asks for, whatever does them (swap/__init__.py lists the backends).

Every backend keeps the same contract: a copy-out's device storage (`CopyOut.source`) is held until
`release_source` is called (at the swap's release point), which orders the compute stream after the
copy-out, finished or not, before the storage goes; a copy-in's buffer is allocated by the caller's
thread when it is issued (its memory counts from then) and may be read only after `wait_copy_in`; a
host range given back to the pool is written again only after the copy-in reading it has finished.
Copies are storage-level: the whole storage of the packed tensor moves once, however many saved entries
view it; each entry is rebuilt over the restored bytes with its own geometry (storage_views.py).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from regen.runtime.swap.host_pool import HostPool, HostSlot


@dataclass
class CopyOut:
    """A storage on its way to (or already in) the host pool."""

    slot: HostSlot
    done_event: object | None  # the backend's completion event; None when the copy is done (SyncEngine)
    source: torch.Tensor | None  # the device bytes, held until release_source ran (at the release point)
    device: torch.device  # where the storage lives (and comes back to)
    stream: object | None = None  # CUDA: the stream the source was allocated on (current at the pack)


@dataclass
class CopyIn:
    buffer: torch.Tensor  # uint8 device tensor holding the restored storage
    done_event: object | None  # the backend's completion event; None when the copy is done (SyncEngine)
    waited_streams: set = field(default_factory=set)  # CUDA: streams ordered after the copy; else {None}
    stream: object | None = None  # CUDA: the stream the buffer was allocated on (current at the issue)


class SwapEngine:
    """Copies between one device and the host pool (the calls of queue.py). See the module doc."""

    def __init__(self, device: torch.device, pool: HostPool):
        self.device = device
        self.pool = pool

    def copy_out(self, t: torch.Tensor) -> CopyOut:
        """Start copying the whole storage of `t` into a host range."""
        raise NotImplementedError

    def release_source(self, out: CopyOut) -> None:
        """Order the compute stream after the copy-out (waiting for it if it still runs), then let the device
        storage go."""
        out.source = None

    def copy_in(self, out: CopyOut) -> CopyIn:
        """Start copying a host range back into a new device buffer (allocated now, by the caller)."""
        raise NotImplementedError

    def wait_copy_in(self, cin: CopyIn) -> None:
        """Make the consumer wait until the copy-in's bytes are in the buffer."""

    def drop_copy_in(self, cin: CopyIn) -> None:
        """Before the buffer goes back to the allocator, make sure no copy still writes it."""

    def retire(self, out: CopyOut) -> None:
        """The copy-out's host range went back to the pool: nothing waits on its events any more."""

    def close(self) -> None:
        """Stop whatever the backend runs in the background (nothing to stop by default)."""
