"""regen/allocator.py: the nested statistics are read where they agree with the public calls, the public
calls otherwise (stand-ins for CUDA's: no GPU here)."""

import pytest
import torch

from regen import allocator


@pytest.fixture
def cuda_counters(monkeypatch):
    """Stand-ins: the allocator's nested statistics and the public calls over one set of counters."""
    counters = {"current": 1000, "peak": 5000, "nested_calls": 0}

    def nested(index):
        counters["nested_calls"] += 1
        return {"allocated_bytes": {"all": {"current": counters["current"], "peak": counters["peak"]}}}

    monkeypatch.setattr(torch._C, "_cuda_memoryStats", nested, raising=False)
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda index=None: counters["current"])
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda index=None: counters["peak"])
    return counters


def test_the_nested_statistics_are_read_when_they_agree(cuda_counters):
    current = allocator.allocated_bytes_reader(torch.device("cuda", 0))
    peak = allocator.peak_bytes_reader(torch.device("cuda", 0))
    cuda_counters.update(current=2048, peak=8192)
    calls = cuda_counters["nested_calls"]
    assert (current(), peak()) == (2048, 8192)
    assert cuda_counters["nested_calls"] == calls + 2


def test_the_public_calls_are_read_when_the_nested_statistics_differ(cuda_counters, monkeypatch):
    monkeypatch.setattr(torch._C, "_cuda_memoryStats", lambda index: {"allocated_bytes": {}}, raising=False)
    current = allocator.allocated_bytes_reader(torch.device("cuda", 0))
    cuda_counters["current"] = 4096
    assert current() == 4096
