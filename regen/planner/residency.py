"""The planner's one memory model: what is resident at a step, and what memory a step holds.

Planned memory at step s is the unplanned memory of s (`unplanned_step_bytes`: the larger of the
peak inside the op and the memory after it) minus the bytes of the candidates not resident then,
plus recipe transients (docs/milp.md). A candidate is resident whatever its action inside its own
lifetime ([p, f] and [b, e]: `resident_without_plan`); a recipe input outside it is resident only
when the plan keeps it (or, in the simulator's timing, once its copy-in has finished).
Memory regen itself holds counts too (`capture_bytes`): the runtime captures every recipe op in forward
and keeps the capture until the step ends, with, on a CPU device, a copy of the RNG state for a random
op (`CPU_RNG_STATE_BYTES`; a CUDA device's RNG states are host tensors) and a copy of every buffer the op
writes (regen.runtime.recompute.Scratch); a random region's call keeps an RNG state the same way, and a
region's call holds its arguments until the replay (`held_argument_spans`: those no backward saves).
The simulator's memory pass is `planned_timelines` (with `gone_span`, the steps a choice frees), the
MILP's read-back of its peak is `planned_peak_bytes`, and `lower_bound_peak` bounds every plan; the
MILP's memory rows are the same accounting in linear form (regen.planner.milp.memory_rows, from
`unplanned_step_bytes` and `CandidateVars.nonresident`).
"""

from __future__ import annotations

import math
from collections.abc import Container, Iterable, Sequence
from typing import TYPE_CHECKING

from regen.formats.plan import ACTION_KEEP, ACTION_RECOMPUTE, ACTION_SWAP
from regen.formats.plan_rules import host_range_bytes
from regen.formats.profile import KIND_BUFFER, PHASE_FORWARD, Profile
from regen.opnames import writes_an_argument

if TYPE_CHECKING:
    from regen.planner.graph import Candidate, PlanningGraph
    from regen.planner.recipes import Recipe
    from regen.planner.result import Choice
    from regen.planner.region_candidates import Region

# torch.get_rng_state(): the CPU generator's state (a 624-word Mersenne Twister and its position), which the
# runtime copies for every random recipe op and random region call; on a CPU device it is device memory
CPU_RNG_STATE_BYTES = 5056


def unplanned_step_bytes(graph: PlanningGraph, step: int) -> int:
    """Memory of `step` with every candidate kept: the peak inside the op or the memory after it."""
    return max(graph.peak_bytes[step], graph.after_bytes[step])


def op_capture_bytes(profile: Profile) -> dict[int, int]:
    """Forward op -> the device bytes the runtime holds from capturing it for a recipe until the step
    ends (only ops that hold any): a CPU device's RNG state for a random op, and a copy of each buffer
    an op that writes its arguments reads (the running statistics batch norm updates)."""
    cpu = profile.device.type == "cpu"
    kinds = {t.id: (t.kind, t.storage, t.storage_bytes) for t in profile.tensors}
    out = {}
    for op in profile.ops:
        if op.phase != PHASE_FORWARD:
            break
        held = CPU_RNG_STATE_BYTES if op.is_random and cpu else 0
        if writes_an_argument(op.name, op.is_inplace):
            buffers = {kinds[x][1]: kinds[x][2] for x in op.inputs if kinds[x][0] == KIND_BUFFER}
            held += sum(buffers.values())
        if held:
            out[op.index] = held
    return out


def region_capture_bytes(graph: PlanningGraph, region: Region) -> int:
    """Device bytes the runtime holds from a region's call until the step ends: its RNG state."""
    return CPU_RNG_STATE_BYTES if region.is_random and graph.profile.device.type == "cpu" else 0


def held_argument_spans(graph: PlanningGraph, regions: Iterable[int]) -> dict[int, tuple[int, int, int]]:
    """Storage -> (bytes, first step, last step) over which the runtime holds a region argument that no
    backward saves past the unplanned step's hold: from the op after its last forward read until the latest
    replay, among `regions`, of a region that takes it (the replay step included: it runs there)."""
    spans: dict[int, tuple[int, int, int]] = {}
    for r in set(regions):
        region = graph.regions[r]
        for h in region.held:
            _, lo, hi = spans.get(h.storage, (0, h.first_held_step, -1))
            spans[h.storage] = (h.bytes, lo, max(hi, region.replay_step))
    return spans


def captured_bytes_timeline(graph: PlanningGraph, recipe_ops: Iterable[int], regions: Iterable[int]) -> list[int]:
    """Per step, the bytes the runtime holds for a plan's captures: each recipe op's (`op_capture_bytes`)
    from that op on, each region's from its call's first op on, and the regions' held arguments
    (`held_argument_spans`)."""
    diff = [0] * (graph.num_steps + 1)
    for q in set(recipe_ops):
        diff[q] += graph.capture_bytes.get(q, 0)
    regions = set(regions)
    for r in regions:
        region = graph.regions[r]
        diff[region.call.first_op] += region_capture_bytes(graph, region)
    for size, lo, hi in held_argument_spans(graph, regions).values():
        if hi >= lo:
            diff[lo] += size
            diff[hi + 1] -= size
    out, run = [], 0
    for s in range(graph.num_steps):
        run += diff[s]
        out.append(run)
    return out


def resident_whatever_action(c: Candidate, step: int) -> bool:
    """`c` is resident at `step` whatever its action: inside [p, f] or [b, e]."""
    if c.producer <= step <= c.last_forward:
        return True
    return c.first_backward is not None and c.first_backward <= step <= c.last_backward


def resident_without_plan(c: Candidate, step: int) -> bool:
    """`c` is resident at `step`, a step where a recipe runs, whatever its action: a trivial candidate
    over [p, e] (or [p, f] without a backward use), any other inside [b, e] (its forward span [p, f]
    is not counted: a recipe input must be resident when the recipe runs in backward)."""
    if c.trivial:
        return c.producer <= step <= (c.last_backward if c.last_backward is not None else c.last_forward)
    return c.first_backward <= step <= c.last_backward


def inputs_to_hold(graph: PlanningGraph, recipe: Recipe, step: int) -> list[int]:
    """The inputs of `recipe`, run before `step`, that the plan must keep (or bring back) for it."""
    return [a for a in recipe.inputs if not resident_without_plan(graph.candidates[a], step)]


def inputs_kept(graph: PlanningGraph, recipe: Recipe, step: int, gone: Container[int]) -> bool:
    """Every input of `recipe`, run before `step`, is resident without a copy-in: resident whatever
    its action, or not in `gone` (the candidates the plan does not keep: a set, or a choices dict,
    which holds only non-keep choices)."""
    return not any(a in gone for a in inputs_to_hold(graph, recipe, step))


def lower_bound_peak(graph: PlanningGraph, allow_swap: bool = True, allow_recompute: bool = True) -> int:
    """No plan's peak is below this: every candidate that can be gone at a step is gone."""
    n = graph.num_steps
    diff = [0] * (n + 1)
    for c in graph.candidates:
        lo = hi = None
        if allow_recompute and c.can_recompute:
            lo, hi = c.gap.start, c.gap.stop
        elif allow_recompute and c.regions:  # gone until the latest of its regions' replays
            lo, hi = c.gap.start, max(graph.regions[r].replay_step for r in c.regions)
        elif allow_swap and c.can_swap:
            lo, hi = max(c.gap.start, c.out_window[0] + 1), c.in_window[-1]
        if lo is not None and hi > lo:
            diff[lo] += c.bytes
            diff[hi] -= c.bytes
    best, run = 0, 0
    for s in range(n):
        run += diff[s]
        best = max(best, unplanned_step_bytes(graph, s) - run)
    return best


def gone_span(graph: PlanningGraph, c: Candidate, choice: Choice, release_step: int | None
              ) -> tuple[range, range] | None:
    """(steps during whose op, steps after whose op) `c` is not resident under `choice`, or None when
    it always is. A recomputed candidate is gone from after its last forward use until its rebuild
    (its first backward use, its "rebuilt with" candidate's, or its region's replay, whichever is
    first); a swapped one from its `release_step` (it counts as resident during op s unless it was
    already gone for the whole of it: released before op s, after its last forward use) until its
    copy-in is issued. A swap without a release step (never copied out) is never gone."""
    if choice.action == ACTION_KEEP or c.trivial:
        return None
    f, b = c.last_forward, c.first_backward
    if choice.action == ACTION_RECOMPUTE:
        if choice.rebuilt_with is not None:  # resident once the other recipe has run (before its op b)
            b = min(b, graph.candidates[choice.rebuilt_with].first_backward)
        if choice.region is not None:  # resident once the region has been replayed
            b = min(b, graph.regions[choice.region].replay_step)
        return range(f + 1, b), range(f, b)
    if choice.action == ACTION_SWAP and release_step is not None:
        return range(max(f + 1, release_step), choice.swap_in_step), range(max(f, release_step - 1), choice.swap_in_step)
    return None


def planned_timelines(graph: PlanningGraph, choices: dict[int, Choice], released_at: dict[int, int],
                      transient_at: Sequence[int]) -> tuple[list[int], list[int]]:
    """Planned memory (after each op, inside each op) of `choices`: the unplanned timeline minus the
    bytes of candidates not resident (`gone_span`; `released_at`: swapped candidate -> its release
    step), plus `transient_at` (recipe and region transients while they run) inside each op, plus the
    bytes the runtime holds for the plan's captures (`captured_bytes_timeline`)."""
    n = graph.num_steps
    gone_during = [0] * (n + 1)  # difference arrays over steps
    gone_after = [0] * (n + 1)
    for i, ch in choices.items():
        c = graph.candidates[i]
        span = gone_span(graph, c, ch, released_at.get(i))
        if span is None:
            continue
        during, after = span
        _add_on_steps(gone_during, during, c.bytes)
        _add_on_steps(gone_after, after, c.bytes)
    held = captured_bytes_timeline(
        graph, [q for ch in choices.values() if ch.recipe is not None and ch.region is None for q in ch.recipe.ops],
        [ch.region for ch in choices.values() if ch.region is not None])
    timeline, peaks = [], []
    run_during = run_after = 0
    for s in range(n):
        run_during += gone_during[s]
        run_after += gone_after[s]
        peaks.append(graph.peak_bytes[s] - run_during + transient_at[s] + held[s])
        timeline.append(graph.after_bytes[s] - run_after + held[s])
    return timeline, peaks


def planned_peak_bytes(graph: PlanningGraph, gone_bytes_at: Sequence[float], transient_bytes_at: Sequence[float]
                       ) -> int:
    """The peak of a plan given, per step, the bytes of candidates not resident and the transients:
    the largest unplanned step memory minus the one plus the other (rounded up)."""
    peak = 0
    for s in range(graph.num_steps):
        peak = max(peak, unplanned_step_bytes(graph, s) - gone_bytes_at[s] + transient_bytes_at[s])
    return int(math.ceil(peak))


def _add_on_steps(diff: list[int], steps: range, value: int) -> None:
    """Add `value` on `steps` (lo .. hi-1) of a difference array."""
    if steps.stop <= steps.start:
        return
    diff[steps.start] += value
    diff[steps.stop] -= value


def host_range_end(c) -> int:
    """Where a swapped candidate's host range goes back to the pool: its last backward use, where autograd
    frees the last handle on it (the runtime keeps the bytes until then, for a backward over a retained
    graph). Every copy-out is issued in forward and every range given back in backward, so the pool's
    peak is the same whether a range ends at the first backward use or the last; the plan says what the
    runtime does."""
    return c.last_backward if c.last_backward is not None else c.first_backward


def host_pool_bytes(candidates: Sequence, choices: dict) -> int:
    """The host pool a plan needs: the most bytes its swapped candidates' host ranges hold at once (each
    from its copy-out's issue to `host_range_end`, rounded as the runtime's pool hands ranges out)."""
    events = []
    for i, ch in choices.items():
        if ch.action == ACTION_SWAP:
            c = candidates[i]
            events.append((c.issue_after, host_range_bytes(c.bytes)))
            events.append((host_range_end(c) + 1, -host_range_bytes(c.bytes)))
    events.sort(key=lambda e: (e[0], e[1]))
    run = best = 0
    for _, delta in events:
        run += delta
        best = max(best, run)
    return best

