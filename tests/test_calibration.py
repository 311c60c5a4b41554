"""regen.calibration: the hooks' and swaps' costs measured on the workload with the runtime, and charged."""

from dataclasses import replace

import pytest

from regen.calibration import METHOD, calibrate
from regen.planner import solve
from regen.profiler import profile_workload
from regen.runtime.costs import measure_runtime_costs
from regen.workloads import build_workload

GPT = dict(vocab_size=512, context=128, d_model=128, n_layer=2, n_head=4)


@pytest.fixture(scope="module")
def calibrated():
    """(probed profile, calibrated profile) of a GPT whose MLP activations (2 MiB) offload-all swaps."""
    w = build_workload("gpt", batch_size=8, args=GPT)
    profile = profile_workload(w, device="cpu", repeats=1, warmup_steps=1, progress=None,
                               runtime_probe=measure_runtime_costs)
    messages = []
    return profile, calibrate(profile, w, messages.append), messages


def test_hooks_and_swaps_are_measured_on_the_workload_and_never_below_the_probe(calibrated):
    probed, profile, messages = calibrated
    rc = profile.runtime_costs
    assert rc.method.endswith(METHOD) and rc.hooks_s >= 0.0
    assert rc.swap_s >= probed.runtime_costs.swap_s > 0.0
    assert probed.runtime_costs.hooks_s == 0.0  # the probe alone does not measure the hooks
    assert any("calibrated" in m for m in messages)
    assert replace(rc, hooks_s=0.0, swap_s=probed.runtime_costs.swap_s, method=probed.runtime_costs.method) \
        == probed.runtime_costs  # nothing else changes


def test_every_plan_is_charged_the_hooks_whatever_it_decides(calibrated):
    _, profile, _ = calibrated
    profile = replace(profile, runtime_costs=replace(profile.runtime_costs, hooks_s=0.004))
    keep = solve(profile, profile.peak_bytes, "keep-all")
    assert keep.simulated.step_time_s == pytest.approx(profile.step_time_s + 0.004)
    plan = solve(profile, int(profile.peak_bytes * 0.7), "recompute", time_limit_s=10)
    assert plan.predicted.step_time_s == pytest.approx(plan.simulated.step_time_s, rel=0.02)
    assert plan.simulated.step_time_s > profile.step_time_s + 0.004


def test_profiles_it_cannot_calibrate_are_left_as_they_are(calibrated):
    probed, _, _ = calibrated
    without = replace(probed, runtime_costs=None)
    assert calibrate(without, None) is without
    parked = replace(probed, notes=probed.notes + ["recorded parked: ..."])
    assert calibrate(parked, None) is parked
