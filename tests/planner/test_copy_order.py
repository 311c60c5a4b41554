"""The runtime's copy-in order (regen.planner.copy_order): copy-ins delayed to the latest step the FIFO stream
allows never make compute wait longer than at the plan's own steps, and a copy-in that a recipe reads is in
before the recipe runs.

chain_profile(5, seed=1) as in test_simulator.py: candidate k is produced by op k and first read in backward by op
10-k; candidate 2's first recipe is op 2 alone, reading candidate 1.
"""

import functools
import itertools
import random

import pytest

from regen.formats.plan import ACTION_RECOMPUTE, ACTION_SWAP
from regen.graphs.synthetic import chain_profile, transformer_profile
from regen.planner.copy_order import CopyInDeadline, copy_in_deadlines, latest_copy_in_steps
from regen.planner.graph import build_graph
from regen.planner.result import Choice
from regen.planner.simulator import simulate


def _chain(copy_s_of_candidate_1: float):
    probe = build_graph(chain_profile(5, seed=1), 1e9, 1e9)
    bytes_per_s = probe.candidates[1].bytes / copy_s_of_candidate_1
    return build_graph(chain_profile(5, seed=1), bytes_per_s, bytes_per_s)


def test_a_tensor_a_recipe_reads_is_due_before_the_recipe_runs():
    graph = _chain(1e-3)
    c1, c2 = graph.candidates[1], graph.candidates[2]
    assert c2.recipes[0].inputs == [1] and c2.first_backward < c1.first_backward
    choices = {1: Choice(ACTION_SWAP, swap_in_step=c1.in_window[0]), 2: Choice(ACTION_RECOMPUTE, recipe=c2.recipes[0])}
    assert copy_in_deadlines(graph, choices) == {1: CopyInDeadline(c2.first_backward, by_recipe=True)}
    assert copy_in_deadlines(graph, {1: choices[1]}) == {1: CopyInDeadline(c1.first_backward)}


def test_a_copy_in_a_recipe_reads_is_delayed_only_as_far_as_the_recipe_allows():
    """Candidate 1's copy takes less than ops 6 and 7 together and more than op 7 alone, and candidate
    2's recipe, run before op 8, reads it: issued before op 6 it is in time, before op 7 the recipe would wait
    (the copy would only be done by the op after the recipe)."""
    copy_s = 0.8e-3
    graph = _chain(copy_s)
    assert sum(graph.time_s[6:8]) > copy_s > graph.time_s[7]
    c2 = graph.candidates[2]
    assert c2.recipes[0].time_s > copy_s - graph.time_s[7]  # the recipe's time would hide the rest: not allowed
    choices = {1: Choice(ACTION_SWAP, swap_in_step=6), 2: Choice(ACTION_RECOMPUTE, recipe=c2.recipes[0])}
    delayed = latest_copy_in_steps(graph, choices, {})
    assert delayed[1].swap_in_step == 6
    sim = simulate(graph, delayed)
    assert sim.valid and sim.parts.link_wait_s == pytest.approx(0, abs=1e-12)
    late = simulate(graph, {**choices, 1: Choice(ACTION_SWAP, swap_in_step=7)})
    assert late.parts.link_wait_s > 0


def test_delayed_copy_ins_never_make_compute_wait_longer():
    """Random plans on a small transformer (swaps started early in their copy-in windows, recipes reading swapped
    tensors), over links slow enough that copies queue: the delayed copy-ins simulate no slower than the plan's
    own, and on some faster (the stream then takes the copies in the order they are due)."""
    faster = 0
    for bytes_per_s, seed in itertools.product([2e8, 5e8, 2e9], range(150)):
        graph = _transformer(bytes_per_s)
        rng = random.Random(seed)
        choices = {}
        for c in graph.candidates:
            r = rng.random()
            if c.can_swap and r < 0.5:
                early = c.in_window[:max(1, len(c.in_window) // 3)]
                choices[c.index] = Choice(ACTION_SWAP, swap_in_step=graph.snap_copy_in(rng.choice(early)))
            elif c.can_recompute and r < 0.75 and all(
                    choices.get(a, Choice()).action != ACTION_RECOMPUTE for a in c.recipes[0].inputs):
                choices[c.index] = Choice(ACTION_RECOMPUTE, recipe=c.recipes[0])
        own = simulate(graph, choices)
        assert own.valid
        delayed = simulate(graph, latest_copy_in_steps(graph, choices, {}))
        assert delayed.valid and delayed.step_time_s <= own.step_time_s * (1 + 1e-12), (bytes_per_s, seed)
        faster += delayed.step_time_s < own.step_time_s * (1 - 1e-9)
    assert faster > 0


@functools.cache
def _transformer(bytes_per_s: float):
    return build_graph(transformer_profile(n_layers=3), bytes_per_s, bytes_per_s)
