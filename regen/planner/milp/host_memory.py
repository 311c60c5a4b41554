"""The MILP's host memory constraint (docs/milp.md "Host memory"): the bytes swapped out at once, which
the runtime's host pool holds (pinned on CUDA), stay within `PlanningGraph.host_memory_cap_bytes`.

A swapped candidate t holds its host range from the op after which its copy-out is issued to its first
backward use (regen.planner.export computes the plan's host pool the same way), so at every such issue
point s: `sum_{t: issue_after_t <= s <= b_t} m_t swap_t <= host cap`. When every swappable candidate
fits at once the constraint is left out.
"""

from __future__ import annotations

import pulp


def add_host_memory_constraints(model) -> None:
    """Bound the swapped bytes alive at each copy-out issue point (model: milp.model.Model)."""
    cap = model.graph.host_memory_cap_bytes
    swapped = [v for v in model.vars.values() if v.swap is not None]
    if cap is None or sum(v.c.bytes for v in swapped) <= cap:
        return
    mu = model.mem_unit
    for s in sorted({v.c.issue_after for v in swapped}):
        alive = [(v.c.bytes / mu) * v.swap for v in swapped if v.c.issue_after <= s <= v.c.first_backward]
        if sum(v.c.bytes for v in swapped if v.c.issue_after <= s <= v.c.first_backward) > cap:
            model.prob += pulp.lpSum(alive) <= cap / mu, f"host_{s}"
