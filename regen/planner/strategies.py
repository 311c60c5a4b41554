"""The strategies of `regen solve`, one function each, every one returning a StrategyResult.

* `hybrid`: the MILP over keep / swap / recompute (regen.planner.milp.search);
* `recompute`, `swap`: the same MILP with one action switched off;
* `str`: STR's formulation (regen.planner.str_milp), for comparison;
* `keep-all`, `chen`, `checkpoint-blocks` (per-block checkpointing as region decisions), `offload-all`
  (every saved tensor of 1 MiB or more swapped): heuristics for comparison (regen.planner.heuristics); a
  heuristic plan over the cap is an InfeasibleCapError naming the strategy's own peak.
"""

from __future__ import annotations

from typing import Callable

from regen.errors import InfeasibleCapError, RegenError
from regen.formats.plan import SolverReport
from regen.planner import heuristics
from regen.planner.graph import PlanningGraph
from regen.planner.milp.search import plan_with_milp
from regen.planner.result import Choice, StrategyResult
from regen.planner.simulator import simulate
from regen.planner.str_milp import solve_str
from regen.units import format_bytes

Say = Callable[[str], None]


def hybrid(graph: PlanningGraph, cap: int, time_limit_s: float, rel_gap: float, say: Say) -> StrategyResult:
    return plan_with_milp(graph, cap, True, True, time_limit_s, rel_gap, say)


def recompute(graph: PlanningGraph, cap: int, time_limit_s: float, rel_gap: float, say: Say) -> StrategyResult:
    return plan_with_milp(graph, cap, False, True, time_limit_s, rel_gap, say)


def swap(graph: PlanningGraph, cap: int, time_limit_s: float, rel_gap: float, say: Say) -> StrategyResult:
    return plan_with_milp(graph, cap, True, False, time_limit_s, rel_gap, say)


def str_formulation(graph: PlanningGraph, cap: int, time_limit_s: float, rel_gap: float,
                    say: Say) -> StrategyResult:
    """STR's formulation; it stops at its own gap (str_milp.STR_REL_GAP), not at `rel_gap`."""
    return solve_str(graph, cap, time_limit_s, say)


def keep_all(graph: PlanningGraph, cap: int, time_limit_s: float, rel_gap: float, say: Say) -> StrategyResult:
    return _heuristic("keep-all", graph, {}, cap)


def chen(graph: PlanningGraph, cap: int, time_limit_s: float, rel_gap: float, say: Say) -> StrategyResult:
    return _heuristic("chen", graph, heuristics.chen(graph), cap)


def checkpoint_blocks(graph: PlanningGraph, cap: int, time_limit_s: float, rel_gap: float,
                      say: Say) -> StrategyResult:
    if not heuristics.block_regions(graph):
        stateful = next((c for c in graph.profile.module_calls if c.leaves_behind), None)
        why = (f"; module calls that leave state behind are never replayed, e.g. {stateful.module}: "
               f"{stateful.leaves_behind}" if stateful is not None else "")
        raise RegenError("strategy checkpoint-blocks: the profile has no repeated blocks whose calls can be "
                         "replayed (regen profile records module calls; a block's saved tensors must all be "
                         f"needed after its replay){why}")
    return _heuristic("checkpoint-blocks", graph, heuristics.checkpoint_blocks(graph), cap)


def offload_all(graph: PlanningGraph, cap: int, time_limit_s: float, rel_gap: float, say: Say) -> StrategyResult:
    return _heuristic("offload-all", graph, heuristics.offload_all(graph), cap)


MILP_STRATEGIES = ("hybrid", "recompute", "swap")
STRATEGIES: dict[str, Callable[[PlanningGraph, int, float, float, Say], StrategyResult]] = {
    "hybrid": hybrid, "recompute": recompute, "swap": swap, "str": str_formulation, "keep-all": keep_all,
    "chen": chen, "checkpoint-blocks": checkpoint_blocks, "offload-all": offload_all,
}


def _heuristic(name: str, graph: PlanningGraph, choices: dict[int, Choice], cap: int) -> StrategyResult:
    sim = simulate(graph, choices)
    if sim.peak_bytes > cap:
        raise InfeasibleCapError(
            f"strategy {name} reaches a peak of {format_bytes(sim.peak_bytes)}, over the cap of "
            f"{format_bytes(cap)}; use a cap of at least {format_bytes(sim.peak_bytes)} or strategy='hybrid'",
            smallest_feasible_cap_bytes=sim.peak_bytes)
    report = SolverReport(name="heuristic", status="heuristic", objective_s=sim.step_time_s, bound_s=None,
                          gap=None, solve_time_s=0.0)
    return StrategyResult(choices=choices, report=report, predicted_step_time_s=sim.step_time_s,
                          predicted_peak_bytes=sim.peak_bytes)
