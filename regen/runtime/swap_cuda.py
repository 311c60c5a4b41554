"""The CUDA backend of `SwapEngine` (swap.py): copies on a device-to-host and a host-to-device stream.

A copy-out waits on an event recorded on the compute stream (and on the copy-ins that last read its
recycled host ranges) and records its own completion event; the device storage is kept alive by the
caller until the compute stream has waited on that event (no `record_stream`). A copy-in allocates its
buffer on the compute stream, runs on the host-to-device stream after an event from the compute stream
and the copy-out's completion, and records an event the consumer waits on.
"""

from __future__ import annotations

import torch

from regen.runtime.swap import CopyIn, CopyOut, HostPool, SwapEngine, storage_bytes_view


class CudaEngine(SwapEngine):
    """Copies between one CUDA device and the (pinned) host pool on two side streams."""

    def __init__(self, device: torch.device, pool: HostPool):
        super().__init__(device, pool)
        self.d2h_stream = torch.cuda.Stream(device)
        self.h2d_stream = torch.cuda.Stream(device)

    # ---- forward -------------------------------------------------------------------------------
    def copy_out(self, t: torch.Tensor) -> CopyOut:
        src = storage_bytes_view(t)
        slot = self.pool.allocate(src.numel())
        compute = torch.cuda.current_stream(self.device)
        ready = torch.cuda.Event()
        ready.record(compute)
        self.d2h_stream.wait_event(ready)
        for event in self.pool.pending_read_events:  # recycled ranges: their last copy-in has read them
            self.d2h_stream.wait_event(event)
        self.pool.pending_read_events.clear()
        with torch.cuda.stream(self.d2h_stream):
            slot.tensor.copy_(src, non_blocking=True)
            done = torch.cuda.Event()
            done.record(self.d2h_stream)
        return CopyOut(slot=slot, done_event=done, source=src, device=self.device)

    def release_source(self, out: CopyOut) -> None:
        """The compute stream first waits on the copy, so the allocator can only hand the memory to work
        ordered after it."""
        if out.source is None:
            return
        torch.cuda.current_stream(self.device).wait_event(out.done_event)
        out.source = None

    # ---- backward ------------------------------------------------------------------------------
    def copy_in(self, out: CopyOut) -> CopyIn:
        buf = torch.empty(out.slot.nbytes, dtype=torch.uint8, device=self.device)
        compute = torch.cuda.current_stream(self.device)
        ready = torch.cuda.Event()
        ready.record(compute)
        self.h2d_stream.wait_event(ready)
        self.h2d_stream.wait_event(out.done_event)  # the host bytes are there
        with torch.cuda.stream(self.h2d_stream):
            buf.copy_(out.slot.tensor, non_blocking=True)
            done = torch.cuda.Event()
            done.record(self.h2d_stream)
        out.slot.last_read_event = done
        return CopyIn(buffer=buf, done_event=done)

    def wait_copy_in(self, cin: CopyIn) -> None:
        """Make the current (consumer) stream wait for the copy-in."""
        stream = torch.cuda.current_stream(self.device)
        if stream.cuda_stream not in cin.waited_streams:
            stream.wait_event(cin.done_event)
            cin.waited_streams.add(stream.cuda_stream)

    def drop_copy_in(self, cin: CopyIn) -> None:
        """Order the compute stream after the copy into the buffer before it goes back to the allocator."""
        if not cin.waited_streams:
            stream = torch.cuda.current_stream(self.device)
            stream.wait_event(cin.done_event)
            cin.waited_streams.add(stream.cuda_stream)
