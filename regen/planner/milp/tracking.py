"""The MILP's charge for the runtime's dispatch mode (docs/milp.md "Objective").

With per-tensor recipes, a steady-state step runs the forward ops of the chosen recipes' tracking
windows through the runtime's dispatch mode (regen.planner.tracking_windows: each op a recipe captures or reads,
from the latest module call that starts at or before it), and every such op costs `costs.dispatch_op_s`
(measured on the profiled workload: 10-30 us per op on a CPU). An op is charged once however many
recipes need it. The simulator charges the same (simulator.tracked_forward_ops).

The forward ops are grouped by the set of recipe options whose windows cover them; each group g gets a
continuous w_g in [0, 1] with `rec_{t,k} <= w_g` for each option (t, k) of its set, and the charge is
`dispatch x sum_g |g| w_g`: at an integer solution, exactly `dispatch` x the number of ops the chosen
recipes' windows cover (minimisation pushes each w_g down to the largest rec it bounds), with no binary
of its own.
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
    options_of: dict[int, list[tuple[int, int]]] = {}  # forward op -> the options whose windows cover it
    for i, v in model.vars.items():
        for k in range(len(v.rec)):
            for op in g.covered_ops(v.c.recipes[k]):
                options_of.setdefault(op, []).append((i, k))
    groups: dict[tuple, int] = {}  # the options covering an op -> how many ops they cover together
    for options in options_of.values():
        key = tuple(options)
        groups[key] = groups.get(key, 0) + 1
    per_op = dispatch_s / model.time_unit
    terms = []
    for n, (options, width) in enumerate(groups.items()):
        w = new_var(f"tracked_{n}", 0, 1)
        for i, k in options:
            model.prob += model.vars[i].rec[k] <= w, f"tracked_{n}_{i}_{k}"
        terms.append(per_op * width * w)
    return terms
