"""regen.calibration: the planner's charges fitted to the workload's own planned steps."""

from collections import Counter
from dataclasses import replace
from types import SimpleNamespace

import pytest
import torch

from regen import calibration as cal
from regen.formats.plan import ACTION_SWAP, TimeParts
from regen.formats.profile import CALIBRATION_MAX_SWAP_BYTE_S, Calibration

STEP_S = 0.100


def _variant(name, times_per_round, parts=None, swapped_bytes=0):
    decisions = [SimpleNamespace(action=ACTION_SWAP, bytes=swapped_bytes)] if swapped_bytes else []
    plan = None if parts is None else SimpleNamespace(simulated_parts=parts, decisions=decisions)
    return cal._Variant(name, plan, times_s=[list(t) for t in times_per_round])


def test_the_recompute_scale_is_the_measured_extra_over_the_charge():
    """A plan charged 20 ms of recomputes whose steps take 30 ms more (round after round, whatever the
    unplanned step did in that round): x1.5; a round of noise does not move the median."""
    base = _variant("unplanned", [[0.100, 0.102], [0.110, 0.110], [0.100, 0.100]])
    plan = _variant("recompute", [[0.131, 0.131], [0.140, 0.140], [0.190, 0.190]],
                    TimeParts(recompute_s=0.020))
    notes = []
    assert cal._fit_recompute_scale(base, plan, STEP_S, notes) == pytest.approx(1.5)
    assert notes == []


def test_a_blocks_time_is_its_least_step_after_the_first():
    """The first step under a new handle verifies the plan, and load only adds time: neither a slow first step nor
    a slow later one moves a block's time."""
    assert cal.block_time_s([0.300, 0.100, 0.101]) == 0.100
    assert cal.block_time_s([0.100, 0.101, 0.250]) == 0.101
    assert cal.block_time_s([0.120]) == 0.120  # a block of one step
    base = _variant("unplanned", [[0.105, 0.100, 0.180]])
    plan = _variant("recompute", [[0.400, 0.130, 0.131]], TimeParts(recompute_s=0.020))
    assert cal._extras_s(base, plan) == [pytest.approx(0.030)]


def test_rounds_stop_once_each_plans_extra_time_agrees_from_round_to_round():
    """Extras of 30 and 31 ms on a 100 ms step agree (1% of the step apart); 30 and 45 ms do not (15%)."""
    base = _variant("unplanned", [[0.100, 0.100, 0.100], [0.105, 0.104, 0.106]])
    steady = _variant("recompute", [[0.130, 0.131, 0.129], [0.136, 0.135, 0.137]], TimeParts(recompute_s=0.02))
    assert cal._settled([base, steady])
    unsteady = _variant("swap", [[0.130, 0.130, 0.130], [0.145, 0.145, 0.145]], TimeParts())
    assert not cal._settled([base, steady, unsteady])


def test_a_planned_steps_own_cost_is_what_keeping_every_tensor_costs_and_comes_out_of_the_other_fits():
    """The keep-everything plan's steps take 5 ms more than the unplanned ones: that is the runtime's cost per
    planned step, and the recompute plan's 35 ms extra is 5 ms of it and 30 ms of recomputes charged 20 ms
    (x1.5); the swap plan's per-byte charge is what is left after both."""
    base = _variant("unplanned", [[0.100], [0.100], [0.100]])
    keep_all = _variant(cal.KEEP_ALL, [[0.105], [0.104], [0.106]], TimeParts())
    notes = []
    runtime_s = cal._fit_runtime_step_s(base, keep_all, STEP_S, notes)
    assert runtime_s == pytest.approx(0.005)
    recompute = _variant("recompute", [[0.135], [0.135], [0.135]], TimeParts(recompute_s=0.020))
    assert cal._fit_recompute_scale(base, recompute, STEP_S, notes, runtime_s) == pytest.approx(1.5)
    swapping = _variant("swap", [[0.115], [0.115], [0.115]], TimeParts(), swapped_bytes=10_000_000)
    assert cal._fit_swap_byte_s(base, swapping, cal._Scales(1.5, 1.5), notes, runtime_s) == pytest.approx(1e-9)
    assert notes == []
    faster = _variant(cal.KEEP_ALL, [[0.099], [0.098], [0.099]], TimeParts())
    assert cal._fit_runtime_step_s(base, faster, STEP_S, notes) == 0.0  # never a negative charge
    wild = _variant(cal.KEEP_ALL, [[0.300], [0.300], [0.300]], TimeParts())
    assert cal._fit_runtime_step_s(base, wild, STEP_S, notes) == 0.0 and "no per-step charge" in notes[-1]


def test_too_little_recompute_or_a_wild_figure_keeps_scale_one_with_a_note():
    base = _variant("unplanned", [[0.100]])
    notes = []
    small = _variant("recompute", [[0.110]], TimeParts(recompute_s=0.001))
    assert cal._fit_recompute_scale(base, small, STEP_S, notes) == 1.0 and "too little" in notes[-1]
    wild = _variant("recompute", [[0.300]], TimeParts(recompute_s=0.020))
    assert cal._fit_recompute_scale(base, wild, STEP_S, notes) == 1.0 and "outside" in notes[-1]


def test_the_per_byte_swap_charge_is_what_the_swapping_plan_costs_beyond_its_recomputes_and_calls():
    """10 MB swapped, 5 ms of recomputes at x2 and 1 ms of swap calls charged, 25 ms measured: 14 ms over
    10 MB is 1.4 ns a byte."""
    base = _variant("unplanned", [[0.100], [0.100]])
    swapping = _variant("swap", [[0.125], [0.125]], TimeParts(recompute_s=0.005, swap_calls_s=0.001),
                      swapped_bytes=10_000_000)
    notes = []
    assert cal._fit_swap_byte_s(base, swapping, cal._Scales(2.0, 2.0), notes) == pytest.approx(1.4e-9)
    faster = _variant("swap", [[0.101], [0.101]], TimeParts(recompute_s=0.005), swapped_bytes=10_000_000)
    assert cal._fit_swap_byte_s(base, faster, cal._Scales(), notes) == 0.0  # never a negative charge
    slow = _variant("swap", [[10.0], [10.0]], TimeParts(), swapped_bytes=10_000)
    assert cal._fit_swap_byte_s(base, slow, cal._Scales(), notes) == 0.0 and "no per-byte charge" in notes[-1]


def test_the_per_byte_swap_charge_is_at_least_what_the_link_s_memmoves_took():
    """The residual (here 0: the runtime's per-step figure took it) is the others' errors too; the emulated
    link's memmoves were measured: 4 ms a step over 10 MB swapped is 0.4 ns a byte."""
    base = _variant("unplanned", [[0.100], [0.100]])
    swapping = _variant("swap", [[0.110], [0.110]], TimeParts(), swapped_bytes=10_000_000)
    notes = []
    assert cal._fit_swap_byte_s(base, swapping, cal._Scales(), notes, runtime_s=0.010) == 0.0
    swapping.memmove_s = 2 * 0.004
    assert cal._fit_swap_byte_s(base, swapping, cal._Scales(), notes, runtime_s=0.010) == pytest.approx(4e-10)


def test_module_replays_and_recipes_get_scales_of_their_own():
    """The replays' plan (20 ms of module replays charged, 16 ms measured): x0.8. The recompute plan charged 10 ms
    of replays and 10 ms of recipes and measured 28 ms: its replays at x0.8 are 8 ms, so its recipes are x2.0 (one
    scale over both would say x1.4). The swap plan's recomputes come out of its extra at those scales."""
    base = _variant("unplanned", [[0.100], [0.100], [0.100]])
    replays = _variant(cal.REGIONS, [[0.116], [0.116], [0.116]], TimeParts(recompute_s=0.020, region_s=0.020))
    notes = []
    region_scale = cal._fit_region_scale(base, replays, STEP_S, notes)
    assert region_scale == pytest.approx(0.8)
    mixed = TimeParts(recompute_s=0.020, region_s=0.010)
    recompute = _variant("recompute", [[0.128], [0.128], [0.128]], mixed)
    assert cal._fit_recompute_scale(base, recompute, STEP_S, notes, 0.0, region_scale) == pytest.approx(2.0)
    assert cal._fit_recompute_scale(base, recompute, STEP_S, notes) == pytest.approx(1.4)
    swapping = _variant("swap", [[0.138], [0.138], [0.138]], mixed, swapped_bytes=10_000_000)
    assert cal._fit_swap_byte_s(base, swapping, cal._Scales(2.0, 0.8), notes) == pytest.approx(1e-9)
    assert notes == []
    # too few replays to measure, or a wild figure: none, and recompute's scale stands for them
    tiny = _variant(cal.REGIONS, [[0.101]], TimeParts(recompute_s=0.0005, region_s=0.0005))
    assert cal._fit_region_scale(base, tiny, STEP_S, notes) is None and "too little" in notes[-1]
    wild = _variant(cal.REGIONS, [[0.300]], TimeParts(recompute_s=0.020, region_s=0.020))
    assert cal._fit_region_scale(base, wild, STEP_S, notes) is None and "outside" in notes[-1]


def test_the_planner_charges_module_replays_at_their_own_scale(tiny_gpt):
    """A calibration with a replays' scale charges module replays with it and recipes with recompute's; one
    without (an older profile) charges both with recompute's."""
    from regen.planner.graph import build_graph

    _workload, profile = tiny_gpt
    plain = build_graph(profile)
    assert plain.regions and plain.costs.region_scale == 1.0
    both = build_graph(replace(profile, calibration=Calibration(2.0, 0.0, 1, "test", region_scale=0.5)))
    assert both.costs.recompute_scale == 2.0 and both.costs.region_scale == 0.5
    assert [r.time_s for r in both.regions] == pytest.approx([0.5 * r.time_s for r in plain.regions])
    older = build_graph(replace(profile, calibration=Calibration(2.0, 0.0, 1, "test")))
    assert [r.time_s for r in older.regions] == pytest.approx([2.0 * r.time_s for r in plain.regions])


def test_a_calibration_out_of_bounds_in_a_file_is_one_format_error(tmp_path):
    from regen.errors import FormatError
    from regen.formats import load_profile, save_profile
    from regen.graphs.synthetic import chain_profile

    path = tmp_path / "p.yaml"
    good = replace(chain_profile(4, seed=1), calibration=Calibration(1.3, 2e-10, 3, "test", ["a note"]))
    save_profile(good, path)
    assert load_profile(path).calibration == good.calibration
    hooked = replace(good, calibration=replace(good.calibration, runtime_step_s=0.1 * good.step_time_s,
                                               region_scale=0.8))
    save_profile(hooked, path)
    assert load_profile(path).calibration == hooked.calibration
    for bad in (Calibration(9.0, 0.0, 3, "test"), Calibration(1.0, 10 * CALIBRATION_MAX_SWAP_BYTE_S, 3, "test"),
                Calibration(1.0, 0.0, 3, "test", region_scale=0.1),
                Calibration(1.0, -1e-9, 3, "test"), Calibration(1.0, 0.0, 3, "test", runtime_step_s=-1e-3),
                Calibration(1.0, 0.0, 3, "test", runtime_step_s=2 * good.step_time_s)):
        save_profile(replace(good, calibration=bad), path)
        with pytest.raises(FormatError, match="calibration"):
            load_profile(path)


@pytest.fixture(scope="module")
def tiny_gpt():
    from regen.profiler import profile_workload
    from regen.workloads import build_workload

    workload = build_workload("gpt", batch_size=4, args=dict(vocab_size=128, context=32, d_model=32, n_layer=2,
                                                              n_head=2))
    return workload, profile_workload(workload, device="cpu", repeats=1, warmup_steps=1, progress=None)


def test_calibrate_times_both_plans_on_the_workload_and_leaves_the_profile_alone(tiny_gpt, monkeypatch):
    """On a real model: the plans run under regen.apply against the unplanned step, every round; the
    figures are within the bounds the profile format accepts (or defaults with a note saying why)."""
    import regen

    workload, profile = tiny_gpt
    monkeypatch.setattr(cal, "MAX_ROUNDS", 2)
    applied, real_apply = [], regen.apply
    monkeypatch.setattr(regen, "apply", lambda model, plan, **kw: applied.append(plan) or real_apply(model, plan, **kw))
    lines = []
    calibration = cal.calibrate(workload, profile, lines.append)
    assert profile.calibration is None
    assert calibration.rounds == 2
    notes = calibration.notes
    # every round timed the plan that keeps every tensor (the runtime's own cost) and the one that replays every
    # block and nothing else (module replays alone), and the recompute plan
    by_strategy = Counter(p.strategy for p in applied)
    assert by_strategy[cal.KEEP_ALL] == by_strategy[cal.REGIONS] == by_strategy["recompute"] == 2, notes
    kept_all = [p for p in applied if p.strategy == cal.KEEP_ALL]
    assert all(p.action_counts()["recompute"] == p.action_counts()["swap"] == 0 for p in kept_all)
    replays = [p for p in applied if p.strategy == cal.REGIONS]
    assert all(p.regions and p.region_member_count() == p.action_counts()["recompute"] for p in replays)
    # the recompute plan measures recipes apart from those replays: it replays no block
    recipes = [p for p in applied if p.strategy == "recompute"]
    assert all(not p.regions and p.action_counts()["recompute"] for p in recipes)
    # the swap plan rests on this machine's measured times: timed every round when it was solved and swaps, else a
    # note says why the per-byte charge keeps its default
    swaps = [p for p in applied if p.strategy == "swap"]
    assert len(swaps) in (0, 2) and all(p.action_counts()["swap"] for p in swaps), notes
    assert swaps or any(n.startswith("no swap plan") or "swaps nothing" in n for n in notes), notes
    assert len(applied) == 6 + len(swaps)
    lo, hi = cal.CALIBRATION_SCALE_BOUNDS
    assert lo <= calibration.recompute_scale <= hi and 0 <= calibration.swap_byte_s <= CALIBRATION_MAX_SWAP_BYTE_S
    assert calibration.region_scale is None or lo <= calibration.region_scale <= hi
    assert 0 <= calibration.runtime_step_s <= cal.CALIBRATION_MAX_RUNTIME_STEP_FRACTION * profile.step_time_s
    assert any(line.startswith("calibration: ") and " ms a planned step, recompute x" in line for line in lines)
    assert all(p.grad is None for p in workload.model.parameters())


def test_a_plan_that_cannot_be_solved_leaves_only_its_own_figure_at_the_default(tiny_gpt, monkeypatch):
    """No swap plan (a solver error): the recompute plan is still timed and fitted; the per-byte charge keeps
    its default, and a note says why."""
    import importlib

    from regen.errors import SolverError

    planner_solve = importlib.import_module("regen.planner.solve")  # the module (regen.planner.solve is a function)
    real = planner_solve.solve_within_reach

    def no_swap_plan(profile, cap, strategy, **kwargs):
        if strategy == "swap":
            raise SolverError("HiGHS stopped")
        return real(profile, cap, strategy, **kwargs)

    workload, profile = tiny_gpt
    monkeypatch.setattr(planner_solve, "solve_within_reach", no_swap_plan)
    monkeypatch.setattr(cal, "MAX_ROUNDS", 2)
    calibration = cal.calibrate(workload, profile)
    assert calibration.rounds == 2 and calibration.swap_byte_s == 0.0
    assert any(n.startswith("no swap plan in 5 s (HiGHS stopped): its figure keeps") for n in calibration.notes)


def test_a_plan_not_found_in_its_time_is_solved_again_with_more_time_at_the_same_cap(tiny_gpt, monkeypatch):
    """The solver finds no recompute plan in the calibration's time (a graph of thousands of ops, most of the
    time spent building): it gets RETRY_TIME_FACTOR times the time at the same cap, and its figure is timed."""
    import importlib

    from regen.errors import SolverError

    planner_solve = importlib.import_module("regen.planner.solve")
    real, calls = planner_solve.solve_within_reach, []
    workload, profile = tiny_gpt

    def slow_at_first(profile, cap, strategy, time_limit_s, **kwargs):
        calls.append((strategy, cap, time_limit_s))
        if strategy == "recompute" and len(calls) == 1:
            raise SolverError("stopped after 1.0 s without a feasible plan")
        return real(profile, cap, strategy, time_limit_s=time_limit_s, **kwargs)

    monkeypatch.setattr(planner_solve, "solve_within_reach", slow_at_first)
    monkeypatch.setattr(cal, "MAX_ROUNDS", 2)
    calibration = cal.calibrate(workload, profile)
    (_, cap, limit_s), (_, again_cap, again_s) = calls[:2]
    assert again_cap == cap and again_s == pytest.approx(min(cal.SOLVE_MAX_S, cal.RETRY_TIME_FACTOR * limit_s))
    assert calibration.notes[0].startswith("no recompute plan in 1 s (stopped after")
    # the recompute plan found the second time is timed (the swap plan's fate rests on this machine's times)
    assert not any(n.startswith("no recompute plan") and "keeps the default" in n for n in calibration.notes), \
        calibration.notes


def test_a_plan_step_that_fails_keeps_the_defaults_with_a_note(tiny_gpt, monkeypatch):
    import regen
    from regen.errors import PlanMismatchError

    def refuse(*_args, **_kwargs):
        raise PlanMismatchError("not this model")

    workload, profile = tiny_gpt
    monkeypatch.setattr(regen, "apply", refuse)
    calibration = cal.calibrate(workload, profile)
    assert (calibration.recompute_scale, calibration.swap_byte_s, calibration.rounds) == (1.0, 0.0, 0)
    assert "a calibration step failed: not this model" in calibration.notes[0]


def test_calibration_leaves_the_models_buffers_and_rng_as_it_found_them(monkeypatch):
    """A model with BatchNorm: the calibration's steps (planned and unplanned) do not move its running
    statistics or the RNG the user's loop continues from."""
    from regen.profiler import profile_workload
    from regen.workloads import build_workload

    workload = build_workload("cnn", batch_size=4, args=dict(channels=4, num_blocks=2, image_size=16))
    profile = profile_workload(workload, device="cpu", repeats=1, warmup_steps=1, progress=None)
    monkeypatch.setattr(cal, "MIN_ROUNDS", 1)
    monkeypatch.setattr(cal, "MAX_ROUNDS", 1)
    buffers = {name: b.clone() for name, b in workload.model.named_buffers()}
    assert any("running_mean" in name for name in buffers)
    rng = torch.get_rng_state()
    calibration = cal.calibrate(workload, profile)
    assert calibration.rounds == 1
    assert all(torch.equal(b, buffers[name]) for name, b in workload.model.named_buffers())
    assert torch.equal(torch.get_rng_state(), rng)
