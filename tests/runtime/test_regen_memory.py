"""Memory regen itself holds is counted in the plan (issue 16, "the cap exceeded").

On a CPU device every random recipe op's capture keeps a copy of the RNG state (5 KB) until the step
ends: a recompute plan with many dropout masks at a tight cap must count them, so the measured peak
stays within the cap + 5%.
"""

import dataclasses
import warnings
import functools

import pytest
import torch
from torch import nn

import regen
from regen.measure import measure_memory
from regen.workloads import Workload

CAP_TOLERANCE = 0.05


class DropoutStack(nn.Module):
    def __init__(self, depth=16, width=32):
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(width, width) for _ in range(depth))
        self.drop = nn.Dropout(0.1)
        self.head = nn.Linear(width, 4)

    def forward(self, x, target=None):
        for layer in self.layers:
            x = self.drop(torch.tanh(layer(x)))
        return self.head(x)


def _loss(out, batch):
    return nn.functional.cross_entropy(out, batch[1])


@functools.lru_cache(maxsize=None)
def _tight_recompute_plan():
    from regen.planner import solve
    from regen.planner.graph import build_graph
    from regen.planner.milp.search import smallest_feasible_cap
    from regen.profiler import profile_workload

    torch.manual_seed(0)
    w = Workload("dropout-stack", DropoutStack(), (torch.randn(32, 32), torch.randint(0, 4, (32,))), _loss)
    profile = profile_workload(w, "cpu", repeats=1, warmup_steps=1, progress=None)
    graph = build_graph(profile)
    cap = smallest_feasible_cap(graph, allow_swap=False, allow_recompute=True)
    return w, profile, graph, solve(profile, memory_cap_bytes=cap, strategy="recompute", time_limit_s=20)


def _step(w):
    torch.manual_seed(0)
    _loss(w.model(*w.batch), w.batch).backward()


def test_rng_state_copies_are_counted_and_the_measured_peak_stays_under_the_cap():
    w, profile, _, plan = _tight_recompute_plan()
    random_ops = [r for r in plan.recipe_ops if r.is_random]
    assert len(random_ops) >= 4, "the plan recomputes too few dropout masks to test this"
    with regen.apply(w.model, plan) as handle:
        _step(w)
        w.model.zero_grad(set_to_none=True)
        measured = measure_memory(lambda: _step(w))
    assert handle.stats.planned_steps == 2
    start = profile.memory_at_start_bytes
    peak = measured.peak_increase_bytes
    cap = plan.memory_cap_bytes - start
    assert peak <= cap * (1 + CAP_TOLERANCE), f"measured {peak} B over the cap's {cap} B + 5%"
    simulated = plan.simulated.peak_bytes - start
    assert abs(peak - simulated) <= CAP_TOLERANCE * simulated, f"measured {peak} B vs simulated {simulated} B"
    assert plan.predicted.peak_bytes - start >= peak * (1 - CAP_TOLERANCE), "the prediction leaves regen's memory out"


def test_the_predicted_peak_includes_the_rng_states():
    from plan_choices import choices_from_plan
    from regen.planner.residency import CPU_RNG_STATE_BYTES
    from regen.planner.simulator import simulate

    _, _, graph, plan = _tight_recompute_plan()
    assert CPU_RNG_STATE_BYTES == torch.get_rng_state().numel()
    choices = choices_from_plan(graph, plan)
    with_captures = simulate(graph, choices)
    without = simulate(dataclasses.replace(graph, capture_bytes={}), choices)
    random_ops = sum(1 for r in plan.recipe_ops if r.is_random)
    assert with_captures.timeline_bytes[-1] - without.timeline_bytes[-1] == random_ops * CPU_RNG_STATE_BYTES
    assert plan.simulated.peak_bytes == with_captures.peak_bytes
    assert plan.predicted.peak_bytes >= with_captures.peak_bytes - CPU_RNG_STATE_BYTES


def test_the_peak_check_warns_once_with_the_figures():
    from regen.runtime import CapExceededWarning
    from regen.runtime.peak_check import PeakCheck, over_cap_message

    assert over_cap_message(1_050_000, 1_000_000) is None  # within 5%
    message = over_cap_message(1_300_000, 1_000_000)
    assert "1300000 B" in message and "1000000 B" in message and "30%" in message
    check = PeakCheck(1_000_000, read_peak=None)
    assert not check.observe(1_040_000)
    with pytest.warns(CapExceededWarning, match="30% over the plan's cap of 1000000 B"):
        assert check.observe(1_300_000)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert check.observe(1_400_000)  # over, but said once already
        no_cap = PeakCheck(0, read_peak=None)  # a plan made by hand names no cap: nothing to check against
        assert over_cap_message(1, 0) is None and not no_cap.observe(1_000)
        assert not no_cap.observe_drops_held(held_bytes=1_000, predicted_peak_bytes=1_000)


def test_a_checked_step_is_compared_with_its_own_plans_cap():
    """In a plan set, a step under the smaller plan's cap is judged by that cap, not the set's largest."""
    from regen.runtime import CapExceededWarning
    from regen.runtime.peak_check import PeakCheck

    figures = iter([0, 1_300_000])
    check = PeakCheck(2_000_000, read_peak=lambda: next(figures))  # the set's largest cap
    step = object()
    check.step_started(step, 1, cap_bytes=1_000_000)
    with pytest.warns(CapExceededWarning, match="30% over the plan's cap of 1000000 B"):
        check.step_released(step, followed_plan=True)


def test_the_handle_checks_every_nth_planned_step_against_the_allocators_peak():
    """The CUDA path on CPU: the allocator's figure injected. Checked steps are the 1st, 11th...; a step's
    peak is read as a new maximum reached during it."""
    from regen.runtime import CapExceededWarning
    from regen.runtime.peak_check import PEAK_CHECK_EVERY_STEPS

    w, _, _, plan = _tight_recompute_plan()
    reads = []
    figures = iter([2 * plan.memory_cap_bytes, 2 * plan.memory_cap_bytes,  # step 1: no new maximum: unknown
                    plan.memory_cap_bytes, 2 * plan.memory_cap_bytes])  # step 11: a new maximum, twice the cap

    def read_peak():
        reads.append(1)
        return next(figures)

    with regen.apply(w.model, plan) as handle:
        handle.peak_check.read_peak = read_peak
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            for _ in range(2 * PEAK_CHECK_EVERY_STEPS + 1):
                _step(w)
                w.model.zero_grad(set_to_none=True)
    over = [c for c in caught if issubclass(c.category, CapExceededWarning)]
    assert len(over) == 1 and f"{2 * plan.memory_cap_bytes} B" in str(over[0].message)
    assert len(reads) == 4  # steps 1 and 11 read twice; none between them, none after the warning (step 21)
    assert handle.stats.planned_steps == 2 * PEAK_CHECK_EVERY_STEPS + 1
