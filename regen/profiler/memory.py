"""Memory of the unplanned step, sampled around every op while the step is recorded.

Two trackers with one interface (levels are relative to the start of the step; `start_bytes()` says what
the start was):

* `CudaMemoryTracker`: the CUDA caching allocator's own counters. Before an op: `memory_allocated()` and
  `reset_peak_memory_stats()`; after it: `max_memory_allocated()`, the peak while the op ran (kernel
  workspaces included). Absolute, so the start is everything allocated on the device.
* `LiveStorageTracker` (CPU): the CPU allocator keeps no counter, so the recorder reports every storage it
  sees appear (new op outputs) and the tracker is told of each one's free as it happens (regen.storage_frees:
  a weak reference's callback, not a poll of every live storage before every op). Temporaries that a kernel
  allocates and frees inside itself (oneDNN reorders in convolution backward, say) are not tensors the dispatch
  mode sees, so while the step is recorded torch.profiler reports the CPU allocator's events
  (`profile_memory=True`) and every op runs inside a marker; the peak within op i is then the level before it
  plus the larger of the storages it returned and the allocator's own peak above its starting level during the
  marker. The start is the
  bytes of the storages that existed before the step and belong to it: parameters, buffers, optimizer
  state, gradients, the batch, and any other pre-existing tensor an op reads.

FSDP2 allocates a unit's unsharded parameters (resizing their storages) just before it gathers them and
frees them (resized to nothing) after the unit's forward and again after its backward: the recorder
reports each storage a gathering op writes (`gathered`), whose bytes then count from that op on, not in
the start, and reports its reshard as a resize to nothing. A storage that no op returned, first met mid-step (a buffer
a collective allocates inside itself and hands back, as gloo's reduce-scatter does), is counted in the
start when met; when the allocator's events show it was allocated during the step, it is moved to the
level from the op where it was met (`mid_step_allocations`).

A parked step (regen.profiler.park) frees saved storages between pack and unpack; both trackers add
`missing_bytes()`, the bytes the unplanned step would hold there, to every level, so the timeline they
report is the unplanned one. A storage brought back in backward is a new storage no op returned: the
recorder reports it (`restored`) so the CPU tracker watches it until it is freed.
"""

from __future__ import annotations

import os
from bisect import bisect_left, bisect_right
from contextlib import contextmanager, nullcontext
from itertools import accumulate
from typing import Callable, ContextManager, Protocol

import torch

from regen.allocator import allocated_bytes_reader, peak_bytes_reader
from regen.cpu_allocator_events import AllocatorEvent, every_cpu_allocator_event, own_events
from regen.storage_frees import FreedStorages


class MemoryTracker(Protocol):
    def add_external(self, info) -> None:
        """A storage that existed before the step (its bytes belong to the start)."""

    def op_scope(self, index: int) -> ContextManager:
        """Entered around the op's own call."""

    def before_op(self) -> int:
        """Bytes allocated now, relative to the start."""

    def after_op(self, new_storages: list) -> int:
        """Peak bytes while the op ran, relative to the start; `new_storages` are the op's new outputs."""

    def resized(self, info, nbytes: int) -> None:
        """A known storage changed size."""

    def restored(self, info) -> None:
        """A parked storage was copied back into the new storage `info` now refers to."""

    def gathered(self, info) -> None:
        """FSDP gathered parameters into the storage `info` (allocated for it): live from now, not at start."""

    def start_bytes(self) -> int:
        """Absolute bytes allocated at the start of the step."""

    def mid_step_allocations(self) -> list[tuple[int, int]]:
        """(op index, bytes) of the storages first met at that op and counted in `start_bytes()` that were in
        fact allocated during the step, before it (the allocator says so): their bytes belong to the level
        from that op on, not to the start."""


def no_missing_bytes() -> int:
    return 0


class LiveStorageTracker:
    """CPU: live bytes from the storages the recorder reports, their frees taken before every op."""

    def __init__(self, allocator_events: "CpuAllocatorEvents | None" = None,
                 missing_bytes: Callable[[], int] = no_missing_bytes) -> None:
        self._start = 0
        self._level = 0
        self._missing = 0
        self.missing_bytes = missing_bytes
        self._live = FreedStorages()  # by storage id (a restored storage: -1 - its id)
        self.allocator_events = allocator_events
        self._ops_begun = 0
        # storage id -> (data pointer, bytes, index of the op at which it was met) of the storages added to the
        # start after the first op began
        self._met_mid_step: dict[int, tuple[int, int, int]] = {}

    def op_scope(self, index: int) -> ContextManager:
        return self.allocator_events.op_scope(index) if self.allocator_events else nullcontext()

    def add_external(self, info) -> None:
        if info.ref is None:
            return
        info.at_start = True
        self._start += info.nbytes
        if self._ops_begun:
            self._met_mid_step[info.id] = (info.key, info.nbytes, self._ops_begun - 1)
        if not info.permanent:  # the batch and the like can be dropped mid-step: watch them
            self._live.watch(info.id, info.ref, info.nbytes)

    def before_op(self) -> int:
        self._ops_begun += 1
        for _, nbytes in self._live.pop_freed():
            self._level -= nbytes
        self._missing = self.missing_bytes()
        return self._level + self._missing

    def after_op(self, new_storages: list) -> int:
        for info in new_storages:
            self._live.watch(info.id, info.ref, info.nbytes)
            self._level += info.nbytes
        return self._level + self._missing

    def resized(self, info, nbytes: int) -> None:
        if info.id in self._live:
            self._level += nbytes - self._live.nbytes(info.id)
            self._live.resize(info.id, nbytes)

    def gathered(self, info) -> None:
        if info.ref is None:
            return
        if info.at_start:  # first met as a tensor from outside the step: allocated by FSDP's unshard
            info.at_start = False
            self._met_mid_step.pop(info.id, None)
            self._start -= info.nbytes
            self._level += info.nbytes
        if info.id not in self._live:
            self._live.watch(info.id, info.ref, info.nbytes)

    def restored(self, info) -> None:
        # keyed apart from the original storage's entry, which may still be watched
        self._live.watch(-1 - info.id, info.ref, info.nbytes)
        self._level += info.nbytes

    def start_bytes(self) -> int:
        return self._start

    def mid_step_allocations(self) -> list[tuple[int, int]]:
        events = self.allocator_events
        if events is None or not self._met_mid_step:
            return []
        return [(op, nbytes) for key, nbytes, op in self._met_mid_step.values()
                if events.allocated_before_op(key, op + 1)]


class CudaMemoryTracker:
    """CUDA: the caching allocator's allocated-bytes counters around every op."""

    def __init__(self, device: torch.device, missing_bytes: Callable[[], int] = no_missing_bytes) -> None:
        self.device = device
        self.missing_bytes = missing_bytes
        self._missing = 0
        torch.cuda.synchronize(device)
        self._read_allocated = allocated_bytes_reader(device)  # regen/allocator.py: about 19 us, not 133
        self._read_peak = peak_bytes_reader(device)
        self._start = self._read_allocated()

    def add_external(self, info) -> None:
        pass  # the allocator already counts it in memory_allocated()

    def op_scope(self, index: int) -> ContextManager:
        return nullcontext()

    def before_op(self) -> int:
        self._missing = self.missing_bytes()
        level = self._read_allocated() - self._start + self._missing
        torch.cuda.reset_peak_memory_stats(self.device)
        return level

    def after_op(self, new_storages: list) -> int:
        return self._read_peak() - self._start + self._missing

    def resized(self, info, nbytes: int) -> None:
        pass

    def restored(self, info) -> None:
        pass  # the allocator counts it

    def gathered(self, info) -> None:
        pass  # the allocator counts it

    def start_bytes(self) -> int:
        return self._start

    def mid_step_allocations(self) -> list[tuple[int, int]]:
        return []  # the allocator's own counters: the start is what was allocated at the start


OP_MARKER_PREFIX = "regen-op#"


@contextmanager
def _quiet_stderr():
    """Silence file descriptor 2 (kineto prints a line on every profiler start and stop)."""
    try:
        saved = os.dup(2)
    except OSError:
        yield
        return
    try:
        with open(os.devnull, "w") as devnull:
            os.dup2(devnull.fileno(), 2)
            yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)


class CpuAllocatorEvents:
    """The CPU allocator's allocations and frees during the recorded step, as torch.profiler reports them.

    Used to see what kernels allocate inside themselves and which storages first met mid-step were
    allocated during it; the level itself comes from the live storages. Unavailable (every op then gets 0
    extra) when another profiler is already running.
    """

    def __init__(self) -> None:
        self.available = not torch._C._autograd._profiler_enabled()
        self._prof = None
        self._recording: tuple[list[AllocatorEvent], dict[int, tuple[int, int]]] | None = None
        self._allocation_times: dict[int, list[int]] | None = None  # address -> start times of allocations there

    def __enter__(self) -> "CpuAllocatorEvents":
        if self.available:
            from torch.profiler import ProfilerActivity, profile

            self._prof = profile(activities=[ProfilerActivity.CPU], profile_memory=True)
            with _quiet_stderr():
                self._prof.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        if self._prof is not None:
            with _quiet_stderr():
                self._prof.__exit__(*exc)

    def op_scope(self, index: int) -> ContextManager:
        if self._prof is None:
            return nullcontext()
        return torch._C._profiler._RecordFunctionFast(f"{OP_MARKER_PREFIX}{index}")

    def allocated_before_op(self, ptr: int, index: int) -> bool:
        """Whether the allocator handed out memory at address `ptr` during the step before op `index` began
        (any time during the step when no op `index` ran)."""
        if self._prof is None:
            return False
        events, markers = self._recorded()
        if self._allocation_times is None:
            self._allocation_times = {}
            for e in events:
                if e.size_bytes > 0:
                    self._allocation_times.setdefault(e.ptr, []).append(e.time_ns)
        until = markers[index][0] if index in markers else float("inf")
        return any(t < until for t in self._allocation_times.get(ptr, ()))

    def _recorded(self) -> tuple[list[AllocatorEvent], dict[int, tuple[int, int]]]:
        """(every CPU allocator event of the recording, op index -> (start, end) of its marker), read once."""
        if self._recording is None:
            results = self._prof.profiler.kineto_results
            markers = {int(e.name()[len(OP_MARKER_PREFIX):]): (e.start_ns(), e.end_ns()) for e in results.events()
                       if e.name().startswith(OP_MARKER_PREFIX)}
            self._recording = every_cpu_allocator_event(results.experimental_event_tree()), markers
        return self._recording

    def in_op_peaks(self) -> dict[int, int]:
        """op index -> highest bytes the allocator held during the op above its level when the op began."""
        if self._prof is None:
            return {}
        events, markers = self._recorded()
        memory = own_events(events)  # no free of a block allocated before the recording: its size may be stale
        times = [e.time_ns for e in memory]
        levels = list(accumulate(e.size_bytes for e in memory))
        peaks = {}
        for index, (start, end) in markers.items():
            lo, hi = bisect_left(times, start), bisect_right(times, end)
            if lo < hi:
                before = levels[lo - 1] if lo else 0
                peaks[index] = max(0, max(levels[lo:hi]) - before)
        return peaks
