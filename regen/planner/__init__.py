"""regen.planner: `regen solve` chooses keep, swap or recompute for every saved tensor under a memory cap.

It reads a `regen.formats.Profile` (from the profiler, or from regen.graphs) and returns a
`regen.formats.Plan`. The walk from `solve` to the Plan: solve (validate the SolveOptions of options.py,
settle the link in host_link, build the graph once, dispatch, final check) -> strategies (one function
per strategy) -> milp.search (warm start, repair loop) -> milp.blocks / milp.solution / milp.model /
milp.highs (the MILP on HiGHS) -> copy_order (the runtime's copy-in order) -> simulator (the judge of
every plan) -> export (the Plan, built once; candidate indices become SavedTensor ids there only).
Below them: graph (candidates, lifetimes, copy windows), costs (what every event costs: the one
answer), residency (the one memory model), recipes (recompute recipes, rebuilt-with options),
region_candidates (module calls a replay may rebuild), tracking_windows (where the runtime's dispatch
mode follows the forward), fsdp_reads (parameters FSDP gathers), result (Choice, StrategyResult),
heuristics (chen, the greedy warm start), str_milp (STR's formulation, for comparison).
"""

from regen.planner.options import SolveOptions
from regen.planner.solve import solve, solve_within_reach
from regen.planner.strategies import STRATEGIES

__all__ = ["STRATEGIES", "SolveOptions", "solve", "solve_within_reach"]
