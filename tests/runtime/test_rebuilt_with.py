"""Rebuilt-with decisions in the runtime, on hand-made plans (docs/internals.md, "Rebuilt with another's
recipe"): the rebuilding decision's recipe hands over the intermediate, gradients stay exact, a rebuilt
tensor that backward reads before that recipe ran is a PlanMismatchError, never a stale or missing tensor, and
one whose rebuilder the step never dropped (it left its plan in between) is rebuilt on its own."""

import pytest
import torch
from torch import nn

import regen
from common import assert_same, run_and_grads
from handmade import build_plan, trace_workload
from regen.errors import PlanMismatchError
from regen.runtime.mismatch import PlanMismatchWarning
from regen.workloads import Workload


class Branches(nn.Module):
    """y = relu(x W); h = sin(y); loss = sum(h^2) + sum(y^3): y's recipe runs inside h's."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(16, 16)

    def forward(self, x):
        y = torch.relu(self.lin(x))
        h = torch.sin(y)
        return (h * h).sum() + (y * y * y).sum()


def _workload():
    torch.manual_seed(0)
    return Workload(name="branches", model=Branches(), batch=(torch.randn(8, 16),), loss_fn=None)


def _rebuild_plan(trace, victim_name: str, rebuilder_name: str):
    """Recompute everything; then mark the candidate produced by `victim_name` as rebuilt with the one
    produced by `rebuilder_name` (whose recipe must run the victim's producer)."""
    plan = build_plan(trace, lambda i, c: "recompute", "recompute")
    name_of = {op.index: op.name for op in trace.ops}
    rebuilder = next(d for d in plan.decisions if name_of[d.producer_op] == rebuilder_name and d.action == "recompute")
    victim = next(d for d in plan.decisions if name_of[d.producer_op] == victim_name)
    # the rebuilder's recipe walks through the victim instead of reading it: it rebuilds the victim on the way
    assert rebuilder.recipe_inputs == [victim.saved_tensor] and victim.action == "recompute"
    rebuilder.recipe = sorted(set(victim.recipe) | set(rebuilder.recipe))
    rebuilder.recipe_inputs = list(victim.recipe_inputs)
    victim.action, victim.rebuilt_with = "recompute", rebuilder.saved_tensor
    victim.recipe = [q for q in rebuilder.recipe if q <= victim.producer_op]
    victim.recipe_inputs, victim.recompute_before_op = [], rebuilder.recompute_before_op
    victim.swap_out_after_op = victim.swap_in_before_op = victim.swap_in_at_unpack = None
    return plan


def test_rebuilt_with_another_recipe_gives_exact_gradients_and_skips_its_own_recipe():
    # relu's output is read by sin's backward after sin's output (h) is rebuilt for mul's backward:
    # with y rebuilt with h's recipe, one recipe run fewer, the same gradients
    class Chain(Branches):
        def forward(self, x):
            y = torch.relu(self.lin(x))
            h = torch.sin(y)
            return (h * h).sum()

    torch.manual_seed(0)
    w = Workload(name="chain", model=Chain(), batch=(torch.randn(8, 16),), loss_fn=None)
    trace = trace_workload(w)
    reference = run_and_grads(w)
    plain = build_plan(trace, lambda i, c: "recompute", "recompute")
    shared = _rebuild_plan(trace, "aten.relu.default", "aten.sin.default")
    with regen.apply(w.model, plain) as handle_plain:
        assert_same(reference, run_and_grads(w))
    with regen.apply(w.model, shared) as handle_shared:
        assert_same(reference, run_and_grads(w))  # verified step
        assert_same(reference, run_and_grads(w))  # pack-order fast path
    assert handle_shared.stats.recomputes == handle_plain.stats.recomputes * 2 - 2


def test_rebuilt_tensor_read_before_its_rebuilder_ran_is_a_clear_error():
    w = _workload()
    trace = trace_workload(w)
    # backward reads y (for y*y*y) before it reads h (for h*h): the autograd engine runs the later branch first
    bad = _rebuild_plan(trace, "aten.relu.default", "aten.sin.default")
    with pytest.raises(PlanMismatchError, match="had not run"):
        with regen.apply(w.model, bad):
            run_and_grads(w)


class Detour(nn.Module):
    """Chain's forward, with a detour (an extra op before sin) the plan did not see when `detour` is set."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(16, 16)
        self.detour = False

    def forward(self, x):
        y = torch.relu(self.lin(x))
        h = torch.sin(y + 0 if self.detour else y)
        return (h * h).sum()


def test_a_step_that_leaves_its_plan_before_the_rebuilder_is_packed_rebuilds_the_tensor_itself():
    """relu's output is dropped to be rebuilt with sin's recipe; the detour makes the step leave its plan at sin's
    pack, so sin's output is never dropped and its recipe never runs: relu's output is rebuilt by the part of that
    recipe up to relu (Note [ A rebuilder that was not dropped ] in planned_storages.py), exactly."""
    torch.manual_seed(0)
    w = Workload(name="detour", model=Detour(), batch=(torch.randn(8, 16),), loss_fn=None)
    plan = _rebuild_plan(trace_workload(w), "aten.relu.default", "aten.sin.default")
    w.model.detour = True
    reference = run_and_grads(w)
    w.model.detour = False
    with regen.apply(w.model, plan) as handle:
        run_and_grads(w)  # the verified step
        w.model.detour = True
        with pytest.warns(PlanMismatchWarning, match="rest of this step runs in dynamic mode"):
            assert_same(reference, run_and_grads(w))
    assert handle.stats.dynamic_steps == 1 and handle.stats.recomputes > 0
