"""Twin layers: the repeated blocks of a model (a decoder's layers, a CNN's stages) whose candidates have
the same variables in the MILP, position by position, so that a plan found for one layer can be tried on
every other at once (the block search's proposals, regen.planner.milp.blocks).

Layers are the calls of the modules `P.0`, `P.1`, ... of every regen.planner.heuristics.outermost_block_parents
P over the profile's module calls (a layer need not be a region; an encoder-decoder's two stacks are layers of
two twin groups). A candidate belongs to the layer whose call made it.
Two layers are twins when their candidates, in producer order, agree one by one in what shapes their action
columns: the producer's offset inside the call, the bytes, the recipe options, the swap, the "rebuilt with"
options (by the other candidate's layer offset and position) and the regions inside the layer that may
rebuild it. Twins' action columns are then listed in the same order (`columns`), so copying one layer's
actions onto its twin's is a plan that differs only there. Their copy windows need not agree (a window ends
where the profiled op times say a copy must be done, and those vary from layer to layer): the binaries of a
window are the caller's to choose again. Whether the copy is a better plan, or a plan at all, is for the
caller to judge: it is a proposal, never an assumption.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass

import numpy as np

from regen.planner.heuristics import numbered_child_of, outermost_block_parents
from regen.planner.milp.model import CandidateVars, Model

MIN_TWIN_LAYERS = 3  # fewer repeated layers gain nothing from proposals


@dataclass
class Twins:
    """Where each candidate sits among the layers, and every layer's discrete columns in twin order."""

    layer_of: dict[int, int]  # candidate index -> layer number (position in the forward)
    position: dict[int, int]  # candidate index -> its position within its layer
    group: list[int]  # per layer: its twin group (layers of one group are twins)
    columns: dict[int, np.ndarray]  # candidate index -> its action columns, in twin order
    window_columns: dict[int, np.ndarray]  # candidate index -> its copy windows' binaries
    members: list[list[int]]  # per layer: its candidates by position

    def twin(self, candidate: int, shift: int) -> int | None:
        """The candidate at the same position `shift` layers away, if that layer is a twin of its own."""
        k = self.layer_of[candidate]
        j = k + shift
        if not 0 <= j < len(self.group) or self.group[j] != self.group[k]:
            return None
        return self.members[j][self.position[candidate]]


@dataclass
class _Layout:
    """Where candidates and regions sit among the layers: what twin keys are read from."""

    layer_of: dict[int, int]
    position: dict[int, int]
    region_at: dict[int, tuple[int, int, int]]  # region index -> (layer, first op, last op: offsets in the layer)

    def rebuilt_key(self, other: int, option: int, k: int) -> tuple:
        """A "rebuilt with" option of a candidate of layer k, as its twins hold it."""
        if other not in self.layer_of:
            return (1, other, option, 0)  # outside the layers: only the very same candidate matches
        return (0, self.layer_of[other] - k, self.position[other], option)

    def region_key(self, region: int, k: int) -> tuple:
        """A region that may rebuild a candidate of layer k, as its twins see it."""
        at = self.region_at.get(region)
        if at is None or at[0] != k:
            return (1, region, 0)  # outside the layer: only the very same region matches
        return (0, at[1], at[2])

    def shape(self, v: CandidateVars, layer_first_op: int) -> tuple:
        """What twin candidates share: everything that decides their action columns and what they mean."""
        k = self.layer_of[v.c.index]
        return (v.c.producer - layer_first_op, v.c.bytes, len(v.rec), v.swap is not None,
                tuple(sorted(self.rebuilt_key(r, option, k) for r, option, _ in v.rebuilt_with)),
                tuple(sorted(self.region_key(r, k) for r, _ in v.regions)))

    def action_columns(self, v: CandidateVars) -> np.ndarray:
        """The candidate's action columns in twin order: recipes, "rebuilt with" and region options by their
        keys, swap."""
        k = self.layer_of[v.c.index]
        rebuilt = [x for _, _, x in sorted(v.rebuilt_with, key=lambda o: self.rebuilt_key(o[0], o[1], k))]
        regions = [x for _, x in sorted(v.regions, key=lambda o: self.region_key(o[0], k))]
        cols = list(v.rec) + rebuilt + regions + ([v.swap] if v.swap is not None else [])
        return np.array([x.index for x in cols], dtype=np.int64)


def find_twins(model: Model) -> Twins | None:
    """The model's twin layers, or None when fewer than MIN_TWIN_LAYERS layers have a twin (the model's
    columns must be numbered: regen.planner.milp.highs.to_highs_lp)."""
    calls = _layer_calls(model)
    if len(calls) < MIN_TWIN_LAYERS:
        return None
    firsts = [c.first_op for c in calls]

    def layer(first_op: int, last_op: int) -> int | None:
        k = bisect.bisect_right(firsts, first_op) - 1
        return k if k >= 0 and last_op <= calls[k].last_op else None

    members: list[list[int]] = [[] for _ in calls]
    for i in sorted(model.vars, key=lambda i: (model.vars[i].c.producer, i)):
        k = layer(model.vars[i].c.producer, model.vars[i].c.producer)
        if k is not None:
            members[k].append(i)
    region_at = {}
    for r in model.regions:
        call = model.regions[r].region.call
        k = layer(call.first_op, call.last_op)
        if k is not None:
            region_at[r] = (k, call.first_op - firsts[k], call.last_op - firsts[k])
    layout = _Layout(layer_of={i: k for k, ms in enumerate(members) for i in ms},
                     position={i: p for ms in members for p, i in enumerate(ms)}, region_at=region_at)
    signatures = [(tuple(layout.shape(model.vars[i], firsts[k]) for i in ms),
                   tuple(sorted(at[1:] for at in region_at.values() if at[0] == k)))
                  for k, ms in enumerate(members)]
    group_of: dict[tuple, int] = {}
    group = [group_of.setdefault(sig, len(group_of)) for sig in signatures]
    if max(np.bincount(group)) < MIN_TWIN_LAYERS:
        return None
    columns = {i: layout.action_columns(model.vars[i]) for i in layout.layer_of}
    window_columns = {i: np.array([x.index for x in list(model.vars[i].od.values()) + list(model.vars[i].is_.values())],
                                  dtype=np.int64) for i in layout.layer_of}
    return Twins(layer_of=layout.layer_of, position=layout.position, group=group, columns=columns,
                 window_columns=window_columns, members=members)


def _layer_calls(model: Model) -> list:
    """The calls of the repeated blocks, in forward order."""
    calls = model.graph.profile.module_calls
    parents = outermost_block_parents([c.module for c in calls])
    return sorted((c for c in calls if any(numbered_child_of(c.module, p) for p in parents)), key=lambda c: c.first_op)


@dataclass
class Proposal:
    """A block's actions copied onto its twins: the whole solution with those columns changed, and the
    columns the caller must solve again (the changed twins' copy-window binaries)."""

    values: np.ndarray
    windows: np.ndarray
    layers: int  # how many layers received a copy


def propose(twins: Twins, solution: np.ndarray, block: list[int]) -> Proposal | None:
    """`block`'s action values copied onto every twin of it that does not overlap it (shifts by whole
    multiples of the layers it spans); None when the block is not inside the layers or no twin's actions
    would change."""
    if any(i not in twins.layer_of for i in block):
        return None
    layers = {twins.layer_of[i] for i in block}
    span = max(layers) - min(layers) + 1
    n = len(twins.group)
    shifts = [d for d in range(-n + 1, n) if d and d % span == 0 and all(twins.twin(i, d) is not None for i in block)]
    values, windows, received = solution.copy(), [], 0
    for d in shifts:
        changed = False
        for i in block:
            j = twins.twin(i, d)
            source, target = twins.columns[i], twins.columns[j]
            if not np.array_equal(values[target], solution[source]):
                values[target] = solution[source]
                windows.append(twins.window_columns[j])
                changed = True
        received += changed
    if not received:
        return None
    return Proposal(values=values, windows=np.concatenate(windows) if windows else np.zeros(0, dtype=np.int64),
                    layers=received)


def layer_blocks(twins: Twins, order: list[int], block_candidates: int, sweeps: int) -> list[list[int]]:
    """One sweep's blocks, cut at the layers' boundaries (shifted by half a layer every other sweep, so no
    pair of neighbours is always split), and blocks of more than 1.5x `block_candidates` halved until
    they are not."""
    starts = {twins.members[k][0] for k in range(len(twins.members)) if twins.members[k]}
    cuts = set()
    for p, i in enumerate(order):
        if i in starts:
            size = len(twins.members[twins.layer_of[i]])
            cuts.add(p + (size // 2 if sweeps % 2 else 0))
    bounds = sorted({0, len(order)} | {c for c in cuts if 0 < c < len(order)})
    blocks = []
    for a, b in zip(bounds, bounds[1:]):
        pieces = 1
        while (b - a) / pieces > 1.5 * block_candidates:
            pieces *= 2
        edges = [a + (b - a) * q // pieces for q in range(pieces + 1)]
        blocks += [order[x:y] for x, y in zip(edges, edges[1:]) if y > x]
    return blocks
