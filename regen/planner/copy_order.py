"""The runtime's copy-in order: where each swap's copy-in is issued on the host-to-device stream.

The MILP shares the host-to-device channel among the copies of a step; the runtime's stream runs them
one after another in issue order, and can only issue a copy-in right before an op that follows an
unpack (`PlanningGraph.copy_in_starts`). Three passes turn a plan's copy-ins into that order, each
returning new choices (the caller's are left as they are):
* `latest_copy_in_steps` (on the MILP's plans, as the solution is read back): going backwards from
  the last deadline, each copy-in gets the latest start that still finishes before it is needed and
  before the copy-ins due after it (earliest deadline first), never earlier than the MILP chose;
* `order_copy_ins` (on every strategy's plan, before the final simulator check): each copy-in moves
  to the runtime trigger at or before its step (`snap_copy_ins`), then head-of-line blocking on the
  FIFO stream is repaired against the simulator (`unblock_copy_ins`).
"""

from __future__ import annotations

import bisect
import math
from dataclasses import replace

from regen.formats.plan import ACTION_RECOMPUTE, ACTION_SWAP
from regen.planner.costs import copy_in_time_s
from regen.planner.graph import PlanningGraph
from regen.planner.residency import resident_without_plan
from regen.planner.result import Choice
from regen.planner.simulator import SimulationResult, simulate

MAX_UNBLOCK_TRIES = 400  # simulations the copy-in reordering may spend


def latest_copy_in_steps(graph: PlanningGraph, choices: dict[int, Choice], stall_s: dict[int, float]
                         ) -> dict[int, Choice]:
    """`choices` with each swap's copy-in delayed to the latest step the FIFO stream allows.

    `stall_s`: exposed transfer time at each step, as the MILP predicts it. A copy-in is issued at the
    last op that begins by its latest start, but never before the step the plan chose (a later copy-in
    holds memory for less time, so the plan's memory bound still holds).
    """
    g = graph
    swaps = [(g.candidates[i], ch) for i, ch in choices.items() if ch.action == ACTION_SWAP]
    out = dict(choices)
    if not swaps:
        return out
    begin, now = [], 0.0
    rec_at = [0.0] * g.num_steps
    for ch_i, ch in choices.items():
        if ch.action == ACTION_RECOMPUTE and ch.recipe is not None:
            rec_at[g.candidates[ch_i].first_backward] += ch.recipe.time_s
    for r in {ch.region for ch in choices.values() if ch.region is not None}:
        rec_at[g.regions[r].replay_step] += g.regions[r].time_s
    for s in range(g.num_steps):
        now += rec_at[s] + stall_s.get(s, 0.0)
        begin.append(now)
        now += g.time_s[s]
    # a swapped tensor is needed at its first backward use, or earlier by a recipe that reads it
    need_at = {c.index: c.first_backward for c, _ in swaps}
    for ch_i, ch in choices.items():
        if ch.action == ACTION_RECOMPUTE and ch.recipe is not None:
            at = g.candidates[ch_i].first_backward
            for a in ch.recipe.inputs:
                if a in need_at and not resident_without_plan(g.candidates[a], at):
                    need_at[a] = min(need_at[a], at)
    latest_end = math.inf
    for c, ch in sorted(swaps, key=lambda x: (-need_at[x[0].index], -x[0].index)):
        end = min(begin[need_at[c.index]], latest_end)
        start_time = end - copy_in_time_s(g, c.bytes)
        latest_end = start_time
        step = bisect.bisect_right(begin, start_time + 1e-15) - 1
        step = g.snap_copy_in(min(step, need_at[c.index] - 1))  # where the runtime can issue it
        out[c.index] = replace(ch, swap_in_step=max(ch.swap_in_step, step))
    return out


def order_copy_ins(graph: PlanningGraph, choices: dict[int, Choice], cap_bytes: int
                   ) -> tuple[dict[int, Choice], SimulationResult]:
    """`choices` with every copy-in where the runtime issues it and head-of-line blocking repaired, and
    the simulation of them."""
    return unblock_copy_ins(graph, snap_copy_ins(graph, choices), cap_bytes)


def snap_copy_ins(graph: PlanningGraph, choices: dict[int, Choice]) -> dict[int, Choice]:
    """`choices` with copy-ins starting at the runtime trigger at or before their step (docs/internals.md)."""
    return {i: (replace(ch, swap_in_step=graph.snap_copy_in(ch.swap_in_step))
                if ch.action == ACTION_SWAP and ch.swap_in_step is not None else ch)
            for i, ch in choices.items()}


def unblock_copy_ins(graph: PlanningGraph, choices: dict[int, Choice], cap_bytes: int
                     ) -> tuple[dict[int, Choice], SimulationResult]:
    """`choices` with head-of-line blocking on the runtime's single host-to-device stream repaired, and
    their simulation.

    A large copy Y issued before a copy X that is needed sooner can delay X. For each such pair, try
    issuing Y together with X (the stream then takes X first), or X together with Y (X resident a
    little earlier: kept only if the simulated peak stays within the cap), and keep a change when the
    simulated step time drops. The trials move copy-ins of its own copies of the swap choices.
    """
    choices = {i: (replace(ch) if ch.action == ACTION_SWAP else ch) for i, ch in choices.items()}
    best = simulate(graph, choices)
    swaps = [(i, ch) for i, ch in choices.items() if ch.action == ACTION_SWAP and ch.swap_in_step is not None]
    if len(swaps) < 2:
        return choices, best
    tries = 0

    def attempt(ch: Choice, step: int) -> bool:
        nonlocal best, tries
        tries += 1
        old = ch.swap_in_step
        ch.swap_in_step = step
        trial = simulate(graph, choices)
        if trial.fits(cap_bytes) and trial.step_time_s < best.step_time_s * (1 - 1e-9):
            best = trial
            return True
        ch.swap_in_step = old
        return False

    for i, ch_y in sorted(swaps, key=lambda x: x[1].swap_in_step):
        b_y = graph.candidates[i].first_backward
        blocked = sorted(((ch_x.swap_in_step, j, ch_x) for j, ch_x in swaps
                          if ch_y.swap_in_step < ch_x.swap_in_step < b_y
                          and graph.candidates[j].first_backward < b_y), key=lambda x: (x[0], x[1]))
        for step, _, ch_x in blocked:
            if tries >= MAX_UNBLOCK_TRIES:
                return choices, best
            if ch_y.swap_in_step < step < b_y and not attempt(ch_y, step):
                attempt(ch_x, ch_y.swap_in_step)
    return choices, best
