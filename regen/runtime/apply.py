"""`regen.apply(model, plan)`: replay a plan inside an unmodified training loop.

A forward pre-hook on the root module starts a *step* (step.py) whenever the model is called with grad
enabled, in training or eval mode (no_grad forwards are left alone; an eval forward whose ops differ
from the plan's, e.g. with dropout or batch norm, is a mismatch like any other; under
DistributedDataParallel the hooks go on the wrapped module). The handle pushes, for each step, the step's pair of saved-tensor hooks and,
while the step needs it, the handle's `ForwardTracker` dispatch mode (tracker.py), which numbers the
forward ops (the loss included) until the plan's `num_forward_ops` have run or backward begins:

* pack: the tensor's plan entry is found (packing.py) by the writer map of its storage, `(producer_op,
  output_slot)`, checked by shape and dtype; then it is kept (`x.detach()`), swapped (storage copied to
  the host pool, a handle returned: swap_queue.py, swap.py) or dropped for recompute (a handle
  returned; its recipe ops were captured as they ran: forward_ops.py, recompute.py);
* unpack: counts the step's unpacks (the backward clock of docs/internals.md), issues the copy-ins
  and region replays scheduled at that position, and rebuilds the entry over its restored or recomputed
  storage (candidates.py).

Plans with regions (`Plan.regions`) also get a forward pre-hook and a forward hook on each region's
module: the step captures the region's call (arguments, RNG and autocast state) and replays the
module's forward in backward (regions.py), rebuilding every tensor the plan gives to the region.

The first planned step also hashes the forward ops and compares the result with `plan.fingerprint`.
Any mismatch raises `PlanMismatchError`, or with `on_mismatch="keep"` warns and keeps every later
tensor of that step.

What a step verified and recorded comes back to the handle when its forward ends (`StepFindings`) and
shapes the later steps (docs/internals.md "Pack-order fast path"): once a step is verified, later steps
match packs by order. For a plan without recipes (keep-all, swap-only, regions) they push no dispatch
mode at all; with recipes they keep it until their last tracked op has run, doing the minimum per op
(forward_ops.py).

Restored and recomputed storages are dropped after their last unpack; host ranges go back to the pool
when autograd frees the handles; an exception inside the `with` block aborts the live steps and leaves
no hook installed.

The copies run on the device's `SwapEngine` (swap.py): CUDA streams on a GPU; on a CPU device, with
`emulate_link=True`, an emulated link at the plan's bandwidths (link.py: copy threads, real stalls),
else synchronous copies, with a warning for a plan that swaps (a CPU has no link: its host pool is the
same RAM). Background copy threads stop when the handle is removed and no step holds copies any more,
when an exception ends the `with` block, or at interpreter exit.
"""

from __future__ import annotations

import warnings
import weakref
from pathlib import Path

import torch
from torch import nn
from torch.utils._python_dispatch import _get_current_dispatch_mode, _get_current_dispatch_mode_stack

from regen.errors import PlanMismatchError, RegenError
from regen.formats.plan import Plan, load_plan
from regen.runtime.forward_ops import FastOps
from regen.runtime.packing import PackRecord
from regen.runtime.plan_index import index_plan
from regen.runtime.regions import module_device
from regen.runtime.stats import RuntimeStats
from regen.runtime.step import Step, StepContext, StepFindings
from regen.runtime.swap import HostPool, SwapEngine, new_engine
from regen.runtime.tracker import PHASE_CLOSED, PHASE_TAIL, ForwardTracker

ON_MISMATCH_CHOICES = ("raise", "keep")


class RegenHandle:
    """The object `regen.apply` returns: a context manager, or call `.remove()` when done."""

    def __init__(self, model: nn.Module, plan: Plan, on_mismatch: str = "raise", emulate_link: bool = False):
        if on_mismatch not in ON_MISMATCH_CHOICES:
            raise RegenError(f"regen.apply: on_mismatch must be one of {', '.join(ON_MISMATCH_CHOICES)}, "
                             f"got {on_mismatch!r}")
        if isinstance(plan, (str, Path)):
            plan = load_plan(plan)
        if not isinstance(plan, Plan):
            raise RegenError(f"regen.apply: expected a regen Plan (regen.load_plan(path)), got {type(plan).__name__}")
        if not isinstance(model, nn.Module):
            raise RegenError(f"regen.apply: expected a torch.nn.Module, got {type(model).__name__}")
        if hasattr(model, "_orig_mod") and type(model).__name__ == "OptimizedModule":
            raise RegenError("regen.apply: this module is torch.compile'd; regen plans eager execution (its hooks "
                             "and recipes run op by op), so apply the plan to the original module "
                             "(model._orig_mod) and train it without torch.compile")
        self.model = model
        self.root = _unwrap(model)
        self.plan = plan
        self.index = index_plan(plan)
        self.on_mismatch = on_mismatch
        self.tracker = ForwardTracker()
        self.tracker_pushed = False
        self.verified = False
        # what earlier steps found (StepFindings), given to every new step
        self.pack_sequence: tuple[PackRecord, ...] | None = None  # the fast path's (see the module doc)
        self.fast_ops: FastOps | None = None  # with recompute decisions: what fast steps still track
        self.stats = RuntimeStats()
        self.current: Step | None = None
        self.live_steps: list[Step] = []
        self._hooks_pushed: set[Step] = set()  # steps whose saved-tensor hooks are pushed, not popped yet
        self._depth = 0
        self._removed = False
        device = module_device(self.root)
        self.emulated_link_bytes_per_s = _emulated_link(plan, device, self.index.swap_bytes) if emulate_link else None
        if not emulate_link and self.index.swap_bytes and (device is None or device.type == "cpu"):
            warnings.warn(_NO_LINK_WARNING, RuntimeWarning, stacklevel=3)
        self.pool = HostPool(plan.host_pool_bytes if self.index.swap_bytes else 0,
                             pin_memory=device is not None and device.type == "cuda")
        self.engines: dict[torch.device, SwapEngine] = {}
        self._finalizer = weakref.finalize(self, _close_engines, self.engines)  # also at interpreter exit
        self._step_context = StepContext(
            index=self.index, on_mismatch=on_mismatch, stats=self.stats, pause_tracker=self.tracker.pause,
            engine_for=self.engine_for, pool=self.pool, forward_ended=self._forward_ended,
            tracking_done=self._pop_tracker_for, released=self._step_released)
        self._hooks = [
            # first of the root's pre-hooks: the step's ops begin where the profiler's do, before those of
            # other pre-hooks (FSDP2's all-gather of the root's parameters)
            self.root.register_forward_pre_hook(self._pre_hook, prepend=True),
            self.root.register_forward_hook(self._post_hook, always_call=True),
        ] + self._region_hooks()

    # ---- public ---------------------------------------------------------------------------------------
    def __enter__(self) -> "RegenHandle":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        self.remove(abort=exc_type is not None)

    def remove(self, abort: bool = False) -> None:
        """Remove every hook. With abort=True (an exception ended the `with` block) the live steps are
        released too; otherwise steps whose graph autograd still holds finish their backward normally."""
        if self._removed:
            return
        self._removed = True
        for h in self._hooks:
            h.remove()
        self._hooks = []
        step = self.current
        if step is not None:
            step.end_forward()
            self._pop_hooks_of(step)
        self._pop_tracker(force=True)
        self.current = None
        if abort:
            for s in list(self.live_steps):
                s.release(aborted=True)
        if not self.live_steps:
            _close_engines(self.engines)

    @property
    def active_steps(self) -> int:
        """Steps still holding resources (their graph is alive)."""
        return len(self.live_steps)

    @property
    def hooks_installed(self) -> bool:
        return bool(self._hooks) or self.tracker_pushed or self.current in self._hooks_pushed

    # ---- step boundaries ------------------------------------------------------------------------------
    def _pre_hook(self, module, args):
        self._depth += 1
        if self._depth > 1 or not torch.is_grad_enabled():  # eval() with grad is planned too: its ops decide
            return
        if torch._C._current_graph_task_id() != -1:  # a forward run inside backward (checkpoint): leave it
            return
        if torch.compiler.is_compiling():
            raise RegenError("regen.apply: the model is being run by torch.compile; regen plans eager "
                             "execution, so train the module under regen.apply without torch.compile")
        prev = self.current
        if prev is not None:
            if prev.phase != PHASE_CLOSED:
                prev.end_forward()
            self._pop_hooks_of(prev)
        step = Step(self._step_context, self.verified, self.pack_sequence, self.fast_ops)
        self.stats.steps += 1
        self.current = step
        self.live_steps.append(step)
        if step.needs_tracker:
            self.tracker.step = step
            if not self.tracker_pushed:
                self.tracker.__enter__()
                self.tracker_pushed = True
        else:  # pack-order fast path: no dispatch mode
            self.tracker.step = None
            self._pop_tracker(force=False)
        torch._C._autograd._push_saved_tensors_default_hooks(step.pack_fn, step.unpack_fn)
        self._hooks_pushed.add(step)

    def _post_hook(self, module, args, output):
        self._depth = max(0, self._depth - 1)
        step = self.current
        if self._depth == 0 and step is not None and step.phase == PHASE_TAIL:
            step.end_forward()

    def _forward_ended(self, step: Step, findings: StepFindings, in_pack_hook: bool):
        """A step's forward ended: keep what it found for later steps, and pop the tracker (and, outside a
        pack hook, its saved-tensor hooks) when they are on top of their stacks and backward has not begun
        (inside backward the engine restores the thread's state afterwards; the next step or `remove()`
        pops them then)."""
        if findings.verified:
            self.verified = True
        if findings.pack_sequence is not None:
            self.pack_sequence = findings.pack_sequence
            self.fast_ops = findings.fast_ops
        if torch._C._current_graph_task_id() == -1:
            self._pop_tracker_for(step)
            if not in_pack_hook:
                self._pop_hooks_of(step, warn=False)

    def _pop_tracker_for(self, step: Step):
        if self.tracker.step is step:
            self._pop_tracker(force=False)

    def _pop_tracker(self, force: bool):
        if not self.tracker_pushed:
            return
        if _get_current_dispatch_mode() is self.tracker:
            self.tracker.__exit__(None, None, None)
            self.tracker_pushed = False
        elif force and self.tracker not in _get_current_dispatch_mode_stack():
            self.tracker_pushed = False
        if not self.tracker_pushed:
            self.tracker.step = None

    def _pop_hooks_of(self, step: Step, warn: bool = True):
        if step not in self._hooks_pushed:
            return
        top = torch._C._autograd._top_saved_tensors_default_hooks(False)
        if top is not None and top[0] is step.pack_fn:
            torch._C._autograd._pop_saved_tensors_default_hooks()
            self._hooks_pushed.discard(step)
        elif warn:
            warnings.warn("regen.apply: other saved-tensor hooks were pushed above regen's and not popped; "
                          "leaving them in place", RuntimeWarning, stacklevel=3)

    def _step_released(self, step: Step, followed_plan: bool):
        if step in self.live_steps:
            self.live_steps.remove(step)
            if followed_plan:
                self.stats.planned_steps += 1
        if self._removed and not self.live_steps:
            _close_engines(self.engines)

    # ---- region modules -------------------------------------------------------------------------------
    def _region_hooks(self) -> list:
        """A pre-hook and a hook on each module a plan region replays, reporting its calls to the step."""
        hooks = []
        for path in dict.fromkeys(r.region.module for r in self.index.regions.values()):
            try:
                module = self.root.get_submodule(path)
            except AttributeError:
                raise PlanMismatchError(f"regen.apply: the plan replays module {path!r}, which this model does not "
                                        f"have; profile and solve for this model") from None
            hooks.append(module.register_forward_pre_hook(self._region_pre_hook(path), with_kwargs=True))
            hooks.append(module.register_forward_hook(self._region_post_hook, always_call=True))
        return hooks

    def _region_pre_hook(self, path: str):
        def pre_hook(module, args, kwargs):
            step = self.current
            if step is not None and torch.is_grad_enabled() and torch._C._current_graph_task_id() == -1:
                step.region_called(path, module, args, kwargs)

        return pre_hook

    def _region_post_hook(self, module, args, output):
        step = self.current
        if step is not None and torch._C._current_graph_task_id() == -1:
            step.region_returned(module)

    # ---- devices --------------------------------------------------------------------------------------
    def engine_for(self, device: torch.device) -> SwapEngine:
        engine = self.engines.get(device)
        if engine is None:
            engine = self.engines[device] = new_engine(device, self.pool, self.emulated_link_bytes_per_s, self.stats)
        return engine


_NO_LINK_WARNING = (
    "regen.apply: this plan swaps on a CPU device, which has no host link: the copies run synchronously at "
    "memcpy speed into a host pool in the same RAM (nothing real is freed); pass emulate_link=True to run them "
    "over an emulated link at the plan's bandwidth, or solve without a link for a recompute-only plan")


def _emulated_link(plan: Plan, device: torch.device | None, swap_bytes: int) -> tuple[float, float]:
    """(d2h, h2d) bytes/s of the emulated link: the plan's; only on a CPU device."""
    if device is not None and device.type != "cpu":
        raise RegenError(f"regen.apply: emulate_link=True emulates a GPU's host link on a CPU device; this model is "
                         f"on {device}, whose real link regen uses")
    if swap_bytes and not (plan.d2h_bytes_per_s > 0 and plan.h2d_bytes_per_s > 0):
        raise RegenError("regen.apply: emulate_link=True needs the plan's copy bandwidths (d2h/h2d_bytes_per_s) "
                         "to be positive")
    return plan.d2h_bytes_per_s, plan.h2d_bytes_per_s


def _close_engines(engines: dict) -> None:
    """Stop the engines' background copies (each is closed once; later steps get new engines)."""
    for engine in list(engines.values()):
        engine.close()
    engines.clear()


def _unwrap(model: nn.Module) -> nn.Module:
    """The module whose forward the plan describes: DDP and DataParallel wrap it."""
    wrappers = (nn.parallel.DistributedDataParallel, nn.DataParallel)
    while isinstance(model, wrappers):
        model = model.module
    return model


def apply(model: nn.Module, plan: Plan | str | Path, on_mismatch: str = "raise",
          emulate_link: bool = False) -> RegenHandle:
    """Replay `plan` on `model`'s training steps until the handle is removed (or the `with` ends).

    `plan` is a Plan or a path to a plan file. `on_mismatch="raise"` (default) raises PlanMismatchError
    when the model or batch shape is not the one the plan was made for; `"keep"` warns and runs that step
    unplanned. `emulate_link=True` (CPU devices only) runs the plan's swaps over an emulated host link at
    the plan's bandwidths, asynchronously, as over a GPU's link (regen.runtime.link).
    """
    return RegenHandle(model, plan, on_mismatch=on_mismatch, emulate_link=emulate_link)
