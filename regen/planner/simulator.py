"""The simulator: replays a plan over its profile and reports peak memory, step time and the timeline.

Three timelines, as the runtime runs them (the timing pass):
* the compute stream runs the profiled ops in order; before op s it replays the regions due there
  (their time, and their transient while they run: regen.planner.region_candidates), runs the recipes of candidates
  recomputed there (`recompute_before_op`), and waits for the copy-ins of tensors op s reads (and of
  recipe inputs that are swapped) to finish;
* a device-to-host copy stream (FIFO): a swapped tensor's copy-out is issued when op
  `swap_out_after_op` ends (its first forward pack; copy-outs issued after one op in pack order, as the
  runtime issues them) and runs at the d2h bandwidth once the stream is free. Its device copy is
  released at a *release step*, a step the runtime can act before (`PlanningGraph.next_release_step`: a
  forward pack after the tensor's own, or a backward unpack): the first one whose start finds the copy
  done, or the plan's (`Choice.release_step`), and at the latest the step its copy-in is issued. There the
  compute stream waits for the copy-out (a stall when it is late) and the copy is freed, or at the end
  of its last forward use if that is later;
* a host-to-device copy stream (FIFO): the copy-in is issued when op `swap_in_before_op` is about to
  start (copy-ins issued there in pack order, as the runtime's queue holds them); its device buffer is
  allocated then.

The memory pass is the planner's one memory model (regen.planner.residency.planned_timelines), given
the release steps and the recipe and region transients the timing pass found: the unplanned timeline
minus the bytes of candidates that are not resident, plus the transients, plus what the runtime holds
for the plan's captures. Every time the timing pass charges comes from regen.planner.costs. The
simulator is the judge of every strategy: `solve` refuses to write a plan whose simulated peak is over
the cap, or that is inconsistent (`errors`).
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass, field

from regen.formats.plan import ACTION_KEEP, ACTION_RECOMPUTE, ACTION_SWAP, TimeParts
from regen.planner.costs import copy_in_time_s, copy_out_time_s
from regen.planner.graph import Candidate, PlanningGraph
from regen.planner.region_candidates import region_transient_bytes
from regen.planner.residency import planned_timelines, resident_without_plan
from regen.planner.result import Choice

TIME_EPS_S = 1e-12  # a copy that ends within this of an op boundary counts as done by it


@dataclass
class SimulationResult:
    peak_bytes: int
    step_time_s: float
    timeline_bytes: list[int]  # planned memory after each op
    peak_timeline_bytes: list[int]  # planned peak inside each op
    errors: list[str] = field(default_factory=list)  # plan inconsistencies (recipe input not resident...)
    release_steps: dict[int, int] = field(default_factory=dict)  # swapped candidate -> its release step
    parts: TimeParts = field(default_factory=TimeParts)  # step_time_s beyond the unplanned ops, by cause

    @property
    def valid(self) -> bool:
        return not self.errors

    def fits(self, cap_bytes: int) -> bool:
        """A consistent plan whose simulated peak is within `cap_bytes`."""
        return self.valid and self.peak_bytes <= cap_bytes

    def step_bytes(self, step: int) -> int:
        """Planned memory of `step`: the peak inside the op or the memory after it."""
        return max(self.peak_timeline_bytes[step], self.timeline_bytes[step])


@dataclass
class _Events:
    """The plan's choices sorted by the step where the runtime acts on them."""

    swap_out_at: dict[int, list[Candidate]] = field(default_factory=dict)
    swap_in_at: dict[int, list[Candidate]] = field(default_factory=dict)
    recompute_at: dict[int, list[Candidate]] = field(default_factory=dict)
    rebuilt_by: dict[int, set[int]] = field(default_factory=dict)  # chosen region -> members it rebuilds
    reads_at: dict[int, list[Candidate]] = field(default_factory=dict)
    errors: list[str] = field(default_factory=list)
    tracked_ops: frozenset = frozenset()  # the forward ops the runtime's dispatch mode follows (recipes)


@dataclass
class _Timing:
    step_time_s: float
    transient_at: list[int]  # recipe transients at each step
    released_at: dict[int, int]  # swapped candidate index -> release step of its device copy
    parts: TimeParts = field(default_factory=TimeParts)


class _Releases:
    """Swapped candidates' device copies from their copy-out to their release step (see the module doc)."""

    def __init__(self, graph: PlanningGraph, choices: dict[int, Choice]):
        self.graph = graph
        self.choices = choices
        self.out_done: dict[int, float] = {}  # candidate index -> copy-out completion
        self.due: list[tuple[float, int]] = []  # heap (completion, index): release step still to find
        self.at_step: dict[int, list[int]] = {}  # release step -> candidates released before that op
        self.released_at: dict[int, int] = {}

    def copied_out(self, c: Candidate, done: float) -> None:
        self.out_done[c.index] = done
        step = self.choices[c.index].release_step
        if step is None:
            heapq.heappush(self.due, (done, c.index))
        else:
            self.at_step.setdefault(step, []).append(c.index)

    def release(self, s: int, now: float, copy_ins: list[Candidate]) -> float:
        """Release the copies due before op s (and those whose copy-in is issued there): the compute stream
        waits for each copy-out; returns its time after the waits."""
        while self.due and self.due[0][0] <= now + TIME_EPS_S:  # done: released at the next release step
            i = heapq.heappop(self.due)[1]
            self.at_step.setdefault(self.graph.next_release_step(self.graph.candidates[i], s), []).append(i)
        for i in self.at_step.pop(s, []) + [c.index for c in copy_ins]:
            if i not in self.released_at:
                self.released_at[i] = s
                now = max(now, self.out_done[i])
        return now


def simulate(graph: PlanningGraph, choices: dict[int, Choice]) -> SimulationResult:
    """Replay `choices` (candidate index -> Choice; absent means keep) over the graph's profile."""
    events = _events(graph, choices)
    timing = _timing_pass(graph, choices, events)
    timeline, peaks = planned_timelines(graph, choices, timing.released_at, timing.transient_at)
    peak = max(max(peaks), max(timeline))
    return SimulationResult(peak_bytes=int(peak), step_time_s=timing.step_time_s, timeline_bytes=timeline,
                            peak_timeline_bytes=peaks, errors=events.errors, release_steps=timing.released_at,
                            parts=timing.parts)


def _events(graph: PlanningGraph, choices: dict[int, Choice]) -> _Events:
    ev = _Events()
    for i, ch in choices.items():
        c = graph.candidates[i]
        if ch.action == ACTION_KEEP:
            continue
        if c.trivial:
            ev.errors.append(f"candidate {c.id}: {ch.action} of a tensor with no gap to act on")
            continue
        if ch.action == ACTION_SWAP:
            sin = ch.swap_in_step
            if sin is None or not (c.issue_after < sin <= c.first_backward):
                ev.errors.append(f"candidate {c.id}: copy-in step {sin} outside ({c.issue_after}, {c.first_backward}]")
                continue
            if ch.release_step is not None and not (c.issue_after < ch.release_step <= sin):
                ev.errors.append(f"candidate {c.id}: release step {ch.release_step} outside ({c.issue_after}, {sin}]")
                continue
            ev.swap_out_at.setdefault(c.issue_after, []).append(c)
            ev.swap_in_at.setdefault(sin, []).append(c)
            ev.reads_at.setdefault(c.first_backward, []).append(c)
        elif ch.action == ACTION_RECOMPUTE and ch.region is not None:
            why = _region_error(graph, choices, c, ch.region)
            if why:
                ev.errors.append(f"candidate {c.id}: {why}")
            else:
                ev.rebuilt_by.setdefault(ch.region, set()).add(c.index)
        elif ch.action == ACTION_RECOMPUTE:
            if ch.recipe is None:
                ev.errors.append(f"candidate {c.id}: recompute without a recipe")
                continue
            if ch.rebuilt_with is not None:
                why = _rebuilt_with_error(graph, choices, c, ch.rebuilt_with)
                if why:
                    ev.errors.append(f"candidate {c.id}: {why}")
                continue  # no time and no transient of its own: resident once the other recipe has run
            ev.recompute_at.setdefault(c.first_backward, []).append(c)
        else:
            ev.errors.append(f"candidate {c.id}: unknown action {ch.action}")
    # in the runtime's order: the step's pack order (copy-ins issued together go in the order of their copy-outs)
    for out in (*ev.swap_out_at.values(), *ev.swap_in_at.values()):
        out.sort(key=lambda c: (c.first_pack_index, c.index))
    ev.tracked_ops = tracked_forward_ops(graph, choices)
    return ev


def recipe_tracked_ops(graph: PlanningGraph, choices: dict[int, Choice]) -> frozenset[int]:
    """The forward ops the chosen per-tensor recipes need the runtime to see (PlanningGraph.tracked_ops)."""
    ops: set[int] = set()
    for ch in choices.values():
        if ch.action == ACTION_RECOMPUTE and ch.recipe is not None and ch.region is None:
            ops |= graph.tracked_ops(ch.recipe)
    return frozenset(ops)


def tracked_forward_ops(graph: PlanningGraph, choices: dict[int, Choice]) -> frozenset[int]:
    """The forward ops the runtime's dispatch mode follows on a steady-state step: the tracking windows
    of the chosen recipes' tracked ops (regen.planner.tracking_windows); none without recipes."""
    return graph.window_starts.covered(recipe_tracked_ops(graph, choices))


def _timing_pass(graph: PlanningGraph, choices: dict[int, Choice], ev: _Events) -> _Timing:
    n = graph.num_steps
    cands = graph.candidates
    releases = _Releases(graph, choices)
    out_done = releases.out_done
    in_done: dict[int, float] = {}
    d2h_free = h2d_free = 0.0
    now = 0.0
    transient_at = [0] * n
    parts = TimeParts()

    def wait_for(i: int) -> None:
        nonlocal now
        if in_done[i] > now:
            now = in_done[i]

    replays_at: dict[int, list[int]] = {}
    for r in ev.rebuilt_by:
        replays_at.setdefault(graph.regions[r].replay_step, []).append(r)

    for s in range(n):
        copy_ins = ev.swap_in_at.get(s, [])
        now = releases.release(s, now, copy_ins)
        for c in copy_ins:
            t0 = max(now, h2d_free, out_done.get(c.index, now))
            h2d_free = t0 + copy_in_time_s(graph, c.bytes)
            in_done[c.index] = h2d_free
        for r in replays_at.get(s, ()):  # module calls replayed here (regen.planner.region_candidates)
            now += graph.regions[r].time_s
            parts.recompute_s += graph.regions[r].time_s
            parts.region_s += graph.regions[r].time_s
            transient_at[s] += region_transient_bytes(graph, graph.regions[r], ev.rebuilt_by[r])
        for c in ev.recompute_at.get(s, []):
            recipe = choices[c.index].recipe
            for a in recipe.inputs:
                if resident_without_plan(cands[a], s):
                    continue
                ach = choices.get(a, Choice())
                if ach.action == ACTION_KEEP:
                    continue
                if ach.action == ACTION_SWAP and a in in_done:
                    wait_for(a)
                    continue
                ev.errors.append(f"candidate {c.id}: recipe input {cands[a].id} ({ach.action}) is not resident "
                                 f"before op {s}")
            now += recipe.time_s
            parts.recompute_s += recipe.time_s
            transient_at[s] += recipe.transient_bytes
        for c in ev.reads_at.get(s, ()):
            if c.index in in_done:
                wait_for(c.index)
            else:
                ev.errors.append(f"candidate {c.id}: read at op {s} before its copy-in was issued")
        now += graph.time_s[s]
        if s in ev.tracked_ops:
            now += graph.costs.dispatch_op_s
            parts.dispatch_s += graph.costs.dispatch_op_s
        for c in ev.swap_out_at.get(s, []):
            now += graph.costs.swap_time_s(c.bytes)  # the swap's cost to the compute thread, all at its copy-out
            parts.swap_calls_s += graph.costs.swap_time_s(c.bytes)
            t0 = max(now, d2h_free)
            d2h_free = t0 + copy_out_time_s(graph, c.bytes)
            releases.copied_out(c, d2h_free)
    parts.link_wait_s = max(0.0, now - graph.compute_time_s - parts.recompute_s - parts.dispatch_s - parts.swap_calls_s)
    return _Timing(step_time_s=now, transient_at=transient_at, released_at=releases.released_at, parts=parts)


def _rebuilt_with_error(graph: PlanningGraph, choices: dict[int, Choice], c: Candidate, r: int) -> str | None:
    """Why `c` cannot be rebuilt with candidate `r`'s recipe in this plan, or None."""
    rc = choices.get(r)
    rid = graph.candidates[r].id
    if rc is None or rc.action != ACTION_RECOMPUTE or rc.recipe is None or rc.rebuilt_with is not None:
        return f"rebuilt with candidate {rid}, which is not recomputed by a recipe of its own"
    if c.producer not in rc.recipe.ops:
        return f"rebuilt with candidate {rid}, whose recipe does not run op {c.producer}"
    if graph.candidates[r].first_backward > c.first_backward:
        return f"rebuilt with candidate {rid}, whose recipe runs after this one's first use"
    return None


def _region_error(graph: PlanningGraph, choices: dict[int, Choice], c: Candidate, r: int) -> str | None:
    """Why `c` cannot be rebuilt by region `r` in this plan, or None: it must be one of the region's
    members, and the region's argument candidates must be kept (the runtime holds them)."""
    if not 0 <= r < len(graph.regions) or c.index not in graph.regions[r].members:
        return f"rebuilt by region {r}, which cannot rebuild it"
    region = graph.regions[r]
    for a in region.inputs:
        ach = choices.get(a)
        if ach is not None and ach.action != ACTION_KEEP:
            return (f"rebuilt by region {region.name}, whose argument {graph.candidates[a].id} is not kept "
                    f"({ach.action})")
    return None
