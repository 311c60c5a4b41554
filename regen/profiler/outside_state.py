"""What a module call leaves behind besides its output: state a replay of the call would write again.

A region (regen.planner.region_candidates) is rebuilt in backward by calling its module again, as
torch.utils.checkpoint does. That is a replay only if the call's sole effects are its output and the
tensors autograd saves: a call that appends its keys and values to a cache object it was given, stores a
tensor in a module attribute or in a list, or changes a module's attribute, would do it a second time
(a cache twice as long, a crash in backward, state that differs from the unplanned step's).

`CallWatcher` finds those calls during the liveness probe's step (regen.profiler.liveness), where autograd
holds copies of every saved storage, so the originals live only as long as something else holds them.
With a forward pre-hook (first of the module's) and a forward hook (after the user's) on every module,
it sees, per call of a submodule in the forward:

1. storages made by the call's ops (an op output over a storage no earlier op read or wrote) that are
   still alive when the call returns and are not storages of the tensors in its output (its pytree leaves:
   an object that is not a tuple, list, dict or ModelOutput, such as a cache, is opaque), after a garbage
   collection: something outside the output holds them (autocast's casts of parameters aside: its own
   cache holds them until autocast exits, and a replay's autocast makes and drops its own);
2. attributes of the module or of its submodules that were rebound during the call (a tensor, a counter,
   any object: compared by identity, and numbers and strings by value; parameters and submodules are not
   compared: FSDP swaps a unit's parameters around its forward).

Calls are numbered per module as the recorded step numbers them (regen.profiler.modules): `found` maps
(module path, call) to the reason that call cannot be replayed.
"""

from __future__ import annotations

import gc
from dataclasses import dataclass

import torch
from torch import nn
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._pytree import tree_flatten

from regen.opinfo import tensor_arguments
from regen.units import format_bytes

_VALUE_TYPES = (int, float, bool, str, bytes, type(None))
_NOT_COMPARED = ("_parameters", "_modules")


@dataclass
class _OpenCall:
    name: str
    call: int
    module: nn.Module
    first_created: int  # index into CallWatcher.created at the call's start
    attributes: dict[tuple[int, str], object]
    autocast: bool  # on when the call began


class CallWatcher:
    """The module calls of one probe step that leave state behind (see the module doc)."""

    def __init__(self, root: nn.Module):
        self.names: dict[int, str] = {id(m): name for name, m in root.named_modules()}
        self.modules = [m for name, m in root.named_modules() if name]  # the root is never replayed
        self.known: dict[int, StorageWeakRef] = {}  # data pointer -> a storage the step has met
        # storages made by the ops of the open calls, in order: (ref, data pointer, bytes)
        self.created: list[tuple[StorageWeakRef, int, int]] = []
        self.stack: list[_OpenCall] = []
        self.call_counts: dict[str, int] = {}
        self.found: dict[tuple[str, int], str] = {}
        self.forward = True  # False once backward begins
        self._handles: list = []

    def __enter__(self) -> "CallWatcher":
        for m in self.modules:
            self._handles.append(m.register_forward_pre_hook(self._pre_hook, prepend=True))
            self._handles.append(m.register_forward_hook(self._post_hook, always_call=True))
        return self

    def __exit__(self, *exc) -> None:
        for h in self._handles:
            h.remove()
        self._handles.clear()

    # ---- ops (from the probe's dispatch mode, its own copies excluded) -------------------------------
    def op_ran(self, func, args, kwargs, out) -> None:
        """An op of the step ran: note the storages it made (not autocast's casts of parameters, which its
        own cache holds until autocast exits, and a replay's autocast makes and drops again). It runs at every op:
        its tensors are collected by opinfo's plain loop, not tree_flatten."""
        for t in tensor_arguments(args, kwargs):
            self._meet(t.untyped_storage())
        watched = self.forward and self.stack and not (self.stack[-1].autocast and _weight_cast(func, args))
        for t in tensor_arguments((out,), {}):
            storage = t.untyped_storage()
            if self._meet(storage) and watched:
                self.created.append((self.known[storage.data_ptr()], storage.data_ptr(), storage.nbytes()))

    def _meet(self, storage) -> bool:
        """Remember `storage`; True when the step had not met it (a new storage)."""
        key = storage.data_ptr()
        if key == 0:
            return False
        ref = self.known.get(key)
        if ref is not None and not ref.expired():
            return False
        self.known[key] = StorageWeakRef(storage)
        return True

    # ---- module hooks ----------------------------------------------------------------------------------
    def _counted(self) -> bool:
        return self.forward and torch._C._current_graph_task_id() == -1

    def _pre_hook(self, module, args):
        name = self.names.get(id(module))
        if name is None or not self._counted():
            return None
        call = self.call_counts.get(name, 0)
        self.call_counts[name] = call + 1
        self.stack.append(_OpenCall(name, call, module, len(self.created), _attributes(module), _autocast_on()))
        return None

    def _post_hook(self, module, args, output):
        name = self.names.get(id(module))
        if name is None or not self._counted() or not self.stack or self.stack[-1].name != name:
            return None
        frame = self.stack.pop()
        reason = self._left_behind(frame, output)
        if reason is not None:
            self.found[(frame.name, frame.call)] = reason
        if not self.stack:  # back outside every call: nothing needs the storages made so far
            self.created.clear()
        return None

    def _left_behind(self, frame: _OpenCall, output) -> str | None:
        rebound = _rebound(frame.attributes, frame.module)
        if rebound:
            return f"its forward rebinds {rebound[0]}" + (f" and {len(rebound) - 1} more attributes"
                                                          if len(rebound) > 1 else "")
        held = self._held_outside(frame, output)
        if held and gc.collect() and not (held := self._held_outside(frame, output)):
            return None
        if held:
            return (f"{len(held)} tensors it makes ({format_bytes(sum(held))}) stay alive after it returns outside "
                    f"its output (a cache, a module attribute, a list): a replay would store them again")
        return None

    def _held_outside(self, frame: _OpenCall, output) -> list[int]:
        returned = {t.untyped_storage().data_ptr() for t in _tensors(output)}
        return [nbytes for ref, key, nbytes in self.created[frame.first_created:]
                if not ref.expired() and key not in returned]


def _tensors(value) -> list[torch.Tensor]:
    return [t for t in tree_flatten(value)[0] if isinstance(t, torch.Tensor)]


def _weight_cast(func, args) -> bool:
    """A cast autocast caches when it is on: `_to_copy` of a leaf that requires grad."""
    return (func is torch.ops.aten._to_copy.default and bool(args) and isinstance(args[0], torch.Tensor)
            and args[0].is_leaf and args[0].requires_grad)


def _autocast_on() -> bool:
    """Autocast is on here (read above the dispatcher: a dispatch mode runs below autocast, which it sees off)."""
    return any(torch.is_autocast_enabled(d) for d in ("cpu", "cuda"))


def _attributes(module: nn.Module) -> dict[tuple[int, str], object]:
    """The module's and its submodules' attributes (parameters and submodules aside), by (module, name)."""
    found = {}
    for m in module.modules():
        for key, value in vars(m).items():
            if key in _NOT_COMPARED:
                continue
            if key == "_buffers":
                found.update({(id(m), f"buffer {name}"): b for name, b in value.items()})
            else:
                found[(id(m), key)] = value
    return found


def _rebound(before: dict[tuple[int, str], object], module: nn.Module) -> list[str]:
    """The attributes of `before` rebound since (or added or removed), as `Class.name`."""
    after = _attributes(module)
    classes = {id(m): type(m).__name__ for m in module.modules()}
    changed = []
    for key in before.keys() | after.keys():
        old, new = before.get(key, _MISSING), after.get(key, _MISSING)
        if old is new or (isinstance(old, _VALUE_TYPES) and type(old) is type(new) and old == new):
            continue
        changed.append(f"{classes.get(key[0], '?')}.{key[1]}")
    return sorted(changed)


_MISSING = object()
