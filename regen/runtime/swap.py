"""Swap: copy a saved tensor's storage to host memory in forward and back to the device in backward.

* `HostPool`: host memory allocated once, by `regen.apply`, its first chunk the plan's `host_pool_bytes`
  (pinned for a model on CUDA: allocating pinned memory per tensor forces a device sync; a pool made
  pageable is made again, pinned, at the first CUDA copy-out: a model moved to the GPU after apply), and handed out as byte ranges (`formats.plan_rules.host_range_bytes`: rounded up to
  512 bytes, as the plan sizes it), first fit; it grows by whole chunks when a step needs more than it
  holds, and every range goes back to it when its step is done, so later steps reuse it. Its ranges
  and pending read events are taken and given back under a lock (engines of several devices share it).
* `SwapEngine`: the copies, one interface (the calls swap_queue.py makes) with three backends, chosen
  by `new_engine`: `CudaEngine` (swap_cuda.py: a device-to-host and a host-to-device stream, events),
  `EmulatedEngine` (link.py: a CPU device with `regen.apply(..., emulate_link=True)`: one copy thread
  per direction at the plan's bandwidth, events the compute thread waits on) and `SyncEngine` (a CPU
  device without an emulated link: `copy_` at once, no events).

Every backend keeps the same contract: a copy-out's device storage (`CopyOut.source`) is held until
`release_source` is called (at the swap's release point, swap_queue.py), which orders the compute stream
after the copy-out, finished or not, before the storage goes; a copy-in's buffer is allocated by the caller's thread
when it is issued (its memory counts from then) and may be read only after `wait_copy_in`; a host range
given back to the pool is written again only after the copy-in reading it has finished
(`HostSlot.last_read_event`, `HostPool.pending_read_events`).

Copies are storage-level: the whole storage of the packed tensor moves once, however many saved entries
view it; each entry is rebuilt over the restored bytes with its own geometry (see `view_of`).
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import NamedTuple

import torch

from regen.formats.plan_rules import host_range_bytes

MIN_CHUNK_BYTES = 1 << 20  # a pool never grows by less than this


def host_memory(nbytes: int, pinned: bool) -> torch.Tensor:
    """`nbytes` of host memory for a chunk of the pool (page-locked when `pinned`)."""
    return torch.empty(nbytes, dtype=torch.uint8, pin_memory=pinned)


def storage_bytes_view(t: torch.Tensor) -> torch.Tensor:
    """A uint8 tensor over the whole storage of `t` (all its views' bytes)."""
    storage = t.untyped_storage()
    return torch.empty(0, dtype=torch.uint8, device=t.device).set_(storage, 0, (storage.nbytes(),), (1,))


def view_of(base: torch.Tensor, geometry: "Geometry") -> torch.Tensor:
    """The tensor with `geometry` over the storage of `base` (dtype may differ from base's): `base` itself when
    it already is that view and has no autograd history (a replay's packed tensor, most entries)."""
    if (base.dtype == geometry.dtype and not base.requires_grad and base.shape == geometry.size
            and base.stride() == geometry.stride and base.storage_offset() == geometry.storage_offset):
        return base
    return torch.empty(0, dtype=geometry.dtype, device=base.device).set_(
        base.untyped_storage(), geometry.storage_offset, geometry.size, geometry.stride)


class Geometry(NamedTuple):
    """How a saved entry views its storage (a named tuple: one is made per swapped or dropped entry)."""

    size: tuple[int, ...]
    stride: tuple[int, ...]
    storage_offset: int
    dtype: torch.dtype

    @staticmethod
    def of(t: torch.Tensor) -> "Geometry":
        return Geometry(tuple(t.shape), t.stride(), t.storage_offset(), t.dtype)


@dataclass
class _Chunk:
    tensor: torch.Tensor  # uint8 host memory
    free: list[list[int]]  # sorted [start, end) free ranges


@dataclass
class HostSlot:
    """A byte range of the host pool holding one swapped storage."""

    chunk: _Chunk
    start: int
    nbytes: int
    reserved_bytes: int
    tensor: torch.Tensor  # uint8 view of the range
    # the last copy reading this range (a copy-in's event); whoever writes the range next waits on it
    last_read_event: object | None = None


class HostPool:
    """Host memory for swapped storages, allocated once and reused every step."""

    def __init__(self, initial_bytes: int = 0, pin_memory: bool = False):
        self.initial_bytes = initial_bytes  # the first chunk's size: the plan's host_pool_bytes
        self.pin_memory = pin_memory  # also set by the first CUDA engine (use_pinned_memory)
        self.chunks: list[_Chunk] = []
        self.checked_out_bytes = 0
        self.grow_count = 0
        # events of copy-ins that read ranges since given back; the next copy-out waits on them
        self.pending_read_events: list[object] = []
        self._lock = threading.Lock()
        if initial_bytes > 0:
            self._grow(initial_bytes)

    @property
    def capacity_bytes(self) -> int:
        return sum(c.tensor.numel() for c in self.chunks)

    def use_pinned_memory(self) -> None:
        """A CUDA engine copies through this pool: chunks allocated from now on are pinned, and pageable
        chunks with nothing checked out are let go (the first chunk is allocated again, pinned, at the
        next copy-out)."""
        with self._lock:
            if self.pin_memory:
                return
            self.pin_memory = True
            if self.checked_out_bytes == 0:
                self.chunks = []

    def _grow(self, nbytes: int) -> _Chunk:
        first = self.initial_bytes if not self.chunks else 0
        size = host_range_bytes(max(nbytes, first, MIN_CHUNK_BYTES, self.capacity_bytes))
        chunk = _Chunk(tensor=host_memory(size, self.pin_memory), free=[[0, size]])
        self.chunks.append(chunk)
        self.grow_count += 1
        return chunk

    def allocate(self, nbytes: int) -> HostSlot:
        need = host_range_bytes(max(nbytes, 1))
        with self._lock:
            for chunk in self.chunks:
                slot = self._take(chunk, need, nbytes)
                if slot is not None:
                    return slot
            slot = self._take(self._grow(need), need, nbytes)
        assert slot is not None
        return slot

    def _take(self, chunk: _Chunk, need: int, nbytes: int) -> HostSlot | None:
        for i, (start, end) in enumerate(chunk.free):
            if end - start >= need:
                if end - start == need:
                    chunk.free.pop(i)
                else:
                    chunk.free[i][0] = start + need
                self.checked_out_bytes += need
                return HostSlot(chunk=chunk, start=start, nbytes=nbytes, reserved_bytes=need,
                                tensor=chunk.tensor[start:start + nbytes])
        return None

    def take_read_events(self) -> list[object]:
        """The pending read events (a copy-out about to write a range waits on them), and none left."""
        with self._lock:
            events, self.pending_read_events = self.pending_read_events, []
        return events

    def release(self, slot: HostSlot) -> None:
        """Give a range back; its last reader's event goes with it so the next writer can wait on it."""
        with self._lock:
            self._release(slot)

    def _release(self, slot: HostSlot) -> None:
        free = slot.chunk.free
        start, end = slot.start, slot.start + slot.reserved_bytes
        if slot.last_read_event is not None:
            self.pending_read_events.append(slot.last_read_event)
            slot.last_read_event = None
        free.append([start, end])
        free.sort()
        merged: list[list[int]] = []
        for r in free:
            if merged and merged[-1][1] == r[0]:
                merged[-1][1] = r[1]
            else:
                merged.append(r)
        slot.chunk.free[:] = merged
        self.checked_out_bytes -= slot.reserved_bytes


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
    """Copies between one device and the host pool (the calls of swap_queue.py). See the module doc."""

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


class SyncEngine(SwapEngine):
    """A CPU device without an emulated link: each copy runs at once (`copy_` between host tensors)."""

    def copy_out(self, t: torch.Tensor) -> CopyOut:
        src = storage_bytes_view(t)
        slot = self.pool.allocate(src.numel())
        slot.tensor.copy_(src)
        return CopyOut(slot=slot, done_event=None, source=None, device=self.device)

    def copy_in(self, out: CopyOut) -> CopyIn:
        buf = torch.empty(out.slot.nbytes, dtype=torch.uint8, device=self.device)
        buf.copy_(out.slot.tensor)
        return CopyIn(buffer=buf, done_event=None)


def new_engine(device: torch.device, pool: HostPool, link_bytes_per_s: tuple[float, float] | None,
               stats=None) -> SwapEngine:
    """The backend for `device`: CUDA streams, an emulated link at (d2h, h2d) bytes/s (its waits counted in
    `stats`, a RuntimeStats), or synchronous."""
    if device.type == "cuda":
        from regen.runtime.swap_cuda import CudaEngine

        return CudaEngine(device, pool)
    if link_bytes_per_s is not None:
        from regen.runtime.link import EmulatedEngine

        return EmulatedEngine(device, pool, *link_bytes_per_s, stats=stats)
    return SyncEngine(device, pool)
