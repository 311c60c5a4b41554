"""regen.planner: `regen solve` chooses keep, swap or recompute for every saved tensor under a memory cap.

Modules: graph (candidates, lifetimes, windows, recipes), milp (regen's MILP on HiGHS), str_milp
(STR's formulation, for comparison), heuristics (keep-all, chen, greedy warm start), simulator (the
judge of every plan), solve (strategy dispatch, the Plan). It reads a `regen.formats.Profile` (from
the profiler, or from regen.graphs) and returns a `regen.formats.Plan`.
"""

from regen.planner.solve import STRATEGIES, solve

__all__ = ["STRATEGIES", "solve"]
