"""Dynamic mode's eviction scores (regen.runtime.dynamic.policy): the victim search skips graph walks by
DTR's score, a lower bound of the graph score, and still picks what scoring every candidate would."""

import random

import torch

from regen.runtime.dynamic.nodes import TensorNode
from regen.runtime.dynamic.policy import dtr_score, lowest, score


def _graph(n: int, rng: random.Random) -> dict:
    """A random DAG of `n` nodes: costs, sizes, ages, a third of them not resident."""
    nodes = {}
    for i in range(n):
        key = (i, 0)
        inputs = frozenset((j, 0) for j in rng.sample(range(i), min(i, rng.randint(0, 3))))
        out = torch.empty(rng.randint(1, 64))
        node = TensorNode(key, (i,), inputs, out, cost_s=rng.choice([1e-6, 1e-5, 1e-4, 1e-3]), evictable=True,
                          clock=rng.randint(0, 50))
        node.tensor = None if rng.random() < 0.35 else out
        node.ref = lambda: None
        node.live = rng.randint(0, 2)
        nodes[key] = node
        for k in inputs:
            nodes[k].dependents.append(key)
    return nodes


def test_the_pruned_search_picks_the_lowest_score_of_all():
    rng = random.Random(0)
    for trial in range(40):
        nodes = _graph(60, rng)
        clock = 60
        candidates = [(n, None if rng.random() < 0.8 else rng.choice([1e-5, 1e-3])) for n in nodes.values()
                      if n.tensor is not None]
        for policy in ("graph", "dtr"):
            scores = [score(policy, n, nodes, clock, c) for n, c in candidates]
            expected = candidates[scores.index(min(scores))][0]
            assert lowest(policy, candidates, nodes, clock) is expected, (trial, policy)
        assert all(dtr_score(n, clock, c) <= score("graph", n, nodes, clock, c) for n, c in candidates)
    assert lowest("graph", [], {}, 0) is None
