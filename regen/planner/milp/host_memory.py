"""The MILP's host memory constraint (docs/milp.md "Host memory"): the bytes swapped out at once, which
the runtime's host pool holds (pinned on CUDA), stay within `PlanningGraph.host_memory_cap_bytes`.

A swapped candidate t holds its host range from the op after which its copy-out is issued to its last
backward use e_t, where autograd frees the last handle on it and the runtime gives the range back
(regen.planner.export computes the plan's host pool the same way), so at every such issue point s:
`sum_{t: issue_after_t <= s <= e_t} m_t swap_t <= host cap`, m_t being t's host range (its
bytes rounded up as the runtime's pool hands them out: formats.plan_rules.host_range_bytes). When every
swappable candidate fits at once the constraint is left out.
"""

from __future__ import annotations

import heapq

import pulp

from regen.formats.plan_rules import host_range_bytes
from regen.planner.milp.highs import new_var
from regen.planner.residency import host_range_end


def add_host_memory_constraints(model) -> None:
    """Bound the swapped bytes alive at each copy-out issue point (model: milp.model.Model).

    The bytes alive form a running sum over the issue points, so they are a chain of continuous
    variables, `h_s = h_prev + (swaps that start holding host memory by s) - (those that stopped before
    s)`, with `h_s <= cap` where the candidates alive at s could exceed it: O(candidates) nonzeros,
    where one dense row per point would be O(candidates x points) (3,000 candidates: 1.8 million
    nonzeros, twice the rest of the LP)."""
    cap = model.graph.host_memory_cap_bytes
    swapped = sorted((v for v in model.vars.values() if v.swap is not None), key=lambda v: v.c.issue_after)
    if cap is None or sum(host_range_bytes(v.c.bytes) for v in swapped) <= cap:
        return
    mu = model.mem_unit
    ending: list[tuple[int, int, object]] = []  # (last backward use, candidate index, vars): a heap
    alive_bytes, k, previous = 0, 0, None
    for s in sorted({v.c.issue_after for v in swapped}):
        change = []
        while k < len(swapped) and swapped[k].c.issue_after <= s:
            v = swapped[k]
            alive_bytes += host_range_bytes(v.c.bytes)
            change.append((v.swap, host_range_bytes(v.c.bytes) / mu))
            heapq.heappush(ending, (host_range_end(v.c), v.c.index, v))
            k += 1
        while ending and ending[0][0] < s:
            v = heapq.heappop(ending)[2]
            alive_bytes -= host_range_bytes(v.c.bytes)
            change.append((v.swap, -host_range_bytes(v.c.bytes) / mu))
        h = new_var(f"host_bytes_{s}", low=0)
        if previous is not None:
            change.append((previous, 1.0))
        model.prob += h == pulp.LpAffineExpression(change), f"host_sum_{s}"
        model.rows_not_in_relaxation.append(f"host_sum_{s}")
        if alive_bytes > cap:
            model.prob += h <= cap / mu, f"host_{s}"
            model.rows_not_in_relaxation.append(f"host_{s}")
        previous = h

