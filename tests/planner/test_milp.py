"""The MILP against brute force: its optimum is the best of all action assignments under the same model.

Brute force fixes every candidate's action (keep / swap / recompute, where allowed) and solves the
same MILP for the rest (the recompute option, copy schedule and stalls), i.e. the same cost model
evaluated per assignment. 3^n assignments: graphs of 4-5 decidable candidates take well under a second;
the 7-candidate graph (2,187 assignments) takes several seconds and is marked slow.
"""

import itertools

import pytest

from regen.formats.plan import ACTION_KEEP, ACTION_RECOMPUTE, ACTION_SWAP
from regen.planner.graph import build_graph
from regen.planner.milp.highs import constraints_of, to_highs_lp
from regen.planner.milp.memory_rows import CapInfeasible
from regen.planner.milp.model import DEFAULT_REL_GAP, MilpOptions, Model
from regen.planner.milp.solution import solve_model
from regen.planner.simulator import simulate
from regen.graphs.synthetic import chain_profile, transformer_profile

EXACT_GAP = 1e-9


def brute_force(graph, cap):
    decidable = [c for c in graph.candidates if c.can_swap or c.can_recompute]
    menus = [[ACTION_KEEP] + ([ACTION_SWAP] if c.can_swap else []) + ([ACTION_RECOMPUTE] if c.can_recompute else [])
             for c in decidable]
    best, evaluated = None, 0
    for combo in itertools.product(*menus):
        fixed = {c.index: a for c, a in zip(decidable, combo)}
        try:
            result = solve_model(Model(graph, cap, MilpOptions(fixed_actions=fixed)), 30, rel_gap=EXACT_GAP)
        except CapInfeasible:
            continue
        evaluated += 1
        if best is None or result.objective_s < best:
            best = result.objective_s
    return best, evaluated, len(decidable)


# caps and bandwidths where the optimum mixes swaps and recomputes, and costs more than the unplanned step
@pytest.mark.parametrize("n,seed,cap_fraction,bandwidth", [(5, 0, 0.75, 3e9), (6, 3, 0.65, 5e9), (6, 7, 0.75, 10e9),
                                                           (6, 3, 0.7, 0.5e9)])
def test_milp_matches_brute_force(n, seed, cap_fraction, bandwidth):
    _check_against_brute_force(n, seed, cap_fraction, bandwidth)


@pytest.mark.slow
def test_milp_matches_brute_force_seven_candidates():
    _check_against_brute_force(8, 2, 0.7, 5e9)


def _check_against_brute_force(n, seed, cap_fraction, bandwidth):
    profile = chain_profile(n, seed=seed, copy_bytes_per_s=bandwidth)
    graph = build_graph(profile)
    cap = int(profile.peak_bytes * cap_fraction)
    best, evaluated, decidable = brute_force(graph, cap)
    assert best is not None and evaluated >= 2 and decidable >= n - 1
    milp = solve_model(Model(graph, cap, MilpOptions()), 30, rel_gap=EXACT_GAP)
    assert milp.objective_s == pytest.approx(best, rel=1e-6)
    assert milp.status == "optimal" and milp.gap == pytest.approx(0.0, abs=1e-6)
    assert milp.objective_s > graph.compute_time_s  # the cap costs something: not a trivial instance
    # and the plan it describes is what the simulator replays
    sim = simulate(graph, milp.choices)
    assert sim.valid and sim.peak_bytes <= cap
    assert sim.step_time_s == pytest.approx(milp.objective_s, rel=0.05)


def test_minimum_peak_model_finds_a_cap_that_is_feasible():
    profile = chain_profile(6, seed=3)
    graph = build_graph(profile)
    result = solve_model(Model(graph, None, MilpOptions(minimize_peak=True)), 30)
    assert result.min_cap_bytes < profile.peak_bytes
    solve_model(Model(graph, result.min_cap_bytes, MilpOptions()), 30)  # feasible at the cap it found
    with pytest.raises(CapInfeasible):
        solve_model(Model(graph, int(result.min_cap_bytes * 0.98), MilpOptions()), 30)


def test_solver_stops_at_the_requested_gap(small_transformer):
    """The default stopping gap is 1%; a looser gap stops sooner with a valid bound, a tight one goes further."""

    assert DEFAULT_REL_GAP == pytest.approx(0.01)
    graph = build_graph(small_transformer)
    cap = int(small_transformer.peak_bytes * 0.5)
    default = solve_model(Model(graph, cap, MilpOptions()), 60)
    assert default.status == "optimal" and default.gap is not None and default.gap <= DEFAULT_REL_GAP + 1e-9
    loose = solve_model(Model(graph, cap, MilpOptions()), 60, rel_gap=0.5)
    tight = solve_model(Model(graph, cap, MilpOptions()), 60, rel_gap=1e-6)
    assert loose.gap <= 0.5 and tight.gap <= 1e-6 + 1e-9
    # every run's bound is below the tightest objective, and tightening never makes the plan worse
    for r in (loose, default):
        assert r.bound_s <= tight.objective_s * (1 + 1e-6)
        assert tight.objective_s <= r.objective_s * (1 + 1e-6)
    assert default.objective_s <= tight.objective_s * (1 + DEFAULT_REL_GAP) + 1e-12


def test_block_improvement_starts_from_the_warm_plan_and_never_worsens_it(small_transformer):
    import pulp

    from regen.planner.milp.blocks import improve_by_blocks

    graph = build_graph(small_transformer)
    cap = int(small_transformer.peak_bytes * 0.5)
    recompute_only = solve_model(Model(graph, cap, MilpOptions(allow_swap=False)), 30, rel_gap=1e-6)
    model = Model(graph, cap, MilpOptions())
    choices, values, objective = improve_by_blocks(model, recompute_only.choices, 30, block_candidates=10)
    blocks_objective_s = pulp.value(model.prob.objective) * model.time_unit
    assert objective * model.time_unit == pytest.approx(blocks_objective_s, rel=1e-6)
    # the blocks solved sub-models: their solution, with every fixed value, satisfies the whole model
    assert all(con.valid(1e-6) for con in constraints_of(model.prob))
    exact = solve_model(Model(graph, cap, MilpOptions()), 60, rel_gap=1e-6)
    assert exact.objective_s * (1 - 1e-6) <= blocks_objective_s <= recompute_only.objective_s * (1 + 1e-6)
    sim = simulate(graph, choices)
    assert sim.valid and sim.peak_bytes <= cap
    binaries = {v.name for v in model.prob.variables() if v.cat == pulp.LpInteger}
    assert set(values) == binaries and set(values.values()) <= {0.0, 1.0}
    # its values warm-start a fresh model of the same options: the solve ends no worse than the blocks
    again = solve_model(Model(graph, cap, MilpOptions()), 30, warm_values=values)
    assert again.objective_s <= blocks_objective_s * (1 + 1e-6)


def test_once_the_bound_is_known_a_block_proves_its_plan_to_its_share_of_the_gap(small_transformer, monkeypatch):
    from regen.planner.milp import blocks
    from regen.planner.milp.relaxation import lp_bound

    graph = build_graph(small_transformer)
    cap = int(small_transformer.peak_bytes * 0.5)
    recompute_only = solve_model(Model(graph, cap, MilpOptions(allow_swap=False)), 30, rel_gap=1e-6)
    model = Model(graph, cap, MilpOptions())
    warm_objective = recompute_only.objective_s / model.time_unit  # the same plan's, in model units
    guide = blocks.SweepGuide()
    guide.bound = lp_bound(model, 30)[0]  # known from the start: every block gets an absolute gap
    abs_gaps, new_highs = [], blocks.new_highs

    def recording(*args, **kwargs):
        h = new_highs(*args, **kwargs)
        set_option = h.setOptionValue
        h.setOptionValue = lambda name, value: (abs_gaps.append(value) if name == "mip_abs_gap" else None,
                                                set_option(name, value))
        return h

    monkeypatch.setattr(blocks, "new_highs", recording)
    _, _, objective = blocks.improve_by_blocks(model, recompute_only.choices, 30, block_candidates=10, guide=guide,
                                               max_sweeps=1)
    sweep_blocks = -(-len(model.vars) // 10)
    assert len(abs_gaps) == sweep_blocks
    assert abs_gaps[0] == pytest.approx(blocks.BLOCK_GAP_SHARE * (warm_objective - guide.bound) / sweep_blocks)
    assert abs_gaps == sorted(abs_gaps, reverse=True)  # the plan's gap only closes
    assert guide.bound <= objective <= warm_objective * (1 + 1e-9)


def test_lp_bound_is_below_the_optimum_and_guides_the_blocks(small_transformer):
    from regen.planner.milp.relaxation import lp_bound, lp_disagreement

    graph = build_graph(small_transformer)
    cap = int(small_transformer.peak_bytes * 0.5)
    model = Model(graph, cap, MilpOptions())
    bound, values = lp_bound(model, 30)
    exact = solve_model(Model(graph, cap, MilpOptions()), 60, rel_gap=1e-6)
    assert bound * model.time_unit <= exact.objective_s * (1 + 1e-9)
    assert bound * model.time_unit > graph.compute_time_s  # the cap costs something: the bound sees it
    # keep-all differs from the relaxation exactly where the relaxation swaps or recomputes
    priority = lp_disagreement(model, values, {})
    assert set(priority) == set(model.vars) and min(priority.values()) >= 0
    acting = {i for i, v in model.vars.items()
              if sum(values[x.index] for x in v.actions()) > 1e-6}
    assert acting and {i for i, p in priority.items() if p > 0} == acting


def test_the_relaxation_leaves_out_rows_and_stays_a_bound(small_transformer):
    """The LP leaves out the copy-in start and host-memory rows: its optimum is at most the LP's with
    them, which is at most the MILP's, and it still sees the cap."""
    from regen.planner.milp.highs import new_highs
    from regen.planner.milp.relaxation import Relaxation

    # a host memory cap that binds: most swaps cannot go at once
    graph = build_graph(small_transformer, host_memory_cap_bytes=small_transformer.peak_bytes // 8)
    cap = int(small_transformer.peak_bytes * 0.5)
    model = Model(graph, cap, MilpOptions())
    left_out = set(model.rows_not_in_relaxation)
    assert any(n.startswith("in_started_") for n in left_out) and any(n.startswith("host_") for n in left_out)
    relaxation = Relaxation(model, 30)
    bound, _ = relaxation.result()
    lp = to_highs_lp(model.prob, model.prob.variables())
    lp.integrality_ = []
    h = new_highs()
    h.passModel(lp)
    h.run()
    with_every_row = h.getInfo().objective_function_value
    exact = solve_model(Model(graph, cap, MilpOptions()), 60, rel_gap=1e-6)
    assert bound <= with_every_row * (1 + 1e-9)
    assert with_every_row * model.time_unit <= exact.objective_s * (1 + 1e-9)
    assert bound * model.time_unit > graph.compute_time_s


def _lp_without_left_out_rows(model) -> float:
    """The optimum of the model's LP relaxation with every row but those it leaves out, in one solve."""
    import numpy as np

    from regen.planner.milp.highs import constraints_of, new_highs

    lp = to_highs_lp(model.prob, model.prob.variables())
    lp.integrality_ = []
    h = new_highs()
    h.passModel(lp)
    names = set(model.rows_not_in_relaxation)
    out = np.array([i for i, con in enumerate(constraints_of(model.prob)) if con.name in names], dtype=np.int32)
    h.deleteRows(len(out), out)
    h.run()
    return h.getInfo().objective_function_value


@pytest.mark.parametrize("per_round", [1, 50])
def test_the_relaxation_adds_the_cap_rows_its_solution_breaks(small_transformer, monkeypatch, per_round):
    """Started with one cap row and given more only where its solution breaks them, the relaxation ends at
    the optimum of the LP with all of them, and its solution breaks none."""
    import regen.planner.milp.relaxation as relaxation_module
    from regen.planner.milp.highs import constraints_of

    monkeypatch.setattr(relaxation_module, "INITIAL_CAP_ROWS", 1)
    monkeypatch.setattr(relaxation_module, "CAP_ROWS_PER_ROUND", per_round)
    model = Model(build_graph(small_transformer), int(small_transformer.peak_bytes * 0.4), MilpOptions())
    assert len(model.cap_rows) > 3
    bound, values = relaxation_module.Relaxation(model, 60).result()
    assert bound == pytest.approx(_lp_without_left_out_rows(model), rel=1e-9)
    for con in constraints_of(model.prob):
        if con.name in set(model.cap_rows):
            activity = sum(coef * values[var.index] for var, coef in con.items())
            assert activity >= con.getLb() - 1e-6 * max(1.0, abs(con.getLb()))


def test_a_relaxation_out_of_time_between_rounds_is_still_a_bound(small_transformer, monkeypatch):
    """Time up after its first round (one cap row of many): the result is that round's optimum, below the
    full LP's (which the rounds after it reach: the test above)."""
    import regen.planner.milp.relaxation as relaxation_module

    monkeypatch.setattr(relaxation_module, "INITIAL_CAP_ROWS", 1)
    model = Model(build_graph(small_transformer), int(small_transformer.peak_bytes * 0.4), MilpOptions())
    monkeypatch.setattr(relaxation_module.Relaxation, "_out_of_time", lambda self: True)
    bound, values = relaxation_module.Relaxation(model, 60).result()
    assert len(values) == len(model.prob.variables())
    assert bound < _lp_without_left_out_rows(model) * (1 - 1e-6)


def test_a_small_graphs_lp_bound_solves_with_every_cap_row_at_once(small_transformer, monkeypatch):
    """lp_bound (the small graphs' neighbourhood) has every cap row from the start: its one solve is the full
    LP's optimum, where the relaxation that adds them when broken, stopped after its first round, is below."""
    import regen.planner.milp.relaxation as relaxation_module

    monkeypatch.setattr(relaxation_module, "INITIAL_CAP_ROWS", 1)
    monkeypatch.setattr(relaxation_module.Relaxation, "_out_of_time", lambda self: True)
    model = Model(build_graph(small_transformer), int(small_transformer.peak_bytes * 0.4), MilpOptions())
    assert relaxation_module.lp_bound(model, 60)[0] == pytest.approx(_lp_without_left_out_rows(model), rel=1e-9)


def test_large_graphs_are_solved_by_blocks_against_the_lp_bound(small_transformer, monkeypatch):
    """The large-graph path (forced here on a small graph): a plan within the cap, no better than the
    exact optimum, and a gap measured against a bound that is below that optimum."""
    import importlib

    from regen.planner import solve

    search_module = importlib.import_module("regen.planner.milp.search")
    monkeypatch.setattr(search_module, "BLOCK_IMPROVE_MIN_CANDIDATES", 10)
    monkeypatch.setattr(search_module, "SWAP_BLOCK_IMPROVE_MIN_CANDIDATES", 10)
    monkeypatch.setattr(importlib.import_module("regen.planner.milp.blocks"), "SWEEP_PROGRESS_INTERVAL_S", 0.0)
    messages = []
    graph = build_graph(small_transformer)
    cap = int(small_transformer.peak_bytes * 0.5)
    plan = solve(small_transformer, cap, "hybrid", time_limit_s=20, progress=messages.append)
    assert any(m.startswith("LP relaxation: bound") for m in messages)
    assert any(m.startswith("block improvement:") and " ms" in m for m in messages)
    # the sweeps say where they are: blocks done, the plan's step time, the bound once it is in
    sweeps = [m for m in messages if m.strip().startswith("sweep 1:")]
    assert sweeps and all(" of " in m and " blocks, plan " in m for m in sweeps)
    exact = solve_model(Model(graph, cap, MilpOptions()), 60, rel_gap=1e-6)
    assert plan.solver.bound_s <= exact.objective_s * (1 + 1e-9) <= plan.solver.objective_s * (1 + 1e-6)
    assert plan.solver.gap == pytest.approx(1 - plan.solver.bound_s / plan.solver.objective_s, abs=1e-9)
    assert (plan.solver.status == "optimal") == (plan.solver.gap <= DEFAULT_REL_GAP)
    assert plan.simulated.peak_bytes <= cap



def test_swaps_take_the_block_search_from_fewer_candidates_than_recompute_only():
    """91 decidable candidates: the hybrid MILP (copy-channel rows) goes to the block sweeps, the
    recompute-only MILP stays with branch and bound; both plans fit."""
    from regen.graphs.synthetic import transformer_profile
    from regen.planner import solve
    from regen.planner.milp.search import (BLOCK_IMPROVE_MIN_CANDIDATES, SWAP_BLOCK_IMPROVE_MIN_CANDIDATES,
                                           decidable_count)

    profile = transformer_profile(n_layers=6, batch=4, seq=256, d_model=256, n_head=4, copy_bytes_per_s=20e9)
    assert SWAP_BLOCK_IMPROVE_MIN_CANDIDATES < decidable_count(build_graph(profile)) <= BLOCK_IMPROVE_MIN_CANDIDATES
    cap = int(profile.peak_bytes * 0.5)
    for strategy, by_blocks in (("hybrid", True), ("recompute", False)):
        messages = []
        plan = solve(profile, cap, strategy, time_limit_s=8, progress=messages.append)
        assert any(m.startswith("block improvement:") for m in messages) == by_blocks, strategy
        assert plan.simulated.peak_bytes <= cap
def test_rebuilt_with_options_share_recompute_work(small_transformer):
    """Recompute-only on a transformer: letting a tensor that another recipe rebuilds on the way be
    kept until its own use never costs more, is used, and the simulator (which charges no recipe run
    for such a tensor but holds it from the other recipe's rebuild on) agrees with the MILP."""
    graph = build_graph(small_transformer)
    cap = int(small_transformer.peak_bytes * 0.6)
    plain = solve_model(Model(graph, cap, MilpOptions(allow_swap=False, allow_rebuilt_with=False)), 60, rel_gap=1e-6)
    shared = solve_model(Model(graph, cap, MilpOptions(allow_swap=False)), 60, rel_gap=1e-6)
    assert shared.objective_s <= plain.objective_s * (1 + 1e-9)
    rebuilt = {i: ch for i, ch in shared.choices.items() if ch.rebuilt_with is not None}
    assert rebuilt and shared.objective_s < plain.objective_s
    for i, ch in rebuilt.items():
        other = shared.choices[ch.rebuilt_with]
        assert other.rebuilt_with is None and graph.candidates[i].producer in other.recipe.ops
        assert graph.candidates[ch.rebuilt_with].first_backward <= graph.candidates[i].first_backward
    sim = simulate(graph, shared.choices)
    assert sim.valid and sim.peak_bytes <= cap
    assert sim.step_time_s == pytest.approx(shared.objective_s, rel=0.05)
    # a rebuilt tensor whose other recipe is not chosen is an inconsistent plan for the simulator
    i, ch = next(iter(rebuilt.items()))
    broken = dict(shared.choices)
    broken.pop(ch.rebuilt_with)
    assert not simulate(graph, broken).valid


def test_large_graphs_without_time_for_the_full_milp_keep_the_block_plan(small_transformer, monkeypatch):
    """When the LP gives no bound and too little time is left for the full MILP (whose presolve alone
    takes seconds on thousands of candidates), the block search's plan is the result, unjudged."""
    import importlib

    from regen.planner import solve

    search = importlib.import_module("regen.planner.milp.search")
    blocks = importlib.import_module("regen.planner.milp.blocks")
    relaxation = importlib.import_module("regen.planner.milp.relaxation")
    monkeypatch.setattr(search, "BLOCK_IMPROVE_MIN_CANDIDATES", 10)
    monkeypatch.setattr(search, "SWAP_BLOCK_IMPROVE_MIN_CANDIDATES", 10)
    monkeypatch.setattr(relaxation.Relaxation, "result", lambda self: None)
    monkeypatch.setattr(blocks, "FULL_SOLVE_MIN_TIME_FRACTION", 1.0)
    messages = []
    cap = int(small_transformer.peak_bytes * 0.5)
    plan = solve(small_transformer, cap, "hybrid", time_limit_s=20, progress=messages.append)
    assert any(m.startswith("block improvement:") for m in messages)
    assert not any(m.startswith("solver highs started") for m in messages)
    assert plan.solver.gap is None and plan.solver.status == "time_limit" and plan.solver.name == "highs"
    assert plan.simulated.peak_bytes <= cap


def test_a_relaxation_with_no_solution_says_the_milp_has_none(small_transformer):
    """An infeasible LP relaxation proves the MILP infeasible (it relaxes it): reported as such, not as an LP that
    ran out of time."""
    from regen.planner.milp.relaxation import Relaxation

    model = Model(build_graph(small_transformer), int(small_transformer.peak_bytes * 0.5), MilpOptions())
    feasible = Relaxation(model, 30)
    assert feasible.result() is not None and not feasible.infeasible() and feasible.unfinished_s() == 0
    swap = next(v.swap for v in model.vars.values() if v.swap is not None)
    model.prob += swap >= 2, "impossible"  # a binary at 2
    infeasible = Relaxation(model, 30)
    assert infeasible.result() is None and infeasible.infeasible() and infeasible.unfinished_s() == 0


def test_large_graphs_whose_relaxation_has_no_solution_take_the_warm_start_at_once(small_transformer,
                                                                                   monkeypatch):
    """No MILP plan exists when the LP relaxation has none: the warm start is the plan, and no full MILP is
    started to look for one."""
    import importlib

    from regen.planner import solve

    search = importlib.import_module("regen.planner.milp.search")
    relaxation = importlib.import_module("regen.planner.milp.relaxation")
    monkeypatch.setattr(search, "BLOCK_IMPROVE_MIN_CANDIDATES", 10)
    monkeypatch.setattr(search, "SWAP_BLOCK_IMPROVE_MIN_CANDIDATES", 10)
    monkeypatch.setattr(relaxation.Relaxation, "result", lambda self: None)
    monkeypatch.setattr(relaxation.Relaxation, "infeasible", lambda self: True)
    messages = []
    cap = int(small_transformer.peak_bytes * 0.5)
    plan = solve(small_transformer, cap, "hybrid", time_limit_s=20, progress=messages.append)
    assert any(m.startswith("LP relaxation: infeasible") for m in messages)
    assert not any(m.startswith("solver highs started") for m in messages)
    assert plan.solver.name == "heuristic" and any(search.MILP_ROWS_INFEASIBLE in n for n in plan.notes)
    assert plan.simulated.peak_bytes <= cap


def test_the_full_milp_gets_no_less_time_than_an_unfinished_lp_ran():
    """It solves that LP first: with less time left than the LP ran without finishing, it would find nothing."""
    import time

    from regen.planner.milp.blocks import FULL_SOLVE_MIN_TIME_FRACTION, time_for_full_solve

    deadline = time.perf_counter() + 10
    assert FULL_SOLVE_MIN_TIME_FRACTION * 20 < 9
    assert time_for_full_solve(deadline, 20) and time_for_full_solve(deadline, 20, lp_unfinished_s=5)
    assert not time_for_full_solve(deadline, 20, lp_unfinished_s=11)


def test_the_relaxation_on_its_own_thread_gives_the_synchronous_bound(small_transformer):
    """The LP relaxation solved on a background thread (as the large-graph search runs it, alongside
    the sweeps) ends with the same bound as solved in the caller's thread, and says when it is done."""
    from regen.planner.milp.highs import new_highs, to_highs_lp
    from regen.planner.milp.relaxation import Relaxation

    graph = build_graph(small_transformer)
    model = Model(graph, int(small_transformer.peak_bytes * 0.5), MilpOptions())
    lp = to_highs_lp(model.prob, model.prob.variables())
    relaxation = Relaxation(model, 30, lp)
    bound, values = relaxation.result()
    assert relaxation.done() and len(values) == len(model.prob.variables())
    assert lp.integrality_, "the caller's model keeps its integrality"
    lp.integrality_ = []
    h = new_highs(time_limit_s=30)
    h.passModel(lp)
    h.run()
    assert bound == pytest.approx(h.getInfo().objective_function_value, rel=1e-9)


def test_recompute_only_warm_starts_share_work_no_worse_than_without(small_transformer):
    from regen.planner.milp.search import recompute_only_milp_plans

    graph = build_graph(small_transformer)
    cap = int(small_transformer.peak_bytes * 0.6)
    plans = dict(recompute_only_milp_plans(graph, cap, 20))
    assert set(plans) == {"recompute-only MILP without sharing", "recompute-only MILP"}
    plain, shared = (simulate(graph, plans[k]) for k in ("recompute-only MILP without sharing", "recompute-only MILP"))
    assert plain.fits(cap) and shared.fits(cap)
    assert shared.step_time_s <= plain.step_time_s * (1 + 1e-6)
    assert any(ch.rebuilt_with is not None for ch in plans["recompute-only MILP"].values())


def test_recompute_only_warm_starts_out_of_time_keep_the_greedy_plan_they_start_from(small_transformer, monkeypatch):
    """Under a short time limit (or beside the LP relaxation's thread on 2 cores) the recompute-only MILP can stop
    before a plan of its own (the 32-layer Llama's at 2.5 s); started from the greedy recompute-only plan, it has
    that one at least, and the hybrid search's warm start can take it. The first solve may use the whole share."""
    from regen.errors import SolverError
    from regen.planner import heuristics
    from regen.planner.milp import search

    starts, limits = [], []

    def out_of_time_unless_started(model, time_limit_s, warm_start=None, **kwargs):
        starts.append(warm_start)
        limits.append(time_limit_s)
        if warm_start is None:
            raise SolverError("the solver (highs) stopped after 1.0 s without a feasible plan (time limit 1 s)")
        return solve_model(model, 0.05, warm_start=warm_start)  # HiGHS has the start at least

    monkeypatch.setattr(search, "solve_model", out_of_time_unless_started)
    graph = build_graph(small_transformer)
    cap = int(small_transformer.peak_bytes * 0.7)
    assert search.recompute_only_milp_plans(graph, cap, 2) == []
    greedy = heuristics.greedy(graph, cap, False, True)
    assert greedy is not None
    starts.clear()
    warm = search.warm_start(graph, cap, True, True, 2, lambda _m: None)
    assert starts and starts[0] == greedy  # the MILP without sharing starts from the greedy plan ...
    limits.clear()
    share_s = 20  # the fake solves return at once: a share the model builds cannot eat up on a loaded machine
    plans = dict(search.recompute_only_milp_plans(graph, cap, share_s, greedy))
    assert set(plans) == {"recompute-only MILP without sharing", "recompute-only MILP"}  # ... and has a plan
    # the first may take the whole share (halves left both on their start on a 32-layer Llama), the second the rest
    assert limits[0] > share_s / 2 and search.MIN_WARM_MILP_S <= limits[1] < limits[0]
    assert all(simulate(graph, plan).fits(cap) for plan in plans.values())
    assert warm is not None


def test_a_feasibility_start_that_timed_out_is_tried_again_with_the_time_left(monkeypatch):
    """On a loaded machine the first try (a quarter of the time) can end without a plan; the objective's
    search would then take far longer to its first plan, so the feasibility search gets the time left."""
    from regen.planner import solve
    from regen.planner.milp import search
    from regen.planner.milp.feasibility import feasible_solution

    calls = []

    def first_try_times_out(model, time_limit_s, lp=None):
        calls.append(time_limit_s)
        return None if len(calls) == 1 else feasible_solution(model, time_limit_s, lp=lp)

    monkeypatch.setattr(search, "feasible_solution", first_try_times_out)
    profile = transformer_profile(n_layers=3)
    cap = int(profile.peak_bytes * 0.5)  # no greedy plan fits here (the test below)
    plan = solve(profile, cap, "hybrid", time_limit_s=60, rel_gap=0.5)
    assert len(calls) == 2 and calls[1] > 2 * calls[0]  # the second try had the time left, not a quarter of it
    assert plan.simulated.peak_bytes <= cap


def test_without_a_heuristic_plan_the_solver_starts_from_any_feasible_one():
    """Every greedy plan and the recompute-only MILP fail at this cap; HiGHS with the step-time objective
    found no plan in 10 s (16.7 s to its first). With the objective dropped it finds one in about a
    second, and the solve goes on from it."""
    from regen.planner import solve
    from regen.planner.milp.feasibility import feasible_values
    from regen.planner.milp.search import warm_start

    profile = transformer_profile(n_layers=3)
    cap = int(profile.peak_bytes * 0.5)
    graph = build_graph(profile)
    assert warm_start(graph, cap, True, True, 10, lambda _m: None) is None
    values = feasible_values(Model(graph, cap, MilpOptions()), 30)
    assert values and set(values.values()) <= {0.0, 1.0}
    model = Model(graph, cap, MilpOptions())  # given the model's HiGHS form, it solves that and gives it back
    lp = to_highs_lp(model.prob, model.prob.variables())
    cost, offset = lp.col_cost_.copy(), lp.offset_
    assert feasible_values(model, 30, lp=lp) == values
    assert (lp.col_cost_ == cost).all() and lp.offset_ == offset and cost.any()
    # a generous limit (on a loaded 2-core machine the first plan has taken 8 s, stopped at a 10 s limit) and a
    # wide gap: the solve stops soon after its first plan
    plan = solve(profile, cap, "hybrid", time_limit_s=60, rel_gap=0.5)
    assert plan.simulated.peak_bytes <= cap
    assert plan.predicted.step_time_s > plan.baseline.step_time_s
    under = Model(graph, int(profile.peak_bytes * 0.3), MilpOptions())  # builds, but no plan fits
    with pytest.raises(CapInfeasible):
        feasible_values(under, 30)


def test_when_the_solve_from_the_feasibility_start_runs_out_of_time_its_plan_stands(monkeypatch):
    """The feasibility start can take most of the time limit (on a loaded machine); the solve from its plan then
    has too little left to finish. Its plan, which the simulator passes, is the result, not a SolverError."""
    from regen.errors import SolverError
    from regen.planner import solve
    from regen.planner.milp import search

    def out_of_time(*args, **kwargs):
        raise SolverError("the solver (highs) stopped after 0.0 s without a feasible plan (time limit 0.001 s)")

    monkeypatch.setattr(search, "solve_model", out_of_time)
    profile = transformer_profile(n_layers=3)
    cap = int(profile.peak_bytes * 0.5)  # no greedy plan fits here (the test above)
    plan = solve(profile, cap, "hybrid", time_limit_s=60, rel_gap=0.5)
    assert plan.simulated.peak_bytes <= cap
    assert plan.action_counts()["swap"] + plan.action_counts()["recompute"] > 0
    assert plan.solver.name == "highs" and plan.solver.gap is None


def test_a_search_that_ends_without_any_plan_names_a_cap_that_has_one(monkeypatch):
    """No heuristic plan fits, the feasibility start finds none and the solve none in its time: the error says
    where a plan exists for certain (the greedy plans' least peak), not only "raise the cap"."""
    import re

    from regen.errors import SolverError
    from regen.planner import solve
    from regen.planner.milp import search

    def out_of_time(*args, **kwargs):
        raise SolverError("the solver (highs) stopped after 0.0 s without a feasible plan (time limit 0.001 s)")

    monkeypatch.setattr(search, "feasible_solution", lambda *args, **kwargs: None)
    monkeypatch.setattr(search, "solve_model", out_of_time)
    profile = transformer_profile(n_layers=3)
    cap = int(profile.peak_bytes * 0.5)  # no greedy plan fits here (the test above)
    with pytest.raises(SolverError, match="within the time limit of 20 s") as raised:
        solve(profile, cap, "hybrid", time_limit_s=20)
    named = int(re.search(r"a plan fits a cap of [^(]+\((\d+) bytes\)", str(raised.value)).group(1))
    assert cap < named < profile.peak_bytes
    plan = solve(profile, named, "hybrid", time_limit_s=20)  # the greedy plan, the solver still failing
    assert plan.simulated.peak_bytes <= named


def _over_the_cap_then_out_of_time(choices_of, rounds, over_cap_rounds=1):
    """A solve_model whose first `over_cap_rounds` rounds return the plan `choices_of(model)` (over the cap) and
    whose next round stops without a plan."""
    from regen.errors import SolverError
    from regen.planner.milp.solution import result_from_values

    def solve_model(model, *args, **kwargs):
        rounds.append(model)
        if len(rounds) <= over_cap_rounds:
            return result_from_values(model, choices_of(model), 0.0, None, DEFAULT_REL_GAP, 0.0)
        raise SolverError("the solver (highs) stopped after 0.0 s without a feasible plan (time limit 0.001 s)")

    return solve_model


@pytest.mark.parametrize("over_cap_rounds", [1, 1000], ids=["repair-round-out-of-time", "every-round-over-the-cap"])
def test_a_search_whose_rounds_end_without_a_plan_keeps_the_feasibility_starts_plan(monkeypatch, over_cap_rounds):
    """The first round's plan simulates over the cap (as the copy-outs' order can make it), and then a repair
    round's solve ends without a plan in the time left, or every round's plan is over the cap up to the last
    repair round: the feasibility start's plan, which the simulator passes, is the result, though it solved the
    first round's model, not a SolverError."""
    from regen.planner import solve
    from regen.planner.milp import search
    from regen.planner.result import Choice

    rounds = []
    keep_everything = lambda model: {c.index: Choice() for c in model.graph.candidates}  # noqa: E731
    monkeypatch.setattr(search, "warm_start", lambda *args, **kwargs: None)  # so the feasibility start runs
    monkeypatch.setattr(search, "solve_model", _over_the_cap_then_out_of_time(keep_everything, rounds,
                                                                               over_cap_rounds))
    profile = transformer_profile(n_layers=3)
    cap = int(profile.peak_bytes * 0.7)
    plan = solve(profile, cap, "hybrid", time_limit_s=30)
    assert len(rounds) == min(over_cap_rounds + 1, search.MAX_REPAIR_ROUNDS + 1)
    assert rounds[0] is not rounds[1]  # a repair round ran on a model of its own
    assert plan.simulated.peak_bytes <= cap
    assert plan.action_counts()["swap"] + plan.action_counts()["recompute"] > 0


def test_a_search_without_a_plan_names_the_least_peak_of_its_own_plans_over_the_cap(monkeypatch):
    """The solver's plan simulated over the cap, and the repair round and the feasibility start found none: the
    error names that plan's simulated peak, a cap it fits, where it is below the greedy plans' least."""
    import re

    from regen.errors import SolverError
    from regen.planner import solve
    from regen.planner.milp import search

    profile = transformer_profile(n_layers=3)
    graph = build_graph(profile)
    least = search.min_peak_plan(graph, False, True, 10)[0]  # recompute only, about 0.53 of the peak
    rounds = []
    monkeypatch.setattr(search, "warm_start", lambda *args, **kwargs: None)
    monkeypatch.setattr(search, "feasible_solution", lambda *args, **kwargs: None)
    monkeypatch.setattr(search, "solve_model", _over_the_cap_then_out_of_time(lambda model: least, rounds))
    cap = int(profile.peak_bytes * 0.5)
    with pytest.raises(SolverError, match="within the time limit of 20 s") as raised:
        solve(profile, cap, "hybrid", time_limit_s=20)
    named = int(re.search(r"a plan fits a cap of [^(]+\((\d+) bytes\)", str(raised.value)).group(1))
    assert len(rounds) == 2
    assert cap < named == simulate(graph, least).peak_bytes < search.greedy_least_peak(graph, True, True)[0]


def test_a_milp_plan_that_simulates_slower_than_the_warm_start_gives_way_to_it(small_transformer, monkeypatch):
    """The simulator judges time as it judges the peak (Note [ The faster of the MILP's plan and the warm start ]):
    a MILP plan under the cap but slower than the warm start, here a recompute plan solved for a lower cap, is
    replaced by the warm start, with a note saying why."""
    from regen.planner.milp import search

    graph = build_graph(small_transformer)
    cap = int(small_transformer.peak_bytes * 0.7)
    slow = solve_model(Model(graph, int(small_transformer.peak_bytes * 0.5), MilpOptions(allow_swap=False)), 30)
    assert simulate(graph, slow.choices).fits(cap)
    slow_sim = simulate(graph, slow.choices)
    monkeypatch.setattr(search, "_solve_and_repair", lambda *args, **kwargs: (slow, slow_sim, None))
    result = search.plan_with_milp(graph, cap, True, True, 30, 0.01, lambda m: None)
    slow_s = simulate(graph, slow.choices).step_time_s
    assert result.choices is not slow.choices
    assert simulate(graph, result.choices).step_time_s < slow_s
    assert simulate(graph, result.choices).fits(cap)
    assert any(n.startswith("the MILP's plan simulates slower than the warm start") for n in result.notes)
    assert result.report.status == "heuristic"


def test_the_block_plan_stands_when_the_full_milp_from_it_ends_worse():
    """HiGHS stops within the gap of its own bound, which can leave it above the block search's plan it started
    from: that plan is then the result, judged against the higher bound."""
    from regen.planner.milp.search import better_of
    from regen.planner.milp.solution import MilpResult

    block = MilpResult(choices={0: "block"}, objective_s=1.00, bound_s=0.98, gap=0.02, status="time_limit",
                       solve_time_s=5.0, predicted_peak_bytes=10)
    full = MilpResult(choices={0: "full"}, objective_s=1.01, bound_s=0.995, gap=0.0149, status="time_limit",
                      solve_time_s=9.0, predicted_peak_bytes=10)
    kept = better_of(block, full, rel_gap=0.01)
    assert kept.choices == {0: "block"} and kept.bound_s == 0.995 and kept.gap == pytest.approx(0.005)
    assert kept.status == "optimal" and kept.solve_time_s == 9.0
    better = MilpResult(choices={0: "full"}, objective_s=0.99, bound_s=0.985, gap=0.005, status="optimal",
                        solve_time_s=9.0, predicted_peak_bytes=10)
    assert better_of(block, better, rel_gap=0.01) is better


def test_the_feasibility_start_reads_the_models_integrality_once(monkeypatch):
    """Each read of a HighsLp vector copies the whole of it: read per column, picking the discrete values out of a
    feasible solution took 2.4 s on 2,080 columns (a PEFT prefix-tuning Llama's hybrid model), and the work grows
    with the square of the columns (a 3,000-candidate model has 118,000)."""
    import highspy

    from regen.planner.milp import feasibility

    reads = []

    class CountingLp(highspy.HighsLp):
        @property
        def integrality_(self):
            reads.append(1)
            return highspy.HighsLp.integrality_.fget(self)

        @integrality_.setter
        def integrality_(self, value):
            highspy.HighsLp.integrality_.fset(self, value)

    def counting_lp(prob, variables):
        lp = to_highs_lp(prob, variables)
        counted = CountingLp()
        for name in ("num_col_", "num_row_", "col_cost_", "col_lower_", "col_upper_", "row_lower_", "row_upper_",
                     "a_matrix_", "offset_", "sense_", "integrality_"):
            setattr(counted, name, getattr(lp, name))
        return counted

    monkeypatch.setattr(feasibility, "to_highs_lp", counting_lp)
    graph = build_graph(transformer_profile(n_layers=3))
    values = feasibility.feasible_values(Model(graph, int(graph.unplanned_peak_bytes * 0.9), MilpOptions()), 30)
    assert values and len(values) > 100
    assert len(reads) <= 2
