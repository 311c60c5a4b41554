"""regen.planner: `regen solve` chooses keep, swap or recompute for every saved tensor under a memory cap.

The walk from `solve` to the Plan: solve (validate, dispatch, final check) -> strategies (one function
per strategy) -> milp.search (warm start, repair loop) -> milp.blocks / milp.solution / milp.model /
milp.highs (the MILP on HiGHS) -> copy_order (the runtime's copy-in order) -> simulator (the judge of
every plan) -> export (the Plan; candidate indices become SavedTensor ids there only).
Below them: graph (candidates, lifetimes, copy windows), recipes (recompute recipes, rebuilt-with
options), residency (the one memory model), result (Choice, StrategyResult), heuristics (chen, the
greedy warm start), str_milp (STR's formulation, for comparison). Beside them: graph_json (node-link
JSON input), synthetic (profiles for tests and benchmarks), summary (`regen show PLAN`).
"""

from regen.planner.solve import load_solver_input, parse_memory_cap, solve
from regen.planner.strategies import STRATEGIES
from regen.planner.summary import plan_summary, plan_summary_json, plot_timeline

__all__ = ["STRATEGIES", "load_solver_input", "parse_memory_cap", "solve", "plan_summary", "plan_summary_json",
           "plot_timeline"]
