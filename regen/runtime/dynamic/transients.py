"""CPU: what each backward op allocates and frees inside itself, learned per call, so later checks keep room for it.

A CPU kernel's temporaries are no tensors the runtime sees (cap_memory.py counts storages the step's ops
return): a depthwise convolution's backward converts its operands inside the op, 6.5 MB on ConvNeXtV2's
tiny config against a cap of 8.2 MB, and its steps measured 7% over the cap by the allocator, none of it in
the runtime's count. A CPU allocator keeps no counter to read either. So a dynamic step of each call runs under
torch.profiler's allocator events, each backward op inside a marker (`TransientRecorder`), and each op's
temporary (its peak inside the op over what it still holds at its end) becomes part of the room the later
steps' checks keep before that op (dynamic_step.py, Note [ Room for the next op ]).

Note [ Recording a step's backward ]
1. Recording starts when the step starts (the model's call, outside any backward) and stops right after the
   step's backward returns to the program (`torch.Tensor.backward`, `torch.autograd.backward` or
   `torch.autograd.grad`, seen by a torch function mode pushed meanwhile), outside it again: autograd puts the
   thread's profiler state back as it found it when a backward ends, and sets it per op inside, so a recording
   started or stopped inside a backward is undone there (and one left half on makes a later profiler fail).
   A step that never runs its backward stops recording when the next step starts or the handle goes. The
   mode is popped at the model's next call (regen.runtime.stacks: an orphan from the start), planned,
   profiled or dynamic, and taken out of the stack wherever it is when the step is over: left on, every torch
   call of the steps after would pass through it.
2. Nothing is recorded while another profiler runs (torch.profiler does not nest): a later step tries again.
3. One step is recorded per call (every op an event: the built-in GPT's first step took 113 ms recorded, 92 ms
   unrecorded, its later steps 72): the engine's first, then a call's second (engine.py, Note [ Temporaries per
   call ]); its figures stand for the backward ops at the same index in the later steps of its call, as the step
   before's outputs do. The recording's allocator events also give the step's own peak (`peak_increase_bytes`).
"""

from __future__ import annotations

import contextlib
import warnings
from itertools import accumulate
from typing import Callable

import torch
from torch.overrides import TorchFunctionMode

from regen.cpu_allocator_events import cpu_allocator_events, every_cpu_allocator_event
from regen.runtime import stacks

_MARK = "regen::backward_op::"
_BACKWARD_CALLS = (torch.Tensor.backward, torch.autograd.backward, torch.autograd.grad)


class TransientRecorder:
    """One step's backward ops' temporaries by backward op index (`bytes_by_op`) and the most the step allocated
    and still held at once from its start (`peak_increase_bytes`: the allocator's figure), once its backward
    returned; then `done(recorder)` is called."""

    def __init__(self, done: Callable[["TransientRecorder"], None] = lambda recorder: None):
        self._prof = None
        self._watcher: _AfterBackward | None = None
        self._done = done
        self.bytes_by_op: dict[int, int] | None = None
        self.peak_increase_bytes: int | None = None

    @property
    def recording(self) -> bool:
        return self._prof is not None

    def start(self) -> bool:
        """At the step's start (Note [ Recording a step's backward ]); False when another profiler runs."""
        from torch.profiler import ProfilerActivity, profile

        if torch._C._autograd._profiler_enabled():
            return False
        prof = profile(activities=[ProfilerActivity.CPU], profile_memory=True)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            prof.__enter__()
        self._prof = prof
        self._watcher = _AfterBackward(self._finish)
        self._watcher.__enter__()
        stacks.orphan(self._watcher)  # popped at the model's next call, whatever kind of step that is
        return True

    def around(self, i: int):
        """The context backward op `i` runs in."""
        if self._prof is None:
            return contextlib.nullcontext()
        return torch.profiler.record_function(f"{_MARK}{i}")

    def close(self) -> None:
        """The step is over: stop recording if its backward never returned (no figures), pop the watcher."""
        if self._prof is not None:
            self._stop()
        watcher, self._watcher = self._watcher, None
        if watcher is None:
            return
        stacks.take_out(watcher)

    def _finish(self) -> None:
        if self._prof is not None:
            roots = list(self._stop().profiler.kineto_results.experimental_event_tree())
            counted = cpu_allocator_events(roots)  # no free of a block allocated before the recording
            self.bytes_by_op = _temporaries_by_marker(roots, set(counted))
            self.peak_increase_bytes = max(accumulate((e.size_bytes for e in counted), initial=0))
            self._done(self)

    def _stop(self):
        prof, self._prof = self._prof, None
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            prof.__exit__(None, None, None)
        return prof


class _AfterBackward(TorchFunctionMode):
    """Calls `done()` once a backward the program started (outside any backward) has returned."""

    def __init__(self, done):
        super().__init__()
        self.done = done

    def __torch_function__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func in _BACKWARD_CALLS and torch._C._current_graph_task_id() == -1:
            self.done()
        return out


def _temporaries_by_marker(roots, counted: set) -> dict[int, int]:
    """Per marked op: the most its allocations (those `counted`) rose inside it over what it held at its end."""
    out: dict[int, int] = {}
    stack = list(roots)
    while stack:
        event = stack.pop()
        if not event.name.startswith(_MARK):
            stack.extend(event.children)
            continue
        level = peak = 0
        for e in every_cpu_allocator_event(event.children):
            if e in counted:
                level += e.size_bytes
                peak = max(peak, level)
        out[int(event.name[len(_MARK):])] = max(0, peak - max(level, 0))
    return out
