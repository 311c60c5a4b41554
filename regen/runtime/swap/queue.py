"""One step's swaps: copy-outs in forward, the copy-in schedule in backward, and giving the memory back.

A swapped planned storage's copy-out starts when it is packed. Its device storage (`CopyOut.source`) is held
until the planned storage's release point (docs/internals.md "Swaps"): the forward pack `release_at_pack` or
the backward unpack `release_at_unpack` of its decision, where the compute stream waits for the copy-out
(done or not) and the storage is dropped, so memory follows op order, as the simulator plans it. The
copy-outs wait in two heaps ordered by their release point, one per clock, so each pack or unpack looks
at the first only. Its copy-in is scheduled at the plan's `swap_in_at_unpack` and issued when the step's
unpack count reaches it, or at its consumer when backward reads it first (a synchronous copy-in); a
source still held then is released first. The restored buffer is dropped after the planned storage's last
use; its host range goes back to the pool when autograd frees the planned storage's last handle. host_pool.py
holds the host pool; the engines (interface.py) do the copies.
"""

from __future__ import annotations

import heapq
import itertools
from typing import Callable

import torch

from regen.runtime.stats import RuntimeStats
from regen.runtime.swap.interface import SwapEngine
from regen.runtime.swap.host_pool import HostPool
from regen.runtime.tracker import regen_ops


class SwapQueue:
    """The copies of one step's swapped planned storages (`planned_storages.PlannedStorage`), in both directions."""

    __slots__ = ("engine_for", "pool", "stats", "due_at_pack", "due_at_unpack", "copy_ins", "_seq")

    def __init__(self, engine_for: Callable[[torch.device], SwapEngine], pool: HostPool, stats: RuntimeStats):
        self.engine_for = engine_for
        self.pool = pool
        self.stats = stats
        # heaps of (release point, seq, planned storage): copy-outs whose device storage is held until that forward
        # pack or backward unpack
        self.due_at_pack: list = []
        self.due_at_unpack: list = []
        self.copy_ins: list = []  # heap of (unpack_order, seq, planned storage): copy-ins not issued yet
        self._seq = itertools.count()

    # ---- forward ----------------------------------------------------------------------------------
    def start(self, ps, x: torch.Tensor) -> None:
        """Copy out the storage of `x` (the planned storage's first pack) and schedule its release and copy-in."""
        ps.copy_out = self.engine_for(x.device).copy_out(x)
        d = ps.info.decision
        if ps.copy_out.source is not None:
            if d.release_at_pack is not None:
                heapq.heappush(self.due_at_pack, (d.release_at_pack, next(self._seq), ps))
            else:
                heapq.heappush(self.due_at_unpack, (d.release_at_unpack, next(self._seq), ps))
        order = d.swap_in_at_unpack
        heapq.heappush(self.copy_ins, (order if order is not None else 0, next(self._seq), ps))
        self.stats.swapped_tensors += 1
        self.stats.swapped_bytes += ps.copy_out.slot.nbytes

    def release_due_at_pack(self, pack_order: int) -> None:
        """Release the device storages due at or before this forward pack."""
        due = self.due_at_pack
        while due and due[0][0] <= pack_order:
            self._release_source(heapq.heappop(due)[2])

    def release_due_at_unpack(self, unpack_order: int) -> None:
        """Release the device storages due at or before this unpack (and every one due in forward)."""
        due = self.due_at_pack
        while due:
            self._release_source(heapq.heappop(due)[2])
        due = self.due_at_unpack
        while due and due[0][0] <= unpack_order:
            self._release_source(heapq.heappop(due)[2])

    def release_all(self) -> None:
        """Release every device storage still held (the step is released)."""
        for due in (self.due_at_pack, self.due_at_unpack):
            while due:
                self._release_source(heapq.heappop(due)[2])

    def _release_source(self, ps) -> None:
        """The compute stream waits for the copy-out, then the device storage goes (done or not)."""
        out = ps.copy_out
        if out is not None and out.source is not None:
            self.engine_for(out.device).release_source(out)

    def held_copy_outs(self) -> int:
        """Copy-outs whose device storage is still held (their release point not reached yet)."""
        return sum(1 for due in (self.due_at_pack, self.due_at_unpack) for _, _, ps in due
                   if ps.copy_out is not None and ps.copy_out.source is not None)

    # ---- backward ---------------------------------------------------------------------------------
    def issue_due(self, unpack_order: int) -> None:
        """Issue the copy-ins scheduled at or before this unpack."""
        copy_ins = self.copy_ins
        while copy_ins and copy_ins[0][0] <= unpack_order:
            ps = heapq.heappop(copy_ins)[2]
            if ps.copy_in is None and not ps.released:
                self._issue(ps)

    def _issue(self, ps) -> None:
        engine = self.engine_for(ps.copy_out.device)
        if ps.copy_out.source is not None:  # issued before its release point: released now
            engine.release_source(ps.copy_out)
        with regen_ops():
            ps.copy_in = engine.copy_in(ps.copy_out)
        ps.storage = ps.copy_in.buffer

    def restored(self, ps) -> torch.Tensor:
        """The planned storage's restored storage, ready on the current stream (copied in now if not issued yet)."""
        if ps.copy_in is None:
            self.stats.synchronous_copy_ins += 1
            self._issue(ps)
        self.engine_for(ps.copy_in.buffer.device).wait_copy_in(ps.copy_in)
        return ps.copy_in.buffer

    def drop_copy_in(self, ps) -> None:
        """The restored buffer goes back to the allocator (ordered after the copy into it)."""
        self.engine_for(ps.copy_in.buffer.device).drop_copy_in(ps.copy_in)
        ps.copy_in = None

    def release(self, ps) -> None:
        """The planned storage's host range goes back to the pool (and its device source, if still held)."""
        out = ps.copy_out
        ps.copy_out = None
        engine = self.engine_for(out.device)
        if out.source is not None:
            engine.release_source(out)
        self.pool.release(out.slot)
        engine.retire(out)

    def clear(self) -> None:
        """The step is released: forget the copy-ins never issued."""
        self.copy_ins.clear()
