"""The full MILP on the second core, beside the block sweeps: HiGHS's branch and bound from the sweeps' plan.

The block search (regen.planner.milp.blocks) sweeps on one core while the LP relaxation solves on the
other; once the relaxation has finished, that core is idle for the rest of the sweeps. `BackgroundMilp`
runs the whole MILP there, from the sweeps' best plan at that moment, until it is within the planner's gap
of its own bound, its time limit ends or the sweeps stop it:

* the sweeps offer each better plan they find (`offer`), which HiGHS takes as a user solution at its next
  chance (its incumbent and its pruning improve with the sweeps');
* each incumbent HiGHS finds is kept, and the sweeps take it when it beats theirs (`take_better`);
* its dual bound, when it ends, bounds the step time as the LP relaxation's does, and is at least as high.

Neither search waits for the other: what one finds the other uses at its next step. HiGHS answers no
callback until its presolve and root LP are done (about 6 s on a 32-layer Llama's hybrid model), so a stop
can wait that long; the block search starts this MILP only at a sweep's end, far from the bound
(docs/milp.md, "Large graphs", item 5, with the figures).
"""

from __future__ import annotations

import math
import threading

from regen.planner.milp.highs import new_highs, require_highspy, solver_output_to_stderr


class BackgroundMilp:
    """The MILP `lp` (as to_highs_lp built it) solving on a thread of its own from `start` (a value per column,
    a complete solution) to `rel_gap` or `time_limit_s`."""

    def __init__(self, lp, start, rel_gap: float, time_limit_s: float):
        import numpy as np

        self._lock = threading.Lock()
        self._best_obj, self._best = math.inf, None  # HiGHS's best incumbent, not yet taken
        self._offered = None  # a plan of the sweeps', not yet given to HiGHS
        self._stop = False
        with solver_output_to_stderr():
            self._h = new_highs(rel_gap=rel_gap, time_limit_s=max(1e-3, time_limit_s))
        self._h.passModel(lp)
        x = np.asarray(start, dtype=float)
        self._h.setSolution(len(x), np.arange(len(x), dtype=np.int32), x)
        self._h.cbMipImprovingSolution.subscribe(self._improving)
        self._h.cbMipUserSolution.subscribe(self._user_solution)
        for interruptible in (self._h.cbMipInterrupt, self._h.cbSimplexInterrupt, self._h.cbIpmInterrupt):
            interruptible.subscribe(self._interrupt)
        self._thread = threading.Thread(target=self._h.run, name="regen-full-milp", daemon=True)
        self._thread.start()

    # ---- HiGHS's callbacks (its thread) ----

    def _improving(self, event) -> None:
        import numpy as np

        objective = event.data_out.objective_function_value
        with self._lock:
            if objective < self._best_obj:
                self._best_obj, self._best = objective, np.array(event.data_out.mip_solution, dtype=float)

    def _user_solution(self, event) -> None:
        with self._lock:
            offered, self._offered = self._offered, None
        if offered is not None:
            event.data_in.setSolution(offered)

    def _interrupt(self, event) -> None:
        if self._stop:
            event.interrupt()

    # ---- the sweeps' side ----

    def offer(self, solution) -> None:
        """A better plan of the sweeps' (every column), for HiGHS to take at its next chance."""
        import numpy as np

        with self._lock:
            self._offered = np.array(solution, dtype=float)

    def take_better(self, objective: float):
        """HiGHS's best incumbent when it is better than `objective`: (its objective, every column), else None."""
        with self._lock:
            if self._best is None or not self._best_obj < objective - 1e-9:
                return None
            found, self._best = (self._best_obj, self._best), None
            return found

    def done(self) -> bool:
        return not self._thread.is_alive()

    def stop(self) -> None:
        self._stop = True
        self._thread.join()

    def wait(self, timeout_s: float) -> None:
        """Until it ends (at its gap or time limit), or `timeout_s`, then stopped."""
        self._thread.join(max(0.0, timeout_s))
        self.stop()

    def interrupted(self) -> bool:
        """It ended by a stop (not at its gap or time limit)."""
        return self.done() and self._h.getModelStatus() == require_highspy().HighsModelStatus.kInterrupt

    def bound(self) -> float | None:
        """Its dual bound once it has ended (a valid lower bound on the objective), else None."""
        if not self.done():
            return None
        value = self._h.getInfo().mip_dual_bound
        return value if math.isfinite(value) else None
