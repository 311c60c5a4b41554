"""Rank agreement: with torch.distributed initialized, every rank takes the same plan-mismatch decision.

Under DDP or FSDP a rank that raises while the others go on leaves them waiting in a collective forever.
So when a process group is initialized, a step's mismatch is not acted on where it is found in the forward:
the step runs on unplanned, and at its first unpack (the start of backward, which every rank reaches)
the ranks all-reduce one flag, "this rank's step did not match the plan". If any rank's did, every rank
takes the `on_mismatch` action: all raise `PlanMismatchError`, or all warn. One all-reduce of one element
per step, on the default process group, and none without torch.distributed.
"""

from __future__ import annotations

from typing import Callable

import torch


def mismatch_agreement() -> Callable[[bool], bool] | None:
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
