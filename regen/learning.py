"""Plans learned while training: the learner that `regen.apply(..., learn=True)` hands the runtime.

The runtime (regen.runtime.learned) observes the first dynamic step of each call signature no plan fits
and, at the model's next call, asks the learner for a plan (`LearnRequest`). Here the three stages meet
for that, only through regen.formats (a Profile in, a Plan out):

1. the profile is recorded at once, on the training thread, between two steps: `profile_workload` on a
   Workload whose batch is the call's arguments (copied when the call ran) and whose loss replays the ops
   the step ran after the model returned (`LossTail`: the same aten ops on the same arguments, so the
   profile's forward ops are the step's), with one repeat and no warm-up: four forward+backward passes
   (plain timing, the recorded step, the liveness probe, op timing; more when the timings disagree),
   unplanned, with their saved tensors parked in host memory (the profiler's `park`; on a CPU device, in
   buffers outside torch's allocator), no optimizer step (no optimizer state) and the link's bandwidth
   measured once when the learner was made (no probe buffers during a step), so they need about the memory
   of the step's parameters, gradients and largest op, not of its saved tensors. The training state is put
   back after it: the parameters' gradients (None during the profile), every module buffer (BatchNorm's
   running statistics) and the RNG states (CPU, each CUDA device);
2. the plan is solved in a background thread (strategy hybrid: on a CPU without a link it recomputes
   only) at the request's cap; at a cap it cannot reach, at its smallest feasible cap, with a warning. Where
   the loop holds its gradients from step to step (the observed step, or the next call, began with them:
   gradient accumulation), the plan counts them for the whole step (regen.planner.held_gradients).
"""

from __future__ import annotations

import warnings
from concurrent.futures import Future, ThreadPoolExecutor

import torch
from torch import nn
from torch.utils._pytree import tree_flatten, tree_map

from regen.errors import RegenError, WorkloadError
from regen.formats.plan import Plan
from regen.formats.profile import Profile
from regen.opinfo import op_outputs, storage_key, tensor_outputs, written_outputs
from regen.runtime.learned import LearningWarning, LearnRequest, LossTail
from regen.runtime.recompute import External, Like, Ref, Scratch
from regen.runtime.model_access import module_device
from regen.runtime.storage_views import Geometry
from regen.units import format_bytes
from regen.workloads import Workload, compute_loss, training_state_kept

SOLVE_TIME_LIMIT_S = 30.0
SOLVE_STRATEGY = "hybrid"


class Learner:
    """`learner(request)`: profile the request's call now, solve its plan in a background thread."""

    def __init__(self, model: nn.Module):
        from regen.profiler.bandwidth import measure_bandwidth

        self._solver = ThreadPoolExecutor(max_workers=1, thread_name_prefix="regen-learn")
        self._bandwidth = measure_bandwidth(module_device(model) or torch.device("cpu"))

    def __call__(self, request: LearnRequest) -> "Future[Plan | None]":
        profile = profile_call(request, self._bandwidth)
        return self._solver.submit(solve_learned, profile, request.cap_bytes, request.gradients_held)


def profile_call(request: LearnRequest, bandwidth) -> Profile:
    """A profile of the request's call, recorded with the training state put back after it; `bandwidth`:
    the link's, measured before."""
    from regen.profiler import profile_workload

    model = request.model
    if request.args and request.kwargs:
        raise RegenError("the model was called with both positional and keyword tensors; regen profiles a "
                         "call of one kind")
    device = module_device(model)
    workload = Workload(name="learned", model=model, batch=request.kwargs if request.kwargs else request.args,
                        loss_fn=replay_loss(request.loss_tail))
    with training_state_kept(model):
        return profile_workload(workload, device=str(device or "cpu"), repeats=1, warmup_steps=0, progress=None,
                                park=True, bandwidth=bandwidth, optimizer_step=False)


def solve_learned(profile: Profile, cap_bytes: int, gradients_held: bool = False) -> Plan:
    """The plan for a learned profile at `cap_bytes`, or at its smallest feasible cap above it; counting the
    gradients for the whole step where the loop holds them from step to step."""
    from regen.planner import solve_within_reach

    plan = solve_within_reach(profile, cap_bytes, SOLVE_STRATEGY, time_limit_s=SOLVE_TIME_LIMIT_S,
                              gradients_held=gradients_held)
    if plan.memory_cap_bytes != cap_bytes:
        warnings.warn(f"regen.apply: the plan learned for this call cannot reach the cap {format_bytes(cap_bytes)}; "
                      f"it runs at its smallest feasible cap {format_bytes(plan.memory_cap_bytes)}", LearningWarning,
                      stacklevel=2)
    return plan


def replay_loss(tail: LossTail):
    """A loss function that runs the tail's ops again on a new model output: each argument the step's
    forward produced is the tensor of the same storage and view here, everything else as captured."""

    def loss_fn(output, batch) -> torch.Tensor:
        writer: dict[int, tuple[int, int]] = {}  # storage key -> (op, slot) of the step it stands for
        tensors: dict = {}  # ((op, slot), Geometry) -> tensor
        flat = [t for t in tree_flatten(output)[0] if isinstance(t, torch.Tensor)]
        if len(flat) != len(tail.outputs):
            raise RegenError("the model's output has another structure than in the step learned from")
        for t, recorded in zip(flat, tail.outputs):
            if recorded is not None:
                writer[storage_key(t)] = recorded[0]
                tensors[(recorded[0], Geometry.of(t))] = t
        loss = None
        for cap in _without_backward_seed(tail.ops):
            args = tree_map(lambda a: _resolve(a, tensors, cap.index), cap.args)
            kwargs = tree_map(lambda a: _resolve(a, tensors, cap.index), cap.kwargs)
            with torch.set_grad_enabled(cap.grad_enabled):
                out = cap.func(*args, **kwargs)
            for slot, key in written_outputs(cap.func, args, kwargs, op_outputs(cap.func, args, kwargs, out)):
                writer[key] = (cap.index, slot)
            for t in tensor_outputs(out):
                if t is None:
                    continue
                w = writer.get(storage_key(t))
                if w is not None:
                    tensors[(w, Geometry.of(t))] = t
                if t.dim() == 0 and t.requires_grad and t.is_floating_point():
                    loss = t
        if loss is None:  # the model returned its loss (a Hugging Face model given labels: `output.loss`)
            loss = _loss_in_output(output)
        return loss

    return loss_fn


def _loss_in_output(output) -> torch.Tensor:
    """The loss a model returned itself, found as `regen profile` finds it (regen.workloads.compute_loss)."""
    try:
        return compute_loss("learned", output, None, None)
    except WorkloadError:
        raise RegenError("no scalar that requires grad came after the model's output, and the output holds no "
                         "loss (.loss, a 'loss' key or a scalar)") from None


def _without_backward_seed(ops: list) -> list:
    """The tail's ops without the last one when it is `loss.backward()`'s own `ones_like(loss)` (dispatched
    before backward began): the profile's backward dispatches it again."""
    if ops and ops[-1].func is torch.ops.aten.ones_like.default:
        first = ops[-1].args[0] if ops[-1].args else None
        if isinstance(first, Like) and first.size == ():
            return ops[:-1]
    return ops


def _resolve(a, tensors: dict, index: int):
    if isinstance(a, Ref):
        t = tensors.get(((a.op, a.slot), a.geometry))
        if t is None:
            raise RegenError(f"op {index} after the model returned reads a tensor of the forward other than the "
                             f"model's output (written by op {a.op}); regen learns losses computed from the output")
        return t
    if isinstance(a, External):
        return a.tensor
    if isinstance(a, (Like, Scratch)):
        return a.materialize()
    return a
