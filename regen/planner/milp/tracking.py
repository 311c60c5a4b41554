"""The MILP's charge for the runtime's dispatch mode (docs/milp.md "Objective").

With per-tensor recipes, a steady-state step keeps the runtime's dispatch mode on from its first
forward op to the last op a chosen recipe needs (its own ops and the producers of what they read:
PlanningGraph.last_tracked_op), and every op it sees costs `costs.dispatch_op_s` (measured on the
profiled workload: about 30 us per op on a CPU, a plan-wide cost that a region-only plan avoids). The
simulator charges the same (simulator._last_tracked_op).

With the distinct last-tracked ops of the recipe options L_1 < L_2 < ... and continuous u_i in [0, 1],
`u_1 >= u_2 >= ...`, `rec_{t,k} <= u_{i(t,k)}` (i(t,k): the option's L), the charge
`dispatch x (u_1 (L_1 + 1) + sum_{i>1} u_i (L_i - L_{i-1}))` is, at an integer solution, exactly
`dispatch x (L_max + 1)` for the last op L_max of the chosen recipes (minimisation pushes each u_i down
to the largest rec it bounds), with no binary of its own.
"""

from __future__ import annotations

from regen.planner.milp.highs import new_var


def add_dispatch_charge(model) -> list:
    """Objective terms (time units) for the dispatch mode; [] without a charge or recipes (model:
    milp.model.Model)."""
    g = model.graph
    dispatch_s = g.costs.dispatch_op_s
    if dispatch_s <= 0:
        return []
    last_op: dict[tuple[int, int], int] = {}  # (candidate, option) -> last forward op it tracks
    for i, v in model.vars.items():
        for k in range(len(v.rec)):
            last_op[(i, k)] = g.last_tracked_op(v.c.recipes[k])
    points = sorted(set(last_op.values()))
    if not points:
        return []
    u = {p: new_var(f"tracked_{p}", 0, 1) for p in points}
    for a, b in zip(points, points[1:]):
        model.prob += u[b] <= u[a], f"tracked_mono_{b}"
    for (i, k), p in last_op.items():
        model.prob += model.vars[i].rec[k] <= u[p], f"tracked_{i}_{k}"
    per_op = dispatch_s / model.time_unit
    widths = [points[0] + 1] + [b - a for a, b in zip(points, points[1:])]
    return [per_op * w * u[p] for p, w in zip(points, widths)]
