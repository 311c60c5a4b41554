"""The emulated host link: a CPU device's swaps run as they would over a GPU's link.

`regen.apply(model, plan, emulate_link=True)` on a CPU device gives it an `EmulatedEngine`, the
`SwapEngine` backend (interface.py) with one `CopyThread` per direction. Each thread runs its copies one at a
time in issue order, as a CUDA copy stream does: a copy of n bytes starts once the thread is free and the
copies it depends on have landed, takes n / bandwidth of wall time (the plan's d2h_ or h2d_bytes_per_s),
and only then writes its bytes into the destination, so a reader that does not wait reads stale bytes.
Times are kept on the link's own clock (a copy starts when it was issued, the copy before it was due to
end and its dependencies were due to land), so a copy thread that wakes up late (the GIL, a loaded
machine) delays the copy it is doing, never the ones after it. Moving the bytes itself takes time
(memcpy, about 10 GB/s on one core): the thread starts it that long before the copy is due, by its
running estimate of its own memcpy rate, so the bytes land when the copy is due rather than a memcpy
later. A thread wakes from a sleep about 0.2 ms after it meant to
(sleep granularity on 2 busy cores), so it sleeps that much less, by a running estimate of its own lag;
its bytes may then land a little before the copy is due, and its waiters, not the thread, yield the
rest of the way (`LinkEvent.wait`: the compute thread is idle while it waits, whereas a copy thread
yielding in a loop would take the GIL from the compute thread at every op). A copy's `LinkEvent` is
set once its bytes have landed and counts as done from its due time; the compute thread waits on these
events (a copy-in's consumer, the release of a copy-out's source), and those waits are real stalls
(`RuntimeStats.link_wait_s`). Moving the bytes takes CPU time on the copy threads, which a GPU's copy
engines do not take from compute; it is counted apart (`RuntimeStats.link_copy_cpu_s`) so that a
benchmark can say how much of a swap plan's measured time is the emulation's own. A copy-in's buffer is
allocated by the compute thread when the copy-in is issued, so its memory counts from then, and poisoned
(`poison`: POISON_WORDS 8-byte words spread over it, at least POISON_STRIDE_BYTES apart, and its tail set
to POISON_BYTE, a NaN in float lanes) so that a read before the copy landed cannot pass for the right
bytes (a NaN spreads through whatever reads it). Only a few words, since the fill is the compute
thread's work, which a GPU does not do, and each word touches a page of a fresh buffer, whose fault the
compute thread then takes instead of the copy's memmove (a few dozen words cost a few microseconds
where a whole fill costs about as much as the copy). A host range given back to the pool is written by
the next copy-out only after the copy-in that last read it has landed (`HostPool.pending_read_events`).

The threads drop their references to the copied tensors before setting an event, so every tensor is
freed by the compute thread (where the allocator's timeline, regen.measure, sees it). They stop at
`close()`: the handle's remove() once no step holds copies, an exception in its `with` block, or
interpreter exit; copies still queued then land at once. An error inside a copy is raised to the
thread that waits on it.
"""

from __future__ import annotations

import ctypes
import queue
import threading
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
MEMCPY_RATE_MIN_BYTES = 64 * 1024  # smaller copies are mostly call overhead: they do not set the rate
MEMCPY_RATE_SMOOTHING = 0.8  # weight of the running memcpy rate against the latest copy's
WAKE_LAG_SMOOTHING = 0.8  # the same for the wake-up lag...
MAX_WAKE_LAG_S = 2e-3  # ...of which one sample counts this much at most (a thread descheduled for long)


def _copy_bytes(src: torch.Tensor, dst: torch.Tensor) -> None:
    """`dst.copy_(src)` without torch's intra-op thread pool when both are plain contiguous byte ranges: a
    torch op in this thread would start an OpenMP team of its own, whose spinning workers then take the
    cores from the compute thread (measured: unplanned steps 24% slower while a link thread existed)."""
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


class LinkEvent:
    """Set by a copy thread when a copy's bytes have landed (or the copy failed: `error`)."""

    __slots__ = ("_flag", "error", "landed_at")

    def __init__(self):
        self._flag = threading.Event()
        self.error: BaseException | None = None
        self.landed_at = 0.0  # time.perf_counter() when the copy's bytes were due to land

    def query(self) -> bool:
        return self._flag.is_set() and (self.error is not None or time.perf_counter() >= self.landed_at)

    def wait(self) -> None:
        """Until the copy's bytes are there and its due time has come (a copy thread may move them a
        wake-up early; the waiter, idle anyway, yields the rest of the way)."""
        self._flag.wait()
        if self.error is not None:
            raise RegenError(f"regen.apply: an emulated link copy failed: {self.error!r}") from self.error
        while time.perf_counter() < self.landed_at:
            time.sleep(0)  # releases the GIL to the copy threads

    def set(self, error: BaseException | None = None) -> None:
        self.error = error
        self._flag.set()


class _Copy:
    __slots__ = ("src", "dst", "after", "done", "issued_at")

    def __init__(self, src: torch.Tensor, dst: torch.Tensor, after: tuple, done: LinkEvent):
        self.src, self.dst, self.after, self.done = src, dst, after, done
        self.issued_at = time.perf_counter()


class CopyThread:
    """One direction of the link: copies one at a time, in issue order, each nbytes / bytes_per_s long."""

    def __init__(self, name: str, bytes_per_s: float, on_copied=None):
        if not bytes_per_s > 0:
            raise RegenError(f"regen.apply: the emulated link needs a positive bandwidth (got {bytes_per_s} B/s)")
        self.bytes_per_s = float(bytes_per_s)
        self._on_copied = on_copied  # called with each copy's CPU seconds (thread time of moving its bytes)
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._hurry = False  # closing: queued copies land at once
        self._free_at = 0.0  # when the link finishes the copy before (its due time, not the thread's)
        self._memcpy_bytes_per_s: float | None = None  # this thread's own memcpy rate, measured as it copies
        self._wake_lag_s = 0.0  # how long after its target this thread wakes from a sleep, running estimate
        self._thread: threading.Thread | None = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def submit(self, src: torch.Tensor, dst: torch.Tensor, after: tuple = ()) -> LinkEvent:
        """Copy `src` into `dst` (same bytes) after the copies of the events `after` have landed."""
        if self._thread is None:
            raise RegenError("regen.apply: the emulated link was closed (the handle was removed)")
        done = LinkEvent()
        self._queue.put(_Copy(src, dst, tuple(after), done))
        return done

    def _run(self) -> None:
        while True:
            task = self._queue.get()
            if task is None:
                return
            self._do(task)

    def _do(self, task: _Copy) -> None:
        error = None
        try:
            for event in task.after:
                event._flag.wait()
                if event.error is not None:
                    raise RuntimeError("a copy it depends on failed") from event.error
            # the copy starts when it was issued, the link was free and what it depends on had landed, on
            # the link's clock: a late wake-up of this thread delays no later copy
            start = max([task.issued_at, self._free_at] + [e.landed_at for e in task.after])
            nbytes = task.dst.numel() * task.dst.element_size()
            due = start + nbytes / self.bytes_per_s
            self._free_at = task.done.landed_at = due
            self._sleep_until(due - self._memcpy_s(nbytes))
            self._copy(task, nbytes)  # its waiters still wait for `due` (LinkEvent.wait)
            if self._hurry:  # closing: it lands now
                task.done.landed_at = min(due, time.perf_counter())
        except BaseException as exc:  # raised to whoever waits on the copy
            error = exc
        task.src = task.dst = None  # the compute thread frees the tensors
        task.done.set(error)

    def _sleep_until(self, t: float) -> None:
        """Sleep until about `t`, waking early by the thread's wake-up lag."""
        target = t - self._wake_lag_s
        while not self._hurry and (left := target - time.perf_counter()) > 0:
            time.sleep(left)
            lag_s = max(0.0, time.perf_counter() - target)
            self._wake_lag_s = (WAKE_LAG_SMOOTHING * self._wake_lag_s
                                + (1 - WAKE_LAG_SMOOTHING) * min(lag_s, MAX_WAKE_LAG_S))

    def _memcpy_s(self, nbytes: int) -> float:
        """How long moving `nbytes` will take this thread (0 before its first copy)."""
        return nbytes / self._memcpy_bytes_per_s if self._memcpy_bytes_per_s else 0.0

    def _copy(self, task: _Copy, nbytes: int) -> None:
        """Move the bytes; update the memcpy rate (copies of 64 KiB and more) and the CPU time spent."""
        wall_start_s, cpu_start_s = time.perf_counter(), time.thread_time()
        _copy_bytes(task.src, task.dst)
        wall_s = time.perf_counter() - wall_start_s
        if nbytes >= MEMCPY_RATE_MIN_BYTES and wall_s > 0:
            rate = nbytes / wall_s
            self._memcpy_bytes_per_s = rate if self._memcpy_bytes_per_s is None else (
                MEMCPY_RATE_SMOOTHING * self._memcpy_bytes_per_s + (1 - MEMCPY_RATE_SMOOTHING) * rate)
        if self._on_copied is not None:
            self._on_copied(time.thread_time() - cpu_start_s)

    @property
    def running(self) -> bool:
        return self._thread is not None

    def close(self) -> None:
        """Land every queued copy at once and stop the thread."""
        if self._thread is None:
            return
        self._hurry = True
        self._queue.put(None)
        self._thread.join()
        self._thread = None


class EmulatedEngine(SwapEngine):
    """A CPU device's copies over an emulated link at (d2h, h2d) bytes/s (see the module doc)."""

    def __init__(self, device: torch.device, pool: HostPool, d2h_bytes_per_s: float, h2d_bytes_per_s: float,
                 stats: RuntimeStats | None = None):
        super().__init__(device, pool)
        self.stats = stats
        self._stats_lock = threading.Lock()  # both copy threads add to stats.link_copy_cpu_s
        self.d2h = CopyThread("regen-link-d2h", d2h_bytes_per_s, self._count_copy_cpu)
        self.h2d = CopyThread("regen-link-h2d", h2d_bytes_per_s, self._count_copy_cpu)

    def _count_copy_cpu(self, cpu_s: float) -> None:
        if self.stats is not None:
            with self._stats_lock:
                self.stats.link_copy_cpu_s += cpu_s

    def _wait(self, event: LinkEvent) -> None:
        if event.query():
            event.wait()  # raises a failed copy's error
            return
        t0 = time.perf_counter()
        event.wait()
        if self.stats is not None:
            self.stats.link_wait_s += time.perf_counter() - t0

    # ---- forward -------------------------------------------------------------------------------
    def copy_out(self, t: torch.Tensor) -> CopyOut:
        src = storage_bytes_view(t)
        slot = self.pool.allocate(src.numel())
        after = tuple(self.pool.take_read_events())  # recycled ranges: their last copy-in has read them
        done = self.d2h.submit(src, slot.tensor, after)
        return CopyOut(slot=slot, done_event=done, source=src, device=self.device)

    def release_source(self, out: CopyOut) -> None:
        """Wait for the copy-out (a stall when it is still running), then let the device storage go."""
        if out.source is None:
            return
        self._wait(out.done_event)
        out.source = None

    # ---- backward ------------------------------------------------------------------------------
    def copy_in(self, out: CopyOut) -> CopyIn:
        buf = torch.empty(out.slot.nbytes, dtype=torch.uint8, device=self.device)
        poison(buf)
        done = self.h2d.submit(out.slot.tensor, buf, (out.done_event,))  # after the host bytes are there
        out.slot.last_read_event = done
        return CopyIn(buffer=buf, done_event=done)

    def wait_copy_in(self, cin: CopyIn) -> None:
        if not cin.waited_streams:
            self._wait(cin.done_event)
            cin.waited_streams.add(None)

    def drop_copy_in(self, cin: CopyIn) -> None:
        """The buffer goes back to the allocator only once no copy writes it."""
        self.wait_copy_in(cin)

    def close(self) -> None:
        self.d2h.close()
        self.h2d.close()
