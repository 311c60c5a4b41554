"""Solving a built MILP (regen.planner.milp.model) on HiGHS and reading its solution back as a plan.

`solve_model` runs HiGHS with a time limit, a relative gap, a warm start and progress messages, and
returns a `MilpResult`. Reading back: each candidate's chosen action (`read_choices`), with its
copy-ins ordered for the runtime's FIFO stream (regen.planner.copy_order), the predicted peak, and the
values of the discrete variables for a given plan (`warm_start_values`, a warm start).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

import pulp

from regen.errors import SolverError
from regen.formats.plan import ACTION_RECOMPUTE, ACTION_SWAP
from regen.planner.copy_order import latest_copy_in_steps
from regen.planner.milp.highs import SOLVER_THREADS, run_highs, size_message, value_of
from regen.planner.milp.memory_rows import CapInfeasible
from regen.planner.milp.model import DEFAULT_REL_GAP, Model
from regen.planner.recipes import rebuilt_with_recipe
from regen.planner.region_candidates import region_transient_bytes
from regen.planner.residency import planned_peak_bytes
from regen.planner.result import Choice
from regen.units import format_duration

BINARY_THRESHOLD = 0.5


@dataclass
class MilpResult:
    choices: dict[int, Choice]
    objective_s: float  # predicted step time (sum of T_s)
    bound_s: float | None
    gap: float | None
    status: str  # optimal | time_limit
    solve_time_s: float
    predicted_peak_bytes: int
    min_cap_bytes: int | None = None  # minimize_peak: the cap found


def solve_model(model: Model, time_limit_s: float, rel_gap: float = DEFAULT_REL_GAP,
                warm_start: dict[int, Choice] | None = None,
                progress: Callable[[str], None] | None = None,
                warm_values: dict[str, float] | None = None) -> MilpResult:
    """Solve a built model; CapInfeasible when it has no solution, SolverError when it stops without a
    feasible plan.

    The warm start is a plan (`warm_start`) or the values of discrete variables by name (`warm_values`,
    e.g. from the block search), which take precedence."""
    if progress:
        progress(size_message(model.prob, variables=model.columns()))
    warm = warm_start_values(model, warm_start) if warm_start is not None else None
    if warm_values is not None:
        warm = dict(warm or {}, **warm_values)
    if progress:
        progress(f"solver highs started (time limit {time_limit_s:g} s, stops at a {100 * rel_gap:g}% gap, "
                 f"{SOLVER_THREADS} threads)")
    run = run_highs(model.prob, time_limit_s, rel_gap, warm_values=warm, progress=progress, variables=model.columns())
    if run.infeasible:
        raise CapInfeasible()
    if not run.has_solution:
        raise SolverError(f"the solver (highs) stopped after {run.elapsed_s:.1f} s without a feasible plan "
                          f"(time limit {time_limit_s:g} s); raise time_limit_s or the memory cap")
    objective = pulp.value(model.prob.objective) or 0.0
    tu = model.time_unit
    if model.options.minimize_peak:
        obj_s, bound_s = step_time_s(model), None
    else:
        obj_s = objective * tu
        bound_s = run.bound * tu if run.bound is not None and math.isfinite(run.bound) else None
    if progress:
        progress(f"solver done in {run.elapsed_s:.2f} s: {'optimal' if run.optimal else 'time limit'}, objective "
                 f"{format_duration(obj_s, model.graph.time_unit)} (profiled op times)"
                 + (f", gap {100 * run.gap:.2f}%" if run.gap is not None else ""))
    result = MilpResult(choices=read_choices(model), objective_s=obj_s, bound_s=bound_s, gap=run.gap,
                        status="optimal" if run.optimal else "time_limit", solve_time_s=run.elapsed_s,
                        predicted_peak_bytes=predicted_peak_bytes(model))
    if model.cap_var is not None:
        result.min_cap_bytes = int(math.ceil(value_of(model.cap_var) * model.mem_unit))
    return result


def result_from_values(model: Model, choices: dict[int, Choice], objective: float, bound: float | None,
                       rel_gap: float, solve_time_s: float) -> MilpResult:
    """A MilpResult for the solution already loaded into the model's variables (e.g. by the block
    search, which read `choices` from them), judged against `bound` (model units): "optimal" when
    within `rel_gap`."""
    gap = relative_gap(objective, bound)
    return MilpResult(choices=choices, objective_s=objective * model.time_unit,
                      bound_s=None if bound is None else bound * model.time_unit, gap=gap,
                      status="optimal" if gap is not None and gap <= rel_gap else "time_limit",
                      solve_time_s=solve_time_s, predicted_peak_bytes=predicted_peak_bytes(model))


def relative_gap(objective: float, bound: float | None) -> float | None:
    """How far `objective` is above `bound`, relative to it (any one unit); None without a bound or objective."""
    if bound is None or objective <= 0:
        return None
    return max(0.0, (objective - bound) / objective)


def read_choices(model: Model) -> dict[int, Choice]:
    """The plan of the solution in the model's variables, its copy-ins at the latest steps the
    runtime's FIFO stream allows."""
    out: dict[int, Choice] = {}
    for i, v in model.vars.items():
        for k, r in enumerate(v.rec):
            if (r.varValue or 0) > BINARY_THRESHOLD:
                out[i] = Choice(ACTION_RECOMPUTE, recipe=v.c.recipes[k])
        for ri, k, x in v.rebuilt_with:
            if (x.varValue or 0) > BINARY_THRESHOLD:
                out[i] = Choice(ACTION_RECOMPUTE, recipe=rebuilt_with_recipe(model.graph, v.c, ri, k),
                                rebuilt_with=ri)
        for ri, x in v.regions:
            if (x.varValue or 0) > BINARY_THRESHOLD:
                out[i] = Choice(ACTION_RECOMPUTE, region=ri)
        if v.swap is not None and (v.swap.varValue or 0) > BINARY_THRESHOLD:
            start = next(s for s in v.c.in_breaks if value_of(v.is_expr(s)) > BINARY_THRESHOLD)
            out[i] = Choice(ACTION_SWAP, swap_in_step=start)
    stall_s = {s: value_of(var) * model.time_unit for s, var in model.stall.items()}
    return latest_copy_in_steps(model.graph, out, stall_s)


def predicted_peak_bytes(model: Model) -> int:
    """The peak the model predicts for its solution (regen.planner.residency.planned_peak_bytes):
    unplanned memory minus the savings S, plus the transients of the recipes and regions chosen."""
    g = model.graph
    n = g.num_steps
    seg_of = [None] * n
    for s0, s1, var in model.segments:
        for s in range(s0, s1 + 1):
            seg_of[s] = var
    trans = [0.0] * n
    for v in model.vars.values():
        for k, r in enumerate(v.rec):
            if value_of(r) > BINARY_THRESHOLD:
                trans[v.c.first_backward] += v.c.recipes[k].transient_bytes
    for rv in model.regions.values():
        if value_of(rv.z) > BINARY_THRESHOLD:
            rebuilt = {t for t, x in rv.members.items() if value_of(x) > BINARY_THRESHOLD}
            trans[rv.region.replay_step] += region_transient_bytes(g, rv.region, rebuilt)
    gone = [(value_of(seg_of[s]) * model.mem_unit) if seg_of[s] is not None else 0.0 for s in range(n)]
    return planned_peak_bytes(g, gone, trans)


def step_time_s(model: Model) -> float:
    """The step time of the solution: compute, the recipes chosen, and the stalls."""
    total = model.graph.compute_time_s
    for v in model.vars.values():
        for k, r in enumerate(v.rec):
            total += value_of(r) * v.c.recipes[k].time_s
    total += sum(value_of(rv.z) * rv.region.time_s for rv in model.regions.values())
    total += sum(value_of(s) for s in model.stall.values()) * model.time_unit
    return total


def warm_start_values(model: Model, choices: dict[int, Choice]) -> dict[str, float]:
    """Values of the discrete variables for a plan (HiGHS completes the rest)."""
    values: dict[str, float] = {}
    for i, v in model.vars.items():
        ch = choices.get(i, Choice())
        for k, r in enumerate(v.rec):
            values[r.name] = 1.0 if (ch.action == ACTION_RECOMPUTE and ch.recipe is v.c.recipes[k]) else 0.0
        for ri, k, x in v.rebuilt_with:
            other = choices.get(ri, Choice())
            values[x.name] = 1.0 if (ch.rebuilt_with == ri and other.recipe is model.graph.candidates[ri].recipes[k]) \
                else 0.0
        for ri, x in v.regions:
            values[x.name] = 1.0 if ch.region == ri else 0.0
        if v.swap is not None:
            on = ch.action == ACTION_SWAP
            values[v.swap.name] = 1.0 if on else 0.0
            for x in v.od.values():
                values[x.name] = 0.0  # copy-out done only at the window's end (always feasible)
            for s, x in v.is_.items():
                values[x.name] = 1.0 if on and ch.swap_in_step is not None and s >= ch.swap_in_step else 0.0
    chosen = {ch.region for ch in choices.values() if ch.region is not None}
    for r, rv in model.regions.items():
        values[rv.z.name] = 1.0 if r in chosen else 0.0
    return values
