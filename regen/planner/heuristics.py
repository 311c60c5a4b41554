"""Heuristic plans: Chen's sqrt(n) checkpointing, and the greedy plan that warm-starts the MILP.

* `chen`: sqrt(n) checkpointing (Chen et al. 2016) over the forward candidates: every ceil(sqrt(n))-th
  candidate is a checkpoint and kept, every other one is recomputed from the checkpoints (its recipe
  walks through the dropped candidates back to kept ones). Every dropped candidate gets a recipe of
  its own (none is rebuilt with another's), so a segment of k candidates costs up to k(k+1)/2 op
  replays rather than Chen's one: a comparison point, not a competitor.
* `checkpoint_blocks`: per-block activation checkpointing (`torch.utils.checkpoint` on each repeated
  block: the numbered children of every outermost module list, `block_regions`) in regen's terms: every
  block call is a region replayed in backward and rebuilds all its
  members, except those another block holds as its argument (the next block's input), which are kept;
  tensors outside the blocks are kept. A peer for comparison, and a warm start of the MILP.
* `offload_all`: what torchtune's activation offloading and `torch.autograd.graph.save_on_cpu` do:
  every saved tensor of at least OFFLOAD_MIN_BYTES is swapped, copied out after its producer and
  issued back at the start of its copy-in window (about twice its transfer time ahead of its first
  backward use), whatever the cap: a peer paying the same link as regen's plans.
* `greedy`: simulator-driven: while the simulated peak is over the cap, take candidates not resident
  at the worst step by cheapest cost per byte (recompute time, or a swap's estimated exposed
  transfer, its copy-in started after the worst step), or start a swap's copy-in after it where it had
  started before, checking recipe inputs stay resident. Its plans are simulator-feasible by construction.
"""

from __future__ import annotations

import math

from regen.formats.plan import ACTION_RECOMPUTE, ACTION_SWAP
from regen.planner.costs import copy_in_time_s
from regen.planner.graph import Candidate, PlanningGraph
from regen.planner.recipes import build_recipe, recipe_context
from regen.planner.residency import inputs_kept, inputs_to_hold
from regen.planner.result import Choice
from regen.planner.simulator import simulate

MAX_GREEDY_ROUNDS = 400
SWAP_TRAFFIC_WEIGHT = 0.05  # fraction of a swap's transfer time counted even when it hides behind compute
CHEN_MAX_PASSES = 4
OFFLOAD_MIN_BYTES = 1 << 20  # torchtune's activation offloading leaves smaller tensors on the device


def offload_all(graph: PlanningGraph) -> dict[int, Choice]:
    """Swap every candidate of at least OFFLOAD_MIN_BYTES that can be swapped."""
    return {c.index: Choice(ACTION_SWAP, swap_in_step=c.in_breaks[0])
            for c in graph.candidates if c.bytes >= OFFLOAD_MIN_BYTES and c.can_swap}


def chen(graph: PlanningGraph) -> dict[int, Choice]:
    """sqrt(n) checkpointing expressed as recompute decisions."""
    ctx = recipe_context(graph)
    cands = [c for c in graph.candidates if not c.trivial and c.bytes > 0 and c.recipes]
    if not cands:
        return {}
    cands.sort(key=lambda c: (c.producer, c.index))
    segment = max(1, math.ceil(math.sqrt(len(cands))))
    dropped = {c.index for k, c in enumerate(cands) if k % segment != segment - 1}
    choices: dict[int, Choice] = {}
    for _ in range(CHEN_MAX_PASSES):
        choices, failed = {}, set()
        for c in cands:
            if c.index not in dropped:
                continue
            recipe, _why = build_recipe(ctx, c, is_input=lambda a: a.index not in dropped)
            if recipe is None or not inputs_kept(graph, recipe, c.first_backward, dropped):
                failed.add(c.index)
            else:
                choices[c.index] = Choice(ACTION_RECOMPUTE, recipe=recipe)
        if not failed:
            break
        dropped -= failed
    return choices


def checkpoint_blocks(graph: PlanningGraph) -> dict[int, Choice]:
    """Per-block checkpointing as region decisions (see the module doc)."""
    blocks = block_regions(graph)
    held = {a for r in blocks for a in r.inputs}
    choices: dict[int, Choice] = {}
    for r in blocks:
        for t in r.members:
            if t not in held and t not in choices:
                choices[t] = Choice(ACTION_RECOMPUTE, region=r.index)
    return choices


def block_regions(graph: PlanningGraph) -> list:
    """The regions of the model's repeated blocks: calls of the modules `P.0`, `P.1`, ... of every
    `outermost_block_parents` P among the regions' modules (an encoder-decoder's two stacks both)."""
    parents = outermost_block_parents([r.call.module for r in graph.regions])
    return [r for r in graph.regions if any(numbered_child_of(r.call.module, p) for p in parents)]


def outermost_block_parents(modules: list[str]) -> list[str]:
    """The paths P whose numbered children `P.0`, `P.1`, ... are called at least twice among `modules` (the
    module of each call), and that are not inside a numbered child of another such path: a decoder's
    `model.layers`, an encoder-decoder's `encoder.block` and `decoder.block`, ALBERT's one shared layer group
    called once per layer, but not a block's own list of sub-layers or of experts. Where no path's children
    are called twice (a model of one layer), the path with the most numbered children, if any."""
    children: dict[str, set[str]] = {}
    calls: dict[str, int] = {}
    for m in modules:
        parent, _, last = m.rpartition(".")
        if last.isdigit():
            children.setdefault(parent, set()).add(m)
            calls[parent] = calls.get(parent, 0) + 1
    lists = [p for p in children if calls[p] >= 2]
    if not lists:  # the shallowest on a tie
        return [max(children, key=lambda p: (len(children[p]), -p.count(".")))] if children else []
    return sorted(p for p in lists
                  if not any(p.startswith(child + ".") for q in lists if q != p for child in children[q]))


def numbered_child_of(module: str, parent: str) -> bool:
    """`module` is `parent.<number>`."""
    head, _, last = module.rpartition(".")
    return head == parent and last.isdigit()


def greedy(graph: PlanningGraph, cap_bytes: int, allow_swap: bool = True, allow_recompute: bool = True,
           best_effort: bool = False) -> dict[int, Choice] | None:
    """A simulator-feasible plan under the cap, or None when the greedy gets stuck.

    With `best_effort`, the valid plan of lowest simulated peak seen is returned instead of None.
    """
    choices: dict[int, Choice] = {}
    locked: set[int] = set()  # inputs of chosen recipes: must stay resident
    best: tuple[int, dict[int, Choice]] = (graph.unplanned_peak_bytes + 1, {})
    for _ in range(MAX_GREEDY_ROUNDS):
        sim = simulate(graph, choices)
        if sim.valid and sim.peak_bytes < best[0]:
            best = (sim.peak_bytes, dict(choices))
        if sim.fits(cap_bytes):
            return choices
        if not sim.valid:
            break
        worst, step = max((sim.step_bytes(s), s) for s in range(graph.num_steps))
        excess = worst - cap_bytes
        options = _later_copy_ins(graph, step, choices) if allow_swap else []
        for c in graph.candidates:
            if c.index in choices or c.index in locked or c.trivial or c.bytes <= 0:
                continue
            if step not in c.gap:
                continue
            option = _best_option(graph, c, step, choices, allow_swap, allow_recompute)
            if option is not None:
                cost, choice = option
                options.append((cost / c.bytes, c, choice))
        if not options:
            break
        options.sort(key=lambda o: o[0])
        freed = 0
        for _score, c, choice in options:
            if c.index in locked:
                continue  # became a recipe input of a candidate taken this round
            if choice.recipe is not None and not inputs_kept(graph, choice.recipe, c.first_backward, choices):
                continue  # one of its recipe inputs was taken this round
            choices[c.index] = choice
            if choice.recipe is not None:
                locked.update(inputs_to_hold(graph, choice.recipe, c.first_backward))
            freed += c.bytes
            if freed >= excess:
                break
    return best[1] if best_effort else None


def _later_copy_ins(graph: PlanningGraph, step: int, choices: dict[int, Choice]) -> list[tuple[float, Candidate,
                                                                                                  Choice]]:
    """Swaps whose copy-in, started at or before the worst `step`, holds their storage there: each started at
    its first window step after `step` instead, scored by the transfer it no longer hides (the earliest start
    hides the most, and in backward those prefetches can be what passes the cap)."""
    options = []
    for i, ch in choices.items():
        c = graph.candidates[i]
        if ch.action != ACTION_SWAP or ch.swap_in_step is None or not ch.swap_in_step <= step < c.first_backward:
            continue
        option = _swap_after(graph, c, step)
        if option is not None:
            cost, choice = option
            options.append(((cost - _exposed_s(graph, c, ch.swap_in_step)) / c.bytes, c, choice))
    return options


def _swap_after(graph: PlanningGraph, c: Candidate, step: int) -> tuple[float, Choice] | None:
    """Swapping `c` so that it is gone at `step` (its copy-out done before it, its copy-in started after it, at
    the earliest window step that allows): its cost (the transfer its window does not hide, plus a share of
    the rest), or None when its windows do not allow it."""
    if not c.out_window or c.out_window[-1] >= step:
        return None
    later = [s for s in c.in_breaks if s > step]
    if not later:
        return None
    transfer = copy_in_time_s(graph, c.bytes)
    return _exposed_s(graph, c, later[0]) + SWAP_TRAFFIC_WEIGHT * transfer, Choice(ACTION_SWAP,
                                                                                   swap_in_step=later[0])


def _exposed_s(graph: PlanningGraph, c: Candidate, swap_in_step: int) -> float:
    """The part of `c`'s copy-in that the ops from `swap_in_step` to its first backward use do not hide."""
    hidden = sum(graph.time_s[s] for s in c.in_window if s >= swap_in_step)
    return max(0.0, copy_in_time_s(graph, c.bytes) - hidden)


def _best_option(graph: PlanningGraph, c: Candidate, step: int, choices: dict[int, Choice], allow_swap: bool,
                 allow_recompute: bool) -> tuple[float, Choice] | None:
    best = None
    if allow_recompute:
        for recipe in c.recipes:
            if inputs_kept(graph, recipe, c.first_backward, choices):
                best = (recipe.time_s, Choice(ACTION_RECOMPUTE, recipe=recipe))
                break
    if allow_swap and c.can_swap:
        swap = _swap_after(graph, c, step)
        if swap is not None and (best is None or swap[0] < best[0]):
            best = swap
    return best
