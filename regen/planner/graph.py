"""The planning graph: a profile turned into what the planner decides over.

* one `Candidate` per saved tensor: bytes, producer p, last forward use f (or the last op something
  other than autograd holds its storage, when later: dropping it frees nothing before), first/last
  backward use b/e, the gap (f, b) where the action matters, the copy-out and copy-in windows a swap may use, and
  the recompute options (regen.planner.recipes) and the regions that may rebuild it (module calls
  replayed in backward: regen.planner.region_candidates); a copy of a parameter (autocast's low-precision weight
  copies, `opnames.copies_first_arg`) gets no copy windows: it is kept or recomputed, never swapped, and
  its gap starts at the end of the forward (autocast's cache holds the copy until the forward ends);
* the unplanned memory timeline (after and peak of every op) that planned memory is measured against:
  whatever the action, t is resident on [p, f] and [b, e]; an action only removes t's bytes from
  steps of its gap, so planned memory = unplanned memory - bytes of candidates not resident then
  (+ recompute transients): the "base + resident candidates" accounting of docs/milp.md, written
  once in regen.planner.residency;
* an op dependency graph (networkx `DiGraph`, op index -> op index through tensors), which STR's
  formulation (regen.planner.str_milp) uses for the edges between its stages.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass, field

import networkx as nx

from regen.errors import RegenError
from regen.formats.profile import KIND_PARAMETER, Profile, SavedTensor
from regen.opnames import copies_first_arg
from regen.planner.costs import RuntimeCharges, copy_in_time_s, copy_out_time_s, op_times_s
from regen.planner.recipes import Recipe, add_rebuilt_with_options, add_recipes, storage_writes
from regen.planner.region_candidates import Region, add_regions
from regen.planner.residency import op_capture_bytes
from regen.planner.tracking_windows import WindowStarts

# NOTE [ Copy window length ]
# A swap's copy window covers at least MIN_WINDOW_STEPS steps (when the gap allows) and at most
# window_steps_cap(candidates): WINDOW_STEP_BUDGET over all candidates (it keeps the MILP's copy variables
# O(budget)), between MIN_WINDOW_STEPS_CAP and MAX_WINDOW_STEPS. The upper bound is long because a slow
# link needs long windows: at R = 0.9 a 3 MiB tensor of the built-in GPT takes ~25 ops to copy, and three
# of them are made at once; with windows of at most 32 steps most swaps do not fit, and hybrid at 50% of
# the peak adds 37 ms to the unplanned step, against 13 ms with windows of up to 128.

# NOTE [ Copy window length on large graphs ]
# Past WINDOW_STEP_BUDGET / MIN_WINDOW_STEPS_CAP candidates every window is capped at MIN_WINDOW_STEPS_CAP
# steps, and windows of 4x a tensor's transfer time fill that cap: a larger model whose block search
# covers fewer blocks in its time limit. There windows cover 2x the transfer time (bench/solver_scaling.py,
# 3,002 candidates, 30 s: docs/benchmarks.md).
MIN_WINDOW_STEPS = 2
MAX_WINDOW_STEPS = 128
MIN_WINDOW_STEPS_CAP = 32
WINDOW_STEP_BUDGET = 12_000
MAX_WINDOW_BREAKS = 6  # steps of a window where the copy's state (done / started) may change
# a window covers this many times the tensor's own transfer time (others share the link): on a graph past the
# window budget, the smaller factor (Note [ Copy window length on large graphs ])
WINDOW_TRANSFER_FACTOR = 4.0
LARGE_GRAPH_TRANSFER_FACTOR = 2.0
FALLBACK_BANDWIDTH_BYTES_PER_S = 10e9  # when a profile records no bandwidth


@dataclass
class Candidate:
    index: int  # position in PlanningGraph.candidates
    saved: SavedTensor
    bytes: int
    producer: int  # p
    # f: the last step its storage lives whatever the plan does: its last forward use, or later while
    # something other than autograd holds it (SavedTensor.held_until_op); held into backward, it is trivial
    last_forward: int
    first_backward: int | None  # b
    last_backward: int | None  # e
    # the runtime issues a swap's copy-out at the tensor's first forward pack: the op dispatched before it
    # (`issue_after`), and its position in the step's pack order (copy-outs issued after one op go in that order)
    issue_after: int
    first_pack_index: int = -1
    last_pack: int = -1  # position of its last forward pack (PlanningGraph.pack_steps); its release comes later
    out_window: list[int] = field(default_factory=list)  # steps a copy-out may use
    in_window: list[int] = field(default_factory=list)  # steps a copy-in may use (ends at b-1)
    out_breaks: list[int] = field(default_factory=list)  # window steps where "copy-out done" may turn on
    in_breaks: list[int] = field(default_factory=list)  # window steps where the copy-in may start
    recipes: list[Recipe] = field(default_factory=list)  # recompute options, cheapest first
    not_recomputable: str | None = None
    # recipes of other candidates that rebuild this one on the way, as (candidate index, recipe option),
    # run at or before this one's first backward use: "rebuilt with" one, it costs no compute of its own
    rebuilt_with_options: list[tuple[int, int]] = field(default_factory=list)
    regions: list[int] = field(default_factory=list)  # regions (PlanningGraph.regions) that may rebuild it

    @property
    def id(self) -> int:
        return self.saved.id

    @property
    def trivial(self) -> bool:
        """No backward use or an empty gap: the action changes nothing, keep."""
        return self.first_backward is None or self.first_backward <= self.last_forward + 1

    @property
    def gap(self) -> range:
        """Steps where the action decides residency: f+1 .. b-1."""
        if self.trivial:
            return range(0)
        return range(self.last_forward + 1, self.first_backward)

    @property
    def can_swap(self) -> bool:
        return not self.trivial and bool(self.out_window) and bool(self.in_window)

    @property
    def can_recompute(self) -> bool:
        return not self.trivial and bool(self.recipes)


@dataclass
class PlanningGraph:
    profile: Profile
    op_graph: nx.DiGraph
    candidates: list[Candidate]
    time_s: list[float]  # c_s
    after_bytes: list[int]  # unplanned memory after each op
    peak_bytes: list[int]  # unplanned peak inside each op
    d2h_bytes_per_s: float
    h2d_bytes_per_s: float
    num_forward_ops: int
    # Steps before which the runtime can start a copy-in: the runtime has no op counter in backward and
    # issues copy-ins at unpacks (docs/internals.md), so a copy-in can only start right before an op that
    # follows an unpack. Empty when the profile records no unpacks (synthetic graphs): any step.
    copy_in_starts: list[int] = field(default_factory=list)
    regions: list[Region] = field(default_factory=list)  # replayable module calls (regen.planner.region_candidates)
    # Where the runtime can release a swapped storage (docs/internals.md "Swaps"): at a forward pack or a
    # backward unpack, i.e. right before the op that follows it. pack_steps[k] is that op for the k-th forward
    # pack, unpack_steps[u] for the u-th unpack (nondecreasing). Both empty (no saved entries): any step.
    pack_steps: list[int] = field(default_factory=list)
    unpack_steps: list[int] = field(default_factory=list)
    # bound on the bytes swapped out at once (the plan's host pool), None for none (regen.planner.host_link)
    host_memory_cap_bytes: int | None = None
    # (name, choices): plans of this graph the caller already had, for the MILP to start from (regen.planner.solve)
    start_plans: list[tuple[str, dict]] = field(default_factory=list)
    costs: RuntimeCharges = field(default_factory=lambda: RuntimeCharges())  # regen's own time per event
    # forward op -> device bytes the runtime holds from capturing it for a recipe (residency.op_capture_bytes)
    capture_bytes: dict[int, int] = field(default_factory=dict)
    _reads: list[tuple[int, ...]] | None = field(default=None, init=False, repr=False)
    _window_starts: WindowStarts | None = field(default=None, init=False, repr=False)
    _covered: dict[tuple[int, ...], frozenset[int]] = field(default_factory=dict, init=False, repr=False)

    def tracked_ops(self, recipe) -> frozenset[int]:
        """The forward ops the runtime must see for `recipe` (a Recipe) on a fast step: its ops and the
        forward producers of what they read (regen.runtime.forward_ops.FastOps)."""
        if self._reads is None:
            fw = self.num_forward_ops
            self._reads = [tuple(p for p in self.op_graph.predecessors(q) if p < fw) for q in range(fw)]
        return frozenset(p for q in recipe.ops for p in (q,) + self._reads[q])

    @property
    def window_starts(self) -> WindowStarts:
        """Where the runtime's tracking windows can open (regen.planner.tracking_windows)."""
        if self._window_starts is None:
            self._window_starts = WindowStarts.of(self.profile, self.pack_steps)
        return self._window_starts

    def covered_ops(self, recipe) -> frozenset[int]:
        """The forward ops the dispatch mode follows for `recipe`: the windows of its tracked ops (once per
        recipe: the MILP is built again for each round and neighbourhood)."""
        key = tuple(recipe.ops)
        ops = self._covered.get(key)
        if ops is None:
            ops = self._covered[key] = self.window_starts.covered(self.tracked_ops(recipe))
        return ops

    def snap_copy_in(self, step: int) -> int:
        """The step where a copy-in planned to start before `step` really starts: the latest runtime
        trigger at or before it (earlier, never later, so a copy-in is never late)."""
        starts = self.copy_in_starts
        if not starts:
            return step
        k = bisect.bisect_right(starts, step) - 1
        return starts[k] if k >= 0 else starts[0]

    def next_copy_in_start(self, step: int) -> int:
        """The first runtime trigger after `step` (`step + 1` when the graph records none; `num_steps` when
        none is left)."""
        starts = self.copy_in_starts
        if not starts:
            return step + 1
        k = bisect.bisect_right(starts, step)
        return starts[k] if k < len(starts) else self.num_steps

    def next_release_step(self, c: Candidate, step: int) -> int:
        """The first step at or after `step` before which the runtime can release swapped candidate `c`: a
        forward pack after c's own packs, or an unpack (`step` itself when the graph records neither)."""
        k = bisect.bisect_left(self.pack_steps, step, lo=c.last_pack + 1)
        if k < len(self.pack_steps):
            return self.pack_steps[k]
        u = bisect.bisect_left(self.unpack_steps, step)
        if u < len(self.unpack_steps):
            return self.unpack_steps[u]
        return step if not self.pack_steps and not self.unpack_steps else self.num_steps

    def release_position(self, c: Candidate, step: int) -> tuple[int | None, int | None]:
        """(forward pack, backward unpack) position where the runtime releases `c` before `step`: one is set
        when `step` is one of c's release steps (next_release_step), both None otherwise."""
        k = bisect.bisect_left(self.pack_steps, step, lo=c.last_pack + 1)
        if k < len(self.pack_steps) and self.pack_steps[k] == step:
            return k, None
        u = bisect.bisect_left(self.unpack_steps, step)
        if u < len(self.unpack_steps) and self.unpack_steps[u] == step:
            return None, u
        return None, None

    @property
    def time_unit(self) -> str | None:
        """The unit of op times when it is a graph's own (regen.graphs), None for seconds."""
        return self.profile.workload.get("time_unit")

    @property
    def num_steps(self) -> int:
        return len(self.time_s)

    @property
    def compute_time_s(self) -> float:
        return float(sum(self.time_s))

    @property
    def unplanned_peak_bytes(self) -> int:
        return max(max(self.peak_bytes, default=0), max(self.after_bytes, default=0))

    def by_saved_id(self) -> dict[int, Candidate]:
        return {c.id: c for c in self.candidates}


def build_graph(profile: Profile, d2h_bytes_per_s: float | None = None, h2d_bytes_per_s: float | None = None,
                host_memory_cap_bytes: int | None = None,
                start_plans: list[tuple[str, dict]] | None = None, module_replays: bool = True) -> PlanningGraph:
    """Candidates, lifetimes, windows and recipes of a profile, over a link of the given bandwidths (the
    profile's own, else FALLBACK_BANDWIDTH_BYTES_PER_S, where None), with the bound on the host pool and
    the plans the MILP may start from (regen.planner.solve); with its module calls as regions unless
    `module_replays` is False."""
    if not profile.ops:
        raise RegenError("the profile has no ops; nothing to plan")
    d2h = d2h_bytes_per_s or profile.device.d2h_bytes_per_s or FALLBACK_BANDWIDTH_BYTES_PER_S
    h2d = h2d_bytes_per_s or profile.device.h2d_bytes_per_s or FALLBACK_BANDWIDTH_BYTES_PER_S
    if d2h <= 0 or h2d <= 0:
        raise RegenError(f"copy bandwidth must be positive (got d2h {d2h}, h2d {h2d} bytes/s)")
    ops = profile.ops
    num_forward = profile.num_forward_ops  # a count over the ops: read once
    times = op_times_s(profile)
    after = [int(op.memory_after_bytes) for op in ops]
    peak = [max(int(op.memory_peak_bytes), int(op.memory_after_bytes)) for op in ops]
    op_graph = _op_graph(profile)

    first_pack: dict[int, tuple[int, int]] = {}  # saved tensor id -> (pack index, op) of its first pack
    for entry in profile.saved_entries:  # in pack order
        if entry.saved_tensor is not None:
            first_pack.setdefault(entry.saved_tensor, (entry.index, entry.pack_after_op))
    forward_packs = sorted((e for e in profile.saved_entries if e.pack_after_op < num_forward),
                           key=lambda e: e.index)
    pack_position = {e.index: k for k, e in enumerate(forward_packs)}

    parameter_copies = _parameter_copies(profile)
    candidates = []
    for i, s in enumerate(sorted(profile.saved_tensors, key=lambda s: (s.producer_op, s.id))):
        b = s.first_backward_use
        e = s.last_backward_use
        f = max(s.last_forward_use, s.producer_op, -1 if s.held_until_op is None else s.held_until_op)
        if s.producer_op in parameter_copies:  # held by autocast's cache until the forward ends
            f = max(f, num_forward - 1)
        c = Candidate(index=i, saved=s, bytes=int(s.bytes), producer=s.producer_op, last_forward=f,
                      first_backward=b, last_backward=e,
                      issue_after=max(s.producer_op, first_pack.get(s.id, (-1, s.producer_op))[1]),
                      first_pack_index=first_pack.get(s.id, (-1, -1))[0],
                      last_pack=max((pack_position.get(x, -1) for x in s.entries), default=-1))
        candidates.append(c)
    copy_in_starts = sorted({e.unpack_before_op for e in profile.saved_entries
                             if e.unpack_order is not None and e.unpack_before_op is not None})
    graph = PlanningGraph(profile=profile, op_graph=op_graph, candidates=candidates, time_s=times,
                          after_bytes=after, peak_bytes=peak, d2h_bytes_per_s=float(d2h),
                          h2d_bytes_per_s=float(h2d), num_forward_ops=num_forward,
                          copy_in_starts=copy_in_starts, costs=RuntimeCharges.of(profile, times),
                          host_memory_cap_bytes=host_memory_cap_bytes, start_plans=list(start_plans or []),
                          capture_bytes=op_capture_bytes(profile),
                          pack_steps=[e.pack_after_op + 1 for e in forward_packs],
                          unpack_steps=[op for _, op in sorted((e.unpack_order, e.unpack_before_op)
                                                               for e in profile.saved_entries
                                                               if e.unpack_order is not None
                                                               and e.unpack_before_op is not None)])
    written_after_pack = _written_after_first_pack(profile)
    max_steps, transfer_factor = window_steps_cap(len(candidates)), window_transfer_factor(len(candidates))
    for c in candidates:
        if c.trivial or c.bytes <= 0 or c.producer in parameter_copies or c.id in written_after_pack:
            continue
        _set_windows(graph, c, max_steps, transfer_factor)
    add_recipes(graph)
    add_rebuilt_with_options(graph)
    if module_replays:
        add_regions(graph)
    return graph


def _parameter_copies(profile: Profile) -> set[int]:
    """Forward ops that copy a parameter (opnames.copies_first_arg): autocast's low-precision weight copies."""
    parameters = {t.id for t in profile.tensors if t.kind == KIND_PARAMETER}
    return {op.index for op in profile.ops[:profile.num_forward_ops]
            if copies_first_arg(op.name) and op.inputs and op.inputs[0] in parameters}


def _written_after_first_pack(profile: Profile) -> set[int]:
    """Saved tensor ids whose storage a forward op writes in place after it was first packed: autograd
    packs an op's inputs before the op runs, so a tensor saved for an op that writes it (the noise of
    `rrelu_with_noise`) gets its contents after the pack. A swap copies out at the pack: such a
    candidate is never swapped (nor recomputed: regen.planner.recipes refuses later writes)."""
    tensors = profile.tensor_by_id()
    inplace_writers, _ = storage_writes(profile, tensors)
    first_pack: dict[int, int] = {}
    for e in profile.saved_entries:
        if e.saved_tensor is not None:
            first_pack[e.saved_tensor] = min(first_pack.get(e.saved_tensor, e.pack_after_op), e.pack_after_op)
    num_forward = profile.num_forward_ops
    return {s.id for s in profile.saved_tensors
            if any(first_pack.get(s.id, s.producer_op) < w < num_forward for w in inplace_writers.get(s.storage, ()))}


def _op_graph(profile: Profile) -> nx.DiGraph:
    """Ops as nodes (with name/time/flags), an edge q -> p when p reads a tensor q produced."""
    g = nx.DiGraph()
    producer = {t.id: t.producer_op for t in profile.tensors}
    for op in profile.ops:
        g.add_node(op.index, name=op.name, time_s=op.time_s, phase=op.phase, is_inplace=op.is_inplace,
                   is_random=op.is_random, is_view=op.is_view)
    for op in profile.ops:
        for x in op.inputs:
            q = producer.get(x)
            if q is not None and q != op.index:
                g.add_edge(q, op.index, tensor=x)
    return g


def window_steps_cap(num_candidates: int) -> int:
    """The most steps a copy window covers on a graph of `num_candidates` candidates."""
    return max(MIN_WINDOW_STEPS_CAP, min(MAX_WINDOW_STEPS, WINDOW_STEP_BUDGET // max(1, num_candidates)))


def window_transfer_factor(num_candidates: int) -> float:
    """How many times its own transfer time a window covers on a graph of `num_candidates` candidates."""
    within_budget = WINDOW_STEP_BUDGET // max(1, num_candidates) >= MIN_WINDOW_STEPS_CAP
    return WINDOW_TRANSFER_FACTOR if within_budget else LARGE_GRAPH_TRANSFER_FACTOR


def _set_windows(graph: PlanningGraph, c: Candidate, max_steps: int, transfer_factor: float) -> None:
    """Bounded copy windows (at most `max_steps` each, covering `transfer_factor` x the tensor's transfer time
    when they can): steps after the pack (copy-out) and before b (copy-in)."""
    b = c.first_backward
    times = graph.time_s
    out_need = transfer_factor * copy_out_time_s(graph, c.bytes)
    in_need = transfer_factor * copy_in_time_s(graph, c.bytes)
    # copy-out: o+1 .. at most b-2 (the copy-in needs a step after it)
    out_window, covered = [], 0.0
    s = c.issue_after + 1
    while s <= b - 2 and len(out_window) < max_steps:
        out_window.append(s)
        covered += times[s]
        if covered >= out_need and len(out_window) >= MIN_WINDOW_STEPS:
            break
        s += 1
    if not out_window:
        return
    out_ends = _release_ends(graph, c, out_window)
    if not out_ends:
        return
    out_window = [s for s in range(out_window[0], out_ends[-1] + 1)]
    # copy-in: within the gap, after the first possible copy-out step, ending at b-1
    first_in = max(c.last_forward + 1, out_window[0] + 1)
    in_window, covered = [], 0.0
    s = b - 1
    while s >= first_in and len(in_window) < max_steps:
        in_window.append(s)
        covered += times[s]
        if covered >= in_need and len(in_window) >= MIN_WINDOW_STEPS:
            break
        s -= 1
    in_window.reverse()
    if not in_window:
        return
    in_starts = list(in_window)
    if graph.copy_in_starts:  # a copy-in may only start where the runtime can issue it
        allowed = set(graph.copy_in_starts)
        in_starts = [s for s in in_window if s in allowed]
        if not in_starts:  # reach back to the latest trigger still inside the gap
            earlier = graph.snap_copy_in(in_window[0])
            if earlier < first_in or earlier > in_window[0]:
                return
            in_window = list(range(earlier, b))
            in_starts = [earlier]
        in_window = [s for s in in_window if s >= in_starts[0]]  # nothing flows before the copy starts
    c.out_window, c.in_window = out_window, in_window
    c.out_breaks = _breaks(out_ends)
    c.in_breaks = _breaks(in_starts)


def _release_ends(graph: PlanningGraph, c: Candidate, out_window: list[int]) -> list[int]:
    """The steps of the copy-out window by whose end the copy-out may be done: those right before a step
    where the runtime can release the storage (PlanningGraph.next_release_step), so the memory the MILP
    frees after the copy-out is freed there. When none is inside the window, the window reaches on to the
    first one (while it leaves a step for the copy-in before b); [] when there is none."""
    if not graph.pack_steps and not graph.unpack_steps:
        return list(out_window)
    ends = [s for s in out_window if graph.next_release_step(c, s + 1) == s + 1]
    if ends:
        return ends
    first = graph.next_release_step(c, out_window[-1] + 1)
    return [first - 1] if first - 1 <= c.first_backward - 2 else []


def _breaks(window: list[int]) -> list[int]:
    """At most MAX_WINDOW_BREAKS window steps, evenly spread, always including the first and last."""
    if len(window) <= MAX_WINDOW_BREAKS:
        return list(window)
    step = (len(window) - 1) / (MAX_WINDOW_BREAKS - 1)
    picks = sorted({window[round(k * step)] for k in range(MAX_WINDOW_BREAKS)})
    return picks
