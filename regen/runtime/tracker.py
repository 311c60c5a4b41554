"""The dispatch mode that numbers a step's forward ops (docs/internals.md "Op numbering").

`ForwardTracker` hands every counted forward op to the current step's `forward_op` (step.py,
forward_ops.py: writer map, fingerprint, recipe captures). The step's `stage` says what to do:
COUNTING counts the op; TAIL (all of the plan's forward ops ran) closes the step's forward at the next
op; CLOSED passes ops straight through, and so does the mode while paused: regen's own copies and
replays run paused so they are never counted.

A dispatch mode cannot pop itself: it is set aside while it handles an op and put back after. So when
the plan's last op runs and nothing is packed after it (a loss such as `mse_loss` computed outside the
model: no root hook follows either), the op that would close the forward, `loss.backward()`'s first,
finds the tracker unable to leave, and the whole backward would run through it in Python. The tracker
therefore pushes `ForwardCloser`, a torch function mode, once the last op has run: the next torch call
made outside regen's own code (`loss.backward()`, `loss.item()`) ends the step's forward before it
runs, from above the dispatch, where the tracker can be popped.
"""

from __future__ import annotations

from typing import Callable

import torch
from torch.overrides import TorchFunctionMode, _get_current_function_mode
from torch.utils._python_dispatch import TorchDispatchMode

from regen.opinfo import is_counted
from regen.runtime import stacks

# regen's own small ops (detach, set_, copies, replays' bookkeeping) skip every Python dispatch mode: they
# are never counted and cost no Python round trip
regen_ops = torch._C._DisableTorchDispatch

# a planned step's stage in its forward (Step.stage; a profile's ops have a phase, forward or backward)
STAGE_COUNTING = 0  # counting forward ops
STAGE_TAIL = 1  # all of the plan's forward ops ran; the last one's outputs may still be packed
STAGE_CLOSED = 2  # forward over: every later pack keeps


class ForwardTracker(TorchDispatchMode):
    """The dispatch mode of one `regen.apply` handle; `step` is the step whose forward it counts.

    The step's `stage` says what to do: COUNTING counts the op; TAIL (all planned forward ops seen)
    closes matching at the next op; CLOSED passes ops straight through.
    """

    def __init__(self, outside_model: Callable[[], bool] = lambda: True):
        """`outside_model()`: no call of the model's root module is running (its hook then closes a tail)."""
        super().__init__()
        self.step = None
        self.outside_model = outside_model
        self.paused = 0
        self._counted: dict = {}  # func -> opinfo.is_counted(func), cached (this runs on every op)
        self.closer = ForwardCloser(self)
        self.closer_pushed = False

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        step = self.step
        if kwargs is None:
            kwargs = {}
        if step is None or self.paused or step.stage == STAGE_CLOSED:
            return func(*args, **kwargs)
        counted = self._counted.get(func)
        if counted is None:
            counted = self._counted[func] = is_counted(func)
        if not counted:
            return func(*args, **kwargs)
        if step.stage == STAGE_TAIL:  # an op after the planned forward: nothing more is matched
            step.end_forward()
            return func(*args, **kwargs)
        if torch._C._current_graph_task_id() != -1:
            step.backward_began()
            return func(*args, **kwargs)
        out = step.forward_op(func, args, kwargs)
        if step.stage == STAGE_TAIL and not self.closer_pushed:  # the last planned op ran
            self.closer.__enter__()
            self.closer_pushed = True
        return out

    def pause(self):
        return _Paused(self)

    def pop_closer(self, force: bool) -> None:
        """Pop the closer when it is on top of the torch function modes (it is set aside while it handles
        a call, and stays until the next chance); with force, take it out wherever it is on the stack (or
        forget one no longer on it)."""
        if self.closer_pushed and (force or _get_current_function_mode() is self.closer):
            stacks.take_out(self.closer)
            self.closer_pushed = False


class ForwardCloser(TorchFunctionMode):
    """Ends the tracked step's forward at the first torch call after its last planned op made outside the
    model (inside it, the root module's hook ends it) and outside regen's own code (regen's hooks run with
    the Python dispatch key excluded: `regen_ops`)."""

    def __init__(self, tracker: ForwardTracker):
        super().__init__()
        self.tracker = tracker

    def __torch_function__(self, func, types, args=(), kwargs=None):
        tracker = self.tracker
        step = tracker.step
        if (step is not None and step.stage == STAGE_TAIL and torch._C._current_graph_task_id() == -1
                and not torch._C._dispatch_tls_is_dispatch_key_excluded(torch._C.DispatchKey.Python)
                and tracker.outside_model()):
            step.end_forward()
        return func(*args, **(kwargs or {}))


class _Paused:
    __slots__ = ("tracker",)

    def __init__(self, tracker: ForwardTracker):
        self.tracker = tracker

    def __enter__(self):
        self.tracker.paused += 1

    def __exit__(self, *exc):
        self.tracker.paused -= 1
