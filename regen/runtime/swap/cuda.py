"""The CUDA backend of `SwapEngine` (interface.py): copies on a device-to-host and a host-to-device stream.

Every stream, event and wait names the engine's device, so a model on `cuda:1` is served right while
device 0 is current. A copy-out waits on the compute stream (the stream current at the pack, which the
source was allocated on) and on the copy-ins that last read its recycled host ranges, and records its
own completion event; the device storage is let go only after that allocation stream has waited on the
copy (no `record_stream`: the allocator may hand the memory to later work on that stream at once). A
copy-in allocates its buffer on the compute stream, runs on the host-to-device stream after the
compute stream's point of issue and the copy-out's completion, and records an event the consumer waits
on; a consumer on another stream than the buffer's allocation stream also `record_stream`s it, so the
allocator keeps the buffer until that stream's reads are done.

Events are reused: one "the compute stream got here" event per engine (a wait takes the event's state
when it is enqueued, so it can be recorded again at once), and completion events go back to a free
list per copy stream when nothing waits on them any more (a copy-out's when its host range is given
back, a copy-in's when its buffer is dropped). A completion event is only ever recorded again on its own
stream, later: a wait on it that is still to come (a reused range's next copy-out) then waits for a
later copy of the same stream, never for less.
"""

from __future__ import annotations

import torch

from regen.runtime.storage_views import storage_bytes_view
from regen.runtime.swap.interface import CopyIn, CopyOut, SwapEngine
from regen.runtime.swap.host_pool import HostPool


class CudaEngine(SwapEngine):
    """Copies between one CUDA device and the pinned host pool on two side streams."""

    def __init__(self, device: torch.device, pool: HostPool):
        super().__init__(device, pool)
        pool.use_pinned_memory()  # at the first CUDA copy-out: a model moved to the GPU after apply()
        self.d2h_stream = torch.cuda.Stream(device)
        self.h2d_stream = torch.cuda.Stream(device)
        self._reached = torch.cuda.Event()  # "the compute stream got here", recorded again for every copy
        self._free_d2h_events: list = []  # completion events recorded on d2h_stream, free for reuse
        self._free_h2d_events: list = []

    def _after_compute(self, copy_stream) -> object:
        """Order `copy_stream` after the work issued so far on the compute stream, which it returns."""
        compute = torch.cuda.current_stream(self.device)
        self._reached.record(compute)
        copy_stream.wait_event(self._reached)
        return compute

    @staticmethod
    def _done_event(free: list, stream) -> object:
        done = free.pop() if free else torch.cuda.Event()
        done.record(stream)
        return done

    # ---- forward -------------------------------------------------------------------------------
    def copy_out(self, t: torch.Tensor) -> CopyOut:
        src = storage_bytes_view(t)
        slot = self.pool.allocate(src.numel())
        compute = self._after_compute(self.d2h_stream)
        for event in self.pool.take_read_events():  # recycled ranges: their last copy-in has read them
            self.d2h_stream.wait_event(event)
        with torch.cuda.stream(self.d2h_stream):
            slot.tensor.copy_(src, non_blocking=True)
        done = self._done_event(self._free_d2h_events, self.d2h_stream)
        return CopyOut(slot=slot, done_event=done, source=src, device=self.device, stream=compute)

    def release_source(self, out: CopyOut) -> None:
        """The source's allocation stream first waits on the copy, so the allocator can only hand the
        memory to work ordered after it, whichever stream is current now."""
        if out.source is None:
            return
        out.stream.wait_event(out.done_event)
        out.source = None

    def retire(self, out: CopyOut) -> None:
        if out.done_event is not None:
            self._free_d2h_events.append(out.done_event)
            out.done_event = None

    # ---- backward ------------------------------------------------------------------------------
    def copy_in(self, out: CopyOut) -> CopyIn:
        buf = torch.empty(out.slot.nbytes, dtype=torch.uint8, device=self.device)
        compute = self._after_compute(self.h2d_stream)
        self.h2d_stream.wait_event(out.done_event)  # the host bytes are there
        with torch.cuda.stream(self.h2d_stream):
            buf.copy_(out.slot.tensor, non_blocking=True)
        done = self._done_event(self._free_h2d_events, self.h2d_stream)
        out.slot.last_read_event = done
        return CopyIn(buffer=buf, done_event=done, stream=compute)

    def wait_copy_in(self, cin: CopyIn) -> None:
        """Make the current (consumer) stream wait for the copy-in; a consumer stream other than the
        buffer's allocation stream is recorded on the buffer, so its reads finish before the memory is
        reused."""
        stream = torch.cuda.current_stream(self.device)
        if stream.cuda_stream not in cin.waited_streams:
            stream.wait_event(cin.done_event)
            cin.waited_streams.add(stream.cuda_stream)
            if stream.cuda_stream != cin.stream.cuda_stream:
                cin.buffer.record_stream(stream)

    def drop_copy_in(self, cin: CopyIn) -> None:
        """A buffer no stream waited for: its allocation stream is ordered after the copy into it before
        the buffer goes back to the allocator. Its completion event is free again."""
        if not cin.waited_streams:
            cin.stream.wait_event(cin.done_event)
            cin.waited_streams.add(cin.stream.cuda_stream)
        self._free_h2d_events.append(cin.done_event)
