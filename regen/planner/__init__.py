"""regen.planner: `regen solve` chooses keep, swap or recompute for every saved tensor under a memory cap.

Modules: graph (candidates, lifetimes, windows, recipes), milp (regen's MILP on HiGHS), str_milp
(STR's formulation, for comparison), heuristics (keep-all, chen, greedy warm start), simulator (the
judge of every plan), solve (strategy dispatch, caps, the Plan), graph_json (node-link JSON input),
synthetic (profiles for tests and benchmarks), summary (`regen show PLAN`).
"""

from regen.planner.solve import STRATEGIES, load_solver_input, parse_memory_cap, solve
from regen.planner.summary import plan_summary, plan_summary_json, plot_timeline

__all__ = ["STRATEGIES", "load_solver_input", "parse_memory_cap", "solve", "plan_summary", "plan_summary_json",
           "plot_timeline"]
