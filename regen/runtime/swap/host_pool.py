"""The host pool: host memory allocated once, by `regen.apply`, and handed out as byte ranges for swapped
storages.

Its first chunk is the plan's `host_pool_bytes` (pinned for a model on CUDA: allocating pinned memory
per tensor forces a device sync; a pool made pageable is made again, pinned, at the first CUDA
copy-out: a model moved to the GPU after apply). Ranges are `formats.plan_rules.host_range_bytes`
(rounded up to 512 bytes, as the plan sizes them), taken first fit; the pool grows by whole chunks
when a step needs more than it holds. A range goes back to the pool when the swapped storage is done
with (the swap queue's `release`: autograd freed the last handle on it, or its step was released), so
later swaps and steps reuse it. Ranges and pending read events are taken and given back under a lock
(engines of several devices share the pool); a range given back is written again only after the
copy-in that last read it has finished (`HostSlot.last_read_event`, `HostPool.pending_read_events`).
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

import torch

from regen.formats.plan_rules import host_range_bytes

MIN_CHUNK_BYTES = 1 << 20  # a pool never grows by less than this


def host_memory(nbytes: int, pinned: bool) -> torch.Tensor:
    """`nbytes` of host memory for a chunk of the pool (page-locked when `pinned`)."""
    return torch.empty(nbytes, dtype=torch.uint8, pin_memory=pinned)


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
