"""`RuntimeStats`: what a `regen.apply` handle did so far, counted by its steps as they run."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class RuntimeStats:
    """What the handle did so far (cumulative over steps)."""

    steps: int = 0  # steps started (training forwards with grad)
    planned_steps: int = 0  # steps whose every pack followed the plan
    unplanned_steps: int = 0  # steps that fell back to keep (on_mismatch="keep")
    # steps no plan fits, or that left their plan in forward, run in dynamic mode (on_mismatch="dynamic"; dynamic_stats)
    dynamic_steps: int = 0
    swapped_tensors: int = 0
    swapped_bytes: int = 0
    dropped_tensors: int = 0  # dropped in forward for recompute
    recomputes: int = 0  # recipe replays
    region_replays: int = 0  # module calls run again in backward (Plan.regions)
    synchronous_copy_ins: int = 0  # copy-ins issued at their consumer instead of their planned unpack
    copy_outs_held_at_end_forward: int = 0  # copy-outs whose storage a forward's end still held (all steps)
    link_wait_s: float = 0.0  # emulated link (emulate_link=True): wall time the compute thread waited on copies
    # emulated link: time the compute thread spent moving the copies' bytes (memmove), the emulation's own
    # cost: a GPU's copy engines take none from compute
    link_copy_cpu_s: float = 0.0
