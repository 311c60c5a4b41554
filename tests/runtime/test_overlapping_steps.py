"""Two calls of the model before one backward (a contrastive or preference loss) under a plan made for one call
per backward: said once (regen.runtime.overlapping_steps); one call per backward, or a module that makes both
calls profiled and planned as one step, says nothing and keeps the cap."""

import functools
import warnings

import torch
from torch import nn

import regen
from regen.measure import measure_memory
from regen.opinfo import unique_storage_bytes
from regen.runtime import OverlappingStepsWarning
from regen.workloads import Workload

CAP_TOLERANCE = 0.05


class _Tower(nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(64, 64) for _ in range(6))

    def forward(self, x):
        for layer in self.layers:
            x = torch.tanh(layer(x))
        return x


class _Pair(nn.Module):
    """Both calls in one forward: the step to profile for a loss over two calls."""

    def __init__(self, tower: nn.Module):
        super().__init__()
        self.tower = tower

    def forward(self, a, b):
        return self.tower(a), self.tower(b)


def _pair_loss(out, batch):
    return (out[0] - out[1]).square().mean()


def _one_loss(out, batch):
    return out.square().mean()


@functools.lru_cache(maxsize=None)
def _planned(pair: bool):
    from regen.planner import solve_within_reach
    from regen.profiler import profile_workload

    torch.manual_seed(0)
    tower = _Tower()
    a, b = torch.randn(256, 64), torch.randn(256, 64)
    w = Workload("pair", _Pair(tower), (a, b), _pair_loss) if pair else Workload("tower", tower, (a,), _one_loss)
    profile = profile_workload(w, "cpu", repeats=1, warmup_steps=1, progress=None)
    start = profile.memory_at_start_bytes
    return w, solve_within_reach(profile, int(start + 0.6 * (profile.peak_bytes - start)), "recompute",
                                 time_limit_s=20)


def _said(run) -> int:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        run()
    return sum(issubclass(c.category, OverlappingStepsWarning) for c in caught)


def test_two_calls_before_one_backward_are_said_once_and_one_call_per_backward_is_not():
    w, plan = _planned(pair=False)
    tower, (a,) = w.model, w.batch
    b = a.flip(0)

    def two_calls():
        with regen.apply(tower, plan):
            for _ in range(3):
                (tower(a) - tower(b)).square().mean().backward()

    def one_call():
        with regen.apply(tower, plan):
            for _ in range(3):
                tower(a).square().mean().backward()

    assert _said(two_calls) == 1
    assert _said(one_call) == 0


def test_the_calls_profiled_as_one_step_keep_the_cap_and_say_nothing():
    w, plan = _planned(pair=True)
    start = unique_storage_bytes([*w.model.parameters(), *w.batch])
    peaks = []

    def steps():
        with regen.apply(w.model, plan) as handle:
            for _ in range(3):
                peaks.append(start + measure_memory(lambda: _pair_loss(w.model(*w.batch), None).backward())
                             .peak_increase_bytes)
                w.model.zero_grad(set_to_none=True)
        assert handle.stats.planned_steps == 3

    assert _said(steps) == 0
    assert max(peaks) <= (1 + CAP_TOLERANCE) * plan.memory_cap_bytes
