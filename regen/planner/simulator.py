"""The simulator: replays a plan over its profile and reports peak memory, step time and the timeline.

Three timelines, as the runtime runs them:
* the compute stream runs the profiled ops in order; before op s it runs the recipes of candidates
  recomputed there (`recompute_before_op`), and waits for the copy-ins of tensors op s reads (and of
  recipe inputs that are swapped) to finish;
* a device-to-host copy stream (FIFO): a swapped tensor's copy-out is issued when op
  `swap_out_after_op` ends and runs at the d2h bandwidth once the stream is free; the device copy is
  freed when the copy-out has completed, or at the end of its last forward use if that is later;
* a host-to-device copy stream (FIFO): the copy-in is issued when op `swap_in_before_op` is about to
  start; its device buffer is allocated then.

Memory is the unplanned timeline minus the bytes of candidates that are not resident, plus recipe
transients while a recipe runs. A candidate counts as resident during op s unless it was already
gone for the whole of it (conservative: a copy-out that completes mid-op frees memory after the op).
The simulator is the judge of every strategy: `solve` refuses to write a plan whose simulated peak
is over the cap.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass, field

from regen.errors import RegenError
from regen.formats.plan import ACTION_KEEP, ACTION_RECOMPUTE, ACTION_SWAP, Plan
from regen.planner.graph import (Candidate, PlanningGraph, Recipe, anchor_resident_without_plan,
                                 recipe_transient_bytes)

TIME_EPS_S = 1e-12  # a copy that ends within this of an op boundary counts as done by it


@dataclass
class Choice:
    """What to do with one candidate (internal form of a plan Decision)."""

    action: str = ACTION_KEEP
    recipe: Recipe | None = None
    swap_in_step: int | None = None  # the copy-in starts before this op
    rebuilt_with: int | None = None  # recompute: rebuilt by this candidate's recipe (graph.Candidate.hosts)


@dataclass
class SimulationResult:
    peak_bytes: int
    step_time_s: float
    timeline_bytes: list[int]  # planned memory after each op
    peak_timeline_bytes: list[int]  # planned peak inside each op
    op_start_s: list[float]
    op_end_s: list[float]
    stall_s: float  # compute time spent waiting for copy-ins
    recompute_s: float
    errors: list[str] = field(default_factory=list)  # plan inconsistencies (recipe input not resident...)

    @property
    def valid(self) -> bool:
        return not self.errors


def simulate(graph: PlanningGraph, choices: dict[int, Choice]) -> SimulationResult:
    """Replay `choices` (candidate index -> Choice; absent means keep) over the graph's profile."""
    n = graph.num_steps
    cands = graph.candidates
    d2h, h2d = graph.d2h_bytes_per_s, graph.h2d_bytes_per_s
    errors: list[str] = []
    swap_out_at: dict[int, list[Candidate]] = {}
    swap_in_at: dict[int, list[Candidate]] = {}
    recompute_at: dict[int, list[Candidate]] = {}
    reads_at: dict[int, list[Candidate]] = {}
    for i, ch in choices.items():
        c = cands[i]
        if ch.action == ACTION_KEEP:
            continue
        if c.trivial:
            errors.append(f"candidate {c.id}: {ch.action} of a tensor with no gap to act on")
            continue
        if ch.action == ACTION_SWAP:
            sin = ch.swap_in_step
            if sin is None or not (c.issue_after < sin <= c.first_backward):
                errors.append(f"candidate {c.id}: copy-in step {sin} outside ({c.issue_after}, {c.first_backward}]")
                continue
            swap_out_at.setdefault(c.issue_after, []).append(c)
            swap_in_at.setdefault(sin, []).append(c)
            reads_at.setdefault(c.first_backward, []).append(c)
        elif ch.action == ACTION_RECOMPUTE:
            if ch.recipe is None:
                errors.append(f"candidate {c.id}: recompute without a recipe")
                continue
            if ch.rebuilt_with is not None:
                why = _byproduct_error(graph, choices, c, ch.rebuilt_with)
                if why:
                    errors.append(f"candidate {c.id}: {why}")
                continue  # no time and no transient of its own: resident from its host's recipe on
            recompute_at.setdefault(c.first_backward, []).append(c)
        else:
            errors.append(f"candidate {c.id}: unknown action {ch.action}")

    out_done: dict[int, float] = {}
    in_done: dict[int, float] = {}
    d2h_free = h2d_free = 0.0
    now = 0.0
    stall = recompute_time = 0.0
    begin = [0.0] * n
    start = [0.0] * n
    end = [0.0] * n
    transient_at = [0] * n
    for s in range(n):
        begin[s] = now
        for c in sorted(swap_in_at.get(s, []), key=lambda c: (c.first_backward, c.index)):
            t0 = max(now, h2d_free, out_done.get(c.index, now))
            h2d_free = t0 + c.bytes / h2d
            in_done[c.index] = h2d_free
        for c in recompute_at.get(s, []):
            recipe = choices[c.index].recipe
            for a in recipe.anchors:
                anchor = cands[a]
                if anchor_resident_without_plan(anchor, s):
                    continue
                ach = choices.get(a, Choice())
                if ach.action == ACTION_KEEP:
                    continue
                if ach.action == ACTION_SWAP and a in in_done:
                    if in_done[a] > now:
                        stall += in_done[a] - now
                        now = in_done[a]
                    continue
                errors.append(f"candidate {c.id}: recipe input {anchor.id} ({ach.action}) is not resident "
                              f"before op {s}")
            now += recipe.time_s
            recompute_time += recipe.time_s
            transient_at[s] += recipe.transient_bytes
        for c in reads_at.get(s, ()):
            if c.index in in_done:
                if in_done[c.index] > now:
                    stall += in_done[c.index] - now
                    now = in_done[c.index]
            else:
                errors.append(f"candidate {c.id}: read at op {s} before its copy-in was issued")
        start[s] = now
        now += graph.time_s[s]
        end[s] = now
        for c in swap_out_at.get(s, []):
            t0 = max(now, d2h_free)
            d2h_free = t0 + c.bytes / d2h
            out_done[c.index] = d2h_free

    # memory: unplanned minus non-resident candidates, plus transients
    saved_during = [0] * (n + 1)  # difference arrays over steps
    saved_after = [0] * (n + 1)
    for i, ch in choices.items():
        c = cands[i]
        if ch.action == ACTION_KEEP or c.trivial:
            continue
        f, b = c.last_forward, c.first_backward
        if ch.action == ACTION_RECOMPUTE:
            if ch.rebuilt_with is not None:  # resident once the host's recipe has run (before op b_host)
                b = min(b, cands[ch.rebuilt_with].first_backward)
            _add(saved_during, f + 1, b, c.bytes)
            _add(saved_after, f, b, c.bytes)
        elif ch.action == ACTION_SWAP and c.index in out_done:
            sin = ch.swap_in_step
            done = out_done[c.index]
            # during op s: gone for all of it iff s > f, copy-out done by its begin, copy-in not yet issued
            first = _first_step_at_or_after(begin, done, f + 1)
            _add(saved_during, first, sin, c.bytes)
            first_after = _first_step_at_or_after(end, done, f)
            _add(saved_after, first_after, sin, c.bytes)
    timeline, peaks = [], []
    run_during = run_after = 0
    for s in range(n):
        run_during += saved_during[s]
        run_after += saved_after[s]
        peaks.append(graph.peak_bytes[s] - run_during + transient_at[s])
        timeline.append(graph.after_bytes[s] - run_after)
    peak = max(max(peaks), max(timeline))
    return SimulationResult(peak_bytes=int(peak), step_time_s=now, timeline_bytes=timeline, peak_timeline_bytes=peaks,
                            op_start_s=start, op_end_s=end, stall_s=stall, recompute_s=recompute_time, errors=errors)


def _byproduct_error(graph: PlanningGraph, choices: dict[int, Choice], c: Candidate, host: int) -> str | None:
    """Why `c` cannot be rebuilt with `host`'s recipe in this plan, or None."""
    h = choices.get(host)
    if h is None or h.action != ACTION_RECOMPUTE or h.recipe is None or h.rebuilt_with is not None:
        return f"rebuilt with candidate {graph.candidates[host].id}, which is not recomputed by a recipe of its own"
    if c.producer not in h.recipe.ops:
        return f"rebuilt with candidate {graph.candidates[host].id}, whose recipe does not run op {c.producer}"
    if graph.candidates[host].first_backward > c.first_backward:
        return f"rebuilt with candidate {graph.candidates[host].id}, whose recipe runs after this one's first use"
    return None


def _add(diff: list[int], lo: int, hi: int, value: int) -> None:
    """Add `value` on steps lo .. hi-1."""
    if hi <= lo:
        return
    diff[lo] += value
    diff[hi] -= value


def _first_step_at_or_after(times: list[float], t: float, lo: int) -> int:
    """The first step s >= lo whose time (begin or end, nondecreasing) is >= t."""
    return max(bisect.bisect_left(times, t - TIME_EPS_S), lo)


# ---- plans -------------------------------------------------------------------------------------


def choices_from_plan(graph: PlanningGraph, plan: Plan) -> dict[int, Choice]:
    """The simulator's view of a plan's decisions (recipes re-derived from their op lists)."""
    by_id = graph.by_saved_id()
    ops = graph.profile.ops
    tensors = graph.profile.tensor_by_id()
    choices: dict[int, Choice] = {}
    for d in plan.decisions:
        c = by_id.get(d.saved_tensor)
        if c is None:
            raise RegenError(f"plan decision for saved tensor {d.saved_tensor}, which the profile does not have")
        if d.action == ACTION_SWAP:
            choices[c.index] = Choice(ACTION_SWAP, swap_in_step=d.swap_in_before_op)
        elif d.action == ACTION_RECOMPUTE and d.rebuilt_with is not None:
            host = by_id.get(d.rebuilt_with)
            if host is None:
                raise RegenError(f"plan decision for saved tensor {d.saved_tensor} is rebuilt with saved tensor "
                                 f"{d.rebuilt_with}, which the profile does not have")
            choices[c.index] = Choice(ACTION_RECOMPUTE, recipe=Recipe(ops=list(d.recipe), anchors=[], time_s=0.0,
                                                                      transient_bytes=0),
                                      rebuilt_with=host.index)
        elif d.action == ACTION_RECOMPUTE:
            anchors = [by_id[a].index for a in d.recipe_inputs if a in by_id]
            recipe = Recipe(ops=list(d.recipe), anchors=anchors, time_s=float(sum(graph.time_s[q] for q in d.recipe)),
                            transient_bytes=recipe_transient_bytes(graph.profile, tensors, list(d.recipe),
                                                                   c.saved.storage),
                            random_ops=[q for q in d.recipe if ops[q].is_random])
            choices[c.index] = Choice(ACTION_RECOMPUTE, recipe=recipe)
    return choices
