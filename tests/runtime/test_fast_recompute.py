"""The fast path of plans with recompute decisions: after the verified step the dispatch mode only counts
ops, capturing recipe ops and noting the outputs of the ops they read; saved tensors match by pack order.
Same loss and gradients bit for bit on every later step (random ops included), drifts still caught."""

import importlib

import pytest
import torch
from torch.utils._python_dispatch import _get_current_dispatch_mode_stack

import regen
from common import assert_nothing_left, assert_same, other_batch, run_and_grads, traced
from handmade import PLANS, trace_workload
from regen.errors import PlanMismatchError
from regen.runtime import PlanMismatchWarning
from regen.workloads import Workload
from test_equivalence import noisy_workload

forward_ops_module = importlib.import_module("regen.runtime.forward_ops")
STEPS = 4


class _WrittenOutputsSpy:
    """Counts the runtime's calls of `written_outputs` (the writer-map update) per step."""

    def __init__(self, monkeypatch):
        self.calls = 0
        real = forward_ops_module.written_outputs

        def spy(*args, **kwargs):
            self.calls += 1
            return real(*args, **kwargs)

        monkeypatch.setattr(forward_ops_module, "written_outputs", spy)


def _workload(name):
    if name == "noisy":
        w = noisy_workload()
        return w, trace_workload(w)
    return traced(name)


@pytest.mark.parametrize("strategy", ["recompute", "hybrid"])
@pytest.mark.parametrize("name", ["gpt", "noisy"])
def test_later_steps_match_unplanned_bit_for_bit(name, strategy, monkeypatch):
    w, trace = _workload(name)
    plan = PLANS[strategy](trace)
    assert plan.action_counts()["recompute"] > 0
    if name == "noisy":
        assert any(r.is_random for r in plan.recipe_ops), "recipes must replay native_dropout / normal"
    references = [run_and_grads(w, seed=s) for s in range(STEPS)]
    after_reference = torch.rand(3)
    spy = _WrittenOutputsSpy(monkeypatch)
    calls, dropped, recomputes = [], [], []
    with regen.apply(w.model, plan) as handle:
        for s in range(STEPS):
            before = spy.calls, handle.stats.dropped_tensors, handle.stats.recomputes
            assert_same(references[s], run_and_grads(w, seed=s))
            calls.append(spy.calls - before[0])
            dropped.append(handle.stats.dropped_tensors - before[1])
            recomputes.append(handle.stats.recomputes - before[2])
            if s == 0:
                assert handle.plan_states[0].fast_ops is not None and handle.plan_states[0].pack_sequence is not None
        after_planned = torch.rand(3)
    assert torch.equal(after_reference, after_planned), "replays must leave the ambient RNG stream alone"
    fast = handle.plan_states[0].fast_ops
    assert fast.tracked >= set(r.index for r in plan.recipe_ops)
    assert len(fast.tracked) < plan.num_forward_ops, "the fast path must skip untracked ops"
    # the verified step updates the writer map on every forward op; later ones only for recipe producers
    assert calls[0] >= plan.num_forward_ops
    assert calls[1:] == [len(fast.producers)] * (STEPS - 1), calls
    assert dropped[0] > 0 and len(set(dropped)) == 1, dropped
    assert len(set(recomputes)) == 1, recomputes
    assert handle.stats.planned_steps == STEPS and handle.stats.unplanned_steps == 0
    assert handle.pool.checked_out_bytes == 0 and handle.active_steps == 0
    assert not handle.hooks_installed


def test_the_mode_still_counts_on_fast_steps():
    w, trace = traced("gpt")
    seen = []
    with regen.apply(w.model, PLANS["recompute"](trace)) as handle:
        hook = w.model.blocks[0].register_forward_pre_hook(
            lambda *_: seen.append(handle.tracker in _get_current_dispatch_mode_stack()))
        for _ in range(3):
            run_and_grads(w)
        hook.remove()
    assert seen == [True, True, True]


def test_later_step_with_other_batch_shape_raises():
    w, trace = traced("gpt")
    other = other_batch(w)
    with pytest.raises(PlanMismatchError, match="verified step"):
        with regen.apply(w.model, PLANS["hybrid"](trace), on_mismatch="raise") as handle:
            run_and_grads(w)
            run_and_grads(w)
            assert handle.plan_states[0].fast_ops is not None
            run_and_grads(other)
    assert_nothing_left(handle, w.model)


class _SwitchMLP(torch.nn.Module):
    """Its activation can be swapped between steps: same shapes, another op at the same index."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.a, self.b, self.c = torch.nn.Linear(32, 32), torch.nn.Linear(32, 32), torch.nn.Linear(32, 1)
        self.act = torch.relu

    def forward(self, x):
        return self.c(self.act(self.b(self.act(self.a(x))))).pow(2).mean()


def _switch_workload():
    return Workload(name="switch", model=_SwitchMLP(), batch=(torch.randn(8, 32),), loss_fn=None)


def test_later_step_recipe_op_drift_raises():
    w = _switch_workload()
    plan = PLANS["recompute"](trace_workload(w))
    assert any(r.name == "aten.relu.default" for r in plan.recipe_ops)
    with pytest.raises(PlanMismatchError, match="aten.relu.default"):
        with regen.apply(w.model, plan, on_mismatch="raise") as handle:
            run_and_grads(w)
            run_and_grads(w)
            assert handle.plan_states[0].fast_ops is not None
            w.model.act = torch.tanh  # same shapes and pack count: only the op names differ
            run_and_grads(w)
    assert_nothing_left(handle, w.model)


def test_later_step_recipe_op_drift_keep_runs_unplanned():
    w = _switch_workload()
    plan = PLANS["recompute"](trace_workload(w))
    reference = run_and_grads(w)
    w.model.act = torch.tanh
    reference_tanh = run_and_grads(w)
    w.model.act = torch.relu
    with regen.apply(w.model, plan, on_mismatch="keep") as handle:
        assert_same(reference, run_and_grads(w))
        assert_same(reference, run_and_grads(w))
        w.model.act = torch.tanh
        with pytest.warns(PlanMismatchWarning, match="recipe expects"):
            assert_same(reference_tanh, run_and_grads(w))
        w.model.act = torch.relu
        assert_same(reference, run_and_grads(w))  # the next matching step is planned again
    assert handle.stats.unplanned_steps == 1 and handle.stats.planned_steps == 3
    assert handle.pool.checked_out_bytes == 0 and handle.active_steps == 0


def test_fast_steps_drop_the_mode_after_the_last_tracked_op():
    """Once every recipe op and producer has run, the next pack pops the dispatch mode: the rest of the
    forward runs without it (packs still match by order), and gradients stay bit for bit."""
    w, trace = traced("gpt")
    plan = PLANS["recompute"](trace)
    cutoff = plan.num_forward_ops // 2  # keep what the second half would recompute: an untracked tail
    for d in plan.decisions:
        if d.action == "recompute" and max(d.recipe) >= cutoff:
            d.action, d.recipe, d.recipe_inputs, d.recompute_before_op = "keep", [], [], None
    used = {q for d in plan.decisions for q in d.recipe}
    plan.recipe_ops = [r for r in plan.recipe_ops if r.index in used]
    assert any(d.action == "recompute" for d in plan.decisions)
    at_end_of_forward = []
    reference = run_and_grads(w)
    with regen.apply(w.model, plan) as handle:
        hook = w.model.register_forward_hook(
            lambda *_: at_end_of_forward.append(handle.tracker in _get_current_dispatch_mode_stack()))
        results = [run_and_grads(w) for _ in range(3)]
        hook.remove()
    assert at_end_of_forward == [True, False, False]  # verified step: full mode; fast steps: popped
    for r in results:
        assert_same(reference, r)
