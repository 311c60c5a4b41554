"""The CPU allocator's events as torch.profiler records them: the one place measure, profiler and runtime read them.

c10's CPU memory reporter learns a block's size at an allocation made while memory profiling is on, and forgets it
only at a free made while profiling is on. A block allocated inside one profiled region and freed outside any
leaves its size behind; a later block at the same address, allocated outside profiling, is then reported freed
with that stale size when a profiled region frees it. Which addresses come back depends on the heap's history,
so the same step, measured after other work in the same process, read up to 512 KiB lower now and then (a
4-layer Jamba's checkpointed step: 9.01 to 9.54 MB over four runs of one test file). So a free counts here only
when the allocation of its block is among the region's own events: a region's figures are what it allocated
and freed itself, whatever ran before it.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["AllocatorEvent", "cpu_allocator_events", "every_cpu_allocator_event", "own_events"]


@dataclass(frozen=True)
class AllocatorEvent:
    time_ns: int
    ptr: int
    size_bytes: int  # > 0: allocated; < 0: freed


def cpu_allocator_events(roots) -> list[AllocatorEvent]:
    """The CPU allocations and frees under `roots` (torch.profiler's event tree nodes, walked) in time order,
    frees of blocks not allocated among them left out."""
    return own_events(every_cpu_allocator_event(roots))


def own_events(events: list[AllocatorEvent]) -> list[AllocatorEvent]:
    """`events` (in time order) less the frees of blocks not allocated among them: their sizes may be stale."""
    live: dict[int, int] = {}  # ptr -> blocks allocated at it among the events and not freed yet
    kept = []
    for e in events:
        if e.size_bytes > 0:
            live[e.ptr] = live.get(e.ptr, 0) + 1
        elif live.get(e.ptr, 0) > 0:
            live[e.ptr] -= 1
        else:
            continue
        kept.append(e)
    return kept


def every_cpu_allocator_event(roots) -> list[AllocatorEvent]:
    """The CPU allocations and frees under `roots` in time order (at equal times, allocations first), every
    free included: part of a region whose own allocations `cpu_allocator_events` of the whole says."""
    from torch._C._profiler import _EventType

    found, stack = [], list(roots)
    while stack:
        event = stack.pop()
        stack.extend(event.children)
        if event.tag == _EventType.Allocation:
            fields = event.typed[1]
            if fields.device.type == "cpu" and fields.alloc_size != 0:
                found.append(AllocatorEvent(event.start_time_ns, fields.ptr, fields.alloc_size))
    found.sort(key=lambda e: (e.time_ns, e.size_bytes < 0))
    return found
