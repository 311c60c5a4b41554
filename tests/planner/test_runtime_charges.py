"""What a plan's predicted time charges for regen's own work: recipe captures and replays, the dispatch
mode over the recipes' tracking windows, the Python a module replay runs again, and a swap's calls on
the compute thread."""

from dataclasses import replace

import pytest

from regen.formats.plan import ACTION_RECOMPUTE, TrackingStart
from regen.formats.profile import ModuleCall, RuntimeCosts
from regen.graphs.synthetic import chain_profile
from regen.planner.graph import build_graph
from regen.planner.result import Choice
from regen.planner.simulator import simulate

COSTS = RuntimeCosts(dispatch_op_s=1e-4, capture_op_s=2e-4, replay_op_s=3e-4, recipe_s=5e-4, method="test")
BYTES_PER_S = 1e21


def _graphs():
    plain = chain_profile(5, seed=1)
    charged = replace(plain, runtime_costs=COSTS)
    return build_graph(plain, BYTES_PER_S, BYTES_PER_S), build_graph(charged, BYTES_PER_S, BYTES_PER_S)


def test_a_recipe_is_charged_its_captures_replays_and_fixed_cost():
    plain, charged = _graphs()
    for c_plain, c_charged in zip(plain.candidates, charged.candidates):
        for r_plain, r_charged in zip(c_plain.recipes, c_charged.recipes):
            extra = len(r_plain.ops) * (COSTS.capture_op_s + COSTS.replay_op_s) + COSTS.recipe_s
            assert r_charged.time_s == pytest.approx(r_plain.time_s + extra)


def test_without_module_calls_the_dispatch_mode_is_charged_from_the_first_op():
    plain, charged = _graphs()
    c = charged.candidates[2]  # produced by op 2 from candidate 1 (op 1): ops 0..2 are tracked
    recipe = c.recipes[0]
    assert recipe.ops == [2] and recipe.inputs == [1]
    keep_plain, keep_charged = simulate(plain, {}), simulate(charged, {})
    assert keep_charged.step_time_s == pytest.approx(keep_plain.step_time_s)  # no recipe: no tracking
    sim_plain = simulate(plain, {2: Choice(ACTION_RECOMPUTE, recipe=plain.candidates[2].recipes[0])})
    sim_charged = simulate(charged, {2: Choice(ACTION_RECOMPUTE, recipe=recipe)})
    recipe_extra = COSTS.capture_op_s + COSTS.replay_op_s + COSTS.recipe_s
    assert sim_charged.step_time_s == pytest.approx(sim_plain.step_time_s + recipe_extra + 3 * COSTS.dispatch_op_s)


def test_a_module_call_opens_a_tracking_window_and_the_plan_names_it():
    """A module call starting at op 1 opens the window of the recipe's tracked ops (1 and 2): op 0 runs
    without the dispatch mode, and the call is the one the plan names for the runtime to hook."""
    block = ModuleCall(module="block", call=0, first_op=1, last_op=3, inputs=[], first_entry=0, num_entries=0,
                       depth=1)
    profile = replace(chain_profile(5, seed=1), runtime_costs=COSTS, module_calls=[block])
    plain = build_graph(chain_profile(5, seed=1), BYTES_PER_S, BYTES_PER_S)
    graph = build_graph(profile, BYTES_PER_S, BYTES_PER_S)
    recipe = graph.candidates[2].recipes[0]
    assert graph.tracked_ops(recipe) == {1, 2} and graph.covered_ops(recipe) == {1, 2}
    assert graph.window_starts.opening(graph.tracked_ops(recipe)) == [TrackingStart("block", 0, 1)]
    sim_plain = simulate(plain, {2: Choice(ACTION_RECOMPUTE, recipe=plain.candidates[2].recipes[0])})
    sim = simulate(graph, {2: Choice(ACTION_RECOMPUTE, recipe=recipe)})
    recipe_extra = COSTS.capture_op_s + COSTS.replay_op_s + COSTS.recipe_s
    assert sim.step_time_s == pytest.approx(sim_plain.step_time_s + recipe_extra + 2 * COSTS.dispatch_op_s)


def test_the_forwards_time_outside_ops_is_charged_to_module_replays_per_forward_op():
    profile = chain_profile(5, seed=1)
    forward_op_s = sum(op.time_s for op in profile.ops[:profile.num_forward_ops])
    op_sum_s = sum(op.time_s for op in profile.ops)
    # the step's time outside ops is 2.0 s, of which the timed forward's is 0.5 s: only the forward's counts
    timed = replace(profile, forward_time_s=forward_op_s + 0.5, step_time_s=op_sum_s + 2.0)
    graph = build_graph(timed, BYTES_PER_S, BYTES_PER_S)
    assert graph.costs.between_forward_ops_s == pytest.approx(0.5 / profile.num_forward_ops)
    assert graph.costs.region_time_s(1.0, 4) == pytest.approx(1.0 + 4 * 0.5 / profile.num_forward_ops)
    fast = replace(timed, forward_time_s=forward_op_s / 2)  # op times above the forward: nothing between ops
    assert build_graph(fast, BYTES_PER_S, BYTES_PER_S).costs.between_forward_ops_s == 0.0


def test_without_a_timed_forward_the_steps_time_outside_ops_is_spread_over_all_ops():
    profile = replace(chain_profile(5, seed=1), forward_time_s=None)
    op_sum_s = sum(op.time_s for op in profile.ops)
    slow = replace(profile, step_time_s=op_sum_s + 0.5)
    assert build_graph(slow, BYTES_PER_S, BYTES_PER_S).costs.between_forward_ops_s == \
        pytest.approx(0.5 / len(profile.ops))
    fast = replace(profile, step_time_s=op_sum_s / 2)
    assert build_graph(fast, BYTES_PER_S, BYTES_PER_S).costs.between_forward_ops_s == 0.0


@pytest.mark.parametrize("dispatch_op_s", [1e-4, 1e-2])
def test_the_milp_charges_the_dispatch_mode_as_the_simulator_does(small_transformer, dispatch_op_s):
    """The MILP's objective includes the dispatch mode over the tracking windows of its recipes, so its
    prediction is the simulator's, and its plan is no slower under that charge than the plan solved
    without it; a dear dispatch mode makes the windows cover fewer ops."""
    from regen.planner.milp.model import MilpOptions, Model
    from regen.planner.milp.solution import solve_model
    from regen.planner.simulator import tracked_forward_ops

    def graph_with(dispatch_s):
        costs = RuntimeCosts(dispatch_op_s=dispatch_s, capture_op_s=0.0, replay_op_s=0.0, recipe_s=0.0, method="t")
        return build_graph(replace(small_transformer, runtime_costs=costs))

    cap = int(small_transformer.peak_bytes * 0.6)
    blind, charged = graph_with(0.0), graph_with(dispatch_op_s)
    unaware = solve_model(Model(blind, cap, MilpOptions(allow_swap=False)), 60, rel_gap=1e-6).choices
    result = solve_model(Model(charged, cap, MilpOptions(allow_swap=False)), 60, rel_gap=1e-6)
    sim = simulate(charged, result.choices)
    assert sim.fits(cap)
    assert result.objective_s == pytest.approx(sim.step_time_s, rel=1e-3)
    assert sim.step_time_s <= simulate(charged, unaware).step_time_s * (1 + 1e-3)
    if dispatch_op_s >= 1e-2:  # 10 ms per forward op: far dearer than any recipe's own ops
        assert len(tracked_forward_ops(charged, result.choices)) < len(tracked_forward_ops(charged, unaware))


def test_each_swap_is_charged_its_calls_by_the_simulator_and_the_milp(small_transformer):
    """A swap costs the compute thread `swap_s` (simulator: at its copy-out); the MILP's objective
    charges the same, and a dear enough swap makes the hybrid plan swap less."""
    from regen.formats.plan import ACTION_SWAP
    from regen.planner.milp.model import MilpOptions, Model
    from regen.planner.milp.solution import solve_model

    def graph_with(swap_s):
        costs = RuntimeCosts(dispatch_op_s=0.0, capture_op_s=0.0, replay_op_s=0.0, recipe_s=0.0, method="t",
                             swap_s=swap_s)
        return build_graph(replace(small_transformer, runtime_costs=costs))

    cap = int(small_transformer.peak_bytes * 0.6)
    free = graph_with(0.0)
    result = solve_model(Model(free, cap, MilpOptions()), 60, rel_gap=1e-6)
    swaps = sum(ch.action == ACTION_SWAP for ch in result.choices.values())
    assert swaps > 0
    dear_s = 0.02 * free.compute_time_s
    dear = graph_with(dear_s)
    assert simulate(dear, result.choices).step_time_s == pytest.approx(
        simulate(free, result.choices).step_time_s + swaps * dear_s, rel=1e-6)
    charged = solve_model(Model(dear, cap, MilpOptions()), 60, rel_gap=1e-6)
    sim = simulate(dear, charged.choices)
    assert sim.fits(cap)
    assert charged.objective_s == pytest.approx(sim.step_time_s, rel=1e-3)
    assert sum(ch.action == ACTION_SWAP for ch in charged.choices.values()) < swaps


# ---- the calibration's charges (formats.Calibration, regen.calibration) ------------------------------


def test_a_calibrated_recompute_is_charged_its_scale():
    """A recipe and a module replay cost recompute_scale times what the probe's figures alone charge."""
    from regen.formats.profile import Calibration

    plain = replace(chain_profile(5, seed=1), runtime_costs=COSTS)
    scaled = replace(plain, calibration=Calibration(recompute_scale=1.5, swap_byte_s=0.0, rounds=3, method="test"))
    g_plain, g_scaled = build_graph(plain, BYTES_PER_S, BYTES_PER_S), build_graph(scaled, BYTES_PER_S, BYTES_PER_S)
    assert g_scaled.costs.region_time_s(1.0, 10) == pytest.approx(1.5 * g_plain.costs.region_time_s(1.0, 10))
    for c_plain, c_scaled in zip(g_plain.candidates, g_scaled.candidates):
        for r_plain, r_scaled in zip(c_plain.recipes, c_scaled.recipes):
            assert r_scaled.time_s == pytest.approx(1.5 * r_plain.time_s)


def test_the_simulated_parts_add_up_to_the_step():
    """The simulator's parts of a plan (what the calibration fits against) are its step beyond the ops."""
    graph = build_graph(replace(chain_profile(5, seed=1), runtime_costs=COSTS), BYTES_PER_S, BYTES_PER_S)
    recipe = graph.candidates[2].recipes[0]
    sim = simulate(graph, {2: Choice(ACTION_RECOMPUTE, recipe=recipe)})
    p = sim.parts
    assert p.recompute_s == pytest.approx(recipe.time_s) and p.dispatch_s == pytest.approx(3 * COSTS.dispatch_op_s)
    assert sim.step_time_s == pytest.approx(graph.compute_time_s + p.recompute_s + p.dispatch_s + p.swap_calls_s
                                            + p.link_wait_s)
    assert p.swap_calls_s == 0 and p.link_wait_s == pytest.approx(0, abs=1e-12)


def test_a_per_byte_swap_charge_reaches_the_milp(small_transformer):
    """With swaps charged at the calibration's largest per-byte figure, the hybrid MILP stops swapping what it
    swapped without it: the charge is in its objective, not only in the simulator's judgement."""
    from regen.formats.plan import ACTION_SWAP
    from regen.formats.profile import CALIBRATION_MAX_SWAP_BYTE_S, Calibration
    from regen.planner import solve

    cap = small_transformer.memory_at_start_bytes + (small_transformer.peak_bytes
                                                     - small_transformer.memory_at_start_bytes) * 7 // 10
    costly = replace(small_transformer, calibration=Calibration(1.0, CALIBRATION_MAX_SWAP_BYTE_S, 3, "test"))
    plain_plan = solve(small_transformer, cap, "hybrid", time_limit_s=30)
    costly_plan = solve(costly, cap, "hybrid", time_limit_s=30)
    swaps = [sum(d.action == ACTION_SWAP for d in p.decisions) for p in (plain_plan, costly_plan)]
    assert swaps[0] > 0 and swaps[1] < swaps[0]
    assert costly_plan.simulated_parts.swap_calls_s >= CALIBRATION_MAX_SWAP_BYTE_S * sum(
        d.bytes for d in costly_plan.decisions if d.action == ACTION_SWAP)


def test_a_planned_steps_own_cost_is_in_every_plans_prediction_and_in_no_decision(small_transformer):
    """The calibration's per-step cost (regen's hooks at every pack and unpack, whatever the plan drops) is
    added to a plan's predicted and simulated step, once, and changes no decision: every plan of the graph
    pays it alike."""
    from regen.formats.profile import Calibration
    from regen.planner import solve

    cap = small_transformer.memory_at_start_bytes + (small_transformer.peak_bytes
                                                     - small_transformer.memory_at_start_bytes) * 7 // 10
    runtime_step_s = 0.1 * small_transformer.step_time_s
    plain = replace(small_transformer, calibration=Calibration(1.0, 0.0, 3, "test"))
    hooked = replace(small_transformer, calibration=Calibration(1.0, 0.0, 3, "test", runtime_step_s=runtime_step_s))
    a, b = (solve(p, cap, "recompute", time_limit_s=30) for p in (plain, hooked))
    assert [(d.action, d.region) for d in a.decisions] == [(d.action, d.region) for d in b.decisions]
    assert b.simulated.step_time_s == pytest.approx(a.simulated.step_time_s + runtime_step_s)
    assert b.predicted.step_time_s == pytest.approx(a.predicted.step_time_s + runtime_step_s)
    assert b.baseline.step_time_s == a.baseline.step_time_s  # the unplanned step pays none of it
    assert b.charges.runtime_step_s == runtime_step_s
