"""The MILP's LP relaxation: a valid lower bound on the step time, and where a plan differs from it.

The relaxation of a large model takes seconds to tens of seconds (3,000 candidates: about 20 s on one
core), so it can run on a thread of its own (`Relaxation`): HiGHS releases the GIL while it solves,
and the block search (regen.planner.milp.blocks) sweeps on the other core meanwhile.
"""

from __future__ import annotations

import threading

from regen.planner.milp.highs import new_highs, require_highspy, solver_output_to_stderr, to_highs_lp
from regen.planner.milp.model import Model
from regen.planner.milp.solution import warm_start_values
from regen.planner.result import Choice


class Relaxation:
    """The LP relaxation of `model`, solving on a background thread until `time_limit_s` at most.

    `lp`: the model as to_highs_lp built it, when the caller has it already. The model is handed to
    HiGHS before the thread starts, so the caller may go on using `lp` and the model's variables.
    """

    def __init__(self, model: Model, time_limit_s: float, lp=None):
        self._highspy = require_highspy()
        lp = lp if lp is not None else to_highs_lp(model.prob, model.prob.variables())
        integrality = lp.integrality_
        lp.integrality_ = []
        with solver_output_to_stderr():  # the first Highs() of a process prints a banner
            self._h = new_highs(time_limit_s=max(time_limit_s, 1e-3))
            self._h.passModel(lp)
        lp.integrality_ = integrality
        self._thread = threading.Thread(target=self._h.run, name="regen-lp-relaxation", daemon=True)
        self._thread.start()

    def done(self) -> bool:
        return not self._thread.is_alive()

    def result(self) -> tuple[float, list[float]] | None:
        """Wait for the solve; its optimum (model units) and solution by column, or None when it did not
        finish within its time limit."""
        self._thread.join()
        if self._h.getModelStatus() != self._highspy.HighsModelStatus.kOptimal:
            return None
        return self._h.getInfo().objective_function_value, list(self._h.getSolution().col_value)


def lp_bound(model: Model, time_limit_s: float, lp=None) -> tuple[float, list[float]] | None:
    """The LP relaxation's optimum (a valid lower bound on the MILP's objective, in model units) and its
    solution (by column), or None when the LP does not finish in time."""
    if time_limit_s <= 0:
        return None
    return Relaxation(model, time_limit_s, lp).result()


def lp_disagreement(model: Model, lp_values: list[float], plan: dict[int, Choice]) -> dict[int, float]:
    """Per candidate, how far the plan's action is from the LP relaxation's (L1 over the action
    variables, weighted by the candidate's bytes): where a better plan most likely differs."""
    warm = warm_start_values(model, plan)
    out = {}
    for i, v in model.vars.items():
        xs = v.actions()
        out[i] = v.c.bytes * sum(abs(lp_values[x.index] - warm.get(x.name, 0.0)) for x in xs)
    return out
