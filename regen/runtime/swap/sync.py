"""The synchronous swap engine: a CPU device without an emulated link, each copy run at once (`copy_`
between host tensors, no events). A CPU has no host link, so such a swap frees nothing: it exists so
a plan that swaps runs (with a warning) where no link is emulated."""

from __future__ import annotations

import torch

from regen.runtime.storage_views import storage_bytes_view
from regen.runtime.swap.interface import CopyIn, CopyOut, SwapEngine


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
