"""The MILP's LP relaxation: a valid lower bound on the step time, and where a plan differs from it.

The relaxation of a large model takes seconds to tens of seconds, so it can run on a thread of its own
(`Relaxation`): HiGHS releases the GIL while it solves, and the block search (regen.planner.milp.blocks)
sweeps on the other core meanwhile.

The LP leaves out two families of rows (`Model.rows_not_in_relaxation`): the host-memory rows
(regen.planner.milp.host_memory) and the copy-in start rows (`in_started`: nothing flows before a copy-in
starts). Without them it relaxes the MILP further, so its optimum is still a valid lower bound, and it
solves sooner (Note [ Rows the LP relaxation leaves out ]). It adds the cap rows (`Model.cap_rows`) only
where its solution breaks them (Note [ Cap rows added when broken ]).
"""

# NOTE [ Rows the LP relaxation leaves out ]
# Rule: a row goes into Model.rows_not_in_relaxation when it costs the LP much time and lowers its bound
# by little. On 3,000 candidates (bench/solver_scaling.py) the LP without both families solves in 14 s,
# against 30 s with them:
# * the host-memory rows give the same bound unless the host cap binds, and their chain is most of the
#   LP's time (30 s with them, 18 s without);
# * the copy-in start rows lower the bound by 0.001% on 3,000 candidates (0.003% on 1,000), and cost
#   21 s against 14 s (3.6 s against 2.6 s on 1,000).

# NOTE [ Cap rows added when broken ]
# A cap row (the savings S at a segment at least what the cap asks there) binds at the LP's optimum only
# around the step's peak: on 3,000 candidates 4 of 4,210 are tight, and the LP solves in 3.7 s with the 20
# that ask the most against 13.5 s with all of them, to the same optimum. So:
# 1. the LP starts with the INITIAL_CAP_ROWS cap rows of the largest right-hand side;
# 2. after each solve the cap rows it left out are checked against its solution, and the
#    CAP_ROWS_PER_ROUND it breaks most are added; HiGHS solves again from its last basis;
# 3. when it breaks none, its solution satisfies every row of the full LP and no solution of the full LP
#    does better (the LP solved relaxes it): the full LP's optimum;
# 4. each round's optimum is a valid lower bound (it relaxes the full LP): when time runs out between rounds
#    the last one is the result.
# 5. A small graph's LP (milp/neighbourhood.py) solves with every cap row at once: it takes well under a
#    second there, and its solution, not only its optimum, steers the neighbourhood (which candidates it frees).
#    The LP with cap rows added reaches the same optimum at another vertex when there are several: on the
#    built-in GPT at R = 2 (tests/runtime/test_link.py) that freed 24 candidates instead of 23 and the hybrid
#    solve ended on its recompute-only warm start (179.9 against 178.5 ms simulated, with 7 swaps).

from __future__ import annotations

import threading

import numpy as np

from regen.planner.milp.highs import (constraints_of, new_highs, require_highspy, solver_output_to_stderr,
                                      to_highs_lp)
from regen.planner.milp.model import Model
from regen.planner.milp.solution import warm_start_values
from regen.planner.result import Choice

INITIAL_CAP_ROWS = 20
CAP_ROWS_PER_ROUND = 50
BROKEN_TOLERANCE = 1e-7  # of a row's bound (at least 1): HiGHS's primal feasibility tolerance


class _LeftOutRows:
    """Rows of the row-wise HighsLp `lp` kept apart: what a solution makes of each, and how far it breaks it."""

    def __init__(self, lp, rows: np.ndarray):
        a = lp.a_matrix_
        starts, index, value = (np.asarray(x) for x in (a.start_, a.index_, a.value_))
        self.rows = rows
        self.lower, self.upper = np.asarray(lp.row_lower_)[rows], np.asarray(lp.row_upper_)[rows]
        self.index = [index[starts[r]:starts[r + 1]] for r in rows]
        self.value = [value[starts[r]:starts[r + 1]] for r in rows]
        self._flat_index = np.concatenate(self.index) if len(rows) else np.zeros(0, dtype=np.int32)
        self._flat_value = np.concatenate(self.value) if len(rows) else np.zeros(0)
        self._row_of = np.repeat(np.arange(len(rows)), [len(i) for i in self.index])

    def breaks(self, col_values: np.ndarray) -> np.ndarray:
        """Per row, how far `col_values` is outside its bounds (0 inside, or within BROKEN_TOLERANCE)."""
        activity = np.bincount(self._row_of, weights=self._flat_value * col_values[self._flat_index],
                               minlength=len(self.rows))
        excess = np.maximum(self.lower - activity, activity - self.upper)
        scale = np.maximum(1.0, np.maximum(np.abs(np.where(np.isfinite(self.lower), self.lower, 0.0)),
                                           np.abs(np.where(np.isfinite(self.upper), self.upper, 0.0))))
        return np.where(excess > BROKEN_TOLERANCE * scale, excess, 0.0)


class Relaxation:
    """The LP relaxation of `model`, solving on a background thread until `time_limit_s` at most.

    `lp`: the model as to_highs_lp built it, when the caller has it already. The model is handed to
    HiGHS before the thread starts, so the caller may go on using `lp` and the model's variables.
    `every_cap_row`: solve with all the cap rows at once instead of adding them when broken (Note [ Cap rows
    added when broken ], 5).
    """

    def __init__(self, model: Model, time_limit_s: float, lp=None, every_cap_row: bool = False):
        self._highspy = require_highspy()
        lp = lp if lp is not None else to_highs_lp(model.prob, model.columns())
        integrality = lp.integrality_
        lp.integrality_ = []
        with solver_output_to_stderr():  # the first Highs() of a process prints a banner
            self._h = new_highs(time_limit_s=max(time_limit_s, 1e-3))
            self._h.passModel(lp)
        lp.integrality_ = integrality
        self._time_limit_s = max(time_limit_s, 1e-3)
        rows = constraints_of(model.prob)
        names, cap_names = set(model.rows_not_in_relaxation), set(model.cap_rows)
        cap_rows = np.array([] if every_cap_row else [i for i, con in enumerate(rows) if con.name in cap_names],
                            dtype=np.int64)
        first = cap_rows[np.argsort(-np.asarray(lp.row_lower_)[cap_rows], kind="stable")[:INITIAL_CAP_ROWS]]
        later = np.setdiff1d(cap_rows, first)
        self._later = _LeftOutRows(lp, later)
        left_out = np.union1d(np.array([i for i, con in enumerate(rows) if con.name in names], dtype=np.int64),
                              later).astype(np.int32)
        if len(left_out):  # columns stay, so solution values keep the model's column indices
            self._h.deleteRows(len(left_out), left_out)
        self._added = np.zeros(len(later), dtype=bool)
        self._solved: tuple[float, list[float]] | None = None
        self._infeasible = False
        self._thread = threading.Thread(target=self._solve, name="regen-lp-relaxation", daemon=True)
        self._thread.start()

    def _solve(self) -> None:
        """Rounds of solve, check and add (Note [ Cap rows added when broken ])."""
        h, later = self._h, self._later
        while True:
            # HiGHS's time limit is on its run time summed over runs
            h.setOptionValue("time_limit", max(self._time_limit_s, h.getRunTime() + 1e-3))
            h.run()
            status = h.getModelStatus()
            if status != self._highspy.HighsModelStatus.kOptimal:
                self._infeasible = status == self._highspy.HighsModelStatus.kInfeasible
                return
            values = np.asarray(h.getSolution().col_value)
            self._solved = (h.getInfo().objective_function_value, values.tolist())
            excess = later.breaks(values)
            excess[self._added] = 0.0
            broken = np.flatnonzero(excess)
            if not len(broken) or self._out_of_time():
                return
            for k in broken[np.argsort(-excess[broken], kind="stable")[:CAP_ROWS_PER_ROUND]]:
                h.addRow(later.lower[k], later.upper[k], len(later.index[k]), later.index[k].astype(np.int32),
                         later.value[k])
                self._added[k] = True

    def _out_of_time(self) -> bool:
        return self._h.getRunTime() >= self._time_limit_s

    def done(self) -> bool:
        return not self._thread.is_alive()

    def unfinished_s(self) -> float:
        """Once done: how long HiGHS ran without finishing a round (0 when one finished or proved infeasibility)."""
        return 0.0 if self._solved is not None or self._infeasible else self._h.getRunTime()

    def infeasible(self) -> bool:
        """Once done: the LP has no solution, so neither has the MILP (the LP relaxes it)."""
        return self._infeasible

    def result(self) -> tuple[float, list[float]] | None:
        """Wait for the solve; its optimum (model units) and solution by column, or None when no round finished
        within its time limit (Note [ Cap rows added when broken ], 4)."""
        self._thread.join()
        return self._solved


def lp_bound(model: Model, time_limit_s: float, lp=None) -> tuple[float, list[float]] | None:
    """The LP relaxation's optimum (a valid lower bound on the MILP's objective, in model units) and its
    solution (by column), or None when the LP does not finish in time; solved at once with every cap row (Note
    [ Cap rows added when broken ], 5)."""
    if time_limit_s <= 0:
        return None
    return Relaxation(model, time_limit_s, lp, every_cap_row=True).result()


def lp_disagreement(model: Model, lp_values: list[float], plan: dict[int, Choice]) -> dict[int, float]:
    """Per candidate, how far the plan's action is from the LP relaxation's (L1 over the action
    variables, weighted by the candidate's bytes): where a better plan most likely differs."""
    warm = warm_start_values(model, plan)
    out = {}
    for i, v in model.vars.items():
        xs = v.actions()
        out[i] = v.c.bytes * sum(abs(lp_values[x.index] - warm.get(x.name, 0.0)) for x in xs)
    return out
