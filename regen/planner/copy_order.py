"""The runtime's copy-in order: where each swap's copy-in is issued on the host-to-device stream.

The MILP shares the host-to-device channel among the copies of a step; the runtime's stream runs them
one after another in issue order, and can only issue a copy-in right before an op that follows an
unpack (`PlanningGraph.copy_in_starts`); copy-ins issued at one point run in pack order (the runtime's
queue: regen.runtime.swap.queue). A copy-in is due before its tensor's first backward use, or before the
recipes of a step when one of them reads it (`copy_in_deadlines`). Three passes turn a plan's copy-ins
into that order, each returning new choices (the caller's are left as they are):
* `latest_copy_in_steps` (on the MILP's plans, as the solution is read back): going backwards from
  the last deadline, each copy-in gets the latest start that still finishes before it is due and
  before the copy-ins due after it (earliest deadline first), never earlier than the MILP chose;
* `order_copy_ins` (on every strategy's plan, before the final simulator check): each copy-in moves
  to the runtime trigger at or before its step (`snap_copy_ins`), then head-of-line blocking on the
  FIFO stream is repaired against the simulator (`unblock_copy_ins`).
"""

from __future__ import annotations

import bisect
import math
from dataclasses import dataclass, replace

from regen.formats.plan import ACTION_RECOMPUTE, ACTION_SWAP
from regen.planner.costs import copy_in_time_s
from regen.planner.graph import PlanningGraph
from regen.planner.residency import resident_without_plan
from regen.planner.result import Choice
from regen.planner.simulator import SimulationResult, simulate

MAX_UNBLOCK_TRIES = 400  # simulations the copy-in reordering may spend


@dataclass(frozen=True)
class CopyInDeadline:
    """Where a swapped tensor must be back on the device: before op `step`, or before the recipes run there
    when one of them reads it (`by_recipe`: the earlier of the two; the simulator waits there)."""

    step: int
    by_recipe: bool = False

    def sort_key(self) -> tuple[int, int]:
        return self.step, 0 if self.by_recipe else 1


def copy_in_deadlines(graph: PlanningGraph, choices: dict[int, Choice]) -> dict[int, CopyInDeadline]:
    """Swapped candidate index -> its copy-in's deadline: its first backward use, or earlier when a chosen
    recipe reads it."""
    need = {i: CopyInDeadline(graph.candidates[i].first_backward)
            for i, ch in choices.items() if ch.action == ACTION_SWAP}
    for i, ch in choices.items():
        if ch.action == ACTION_RECOMPUTE and ch.recipe is not None:
            at = CopyInDeadline(graph.candidates[i].first_backward, by_recipe=True)
            for a in ch.recipe.inputs:
                if a in need and not resident_without_plan(graph.candidates[a], at.step):
                    need[a] = min(need[a], at, key=CopyInDeadline.sort_key)
    return need


def latest_copy_in_steps(graph: PlanningGraph, choices: dict[int, Choice], stall_s: dict[int, float]
                         ) -> dict[int, Choice]:
    """`choices` with each swap's copy-in delayed to the latest step the FIFO stream allows.

    `stall_s`: exposed transfer time at each step, as the MILP predicts it. Going backwards from the last
    deadline (`copy_in_deadlines`), each copy-in gets the latest start that still ends before its deadline
    and before the start of the copy-in after it on the stream, and is issued at the last op that begins by
    then, but never before the step the plan chose (a later copy-in holds memory for less time, so the
    plan's memory bound still holds). When compute would wait less for the copies at the plan's own steps
    than at the delayed ones (a copy the plan starts late pushes the ones after it), the plan's steps stay.
    """
    g = graph
    swaps = [(g.candidates[i], ch) for i, ch in choices.items() if ch.action == ACTION_SWAP]
    out = dict(choices)
    if not swaps:
        return out
    clock = _StepClock.of(g, choices, stall_s)
    deadlines = copy_in_deadlines(g, choices)
    latest_end = math.inf
    # the stream runs them earliest deadline first; of two due together, the one the plan lets start later
    # goes last (the other can go before it; the reverse leaves the first one's copy waiting on the second)
    by_stream_order = sorted(swaps, key=lambda x: (deadlines[x[0].index].sort_key(), x[1].swap_in_step, x[0].index))
    for c, ch in reversed(by_stream_order):
        need = deadlines[c.index]
        start_time = min(clock.due_s(need), latest_end) - copy_in_time_s(g, c.bytes)
        latest_end = start_time
        step = bisect.bisect_right(clock.step_start_s, start_time + 1e-15) - 1
        step = g.snap_copy_in(min(step, need.step - 1))  # where the runtime can issue it
        out[c.index] = replace(ch, swap_in_step=max(ch.swap_in_step, step))
    if clock.stall_s(g, out, deadlines) > clock.stall_s(g, choices, deadlines) + 1e-12:
        return dict(choices)
    return out


@dataclass
class _StepClock:
    """When each step starts (copy-ins are issued there) and when its op starts (after the replays, recipes
    and stalls charged there), with no copy late: a tensor a recipe reads must be in by the first, one the
    op reads by the second."""

    step_start_s: list[float]
    op_start_s: list[float]

    @staticmethod
    def of(graph: PlanningGraph, choices: dict[int, Choice], stall_s: dict[int, float]) -> "_StepClock":
        rec_at = [0.0] * graph.num_steps
        for i, ch in choices.items():
            if ch.action == ACTION_RECOMPUTE and ch.recipe is not None:
                rec_at[graph.candidates[i].first_backward] += ch.recipe.time_s
        for r in {ch.region for ch in choices.values() if ch.region is not None}:
            rec_at[graph.regions[r].replay_step] += graph.regions[r].time_s
        step_start, op_start, now = [], [], 0.0
        for s in range(graph.num_steps):
            step_start.append(now)
            now += rec_at[s] + stall_s.get(s, 0.0)
            op_start.append(now)
            now += graph.time_s[s]
        return _StepClock(step_start, op_start)

    def due_s(self, need: CopyInDeadline) -> float:
        return (self.step_start_s if need.by_recipe else self.op_start_s)[need.step]

    def stall_s(self, graph: PlanningGraph, choices: dict[int, Choice],
                deadlines: dict[int, CopyInDeadline]) -> float:
        """How long compute waits for copy-ins issued at the choices' steps (in pack order at one step, as
        the runtime issues them), each wait delaying everything after it, as the simulator's timing pass
        runs the stream (without the copy-outs' releases)."""
        issued: dict[int, list[tuple[int, int]]] = {}
        due: dict[int, list[tuple[int, int]]] = {}
        for i, ch in choices.items():
            if ch.action == ACTION_SWAP:
                issued.setdefault(ch.swap_in_step, []).append((graph.candidates[i].first_pack_index, i))
                need = deadlines[i]
                due.setdefault(need.step, []).append((0 if need.by_recipe else 1, i))
        shift_s = free_s = 0.0
        done_s: dict[int, float] = {}
        for step in sorted(issued.keys() | due.keys()):
            for _, i in sorted(issued.get(step, ())):
                copy_s = copy_in_time_s(graph, graph.candidates[i].bytes)
                free_s = done_s[i] = max(free_s, self.step_start_s[step] + shift_s) + copy_s
            for _, i in sorted(due.get(step, ())):
                shift_s = max(shift_s, done_s[i] - self.due_s(deadlines[i]))
        return shift_s


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

    A large copy Y issued before a copy X that is needed sooner (`copy_in_deadlines`) can delay X. For
    each such pair, try issuing Y together with X (copy-ins issued together go in pack order), then Y at
    the next trigger after X (the stream then takes X first), or X together with Y (X resident a little
    earlier: kept only if the simulated peak stays within the cap), and keep a change when the simulated
    step time drops. A trial is simulated only when it shortens compute's waits for the stream on the plan's
    clock (`_StepClock.stall_s`; the simulator alone also sees the copy-outs' releases). The trials move
    copy-ins of its own copies of the swap choices.
    """
    choices = {i: (replace(ch) if ch.action == ACTION_SWAP else ch) for i, ch in choices.items()}
    best = simulate(graph, choices)
    swaps = [(i, ch) for i, ch in choices.items() if ch.action == ACTION_SWAP and ch.swap_in_step is not None]
    if len(swaps) < 2:
        return choices, best
    deadlines = copy_in_deadlines(graph, choices)
    clock = _StepClock.of(graph, choices, {})
    stall_s = clock.stall_s(graph, choices, deadlines)
    tries = 0

    def attempt(ch: Choice, step: int) -> bool:
        """Keep `step` if the stream's waits drop (the cheap check) and the simulated step time drops within
        the cap."""
        nonlocal best, tries, stall_s
        old = ch.swap_in_step
        ch.swap_in_step = step
        trial_stall_s = clock.stall_s(graph, choices, deadlines)
        if trial_stall_s < stall_s - 1e-12:
            tries += 1
            trial = simulate(graph, choices)
            if trial.fits(cap_bytes) and trial.step_time_s < best.step_time_s * (1 - 1e-9):
                best, stall_s = trial, trial_stall_s
                return True
        ch.swap_in_step = old
        return False

    for i, ch_y in sorted(swaps, key=lambda x: x[1].swap_in_step):
        need_y = deadlines[i]
        b_y = need_y.step
        blocked = sorted(((ch_x.swap_in_step, j, ch_x) for j, ch_x in swaps
                          if ch_y.swap_in_step < ch_x.swap_in_step < b_y
                          and deadlines[j].sort_key() < need_y.sort_key()), key=lambda x: (x[0], x[1]))
        for step, _, ch_x in blocked:
            if tries >= MAX_UNBLOCK_TRIES:
                return choices, best
            if not ch_y.swap_in_step < step < b_y:
                continue
            after = graph.next_copy_in_start(step)
            if not (attempt(ch_y, step) or (after < b_y and attempt(ch_y, after))):
                attempt(ch_x, ch_y.swap_in_step)
    return choices, best
