"""STR's planner formulation (Zong et al., TPDS 2023), for comparison with regen's MILP.

As read from STR's public code, in seconds everywhere:
* stages t = 1..n, one per node of the (coarsened) graph; binaries R[t,i] (node i computed in stage
  t, R[t,t] = 1), S[t,i] (i's output resident entering t), P[t,i] / Q[t,i] (swap-out / swap-in of i
  starts at t);
* Checkmate's dependencies (an input is resident or computed in the same stage) and residency
  (resident entering t+1 only if resident entering t, computed in t, or swapped in by then);
* a swap started at t finishes at the first stage whose cumulative compute covers bytes/bandwidth;
  one transfer per direction at a time; a swap-in needs an earlier swap-out and reserves memory while
  in flight; a host copy can be swapped in several times;
* memory per stage <= budget; objective: recompute time only (swaps assumed hidden).
Simplification: memory is counted per stage (what is resident or computed in the stage), without
Checkmate's FREE variables for frees inside a stage. STR's model has no in-stage peak: a tensor can
leave right after its producer stage although later forward ops still read it, and a swap-out frees
memory as it starts. By default (`in_stage_peak`) regen adds both: a candidate counts while a stage's op
is inside its forward or backward use, and a swapped-out tensor counts until its copy-out finishes.

Graphs over STR_COARSEN_ABOVE nodes are coarsened by merging the lightest adjacent pair (same phase)
until STR_TARGET_NODES remain; above STR_MAX_OPS ops the formulation is refused. The solution is
mapped back to per-candidate actions (recompute with regen's recipe, swap at the stage's first op,
else keep) and judged by the simulator like every strategy.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import pulp

from regen.errors import InfeasibleCapError, RegenError, SolverError
from regen.formats.plan import ACTION_RECOMPUTE, ACTION_SWAP, SolverReport
from regen.planner.costs import copy_in_time_s, copy_out_time_s
from regen.planner.graph import PlanningGraph
from regen.planner.milp.highs import new_var, require_highspy, run_highs
from regen.planner.residency import inputs_kept, resident_whatever_action, unplanned_step_bytes
from regen.planner.result import Choice, StrategyResult
from regen.planner.simulator import simulate
from regen.units import format_duration

STR_COARSEN_ABOVE = 150
STR_TARGET_NODES = 80
STR_MAX_OPS = 20000
STR_REL_GAP = 1e-4


@dataclass
class _Node:
    ops: list[int]
    forward: bool
    time_s: float
    candidates: list[int] = field(default_factory=list)  # candidate indices produced here
    bytes: int = 0
    base_bytes: int = 0  # memory of everything but candidates, max over its ops


def coarsen(graph: PlanningGraph, target: int = STR_TARGET_NODES, above: int = STR_COARSEN_ABOVE) -> list[_Node]:
    """The graph's ops as STR's stages: above `above` ops, the lightest adjacent pair of one phase is
    merged until `target` stages remain."""
    n = graph.num_steps
    nodes = [_Node([s], s < graph.num_forward_ops, graph.time_s[s]) for s in range(n)]
    if len(nodes) > above:
        while len(nodes) > target:
            best, k_best = None, None
            for k in range(len(nodes) - 1):
                a, b = nodes[k], nodes[k + 1]
                if a.forward != b.forward:
                    continue
                w = a.time_s + b.time_s
                if best is None or w < best:
                    best, k_best = w, k
            if k_best is None:
                break
            a, b = nodes[k_best], nodes[k_best + 1]
            nodes[k_best:k_best + 2] = [_Node(a.ops + b.ops, a.forward, a.time_s + b.time_s)]
    node_of = {}
    for i, nd in enumerate(nodes):
        for s in nd.ops:
            node_of[s] = i
    live = [0] * (n + 1)
    for c in graph.candidates:
        if c.trivial or c.bytes <= 0:
            continue
        nodes[node_of[c.producer]].candidates.append(c.index)
        nodes[node_of[c.producer]].bytes += c.bytes
        live[c.producer] += c.bytes
        live[(c.last_backward if c.last_backward is not None else c.last_forward) + 1] -= c.bytes
    run, base = 0, []
    for s in range(n):
        run += live[s]
        base.append(unplanned_step_bytes(graph, s) - run)
    for nd in nodes:
        nd.base_bytes = max(base[s] for s in nd.ops)
    return nodes


def solve_str(graph: PlanningGraph, cap: int, time_limit_s: float, say: Callable[[str], None],
              in_stage_peak: bool = True, check_cap: bool = True) -> StrategyResult:
    """STR's plan under `cap` (predicted time: STR's objective; predicted peak: the simulator's).

    `in_stage_peak` adds what STR's published model leaves out (memory resident inside a stage whatever
    the plan, and swap-outs in flight); `check_cap=False` returns a plan even when the simulator puts it
    over the cap (for the comparison benchmark, which reports it)."""
    if graph.num_steps > STR_MAX_OPS:
        raise RegenError(f"strategy str: {graph.num_steps} ops is too big for STR's O(n^2) formulation "
                         f"(limit {STR_MAX_OPS}); use strategy='hybrid'")
    require_highspy()
    nodes = coarsen(graph)
    notes = [f"str: coarsened {graph.num_steps} ops to {len(nodes)} nodes"] if len(nodes) < graph.num_steps else []
    m = _StrModel(graph, nodes, cap, in_stage_peak)
    say(f"STR MILP over {len(nodes)} stages: {len(m.R) + len(m.S) + len(m.P) + len(m.Q)} binaries")
    run = run_highs(m.prob, time_limit_s, STR_REL_GAP)
    if not run.has_solution:
        if run.pulp_status == pulp.LpStatusInfeasible:
            raise InfeasibleCapError(f"strategy str: STR's formulation has no plan under the cap of {cap} bytes",
                                     smallest_feasible_cap_bytes=None)
        raise SolverError(f"strategy str: the solver stopped after {run.elapsed_s:.1f} s without a feasible plan")
    choices = _choices(graph, m)
    objective = pulp.value(m.prob.objective) or 0.0
    sim = simulate(graph, choices)
    say(f"STR solved in {run.elapsed_s:.2f} s: objective {format_duration(objective, graph.time_unit)} (recompute "
        f"time only, swaps assumed hidden); simulated {format_duration(sim.step_time_s, graph.time_unit)}, "
        f"peak {sim.peak_bytes}")
    if check_cap and sim.peak_bytes > cap:
        raise InfeasibleCapError(
            f"strategy str: STR's plan, mapped to regen's actions, peaks at {sim.peak_bytes} bytes in the simulator, "
            f"over the cap of {cap} (its stage-level model misses memory inside stages); use strategy='hybrid'",
            smallest_feasible_cap_bytes=sim.peak_bytes)
    report = SolverReport(name="highs", status="optimal" if run.solution_status == pulp.LpSolutionOptimal
                          else "time_limit", objective_s=objective, bound_s=None, gap=None,
                          solve_time_s=run.elapsed_s, time_limit_s=time_limit_s)
    return StrategyResult(choices=choices, report=report, predicted_step_time_s=objective,
                          predicted_peak_bytes=sim.peak_bytes, notes=notes)


class _StrModel:
    """STR's formulation over the stages `nodes` (see the module docstring)."""

    def __init__(self, graph: PlanningGraph, nodes: list[_Node], cap: int, in_stage_peak: bool):
        self.graph, self.nodes, self.cap, self.in_stage_peak = graph, nodes, cap, in_stage_peak
        self.n = n = len(nodes)
        self.cap_nodes = [i for i, nd in enumerate(nodes) if nd.forward and nd.bytes > 0]
        self.cumulative = [0.0]
        for nd in nodes:
            self.cumulative.append(self.cumulative[-1] + nd.time_s)
        self.prob = pulp.LpProblem("str", pulp.LpMinimize)
        self.R, self.S, self.P, self.Q = {}, {}, {}, {}
        for t in range(n):
            for i in range(t + 1):
                if i == t or nodes[i].forward:
                    self.R[t, i] = new_var(f"R_{t}_{i}", 0, 1, cat=pulp.LpBinary)
            for i in self.cap_nodes:
                if i < t:
                    self.S[t, i] = new_var(f"S_{t}_{i}", 0, 1, cat=pulp.LpBinary)
                    self.P[t, i] = new_var(f"P_{t}_{i}", 0, 1, cat=pulp.LpBinary)
                    self.Q[t, i] = new_var(f"Q_{t}_{i}", 0, 1, cat=pulp.LpBinary)
        self._dependencies()
        self._residency_and_channels()
        self._memory()
        R = self.R
        self.prob += pulp.lpSum(nodes[i].time_s * R[t, i] for (t, i) in R if i != t) + sum(nd.time_s for nd in nodes)

    def finish(self, t: int, seconds: float) -> int:
        """First stage (>= t) whose cumulative compute from t covers `seconds`."""
        u = t
        while u < self.n - 1 and self.cumulative[u + 1] - self.cumulative[t] < seconds:
            u += 1
        return u

    def _dependencies(self) -> None:
        """Checkmate's dependencies: computing j in stage t needs each input i computed in t or resident
        (forward nodes in their own stage read the forward pass's live tensors)."""
        nodes, R, S, prob = self.nodes, self.R, self.S, self.prob
        node_of = {s: i for i, nd in enumerate(nodes) for s in nd.ops}
        edges = set()
        for j, nd in enumerate(nodes):
            for q in nd.ops:
                for u in self.graph.op_graph.predecessors(q):
                    i = node_of[u]
                    if i != j:
                        edges.add((i, j))
        for t in range(self.n):
            prob += R[t, t] == 1, f"own_{t}"
            for (i, j) in edges:
                if (t, j) not in R or i > t or (j == t and nodes[j].forward) or not nodes[i].forward:
                    continue  # gradients (backward outputs) are base memory, available in order
                if j == t and i not in self.cap_nodes:
                    continue  # a backward node reads only saved tensors; these are kept whatever happens
                avail = [x for x in (R.get((t, i)), S.get((t, i))) if x is not None]
                prob += R[t, j] <= pulp.lpSum(avail), f"dep_{t}_{i}_{j}"

    def _residency_and_channels(self) -> None:
        """Resident entering t+1 only if resident entering t, computed in t, or swapped in by then; one
        transfer per direction at a time."""
        n, R, S, P, Q, prob, finish = self.n, self.R, self.S, self.P, self.Q, self.prob, self.finish
        xfer = {i: copy_in_time_s(self.graph, self.nodes[i].bytes) for i in self.cap_nodes}
        for i in self.cap_nodes:
            for t in range(i + 1, n):
                back_in = [Q[u, i] for u in range(i + 1, t) if (u, i) in Q and finish(u, xfer[i]) < t]
                prev = [x for x in (S.get((t - 1, i)), R.get((t - 1, i))) if x is not None]
                prob += S[t, i] <= pulp.lpSum(prev + back_in), f"res_{t}_{i}"
                prob += P[t, i] <= S[t, i], f"pout_{t}_{i}"
                prob += Q[t, i] <= pulp.lpSum(P[u, i] for u in range(i + 1, t) if finish(u, xfer[i]) < t), \
                    f"qin_{t}_{i}"
        for t in range(n):
            busy_out = [P[u, i] for i in self.cap_nodes for u in range(i + 1, t + 1)
                        if (u, i) in P and finish(u, xfer[i]) >= t]
            busy_in = [Q[u, i] for i in self.cap_nodes for u in range(i + 1, t + 1)
                       if (u, i) in Q and finish(u, xfer[i]) >= t]
            if len(busy_out) > 1:
                prob += pulp.lpSum(busy_out) <= 1, f"chan_out_{t}"
            if len(busy_in) > 1:
                prob += pulp.lpSum(busy_in) <= 1, f"chan_in_{t}"

    def _memory(self) -> None:
        """Memory per stage, with the in-stage peak: a candidate is resident whatever the plan while one
        of the stage's ops is inside its forward or backward use ([p, f] or [b, e]), and a swapped-out
        tensor holds its memory until its copy-out has finished."""
        g, nodes, cap, in_stage_peak = self.graph, self.nodes, self.cap, self.in_stage_peak
        xfer = {i: copy_in_time_s(g, nodes[i].bytes) for i in self.cap_nodes}
        xfer_out = {i: copy_out_time_s(g, nodes[i].bytes) for i in self.cap_nodes}
        for t in range(self.n):
            terms, forced_total = [], 0
            for i in self.cap_nodes:
                forced = sum(g.candidates[ci].bytes for ci in nodes[i].candidates
                             if any(resident_whatever_action(g.candidates[ci], s) for s in nodes[t].ops)) if in_stage_peak else 0
                free = nodes[i].bytes - forced
                forced_total += forced
                if (t, i) in self.S:
                    terms.append(free * self.S[t, i])
                if (t, i) in self.R:
                    terms.append(free * self.R[t, i])
                for u in range(i + 1, t + 1):
                    if (u, i) in self.Q and self.finish(u, xfer[i]) >= t:
                        terms.append(free * self.Q[u, i])
                    if in_stage_peak and u < t and (u, i) in self.P and self.finish(u, xfer_out[i]) >= t:
                        terms.append(free * self.P[u, i])
            if nodes[t].base_bytes > cap:
                raise InfeasibleCapError(f"strategy str: stage {t} needs {nodes[t].base_bytes} bytes outside the "
                                         f"candidates, over the cap {cap}", smallest_feasible_cap_bytes=None)
            if nodes[t].base_bytes + forced_total > cap:
                raise InfeasibleCapError(f"strategy str: stage {t} needs {nodes[t].base_bytes + forced_total} bytes "
                                         f"whatever the plan, over the cap {cap}", smallest_feasible_cap_bytes=None)
            if terms:
                self.prob += pulp.lpSum(terms) <= cap - nodes[t].base_bytes - forced_total, f"mem_{t}"


def _choices(graph: PlanningGraph, m: _StrModel) -> dict[int, Choice]:
    """STR's solution as regen's actions: recompute with regen's recipe, swap at the stage's first op,
    else keep."""
    nodes, n = m.nodes, m.n
    val = lambda x: (x.varValue or 0.0) > 0.5  # noqa: E731
    choices: dict[int, Choice] = {}
    for i in m.cap_nodes:
        recomputed_at = [t for t in range(i + 1, n) if (t, i) in m.R and val(m.R[t, i]) and not nodes[t].forward]
        swapped_at = [t for t in range(i + 1, n) if (t, i) in m.Q and val(m.Q[t, i])]
        for ci in nodes[i].candidates:
            c = graph.candidates[ci]
            if recomputed_at and c.can_recompute:
                recipe = next((r for r in c.recipes if inputs_kept(graph, r, c.first_backward, choices)), None)
                if recipe is not None:
                    choices[ci] = Choice(ACTION_RECOMPUTE, recipe=recipe)
                    continue
            if swapped_at and c.can_swap:
                first = min(swapped_at)
                step = min(max(nodes[first].ops[0], c.in_window[0]), c.first_backward - 1)
                choices[ci] = Choice(ACTION_SWAP, swap_in_step=step)
    # recipe inputs chosen before their dependents may have been dropped since: keep those dependents
    for ci, ch in list(choices.items()):
        if ch.action == ACTION_RECOMPUTE:
            if not inputs_kept(graph, ch.recipe, graph.candidates[ci].first_backward, choices):
                del choices[ci]
    return choices
