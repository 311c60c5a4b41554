"""regen.planner: `regen solve` chooses keep, swap or recompute for every saved tensor under a memory cap.

It reads a `regen.formats.Profile` (from the profiler, or from regen.graphs) and returns a
`regen.formats.Plan`. The walk from `solve` to the Plan: solve (validate, dispatch, final check) ->
strategies (one function per strategy) -> milp.search (warm start, repair loop) -> milp.blocks /
milp.solution / milp.model / milp.highs (the MILP on HiGHS) -> copy_order (the runtime's copy-in
order) -> simulator (the judge of every plan) -> export (the Plan; candidate indices become
SavedTensor ids there only). Below them: graph (candidates, lifetimes, copy windows), recipes
(recompute recipes, rebuilt-with options), residency (the one memory model), result (Choice,
StrategyResult), heuristics (chen, the greedy warm start), str_milp (STR's formulation, for
comparison).
"""

from regen.planner.solve import solve, solve_within_reach
from regen.planner.strategies import STRATEGIES

__all__ = ["STRATEGIES", "solve", "solve_within_reach"]
