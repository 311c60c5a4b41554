"""`loss.backward(retain_graph=True)` then another backward: saved tensors are unpacked twice. Recomputed
and swapped tensors are rebuilt again; gradients equal the unplanned run's bit for bit."""

import pytest
import torch

import regen
from common import traced
from handmade import PLANS
from regen.errors import PlanMismatchError


def two_backwards(w, seed: int = 5):
    w.model.zero_grad(set_to_none=True)
    torch.manual_seed(seed)
    loss = w.loss_fn(w.model(*w.batch), w.batch)
    loss.backward(retain_graph=True)
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in w.model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("strategy", ["recompute", "hybrid", "swap"])
def test_a_second_backward_over_a_retained_graph(strategy):
    w, trace = traced("gpt")
    plan = PLANS[strategy](trace)
    reference = two_backwards(w)
    with regen.apply(w.model, plan) as handle:
        planned = two_backwards(w)
        again = two_backwards(w)  # the fast path of later steps too
    for loss, grads in (planned, again):
        assert torch.equal(loss, reference[0])
        assert grads.keys() == reference[1].keys()
        assert all(torch.equal(grads[k], reference[1][k]) for k in grads), "a gradient differs"
    assert handle.stats.planned_steps == 2
    if strategy != "swap":  # every dropped tensor rebuilt in both backwards of both steps
        assert handle.stats.recomputes >= 4 * (plan.action_counts()["recompute"] - plan.rebuilt_count()) > 0


def test_a_second_backward_over_a_region_plan_whose_inputs_are_gone_is_a_clear_error():
    """The GPT's blocks: nothing else holds a block's input after its replay, so the second backward
    cannot replay it again; a PlanMismatchError that says so, never a wrong gradient."""
    from test_regions import _region_plan

    w, _, plan = _region_plan("gpt", "blocks")
    with regen.apply(w.model, plan):
        with pytest.raises(PlanMismatchError, match="inputs were freed after its first replay"):
            two_backwards(w)
