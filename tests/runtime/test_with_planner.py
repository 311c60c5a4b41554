"""The "Done when" checks with real profiles and plans (regen.profiler + regen.planner).

Skipped while those stages still say "not yet implemented". For every built-in workload and HF GPT-2 and
BERT, and each strategy at 50% of the unplanned peak (or the smallest cap the strategy reaches, said in
the skip/xfail message): loss and gradients equal the unplanned run bit for bit, and the measured peak
(torch.profiler's allocator timeline, regen.measure; the host pool is allocated by regen.apply before the
measurement and so counted apart) is at most the cap + 5% and within 10% of the simulator's prediction.
CPU measurements only see allocations made during the step, so they are compared as increases over the
step's start: plan figures minus the profile's memory_at_start_bytes.
"""

import functools

import pytest

import regen
from common import assert_same, make, run_and_grads, step
from regen.errors import InfeasibleCapError, RegenError
from regen.measure import measure_memory

CAP_FRACTION = 0.5
CAP_TOLERANCE = 0.05
SIMULATOR_TOLERANCE = 0.10
WORKLOADS = ["mlp", "cnn", "gpt", "hf-gpt2", "hf-bert"]
STRATEGIES = ["hybrid", "recompute", "swap"]


def _stages_ready() -> bool:
    from regen.planner import solve
    from regen.profiler import profile_workload

    try:
        profile_workload(make("mlp"), device="cpu", repeats=1, warmup_steps=0, progress=None)
    except RegenError as exc:
        if "not yet implemented" in str(exc):
            return False
        raise
    return callable(solve)


pytestmark = pytest.mark.skipif(not _stages_ready(), reason="regen.profiler / regen.planner not implemented yet")


def _solve(profile, strategy):
    from regen.planner import solve

    cap = int(profile.peak_bytes * CAP_FRACTION)
    # the profile's own (memcpy) bandwidth, given explicitly: a CPU profile without a link plans no swaps
    bandwidth_gb_s = profile.device.d2h_bytes_per_s / 1e9
    try:
        return solve(profile, memory_cap_bytes=cap, strategy=strategy, time_limit_s=30,
                     bandwidth_gb_s=bandwidth_gb_s), None
    except InfeasibleCapError as exc:
        if exc.smallest_feasible_cap_bytes is None:
            raise
        note = (f"{strategy} cannot reach 50% of the unplanned peak; using its smallest cap "
                f"{exc.smallest_feasible_cap_bytes} B ({exc.smallest_feasible_cap_bytes / profile.peak_bytes:.0%})")
        return solve(profile, memory_cap_bytes=exc.smallest_feasible_cap_bytes, strategy=strategy,
                      time_limit_s=30, bandwidth_gb_s=bandwidth_gb_s), note


@functools.lru_cache(maxsize=None)
def _profiled_plan(name, strategy):
    from regen.profiler import profile_workload

    w = make(name)
    profile = profile_workload(w, device="cpu", repeats=1, warmup_steps=1, progress=None)
    plan, note = _solve(profile, strategy)
    return w, profile, plan, note


def _params(f):
    f = pytest.mark.parametrize("strategy", STRATEGIES)(f)
    return pytest.mark.slow(pytest.mark.parametrize("name", WORKLOADS)(f))


@_params
def test_real_plan_gives_unplanned_gradients(name, strategy):
    if name.startswith("hf-"):
        pytest.importorskip("transformers")
    w, profile, plan, note = _profiled_plan(name, strategy)
    reference = run_and_grads(w)
    with regen.apply(w.model, plan) as handle:
        planned = run_and_grads(w)
    assert_same(reference, planned)
    assert handle.stats.planned_steps == 1
    counts = plan.action_counts()
    assert handle.stats.swapped_tensors == counts["swap"] and handle.stats.dropped_tensors == counts["recompute"]
    # one recipe run per recompute decision, none for those rebuilt with another's recipe
    rebuilt = plan.rebuilt_count()
    assert handle.stats.recomputes == counts["recompute"] - rebuilt


@pytest.mark.slow
@pytest.mark.parametrize("name", ["gpt", "hf-gpt2"])
def test_transformer_recompute_plans_share_rebuilt_intermediates(name):
    """On transformers the planner rebuilds some tensors as by-products of another's recipe (a chain
    fc -> gelu recomputes fc once, not twice); the tests above then check gradients and memory."""
    if name.startswith("hf-"):
        pytest.importorskip("transformers")
    w, _, plan, _ = _profiled_plan(name, "recompute")
    rebuilt = [d for d in plan.decisions if d.rebuilt_with is not None]
    assert rebuilt, "no tensor rebuilt with another's recipe"
    by_id = {d.saved_tensor: d for d in plan.decisions}
    for d in rebuilt:
        rebuilder = by_id[d.rebuilt_with]
        assert rebuilder.action == "recompute" and d.producer_op in rebuilder.recipe
        assert rebuilder.recompute_before_op == d.recompute_before_op
    # the first step is verified op by op, the second runs on the pack-order fast path: both exact
    reference = run_and_grads(w)
    with regen.apply(w.model, plan) as handle:
        first = run_and_grads(w)
        second = run_and_grads(w)
    assert_same(reference, first)
    assert_same(reference, second)
    assert handle.stats.planned_steps == 2


@_params
def test_real_plan_measured_peak(name, strategy):
    if name.startswith("hf-"):
        pytest.importorskip("transformers")
    w, profile, plan, note = _profiled_plan(name, strategy)
    if note:
        print(note)
    with regen.apply(w.model, plan) as handle:
        step(w)
        w.model.zero_grad(set_to_none=True)  # as profiled: gradients are allocated inside the step
        measured = measure_memory(lambda: step(w))  # host pool allocated at apply(): counted apart
    start = profile.memory_at_start_bytes
    cap_increase = plan.memory_cap_bytes - start
    simulated_increase = plan.simulated.peak_bytes - start
    peak = measured.peak_increase_bytes
    assert peak <= cap_increase * (1 + CAP_TOLERANCE), (
        f"measured peak increase {peak} B over the cap's {cap_increase} B (+5%); pool {handle.pool.capacity_bytes} B apart")
    assert abs(peak - simulated_increase) <= SIMULATOR_TOLERANCE * simulated_increase, (
        f"measured peak increase {peak} B vs simulated {simulated_increase} B")

