"""The plan read once into the lookup tables the runtime matches against.

`PlanIndex` holds the decisions by `(producer_op, output_slot)` (each a `DecisionInfo`: shape and dtype
parsed, recipe inputs and the rebuilt-with link as keys), the recipe op names and randomness, the
recipe inputs some recipe reads, and the regions (`RegionInfo`: packs as decision keys, found by module call).
`index_plan` checks the plan for internal consistency: a plan that contradicts itself is a FormatError.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from regen.errors import FormatError
from regen.formats.plan import (ACTION_RECOMPUTE, ACTION_SWAP, Decision, Plan, RegionDecision, rebuilt_with_error,
                                region_error)


def parse_dtype(name: str, where: str) -> torch.dtype:
    dtype = getattr(torch, name.rsplit(".", 1)[-1], None)
    if not isinstance(dtype, torch.dtype):
        raise FormatError(f"{where}: unknown dtype '{name}'")
    return dtype


@dataclass
class DecisionInfo:
    """A decision with what the runtime checks and needs, precomputed."""

    decision: Decision
    key: tuple[int, int]
    shape: torch.Size
    dtype: torch.dtype
    action: str
    recipe_inputs: tuple[tuple[int, int], ...] = ()  # recipe_inputs as (producer_op, output_slot)
    rebuilt_with: tuple[int, int] | None = None  # the decision whose recipe rebuilds this one (Decision.rebuilt_with)
    rebuilds: tuple[tuple[int, int], ...] = ()  # decisions rebuilt with this one's recipe, kept for their use
    region: int | None = None  # rebuilt by replaying Plan.regions[region] (Decision.region)


@dataclass
class RegionInfo:
    """A plan region with its packs as decision keys."""

    region: RegionDecision
    pack_keys: tuple[tuple[int, int] | None, ...]  # per pack of the call: the member rebuilt there, or None
    # per pack of the call that gives a member: (shape, stride, storage offset, dtype, storage bytes) as the
    # forward packed it, recorded by the steps that match packs through the writer map (region_replays.py)
    member_geometry: dict[int, tuple] = field(default_factory=dict)
    # whether the call draws from Python's or NumPy's global RNG (region_replays.py), from the handle's first
    # step on: None until a call of it has returned
    draws_host_rng: bool | None = None


@dataclass
class PlanIndex:
    """A plan's lookup tables (see the module doc)."""

    plan: Plan
    decisions: dict[tuple[int, int], DecisionInfo]
    recipe_op_names: dict[int, str]
    recipe_op_random: dict[int, bool]
    recipe_input_keys: frozenset  # candidates some recompute decision reads
    num_forward_ops: int
    has_recipes: bool = False  # any recompute decision with a recipe (fast steps then keep a minimal dispatch mode)
    swap_bytes: int = 0
    regions: dict[int, RegionInfo] = field(default_factory=dict)  # by RegionDecision.id
    region_by_call: dict[tuple[str, int], int] = field(default_factory=dict)  # (module, call) -> region id
    region_replay_order: tuple[tuple[int, int], ...] = ()  # (unpack position, region id): the replays, in order


def index_plan(plan: Plan) -> PlanIndex:
    """Read a plan into lookup tables, refusing plans that contradict themselves."""
    where = "plan"
    n_fwd = plan.num_forward_ops
    if n_fwd <= 0:
        raise FormatError(f"{where}: num_forward_ops is {n_fwd}; a plan covers at least one forward op")
    by_saved: dict[int, Decision] = {}
    decisions: dict[tuple[int, int], DecisionInfo] = {}
    for d in plan.decisions:
        key = (d.producer_op, d.output_slot)
        if key in decisions:
            raise FormatError(f"{where}: two decisions for op {d.producer_op} output {d.output_slot}")
        if not 0 <= d.producer_op < n_fwd:
            raise FormatError(f"{where}: decision for saved tensor {d.saved_tensor} names op {d.producer_op}, "
                              f"outside the forward (0..{n_fwd - 1})")
        if d.action == ACTION_SWAP and d.release_at_pack is None and d.release_at_unpack is None:
            raise FormatError(f"{where}: the swap of saved tensor {d.saved_tensor} has no release point "
                              f"(release_at_pack or release_at_unpack): solve the profile again with this regen")
        by_saved[d.saved_tensor] = d
        decisions[key] = DecisionInfo(decision=d, key=key, shape=torch.Size(d.shape),
                                      dtype=parse_dtype(d.dtype, f"{where}: saved tensor {d.saved_tensor}"),
                                      action=d.action)
    names = {r.index: r.name for r in plan.recipe_ops}
    randoms = {r.index: bool(r.is_random) for r in plan.recipe_ops}
    recipe_inputs: set[tuple[int, int]] = set()
    for info in decisions.values():
        d = info.decision
        if info.action != ACTION_RECOMPUTE:
            continue
        why = region_error(d, plan.regions)
        if why:
            raise FormatError(f"{where}: saved tensor {d.saved_tensor} {why}")
        if d.region is not None:
            info.region = d.region
            continue
        if not d.recipe or info.key[0] not in d.recipe:
            raise FormatError(f"{where}: the recipe of saved tensor {d.saved_tensor} does not run its producer "
                              f"op {d.producer_op}")
        if list(d.recipe) != sorted(set(d.recipe)):
            raise FormatError(f"{where}: the recipe of saved tensor {d.saved_tensor} is not in execution order")
        for r in d.recipe:
            if r not in names:
                raise FormatError(f"{where}: recipe op {r} (saved tensor {d.saved_tensor}) is missing from recipe_ops")
            if not 0 <= r < n_fwd:
                raise FormatError(f"{where}: recipe op {r} is outside the forward (0..{n_fwd - 1})")
        keys = []
        for sid in d.recipe_inputs:
            src = by_saved.get(sid)
            if src is None:
                raise FormatError(f"{where}: saved tensor {d.saved_tensor} reads saved tensor {sid}, "
                                  f"which has no decision")
            keys.append((src.producer_op, src.output_slot))
        info.recipe_inputs = tuple(keys)
        recipe_inputs.update(keys)
    for info in decisions.values():
        d = info.decision
        if d.rebuilt_with is None:
            continue
        why = rebuilt_with_error(d, by_saved)
        if why:
            raise FormatError(f"{where}: saved tensor {d.saved_tensor} {why}")
        rebuilder = by_saved[d.rebuilt_with]
        rebuilder_info = decisions[(rebuilder.producer_op, rebuilder.output_slot)]
        info.rebuilt_with = rebuilder_info.key
        rebuilder_info.rebuilds = rebuilder_info.rebuilds + (info.key,)
    swap_bytes = sum(i.decision.bytes for i in decisions.values() if i.action == ACTION_SWAP)
    has_recipes = any(i.action == ACTION_RECOMPUTE and i.region is None for i in decisions.values())
    regions = _index_regions(plan, by_saved, where)
    return PlanIndex(plan=plan, decisions=decisions, recipe_op_names=names, recipe_op_random=randoms,
                     recipe_input_keys=frozenset(recipe_inputs), num_forward_ops=n_fwd,
                     has_recipes=has_recipes, swap_bytes=swap_bytes, regions=regions,
                     region_by_call={(r.region.module, r.region.call): rid for rid, r in regions.items()},
                     region_replay_order=tuple(sorted((r.region.replay_at_unpack, rid) for rid, r in regions.items()
                                                      if r.region.replay_at_unpack is not None)))


def _index_regions(plan: Plan, by_saved: dict[int, Decision], where: str) -> dict[int, RegionInfo]:
    """The plan's regions with their packs as decision keys; a region pack names a decision rebuilt by it."""
    out = {}
    for i, r in enumerate(plan.regions):
        if r.id != i:
            raise FormatError(f"{where}: regions[{i}] has id {r.id}")
        keys = []
        for sid in r.packs:
            if sid is None:
                keys.append(None)
                continue
            d = by_saved.get(sid)
            if d is None or d.region != i:
                raise FormatError(f"{where}: region {i} ({r.module!r}) rebuilds saved tensor {sid}, which is not a "
                                  f"decision rebuilt by it")
            keys.append((d.producer_op, d.output_slot))
        if (r.module, r.call) in {(o.region.module, o.region.call) for o in out.values()}:
            raise FormatError(f"{where}: two regions for call {r.call} of module {r.module!r}")
        out[i] = RegionInfo(region=r, pack_keys=tuple(keys))
    return out
