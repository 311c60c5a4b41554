"""The full MILP beside the block sweeps (regen.planner.milp.background, blocks._FullMilpBeside)."""

import pulp
import pytest

from regen.planner.graph import build_graph
from regen.planner.milp.highs import constraints_of, to_highs_lp
from regen.planner.milp.model import MilpOptions, Model
from regen.planner.milp.solution import solve_model, warm_start_values


@pytest.fixture(scope="module")
def solved(small_transformer):
    """(graph, cap, the recompute-only optimum, the hybrid optimum's objective in model units) at half the peak."""
    graph = build_graph(small_transformer)
    cap = int(small_transformer.peak_bytes * 0.5)
    recompute_only = solve_model(Model(graph, cap, MilpOptions(allow_swap=False)), 30, rel_gap=1e-6)
    model = Model(graph, cap, MilpOptions())
    exact = solve_model(model, 60, rel_gap=1e-6)
    return graph, cap, recompute_only, exact.objective_s / model.time_unit


def _start(model, recompute_only):
    """The model as HiGHS takes it, and the recompute-only plan's every column (a complete start)."""
    from regen.planner.milp import blocks

    lp = to_highs_lp(model.prob, model.prob.variables())
    search = blocks._new_search(model, recompute_only.choices, 1e-6, lp)
    blocks._solve_warm_plan(search, deadline=float("inf"))
    return lp, search


def test_the_background_milp_improves_on_its_start_and_bounds_the_optimum(solved):
    import numpy as np

    from regen.planner.milp.background import BackgroundMilp

    graph, cap, recompute_only, exact_obj = solved
    model = Model(graph, cap, MilpOptions())
    lp, search = _start(model, recompute_only)
    milp = BackgroundMilp(lp, search.solution, rel_gap=1e-6, time_limit_s=60)
    milp.wait(60)
    assert milp.done() and not milp.interrupted()  # it ended at its gap, not stopped by the wait
    found = milp.take_better(search.best_obj)
    assert found is not None  # the hybrid optimum is below the recompute-only start on this model
    objective, columns = found
    assert objective == pytest.approx(exact_obj, rel=1e-5)
    assert milp.take_better(objective) is None  # taken once, and never a plan no better than the one given
    assert milp.bound() <= exact_obj * (1 + 1e-6)
    # its columns are a plan of the whole model: every row holds
    for v in model.prob.variables():
        v.varValue = float(np.round(columns[v.index])) if v.cat == pulp.LpInteger else float(columns[v.index])
    assert all(con.valid(1e-6) for con in constraints_of(model.prob))


def test_a_stopped_background_milp_ends(solved):
    from regen.planner.milp.background import BackgroundMilp

    graph, cap, recompute_only, _ = solved
    model = Model(graph, cap, MilpOptions())
    lp, search = _start(model, recompute_only)
    milp = BackgroundMilp(lp, search.solution, rel_gap=0.0, time_limit_s=600)
    milp.stop()
    assert milp.done() and milp.interrupted()  # ended by the stop: a stop ignored ends optimal, or at 600 s


def test_sweeps_with_the_full_milp_beside_end_at_a_plan_of_the_whole_model(solved, monkeypatch):
    """Started after the first sweep whatever the gap, the full MILP trades plans with the sweeps: the result is a
    plan every row of the whole model holds at, no worse than the warm plan, and the guide's bound (raised by the
    MILP's dual bound once it ended) stays below the optimum."""
    from regen.planner.milp import blocks
    from regen.planner.milp.relaxation import lp_bound

    graph, cap, recompute_only, exact_obj = solved
    model = Model(graph, cap, MilpOptions())
    warm_obj = recompute_only.objective_s / model.time_unit
    guide = blocks.SweepGuide(rel_gap=1e-6, full_milp_beside=True)
    guide.raise_bound(lp_bound(model, 30)[0])
    monkeypatch.setattr(blocks, "FULL_MILP_BESIDE_GAPS", 0.0)
    monkeypatch.setattr(blocks, "MIN_FULL_MILP_BESIDE_S", 0.0)
    choices, _, objective = blocks.improve_by_blocks(model, recompute_only.choices, 30, block_candidates=10,
                                                     guide=guide, max_sweeps=1)
    assert guide.full_milp_ran
    assert all(con.valid(1e-6) for con in constraints_of(model.prob))
    assert objective <= warm_obj * (1 + 1e-9)
    assert guide.bound <= exact_obj * (1 + 1e-6)
    assert objective == pytest.approx(exact_obj, rel=1e-4)  # it waited for the MILP
    assert warm_start_values(model, choices)  # the plan reads back
