"""A saved tensor modified in place before backward is an error under a plan, as it is without one.

Autograd skips its version-counter check when saved-tensor hooks are installed, so regen records each
packed tensor's version at the pack and checks it at the unpack, for every action (keep, swap, recompute),
raising autograd's own message."""

import pytest
import torch

import regen
from common import assert_same, run_and_grads
from handmade import PLANS, trace_workload
from regen.workloads import Workload

MESSAGE = "modified by an inplace operation"


class Edited(torch.nn.Module):
    """Keeps `y` (saved by sigmoid and by the second linear) where a caller can edit it in place."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.lin1, self.lin2, self.lin3 = (torch.nn.Linear(32, 32) for _ in range(3))
        self.last = None

    def forward(self, x):
        y = torch.sigmoid(self.lin1(x))
        self.last = y
        return self.lin3(torch.tanh(self.lin2(y))).pow(2).mean()


def _workload():
    return Workload(name="edited", model=Edited(), batch=(torch.randn(8, 32),), loss_fn=None)


def _step(w, edit: bool):
    w.model.zero_grad(set_to_none=True)
    loss = w.model(*w.batch)
    if edit:
        with torch.no_grad():
            w.model.last.mul_(2)  # illegal: sigmoid's backward and the linear's need y as it was
    w.model.last = None
    loss.backward()


def test_unplanned_autograd_raises():
    w = _workload()
    with pytest.raises(RuntimeError, match=MESSAGE):
        _step(w, edit=True)


@pytest.mark.parametrize("strategy", ["keep-all", "swap", "recompute"])
@pytest.mark.parametrize("verified_first", [False, True])
def test_a_planned_step_raises_autograds_error(strategy, verified_first):
    w = _workload()
    plan = PLANS[strategy](trace_workload(w))
    counts = plan.action_counts()
    assert strategy == "keep-all" or counts["keep"] < len(plan.decisions)
    reference = run_and_grads(w)
    with regen.apply(w.model, plan, emulate_link=strategy == "swap") as handle:
        if verified_first:  # the edited step is a fast one
            assert_same(reference, run_and_grads(w))
        with pytest.raises(RuntimeError, match=MESSAGE):
            _step(w, edit=True)
        assert_same(reference, run_and_grads(w))  # the next step runs as planned
    if strategy == "swap":
        assert handle.stats.swapped_tensors > 0
    assert handle.active_steps == 0 and handle.pool.checked_out_bytes == 0
