"""The emulated host link: a CPU device's swaps run as they would over a GPU's link.

`regen.apply(model, plan, emulate_link=True)` on a CPU device gives it an `EmulatedEngine`, the
`SwapEngine` backend (interface.py). Each direction of the link is a clock: a copy of n bytes starts once
it was issued, the copy before it in its direction was due to end and the copies it depends on were due to
land, and is due n / bandwidth later (the plan's d2h_ or h2d_bytes_per_s), as a CUDA copy stream runs its
copies one at a time in issue order. A copy counts as landed from its due time: a consumer that needs it
earlier waits until then, and those waits are real stalls (`RuntimeStats.link_wait_s`; the compute thread
sleeps, then spins the last SPIN_S).

No thread moves the bytes. The compute thread moves those of every copy that is due, in the order they are
due, whenever it calls the engine (`_land_due`), and a wait lands the copy it waits for the same way. So a
copy-in's buffer holds its poison until then (`poison`: POISON_WORDS 8-byte words spread over it, at least
POISON_STRIDE_BYTES apart, and its tail set to POISON_BYTE, a NaN in float lanes), and a reader that does
not wait reads it rather than the right bytes (a NaN spreads through whatever reads it). Only a few words,
since the fill is the compute thread's work, which a GPU does not do. A copy-out's source is held until
its release (interface.py), so its bytes are still there when it lands; a host range given back to the
pool is written again only by a copy-out that starts after the copy-in that last read it was due
(`HostPool.pending_read_events`), so it lands after that read.

Why not copy threads, as a GPU's copy engines run beside its compute: on a machine of a few cores, a
thread per direction took the GIL and the cores from the compute thread at every copy (its wake-ups, its
Python), 0.24-0.27 ms a swap next to compute on 2 cores even with no byte moved, against about 0.1-0.15 ms
per MiB for the compute thread to move the bytes itself (docs/benchmarks.md has the figures). Moving the bytes
is still the emulation's own cost, which a GPU's compute does not pay: it is counted apart
(`RuntimeStats.link_copy_cpu_s`) so that a benchmark can say how much of a swap plan's measured time it is.
Every tensor is allocated and freed by the compute thread, where the allocator's timeline (regen.measure)
sees it. `close()` (the handle's remove() once no step holds copies, or an exception in its `with` block)
lands every copy at once.
"""

from __future__ import annotations

import ctypes
import heapq
import itertools
import time

import torch

from regen.errors import RegenError
from regen.runtime.stats import RuntimeStats
from regen.runtime.storage_views import storage_bytes_view
from regen.runtime.swap.interface import CopyIn, CopyOut, SwapEngine
from regen.runtime.swap.host_pool import HostPool

POISON_BYTE = 0xFF  # a float32 / bfloat16 NaN in every lane it fills
POISON_WORDS = 64  # poisoned 8-byte words in a copy-in buffer, at most...
POISON_STRIDE_BYTES = 256  # ... and at least this many bytes apart (every 256 bytes in buffers up to 16 KiB)
SPIN_S = 0.5e-3  # a wait spins (rather than sleeps) this last stretch: a sleep wakes about 0.2 ms late here


def _copy_bytes(src: torch.Tensor, dst: torch.Tensor) -> None:
    """`dst.copy_(src)`, by one memmove when both are plain contiguous byte ranges (no op dispatched: the
    compute thread's dispatch mode, if any, does not see it)."""
    nbytes = dst.numel() * dst.element_size()
    if (src.is_contiguous() and dst.is_contiguous() and src.dtype == dst.dtype and src.numel() == dst.numel()
            and src.device.type == "cpu" and dst.device.type == "cpu"):
        ctypes.memmove(dst.data_ptr(), src.data_ptr(), nbytes)  # ctypes releases the GIL meanwhile
    else:
        dst.copy_(src)


def poison_stride_bytes(nbytes: int) -> int:
    """The stride of the poisoned words in a copy-in buffer of `nbytes`: POISON_WORDS of them at most."""
    return max(POISON_STRIDE_BYTES, -(-nbytes // (POISON_WORDS * 8)) * 8)


def poison(buf: torch.Tensor) -> None:
    """Set an 8-byte word of the uint8 buffer `buf` to POISON_BYTE every poison_stride_bytes, and its tail."""
    nbytes = buf.numel()
    words = nbytes // 8
    if words:
        buf[:words * 8].view(torch.int64)[::poison_stride_bytes(nbytes) // 8].fill_(-1)  # all bytes 0xFF
    if nbytes > words * 8:
        buf[words * 8:].fill_(POISON_BYTE)


class LinkCopy:
    """One copy over the emulated link: due at `landed_at` (time.perf_counter()), its bytes moved once landed."""

    __slots__ = ("src", "dst", "landed_at", "landed")

    def __init__(self, src: torch.Tensor, dst: torch.Tensor, due_s: float):
        self.src, self.dst = src, dst
        self.landed_at = due_s
        self.landed = False

    def query(self) -> bool:
        """Its bytes are in the destination."""
        return self.landed


class _Direction:
    """One direction of the link: its bandwidth and when it finishes the copies issued so far."""

    def __init__(self, bytes_per_s: float):
        if not bytes_per_s > 0:
            raise RegenError(f"regen.apply: the emulated link needs a positive bandwidth (got {bytes_per_s} B/s)")
        self.bytes_per_s = float(bytes_per_s)
        self.free_at_s = 0.0

    def schedule(self, nbytes: int, now_s: float, after: list[LinkCopy]) -> float:
        """The due time of a copy of `nbytes` issued at `now_s`, after the copies `after` have landed."""
        start_s = max([now_s, self.free_at_s] + [c.landed_at for c in after])
        self.free_at_s = start_s + nbytes / self.bytes_per_s
        return self.free_at_s


class EmulatedEngine(SwapEngine):
    """A CPU device's copies over an emulated link at (d2h, h2d) bytes/s (see the module doc)."""

    def __init__(self, device: torch.device, pool: HostPool, d2h_bytes_per_s: float, h2d_bytes_per_s: float,
                 stats: RuntimeStats | None = None):
        super().__init__(device, pool)
        self.stats = stats
        self.d2h = _Direction(d2h_bytes_per_s)
        self.h2d = _Direction(h2d_bytes_per_s)
        self._due: list[tuple[float, int, LinkCopy]] = []  # heap (due time, issue order, copy) not landed yet
        self._issued = itertools.count()
        self._closed = False

    def _issue(self, direction: _Direction, src: torch.Tensor, dst: torch.Tensor, after: list[LinkCopy]) -> LinkCopy:
        if self._closed:
            raise RegenError("regen.apply: the emulated link was closed (the handle was removed)")
        now_s = time.perf_counter()
        self._land_due(now_s)
        copy = LinkCopy(src, dst, direction.schedule(dst.numel() * dst.element_size(), now_s, after))
        heapq.heappush(self._due, (copy.landed_at, next(self._issued), copy))
        return copy

    def _land_due(self, until_s: float) -> None:
        """Move the bytes of every copy due by `until_s`, in the order they are due."""
        due = self._due
        while due and due[0][0] <= until_s:
            copy = heapq.heappop(due)[2]
            t0 = time.perf_counter()
            _copy_bytes(copy.src, copy.dst)
            copy.src = copy.dst = None  # the compute thread frees the tensors
            copy.landed = True
            if self.stats is not None:
                self.stats.link_copy_cpu_s += time.perf_counter() - t0

    def _wait(self, copy: LinkCopy) -> None:
        """Until `copy` is due (a stall when it is not yet), then land it."""
        if copy.query():
            return
        t0 = time.perf_counter()
        if t0 < copy.landed_at:
            while (left_s := copy.landed_at - time.perf_counter()) > 0:
                if left_s > SPIN_S:
                    time.sleep(left_s - SPIN_S)
            if self.stats is not None:
                self.stats.link_wait_s += time.perf_counter() - t0
        self._land_due(copy.landed_at)

    # ---- forward -------------------------------------------------------------------------------
    def copy_out(self, t: torch.Tensor) -> CopyOut:
        src = storage_bytes_view(t)
        slot = self.pool.allocate(src.numel())
        after = self.pool.take_read_events()  # recycled ranges: their last copy-in has read them
        done = self._issue(self.d2h, src, slot.tensor, after)
        return CopyOut(slot=slot, done_event=done, source=src, device=self.device)

    def release_source(self, out: CopyOut) -> None:
        """Wait for the copy-out (a stall when it is not due yet), then let the device storage go."""
        if out.source is None:
            return
        self._wait(out.done_event)
        out.source = None

    # ---- backward ------------------------------------------------------------------------------
    def copy_in(self, out: CopyOut) -> CopyIn:
        buf = torch.empty(out.slot.nbytes, dtype=torch.uint8, device=self.device)
        poison(buf)
        done = self._issue(self.h2d, out.slot.tensor, buf, [out.done_event])  # after the host bytes are there
        out.slot.last_read_event = done
        return CopyIn(buffer=buf, done_event=done)

    def wait_copy_in(self, cin: CopyIn) -> None:
        if not cin.waited_streams:
            self._wait(cin.done_event)
            cin.waited_streams.add(None)

    def drop_copy_in(self, cin: CopyIn) -> None:
        """The buffer goes back to the allocator only once its copy has landed."""
        self.wait_copy_in(cin)

    def wait_landed(self, copies: list[LinkCopy | None]) -> None:
        """Wait, as a consumer would, until every copy of `copies` has landed."""
        for copy in copies:
            if copy is not None:
                self._wait(copy)

    @property
    def running(self) -> bool:
        """Copies issued and not landed yet."""
        return bool(self._due)

    def close(self) -> None:
        """Land every copy at once; no copy is issued after."""
        self._land_due(float("inf"))
        self._closed = True
