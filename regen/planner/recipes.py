"""Recompute recipes: how a candidate is rebuilt at its first backward use, and what it costs.

A recipe (docs/internals.md "Recipes") walks back from the candidate's producer through op inputs
(`op.inputs`) until every input is available: a tensor no op produced (parameter, buffer, batch), or
the producer output of another candidate that is alive at b (a *recipe input*, the plan's
`Decision.recipe_inputs`: inside its own backward window, or kept / swapped back by then, which the
plan must guarantee). Option `depth` d walks
*through* up to d alive candidates on any path (recomputing them as intermediates) instead of
reading them as inputs, so a candidate can be rebuilt from further back when its direct inputs are dropped
too. Random ops are replayed with their RNG state (flagged in the plan's recipe_ops). In-place ops are
replayed only on a *recipe-internal* storage: one whose creating op is in the recipe along with every
in-place write to it that precedes a recipe read of it (its whole write history up to that read,
replayed in forward order, so the replayed storage holds the same contents when it is read). CPU
dropout (`empty_like`, `bernoulli_`, `div_`) is recomputable this way. In-place writes to any other
storage (parameters, the batch, recipe inputs) are never replayed. A collective or an op of FSDP's gathering is
never replayed (`opnames.is_distributed`); a parameter FSDP gathered is read as a parameter, and only by a
recipe whose replay finds it unsharded (regen.planner.fsdp_reads).

"Rebuilt with": a recomputable candidate T whose producer op another candidate R's recipe replays on
the way (before T's first backward use) may be kept from R's rebuild until its own use instead of
replayed again (`Candidate.rebuilt_with_options`, `rebuilt_with_recipe`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable

from regen.formats.profile import PHASE_FORWARD, Profile
from regen.opnames import gathers_parameters, is_distributed, reads_first_arg_metadata_only
from regen.planner.fsdp_reads import gathered_storages, resharded_read

if TYPE_CHECKING:
    from regen.planner.graph import Candidate, PlanningGraph

MAX_RECIPE_OPS = 32  # longer chains are not recomputable
MAX_RECIPE_DEPTH = 2  # recipe options walk through at most this many alive candidates on a path
MAX_REBUILT_WITH_OPTIONS = 3  # recipes of other candidates a candidate may be rebuilt with


@dataclass
class Recipe:
    """One way to rebuild a candidate at its first backward use."""

    ops: list[int]  # forward op indices, execution order, ending with the producer
    inputs: list[int]  # candidate indices (PlanningGraph.candidates) that must be resident at b (Decision.recipe_inputs)
    time_s: float
    transient_bytes: int  # intermediates' bytes (freed once the candidate is rebuilt)
    random_ops: list[int] = field(default_factory=list)


@dataclass
class RecipeContext:
    """What recipe walks look up: tensors by id, candidates by tensor, in-place writers and creators."""

    graph: PlanningGraph
    tensors: dict
    cand_by_tensor: dict[int, Candidate]
    # storage -> the ops (any phase, increasing) that wrote it in place
    inplace_writers: dict[int, list[int]] = field(default_factory=dict)
    # storage -> the op that created it: the first op with a non-view, non-in-place output over it that
    # read no tensor of that storage (absent for parameters, buffers, the batch)
    creator: dict[int, int] = field(default_factory=dict)
    # storage -> the forward ops that gathered an FSDP parameter into it (regen.planner.fsdp_reads)
    gathered: dict[int, list[int]] = field(default_factory=dict)


def add_recipes(graph: PlanningGraph) -> None:
    """Every candidate's recompute options (depth 0 .. MAX_RECIPE_DEPTH, distinct, cheapest first), or
    the reason it is not recomputable."""
    ctx = recipe_context(graph)
    for c in graph.candidates:
        if c.trivial or c.bytes <= 0:
            continue
        options: list[Recipe] = []
        reason = None
        for depth in range(MAX_RECIPE_DEPTH + 1):
            recipe, why = build_recipe(ctx, c, depth=depth)
            if recipe is None:
                reason = reason or why
                break
            if not any(r.ops == recipe.ops for r in options):
                options.append(recipe)
            if not recipe.inputs:
                break  # nothing left to walk through
        c.recipes = options
        c.not_recomputable = None if options else reason


def storage_writes(profile: Profile, tensors: dict) -> tuple[dict[int, list[int]], dict[int, int]]:
    """(storage -> the in-place ops that wrote it, increasing; storage -> the op that created it: the
    first non-view, non-in-place op with an output over it that read no tensor of that storage). An
    in-place op writes every storage among its outputs, which list the arguments its schema writes,
    returned or not (regen.opinfo.op_outputs: `rrelu_with_noise` writes its noise argument). FSDP's
    gathering writes parameters, not the step's values (regen.planner.fsdp_reads): not counted here."""
    inplace_writers: dict[int, list[int]] = {}
    creator: dict[int, int] = {}
    for op in profile.ops:
        if op.is_view or gathers_parameters(op.name):
            continue
        out_storages = {tensors[o].storage for o in op.outputs if o in tensors and tensors[o].storage_bytes}
        if op.is_inplace:
            for st in sorted(out_storages):
                inplace_writers.setdefault(st, []).append(op.index)
            continue
        in_storages = {tensors[x].storage for x in op.inputs if x in tensors}
        for st in out_storages - in_storages:
            creator.setdefault(st, op.index)
    return inplace_writers, creator


def recipe_context(graph: PlanningGraph) -> RecipeContext:
    profile = graph.profile
    tensors = profile.tensor_by_id()
    cand_by_tensor = {c.saved.tensor: c for c in graph.candidates}
    inplace_writers, creator = storage_writes(profile, tensors)
    return RecipeContext(graph, tensors, cand_by_tensor, inplace_writers, creator,
                         gathered_storages(profile, tensors))


def build_recipe(ctx: RecipeContext, target: Candidate, depth: int = 0,
                 is_input: Callable[[Candidate], bool] | None = None) -> tuple[Recipe | None, str | None]:
    """The recipe that rebuilds `target` at its first backward use.

    An alive candidate met on the way is an input of the recipe unless the walk may go through it: up to `depth`
    alive candidates per path are walked through; with `is_input`, exactly the candidates it accepts
    (and that are alive at b) are inputs. Returns (None, reason) when the target cannot be recomputed.
    """
    ops = ctx.graph.profile.ops
    if ops[target.producer].phase != PHASE_FORWARD:
        return None, "its producer is not a forward op"
    later = [w for w in ctx.inplace_writers.get(target.saved.storage, []) if w > target.producer]
    if later:
        return None, f"op {later[0]} ({ops[later[0]].name}) writes its storage in place after its producer"
    walk = _RecipeWalk(ctx, target, is_input)
    why = walk.visit_op(target.producer, depth)
    if why:
        return None, why
    order = sorted(walk.recipe_ops)
    why = resharded_read(ctx.graph.profile, ctx.tensors, ctx.gathered, order, target.first_backward)
    if why:
        return None, why
    op_times_s = float(sum(ctx.graph.time_s[q] for q in order))
    return Recipe(ops=order, inputs=sorted(walk.inputs), time_s=ctx.graph.costs.recipe_time_s(op_times_s, len(order)),
                  transient_bytes=recipe_transient_bytes(ctx.graph.profile, ctx.tensors, order,
                                                         target.saved.storage),
                  random_ops=[q for q in order if ops[q].is_random]), None


class _RecipeWalk:
    """One walk back from a target's producer; each visit returns why the target is not recomputable,
    or None."""

    def __init__(self, ctx: RecipeContext, target: Candidate, is_input: Callable[[Candidate], bool] | None):
        self.ctx = ctx
        self.ops = ctx.graph.profile.ops
        self.target = target
        self.is_input = is_input
        self.recipe_ops: set[int] = set()
        self.inputs: set[int] = set()

    def written_storages(self, q: int) -> set[int]:
        op = self.ops[q]
        if not op.is_inplace:
            return set()
        return {self.ctx.tensors[o].storage for o in op.outputs if o in self.ctx.tensors}

    def visit_history(self, storage: int, before: int, budget: int) -> str | None:
        """Put the creating op and every in-place write before op `before` of a storage into the recipe,
        so the replay rebuilds its contents as op `before` saw them in forward."""
        writers = self.ctx.inplace_writers.get(storage)
        if not writers:
            return None
        first = self.ctx.creator.get(storage)
        if first is None or first > writers[0]:
            return (f"op {writers[0]} ({self.ops[writers[0]].name}) is in-place on a storage no recipe op creates "
                    f"(a parameter, the batch, or a tensor made outside the step)")
        for w in [first] + [w for w in writers if w < before]:
            why = self.visit_op(w, budget)
            if why:
                return why
        return None

    def visit_op(self, q: int, budget: int) -> str | None:
        if q in self.recipe_ops:
            return None
        op = self.ops[q]
        if op.phase != PHASE_FORWARD:
            return f"op {q} ({op.name}) is not a forward op"
        if is_distributed(op.name):
            return f"op {q} ({op.name}) is a collective or FSDP's gathering, which one rank cannot replay"
        self.recipe_ops.add(q)
        if len(self.recipe_ops) > MAX_RECIPE_OPS:
            return f"its recipe is longer than {MAX_RECIPE_OPS} ops"
        for st in self.written_storages(q):  # in-place: the storage's earlier history is replayed first
            why = self.visit_history(st, q, budget)
            if why:
                return why
        inputs = op.inputs[1:] if reads_first_arg_metadata_only(op.name) else op.inputs  # empty_like(x)
        for x in inputs:
            why = self.visit_tensor(x, q, budget)
            if why:
                return why
        return None

    def visit_tensor(self, x: int, reader: int, budget: int) -> str | None:
        ctx = self.ctx
        rec = ctx.tensors.get(x)
        if rec is None or rec.producer_op is None:
            if rec is not None and rec.storage in ctx.inplace_writers:
                return f"input tensor {x} is modified in place"
            return None  # parameter, buffer or batch: captured by reference
        overwritten = rec.storage in self.written_storages(reader)  # the reader writes it: rebuild, never an input
        cand = ctx.cand_by_tensor.get(x)
        if cand is not None and cand is not self.target and cand.bytes > 0 and not overwritten:
            alive = cand.last_backward is not None and cand.last_backward >= self.target.first_backward
            if alive:
                as_input = self.is_input(cand) if self.is_input else budget <= 0
                if as_input:
                    self.inputs.add(cand.index)
                    return None
                budget -= 1
        why = self.visit_history(rec.storage, reader, budget)
        if why:
            return why
        return self.visit_op(rec.producer_op, budget)


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


def add_rebuilt_with_options(graph: PlanningGraph) -> None:
    """For every recomputable candidate, the recipes of others that replay its producer op before its
    first backward use (a rebuilt intermediate can be kept until its own use instead of recomputed
    twice: what a checkpointed block does for all its intermediates). At most MAX_REBUILT_WITH_OPTIONS,
    the latest first (the shorter the wait, the less memory the kept intermediate holds)."""
    by_op: dict[int, list[tuple[int, int]]] = {}
    for r in graph.candidates:
        if not r.can_recompute or r.bytes <= 0:
            continue
        for k, recipe in enumerate(r.recipes):
            for q in recipe.ops[:-1]:  # the last op is r's own producer
                by_op.setdefault(q, []).append((r.index, k))
    for c in graph.candidates:
        if not c.can_recompute or c.bytes <= 0:
            continue
        options = [(r, k) for r, k in by_op.get(c.producer, ())
                   if r != c.index and graph.candidates[r].producer != c.producer
                   and graph.candidates[r].first_backward <= c.first_backward]
        options.sort(key=lambda o: (-graph.candidates[o[0]].first_backward,
                                    graph.candidates[o[0]].recipes[o[1]].time_s))
        c.rebuilt_with_options = options[:MAX_REBUILT_WITH_OPTIONS]


def rebuilt_with_recipe(graph: PlanningGraph, c: Candidate, rebuilt_with: int, option: int) -> Recipe:
    """The recipe of a candidate rebuilt with candidate `rebuilt_with`'s recipe `option`: that recipe's
    ops up to this candidate's producer, no inputs of its own, no time and no transient of its own (the
    other recipe pays)."""
    ops = [q for q in graph.candidates[rebuilt_with].recipes[option].ops if q <= c.producer]
    return Recipe(ops=ops, inputs=[], time_s=0.0, transient_bytes=0)
