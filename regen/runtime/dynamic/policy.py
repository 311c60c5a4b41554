"""Eviction scores of dynamic mode: the resident node with the lowest score is dropped first.

Both are of the DTR family, `cost / (bytes x staleness)`, where staleness is the step's clock (forward
ops, then unpacks) since the node was last read, and costs are the forward op times measured with
`time.perf_counter` around each op (on CUDA that is the launch time, a proxy for the kernel's):

* `"dtr"`: DTR's plain score: the cost of the node's own recipe.
* `"graph"` (default): the cost sees the tensor graph. Rebuilding the node also rebuilds the dropped
  nodes its recipe reads, transitively (their recipe costs are added), and every dropped saved node
  whose recipe reads it, directly or through other dropped nodes, pays that rebuild again: the cost is
  multiplied by one plus their number. A node that many dropped recipes depend on is expensive to drop.

A node whose bytes are on the host (dynamic swaps, swaps.py) costs the time to copy it back instead of
its recipe's, with nothing upstream.

The graph walks stop after `WALK_LIMIT` nodes, so a score costs a bounded time on any graph, and the
victim search (`lowest`) walks only the candidates whose DTR score, a lower bound of their graph score, is
below the best graph score found so far.
"""

from __future__ import annotations

from typing import Callable, Iterator

from regen.runtime.dynamic.nodes import TensorNode

POLICIES = ("graph", "dtr")
WALK_LIMIT = 256
_MIN_COST_S = 1e-9  # an op too fast for the timer still costs something


def score(policy: str, node: TensorNode, nodes: dict, clock: int, swap_cost_s: float | None = None) -> float:
    """`swap_cost_s`: the time to copy the node back when its bytes are on the host (swaps.py): its cost
    then, with nothing upstream to rebuild."""
    staleness = max(1, clock - node.last_access)
    own_s = (node.cost_s if swap_cost_s is None else swap_cost_s) + _MIN_COST_S
    if policy == "graph":
        upstream_s = dropped_upstream_cost_s(node, nodes) if swap_cost_s is None else 0.0
        own_s = (1 + dropped_dependents(node, nodes)) * (own_s + upstream_s)
    return own_s / (max(1, node.nbytes) * staleness)


def dtr_score(node: TensorNode, clock: int, swap_cost_s: float | None = None) -> float:
    """DTR's plain score (`score("dtr", ...)`): never above the graph score, and needs none of its walks."""
    return score("dtr", node, {}, clock, swap_cost_s)


def lowest(policy: str, candidates: list[tuple[TensorNode, float | None]], nodes: dict,
           clock: int) -> TensorNode | None:
    """The candidate (node, swap cost or None) with the lowest score, the first of equal ones. The graph
    score is walked only for candidates whose DTR score (a lower bound of it) is below the best found."""
    if not candidates:
        return None
    bounds = [(dtr_score(node, clock, cost), i) for i, (node, cost) in enumerate(candidates)]
    if policy != "graph":
        return candidates[min(bounds)[1]][0]
    bounds.sort()
    best, best_i = None, None
    for bound, i in bounds:
        if best is not None and bound > best:
            break
        node, cost = candidates[i]
        s = score(policy, node, nodes, clock, cost)
        if best is None or s < best or (s == best and i < best_i):
            best, best_i = s, i
    return candidates[best_i][0]


def dropped_upstream_cost_s(node: TensorNode, nodes: dict) -> float:
    """Recipe cost of the non-resident nodes that rebuilding `node` would rebuild first (transitively)."""
    return sum(m.cost_s for m in _non_resident_reach(node.inputs, nodes, lambda m: m.inputs))


def dropped_dependents(node: TensorNode, nodes: dict) -> int:
    """Dropped saved nodes (autograd still awaits them) whose rebuild reads `node`, directly or through
    other non-resident nodes."""
    return sum(1 for m in _non_resident_reach(node.dependents, nodes, lambda m: m.dependents) if m.live > 0)


def _non_resident_reach(keys, nodes: dict, edges: Callable[[TensorNode], list]) -> Iterator[TensorNode]:
    """The non-resident nodes reached from `keys` along `edges` through non-resident nodes only (at most
    WALK_LIMIT nodes visited)."""
    seen = set()
    todo = list(keys)
    while todo and len(seen) < WALK_LIMIT:
        key = todo.pop()
        if key in seen:
            continue
        seen.add(key)
        m = nodes.get(key)
        if m is None or m.resident() is not None:
            continue
        yield m
        todo.extend(edges(m))
