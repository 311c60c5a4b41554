"""Measuring memory honestly: peak bytes as the allocator saw them, not as regen's bookkeeping says.

* CUDA: `torch.cuda.reset_peak_memory_stats()` then `torch.cuda.max_memory_allocated()`.
* CPU: torch.profiler's record of the CPU allocator's events (`profile_memory=True`, the data behind
  `export_memory_timeline`): every allocation and free the allocator made while the step ran, summed over
  time; a free of a block allocated before the step does not count (cpu_allocator_events.py: its size may be
  a stale one).

Tests and benchmarks use this to check profiles and plans; the profiler and runtime never use it
for their own decisions. On CPU the timeline only knows tensors that appear during the measured
region, so compare the *increase* over the start (`peak_bytes - start_bytes`) unless you know that
everything of interest was allocated inside it.
"""

from __future__ import annotations

import contextlib
import gc
import warnings
from dataclasses import dataclass
from itertools import accumulate
from typing import Callable

import torch

from regen.cpu_allocator_events import cpu_allocator_events


@dataclass
class MemoryMeasurement:
    peak_bytes: int  # highest bytes allocated at any moment of the step
    start_bytes: int  # bytes allocated when the measurement began
    end_bytes: int
    timeline_bytes: list[int]  # allocated bytes at each allocator event (CPU) or [start, peak, end] (CUDA)

    @property
    def peak_increase_bytes(self) -> int:
        return self.peak_bytes - self.start_bytes


def measure_memory(step: Callable[[], object], device: str | torch.device = "cpu",
                   collect_garbage: bool = False) -> MemoryMeasurement:
    """Run `step()` once and measure the device memory it allocated, from the allocator itself.

    On CPU, torch.profiler's results are left as cyclic garbage, which Python's collector frees later,
    inside whatever runs then: a caller that times steps after measuring passes `collect_garbage=True`
    (a full collection, a fifth of a second with transformers loaded)."""
    device = torch.device(device)
    step = _without_collection(step)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        start = torch.cuda.memory_allocated(device)
        torch.cuda.reset_peak_memory_stats(device)
        step()
        torch.cuda.synchronize(device)
        peak = torch.cuda.max_memory_allocated(device)
        end = torch.cuda.memory_allocated(device)
        return MemoryMeasurement(peak, start, end, [start, peak, end])
    return _measure_cpu(step, collect_garbage)


def _without_collection(step: Callable[[], object]) -> Callable[[], object]:
    """`step` with Python's cyclic collector off while it runs: garbage of earlier work (an earlier test's
    model, gradients) collected inside the step would lower its figure on CUDA (the allocator's absolute
    peak), and would cost the step the collection's time (on CPU such frees do not count:
    cpu_allocator_events.py)."""
    def run():
        enabled = gc.isenabled()
        gc.disable()
        try:
            return step()
        finally:
            if enabled:
                gc.enable()

    return run


def _measure_cpu(step: Callable[[], object], collect_garbage: bool) -> MemoryMeasurement:
    totals = _timeline_totals(step)
    if collect_garbage:
        gc.collect()
    return MemoryMeasurement(peak_bytes=max(totals), start_bytes=totals[0], end_bytes=totals[-1],
                             timeline_bytes=totals)


def _timeline_totals(step: Callable[[], object]) -> list[int]:
    """Run `step()` under torch.profiler; the bytes the step allocated and still held after each of its CPU
    allocator events (cpu_allocator_events.py: a free of a block allocated before the step is not counted)."""
    from torch.profiler import ProfilerActivity, profile

    prof = profile(activities=[ProfilerActivity.CPU], profile_memory=True)
    with _profilers_warnings_ignored():
        prof.__enter__()
    try:
        step()  # its own warnings reach the caller
    finally:
        with _profilers_warnings_ignored():
            prof.__exit__(None, None, None)
    events = cpu_allocator_events(prof.profiler.kineto_results.experimental_event_tree())
    return [0] + list(accumulate(e.size_bytes for e in events))


@contextlib.contextmanager
def _profilers_warnings_ignored():
    """The profiler's own warnings (memory allocated before it started, and the like) are not the step's."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        yield
