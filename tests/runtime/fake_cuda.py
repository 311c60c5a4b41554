"""A stand-in for torch.cuda's streams and events on a machine without a GPU.

`FakeCuda.install(monkeypatch)` replaces `torch.cuda.Stream`, `Event`, `current_stream`, `stream` and
`synchronize`, and `Tensor.record_stream`, with objects that keep a record of what was asked of them, so
the CUDA code paths (regen.runtime.swap.cuda, the profiler's CUDA timing) run here on CPU tensors and
their ordering can be checked: which stream an event was recorded on, which events a stream waited on,
which streams a buffer was recorded on. Copies run at once, so bytes are right whatever the ordering:
these tests check the ordering calls, never timing. A call that leaves the device to the current one
(no device or stream given) is listed in `unnamed_device_calls`.
"""

from __future__ import annotations

import itertools
from contextlib import contextmanager

import torch

_ids = itertools.count(1)


class FakeStream:
    def __init__(self, device: torch.device, name: str):
        self.device = device
        self.name = name
        self.cuda_stream = next(_ids)
        self.waited: list[FakeEvent] = []  # events this stream waited on, in order

    def wait_event(self, event: "FakeEvent") -> None:
        self.waited.append(event)

    def __repr__(self) -> str:
        return f"FakeStream({self.name} on {self.device})"


class FakeEvent:
    def __init__(self, fake: "FakeCuda", enable_timing: bool = False, **_):
        fake.events_created += 1
        self.fake = fake
        self.stream: FakeStream | None = None  # where it was last recorded
        self.records = 0

    def record(self, stream: FakeStream | None = None) -> None:
        if stream is None:
            self.fake.unnamed_device_calls.append("Event.record")
            stream = self.fake.current_stream(self.fake.current_device)
        self.stream = stream
        self.records += 1

    def query(self) -> bool:
        return True

    def synchronize(self) -> None:
        pass

    def elapsed_time(self, end: "FakeEvent") -> float:
        return 1.0  # ms


class FakeCuda:
    def __init__(self, current_device: str = "cuda:0"):
        self.current_device = torch.device(current_device)
        self.current: dict[torch.device, FakeStream] = {}
        self.unnamed_device_calls: list[str] = []
        self.events_created = 0
        self.synchronized: list[torch.device] = []
        self.recorded_streams: list[tuple[int, FakeStream]] = []  # (storage data_ptr, stream) of record_stream
        self.streams_created: list[FakeStream] = []

    def install(self, monkeypatch) -> "FakeCuda":
        for name in ("current_stream", "Stream", "Event", "stream", "synchronize"):
            monkeypatch.setattr(torch.cuda, name, getattr(self, name))
        monkeypatch.setattr(torch.Tensor, "record_stream", lambda t, stream: self._record_stream(t, stream))
        return self

    def _device(self, device, what: str) -> torch.device:
        if device is None:
            self.unnamed_device_calls.append(what)
            return self.current_device
        return torch.device(device)

    def current_stream(self, device=None) -> FakeStream:
        d = self._device(device, "current_stream")
        if d not in self.current:
            self.current[d] = FakeStream(d, "default")
        return self.current[d]

    def Stream(self, device=None) -> FakeStream:  # noqa: N802 (torch.cuda.Stream)
        s = FakeStream(self._device(device, "Stream"), f"side{len(self.streams_created)}")
        self.streams_created.append(s)
        return s

    def Event(self, **kwargs) -> FakeEvent:  # noqa: N802 (torch.cuda.Event)
        return FakeEvent(self, **kwargs)

    @contextmanager
    def stream(self, s: FakeStream):
        prev = self.current_stream(s.device)
        self.current[s.device] = s
        try:
            yield
        finally:
            self.current[s.device] = prev

    def synchronize(self, device=None) -> None:
        self.synchronized.append(self._device(device, "synchronize"))

    def _record_stream(self, tensor: torch.Tensor, stream: FakeStream) -> None:
        self.recorded_streams.append((tensor.untyped_storage().data_ptr(), stream))
