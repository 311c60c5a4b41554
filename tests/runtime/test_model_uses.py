"""Models that regen profiles and plans end to end (regen.profiler, regen.planner, regen.apply), in the ways
a training loop uses them: an LSTM whose kernel returns other outputs without grad, a user's forward
pre-hook on the root module, and a module used two ways in one loop (a GAN's discriminator, planned by a
plan set). Each planned step gives the unplanned loss, gradients and buffers bit for bit."""

import pytest
import torch
from torch import nn

import regen
from common import assert_same, run_and_grads
from regen.errors import InfeasibleCapError
from regen.planner import solve
from regen.profiler import profile_workload
from regen.workloads import Workload

LINK_RATIO = 0.5  # a CPU profile plans swaps only over a given link (docs/limitations.md "CPU vs GPU")


def _profile(w: Workload):
    return profile_workload(w, device="cpu", repeats=1, warmup_steps=0, progress=None)


def _solve_tight(profile, strategy: str, fraction: float = 0.5):
    """A plan at `fraction` of the unplanned peak, or at the smallest cap the strategy reaches."""
    link = {} if strategy == "recompute" else {"link_ratio": LINK_RATIO}
    try:
        return solve(profile, int(profile.peak_bytes * fraction), strategy=strategy, time_limit_s=30, **link)
    except InfeasibleCapError as exc:
        return solve(profile, exc.smallest_feasible_cap_bytes, strategy=strategy, time_limit_s=30, **link)


def _count(plan, action: str) -> int:
    return sum(1 for d in plan.decisions if d.action == action)


# ---- an LSTM under recompute ---------------------------------------------------------------------


class TwoLayerLSTM(nn.Module):
    def __init__(self):
        super().__init__()
        self.lstm = nn.LSTM(8, 16, num_layers=2, batch_first=True)
        self.head = nn.Linear(16, 1)

    def forward(self, x):
        return self.head(self.lstm(x)[0]).mean()


def test_lstm_recompute_replays_under_the_grad_mode_it_ran_with():
    """On CPU an LSTM layer is `aten.mkldnn_rnn_layer`, which returns its workspace only with grad on: a
    recipe replayed without grad did not rebuild it."""
    torch.manual_seed(0)
    w = Workload("lstm", TwoLayerLSTM(), (torch.randn(4, 12, 8),), None)
    plan = _solve_tight(_profile(w), "recompute")
    assert "aten.mkldnn_rnn_layer.default" in {op.name for op in plan.recipe_ops}, "no LSTM layer replayed"
    reference = run_and_grads(w)
    with regen.apply(w.model, plan) as handle:
        for _ in range(3):  # the verified step, then the fast path
            assert_same(reference, run_and_grads(w))
    assert handle.stats.planned_steps == 3 and handle.stats.recomputes > 0


# ---- a forward pre-hook on the root module -------------------------------------------------------


class MLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b, self.c = nn.Linear(8, 128), nn.Linear(128, 128), nn.Linear(128, 1)

    def forward(self, x):
        return self.c(torch.tanh(self.b(torch.tanh(self.a(x))))).mean()


@pytest.fixture(scope="module")
def hooked_mlp():
    """A model whose root has a user pre-hook that runs tensor ops, and its profile (hook included)."""
    torch.manual_seed(0)
    model = MLP()
    model.register_forward_pre_hook(lambda module, args: (args[0] * 2 + 1,))
    w = Workload("hooked", model, (torch.randn(512, 8),), None)
    return w, _profile(w)


@pytest.mark.parametrize("strategy", ["recompute", "swap", "hybrid"])
def test_root_pre_hook_ops_are_counted_at_run_time_as_in_the_profile(hooked_mlp, strategy):
    w, profile = hooked_mlp
    assert [op.name for op in profile.ops[:2]] == ["aten.mul.Tensor", "aten.add.Tensor"]  # the hook's ops
    plan = _solve_tight(profile, strategy)
    assert _count(plan, "keep") < len(plan.decisions)
    reference = run_and_grads(w)
    with regen.apply(w.model, plan, emulate_link=strategy != "recompute") as handle:
        for _ in range(3):
            assert_same(reference, run_and_grads(w))
    assert handle.stats.planned_steps == 3 and handle.stats.unplanned_steps == 0
