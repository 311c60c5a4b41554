"""Swap: a saved tensor's storage copied to host memory in forward and back to the device in backward.

* host_pool.py: `HostPool`, the host memory ranges swapped storages live in.
* interface.py: `SwapEngine`, the copies' interface (`CopyOut`, `CopyIn`), with three backends chosen by
  `new_engine`: `CudaEngine` (cuda.py: a device-to-host and a host-to-device stream, events),
  `EmulatedEngine` (emulated.py: a CPU device with `regen.apply(..., emulate_link=True)`: one copy
  thread per direction at the plan's bandwidth, events the compute thread waits on) and `SyncEngine`
  (sync.py: a CPU device without an emulated link: `copy_` at once, no events).
* queue.py: `SwapQueue`, one step's swaps: copy-outs in forward, their release points, the copy-in
  schedule in backward, and the host ranges given back.
"""

from __future__ import annotations

import torch

from regen.runtime.swap.cuda import CudaEngine
from regen.runtime.swap.emulated import EmulatedEngine
from regen.runtime.swap.interface import CopyIn, CopyOut, SwapEngine
from regen.runtime.swap.host_pool import HostPool, HostSlot
from regen.runtime.swap.queue import SwapQueue
from regen.runtime.swap.sync import SyncEngine

__all__ = ["CopyIn", "CopyOut", "CudaEngine", "EmulatedEngine", "HostPool", "HostSlot", "SwapEngine", "SwapQueue",
           "SyncEngine", "new_engine"]


def new_engine(device: torch.device, pool: HostPool, link_bytes_per_s: tuple[float, float] | None,
               stats=None) -> SwapEngine:
    """The backend for `device`: CUDA streams, an emulated link at (d2h, h2d) bytes/s (its waits counted in
    `stats`, a RuntimeStats), or synchronous."""
    if device.type == "cuda":
        return CudaEngine(device, pool)
    if link_bytes_per_s is not None:
        return EmulatedEngine(device, pool, *link_bytes_per_s, stats=stats)
    return SyncEngine(device, pool)
