"""A plan applied to another batch shape or model raises PlanMismatchError, or with
on_mismatch="keep" warns and runs the step unplanned (same gradients as without regen)."""

import pytest
import torch

import regen
from common import assert_nothing_left, assert_same, make, run_and_grads, step, traced
from handmade import PLANS
from regen.errors import FormatError, PlanMismatchError, RegenError
from regen.runtime import PlanMismatchWarning


def test_other_batch_size_raises():
    _, trace = traced("gpt")
    plan = PLANS["hybrid"](trace)
    other = make("gpt", batch_size=2)
    with pytest.raises(PlanMismatchError, match="plan expects"):
        with regen.apply(other.model, plan) as handle:
            step(other)
    assert_nothing_left(handle, other.model)
    other.model.zero_grad(set_to_none=True)
    step(other)  # the model trains normally afterwards


def test_other_batch_size_keep_runs_unplanned():
    _, trace = traced("gpt")
    plan = PLANS["hybrid"](trace)
    other = make("gpt", batch_size=2)
    reference = run_and_grads(other)
    with regen.apply(other.model, plan, on_mismatch="keep") as handle:
        with pytest.warns(PlanMismatchWarning, match="unplanned"):
            planned = run_and_grads(other)
    assert_same(reference, planned)
    assert handle.stats.unplanned_steps == 1 and handle.stats.planned_steps == 0
    assert handle.stats.swapped_tensors == 0 and handle.stats.dropped_tensors == 0
    assert_nothing_left(handle, other.model)


def test_other_model_raises():
    _, trace = traced("mlp")
    plan = PLANS["swap"](trace)
    cnn = make("cnn")
    with pytest.raises(PlanMismatchError):
        with regen.apply(cnn.model, plan):
            step(cnn)


class _MLP(torch.nn.Module):
    def __init__(self, act):
        super().__init__()
        torch.manual_seed(0)
        self.a, self.b, self.act = torch.nn.Linear(32, 32), torch.nn.Linear(32, 1), act

    def forward(self, x):
        return self.b(self.act(self.a(x))).pow(2).mean()


def test_same_shapes_other_ops_caught_by_fingerprint():
    """Every saved tensor has the plan's shape and dtype; only the fingerprint tells the models apart."""
    from regen.workloads import Workload
    from handmade import trace_workload

    x = torch.randn(8, 32)
    relu = Workload(name="relu", model=_MLP(torch.nn.ReLU()), batch=(x,), loss_fn=None)
    tanh = Workload(name="tanh", model=_MLP(torch.nn.Tanh()), batch=(x,), loss_fn=None)
    plan = PLANS["swap"](trace_workload(relu))
    assert trace_workload(tanh).num_forward_ops == plan.num_forward_ops
    with pytest.raises(PlanMismatchError, match="fingerprint"):
        with regen.apply(tanh.model, plan):
            step(tanh)
    with regen.apply(relu.model, plan) as handle:  # the right model passes
        step(relu)
    assert handle.stats.planned_steps == 1


def test_recipe_op_name_is_checked():
    w, trace = traced("mlp")
    plan = PLANS["recompute"](trace)
    plan.recipe_ops[0].name = "aten.cos.default"
    with pytest.raises(PlanMismatchError, match="aten.cos.default"):
        with regen.apply(w.model, plan):
            step(w)


def test_no_grad_and_eval_forwards_are_left_alone():
    w, trace = traced("gpt")
    plan = PLANS["hybrid"](trace)
    with regen.apply(w.model, plan) as handle:
        with torch.no_grad():
            w.model(*w.batch)
        w.model.eval()
        try:
            w.model(*w.batch)
        finally:
            w.model.train()
        assert handle.stats.steps == 0
        assert torch._C._autograd._top_saved_tensors_default_hooks(False) is None
        reference = run_and_grads(w)  # inside: the first training step is planned
    assert handle.stats.steps == 1 and handle.stats.planned_steps == 1
    assert_same(reference, run_and_grads(w))


def test_bad_arguments_are_clear_errors():
    w, trace = traced("mlp")
    plan = PLANS["recompute"](trace)
    with pytest.raises(RegenError, match="on_mismatch"):
        regen.apply(w.model, plan, on_mismatch="ignore")
    with pytest.raises(RegenError, match="Plan"):
        regen.apply(w.model, {"decisions": []})
    broken = PLANS["recompute"](trace)
    d = next(d for d in broken.decisions if d.action == "recompute")
    d.recipe = [r for r in d.recipe if r != d.producer_op]
    with pytest.raises(FormatError, match="producer"):
        regen.apply(w.model, broken)
    assert not w.model._forward_pre_hooks
