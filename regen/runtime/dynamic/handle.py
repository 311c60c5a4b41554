"""`regen.apply(model, memory_cap=...)`: dynamic mode's handle (a context manager, or `.remove()`).

A forward pre-hook on the root module starts a step (step.py) whenever the model is called with grad
enabled and pushes the step's saved-tensor hooks; they are popped when the next step starts or the handle
is removed. The handle's dispatch mode (`DynamicMode`) is pushed at the first step and popped by
`remove()`: it hands every counted op to the current step (captured in forward; in backward, on CPU,
counted as memory in use) and passes ops through while paused (rebuilds) or between steps.

An exception inside the `with` block releases every live step and leaves no hook, mode or step behind.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode, _get_current_dispatch_mode, _get_current_dispatch_mode_stack

from regen.errors import RegenError
from regen.opinfo import is_counted
from regen.runtime.apply import _unwrap  # the module a plan would describe: DDP and DataParallel unwrapped
from regen.runtime.dynamic.memory import DeviceMemory, TrackedMemory
from regen.runtime.dynamic.policy import POLICIES
from regen.runtime.dynamic.step import DynamicStep, OverCapWarning
from regen.runtime.regions import module_device
from regen.units import parse_memory_cap

__all__ = ["DynamicHandle", "DynamicStats", "OverCapWarning"]


@dataclass
class DynamicStats:
    """What a dynamic handle did so far (cumulative over steps)."""

    steps: int = 0  # steps started (training forwards with grad)
    evictions: int = 0  # held nodes dropped to stay under the cap
    rebuilds: int = 0  # recipes replayed (a dropped node needed again, or an input of one)
    input_rebuilds: int = 0  # of which inputs of another rebuild (DTR's recursion)
    over_cap_steps: int = 0  # steps that passed the cap with nothing left to drop (OverCapWarning)
    peak_in_use_bytes: int = 0  # the highest memory in use seen at a pack, unpack or rebuild (memory.py)


class DynamicMode(TorchDispatchMode):
    """Hands every counted op to the current step: `forward_op` until backward begins, then `backward_op`."""

    def __init__(self, count_backward: bool):
        super().__init__()
        self.step: DynamicStep | None = None
        self.paused = 0
        self.count_backward = count_backward  # CPU: backward's outputs are memory in use

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if kwargs is None:
            kwargs = {}
        step = self.step
        if step is None or self.paused or step.released or not is_counted(func):
            return func(*args, **kwargs)
        if step.in_backward or torch._C._current_graph_task_id() != -1:
            if self.count_backward:
                return step.backward_op(func, args, kwargs)
            step.in_backward = True
            return func(*args, **kwargs)
        return step.forward_op(func, args, kwargs)

    def pause(self):
        return _Paused(self)


class _Paused:
    __slots__ = ("mode",)

    def __init__(self, mode: DynamicMode):
        self.mode = mode

    def __enter__(self):
        self.mode.paused += 1

    def __exit__(self, *exc):
        self.mode.paused -= 1


class DynamicHandle:
    """The object `regen.apply(model, memory_cap=...)` returns: a context manager, or call `.remove()`."""

    def __init__(self, model: nn.Module, memory_cap: int | str, policy: str = "graph"):
        if not isinstance(model, nn.Module):
            raise RegenError(f"regen.apply: expected a torch.nn.Module, got {type(model).__name__}")
        if hasattr(model, "_orig_mod") and type(model).__name__ == "OptimizedModule":
            raise RegenError("regen.apply: this module is torch.compile'd; dynamic mode replays ops one by one, so "
                             "apply it to the original module (model._orig_mod) and train it without torch.compile")
        if policy not in POLICIES:
            raise RegenError(f"regen.apply: policy must be one of {', '.join(POLICIES)}, got {policy!r}")
        self.cap_bytes = cap_bytes(memory_cap)
        self.policy = policy
        self.model = model
        self.root = _unwrap(model)
        device = module_device(self.root)
        on_cuda = device is not None and device.type == "cuda"
        self.memory = DeviceMemory(device) if on_cuda else TrackedMemory()
        self.mode = DynamicMode(count_backward=not on_cuda)
        self.mode_pushed = False
        self.stats = DynamicStats()
        self.current: DynamicStep | None = None
        self.live_steps: list[DynamicStep] = []
        self._hooks_pushed: set[DynamicStep] = set()
        self._depth = 0
        self._removed = False
        self._hooks = [self.root.register_forward_pre_hook(self._pre_hook),
                       self.root.register_forward_hook(self._post_hook, always_call=True)]

    # ---- public -----------------------------------------------------------------------------------
    def __enter__(self) -> "DynamicHandle":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        self.remove(abort=exc_type is not None)

    def remove(self, abort: bool = False) -> None:
        """Remove every hook and the dispatch mode. With abort=True (an exception ended the `with` block)
        the live steps are released too; otherwise a step whose graph autograd still holds can finish its
        backward (rebuilding what it dropped)."""
        if self._removed:
            return
        self._removed = True
        for h in self._hooks:
            h.remove()
        self._hooks = []
        step = self.current
        if step is not None:
            step.closed = True
            self._pop_hooks_of(step)
        if self.mode_pushed and _get_current_dispatch_mode() is self.mode:
            self.mode.__exit__(None, None, None)
            self.mode_pushed = False
        elif self.mode_pushed and self.mode not in _get_current_dispatch_mode_stack():
            self.mode_pushed = False
        self.mode.step = None
        self.current = None
        for s in list(self.live_steps):
            if abort:
                s.release(aborted=True)
            else:
                s.maybe_release()

    @property
    def active_steps(self) -> int:
        """Steps still holding nodes (their graph is alive)."""
        return len(self.live_steps)

    @property
    def hooks_installed(self) -> bool:
        return bool(self._hooks) or self.mode_pushed or bool(self._hooks_pushed)

    # ---- step boundaries --------------------------------------------------------------------------
    def _pre_hook(self, module, args):
        self._depth += 1
        if self._depth > 1 or not torch.is_grad_enabled():
            return
        if torch._C._current_graph_task_id() != -1:  # a forward run inside backward (checkpoint): leave it
            return
        if torch.compiler.is_compiling():
            raise RegenError("regen.apply: the model is being run by torch.compile; dynamic mode runs eager "
                             "execution, so train the module under regen.apply without torch.compile")
        prev = self.current
        if prev is not None:
            prev.closed = True
            self._pop_hooks_of(prev)
            prev.maybe_release()
        self.memory.begin_step(self.root)
        step = DynamicStep(self.memory, self.cap_bytes, self.policy, self.stats, self.mode.pause, self._released)
        self.stats.steps += 1
        self.current = step
        self.live_steps.append(step)
        self.mode.step = step
        if not self.mode_pushed:
            self.mode.__enter__()
            self.mode_pushed = True
        torch._C._autograd._push_saved_tensors_default_hooks(step.pack, step.unpack)
        self._hooks_pushed.add(step)

    def _post_hook(self, module, args, output):
        self._depth = max(0, self._depth - 1)

    def _pop_hooks_of(self, step: DynamicStep) -> None:
        if step not in self._hooks_pushed:
            return
        top = torch._C._autograd._top_saved_tensors_default_hooks(False)
        if top is not None and top[0] == step.pack:
            torch._C._autograd._pop_saved_tensors_default_hooks()
            self._hooks_pushed.discard(step)
        else:
            warnings.warn("regen.apply: other saved-tensor hooks were pushed above regen's and not popped; "
                          "leaving them in place", RuntimeWarning, stacklevel=3)

    def _released(self, step: DynamicStep) -> None:
        if step in self.live_steps:
            self.live_steps.remove(step)


def cap_bytes(memory_cap: int | str) -> int:
    """The cap in bytes: a positive int, or text such as '6GiB' (regen.units.parse_memory_cap)."""
    if isinstance(memory_cap, bool) or not isinstance(memory_cap, (int, str)):
        raise RegenError(f"regen.apply: memory_cap must be bytes (an int) or text such as '6GiB', got {memory_cap!r}")
    if isinstance(memory_cap, int):
        if memory_cap <= 0:
            raise RegenError(f"regen.apply: memory_cap must be positive, got {memory_cap}")
        return memory_cap
    return parse_memory_cap(memory_cap, 0, flag="memory_cap",
                            percent_of="the unplanned peak (dynamic mode has no profile)")
