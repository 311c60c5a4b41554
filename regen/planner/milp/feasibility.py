"""A first feasible solution of the MILP when no heuristic plan fits under the cap.

With its step-time objective, HiGHS can search a long time before its first feasible plan. With the
objective dropped, any feasible plan is optimal, and HiGHS finds one far sooner; its discrete values
then warm-start the real solve (regen.planner.milp.search; Note [ Feasibility first ]), and its plan is the
result when that solve runs out of time without a better one.
"""

# NOTE [ Feasibility first ]
# On a 3-layer synthetic transformer at 50% of its peak (47 candidates, where every greedy plan and the
# recompute-only MILP fail), HiGHS with the step-time objective takes 16.7 s to its first feasible plan,
# and 0.9 s without the objective.

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from regen.planner.milp.highs import new_highs, require_highspy, solver_output_to_stderr, to_highs_lp
from regen.planner.milp.memory_rows import CapInfeasible
from regen.planner.milp.model import Model

FEASIBILITY_TIME_FRACTION = 0.25  # of the time left, at most, for the first try
# a second try when the first found none takes all the time left but this fraction of it (for the solve
# from its plan and the final check)
FEASIBILITY_RESERVE_FRACTION = 0.1


@dataclass
class FeasibleSolution:
    """A solution of `model` found with its objective dropped."""

    model: Model
    discrete: dict[str, float]  # the discrete variables' values, by name: the real solve's warm start
    columns: list[float]  # every variable's value, in `model.columns()` order

    def load(self) -> None:
        """Set the model's variables to this solution (to read its plan back when no better one comes)."""
        for var, value in zip(self.model.columns(), self.columns):
            var.varValue = value


def feasible_solution(model: Model, time_limit_s: float, lp=None) -> FeasibleSolution | None:
    """Some solution of `model`, or None when HiGHS finds none within `time_limit_s`; CapInfeasible when it proves
    there is none. `lp`: the model as to_highs_lp built it, when the caller has it (left as it is: the objective
    is dropped in HiGHS's copy)."""
    highspy = require_highspy()
    variables = model.columns()
    lp = lp if lp is not None else to_highs_lp(model.prob, variables)
    h = new_highs(time_limit_s=max(time_limit_s, 1e-3))
    with solver_output_to_stderr():
        h.passModel(lp)
        h.changeColsCost(lp.num_col_, np.arange(lp.num_col_, dtype=np.int32), np.zeros(lp.num_col_))
        h.changeObjectiveOffset(0.0)
        h.run()
    if h.getModelStatus() == highspy.HighsModelStatus.kInfeasible:
        raise CapInfeasible()
    if h.getInfo().primal_solution_status != 2:  # no feasible solution
        return None
    values = list(h.getSolution().col_value)
    integer = highspy.HighsVarType.kInteger
    # read once: each read of a HighsLp vector copies all of it (per column, 2.4 s on 2,080 columns)
    integrality = lp.integrality_
    discrete = {v.name: float(round(values[j])) for j, v in enumerate(variables) if integrality[j] == integer}
    return FeasibleSolution(model=model, discrete=discrete, columns=values)


def feasible_values(model: Model, time_limit_s: float, lp=None) -> dict[str, float] | None:
    """The values of the discrete variables of `feasible_solution` (by name), or None when there is none."""
    solution = feasible_solution(model, time_limit_s, lp)
    return None if solution is None else solution.discrete
