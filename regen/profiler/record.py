"""`profile_workload`: run a workload's training step on the target device and build its Profile.

Phases, in order (each announced through `progress`):

1. warm-up: `warmup_steps` plain steps (forward, backward, optimizer step), so caches, lazy
   initialisation and the optimizer state exist as they do in steady-state training;
2. plain timing: `repeats` uninstrumented forward+backward steps (`step_time_s`, median) each followed by
   a separately timed optimizer step (`optimizer_step_time_s`, median);
3. the recorded step: one forward+backward under the capture mode and saved-tensor hooks (op sequence,
   tensors, saved tensors, memory timeline; see regen.profiler.capture), with module hooks naming each
   op's module and recording each submodule call's extent (regen.profiler.modules);
4. op timing: `repeats` steps under a timing-only mode (and pass-through saved-tensor hooks, so the op
   sequence is the recorded one); each must dispatch exactly the recorded op sequence, and every op's
   `time_s` is the median over them;
5. the bandwidth probe.

The optimizer is `torch.optim.AdamW` with lr=0: the same kernels, time and state memory as a real step,
without changing the model's weights (weight decay multiplies by 1 - lr*wd = 1, the update is scaled by 0).
Gradients are set to None between steps, as `zero_grad()` does by default.
"""

from __future__ import annotations

import statistics
import time
from contextlib import nullcontext
from typing import Callable

import torch
from torch.utils._pytree import tree_flatten

from regen.errors import DeviceError, RegenError, WorkloadError
from regen.formats.profile import PHASE_BACKWARD, Profile, StaticMemory, op_fingerprint
from regen.profiler.bandwidth import measure_bandwidth
from regen.profiler.capture import (
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
    unique_storage_bytes,
)
from regen.profiler.memory import CpuAllocatorEvents, CudaMemoryTracker, LiveStorageTracker
from regen.profiler.modules import ModuleRecorder
from regen.workloads import Workload, forward_with_output, training_step

OPTIMIZER_LR = 0.0  # see the module docstring: a real AdamW step that leaves the weights unchanged

Progress = Callable[[str], None]


def profile_workload(workload: Workload, device: str, repeats: int, warmup_steps: int,
                     progress: Progress | None) -> Profile:
    """Profile one training step of `workload` on `device` (see the module docstring for the phases)."""
    say = progress or (lambda message: None)
    dev = resolve_device(device)
    if repeats < 1:
        raise RegenError(f"repeats must be at least 1, got {repeats}")
    if warmup_steps < 0:
        raise RegenError(f"warm-up steps must be 0 or more, got {warmup_steps}")
    _check_model_device(workload, dev)
    model = workload.model
    parameters = list(model.parameters())
    trainable = [p for p in parameters if p.requires_grad]
    if not trainable:
        raise WorkloadError(f"workload '{workload.name}': the model has no trainable parameters")
    optimizer = torch.optim.AdamW(trainable, lr=OPTIMIZER_LR)
    cuda = dev.type == "cuda"

    def sync() -> None:
        if cuda:
            torch.cuda.synchronize(dev)

    for k in range(warmup_steps):
        say(f"warm-up step {k + 1}/{warmup_steps}")
        training_step(workload)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    step_times_s, optimizer_times_s = [], []
    for k in range(repeats):
        say(f"timing plain step {k + 1}/{repeats}")
        sync()
        t0 = time.perf_counter()
        training_step(workload)
        sync()
        t1 = time.perf_counter()
        optimizer.step()
        sync()
        step_times_s.append(t1 - t0)
        optimizer_times_s.append(time.perf_counter() - t1)
        optimizer.zero_grad(set_to_none=True)
    optimizer_state_bytes = unique_storage_bytes(optimizer_state_tensors(optimizer))

    say("recording one step: ops, saved tensors, memory")
    capture = record_step(workload, dev, extra_inputs=optimizer_state_tensors(optimizer))
    gradient_bytes = unique_storage_bytes(p.grad for p in parameters)
    optimizer.zero_grad(set_to_none=True)

    per_step_times = []
    for k in range(repeats):
        say(f"timing ops: step {k + 1}/{repeats}")
        names, times = _timed_step(workload, cuda)
        optimizer.zero_grad(set_to_none=True)
        _check_same_sequence(workload.name, capture.op_names, names)
        per_step_times.append(times)
    for i, op in enumerate(capture.ops):
        op.time_s = statistics.median(times[i] for times in per_step_times)

    say("measuring host<->device bandwidth")
    bandwidth = measure_bandwidth(dev)
    say(f"assembling the profile: {len(capture.ops)} ops, {len(capture.saved_tensors)} saved tensors")
    notes = list(capture.notes)
    notes.append(f"optimizer: torch.optim.AdamW (lr={OPTIMIZER_LR}: real kernels and state, weights unchanged)")
    if not cuda:
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
        optimizer_step_time_s=statistics.median(optimizer_times_s),
        memory_at_start_bytes=capture.memory_at_start_bytes,
        peak_bytes=max((op.memory_peak_bytes for op in capture.ops), default=capture.memory_at_start_bytes),
        fingerprint=op_fingerprint(capture.ops, capture.tensors),
        ops=capture.ops, tensors=capture.tensors, saved_entries=capture.saved_entries,
        saved_tensors=capture.saved_tensors, notes=notes, module_calls=capture.module_calls,
    )


def record_step(workload: Workload, device: torch.device, extra_inputs: list[torch.Tensor] = ()) -> Capture:
    """One forward+backward under the capture mode and saved-tensor hooks (gradients left in place).

    `extra_inputs` are other tensors held for the whole step that belong to it (optimizer state): on CPU
    their bytes count in the memory at start.
    """
    model = workload.model
    allocator_events = None if device.type == "cuda" else CpuAllocatorEvents()
    tracker = CudaMemoryTracker(device) if allocator_events is None else LiveStorageTracker(allocator_events)
    batch_tensors = [t for t in tree_flatten(workload.batch)[0] if isinstance(t, torch.Tensor)]
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    recorder = StepRecorder(tracker, parameters=list(model.parameters()), buffers=list(model.buffers()),
                            known_inputs=batch_tensors, held=list(extra_inputs) + grads)
    modules = ModuleRecorder(model, recorder)
    recorder.current_module = modules.current
    with allocator_events if allocator_events is not None else nullcontext(), modules:
        with torch.autograd.graph.saved_tensors_hooks(recorder.pack, recorder.unpack):
            with CaptureMode(recorder):
                try:
                    # the output is held until backward ends, as a typical loop does (forward_with_output)
                    loss, output = forward_with_output(workload)
                    recorder.phase = PHASE_BACKWARD
                    _backward(workload, loss)
                    del loss, output
                except WorkloadError:
                    if recorder.internal_error is not None:  # regen's bug, not the workload's: keep its traceback
                        raise recorder.internal_error from None
                    raise
    capture = recorder.finish(allocator_events.in_op_peaks() if allocator_events is not None else None)
    capture.module_calls = modules.calls
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


def _timed_step(workload: Workload, cuda: bool) -> tuple[list[str], list[float]]:
    mode = TimingMode(cuda)
    with torch.autograd.graph.saved_tensors_hooks(pass_through_pack, pass_through_unpack):
        with mode:
            loss, output = forward_with_output(workload)
            _backward(workload, loss)
            del loss, output
    return mode.names, mode.times_s()


def _check_same_sequence(name: str, recorded: list[str], timed: list[str]) -> None:
    if recorded == timed:
        return
    first = next((i for i, (a, b) in enumerate(zip(recorded, timed)) if a != b), min(len(recorded), len(timed)))
    got = timed[first] if first < len(timed) else "the end of the step"
    want = recorded[first] if first < len(recorded) else "the end of the step"
    raise WorkloadError(
        f"workload '{name}': the op sequence changed between steps (op {first}: {want} when recorded, {got} "
        f"when timed; {len(recorded)} vs {len(timed)} ops). regen needs a training step that dispatches the same "
        f"ops every time (no data-dependent control flow)")


def _check_model_device(workload: Workload, device: torch.device) -> None:
    for p in workload.model.parameters():
        if p.device.type != device.type:
            raise DeviceError(f"workload '{workload.name}': the model's parameters are on {p.device} but the "
                              f"profile was asked for {device}; build the workload on that device")
        break
