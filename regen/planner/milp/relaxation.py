"""The MILP's LP relaxation: a valid lower bound on the step time, and where a plan differs from it.

The relaxation of a large model takes seconds to tens of seconds (Note [ Rows the LP relaxation leaves
out ]), so it can run on a thread of its own (`Relaxation`): HiGHS releases the GIL while it solves,
and the block search (regen.planner.milp.blocks) sweeps on the other core meanwhile.

The LP leaves out two families of rows (`Model.rows_not_in_relaxation`): the host-memory rows
(regen.planner.milp.host_memory) and the copy-in start rows (`in_started`: nothing flows before a copy-in
starts). Without them it relaxes the MILP further, so its optimum is still a valid lower bound, and it
solves sooner (Note [ Rows the LP relaxation leaves out ]).
"""

# NOTE [ Rows the LP relaxation leaves out ]
# Rule: a row goes into Model.rows_not_in_relaxation when it costs the LP much time and lowers its bound
# by little. On 3,000 candidates (bench/solver_scaling.py) the LP without both families solves in 14 s,
# against 30 s with them:
# * the host-memory rows give the same bound unless the host cap binds, and their chain is most of the
#   LP's time (30 s with them, 18 s without);
# * the copy-in start rows lower the bound by 0.001% on 3,000 candidates (0.003% on 1,000), and cost
#   21 s against 14 s (3.6 s against 2.6 s on 1,000).

from __future__ import annotations

import threading

import numpy as np

from regen.planner.milp.highs import (constraints_of, new_highs, require_highspy, solver_output_to_stderr,
                                      to_highs_lp)
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
        names = set(model.rows_not_in_relaxation)
        left_out = np.array([i for i, con in enumerate(constraints_of(model.prob)) if con.name in names],
                            dtype=np.int32)
        if len(left_out):  # columns stay, so solution values keep the model's column indices
            self._h.deleteRows(len(left_out), left_out)
        self._thread = threading.Thread(target=self._h.run, name="regen-lp-relaxation", daemon=True)
        self._thread.start()

    @property
    def num_rows(self) -> int:
        """Rows of the LP being solved (the model's, less those it leaves out)."""
        return self._h.getNumRow()

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
