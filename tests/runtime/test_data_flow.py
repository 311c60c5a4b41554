"""A later step whose forward takes another branch (same op names, shapes and saved tensors, another data
flow) is a plan mismatch on the fast path, even when the allocator gives the new tensor the address of a
freed one that the verified step's recipe read: the writer map's entries are checked alive, and every
dropped or recipe input's pack is checked to be the op output the plan names."""

import pytest
import torch

import regen
from common import assert_same, run_and_grads
from handmade import PLANS, trace_workload
from regen.errors import PlanMismatchError
from regen.runtime import PlanMismatchWarning
from regen.workloads import Workload


class Branchy(torch.nn.Module):
    """`tanh` reads `h * 2` (flag off) or `h * 3` (flag on, made after `h * 2` is freed: same size, so the
    allocator hands it the freed address). Same ops, shapes and saved tensors either way."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.lin = torch.nn.Linear(32, 32)
        self.flag = False
        self.addresses = []

    def forward(self, x):
        h = self.lin(x)
        u = h * 2
        if self.flag:
            address = u.data_ptr()
            u = None  # freed: the next tensor of its size takes its place
            v = h * 3
            self.addresses.append((address, v.data_ptr()))
            r = torch.tanh(v)
        else:
            v = h * 3
            r = torch.tanh(u)
        return (r * h).sum() + v.sum()


def _workload():
    return Workload(name="branchy", model=Branchy(), batch=(torch.randn(8, 32),), loss_fn=None)


def _plan(w):
    plan = PLANS["recompute"](trace_workload(w))
    names = {r.index: r.name for r in plan.recipe_ops}
    tanh = [d for d in plan.decisions if d.action == "recompute" and names.get(d.producer_op) == "aten.tanh.default"]
    assert tanh and any(names.get(q) == "aten.mul.Tensor" for q in tanh[0].recipe), "tanh must replay h * 2"
    return plan


ATTEMPTS = 32  # the allocator reuses the freed address most of the time, not always (less after many tests)


def test_another_branch_on_a_fast_step_raises_even_at_a_reused_address():
    w = _workload()
    plan = _plan(w)
    for _ in range(ATTEMPTS):
        w.model.flag = False
        w.model.addresses.clear()
        with pytest.raises(PlanMismatchError, match="data flow"):
            with regen.apply(w.model, plan, on_mismatch="raise") as handle:
                run_and_grads(w)
                run_and_grads(w)
                assert handle.plan_states[0].fast_ops is not None and handle.stats.planned_steps == 2
                w.model.flag = True
                run_and_grads(w)
        (address, reused), = w.model.addresses
        if address == reused:
            return
    # every attempt raised, but none at a reused address: the case this test is for did not occur in this process
    pytest.skip(f"the allocator never reused the freed address in {ATTEMPTS} attempts")


def test_another_branch_with_keep_runs_unplanned_and_exact():
    w = _workload()
    plan = _plan(w)
    reference = run_and_grads(w)
    w.model.flag = True
    reference_branch = run_and_grads(w)
    w.model.flag = False
    w.model.addresses.clear()
    with regen.apply(w.model, plan, on_mismatch="keep") as handle:
        assert_same(reference, run_and_grads(w))
        assert_same(reference, run_and_grads(w))
        w.model.flag = True
        for _ in range(ATTEMPTS):
            with pytest.warns(PlanMismatchWarning):
                assert_same(reference_branch, run_and_grads(w))
        w.model.flag = False
        assert_same(reference, run_and_grads(w))
    assert handle.stats.unplanned_steps == ATTEMPTS and handle.stats.planned_steps == 3
