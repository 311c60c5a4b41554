"""A loop that holds its gradients from step to step (gradient accumulation): plans that count them keep the cap,
and a plan that does not is said once (regen.planner.held_gradients, regen.runtime.held_gradients_check)."""

import copy
import dataclasses
import functools
import warnings

import pytest
import torch
from torch import nn

import regen
from regen.measure import measure_memory
from regen.opinfo import unique_storage_bytes
from regen.runtime import HeldGradientsWarning
from regen.workloads import Workload

CAP_TOLERANCE = 0.05
MICRO_BATCHES = 2


class _Wide(nn.Module):
    """Weights large beside the activations of a small batch: its gradients are most of a step's increase; a
    BatchNorm whose running statistics the planned loop must leave as the unplanned one does. `depth` layers,
    the first from `in_features` to `width`."""

    def __init__(self, in_features: int = 128, width: int = 128, depth: int = 8):
        super().__init__()
        self.norm = nn.BatchNorm1d(in_features)
        self.layers = nn.ModuleList(nn.Linear(in_features if k == 0 else width, width) for k in range(depth))

    def forward(self, x):
        x = self.norm(x)
        for layer in self.layers:
            x = torch.tanh(layer(x))
        return x


def _loss(out, batch):
    return out.square().mean()


@functools.lru_cache(maxsize=None)
def _profiled():
    from regen.profiler import profile_workload

    torch.manual_seed(0)
    w = Workload("wide", _Wide(), (torch.randn(512, 128),), _loss)
    return w, profile_workload(w, "cpu", repeats=1, warmup_steps=1, progress=None)


def _plan(gradients_held: bool):
    from regen.planner import solve_within_reach

    w, profile = _profiled()
    held = profile.static_memory.gradient_bytes if gradients_held else 0
    start, peak = profile.memory_at_start_bytes + held, profile.peak_bytes + held
    return solve_within_reach(profile, int(start + 0.6 * (peak - start)), "recompute", time_limit_s=20,
                              gradients_held=gradients_held)


def _accumulating_loop(model, plan=None, w=None):
    """Two optimizer steps of MICRO_BATCHES micro-batches each of `w`'s batch (`_profiled`'s by default); per
    micro-batch, the allocator's peak plus what was held at its start (parameters, gradients, optimizer state,
    batch); and the final parameters and buffers."""
    w = w if w is not None else _profiled()[0]
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    peaks, said_at = [], []
    handle = regen.apply(model, plan) if plan is not None else None
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for step in range(2):
            for k in range(MICRO_BATCHES):
                x = w.batch[0].roll(k, 0)
                state = [t for s in optimizer.state.values() for t in s.values() if torch.is_tensor(t)]
                held = unique_storage_bytes([*model.parameters(), *(p.grad for p in model.parameters()), *state, x])
                measured = measure_memory(lambda: (_loss(model(x), None) / MICRO_BATCHES).backward())
                peaks.append(held + measured.peak_increase_bytes)
                said_at += [(step, k)] * sum(issubclass(c.category, HeldGradientsWarning) for c in caught)
                caught.clear()
            optimizer.step()
            optimizer.zero_grad()
    if handle is not None:
        handle.remove()
    return peaks, said_at, [t.detach().clone() for t in (*model.parameters(), *model.buffers())]


def test_a_plan_solved_with_the_gradients_held_counts_them_for_the_whole_step():
    _, profile = _profiled()
    held = profile.static_memory.gradient_bytes
    plain, counted = _plan(False), _plan(True)
    assert held > 0 and plain.gradients_held_bytes == 0 and counted.gradients_held_bytes == held
    assert counted.baseline.peak_bytes == profile.peak_bytes + held
    assert counted.simulated.peak_bytes <= counted.memory_cap_bytes
    assert any(note.startswith("gradients held from step to step") for note in counted.notes)


def test_an_accumulating_loop_keeps_the_cap_of_a_plan_that_counts_its_gradients_and_trains_the_same():
    w, _ = _profiled()
    plan = _plan(True)
    peaks, said_at, state = _accumulating_loop(copy.deepcopy(w.model), plan)
    _, _, expected = _accumulating_loop(copy.deepcopy(w.model))
    assert not said_at
    assert max(peaks) <= (1 + CAP_TOLERANCE) * plan.memory_cap_bytes, [p / plan.memory_cap_bytes for p in peaks]
    assert all(torch.equal(a, b) for a, b in zip(state, expected))


def test_a_plan_that_does_not_count_them_is_said_once_at_the_first_step_that_holds_them():
    """Under a plan solved for steps that make their gradients, a second micro-batch begins with them all; with
    the optimizer's state made (the second optimizer step, as the profile counts it) it passes the cap (the
    reason to say it) where the first micro-batch does not. The warning comes at the first such step, once."""
    w, _ = _profiled()
    plan = _plan(False)
    peaks, said_at, _ = _accumulating_loop(copy.deepcopy(w.model), plan)
    assert said_at == [(0, 1)]
    assert peaks[MICRO_BATCHES] <= (1 + CAP_TOLERANCE) * plan.memory_cap_bytes < peaks[MICRO_BATCHES + 1]


@functools.lru_cache(maxsize=None)
def _wide_input():
    from regen.profiler import profile_workload

    torch.manual_seed(0)
    # a first layer whose gradient is large beside the activations: a loop that holds its gradients peaks at the
    # end of backward, where the first layer's new gradient meets all the held ones
    w = Workload("wide input", _Wide(in_features=1024, width=256, depth=5), (torch.randn(64, 1024),), _loss)
    return w, profile_workload(w, "cpu", repeats=1, warmup_steps=1, progress=None)


def test_the_held_gradients_counted_at_each_op_are_those_the_step_had_not_made_before_it():
    from regen.planner.held_gradients import with_gradients_held

    _, profile = _wide_input()
    held = profile.static_memory.gradient_bytes
    counted = with_gradients_held(profile)
    assert counted.memory_at_start_bytes == profile.memory_at_start_bytes + held
    for op, c in zip(profile.ops, counted.ops):
        not_made = held - sum(g.bytes for g in profile.gradients_made if g.after_op < op.index)
        assert c.memory_after_bytes - op.memory_after_bytes == not_made
        assert c.memory_peak_bytes - op.memory_peak_bytes == not_made
    assert counted.ops[profile.num_forward_ops - 1].memory_after_bytes == profile.ops[
        profile.num_forward_ops - 1].memory_after_bytes + held  # none made in forward
    bound = with_gradients_held(dataclasses.replace(profile, gradients_made=None))  # every gradient at every op
    assert all(b.memory_after_bytes == op.memory_after_bytes + held for b, op in zip(bound.ops, profile.ops))
    assert counted.peak_bytes < bound.peak_bytes


def test_an_accumulating_loop_that_peaks_at_the_end_of_backward_keeps_the_cap_its_gradients_set():
    """The smallest cap a plan that holds the gradients can have here is the count at the end of backward (every
    gradient held, the first layer's new one beside them): counting each gradient twice once it is made, it
    would be refused. The loop measures within it."""
    from regen.errors import InfeasibleCapError
    from regen.planner import solve

    w, profile = _wide_input()
    cap = profile.peak_bytes + profile.static_memory.gradient_bytes  # at most the held count's peak
    plan = solve(profile, cap, "recompute", time_limit_s=20, gradients_held=True)
    counted_peak = plan.baseline.peak_bytes
    assert counted_peak <= cap
    plan = solve(profile, counted_peak, "recompute", time_limit_s=20, gradients_held=True)
    with pytest.raises(InfeasibleCapError):
        solve(dataclasses.replace(profile, gradients_made=None), counted_peak, "recompute", time_limit_s=20,
              gradients_held=True)
    peaks, _, state = _accumulating_loop(copy.deepcopy(w.model), plan, w)
    _, _, expected = _accumulating_loop(copy.deepcopy(w.model), None, w)
    assert max(peaks) <= (1 + CAP_TOLERANCE) * plan.memory_cap_bytes, [p / plan.memory_cap_bytes for p in peaks]
    assert all(torch.equal(a, b) for a, b in zip(state, expected))
