"""Host<->device copy bandwidth, measured on the machine being profiled (a short probe, well under 0.5 s).

* CUDA: a pinned host buffer and a device buffer; `copy_(non_blocking=True)` (cudaMemcpyAsync) in each
  direction on a side stream, timed with CUDA events, best of a few repeats.
* CPU: there is no transfer to measure; the probe times a large host memcpy (`copy_` between two host
  tensors) so swap on CPU (which copies into another host buffer) has a realistic cost, and says so in
  `bandwidth_method`.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

PROBE_BYTES = 64 * 1024 * 1024  # large enough to reach peak bandwidth, small enough to stay fast
CPU_PROBE_BYTES = 32 * 1024 * 1024
PROBE_REPEATS = 3
CUDA_METHOD = "pinned cudaMemcpyAsync (CUDA events)"
CPU_METHOD = "host memcpy (CPU device: no real transfer)"


@dataclass
class Bandwidth:
    d2h_bytes_per_s: float
    h2d_bytes_per_s: float
    method: str


def measure_bandwidth(device: torch.device) -> Bandwidth:
    if device.type == "cuda":
        return _cuda_bandwidth(device)
    return _cpu_bandwidth()


def _cpu_bandwidth() -> Bandwidth:
    src = torch.ones(CPU_PROBE_BYTES, dtype=torch.uint8)
    dst = torch.empty_like(src)
    dst.copy_(src)  # first touch of the pages, not timed
    best_s = float("inf")
    for _ in range(PROBE_REPEATS):
        t0 = time.perf_counter()
        dst.copy_(src)
        best_s = min(best_s, time.perf_counter() - t0)
    rate = CPU_PROBE_BYTES / max(best_s, 1e-9)
    return Bandwidth(d2h_bytes_per_s=rate, h2d_bytes_per_s=rate, method=CPU_METHOD)


def _cuda_bandwidth(device: torch.device) -> Bandwidth:
    host = torch.empty(PROBE_BYTES, dtype=torch.uint8, pin_memory=True)
    dev = torch.empty(PROBE_BYTES, dtype=torch.uint8, device=device)
    stream = torch.cuda.Stream(device)
    torch.cuda.synchronize(device)

    def best_rate(copy) -> float:
        best_s = float("inf")
        with torch.cuda.stream(stream):
            copy()  # warm-up
            for _ in range(PROBE_REPEATS):
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record(stream)
                copy()
                end.record(stream)
                end.synchronize()
                best_s = min(best_s, start.elapsed_time(end) / 1e3)  # elapsed_time is in ms
        return PROBE_BYTES / max(best_s, 1e-9)

    d2h = best_rate(lambda: host.copy_(dev, non_blocking=True))
    h2d = best_rate(lambda: dev.copy_(host, non_blocking=True))
    return Bandwidth(d2h_bytes_per_s=d2h, h2d_bytes_per_s=h2d, method=CUDA_METHOD)
