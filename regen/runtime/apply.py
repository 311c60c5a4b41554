"""`regen.apply(model, plan)`: replay a plan inside an unmodified training loop.

A forward pre-hook on the root module starts a *step* (step.py) whenever the model is called with grad
enabled, in training or eval mode (no_grad forwards are left alone; an eval forward whose ops differ
from the plan's, e.g. with dropout or batch norm, is a mismatch like any other; under
DistributedDataParallel the hooks go on the wrapped module; nn.DataParallel, whose replicas run in threads
through one handle, is refused). The handle pushes, for each step, the step's pair of saved-tensor hooks
and, while the step needs it, the handle's `ForwardTracker` dispatch mode (tracker.py), which numbers the
forward ops (the loss included) until the plan's `num_forward_ops` have run or backward begins:

* pack: the swapped storages due at this pack are released (their release points, swap/queue.py); the
  tensor's plan entry is found (packing.py) by the writer map of its storage, `(producer_op,
  output_slot)`, checked by shape and dtype; then it is kept (`x.detach()`), swapped (storage copied to
  the host pool, a handle returned: regen.runtime.swap) or dropped for recompute (a handle
  returned; its recipe ops were captured as they ran: forward_ops.py, recompute.py);
* unpack: counts the step's unpacks (the backward clock of docs/internals.md), releases the swapped
  storages due there, issues the copy-ins
  and region replays scheduled at that position, and rebuilds the entry over its restored or recomputed
  storage (planned_storages.py).

Plans with regions (`Plan.regions`) also get a forward pre-hook and a forward hook on each region's
module: the step captures the region's call (arguments, RNG and autocast state) and replays the
module's forward in backward (region_replays.py), rebuilding every tensor the plan gives to the region.

A plan set (`regen.apply(model, [plan_a, plan_b])`, plan_set.py) holds one plan per way the loop calls the
model (a GAN's discriminator in its own step and in the generator's): the pre-hook runs each step under
the plan profiled with that call (`Plan.call`), and each plan keeps what its own steps found.

A call no plan fits (with a single plan that records its call, `Plan.call`, any other call) runs, with
`on_mismatch="dynamic"` (the default), as a dynamic step under the smallest cap of the set, with a notice
the first time per call signature: the handle's `DynamicFallback` (fallback.py) runs it on a `DynamicEngine`
(dynamic/engine.py), which pushes that step's saved-tensor hooks and its dispatch mode in place of the
tracker's, so only one set of hooks is ever active; the engine's mode is popped when a planned step begins. With `on_mismatch="raise"` such a
call raises `PlanMismatchError`; with `"keep"` it warns and runs unplanned. With a learner
(`regen.apply(..., learn=True)`, learned.py) the first dynamic step of each call signature also yields a
plan for it, used from the first call after it is solved.

The first planned step of a plan also hashes the forward ops and compares the result with `plan.fingerprint`.
A mismatch found within a step raises `PlanMismatchError` under `on_mismatch="raise"`; otherwise it warns and
the step keeps every later tensor (a step cannot change mode once it has begun; Note [ A step that leaves its
plan ]).

What a step verified and recorded comes back to the handle when its forward ends (`StepFindings`) and
shapes the later steps (docs/internals.md "Pack-order fast path"): once a step is verified, later steps
match packs by order. For a plan without recipes (keep-all, swap-only, regions) they push no dispatch
mode at all; with recipes they keep it until their last tracked op has run, doing the minimum per op
(forward_ops.py).

On CUDA, every `peak_check.PEAK_CHECK_EVERY_STEPS`-th step's peak (`torch.cuda.max_memory_allocated`) is
compared with the cap of the plan it ran under, with one warning per handle when it is over by more than 5% (peak_check.py).

Restored and recomputed storages are dropped after their last unpack; host ranges go back to the pool
when autograd frees the handles; an exception inside the `with` block aborts the live steps and leaves
no hook installed.

The copies run on the device's `SwapEngine` (regen.runtime.swap): CUDA streams on a GPU; on a CPU device, with
`emulate_link=True`, an emulated link at the plan's bandwidths (swap/emulated.py: copies on the link's
clock, real stalls), else synchronous copies, with a warning for a plan that swaps (a CPU has no link: its
host pool is the same RAM). Every copy has landed once the handle is removed and no step holds copies any
more, or an exception ends the `with` block.
"""

from __future__ import annotations

import functools
import warnings
import weakref
from pathlib import Path

import torch
from torch import nn
from torch.utils._python_dispatch import _get_current_dispatch_mode

from regen.call_signature import TrainableCount
from regen.caches import announced_caches_off
from regen.errors import PlanMismatchError, RegenError
from regen.formats.plan import Plan
from regen.runtime.compiled import CompiledCalls, CompiledPlanHandle, reset_compiled_code
from regen.runtime.dynamic.engine import DynamicStats
from regen.runtime.dynamic.handle import DynamicHandle, cap_bytes, check_policy
from regen.runtime.fallback import DynamicFallback
from regen.runtime.held_gradients_check import HeldGradientsCheck
from regen.runtime.overlapping_steps import OverlapCheck
from regen.runtime.learned import Learner
from regen.ranks import rank_agreement
from regen.runtime.peak_check import PeakCheck, cuda_peak_reader
from regen.runtime.plan_set import PlanState, add_plan, call_difference, choose, plan_states
from regen.runtime.region_hooks import RegionHooks
from regen.runtime.stats import RuntimeStats
from regen.runtime.mismatch import MAX_DIVERGED_STEPS, PlanMismatchWarning
from regen.runtime.model_access import check_model, compiled_module, module_device, starts_a_step, unwrap_model
from regen.runtime import stacks
from regen.runtime.step import Step, StepContext, StepFindings
from regen.runtime.swap import HostPool, SwapEngine, new_engine
from regen.runtime.tracker import STAGE_CLOSED, STAGE_TAIL, ForwardTracker
from regen.runtime.window_hooks import WindowHooks


ON_MISMATCH_CHOICES = ("dynamic", "raise", "keep")

# NOTE [ A step that leaves its plan ]
# A step can find that its ops are not its plan's only once it has begun (the call matched the plan's): a
# model whose first forward builds modules or buffers (BigBird at a short sequence swaps its attention
# modules for full attention in its first call, which the profile's warm-up hid), or a branch on the data (a
# Hugging Face decoder given a padding mask builds its attention mask, and skips it for a batch without
# padding: the same call, another forward). Under on_mismatch="dynamic":
#   1. a step that leaves its plan in forward goes on in dynamic mode under the cap from there (the fallback's
#      engine: its saved-tensor hooks pushed above the plan's, so every later pack is its, and its dispatch mode
#      from the next module call, engine.py). What the planned part packed stays the planned step's (its drops
#      rebuilt in backward as planned: planned_storages.py, Note [ A rebuilder that was not dropped ]; a region
#      replayed only up to what it dropped); the planned step's forward ends there (its tracker captures no
#      more). On CPU the dynamic step counts, on top of the model, what that part's saved tensors hold (the
#      verified step's pack records up to there: PackRecord.held_bytes), the tensors the running forward's frames
#      hold (cap_memory.py, `track_running_frames`) and each storage it packs or its ops read that the planned
#      part made: more than the allocator holds, where a tensor is both; on CUDA the allocator counts everything.
#      Such a step is not remembered for later steps (its forward is a part);
#   2. a step that leaves it once backward began (a forward shorter than the plan's, found at the first unpack;
#      with torch.distributed, the ranks' agreement there) runs the rest unplanned: its saved set is final;
#   3. the call's later steps keep the plan (a first forward differs once, a padding mask now and then), until
#      MAX_DIVERGED_STEPS of them have left it and they are more than half of the call's steps: from then on
#      the call runs in dynamic mode from its start (the count and the warnings: regen/runtime/mismatch.py).
# "raise" raises; "keep" keeps what the step saves from there (warned: it can pass the cap).


def _checked_plan_states(model: nn.Module, plan: Plan | str | Path | list | None, on_mismatch: str,
                         learner: Learner | None) -> list[PlanState]:
    """The plans' states (plan_set.py), after the arguments of `regen.apply` are checked."""
    if on_mismatch not in ON_MISMATCH_CHOICES:
        raise RegenError(f"regen.apply: on_mismatch must be one of {', '.join(ON_MISMATCH_CHOICES)}, "
                         f"got {on_mismatch!r}")
    states = plan_states(plan) if plan is not None else []
    if learner is not None and any(s.plan.call is None for s in states):
        raise RegenError("regen.apply: learn=True adds a plan per call to the set, and a plan given does not "
                         "record how its step called the model (profiled by an older regen); profile and "
                         "solve it again")
    check_model(model, "regen plans eager execution (its hooks and recipes run op by op), so apply the plan")
    return states



class RegenHandle:
    """The object `regen.apply` returns: a context manager, or call `.remove()` when done."""

    def __init__(self, model: nn.Module, plan: Plan | str | Path | list | None, on_mismatch: str = "dynamic",
                 emulate_link: bool = False, cap_bytes: int | None = None, policy: str = "graph",
                 learner: Learner | None = None):
        """`cap_bytes`: the cap of dynamic steps without a plan (`plan` None: every call is learned);
        `learner`: what learns a plan for a call no plan fits (learned.py)."""
        states = _checked_plan_states(model, plan, on_mismatch, learner)
        self.model = model
        self.root = unwrap_model(model)
        self.plan_states = states  # one per plan, each with what its steps found (plan_set.py)
        self.on_mismatch = on_mismatch
        # the steps no plan fits run under the smallest cap of the set: within every cap the user solved for
        self.fallback = DynamicFallback(self.root,
                                        min((s.plan.memory_cap_bytes for s in states), default=cap_bytes),
                                        policy, learner)
        self._any_rank = rank_agreement()  # None without torch.distributed
        self.caches = announced_caches_off(self.root)  # as the profile's steps ran (regen.caches)
        self.tracker = ForwardTracker(outside_model=lambda: self._depth == 0)
        self.tracker_pushed = False
        self.stats = RuntimeStats()
        self.current: Step | None = None
        self.live_steps: list[Step] = []
        self._depth = 0
        self._call: tuple | None = None  # the current planned step's call (args, kwargs) until its forward returns
        self._removed = False
        self.compiled: CompiledCalls | None = None  # set when the model is compiled under this handle
        # code compiled before would run in place of the plan's (Note [ Plans under torch.compile ] 8)
        reset_compiled_code()
        device = module_device(self.root)
        swapping = [s.plan for s in states if s.index.swap_bytes]
        self.emulated_link_bytes_per_s = _emulated_link(states, device) if emulate_link else None
        if not emulate_link and swapping and (device is None or device.type == "cpu"):
            warnings.warn(_NO_LINK_WARNING, RuntimeWarning, stacklevel=3)
        # each checked step against its own plan's cap (the largest until one is checked)
        self.peak_check = PeakCheck(max((s.plan.memory_cap_bytes for s in states), default=cap_bytes),
                                    cuda_peak_reader(device))
        # pinned for a model on CUDA; a model moved to the GPU later gets it again, pinned, at its first copy-out
        self.pool = HostPool(max((p.host_pool_bytes for p in swapping), default=0),
                             pin_memory=device is not None and device.type == "cuda")
        self.engines: dict[torch.device, SwapEngine] = {}
        self._finalizer = weakref.finalize(self, _close_engines, self.engines)  # also at interpreter exit
        for state in states:
            self._give_context(state)
        self._hooks = [
            # first of the root's pre-hooks: the step's ops begin where the profiler's do, before those of the
            # user's pre-hooks (whose ops the profiler counted in the forward) and of FSDP2's all-gather
            self.root.register_forward_pre_hook(self._pre_hook, prepend=True, with_kwargs=True),
            self.root.register_forward_hook(self._post_hook, always_call=True),
        ]
        self.trainable = TrainableCount(self.root)  # read at each step when on_mismatch="dynamic"
        self.held_gradients = HeldGradientsCheck(self.trainable.parameters)
        self.overlap = OverlapCheck()
        self._hooks += self.trainable.hooks
        self.region_hooks = RegionHooks(self.root, lambda: self.current)
        self._hooks += self.region_hooks.add(states)
        self.window_hooks = WindowHooks(self.root, lambda: self.current)
        self._hooks += self.window_hooks.add(states)

    def _give_context(self, state: PlanState) -> None:
        """What the plan's steps get (a mismatch found mid-step: Note [ A step that leaves its plan ])."""
        state.context = StepContext(
            index=state.index, on_mismatch=self.on_mismatch,
            stats=self.stats, pause_tracker=self.tracker.pause, engine_for=self.engine_for, pool=self.pool,
            forward_ended=functools.partial(self._forward_ended, state), tracking_done=self._pop_tracker_for,
            track=self._track,
            released=self._step_released, drops_held=self._drops_held,
            diverged=functools.partial(self._diverged, state))

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
        stacks.pop_finished()
        if step is not None:
            stacks.pop_hooks(step.pack_fn)  # or later, by pop_finished, once it is on top again
        self._pop_tracker(force=True)
        self.current = None
        self.fallback.remove(abort)
        self.caches.restore()
        if abort:
            for s in list(self.live_steps):
                s.release(aborted=True)
        stacks.pop_finished()  # what this removal uncovered (another handle's, or this one's let go)
        if not self.live_steps:
            _close_engines(self.engines)
        if self.compiled is not None:  # the next steps compile without the plan
            reset_compiled_code()

    @property
    def active_steps(self) -> int:
        """Steps still holding resources (their graph is alive), dynamic ones included."""
        return len(self.live_steps) + self.fallback.live_steps

    @property
    def hooks_installed(self) -> bool:
        return (bool(self._hooks) or self.tracker_pushed
                or (self.current is not None and stacks.hooks_pushed(self.current.pack_fn))
                or self.fallback.hooks_installed)

    @property
    def dynamic_stats(self) -> DynamicStats:
        """What the steps run in dynamic mode did (on_mismatch="dynamic")."""
        return self.fallback.stats

    def save_learned_plans(self, directory: str | Path) -> list[Path]:
        """Write the plans learned so far (learn=True) to `directory`; `regen.apply(model, directory)` loads
        them back as a plan set. Returns the files written."""
        return self.fallback.save_learned_plans(directory)

    def wait_for_learning(self, timeout_s: float | None = None) -> None:
        """Wait until every plan being learned is solved (it is used from the next call with its signature)."""
        self.fallback.learned.wait(timeout_s)

    # ---- step boundaries ------------------------------------------------------------------------------
    def _pre_hook(self, module, args, kwargs):
        if torch.compiler.is_compiling():  # compiled under this handle: Note [ Plans under torch.compile ] 8
            self._compiled_call_begins()
            return
        self._depth += 1
        if not starts_a_step(self._depth, "regen plans"):
            return
        self._close_previous_step()
        for plan in self.fallback.between_steps():  # learned plans join the set (on this thread)
            new = add_plan(self.plan_states, plan)
            self._give_context(new)
            self._hooks += self.region_hooks.add([new]) + self.window_hooks.add([new])
        state, left_plan = self._plan_for(args, kwargs)
        if state is None:  # no plan of the set fits this call: unplanned ("keep") or dynamic
            self.current = None
            self._pop_tracker(force=False)
            if self.on_mismatch == "dynamic":
                self.fallback.run(args, kwargs, why=left_plan)
            return
        self.fallback.planned_step_begins()
        self.held_gradients.step_begins(state.plan)
        self.overlap.step_begins(self.live_steps)
        step = Step(state.context, state.verified, state.pack_sequence, state.fast_ops,
                    call_difference(state, self.root, args, kwargs))
        self.stats.steps += 1
        state.steps += 1
        self._call = (args, kwargs)
        if self.peak_check.step_started(step, self.stats.steps, state.plan.memory_cap_bytes):
            step.storages.watch_drops()
        self.current = step
        self.live_steps.append(step)
        if step.needs_tracker:
            self._track(step)
        else:  # pack-order fast path: no dispatch mode (until a tracking window opens)
            self.tracker.step = None
            self._pop_tracker(force=False)
        stacks.push_hooks(step, step.pack_fn, step.unpack_fn)

    def _diverged(self, state: PlanState) -> bool:
        """One of `state`'s steps left its plan mid-step: True when dynamic mode takes its forward over from here
        (Note [ A step that leaves its plan ] 1, 2; with torch.distributed a mismatch is acted on at the first
        unpack, in backward)."""
        state.diverged_steps += 1
        step, call = self.current, self._call
        if self.on_mismatch != "dynamic" or step is None or call is None or torch._C._current_graph_task_id() != -1:
            return False
        step.release_held = self.fallback.take_over(*call, held_bytes=step.held_bytes())
        return True

    def _close_previous_step(self) -> None:
        """The model's next call begins: the step before packs no more, and what it left pushed goes."""
        prev = self.current
        if prev is not None and prev.stage != STAGE_CLOSED:
            prev.end_forward()
        stacks.pop_finished()  # this handle's and others' steps that pack no more
        if prev is not None:
            stacks.pop_hooks(prev.pack_fn)
        self.tracker.pop_closer(force=False)  # left pushed by the step before when it closed the forward

    def _plan_for(self, args: tuple, kwargs: dict) -> tuple[PlanState | None, str | None]:
        """The plan of the set this call runs under, or None when none fits and on_mismatch is "keep" (with a
        warning) or "dynamic" (the fallback's step); and, for a call whose plan its steps keep leaving (Note
        [ A step that leaves its plan ]), why it runs in dynamic mode."""
        dynamic = self.on_mismatch == "dynamic"
        state, problem = choose(self.plan_states, self.root, args, kwargs, by_call=dynamic,
                                trainable=self.trainable)
        left_plan = None
        if dynamic and state is not None and MAX_DIVERGED_STEPS <= state.diverged_steps > state.steps / 2:
            state, left_plan = None, f"{state.diverged_steps} steps of this call left its plan mid-step"
        if dynamic and self._any_rank is not None and self._any_rank(state is None):
            state = None  # every rank runs the same kind of step (a planned step's collectives need them all)
        if state is not None:
            return state, None
        if self.on_mismatch == "raise":
            raise PlanMismatchError(f"regen.apply: {problem}, or pass on_mismatch='dynamic' to run such steps in "
                                    f"dynamic mode or 'keep' to run them unplanned")
        self.stats.steps += 1
        if not dynamic:
            self.stats.unplanned_steps += 1
            warnings.warn(f"regen.apply: {problem}; running this step unplanned (on_mismatch='keep')",
                          PlanMismatchWarning, stacklevel=4)
            return None, None
        self.stats.dynamic_steps += 1
        return None, left_plan

    def _post_hook(self, module, args, output):
        if torch.compiler.is_compiling():
            self._compiled_call_ends(output)
            return
        self._depth = max(0, self._depth - 1)
        if self._depth == 0:
            self._call = None
            self.fallback.model_returned(output)
        step = self.current
        if self._depth == 0 and step is not None and step.stage == STAGE_TAIL:
            step.end_forward()

    @torch.compiler.disable
    def _compiled_call_begins(self) -> None:
        """A call of the model compiled under this handle begins (run eagerly, outside the compiled code): the
        plan is carried out by the compiler from here (compiled.py), the eager steps before are let go."""
        if self.compiled is None:
            refused = _eager_only_arguments(on_mismatch=self.on_mismatch, emulate_link=self.emulated_link_bytes_per_s
                                           is not None, learn=self.fallback.learned.learning or None)
            if refused or len(self.plan_states) != 1:
                why = _compiled_refusal(refused) if refused else _ONE_PLAN_COMPILED
                raise RegenError(f"{why} (the model was compiled under regen.apply)")
            self.compiled = CompiledCalls(self.root, self.plan_states[0].plan)
        self._close_previous_step()
        self.current = None
        self._pop_tracker(force=False)
        self.fallback.between_steps()
        self.fallback.planned_step_begins()
        self.compiled.begin_call()

    @torch.compiler.disable
    def _compiled_call_ends(self, output) -> None:
        if self.compiled is not None:  # None: the call's beginning refused the compiled model
            self.compiled.end_call(output)

    def _forward_ended(self, state: PlanState, step: Step, findings: StepFindings, in_pack_hook: bool):
        """A step's forward ended: keep what it found for its plan's later steps, and pop the tracker (and,
        outside a pack hook, its saved-tensor hooks) when they are on top of their stacks and backward has not begun
        (inside backward the engine restores the thread's state afterwards; the next step or `remove()`
        pops them then)."""
        if findings.verified:
            state.verified = True
        if findings.pack_sequence is not None:
            state.pack_sequence = findings.pack_sequence
            state.fast_ops = findings.fast_ops
        if torch._C._current_graph_task_id() == -1:
            self._pop_tracker_for(step)
            if not in_pack_hook:
                stacks.pop_hooks(step.pack_fn)

    def _track(self, step: Step):
        """The tracker follows `step`'s forward ops from here (pushed if it is not)."""
        self.tracker.step = step
        if not self.tracker_pushed:
            self.tracker.__enter__()
            self.tracker_pushed = True

    def _pop_tracker_for(self, step: Step):
        if self.tracker.step is step:
            self._pop_tracker(force=False)

    def _pop_tracker(self, force: bool):
        self.tracker.pop_closer(force)
        if not self.tracker_pushed:
            return
        if _get_current_dispatch_mode() is self.tracker:
            self.tracker.__exit__(None, None, None)
            self.tracker_pushed = False
        elif force:  # let go: popped once it is on top (regen.runtime.stacks)
            stacks.orphan(self.tracker)
            self.tracker_pushed = False
        if not self.tracker_pushed:
            self.tracker.step = None

    def _drops_held(self, step: Step, held_bytes: int):
        self.peak_check.observe_drops_held(held_bytes, step.index.plan.simulated.peak_bytes)

    def _step_released(self, step: Step, followed_plan: bool):
        self.peak_check.step_released(step, followed_plan)
        if step in self.live_steps:
            self.live_steps.remove(step)
            if followed_plan:
                self.stats.planned_steps += 1
        if self._removed and not self.live_steps:
            _close_engines(self.engines)

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


def _emulated_link(states: list[PlanState], device: torch.device | None) -> tuple[float, float]:
    """(d2h, h2d) bytes/s of the emulated link: the plan's (the first of those that swap); only on a CPU device."""
    if device is not None and device.type != "cpu":
        raise RegenError(f"regen.apply: emulate_link=True emulates a GPU's host link on a CPU device; this model is "
                         f"on {device}, whose real link regen uses")
    swapping = [s.plan for s in states if s.index.swap_bytes]
    if any(not (plan.d2h_bytes_per_s > 0 and plan.h2d_bytes_per_s > 0) for plan in swapping):
        raise RegenError("regen.apply: emulate_link=True needs the plan's copy bandwidths (d2h/h2d_bytes_per_s) "
                         "to be positive")
    plan = (swapping or [states[0].plan])[0]
    return plan.d2h_bytes_per_s, plan.h2d_bytes_per_s


def _close_engines(engines: dict) -> None:
    """Stop the engines' background copies (each is closed once; later steps get new engines)."""
    for engine in list(engines.values()):
        engine.close()
    engines.clear()



def apply(model: nn.Module, plan: Plan | str | Path | list | None = None, on_mismatch: str = "dynamic",
          emulate_link: bool = False, memory_cap: int | str | None = None, policy: str | None = None,
          learner: Learner | None = None, link_gb_s: float | tuple[float, float] | None = None):
    """Replay `plan` on `model`'s training steps until the handle is removed (or the `with` ends).

    `plan` is a Plan or a path to a plan file, a directory of plan files, or a list of them, one per way
    the loop calls the model or shape it calls it with (a plan set: each step runs under the plan profiled
    with its call; plan_set.py). A call no plan fits runs, with `on_mismatch="dynamic"` (default), in
    dynamic mode under the smallest cap of the set (a notice the first time per call signature); with
    `"raise"` it raises PlanMismatchError; with `"keep"` it warns and runs unplanned. A mismatch found
    mid-step (a planned call whose ops differ from the plan's) raises with "raise"; otherwise the rest of the
    step runs unplanned, with a warning (under "dynamic", a call whose steps do so twice runs in dynamic mode
    from then on).
    `emulate_link=True` (CPU devices only) runs the plan's swaps over an emulated host link at the plan's
    bandwidths, asynchronously, as over a GPU's link (regen.runtime.swap.emulated).

    Without a plan, `memory_cap` (bytes, or text such as "6GiB") runs dynamic mode: saved tensors are
    dropped at run time to stay under the cap and rebuilt when backward needs them, chosen by the
    eviction score `policy` ("graph", the default, or "dtr"): regen.runtime.dynamic. `policy` also
    chooses the score of a plan set's dynamic steps. With a host link, dynamic mode also swaps saved
    tensors out and back (regen.runtime.dynamic.swaps): `link_gb_s` is its bandwidth in GB/s (one figure,
    or a (d2h, h2d) pair): on CUDA, regen.apply measures it when not given; on a CPU device, only with
    `emulate_link=True`, whose emulated link runs at `link_gb_s`.

    `learner` (regen.learning, from `regen.apply(..., learn=True)`) learns a plan for each call signature
    no plan fits (learned.py); without a plan, the steps run in dynamic mode under `memory_cap` until then.

    A torch.compile'd model (`torch.compile(model)`, or `model.compile()`) takes one plan, carried out by the
    compiler as recompute policies on its graph (compiled.py); the other arguments are for eager models. An eager
    model compiled while its handle is applied runs its plan the same way from its first compiled call.
    """
    if policy is not None:
        check_policy(policy)
    if plan is None:
        if memory_cap is None:
            raise RegenError("regen.apply: give a plan, or a memory_cap (e.g. memory_cap='6GiB') for dynamic mode")
        if learner is None:
            return DynamicHandle(model, memory_cap, policy or "graph", link_gb_s, emulate_link)
        if emulate_link or link_gb_s is not None:
            raise RegenError("regen.apply: learn=True's dynamic steps recompute only; emulate_link and link_gb_s "
                             "are for dynamic mode alone and for plans that swap")
        return RegenHandle(model, None, cap_bytes=cap_bytes(memory_cap), policy=policy or "graph", learner=learner)
    if compiled_module(model) is not None:
        return _compiled_plan_handle(model, plan, on_mismatch, emulate_link, memory_cap, policy, learner, link_gb_s)
    if link_gb_s is not None:
        raise RegenError("regen.apply: link_gb_s is for dynamic mode (no plan); a plan swaps at its own bandwidth")
    if memory_cap is not None:
        raise RegenError("regen.apply: memory_cap is for dynamic mode (no plan); a plan was solved for its own cap, "
                         "and the calls no plan fits run in dynamic mode under the plans' cap")
    if on_mismatch != "dynamic" and (policy is not None or learner is not None):
        raise RegenError(f"regen.apply: {'learn' if learner is not None else 'policy'} is for the calls no plan "
                         f"fits, run in dynamic mode: on_mismatch='dynamic', not {on_mismatch!r}")
    return RegenHandle(model, plan, on_mismatch=on_mismatch, emulate_link=emulate_link, policy=policy or "graph",
                       learner=learner)


_ONE_PLAN_COMPILED = ("regen.apply: a compiled model runs one plan; a plan set (one plan per call) needs the "
                      "eager runtime: apply it to the module without torch.compile")


def _eager_only_arguments(on_mismatch: str, emulate_link: bool, **others) -> list[str]:
    """The arguments given of those only the eager runtime carries out."""
    given = [name for name, value in others.items() if value is not None]
    if emulate_link:
        given.append("emulate_link")
    if on_mismatch != "dynamic":
        given.append("on_mismatch")
    return given


def _compiled_refusal(given: list[str]) -> str:
    return (f"regen.apply: {', '.join(given)} is for an eager model; a compiled model runs one plan, recompute "
            f"only, carried out by the compiler")


def _compiled_plan_handle(model, plan, on_mismatch, emulate_link, memory_cap, policy, learner, link_gb_s):
    """One plan on a torch.compile'd model (compiled.py); what only the eager runtime does is refused."""
    given = _eager_only_arguments(on_mismatch, emulate_link, memory_cap=memory_cap, policy=policy, learn=learner,
                                 link_gb_s=link_gb_s)
    if given:
        raise RegenError(_compiled_refusal(given))
    many = isinstance(plan, (list, tuple)) and len(plan) > 1
    states = [] if many else plan_states(plan)
    if many or len(states) > 1:
        raise RegenError(_ONE_PLAN_COMPILED)
    return CompiledPlanHandle(model, states[0].plan)
