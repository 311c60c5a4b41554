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
LINK_RATIO = 0.5  # copy time of every saved tensor over the step time
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
    link = {"link_ratio": LINK_RATIO}  # a CPU profile without a link plans no swaps
    try:
        return solve(profile, memory_cap_bytes=cap, strategy=strategy, time_limit_s=30,
                     **link), None
    except InfeasibleCapError as exc:
        if exc.smallest_feasible_cap_bytes is None:
            raise
        note = (f"{strategy} cannot reach 50% of the unplanned peak; using its smallest cap "
                f"{exc.smallest_feasible_cap_bytes} B ({exc.smallest_feasible_cap_bytes / profile.peak_bytes:.0%})")
        return solve(profile, memory_cap_bytes=exc.smallest_feasible_cap_bytes, strategy=strategy,
                      time_limit_s=30, **link), note


@functools.lru_cache(maxsize=None)
def _profiled_plan(name, strategy):
    from plans import profile as fixed_profile  # fixed times: the same plans on a busy machine

    w = make(name)
    profile = fixed_profile(w)
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
    # one recipe run per recompute decision, none for those rebuilt with another's recipe or by a region
    # replay (one replay per region)
    rebuilt = plan.rebuilt_count()
    assert handle.stats.recomputes == counts["recompute"] - rebuilt - plan.region_member_count()
    assert handle.stats.region_replays == len(plan.regions)


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



@pytest.mark.slow
def test_batchnorm_statistics_are_updated_once_under_recompute():
    """A recompute plan whose recipes replay batch norm: after 5 SGD steps the running statistics, the
    step counters and the eval-mode output equal the unplanned run's bit for bit."""
    import torch

    from regen.planner import solve
    from regen.profiler import profile_workload
    from regen.workloads import build_workload

    def build():
        torch.manual_seed(0)
        return build_workload("cnn", batch_size=4, args=dict(channels=8, num_blocks=2, image_size=16))

    profile = profile_workload(build(), device="cpu", repeats=1, warmup_steps=1, progress=None)
    plan = solve(profile, int(profile.peak_bytes * 0.7), "recompute", time_limit_s=30)
    replayed = {r.name for r in plan.recipe_ops}
    assert "aten.native_batch_norm.default" in replayed, replayed
    plain, planned = build(), build()
    planned.model.load_state_dict(plain.model.state_dict())
    with regen.apply(planned.model, plan) as handle:
        for w in (plain, planned):
            optimizer = torch.optim.SGD(w.model.parameters(), lr=0.1)
            for k in range(5):
                step(w, seed=k)
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
    assert handle.stats.recomputes > 0 and handle.stats.planned_steps == 5
    for (name, a), (_, b) in zip(plain.model.named_buffers(), planned.model.named_buffers()):
        assert torch.equal(a, b), f"buffer {name} differs"
    plain.model.eval(), planned.model.eval()
    with torch.no_grad():
        assert torch.equal(plain.model(*plain.batch), planned.model(*planned.batch))


@pytest.mark.slow
def test_a_plan_for_another_saved_set_is_a_mismatch():
    """Solved with the first layer frozen, applied with every parameter trainable (gradual unfreezing):
    autograd saves more tensors than the plan knows of, which is a mismatch, never a silent overrun."""
    from regen.errors import PlanMismatchError
    from regen.profiler import profile_workload
    from regen.runtime import PlanMismatchWarning

    w = make("mlp")
    first = next(w.model.parameters())
    first.requires_grad_(False)
    profile = profile_workload(w, device="cpu", repeats=1, warmup_steps=1, progress=None)
    plan, _ = _solve(profile, "recompute")
    assert plan.num_forward_packs == sum(1 for e in profile.saved_entries if e.pack_after_op < plan.num_forward_ops)
    with regen.apply(w.model, plan) as handle:
        step(w)  # the saved set it was solved for
    assert handle.stats.planned_steps == 1
    first.requires_grad_(True)
    with pytest.raises(PlanMismatchError, match="saved .* tensors for backward, the plan's saved"):
        with regen.apply(w.model, plan, on_mismatch="raise"):
            step(w)
    with regen.apply(w.model, plan, on_mismatch="keep") as handle:
        with pytest.warns(PlanMismatchWarning, match="frozen or unfrozen"):
            step(w)
    assert handle.stats.unplanned_steps == 1
