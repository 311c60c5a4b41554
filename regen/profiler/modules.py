"""Module paths and module calls of the recorded step (the optional module fields of a Profile).

`ModuleRecorder` puts a forward pre-hook and a forward hook on every module under the root for the one
recorded step (never on timed steps, so op times are not affected) and keeps:

* the stack of module calls running in forward: each op's `OpRecord.module` is the innermost one;
* the modules whose backward is running, much as torch.utils.module_tracker.ModuleTracker finds them: a
  multi-grad hook on a call's outputs enters the module when the first of their gradients is ready, one on
  its inputs leaves it when the first of theirs is (`_multi_grad_hook` says why the first); a backward op's
  module is the deepest module entered;
* one `ModuleCall` per call of a submodule in the forward: its first and last op, its tensor
  arguments, the saved entries packed while it ran (consecutive in pack order) and its buffer bytes.

Names are paths from the root module (`root.named_modules()`, `""` for the root). A module called
more than once gets one ModuleCall per call, numbered in call order as the runtime counts them.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn
from torch.autograd.graph import register_multi_grad_hook
from torch.utils._python_dispatch import _disable_current_modes
from torch.utils._pytree import tree_flatten

from regen.formats.profile import PHASE_FORWARD, ModuleCall


@dataclass
class _OpenCall:
    name: str
    call: int
    first_op: int
    first_entry: int
    inputs: list[int]
    depth: int


def _multi_grad_hook(tensors: list[torch.Tensor], fn):
    """register_multi_grad_hook outside the profiler's dispatch mode: on a leaf (a batch tensor that requires
    grad) it dispatches a view to reach the gradient accumulator, which is no op of the step. None where
    autograd gives no node to hook: a module called inside a custom autograd Function's forward (Reformer's
    reversible layers), whose backward the Function runs itself; its backward ops then count as the
    enclosing module's.

    Called at the first of the tensors' gradients (mode "any"): the "all" mode's hook holds the tensors'
    graph nodes, and a node holding its own hook is a cycle that keeps the node, and what it saved, alive
    until the hook is removed. Autograd never runs the nodes of an output the loss does not depend on (Canine's
    final character encoder under a classification head), so the step frees what they saved when the
    forward lets go of them; the recorded step held it to its end (1.25 MB of Canine's 37.9 MB peak)."""
    with _disable_current_modes():
        try:
            return register_multi_grad_hook(tensors, fn, mode="any")
        except AssertionError:  # torch.autograd.graph: "Expected gradient function to be set"
            return None


def _grad_tensors(value) -> list[torch.Tensor]:
    return [t for t in tree_flatten(value)[0] if isinstance(t, torch.Tensor) and t.requires_grad]


class ModuleRecorder:
    """Module paths and calls of one recorded step; `recorder` is the profiler's StepRecorder, which
    reads `current()` for every op it records."""

    def __init__(self, root: nn.Module, recorder):
        self.recorder = recorder
        self.names: dict[int, str] = {id(m): name for name, m in root.named_modules()}
        self.depths: dict[str, int] = {name: (name.count(".") + 1 if name else 0) for name in self.names.values()}
        self.modules = [m for _, m in root.named_modules()]
        self.stack: list[_OpenCall] = []
        self.in_backward: dict[str, int] = {}  # module name -> times entered and not left
        self.call_counts: dict[str, int] = {}
        self.calls: list[ModuleCall] = []
        self._handles: list = []
        self._grad_hooks: list = []

    def __enter__(self) -> "ModuleRecorder":
        for m in self.modules:
            # first of the module's pre-hooks, as the runtime's: a call includes the ops of the user's
            self._handles.append(m.register_forward_pre_hook(self._pre_hook, with_kwargs=True, prepend=True))
            self._handles.append(m.register_forward_hook(self._post_hook, with_kwargs=True, always_call=True))
        return self

    def __exit__(self, *exc) -> None:
        for h in self._handles + self._grad_hooks:
            h.remove()
        self._handles.clear()
        self._grad_hooks.clear()

    def current(self) -> str | None:
        """The module path of the op being recorded (forward: innermost call; backward: deepest module
        whose backward is running), None outside any."""
        if torch._C._current_graph_task_id() != -1:
            active = [n for n, k in self.in_backward.items() if k > 0]
            return max(active, key=lambda n: self.depths.get(n, 0)) if active else None
        return self.stack[-1].name if self.stack else None

    # ---- hooks ----------------------------------------------------------------------------------
    def _recording_forward(self) -> bool:
        return self.recorder.phase == PHASE_FORWARD and torch._C._current_graph_task_id() == -1

    def _pre_hook(self, module, args, kwargs):
        name = self.names.get(id(module))
        if name is None or not self._recording_forward():
            return None
        try:
            call = self.call_counts.get(name, 0)
            self.call_counts[name] = call + 1
            inputs = [self.recorder.id_of_input(t)[0] for t in tree_flatten((args, kwargs))[0]
                      if isinstance(t, torch.Tensor)]
            self.stack.append(_OpenCall(name, call, len(self.recorder.ops), len(self.recorder.entries), inputs,
                                        self.depths[name]))
            tensors = _grad_tensors((args, kwargs))
            hook = _multi_grad_hook(tensors, self._leave_backward(name)) if tensors else None
            if hook is not None:
                self._grad_hooks.append(hook)
        except Exception as exc:
            self.recorder.internal_error = exc
            raise
        return None

    def _post_hook(self, module, args, kwargs, output):
        name = self.names.get(id(module))
        if name is None or not self._recording_forward() or not self.stack or self.stack[-1].name != name:
            return None
        try:
            frame = self.stack.pop()
            last_op = len(self.recorder.ops) - 1
            if last_op >= frame.first_op:
                self.calls.append(ModuleCall(
                    module=name, call=frame.call, first_op=frame.first_op, last_op=last_op, inputs=frame.inputs,
                    first_entry=frame.first_entry, num_entries=len(self.recorder.entries) - frame.first_entry,
                    buffer_bytes=sum(b.untyped_storage().nbytes() for b in module.buffers()), depth=frame.depth))
            tensors = _grad_tensors(output)
            hook = _multi_grad_hook(tensors, self._enter_backward(name)) if tensors else None
            if hook is not None:
                self._grad_hooks.append(hook)
        except Exception as exc:
            self.recorder.internal_error = exc
            raise
        return None

    def _enter_backward(self, name: str):
        def enter(*_):
            self.in_backward[name] = self.in_backward.get(name, 0) + 1

        return enter

    def _leave_backward(self, name: str):
        def leave(*_):
            if self.in_backward.get(name, 0) > 0:
                self.in_backward[name] -= 1

        return leave
