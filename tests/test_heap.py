"""regen.heap: the heap's freed pages go back to the system between profiling's phases."""

import sys

import pytest

from regen import heap


@pytest.mark.skipif(not sys.platform.startswith("linux") or heap._libc_function("malloc_trim") is None,
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


_CHILD = """
import sys, torch
from regen import heap
if sys.argv[1] == "keep":
    assert heap.keep_freed_host_memory()
def resident_bytes():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096
torch.set_num_threads(1)  # no thread pool started by the fill below
torch.ones(1024).sum()  # torch's own first-op set-up, before the reading
before = resident_bytes()
t = torch.ones(4 * 2**20)  # 16 MiB: glibc maps blocks this large on their own by default
del t
print(resident_bytes() - before)
"""


@pytest.mark.skipif(not sys.platform.startswith("linux") or heap._libc_function("malloc_trim") is None, reason="glibc (Linux)")
def test_kept_host_memory_stays_with_the_process_for_the_next_step():
    """A freed 16 MiB tensor goes back to the system by default and stays in the heap once the thresholds
    are fixed (each in a process of its own: the setting is the process's)."""
    import subprocess

    def resident_after_free(mode: str) -> int:
        out = subprocess.run([sys.executable, "-c", _CHILD, mode], capture_output=True, text=True, check=True)
        return int(out.stdout.split()[-1])

    default, kept = resident_after_free("default"), resident_after_free("keep")
    assert kept - default >= 12 * 2**20, (default, kept)  # what else the process grew by is in both
