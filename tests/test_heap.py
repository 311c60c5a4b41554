"""regen.heap: the heap's freed pages go back to the system between profiling's phases."""

import sys

import pytest

from regen import heap


@pytest.mark.skipif(not sys.platform.startswith("linux") or heap._malloc_trim() is None,
                    reason="glibc's malloc_trim (Linux)")
def test_pages_freed_between_blocks_still_in_use_go_back_to_the_system():
    """Blocks below malloc's map threshold, every other one freed: their pages stay with the process until
    they are given back."""
    def resident_bytes() -> int:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * 4096

    blocks = [bytearray(b"x" * 60_000) for _ in range(4_000)]
    kept = blocks[::2]
    del blocks
    freed = 2_000 * 60_000
    before = resident_bytes()
    heap.give_back_freed_host_memory()
    assert before - resident_bytes() >= freed // 2
    assert len(kept) == 2_000
