"""The engine that runs dynamic steps: the memory reading, the dispatch mode, the live steps.

Both handles drive it from their root pre-hook: `DynamicHandle` (dynamic mode alone) for every step, and
`RegenHandle` (apply.py) for the steps no plan of its set fits (`on_mismatch="dynamic"`). The engine
owns no module hook, so one handle's hooks decide every step and the two sets never meet:

* `start_step()`: a dynamic step begins; its saved-tensor hooks are pushed, and the engine's dispatch
  mode (`DynamicMode`) if it is not pushed yet;
* `close_current()`: the next step (of either kind) begins: the current step's saved-tensor hooks are
  popped and it is let go once autograd holds none of its handles;
* `pop_mode()`: a planned step begins: the mode is popped when it is on top of the stack. It stays
  pushed after a step's forward, so the step's backward ops are seen (counted as memory in use on CPU),
  and `regen.runtime.stacks.pop_finished` (at any handle's step start) pops it once it is on top and no
  step of the engine is alive: the program's ops between steps (an optimizer step, another model's step
  in the same thread) then run without it;
* `remove(abort)`: the handle is removed.

On CUDA the allocator's peak (`torch.cuda.max_memory_allocated`, never reset: the loop's own figures stay
its own) is read when a step starts and when it is let go; a step that set a new maximum over its cap +
5% warns with that figure (`DynamicStep.measured_peak`), as the checks at packs and unpacks cannot see an
op's temporaries or backward's gradients there; the steps after it keep a reserve free (Note [ The learned
reserve ]).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode, _get_current_dispatch_mode

from regen.opinfo import is_counted
from regen.runtime import stacks
from regen.runtime.dynamic.backward_figures import BackwardFigures, figures
from regen.runtime.dynamic.cap_memory import DeviceMemory, TrackedMemory
from regen.runtime.dynamic.dynamic_step import DynamicStep
from regen.runtime.dynamic.swaps import new_swaps
from regen.runtime.dynamic.transients import TransientRecorder
from regen.runtime.model_access import module_device
from regen.runtime.peak_check import cuda_peak_reader


# NOTE [ The learned reserve ]
# The checks at packs and unpacks count what the step made so far (on CUDA, the allocator's figure) plus a
# headroom for the next op (eviction.py). What they cannot see (an op's own temporaries, the gradients
# backward makes between two unpacks, a loss whose backward holds several logits-sized tensors at once) shows
# only in the allocator's peak, read when a step is let go. So each step's overshoot (its measured peak over
# the cap) is added to a reserve that every check of the steps after it keeps free, too:
#   1. it grows by the whole overshoot of a step, and only of a step whose checks always found something to
#      drop before the reserve was free (the headroom aside: it is a guess, the reserve a measurement); when
#      a check ran out of victims, a larger reserve frees nothing more: the cap is below what dynamic mode
#      reaches, and growing it would make every later check evict all it can;
#   2. it never shrinks (a step under the cap says the reserve worked, not that it is too large) and never
#      passes MAX_RESERVE_FRACTION of the cap;
#   3. the first step over the cap still warns (its figure is the allocator's); the ones after it stay under.


MAX_RESERVE_FRACTION = 0.5


# NOTE [ Temporaries per call ]
# What a backward op allocates and frees inside itself (CPU: transients.py) grows with the step's shapes, as its
# outputs do, so the temporaries are kept per call (call_signature.signature_key), with its foresight and figures:
#   1. a step of a call whose temporaries were recorded keeps room for exactly them before each backward op
#      (with exact foresight, and no headroom);
#   2. a step of a call without them takes the last recorded call's as a guess, with the headroom on top, and
#      runs no backward without the mode: taken as exact, the CNN's batch-16 steps on its batch-4 step's
#      temporaries ran without the mode and measured 1.08x their cap, without a warning;
#   3. the engine's first step records, and so does a call's second step (its first that repeats one): lengths
#      that never repeat are recorded once, buckets once each (a recorded step pays for the profiler's events:
#      the built-in GPT's 92 ms step took 113 ms);
#   4. the recorded step's allocator events give its peak, the allocator's figure: over the cap + 5% it warns
#      with it. No reserve is learned from it: what its checks did not see was mostly the temporaries, which the
#      steps after it keep room for.


@dataclass
class DynamicStats:
    """What a dynamic engine did so far (cumulative over steps)."""

    steps: int = 0  # steps started (training forwards with grad)
    evictions: int = 0  # held nodes dropped to stay under the cap
    rebuilds: int = 0  # recipes replayed (a dropped node needed again, or an input of one)
    input_rebuilds: int = 0  # of which inputs of another rebuild (DTR's recursion)
    over_cap_steps: int = 0  # steps over the cap: nothing left to drop, or a measured peak (CUDA) (OverCapWarning)
    thrashing_steps: int = 0  # steps whose rebuilds passed their limit and stopped dropping (eviction.py)
    backwards_without_mode: int = 0  # backwards run on the step before's figures (backward_figures.py)
    peak_in_use_bytes: int = 0  # the highest memory in use seen at a pack, unpack, rebuild or (CPU) after an op, with
    # its learned temporaries (cap_memory.py, transients.py: on CPU the allocator's figure then)
    copy_outs: int = 0  # host link (swaps.py): copies to the host started ahead
    swap_evictions: int = 0  # of the evictions, nodes let go as swapped out (their bytes on the host)
    copy_ins: int = 0  # copies back to the device
    synchronous_copy_ins: int = 0  # of which issued at the unpack that needed them (none ahead)
    link_wait_s: float = 0.0  # time the step waited on the link (an emulated link's copies not yet due)
    link_copy_cpu_s: float = 0.0  # an emulated link's memmoves on the compute thread (emulation only)
    reserve_bytes: int = 0  # kept free at every check, learned from measured peaks (Note [ The learned reserve ])


# the calls whose last step an engine remembers (Note [ Room for the next op ]; backward_figures.py):
# bucketed lengths, a training and an evaluation shape
CALLS_REMEMBERED = 16


@dataclass
class _Seen:
    """What the last dynamic step of one call made (forward and backward ops: their op and bytes), the figures of
    that call's last backward run under the mode, and (CPU) its backward ops' temporaries, once a step recorded
    them (transients.py)."""

    made_forward: list = field(default_factory=list)
    made_backward: list = field(default_factory=list)
    figures: BackwardFigures | None = None
    temporaries: dict[int, int] | None = None


class DynamicMode(TorchDispatchMode):
    """Hands every counted op to the current step: `forward_op` until backward begins, then `backward_op`."""

    def __init__(self):
        super().__init__()
        self.step: DynamicStep | None = None
        self.paused = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if kwargs is None:
            kwargs = {}
        step = self.step
        if step is None or self.paused or step.released or not is_counted(func):
            return func(*args, **kwargs)
        if step.in_backward or torch._C._current_graph_task_id() != -1:
            return step.backward_op(func, args, kwargs)
        if step.closed:  # the model's next call began (a planned step): its ops are not this step's
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


class DynamicEngine:
    """Runs dynamic steps of one model under `cap_bytes`, evicting by the score `policy` (policy.py)."""

    def __init__(self, root: nn.Module, cap_bytes: int, policy: str,
                 link_bytes_per_s: tuple[float, float] | None = None, emulate_link: bool = False):
        self.root = root
        self.cap_bytes = cap_bytes
        self.policy = policy
        device = module_device(root)
        on_cuda = device is not None and device.type == "cuda"
        self.device_type = device.type if device is not None else "cpu"
        self.memory = DeviceMemory(device) if on_cuda else TrackedMemory()
        self.read_peak = cuda_peak_reader(device)  # the allocator's peak so far, or None (CPU)
        self.mode = DynamicMode()
        self.stats = DynamicStats()
        self.swaps = new_swaps(device, link_bytes_per_s, emulate_link, self.stats)
        self.removed = False
        self.current: DynamicStep | None = None
        self.live_steps: list[DynamicStep] = []
        # CPU: the backward ops' temporaries a step recorded last, of whatever call (transients.py)
        self.latest_temporaries: dict[int, int] | None = None
        self.recorder: TransientRecorder | None = None  # recording a step's backward now
        # per call key (None: calls not told apart), the last step's ops' outputs and its call's last backward run
        # under the mode (backward_figures.py)
        self._seen: dict = {}
        self._module_hooks: list = []  # a step taking over midway: the one-shot hooks that push the mode

    @property
    def mode_pushed(self) -> bool:
        return stacks.mode_pushed(self.mode)

    @property
    def hooks_installed(self) -> bool:
        return self.mode_pushed or (self.current is not None and stacks.hooks_pushed(self.current.pack))

    def start_step(self, call_key=None, held_bytes: int | None = None) -> DynamicStep:
        """A training forward begins as a dynamic step; `call_key` tells its call apart from others
        (`call_signature.signature_key`; None: not told apart, and never a backward without the mode).
        `held_bytes`: the step takes over a planned step's forward midway, whose part holds these bytes (CPU:
        counted on top of the model's; Note [ A step that leaves its plan ] in regen/runtime/apply.py): it foresees
        nothing, records nothing and is not remembered (its forward is a part)."""
        midway = held_bytes is not None
        self._close_recorder()
        previous = self.current
        if previous is not None and not previous.midway:
            self._remember(previous)
        self.close_current()
        if not midway:  # (midway: inside the planned step's pack hook or op, whose entries stay pushed)
            stacks.pop_finished()  # this handle's and others' steps that pack no more
        self._take_figures(previous)
        # Note [ Room for the next op ]: what the last step of this call made, else the step before's; a backward
        # without the mode only on its own call's figures (another call's, differing in what requires grad, may
        # make the same forward and a larger backward)
        known = self._seen.get(call_key) if call_key is not None and not midway else None
        seen = known if known is not None or previous is None or midway else self._seen.get(previous.call_key)
        self.memory.begin_step(self.root, held_bytes or 0)
        if midway:
            self.memory.track_running_frames(self.root)
        step = DynamicStep(self.memory, self.cap_bytes, self.policy, self.stats, self.mode.pause, self._released,
                           self.swaps, self.device_type, self.read_peak() if self.read_peak is not None else None)
        step.call_key = call_key
        step.midway = midway
        step.residency.reserve_bytes = self.stats.reserve_bytes
        step.foresee((seen.made_forward, seen.made_backward) if seen is not None else None)
        self._give_temporaries(step, known)
        if step.midway:
            step.record = None  # its backward runs the planned part's unpacks too: no figures for its call
        elif step.record is not None:  # Note [ A backward without the dispatch mode ] 2
            figures_known = known.figures if known is not None else None
            step.gate_backward(figures_known if self._backward_without_mode(step, figures_known) else None,
                               self._leave_mode)
        self.stats.steps += 1
        self.current = step
        self.live_steps.append(step)
        if midway:
            self._follow_ops_from_next_module_call(step)
        else:
            self._follow_ops(step)
        stacks.push_hooks(step, step.pack, step.unpack)
        return step

    def _follow_ops(self, step: DynamicStep) -> None:
        """The dispatch mode hands the ops from here to `step` (pushed if it is not)."""
        self.mode.step = step
        if not self.mode_pushed:
            stacks.push_mode(self.mode, lambda: not self.live_steps)

    def _follow_ops_from_next_module_call(self, step: DynamicStep) -> None:
        """A step taking over midway: the op that left the plan may still be running (its saved inputs are packed
        before its kernel runs, and a mode pushed then would see the ops its kernel calls, such as the output
        buffer a CPU attention kernel allocates and fills, as ops of their own: rebuilt, such a buffer is empty).
        So the mode follows the ops from the next module call or return, where no op is running; until then the
        step sees no op, and keeps what it packs."""
        self.mode.step = None
        hooks = []

        def follow(*_):
            self._drop_module_hooks()
            if self.current is step and not step.closed and not self.removed:
                self.memory.track_running_frames(self.root)  # what the ops it did not see made and the forward holds
                self._follow_ops(step)

        hooks.append(torch.nn.modules.module.register_module_forward_pre_hook(follow))
        hooks.append(torch.nn.modules.module.register_module_forward_hook(follow))
        self._module_hooks = hooks

    def _drop_module_hooks(self) -> None:
        for h in self._module_hooks:
            h.remove()
        self._module_hooks = []

    def _give_temporaries(self, step: DynamicStep, known: _Seen | None) -> None:
        """CPU: the temporaries `step`'s backward checks keep room for (Note [ Temporaries per call ]), and a
        recorder when they are to be learned in its backward."""
        own = known.temporaries if known is not None else None
        step.temporaries = own if own is not None else self.latest_temporaries
        step.temporaries_exact = own is not None
        if self.read_peak is not None or own is not None or step.midway:
            return
        if self.latest_temporaries is None or known is not None:  # the first step, or a call seen before
            recorder = TransientRecorder(lambda r: self._recorded(step, r))
            if recorder.start():
                self.recorder = step.recorder = recorder

    def _recorded(self, step: DynamicStep, recorder: TransientRecorder) -> None:
        """A recorded step's backward returned: its call's temporaries, and the allocator's peak of the step (Note
        [ Temporaries per call ] 4)."""
        seen = self._seen.setdefault(step.call_key, _Seen())
        seen.temporaries = self.latest_temporaries = recorder.bytes_by_op
        if not step.aborted:
            step.measured_peak(step.start_bytes + recorder.peak_increase_bytes)

    def _remember(self, step: DynamicStep) -> None:
        """What `step` made, op by op, as the last step of its call (a backward without the mode made no figures:
        the call's earlier ones stand)."""
        seen = self._seen.pop(step.call_key, None) or _Seen()
        seen.made_forward = step.made_forward
        if not step.mode_free:
            seen.made_backward = step.made_backward
        self._seen[step.call_key] = seen  # the most recent last
        while len(self._seen) > CALLS_REMEMBERED:
            self._seen.pop(next(iter(self._seen)))

    def _take_figures(self, step: DynamicStep | None) -> None:
        """The figures of `step`'s backward for its call, when it ran in full under the mode and held its cap (Note
        [ A backward without the dispatch mode ] 1, 4)."""
        seen = self._seen.get(step.call_key) if step is not None else None
        if (seen is None or step.record is None or not step.released or step.aborted or step.residency.thrashed
                or step.warned or seen.temporaries is None or step.ops_at_backward is None):
            return
        seen.figures = figures(step.record, seen.temporaries, step.start_bytes, step.ops_at_backward)

    def _backward_without_mode(self, step: DynamicStep, figures_known: BackwardFigures | None) -> bool:
        """`step` may run its backward without the dispatch mode on its call's `figures_known` (Note [ A backward
        without the dispatch mode ] 2): taken with the model's memory at its start what it is now, the backward's
        temporaries learned and not recording (whether its forward repeats that call's, the gate checks)."""
        return (figures_known is not None and step.temporaries_exact and step.recorder is None
                and figures_known.start_bytes == step.start_bytes)

    def model_returned(self) -> None:
        """The model's root call returned (the handle's post-hook)."""
        if self.current is not None:
            self.current.model_returned()

    def _leave_mode(self) -> bool:
        """Pop the dispatch mode for a backward without it, when it is on top (False: it stays)."""
        if _get_current_dispatch_mode() is not self.mode:
            return False
        stacks.let_go(self.mode)
        return True

    def close_current(self) -> None:
        """The model's next call began: the current step packs no more."""
        self._drop_module_hooks()
        step = self.current
        if step is None:
            return
        step.closed = True
        step.drop_gate()
        stacks.pop_hooks(step.pack)  # or later, by pop_finished (the next step's start, remove()), once on top
        self.current = None
        step.maybe_release()

    def pop_mode(self, force: bool = False) -> None:
        """Pop the dispatch mode when it is on top of the stack (with `force`, forget it when it is not
        on the stack at all)."""
        if self.mode_pushed and (force or _get_current_dispatch_mode() is self.mode):
            stacks.let_go(self.mode)  # popped now when on top, else once it is (regen.runtime.stacks)
        if not self.mode_pushed:
            self.mode.step = None

    def remove(self, abort: bool) -> None:
        """The handle is removed: hooks and mode popped; with `abort` every live step released, otherwise a
        step whose graph autograd still holds can finish its backward (rebuilding what it dropped)."""
        self.close_current()
        self.pop_mode(force=True)
        self.mode.step = None
        self.removed = True
        for s in list(self.live_steps):
            if abort:
                s.release(aborted=True)
            else:
                s.maybe_release()
        self._close_recorder()
        stacks.pop_finished()  # what this removal uncovered (another handle's, or this one's let go)
        self._close_link()

    def _close_recorder(self) -> None:
        """CPU: the step that recorded is over (its figures came when its backward returned: `_recorded`)."""
        recorder, self.recorder = self.recorder, None
        if recorder is not None:
            recorder.close()

    def _learn_reserve(self, overshoot_bytes: int, ran_out: bool) -> None:
        """Note [ The learned reserve ]."""
        if overshoot_bytes <= 0 or ran_out:
            return
        grown = self.stats.reserve_bytes + overshoot_bytes
        self.stats.reserve_bytes = min(grown, int(MAX_RESERVE_FRACTION * self.cap_bytes))

    def _close_link(self) -> None:
        """Every copy over the link lands once the handle is removed and no step can copy any more."""
        if self.removed and not self.live_steps and self.swaps is not None:
            self.swaps.close()

    def _released(self, step: DynamicStep) -> None:
        if step.peak_at_start_bytes is not None and not step.aborted:
            peak = self.read_peak()
            if peak > step.peak_at_start_bytes:  # a new maximum: this step's own peak
                step.measured_peak(peak)
                self._learn_reserve(peak - self.cap_bytes, step.residency.ran_out)
        if step in self.live_steps:
            self.live_steps.remove(step)
        self._close_link()
