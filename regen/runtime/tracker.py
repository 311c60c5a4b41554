"""The dispatch mode that numbers a step's forward ops (docs/internals.md "Op numbering").

`ForwardTracker` hands every counted forward op to the current step's `forward_op` (step.py,
forward_ops.py: writer map, fingerprint, recipe captures). The step's `phase` says what to do:
FORWARD counts the op; TAIL (all of the plan's forward ops ran) closes the step's forward at the next
op; CLOSED passes ops straight through, and so does the mode while paused: regen's own copies and
replays run paused so they are never counted.
"""

from __future__ import annotations

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from regen.opinfo import is_counted

# regen's own small ops (detach, set_, copies, replays' bookkeeping) skip every Python dispatch mode: they
# are never counted and cost no Python round trip
regen_ops = torch._C._DisableTorchDispatch

PHASE_FORWARD = 0  # counting forward ops
PHASE_TAIL = 1  # all of the plan's forward ops ran; the last one's outputs may still be packed
PHASE_CLOSED = 2  # forward over: every later pack keeps


class ForwardTracker(TorchDispatchMode):
    """The dispatch mode of one `regen.apply` handle; `step` is the step whose forward it counts.

    The step's `phase` says what to do: FORWARD counts the op; TAIL (all planned forward ops seen)
    closes matching at the next op; CLOSED passes ops straight through.
    """

    def __init__(self):
        super().__init__()
        self.step = None
        self.paused = 0
        self._counted: dict = {}  # func -> opinfo.is_counted(func), cached (this runs on every op)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        step = self.step
        if kwargs is None:
            kwargs = {}
        if step is None or self.paused or step.phase == PHASE_CLOSED:
            return func(*args, **kwargs)
        counted = self._counted.get(func)
        if counted is None:
            counted = self._counted[func] = is_counted(func)
        if not counted:
            return func(*args, **kwargs)
        if step.phase == PHASE_TAIL:  # an op after the planned forward: nothing more is matched
            step.end_forward()
            return func(*args, **kwargs)
        if torch._C._current_graph_task_id() != -1:
            step.backward_began()
            return func(*args, **kwargs)
        return step.forward_op(func, args, kwargs)

    def pause(self):
        return _Paused(self)


class _Paused:
    __slots__ = ("tracker",)

    def __init__(self, tracker: ForwardTracker):
        self.tracker = tracker

    def __enter__(self):
        self.tracker.paused += 1

    def __exit__(self, *exc):
        self.tracker.paused -= 1
