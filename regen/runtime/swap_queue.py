"""One step's swaps: copy-outs in forward, the copy-in schedule in backward, and giving the memory back.

A swapped candidate's copy-out starts when it is packed. Its device storage (`CopyOut.source`) stays
held until the copy is done: checked at each later pack, waited for when the forward closes. Its
copy-in is scheduled at the plan's `swap_in_at_unpack` and issued when the step's unpack count reaches
it, or at its consumer when backward reads it first (a synchronous copy-in). The restored buffer is
dropped after the candidate's last use; its host range goes back to the pool when autograd frees the
candidate's last handle. swap.py holds the host pool and the engines that do the copies.
"""

from __future__ import annotations

import heapq
import itertools
from typing import Callable

import torch

from regen.runtime.stats import RuntimeStats
from regen.runtime.swap import HostPool, SwapEngine
from regen.runtime.tracker import regen_ops


class SwapQueue:
    """The copies of one step's swapped candidates (`candidates.Candidate`), in both directions."""

    __slots__ = ("engine_for", "pool", "stats", "pending_copy_outs", "copy_ins", "_seq")

    def __init__(self, engine_for: Callable[[torch.device], SwapEngine], pool: HostPool, stats: RuntimeStats):
        self.engine_for = engine_for
        self.pool = pool
        self.stats = stats
        self.pending_copy_outs: list = []  # candidates whose device storage waits for its copy-out
        self.copy_ins: list = []  # heap of (unpack_order, seq, candidate): copy-ins not issued yet
        self._seq = itertools.count()

    # ---- forward ----------------------------------------------------------------------------------
    def start(self, cand, x: torch.Tensor) -> None:
        """Copy out the storage of `x` (the candidate's first pack) and schedule its copy-in."""
        cand.copy_out = self.engine_for(x.device).copy_out(x)
        if cand.copy_out.source is not None:
            self.pending_copy_outs.append(cand)
        order = cand.info.decision.swap_in_at_unpack
        heapq.heappush(self.copy_ins, (order if order is not None else 0, next(self._seq), cand))
        self.stats.swapped_tensors += 1
        self.stats.swapped_bytes += cand.copy_out.slot.nbytes

    def flush(self, wait_all: bool) -> None:
        """Let go of the device storage of finished copy-outs (of all of them, after waiting, if wait_all)."""
        keep = []
        for cand in self.pending_copy_outs:
            out = cand.copy_out
            if out is None or out.source is None:
                continue
            engine = self.engine_for(out.source.device)
            if wait_all or engine.copy_out_finished(out):
                engine.release_source(out)
            else:
                keep.append(cand)
        self.pending_copy_outs[:] = keep

    def unfinished_copy_outs(self) -> int:
        """Copy-outs still running (their device storage held)."""
        outs = [cand.copy_out for cand in self.pending_copy_outs]
        return sum(1 for out in outs if out is not None and out.source is not None
                   and not self.engine_for(out.device).copy_out_finished(out))

    # ---- backward ---------------------------------------------------------------------------------
    def issue_due(self, unpack_order: int) -> None:
        """Issue the copy-ins scheduled at or before this unpack."""
        copy_ins = self.copy_ins
        while copy_ins and copy_ins[0][0] <= unpack_order:
            cand = heapq.heappop(copy_ins)[2]
            if cand.copy_in is None and not cand.released:
                self._issue(cand)

    def _issue(self, cand) -> None:
        engine = self.engine_for(cand.copy_out.device)
        with regen_ops():
            cand.copy_in = engine.copy_in(cand.copy_out)
        cand.storage = cand.copy_in.buffer

    def restored(self, cand) -> torch.Tensor:
        """The candidate's restored storage, ready on the current stream (copied in now if not issued yet)."""
        if cand.copy_in is None:
            self.stats.synchronous_copy_ins += 1
            self._issue(cand)
        self.engine_for(cand.copy_in.buffer.device).wait_copy_in(cand.copy_in)
        return cand.copy_in.buffer

    def drop_copy_in(self, cand) -> None:
        """The restored buffer goes back to the allocator (ordered after the copy into it)."""
        self.engine_for(cand.copy_in.buffer.device).drop_copy_in(cand.copy_in)
        cand.copy_in = None

    def release(self, cand) -> None:
        """The candidate's host range goes back to the pool (and its device source, if still held)."""
        out = cand.copy_out
        cand.copy_out = None
        engine = self.engine_for(out.device)
        if out.source is not None:
            engine.release_source(out)
        self.pool.release(out.slot)
        engine.retire(out)

    def clear(self) -> None:
        """The step is released: forget the copy-ins never issued."""
        self.copy_ins.clear()
