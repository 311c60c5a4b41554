"""`profile_workload`: run a workload's training step on the target device and build its Profile.

Phases, in order (each announced through `progress`):

1. warm-up: `warmup_steps` plain steps (forward, backward, optimizer step), and more while they and the
   plain timing's steps after them take less than `warmup_s` (on a CPU a small model's step keeps getting
   faster for ten steps or so, 15% on the built-in GPT: the allocator settles), so caches, lazy
   initialisation and the optimizer state exist as they do in steady-state training;
2. plain timing: `repeats` uninstrumented forward+backward steps (`step_time_s`, median; their forwards
   alone `forward_time_s`) each followed by a separately timed optimizer step (`optimizer_step_time_s`);
3. the recorded step: one forward+backward under the capture mode and saved-tensor hooks (op sequence,
   tensors, saved tensors, memory timeline; see regen.profiler.capture), with module hooks naming each
   op's module and recording each submodule call's extent (regen.profiler.modules);
4. the liveness probe: one more forward+backward that measures until when something other than autograd
   holds each saved storage (`SavedTensor.held_until_op`, regen.profiler.liveness), and which module calls
   leave state behind besides their output (`ModuleCall.leaves_behind`, regen.profiler.outside_state);
5. op timing: `repeats` steps under a timing-only mode (and pass-through saved-tensor hooks, so the op
   sequence is the recorded one); each must dispatch exactly the recorded op sequence, and every op's
   `time_s` is the median over them. Each is followed by one more plain step, and `step_time_s` is the
   median over all plain steps of phases 2 and 5, so that a burst of load on a shared machine during
   either phase moves it little;
6. a check that the plain step time and the summed op times agree: when they are far apart (another
   process ran during one of them), a warning, and phases 2 and 5 again (at most 3 times in all; a
   disagreement that persists is kept and noted in the profile);
7. the caller's probe of what regen's runtime adds per event (`runtime_probe`: it times the workload's forward
   too, so it comes right after phase 5's last plain step), and the bandwidth probe.

The profile also records how the step called the model (`Profile.call`, regen.call_signature): a batch
tensor that requires grad (a GAN's discriminator in the generator's step) makes autograd save more.

With `park=True` (`regen profile --park`) every step runs with its saved activations parked in host
memory (regen.profiler.park), so a step that does not fit on the device is profiled: the recorded
timeline is still the unplanned one (the trackers add back what is parked), op times leave the copies
out, and plain step times subtract the time spent copying. On CUDA, a warm-up step that runs out of
memory switches the rest of the profile to parked steps, and says so.

The optimizer is `torch.optim.AdamW` with lr=0: the same kernels, time and state memory as a real step,
without changing the model's weights (weight decay multiplies by 1 - lr*wd = 1, the update is scaled by 0).
Gradients are set to None between steps, as `zero_grad()` does by default, and so are those of batch
tensors that require grad (a workload profiling a module's use on another's output: docs/recipes.md "A
module used two ways"), whose gradient a training step hands on rather than accumulates.
"""

from __future__ import annotations

import gc
import statistics
import time
from contextlib import nullcontext
from typing import Callable

import torch
from torch.utils._pytree import tree_flatten

from regen.caches import CACHE_NOTICE, training_caches_off
from regen.call_signature import call_signature
from regen.errors import DATA_PARALLEL_REFUSED, DeviceError, RegenError, WorkloadError
from regen.formats.profile import (EXCLUDED_OTHER_DEVICE, OTHER_HOOKS_ADVICE, PHASE_BACKWARD, Profile, RuntimeCosts,
                                   StaticMemory, op_fingerprint)
from regen.heap import give_back_freed_host_memory
from regen.opinfo import unique_storage_bytes
from regen.profiler.accumulation import EngineSums
from regen.profiler.bandwidth import Bandwidth, measure_bandwidth
from regen.ranks import rank_agreement
from regen.profiler.capture import (
    DOUBLE_BACKWARD_NOTE,
    Capture,
    CaptureMode,
    StepRecorder,
    TimingMode,
    pass_through_pack,
    pass_through_unpack,
)
from regen.profiler.environment import (
    device_info,
    library_versions,
    optimizer_state_tensors,
    resolve_device,
)
from regen.profiler.gradients import GradientWatch
from regen.profiler.liveness import probe_step
from regen.profiler.memory import CpuAllocatorEvents, CudaMemoryTracker, LiveStorageTracker, no_missing_bytes
from regen.profiler.modules import ModuleRecorder
from regen.profiler.park import ParkingHooks, ParkStore
from regen.workloads import Workload, call_arguments, forward_with_output, training_step

OPTIMIZER_LR = 0.0  # see the module docstring: a real AdamW step that leaves the weights unchanged
# what regen profile's caller measures of its runtime: (device, timed_forward or None, plain forward times) ->
# RuntimeCosts, where timed_forward(context) runs one step of the workload with `context` around its forward and
# returns the forward's seconds, and the plain forward times are the plain steps' (regen.runtime.self_timing)
RuntimeProbe = Callable[[torch.device, Callable | None, list[float]], RuntimeCosts]
MAX_WARMUP_STEPS = 12  # warm-up steps taken to fill `warmup_s`, at most
# the plain step time and the summed op times disagree (a busy machine) when they differ by this factor
# and by this much; then both are measured again, up to MAX_TIMING_ATTEMPTS times in all
TIMING_DISAGREE_RATIO = 2.0
TIMING_DISAGREE_MIN_S = 0.02
MAX_TIMING_ATTEMPTS = 3
MAX_RECORDINGS = 3  # the step is recorded again while the steps after it dispatch other ops (a steady state)

Progress = Callable[[str], None]


def profile_workload(workload: Workload, device: str, repeats: int, warmup_steps: int,
                     progress: Progress | None,
                     runtime_probe: RuntimeProbe | None = None, park: bool = False,
                     bandwidth: Bandwidth | None = None, optimizer_step: bool = True,
                     warmup_s: float = 0.0) -> Profile:
    """Profile one training step of `workload` on `device` (see the module docstring for the phases).

    `runtime_probe` measures what regen's runtime adds per event on this device (`regen profile` passes
    regen.runtime.self_timing.measure_runtime_costs); without it the profile has no `runtime_costs`. `park`
    records the step with its saved tensors parked in host memory (a step that does not fit). `bandwidth`:
    the link's, measured before (no probe buffers then); `optimizer_step=False` runs no optimizer step (no
    optimizer state: a profile taken between a user's training steps, regen.learning). `warmup_s`: more
    warm-up steps after `warmup_steps` while all of them have taken less than this (`regen profile`: 2 s)."""
    say = progress or (lambda message: None)
    caches = training_caches_off(workload.model)  # as the runtime runs the planned steps (regen.caches)
    turned_off = bool(caches)
    if turned_off:
        say(f"note: {CACHE_NOTICE}")
    try:
        profile = _profile(workload, device, repeats, warmup_steps, say, runtime_probe, park, bandwidth,
                           optimizer_step, warmup_s)
    finally:
        caches.restore()
    if turned_off:
        profile.notes.append("key/value cache: off while profiling (config.use_cache=False), as regen.apply runs "
                             "training steps")
    return profile


def _profile(workload: Workload, device: str, repeats: int, warmup_steps: int, say: Progress,
             runtime_probe: RuntimeProbe | None, park: bool, bandwidth: Bandwidth | None, optimizer_step: bool,
             warmup_s: float) -> Profile:
    """profile_workload's phases, with the model as the runtime will train it."""
    dev = resolve_device(device)
    if repeats < 1:
        raise RegenError(f"repeats must be at least 1, got {repeats}")
    if warmup_steps < 0:
        raise RegenError(f"warm-up steps must be 0 or more, got {warmup_steps}")
    if not warmup_s >= 0:
        raise RegenError(f"the warm-up time must be 0 or more seconds, got {warmup_s}")
    _check_model_device(workload, dev)
    parameters = list(workload.model.parameters())
    trainable = [p for p in parameters if p.requires_grad]
    if not trainable:
        raise WorkloadError(f"workload '{workload.name}': the model has no trainable parameters")
    optimizer = torch.optim.AdamW(trainable, lr=OPTIMIZER_LR)
    timer = _StepTimer(workload, optimizer if optimizer_step else None, dev, repeats, say, park)
    _warm_up(timer, warmup_steps, warmup_s)
    step_times_s, optimizer_times_s = timer.plain_steps()
    optimizer_state_bytes = unique_storage_bytes(optimizer_state_tensors(optimizer))

    for attempt in range(1, MAX_RECORDINGS + 1):  # until the steps after the recorded one dispatch its ops
        say("recording one step: ops, saved tensors, memory" + (" (saved tensors parked in host memory)"
                                                                 if timer.park else ""))
        capture = record_step(workload, dev, extra_inputs=optimizer_state_tensors(optimizer), park=timer.park)
        for note in capture.notes:
            if note == DOUBLE_BACKWARD_NOTE or OTHER_HOOKS_ADVICE in note:
                say(f"warning: {note}")
        gradient_bytes = unique_storage_bytes(p.grad for p in parameters)
        _zero_grad(optimizer, workload)
        give_back_freed_host_memory()  # each phase's host memory is its own (regen.heap)
        say("probing until when saved tensors are held outside autograd")
        notes = list(capture.notes) + record_probe(workload, capture)
        give_back_freed_host_memory()
        try:
            step_times_s, optimizer_times_s, op_times_s = _times_that_agree(timer, capture, step_times_s,
                                                                            optimizer_times_s, notes)
            break
        except SequenceChanged as exc:
            if attempt == MAX_RECORDINGS:
                raise WorkloadError(f"{exc}, in each of {attempt} recordings. A plan needs a training step that "
                                    f"dispatches the same ops every time (no random layer drop, no branch on the "
                                    f"data); train such a model in dynamic mode: regen.apply(model, "
                                    f"memory_cap=...)") from None
            say(f"warning: {exc}; recording again, as the model trains in its steady state "
                f"({attempt + 1}/{MAX_RECORDINGS})")
            step_times_s, optimizer_times_s = timer.plain_steps()
    if attempt > 1:
        notes.append(f"recorded {attempt} times: the op sequence changed between the first steps, and this "
                     f"recording is the one the steps after it dispatched")
    for op, time_s in zip(capture.ops, op_times_s):
        op.time_s = time_s

    say(("measuring the runtime's own costs and " if runtime_probe else "measuring ") + "host<->device bandwidth")
    # the probe times forwards of this workload too, unless a step does not fit (parked): first, right after the
    # op timing's last plain step (regen.runtime.self_timing, NOTE [ The workload's dispatch figure ])
    runtime_costs = (runtime_probe(dev, None if timer.park else timer.forward_time_under, timer.forward_times_s)
                     if runtime_probe is not None else None)
    bandwidth = bandwidth or measure_bandwidth(dev)
    say(f"assembling the profile: {len(capture.ops)} ops, {len(capture.saved_tensors)} saved tensors")
    notes.append(f"optimizer: torch.optim.AdamW (lr={OPTIMIZER_LR}: real kernels and state, weights unchanged)"
                 if optimizer_step else "optimizer: none (the step alone)")
    if timer.park:
        notes.append("recorded parked: saved tensors were held in host memory during the profile; the memory "
                     "timeline is the unplanned step's, computed from the bookkeeping")
    if dev.type != "cuda":
        notes.append("memory on CPU: live storages tracked by the profiler, kernel temporaries from the allocator's "
                     "profiler events")
    return Profile(
        workload=workload.describe(),
        device=device_info(dev, bandwidth),
        static_memory=StaticMemory(parameter_bytes=unique_storage_bytes(parameters), gradient_bytes=gradient_bytes,
                                   optimizer_state_bytes=optimizer_state_bytes),
        versions=library_versions(),
        repeats=repeats,
        step_time_s=statistics.median(step_times_s),
        forward_time_s=statistics.median(timer.forward_times_s),
        optimizer_step_time_s=statistics.median(optimizer_times_s),
        memory_at_start_bytes=capture.memory_at_start_bytes,
        peak_bytes=max((op.memory_peak_bytes for op in capture.ops), default=capture.memory_at_start_bytes),
        fingerprint=op_fingerprint(capture.ops, capture.tensors),
        ops=capture.ops, tensors=capture.tensors, saved_entries=capture.saved_entries,
        saved_tensors=capture.saved_tensors, notes=notes, module_calls=capture.module_calls,
        gradients_made=capture.gradients_made,
        runtime_costs=runtime_costs,
        call=call_signature(workload.model, *call_arguments(workload.batch)),
    )


def record_probe(workload: Workload, capture: Capture) -> list[str]:
    """Fill each saved tensor's `held_until_op` and each module call's `leaves_behind` from the probe step;
    the notes they call for."""
    # every storage autograd holds that the step's ops made: the candidates', and those saved on another
    # device (never planned, but held by autograd, not by something outside the call that made them)
    entries = ({e for s in capture.saved_tensors for e in s.entries}
               | {e.index for e in capture.saved_entries if e.excluded_reason == EXCLUDED_OTHER_DEVICE})
    found = probe_step(workload, entries, capture.op_names)
    if found is None:
        for call in capture.module_calls:  # unknown: no call is taken to be replayable
            call.leaves_behind = "the liveness probe step dispatched another op sequence"
        return ["liveness probe: the probe step dispatched another op sequence; saved tensors are taken to be "
                "freed at their last forward use, and no module call is replayed"]
    for call in capture.module_calls:
        call.leaves_behind = found.left_behind.get((call.module, call.call))
    return _held_until(capture, found.held_until_op) + _left_behind_note(capture)


def _left_behind_note(capture: Capture) -> list[str]:
    calls = [c for c in capture.module_calls if c.leaves_behind]
    if not calls:
        return []
    first = calls[0]
    return [f"{len(calls)} module calls leave state behind besides their output and are not replayed as regions, "
            f"e.g. {first.module or '(root)'}: {first.leaves_behind}"]


def _held_until(capture: Capture, held: dict[int, int]) -> list[str]:
    """Each saved tensor's `held_until_op`; the note on those held into backward."""
    kept = []
    for s in capture.saved_tensors:
        s.held_until_op = max((held.get(e, s.last_forward_use) for e in s.entries), default=s.last_forward_use)
        first = s.first_backward_use
        if first is not None and s.held_until_op >= first - 1 and s.last_forward_use < first - 1:
            kept.append(s)
    if not kept:
        return []
    return [f"{len(kept)} saved tensors ({sum(s.bytes for s in kept)} B) stay held by something other than autograd "
            f"(a list, a module attribute, the model's output) into backward: dropping them frees nothing, so they "
            f"are kept"]


def _times_that_agree(timer: "_StepTimer", capture: Capture, step_times_s: list[float],
                      optimizer_times_s: list[float], notes: list[str]) -> tuple[list[float], list[float], list[float]]:
    """Op times, and plain step and op times measured again while they disagree (at most MAX_TIMING_ATTEMPTS
    in all). Under torch.distributed every rank measures again when any rank's disagree, so all ranks run
    the same steps (FSDP's collectives)."""
    any_rank = rank_agreement()
    step_times_s, optimizer_times_s, op_times_s = _with_op_times(timer, capture, step_times_s, optimizer_times_s)
    for attempt in range(1, MAX_TIMING_ATTEMPTS + 1):
        problem = _timing_disagreement(statistics.median(step_times_s), sum(op_times_s))
        if any_rank is not None and any_rank(problem is not None) and problem is None:
            problem = "another rank's step time and op times disagree"
        if problem is None:
            break
        if attempt == MAX_TIMING_ATTEMPTS:
            timer.say(f"warning: {problem}; kept as measured (is another process using the machine?)")
            notes.append(f"timing: {problem} after {attempt} measurements (a busy machine?)")
            break
        timer.say(f"warning: {problem} (another process?); measuring again")
        step_times_s, optimizer_times_s = timer.plain_steps()
        step_times_s, optimizer_times_s, op_times_s = _with_op_times(timer, capture, step_times_s,
                                                                     optimizer_times_s)
    return step_times_s, optimizer_times_s, op_times_s


def _with_op_times(timer: "_StepTimer", capture: Capture, step_times_s: list[float],
                   optimizer_times_s: list[float]) -> tuple[list[float], list[float], list[float]]:
    """Op times, with the plain steps timed among them added to the given step and optimizer times."""
    op_times_s, more_steps_s, more_optimizer_s = timer.op_times(capture.op_names)
    return step_times_s + more_steps_s, optimizer_times_s + more_optimizer_s, op_times_s


def _warm_up(timer: "_StepTimer", warmup_steps: int, warmup_s: float) -> None:
    """At least `warmup_steps` warm-up steps, and more until they and the plain timing's `repeats` steps
    after them take `warmup_s` in all (at most MAX_WARMUP_STEPS): the plain steps are timed in warm-up's
    last stretch, and the step time is a median over them and the op timing's plain steps, so one still
    settling moves it little. On CUDA, one that runs out of memory is retried parked (and the profile stays
    so)."""
    t0 = time.perf_counter()
    k = 0
    step_s = 0.0  # the last warm-up step's, optimizer included

    def more_by_time() -> bool:
        return time.perf_counter() - t0 + timer.repeats * step_s < warmup_s and k < MAX_WARMUP_STEPS

    while k < warmup_steps or more_by_time():
        k += 1
        timer.say(f"warm-up step {k}" + (f"/{warmup_steps}" if k <= warmup_steps else f" (until {warmup_s:g} s)"))
        try:
            step_s = sum(timer.plain_step())
            continue
        except (torch.OutOfMemoryError, WorkloadError) as exc:
            out_of_memory = isinstance(exc, torch.OutOfMemoryError) or isinstance(exc.__cause__,
                                                                                   torch.OutOfMemoryError)
            if timer.park or not timer.cuda or not out_of_memory:
                raise
        # retried outside the except clause: the exception's frames hold the failed step's graph until then
        timer.say("the unplanned step ran out of device memory: profiling parked (saved tensors held in "
                  "host memory while recording, as with --park)")
        _zero_grad(timer.optimizer, timer.workload)
        gc.collect()
        torch.cuda.empty_cache()
        timer.park = True
        timer.plain_step()


def _timing_disagreement(step_time_s: float, op_sum_s: float) -> str | None:
    """Why the plain step time and the summed op times cannot both be true measurements, or None.

    A step costs its ops plus the framework's own work, so on a quiet machine the two stay within a
    small factor of each other; a step many times its ops' sum (or far below it) means something else
    ran during one of the two measurements. Small absolute differences (tiny models, where Python's
    share is large) are never a disagreement."""
    low, high = sorted((step_time_s, op_sum_s))
    if high - low > TIMING_DISAGREE_MIN_S and high > TIMING_DISAGREE_RATIO * low:
        return (f"the step time ({step_time_s * 1e3:.1f} ms) and the sum of its op times ({op_sum_s * 1e3:.1f} ms) "
                f"disagree")
    return None


class _StepTimer:
    """The timed phases of a profile: plain steps (with their optimizer step) and op-by-op timing."""

    def __init__(self, workload: Workload, optimizer, device: torch.device, repeats: int, say: Progress,
                 park: bool):
        self.workload, self.optimizer, self.device, self.repeats, self.say = workload, optimizer, device, repeats, say
        self.cuda = device.type == "cuda"
        self.park = park
        self.forward_times_s: list[float] = []  # of the plain steps since the last plain_steps()

    def parking_hooks(self) -> ParkingHooks:
        """Hooks parking this step's saved activations (parameters, buffers and the batch stay)."""
        model = self.workload.model
        batch = [t for t in tree_flatten(self.workload.batch)[0] if isinstance(t, torch.Tensor)]
        return ParkingHooks(ParkStore(self.device), list(model.parameters()) + list(model.buffers()) + batch)

    def sync(self) -> None:
        if self.cuda:
            torch.cuda.synchronize(self.device)

    def plain_step(self) -> tuple[float, float]:
        """One forward+backward and one optimizer step: (step time, optimizer time); a parked step's time
        leaves its copies out."""
        parking = self.parking_hooks() if self.park else None

        def copy_time_s() -> float:
            return parking.store.copy_time_s if parking is not None else 0.0

        def forward_ended() -> None:
            self.sync()
            self.forward_times_s.append(time.perf_counter() - t0 - copy_time_s())

        self.sync()
        t0 = time.perf_counter()
        with parking.hooks() if parking is not None else nullcontext():
            training_step(self.workload, after_forward=forward_ended)
        self.sync()
        t1 = time.perf_counter()
        if self.optimizer is not None:
            self.optimizer.step()
        self.sync()
        t2 = time.perf_counter()
        _zero_grad(self.optimizer, self.workload)
        return t1 - t0 - copy_time_s(), t2 - t1

    def forward_time_under(self, context) -> float:
        """One forward+backward with `context` entered around the forward: the forward's seconds."""
        self.sync()
        t0 = time.perf_counter()
        with context:
            loss, output = forward_with_output(self.workload)
            self.sync()
            forward_s = time.perf_counter() - t0
        loss.backward()
        del loss, output
        _zero_grad(self.optimizer, self.workload)
        return forward_s

    def plain_steps(self) -> tuple[list[float], list[float]]:
        """`repeats` plain steps: (step times, optimizer times); their forward times in `forward_times_s`."""
        step_times_s, optimizer_times_s = [], []
        self.forward_times_s = []
        for k in range(self.repeats):
            self.say(f"timing plain step {k + 1}/{self.repeats}")
            step_s, optimizer_s = self.plain_step()
            step_times_s.append(step_s)
            optimizer_times_s.append(optimizer_s)
        return step_times_s, optimizer_times_s

    def op_times(self, recorded_names: list[str]) -> tuple[list[float], list[float], list[float]]:
        """Each recorded op's median time over `repeats` timed steps of the same op sequence, and the step
        and optimizer times of a plain step taken after each: the step time is then a median over plain
        steps spread over the whole timing, so a burst of load on a shared machine moves it no more than
        the op times (plain steps taken together right after the warm-up can all land in one burst)."""
        per_step_times, step_times_s, optimizer_times_s = [], [], []
        for k in range(self.repeats):
            self.say(f"timing ops: step {k + 1}/{self.repeats}")
            names, times = _timed_step(self.workload, self.device, self.parking_hooks() if self.park else None)
            _zero_grad(self.optimizer, self.workload)
            _check_same_sequence(self.workload.name, recorded_names, names)
            per_step_times.append(times)
            step_s, optimizer_s = self.plain_step()
            step_times_s.append(step_s)
            optimizer_times_s.append(optimizer_s)
        op_times_s = [statistics.median(times[i] for times in per_step_times) for i in range(len(recorded_names))]
        return op_times_s, step_times_s, optimizer_times_s


def _zero_grad(optimizer, workload: Workload) -> None:
    """Gradients to None: the model's (the optimizer's parameters, or all without one) and the batch's leaves."""
    if optimizer is not None:
        optimizer.zero_grad(set_to_none=True)
    else:
        for p in workload.model.parameters():
            p.grad = None
    for t in tree_flatten(workload.batch)[0]:
        if isinstance(t, torch.Tensor) and t.grad is not None:
            t.grad = None


def record_step(workload: Workload, device: torch.device, extra_inputs: list[torch.Tensor] = (),
                park: bool = False) -> Capture:
    """One forward+backward under the capture mode and saved-tensor hooks (gradients left in place).

    `extra_inputs` are other tensors held for the whole step that belong to it (optimizer state): on CPU
    their bytes count in the memory at start. `park`: saved activations are parked in host memory while
    the step runs (regen.profiler.park); the records are the same.
    """
    model = workload.model
    store = ParkStore(device) if park else None
    missing = store.missing_bytes if store is not None else no_missing_bytes
    allocator_events = None if device.type == "cuda" else CpuAllocatorEvents()
    tracker = (CudaMemoryTracker(device, missing) if allocator_events is None
               else LiveStorageTracker(allocator_events, missing))
    batch_tensors = [t for t in tree_flatten(workload.batch)[0] if isinstance(t, torch.Tensor)]
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    recorder = StepRecorder(tracker, parameters=list(model.parameters()), buffers=list(model.buffers()),
                            known_inputs=batch_tensors, device_type=device.type, held=list(extra_inputs) + grads,
                            park=store)
    modules = ModuleRecorder(model, recorder)
    recorder.current_module = modules.current
    gradients = GradientWatch(list(model.parameters()), lambda: len(recorder.ops) - 1)
    with allocator_events if allocator_events is not None else nullcontext(), modules, gradients:
        with torch.autograd.graph.saved_tensors_hooks(recorder.pack, recorder.unpack):
            with CaptureMode(recorder):
                try:
                    # the output is held until backward ends, as a typical loop does (forward_with_output)
                    loss, output = forward_with_output(workload)
                    recorder.phase = PHASE_BACKWARD
                    recorder.engine_sums = EngineSums()
                    with recorder.engine_sums.watching(loss):  # Note [ Sums the engine runs in place ]
                        _backward(workload, loss)
                    del loss, output
                except WorkloadError:
                    if recorder.internal_error is not None:  # regen's bug, not the workload's: keep its traceback
                        raise recorder.internal_error from None
                    raise
    capture = recorder.finish(allocator_events.in_op_peaks() if allocator_events is not None else None)
    capture.module_calls = modules.calls
    capture.gradients_made = gradients.made
    if allocator_events is not None and not allocator_events.available:
        capture.notes.append("another torch.profiler was running: kernel-internal temporaries not measured")
    return capture


def _backward(workload: Workload, loss: torch.Tensor) -> None:
    try:
        loss.backward()
    except RegenError:
        raise
    except Exception as exc:
        raise WorkloadError(f"workload '{workload.name}': the backward raised {type(exc).__name__}: {exc}") from exc


def _timed_step(workload: Workload, device: torch.device, parking: ParkingHooks | None) -> tuple[list[str], list[float]]:
    mode = TimingMode(device)
    with parking.hooks() if parking is not None else torch.autograd.graph.saved_tensors_hooks(
            pass_through_pack, pass_through_unpack):
        with mode:
            loss, output = forward_with_output(workload)
            _backward(workload, loss)
            del loss, output
    return mode.names, mode.times_s()


class SequenceChanged(WorkloadError):
    """A timed step dispatched another op sequence than the recorded one."""


def _check_same_sequence(name: str, recorded: list[str], timed: list[str]) -> None:
    if recorded == timed:
        return
    first = next((i for i, (a, b) in enumerate(zip(recorded, timed)) if a != b), min(len(recorded), len(timed)))
    got = timed[first] if first < len(timed) else "the end of the step"
    want = recorded[first] if first < len(recorded) else "the end of the step"
    raise SequenceChanged(
        f"workload '{name}': the op sequence changed between steps (op {first}: {want} when recorded, {got} "
        f"when timed; {len(recorded)} vs {len(timed)} ops)")


def _check_model_device(workload: Workload, device: torch.device) -> None:
    if isinstance(workload.model, torch.nn.DataParallel):
        raise WorkloadError(f"workload '{workload.name}': {DATA_PARALLEL_REFUSED}")
    for p in workload.model.parameters():
        if p.device != device:
            raise DeviceError(f"workload '{workload.name}': the model's parameters are on {p.device} but the "
                              f"profile was asked for {device}; build the workload on that device")
        break
