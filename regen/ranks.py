"""Rank agreement: with torch.distributed initialized, every rank takes the same decision.

Under DDP or FSDP a rank that raises, or runs one more step, while the others go on leaves them waiting
in a collective forever. So decisions that one rank could take alone are all-reduced as a flag ("any
rank?") over the default process group: the runtime's plan-mismatch decision (runtime/step.py: at a
step's first unpack, so all ranks raise or all go on) and the profiler's decision to measure the timings
again (profiler/record.py: all ranks run the same steps). One all-reduce of one element per decision,
and none without torch.distributed.
"""

from __future__ import annotations

from typing import Callable

import torch


def rank_agreement() -> Callable[[bool], bool] | None:
    """A function `any_rank(flag) -> bool` all-reducing a flag over the default group, or None when
    torch.distributed is not initialized (one process: nothing to agree on)."""
    import torch.distributed as dist

    if not dist.is_available() or not dist.is_initialized() or dist.get_world_size() < 2:
        return None
    device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else torch.device("cpu")

    def any_rank(flag: bool) -> bool:
        t = torch.tensor([1 if flag else 0], dtype=torch.int32, device=device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return bool(t.item())

    return any_rank
