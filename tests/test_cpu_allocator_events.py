"""The CPU allocator's profiled events: a free of a block allocated before the region does not count, whatever
size c10's reporter remembers for its address (regen/cpu_allocator_events.py)."""

from types import SimpleNamespace

import torch
from torch._C._profiler import _EventType
from torch.profiler import ProfilerActivity, profile

from regen.cpu_allocator_events import cpu_allocator_events, every_cpu_allocator_event
from regen.measure import measure_memory

CPU = torch.device("cpu")


def _allocation(time_ns: int, ptr: int, size_bytes: int, device=CPU):
    return SimpleNamespace(tag=_EventType.Allocation, start_time_ns=time_ns, children=[],
                           typed=(None, SimpleNamespace(device=device, ptr=ptr, alloc_size=size_bytes)))


def _op(*children):
    return SimpleNamespace(tag=_EventType.TorchOp, start_time_ns=0, children=list(children), typed=(None, None))


def test_a_free_counts_only_when_its_block_was_allocated_in_the_region():
    roots = [_op(_allocation(3, ptr=0xA, size_bytes=-4096),  # allocated before: a stale size, maybe
                 _allocation(1, ptr=0xB, size_bytes=100),
                 _allocation(5, ptr=0xA, size_bytes=64)),
             _op(_allocation(7, ptr=0xA, size_bytes=-64), _allocation(9, ptr=0xA, size_bytes=-64),
                 _allocation(2, ptr=0xC, size_bytes=8, device=torch.device("meta")))]
    assert [e.size_bytes for e in every_cpu_allocator_event(roots)] == [100, -4096, 64, -64, -64]
    assert [(e.time_ns, e.size_bytes) for e in cpu_allocator_events(roots)] == [(1, 100), (5, 64), (7, -64)]


def test_at_equal_times_an_allocation_comes_before_a_free():
    roots = [_op(_allocation(4, ptr=0xA, size_bytes=-8), _allocation(4, ptr=0xA, size_bytes=8))]
    assert [e.size_bytes for e in cpu_allocator_events(roots)] == [8, -8]


def test_measured_memory_counts_what_the_step_allocated_not_what_it_freed_of_before():
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True):
        holder = [torch.empty(16 * 1024)]  # the reporter learns its size: its free is reported with it

    def step():
        holder.clear()
        return torch.ones(4096)

    measured = measure_memory(step)
    assert measured.peak_increase_bytes == 4 * 4096  # with the earlier block's free taken off: 0
