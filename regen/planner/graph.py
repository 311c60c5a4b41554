"""The planning graph: a profile turned into what the planner decides over.

* an op dependency graph (networkx `DiGraph`, op index -> op index through tensors) used to walk
  recompute recipes;
* one `Candidate` per saved tensor: bytes, producer p, last forward use f, first/last backward use
  b/e, the gap (f, b) where the action matters, the copy-out and copy-in windows a swap may use, and
  the recompute options (`Recipe`: forward ops back to tensors that can be resident at b);
* the unplanned memory timeline (after and peak of every op) that planned memory is measured against:
  whatever the action, t is resident on [p, f] and [b, e]; an action only removes t's bytes from
  steps of its gap, so planned memory = unplanned memory - bytes of candidates not resident then
  (+ recompute transients). This is the "base + resident candidates" accounting of DESIGN.md.

Recipes (docs/internals.md "Recipes"): from the producer, walk back through op inputs until every
input is available: a tensor no op produced (parameter, buffer, batch), or the producer output of
another candidate that is alive at b (an *anchor*: inside its own backward window, or kept / swapped
back by then, which the MILP enforces with a linear constraint). Option `depth` d walks *through* up
to d alive candidates on any path (recomputing them as intermediates) instead of anchoring on them,
so a candidate can be rebuilt from further back when its direct inputs are dropped too. Random ops are
replayed with their RNG state (flagged in the plan's recipe_ops). In-place ops are replayed only on a
*recipe-internal* storage: one whose creating op is in the recipe along with every in-place write to it
that precedes a recipe read of it (its whole write history up to that read, replayed in forward order,
so the replayed storage holds the same contents when it is read). CPU dropout
(`empty_like`, `bernoulli_`, `div_`) is recomputable this way. In-place writes to any other storage
(parameters, the batch, anchors) are never replayed.
"""

from __future__ import annotations

import bisect

from dataclasses import dataclass, field
from typing import Callable

import networkx as nx

from regen.errors import RegenError
from regen.opinfo import reads_first_arg_metadata_only
from regen.formats.profile import PHASE_FORWARD, Profile, SavedTensor

MAX_RECIPE_OPS = 32  # longer chains are not recomputable
MAX_RECIPE_DEPTH = 2  # recipe options walk through at most this many alive candidates on a path
MIN_WINDOW_STEPS = 2  # a swap's copy window covers at least this many steps (when the gap allows)
MAX_WINDOW_STEPS = 32  # ... and at most this many: keeps the MILP O(candidates x window)
MAX_HOSTS = 3  # recipes of other candidates a candidate may be rebuilt with (see _set_hosts)
MAX_WINDOW_BREAKS = 6  # steps of a window where the copy's state (done / started) may change
WINDOW_TRANSFER_FACTOR = 2.0  # a window covers this many times the tensor's own transfer time
FALLBACK_BANDWIDTH_BYTES_PER_S = 10e9  # when a profile records no bandwidth


@dataclass
class Recipe:
    """One way to rebuild a candidate at its first backward use."""

    ops: list[int]  # forward op indices, execution order, ending with the producer
    anchors: list[int]  # candidate indices (PlanningGraph.candidates) that must be resident at b
    time_s: float
    transient_bytes: int  # intermediates' bytes (freed once the candidate is rebuilt)
    random_ops: list[int] = field(default_factory=list)


@dataclass
class Candidate:
    index: int  # position in PlanningGraph.candidates
    saved: SavedTensor
    bytes: int
    producer: int  # p
    last_forward: int  # f
    first_backward: int | None  # b
    last_backward: int | None  # e
    issue_after: int  # op after which a copy-out can start (all entries packed)
    out_window: list[int] = field(default_factory=list)  # steps a copy-out may use
    in_window: list[int] = field(default_factory=list)  # steps a copy-in may use (ends at b-1)
    out_breaks: list[int] = field(default_factory=list)  # window steps where "copy-out done" may turn on
    in_breaks: list[int] = field(default_factory=list)  # window steps where the copy-in may start
    recipes: list[Recipe] = field(default_factory=list)  # recompute options, cheapest first
    not_recomputable: str | None = None
    # recipes of other candidates that rebuild this one on the way, as (candidate index, recipe option),
    # run at or before this one's first backward use: "rebuilt with" them, it costs no compute of its own
    hosts: list[tuple[int, int]] = field(default_factory=list)

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

    def alive_at(self, step: int) -> bool:
        """Resident at `step` whatever its action ([p, f] or [b, e])."""
        if self.producer <= step <= self.last_forward:
            return True
        return self.first_backward is not None and self.first_backward <= step <= self.last_backward


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

    def snap_copy_in(self, step: int) -> int:
        """The step where a copy-in planned to start before `step` really starts: the latest runtime
        trigger at or before it (earlier, never later, so a copy-in is never late)."""
        starts = self.copy_in_starts
        if not starts:
            return step
        k = bisect.bisect_right(starts, step) - 1
        return starts[k] if k >= 0 else starts[0]

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


def build_graph(profile: Profile, d2h_bytes_per_s: float | None = None,
                h2d_bytes_per_s: float | None = None) -> PlanningGraph:
    """Candidates, lifetimes, windows and recipes of a profile."""
    if not profile.ops:
        raise RegenError("the profile has no ops; nothing to plan")
    d2h = d2h_bytes_per_s or profile.device.d2h_bytes_per_s or FALLBACK_BANDWIDTH_BYTES_PER_S
    h2d = h2d_bytes_per_s or profile.device.h2d_bytes_per_s or FALLBACK_BANDWIDTH_BYTES_PER_S
    if d2h <= 0 or h2d <= 0:
        raise RegenError(f"copy bandwidth must be positive (got d2h {d2h}, h2d {h2d} bytes/s)")
    ops = profile.ops
    times = [max(0.0, float(op.time_s)) for op in ops]
    after = [int(op.memory_after_bytes) for op in ops]
    peak = [max(int(op.memory_peak_bytes), int(op.memory_after_bytes)) for op in ops]
    op_graph = _op_graph(profile)

    pack_after: dict[int, int] = {}
    for entry in profile.saved_entries:
        if entry.saved_tensor is not None:
            pack_after[entry.saved_tensor] = max(pack_after.get(entry.saved_tensor, -1), entry.pack_after_op)

    candidates = []
    for i, s in enumerate(sorted(profile.saved_tensors, key=lambda s: (s.producer_op, s.id))):
        b = s.first_backward_use
        e = s.last_backward_use
        f = max(s.last_forward_use, s.producer_op)
        c = Candidate(index=i, saved=s, bytes=int(s.bytes), producer=s.producer_op, last_forward=f,
                      first_backward=b, last_backward=e,
                      issue_after=max(s.producer_op, pack_after.get(s.id, s.producer_op)))
        candidates.append(c)
    copy_in_starts = sorted({e.unpack_before_op for e in profile.saved_entries
                             if e.unpack_order is not None and e.unpack_before_op is not None})
    graph = PlanningGraph(profile=profile, op_graph=op_graph, candidates=candidates, time_s=times,
                          after_bytes=after, peak_bytes=peak, d2h_bytes_per_s=float(d2h),
                          h2d_bytes_per_s=float(h2d), num_forward_ops=profile.num_forward_ops,
                          copy_in_starts=copy_in_starts)
    for c in candidates:
        if c.trivial or c.bytes <= 0:
            continue
        _set_windows(graph, c)
    _set_recipes(graph)
    _set_hosts(graph)
    return graph


def byproduct_recipe(graph: PlanningGraph, c: Candidate, host: int, option: int) -> Recipe:
    """The recipe of a candidate rebuilt with `host`'s recipe `option`: the host's ops up to this
    candidate's producer, no inputs of its own, no time and no transient of its own (the host pays)."""
    ops = [q for q in graph.candidates[host].recipes[option].ops if q <= c.producer]
    return Recipe(ops=ops, anchors=[], time_s=0.0, transient_bytes=0)


def _set_hosts(graph: PlanningGraph) -> None:
    """For every recomputable candidate, the recipes of others that replay its producer op before its
    first backward use (a rebuilt intermediate can be kept until its own use instead of recomputed
    twice: what a checkpointed block does for all its intermediates). At most MAX_HOSTS, the latest
    first (the shorter the wait, the less memory the kept intermediate holds)."""
    by_op: dict[int, list[tuple[int, int]]] = {}
    for g in graph.candidates:
        if not g.can_recompute or g.bytes <= 0:
            continue
        for k, r in enumerate(g.recipes):
            for q in r.ops[:-1]:  # the last op is g's own producer
                by_op.setdefault(q, []).append((g.index, k))
    for c in graph.candidates:
        if not c.can_recompute or c.bytes <= 0:
            continue
        hosts = [(g, k) for g, k in by_op.get(c.producer, ())
                 if g != c.index and graph.candidates[g].producer != c.producer
                 and graph.candidates[g].first_backward <= c.first_backward]
        hosts.sort(key=lambda h: (-graph.candidates[h[0]].first_backward, graph.candidates[h[0]].recipes[h[1]].time_s))
        c.hosts = hosts[:MAX_HOSTS]


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


def _set_windows(graph: PlanningGraph, c: Candidate) -> None:
    """Bounded copy windows: steps after the pack (copy-out) and before b (copy-in)."""
    b = c.first_backward
    times = graph.time_s
    out_need = WINDOW_TRANSFER_FACTOR * c.bytes / graph.d2h_bytes_per_s
    in_need = WINDOW_TRANSFER_FACTOR * c.bytes / graph.h2d_bytes_per_s
    # copy-out: o+1 .. at most b-2 (the copy-in needs a step after it)
    out_window, covered = [], 0.0
    s = c.issue_after + 1
    while s <= b - 2 and len(out_window) < MAX_WINDOW_STEPS:
        out_window.append(s)
        covered += times[s]
        if covered >= out_need and len(out_window) >= MIN_WINDOW_STEPS:
            break
        s += 1
    if not out_window:
        return
    # copy-in: within the gap, after the first possible copy-out step, ending at b-1
    first_in = max(c.last_forward + 1, out_window[0] + 1)
    in_window, covered = [], 0.0
    s = b - 1
    while s >= first_in and len(in_window) < MAX_WINDOW_STEPS:
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
    c.out_breaks = _breaks(out_window)
    c.in_breaks = _breaks(in_starts)


def _breaks(window: list[int]) -> list[int]:
    """At most MAX_WINDOW_BREAKS window steps, evenly spread, always including the first and last."""
    if len(window) <= MAX_WINDOW_BREAKS:
        return list(window)
    step = (len(window) - 1) / (MAX_WINDOW_BREAKS - 1)
    picks = sorted({window[round(k * step)] for k in range(MAX_WINDOW_BREAKS)})
    return picks


# ---- recipes -----------------------------------------------------------------------------------


@dataclass
class _RecipeContext:
    graph: PlanningGraph
    tensors: dict
    cand_by_tensor: dict[int, Candidate]
    # storage -> the ops (any phase, increasing) that wrote it in place
    inplace_writers: dict[int, list[int]] = field(default_factory=dict)
    # storage -> the op that created it: the first op with a non-view, non-in-place output over it that
    # read no tensor of that storage (absent for parameters, buffers, the batch)
    creator: dict[int, int] = field(default_factory=dict)


def _set_recipes(graph: PlanningGraph) -> None:
    ctx = recipe_context(graph)
    for c in graph.candidates:
        if c.trivial or c.bytes <= 0:
            continue
        options: list[Recipe] = []
        reason = None
        for depth in range(MAX_RECIPE_DEPTH + 1):
            recipe, why = build_recipe(ctx, c, lambda a, d=depth: d)
            if recipe is None:
                reason = reason or why
                break
            if not any(r.ops == recipe.ops for r in options):
                options.append(recipe)
            if not recipe.anchors:
                break  # nothing left to walk through
        c.recipes = options
        c.not_recomputable = None if options else reason


def recipe_context(graph: PlanningGraph) -> _RecipeContext:
    """What recipe walks look up: tensors by id, candidates by tensor, in-place writers and creators."""
    profile = graph.profile
    tensors = profile.tensor_by_id()
    cand_by_tensor = {c.saved.tensor: c for c in graph.candidates}
    inplace_writers: dict[int, list[int]] = {}
    creator: dict[int, int] = {}
    for op in profile.ops:
        if op.is_view:
            continue
        out_storages = {tensors[o].storage for o in op.outputs if o in tensors and tensors[o].storage_bytes}
        if op.is_inplace:
            for st in sorted(out_storages):
                inplace_writers.setdefault(st, []).append(op.index)
            continue
        in_storages = {tensors[x].storage for x in op.inputs if x in tensors}
        for st in out_storages - in_storages:
            creator.setdefault(st, op.index)
    return _RecipeContext(graph, tensors, cand_by_tensor, inplace_writers, creator)


def build_recipe(ctx: _RecipeContext, target: Candidate,
                 walk_budget: Callable[[Candidate], int] | None = None,
                 is_anchor: Callable[[Candidate], bool] | None = None) -> tuple[Recipe | None, str | None]:
    """The recipe that rebuilds `target` at its first backward use.

    An alive candidate met on the way is an anchor unless the walk may go through it: with
    `walk_budget(target)` = d, up to d alive candidates per path are walked through; with
    `is_anchor`, exactly the candidates it accepts (and that are alive at b) are anchors.
    Returns (None, reason) when the target cannot be recomputed.
    """
    graph = ctx.graph
    ops = graph.profile.ops
    b = target.first_backward
    if ops[target.producer].phase != PHASE_FORWARD:
        return None, "its producer is not a forward op"
    later = [w for w in ctx.inplace_writers.get(target.saved.storage, []) if w > target.producer]
    if later:
        return None, f"op {later[0]} ({ops[later[0]].name}) writes its storage in place after its producer"
    budget0 = walk_budget(target) if walk_budget else 0
    recipe_ops: set[int] = set()
    anchors: set[int] = set()

    def written_storages(q: int) -> set[int]:
        op = ops[q]
        if not op.is_inplace:
            return set()
        return {ctx.tensors[o].storage for o in op.outputs if o in ctx.tensors}

    def visit_history(storage: int, before: int, budget: int) -> str | None:
        """Put the creating op and every in-place write before op `before` of a storage into the recipe,
        so the replay rebuilds its contents as op `before` saw them in forward."""
        writers = ctx.inplace_writers.get(storage)
        if not writers:
            return None
        first = ctx.creator.get(storage)
        if first is None or first > writers[0]:
            return (f"op {writers[0]} ({ops[writers[0]].name}) is in-place on a storage no recipe op creates "
                    f"(a parameter, the batch, or a tensor made outside the step)")
        for w in [first] + [w for w in writers if w < before]:
            why = visit_op(w, budget)
            if why:
                return why
        return None

    def visit_op(q: int, budget: int) -> str | None:
        if q in recipe_ops:
            return None
        op = ops[q]
        if op.phase != PHASE_FORWARD:
            return f"op {q} ({op.name}) is not a forward op"
        recipe_ops.add(q)
        if len(recipe_ops) > MAX_RECIPE_OPS:
            return f"its recipe is longer than {MAX_RECIPE_OPS} ops"
        for st in written_storages(q):  # in-place: the storage's earlier history is replayed first
            why = visit_history(st, q, budget)
            if why:
                return why
        inputs = op.inputs[1:] if reads_first_arg_metadata_only(op.name) else op.inputs  # empty_like(x)
        for x in inputs:
            why = visit_tensor(x, q, budget)
            if why:
                return why
        return None

    def visit_tensor(x: int, reader: int, budget: int) -> str | None:
        rec = ctx.tensors.get(x)
        if rec is None or rec.producer_op is None:
            if rec is not None and rec.storage in ctx.inplace_writers:
                return f"input tensor {x} is modified in place"
            return None  # parameter, buffer or batch: captured by reference
        overwritten = rec.storage in written_storages(reader)  # the reader writes it: rebuild, never anchor
        cand = ctx.cand_by_tensor.get(x)
        if cand is not None and cand is not target and cand.bytes > 0 and not overwritten:
            alive = cand.last_backward is not None and cand.last_backward >= b
            if alive:
                anchor = is_anchor(cand) if is_anchor else budget <= 0
                if anchor:
                    anchors.add(cand.index)
                    return None
                budget -= 1
        why = visit_history(rec.storage, reader, budget)
        if why:
            return why
        return visit_op(rec.producer_op, budget)

    why = visit_op(target.producer, budget0)
    if why:
        return None, why
    order = sorted(recipe_ops)
    return Recipe(ops=order, anchors=sorted(anchors), time_s=float(sum(graph.time_s[q] for q in order)),
                  transient_bytes=recipe_transient_bytes(graph.profile, ctx.tensors, order, target.saved.storage),
                  random_ops=[q for q in order if ops[q].is_random]), None


def recipe_transient_bytes(profile: Profile, tensors: dict, order: list[int], target_storage: int) -> int:
    """Peak bytes of a recipe's intermediates while it replays (the target itself excluded).

    Contract with the runtime: a replay frees each intermediate after its last use inside the recipe
    (they are locals of the replay), so the transient is the peak of the live intermediates, not
    their sum.
    """
    ops = profile.ops
    last_read: dict[int, int] = {}
    for pos, q in enumerate(order):
        for x in ops[q].inputs:
            rec = tensors.get(x)
            if rec is not None:
                last_read[rec.storage] = pos
    live: dict[int, int] = {}
    peak = 0
    for pos, q in enumerate(order):
        if not ops[q].is_view:
            for o in ops[q].outputs:
                rec = tensors.get(o)
                if rec is not None and rec.storage != target_storage:
                    live[rec.storage] = rec.storage_bytes
        peak = max(peak, sum(live.values()))
        for st in [st for st in live if last_read.get(st, -1) <= pos]:
            del live[st]
    return int(peak)


def anchor_resident_without_plan(anchor: Candidate, step: int) -> bool:
    """The anchor is resident at `step` whatever its action (trivial, or inside [b, e])."""
    if anchor.trivial:
        return anchor.producer <= step <= (anchor.last_backward if anchor.last_backward is not None
                                           else anchor.last_forward)
    return anchor.first_backward <= step <= anchor.last_backward
