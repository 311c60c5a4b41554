"""A small graph's start for the full MILP: the relaxation-induced neighbourhood of the warm plan.

HiGHS on the full model of a small graph (up to a few hundred candidates) has a bound within the gap
right after its root LP, but finds a plan that close only through its own sub-MIP heuristics, after
the root cut rounds and a long tree search. Solving the LP relaxation and then the MILP with every
candidate on which the warm plan and the LP solution agree fixed to the warm plan's action leaves a few
dozen candidates free; that sub-MIP solves far sooner, and the full MILP started from its plan usually
stops at its root (docs/milp.md; Note [ Why a neighbourhood first ]).
"""

# NOTE [ Why a neighbourhood first ]
# 107 candidates at a 50% cap: HiGHS alone needed about 20 s of tree search to come within the gap; the
# neighbourhood's sub-MIP solved in a second or two and the full MILP then stopped at its root.

from __future__ import annotations

from dataclasses import replace
from typing import Callable

import pulp

from regen.errors import SolverError
from regen.planner.milp.blocks import MIN_SOLVER_TIME_S
from regen.planner.milp.relaxation import lp_bound, lp_disagreement
from regen.planner.milp.memory_rows import CapInfeasible
from regen.planner.milp.model import Model
from regen.planner.milp.solution import solve_model
from regen.planner.result import Choice
from regen.units import format_duration

NEIGHBOURHOOD_TIME_FRACTION = 0.2  # of the time limit, for each of the LP and the sub-MIP
# the sub-MIP's stopping gap (on its own bound), as a fraction of the planner's gap: HiGHS finds the
# neighbourhood's best plans early (its RINS heuristic at the root) and spends the rest proving the bound
NEIGHBOURHOOD_GAP_FRACTION = 0.5


def improve_where_lp_disagrees(model: Model, warm: dict[int, Choice], time_limit_s: float,
                               say: Callable[[str], None]) -> tuple[dict[int, Choice], dict[str, float] | None]:
    """The sub-MIP's plan and its discrete values (a warm start for the full model), or the warm plan
    and None when the LP or the sub-MIP gives nothing."""
    share_s = max(MIN_SOLVER_TIME_S, NEIGHBOURHOOD_TIME_FRACTION * time_limit_s)
    relaxation = lp_bound(model, share_s)
    if relaxation is None:
        return warm, None
    priority = lp_disagreement(model, relaxation[1], warm)
    fixed = {i: warm.get(i, Choice()).action for i, p in priority.items() if p <= 0}
    if len(fixed) == len(priority):
        return warm, None
    sub = Model(model.graph, model.cap_bytes, replace(model.options, fixed_actions=fixed))
    try:
        result = solve_model(sub, share_s, rel_gap=NEIGHBOURHOOD_GAP_FRACTION * model.options.rel_gap,
                             warm_start=warm)
    except (SolverError, CapInfeasible):
        return warm, None
    say(f"LP neighbourhood: {len(priority) - len(fixed)} candidates free, objective "
        f"{format_duration(result.objective_s, model.graph.time_unit)} (profiled op times)")
    values = {v.name: float(round(v.varValue or 0.0)) for v in sub.columns() if v.cat == pulp.LpInteger}
    return result.choices, values
