"""The plan: what to do with every saved tensor of a profiled step (`format: regen-plan/2`).

Written by `regen solve` (regen.planner), read by `regen.apply` (regen.runtime) and `regen show`.

Each `Decision` names a candidate the way the runtime sees it: the index of the forward op that
produced its storage (`producer_op`) and the output slot, with shape and dtype as a check. Actions:

* `keep`: autograd keeps the tensor on the device (the unplanned behaviour).
* `swap`: the storage is copied to the host pool after `swap_out_after_op` (the runtime starts the
  copy when autograd first packs it, right after that op) and copied back starting before
  backward op `swap_in_before_op`. The runtime has no op counter in backward; it issues the copy-in
  when the step's unpack sequence reaches position `swap_in_at_unpack` (derived from the profile's
  saved entries, so it lands at or before `swap_in_before_op`). The device storage is released before op
  `release_before_op`, at a fixed point of the step: the forward pack `release_at_pack` or the backward
  unpack `release_at_unpack` (one of them; the first point after which the simulator has the copy-out
  done). There the compute stream waits for the copy-out, done or not, and the storage is dropped, so
  memory follows op order, not the CPU's view of the copies (docs/internals.md "Swaps").
* `recompute`: the device copy is dropped; before backward op `recompute_before_op` (the first
  backward use) the runtime replays the forward ops `recipe` (indices, execution order). The recipe's
  inputs are parameters, the batch, outputs of its own earlier ops, or the candidates listed in
  `recipe_inputs`, which the plan guarantees are resident at that point.

* `producer_name`, `producer_module`, `producer_rank` (optional) name the producer op independently of
  op indices (its name, innermost module, and rank among that module's forward ops of its `op_family`), so
  that a compiled graph, whose ops are numbered its own way, can place the decision (regen.runtime.compiled).

* `recompute` with `region: R` (optional): the tensor is rebuilt by re-running the forward of the
  module call `Plan.regions[R]` once, before backward op `recompute_before_op` (the region's
  `replay_before_op`), with no recipe of its own; the replay rebuilds every tensor of the region at
  once, matched by the order in which the call packed them (`RegionDecision.packs`).

`call` is the profile's `CallSignature` (how its step called the model): `regen.apply(model, [plan_a,
plan_b])` runs each step under the plan whose call it matches.

`recipe_ops` describes every op that appears in some recipe (name, randomness) so the runtime can
check that the op it captured at that index is the op the plan expects.

`tracking_starts` (optional): the module calls at whose start the runtime's dispatch mode begins to follow
the forward again on steps after the verified one, so that it sees each op a recipe captures or reads
(from the latest of these calls that starts at or before the op, to the op, and on to the next pack,
where it lets go) and no others; without
them it follows the forward from its first op to the last such op.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from regen.errors import FormatError
from regen.formats.profile import CallSignature, call_signature_from_document
from regen.formats.yamlio import build_dataclass, dump_document, load_document, optional, require, required

PLAN_FORMAT = "regen-plan/2"
PLAN_VERSIONS = (1, 2)  # 1: swaps without release points, refused (re-solve); other plans load

ACTION_KEEP = "keep"
ACTION_SWAP = "swap"
ACTION_RECOMPUTE = "recompute"

ACTIONS = (ACTION_KEEP, ACTION_SWAP, ACTION_RECOMPUTE)


def op_family(name: str) -> str:
    """An op's name without its overload or in-place mark ("aten.add_.Tensor" -> "aten.add"): what a
    compiled graph, which writes in-place ops out of place, still calls it."""
    parts = name.split(".")
    base = ".".join(parts[:2]) if len(parts) >= 3 else name
    return base[:-1] if base.endswith("_") and not base.endswith("__") else base


@dataclass
class Decision:
    saved_tensor: int  # SavedTensor.id in the profile
    producer_op: int
    output_slot: int
    shape: list[int]
    dtype: str
    bytes: int
    action: str  # keep | swap | recompute
    swap_out_after_op: int | None = None
    swap_in_before_op: int | None = None
    swap_in_at_unpack: int | None = None
    # swap: the device storage is released before this op, at the forward pack `release_at_pack` or else
    # at the backward unpack `release_at_unpack` (positions in the step's pack and unpack sequences)
    release_before_op: int | None = None
    release_at_pack: int | None = None
    release_at_unpack: int | None = None
    recompute_before_op: int | None = None
    recipe: list[int] = field(default_factory=list)
    recipe_inputs: list[int] = field(default_factory=list)  # SavedTensor ids that must be resident
    # recompute: rebuilt on the way by the recipe of this SavedTensor id (kept from then until its use),
    # not by a recipe run of its own; `recipe` is then that decision's ops up to this tensor's producer
    rebuilt_with: int | None = None
    # recompute: rebuilt by replaying the module call Plan.regions[region] (no recipe of its own)
    region: int | None = None
    # the producer op as a compiled graph can find it (regen.runtime.compiled): its name, the innermost
    # module it ran in (path from the root; None outside the model) and how many forward ops of its family
    # (op_family) ran in that module before it (its rank). None in plans solved before they were written.
    producer_name: str | None = None
    producer_module: str | None = None
    producer_rank: int | None = None


@dataclass
class RegionDecision:
    """A module call whose forward the runtime runs again in backward, rebuilding the tensors it saved."""

    id: int  # position in Plan.regions (Decision.region)
    module: str  # path from the root module, e.g. "blocks.3"
    call: int  # which call of that module in the forward (0 = first)
    first_op: int  # its forward op extent (as profiled)
    last_op: int
    replay_before_op: int  # the replay runs before this backward op (the first backward use of its tensors)
    replay_at_unpack: int | None  # ... issued at this position of the step's unpack sequence
    # one per saved entry packed inside the call, in order: the SavedTensor id the replay's pack at that
    # position rebuilds, or None (not rebuilt by this region: a parameter, an input, a tensor kept)
    packs: list[int | None] = field(default_factory=list)
    inputs: list[int] = field(default_factory=list)  # SavedTensor ids among its arguments (kept for it)
    is_random: bool = False  # draws from the RNG: replayed with the RNG state of the original call
    time_s: float = 0.0  # the replay's predicted time


@dataclass
class TrackingStart:
    """A module call whose start opens a window of ops the runtime's dispatch mode follows (Plan.tracking_starts)."""

    module: str  # path from the root module; "" for the root (the step's first op)
    call: int  # which call of that module in the forward (0 = first)
    first_op: int  # its first forward op (as profiled)


@dataclass
class RecipeOp:
    index: int
    name: str
    is_random: bool = False


@dataclass
class PlanFigures:
    peak_bytes: int
    step_time_s: float


@dataclass
class SolverReport:
    name: str  # "highs" or "heuristic"
    status: str  # optimal | time_limit | heuristic
    objective_s: float | None
    bound_s: float | None  # LP bound on the objective, when the solver gives one
    gap: float | None  # relative optimality gap, 0.0 when proven optimal
    solve_time_s: float
    time_limit_s: float | None = None


LINK_FROM_RATIO = "link-ratio"  # both bandwidths from --link-ratio
LINK_FROM_BANDWIDTH = "bandwidth"  # --bandwidth
LINK_FROM_PROFILE = "profile"  # the profile's measured (or a graph's default) bandwidth
LINK_SOURCES = (LINK_FROM_RATIO, LINK_FROM_BANDWIDTH, LINK_FROM_PROFILE)


@dataclass
class TimeParts:
    """What the simulator's step time of a plan adds to the unplanned ops, by cause (seconds)."""

    recompute_s: float = 0.0  # recipes and module replays, as the planner charges them (with its calibration)
    swap_calls_s: float = 0.0  # the swaps' cost to the compute thread, not their transfers
    dispatch_s: float = 0.0  # forward ops through the runtime's dispatch mode (recipe tracking)
    link_wait_s: float = 0.0  # the compute thread waiting for copies
    region_s: float = 0.0  # the part of recompute_s that replays module calls whole (0 in older plans)


@dataclass
class PlanCharges:
    """The charges a plan was solved with (the planner's RuntimeCharges: the profile's runtime costs and
    calibration), so that a plan says what it believed, whatever its profile says later."""

    dispatch_op_s: float = 0.0
    capture_op_s: float = 0.0
    replay_op_s: float = 0.0
    recipe_s: float = 0.0
    between_forward_ops_s: float = 0.0
    swap_s: float = 0.0
    swap_byte_s: float = 0.0
    recompute_scale: float = 1.0
    runtime_step_s: float = 0.0
    region_scale: float | None = None  # module replays' (None in plans solved before it was charged apart)


@dataclass
class PlanLink:
    """The host link a plan was solved for (its bandwidths are the plan's d2h/h2d_bytes_per_s)."""

    source: str  # link-ratio | bandwidth | profile
    link_ratio: float  # time to copy every candidate's bytes one way (slower direction) / unplanned step time
    candidate_bytes: int  # bytes of every saved tensor of the profile, each storage once


@dataclass
class Plan:
    fingerprint: str  # the profile's (forward op names and shapes)
    workload: dict[str, Any]
    strategy: str
    memory_cap_bytes: int
    baseline: PlanFigures  # the unplanned step, from the profile
    predicted: PlanFigures  # the MILP's (or heuristic's) own prediction
    simulated: PlanFigures  # the simulator's replay of the decisions
    solver: SolverReport
    d2h_bytes_per_s: float
    h2d_bytes_per_s: float
    host_pool_bytes: int  # host memory the runtime allocates once (pinned on CUDA): swapped ranges, rounded
    # up by host_range_bytes, at their most at once
    num_forward_ops: int
    decisions: list[Decision]
    recipe_ops: list[RecipeOp] = field(default_factory=list)
    memory_at_start_bytes: int = 0  # the profile's: device bytes allocated when the step began
    num_forward_packs: int | None = None  # tensors autograd saved in the profiled forward (the saved set)
    baseline_timeline_bytes: list[int] = field(default_factory=list)  # unplanned, after each op
    planned_timeline_bytes: list[int] = field(default_factory=list)  # simulator's, after each op
    format: str = PLAN_FORMAT
    profile_path: str | None = None
    notes: list[str] = field(default_factory=list)
    regions: list[RegionDecision] = field(default_factory=list)  # module calls replayed in backward
    tracking_starts: list[TrackingStart] = field(default_factory=list)  # where recipe tracking windows open
    simulated_parts: TimeParts | None = None  # the simulated step's additions by cause (absent in older plans)
    link: PlanLink | None = None  # absent in plans written before the link was recorded
    host_memory_cap_bytes: int | None = None  # the bound on host_pool_bytes the plan was solved under
    call: CallSignature | None = None  # the profile's: how its step called the model (chooses within a plan set)
    # how many decisions the planner wrote (one per saved tensor it planned): a file holding fewer was cut
    # or edited, and is refused on load (absent in older plans)
    num_decisions: int | None = None
    charges: PlanCharges | None = None  # the charges it was solved with (absent in older plans)
    # gradients the training loop holds from before each step (gradient accumulation, zero_grad(set_to_none=
    # False)), counted in the plan's memory for the whole step; 0: the profiled loop's, whose steps create them
    gradients_held_bytes: int = 0

    def region_member_count(self) -> int:
        """Recompute decisions rebuilt by a region replay (Decision.region)."""
        return sum(1 for d in self.decisions if d.region is not None)

    def rebuilt_count(self) -> int:
        """Recompute decisions rebuilt with another's recipe (Decision.rebuilt_with)."""
        return sum(1 for d in self.decisions if d.rebuilt_with is not None)

    def action_counts(self) -> dict[str, int]:
        counts = {a: 0 for a in ACTIONS}
        for d in self.decisions:
            counts[d.action] += 1
        return counts

    def action_bytes(self) -> dict[str, int]:
        totals = {a: 0 for a in ACTIONS}
        for d in self.decisions:
            totals[d.action] += d.bytes
        return totals

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        out = {"format": d.pop("format")}
        out.update(d)
        return out


def save_plan(plan: Plan, path: str | Path) -> None:
    dump_document(plan.to_dict(), path)


def load_plan(path: str | Path, broadcast_from: int | None = None) -> Plan:
    """Read a plan file; malformed files and unknown versions raise FormatError.

    `broadcast_from=R` with torch.distributed initialized: only rank R reads the file, and every rank gets
    its plan (torch.distributed.broadcast_object_list), or the same FormatError when R could not read it.
    Without torch.distributed it reads the file as usual."""
    if broadcast_from is None:
        return plan_from_document(load_document(path, "plan", PLAN_VERSIONS), str(path))
    import torch.distributed as dist

    if not dist.is_available() or not dist.is_initialized():
        return load_plan(path)
    box: list[Any] = [None]
    failure = None
    if dist.get_rank() == broadcast_from:
        try:
            box[0] = load_plan(path)
        except Exception as exc:  # the other ranks must not wait for a plan that never comes
            failure = exc
            box[0] = FormatError(f"rank {broadcast_from} could not read the plan: {exc}")
    dist.broadcast_object_list(box, src=broadcast_from)
    if failure is not None:
        raise failure
    if isinstance(box[0], FormatError):
        raise box[0]
    return box[0]


def plan_from_document(doc: dict[str, Any], where: str) -> Plan:
    """The Plan of a parsed document whose format was checked (load_document)."""
    try:
        decisions = [build_dataclass(Decision, d, f"{where}: decisions[{i}]")
                     for i, d in enumerate(require(doc, "decisions", where))]
        recipe_ops = [build_dataclass(RecipeOp, r, f"{where}: recipe_ops[{i}]")
                      for i, r in enumerate(doc.get("recipe_ops") or [])]
        regions = [build_dataclass(RegionDecision, r, f"{where}: regions[{i}]")
                   for i, r in enumerate(doc.get("regions") or [])]
        tracking_starts = [build_dataclass(TrackingStart, t, f"{where}: tracking_starts[{i}]")
                           for i, t in enumerate(doc.get("tracking_starts") or [])]
        plan = Plan(
            fingerprint=str(require(doc, "fingerprint", where)),
            workload=require(doc, "workload", where),
            strategy=str(require(doc, "strategy", where)),
            memory_cap_bytes=required(doc, "memory_cap_bytes", int, where),
            baseline=build_dataclass(PlanFigures, require(doc, "baseline", where), f"{where}: baseline"),
            predicted=build_dataclass(PlanFigures, require(doc, "predicted", where), f"{where}: predicted"),
            simulated=build_dataclass(PlanFigures, require(doc, "simulated", where), f"{where}: simulated"),
            solver=build_dataclass(SolverReport, require(doc, "solver", where), f"{where}: solver"),
            d2h_bytes_per_s=required(doc, "d2h_bytes_per_s", float, where),
            h2d_bytes_per_s=required(doc, "h2d_bytes_per_s", float, where),
            host_pool_bytes=required(doc, "host_pool_bytes", int, where),
            num_forward_ops=required(doc, "num_forward_ops", int, where),
            decisions=decisions, recipe_ops=recipe_ops, format=str(doc["format"]),
            profile_path=doc.get("profile_path"), notes=list(doc.get("notes") or []),
            memory_at_start_bytes=optional(doc, "memory_at_start_bytes", int, where, 0),
            num_forward_packs=optional(doc, "num_forward_packs", int, where),
            baseline_timeline_bytes=optional(doc, "baseline_timeline_bytes", list[int], where, []),
            planned_timeline_bytes=optional(doc, "planned_timeline_bytes", list[int], where, []), regions=regions,
            tracking_starts=tracking_starts,
            link=_optional_link(doc.get("link"), where),
            host_memory_cap_bytes=optional(doc, "host_memory_cap_bytes", int, where),
            call=call_signature_from_document(doc.get("call"), where),
            simulated_parts=_optional_parts(doc.get("simulated_parts"), where),
            num_decisions=optional(doc, "num_decisions", int, where),
            gradients_held_bytes=optional(doc, "gradients_held_bytes", int, where, 0),
            charges=(None if doc.get("charges") is None
                     else build_dataclass(PlanCharges, doc["charges"], f"{where}: charges")),
        )
    except (TypeError, ValueError) as exc:
        raise FormatError(f"{where}: malformed plan ({exc})") from None
    for i, d in enumerate(plan.decisions):
        if d.action not in ACTIONS:
            raise FormatError(f"{where}: decisions[{i}] has action '{d.action}', expected one of {', '.join(ACTIONS)}")
        if d.action == ACTION_SWAP and (d.swap_out_after_op is None or d.swap_in_before_op is None):
            raise FormatError(f"{where}: decisions[{i}] is a swap without swap_out_after_op/swap_in_before_op")
        if d.action == ACTION_SWAP and d.release_before_op is None:
            raise FormatError(f"{where}: decisions[{i}] is a swap without a release point (release_before_op, which "
                              f"plans before {PLAN_FORMAT} lack): solve the profile again with this regen")
        if d.action == ACTION_RECOMPUTE and (d.recompute_before_op is None or not (d.recipe or d.region is not None)):
            raise FormatError(f"{where}: decisions[{i}] is a recompute without recompute_before_op/recipe")
    _check_decision_count(plan, where)
    by_id = {d.saved_tensor: d for d in plan.decisions}
    for i, d in enumerate(plan.decisions):
        why = rebuilt_with_error(d, by_id) or region_error(d, plan.regions)
        if why:
            raise FormatError(f"{where}: decisions[{i}] {why}")
    for i, r in enumerate(plan.regions):
        if r.id != i:
            raise FormatError(f"{where}: regions[{i}] has id {r.id}; regions are numbered 0..{len(plan.regions) - 1}")
    return plan


def _check_decision_count(plan: Plan, where: str) -> None:
    """One decision per saved tensor, as many as the planner wrote (`num_decisions`)."""
    ids = [d.saved_tensor for d in plan.decisions]
    if len(set(ids)) != len(ids):
        twice = next(i for i in ids if ids.count(i) > 1)
        raise FormatError(f"{where}: decisions name saved tensor {twice} more than once")
    if plan.num_decisions is not None and len(ids) != plan.num_decisions:
        raise FormatError(f"{where}: holds {len(ids)} decisions where its planner wrote {plan.num_decisions} (the "
                          f"file was cut short or edited); solve the profile again")


def _optional_parts(doc: Any, where: str) -> TimeParts | None:
    if doc is None:
        return None
    parts = build_dataclass(TimeParts, doc, f"{where}: simulated_parts")
    figures = {f: float(getattr(parts, f))
               for f in ("recompute_s", "swap_calls_s", "dispatch_s", "link_wait_s", "region_s")}
    bad = [f for f, v in figures.items() if not v >= 0 or v == float("inf")]
    if bad:
        raise FormatError(f"{where}: simulated_parts.{bad[0]} must be a non-negative number of seconds")
    return TimeParts(**figures)


def _optional_link(raw: Any, where: str) -> PlanLink | None:
    if raw is None:
        return None
    link = build_dataclass(PlanLink, raw, f"{where}: link")
    link.link_ratio, link.candidate_bytes = float(link.link_ratio), int(link.candidate_bytes)
    if link.source not in LINK_SOURCES:
        raise FormatError(f"{where}: link source '{link.source}', expected one of {', '.join(LINK_SOURCES)}")
    return link


def region_error(d: Decision, regions: list[RegionDecision]) -> str | None:
    """Why decision `d`'s `region` does not hold in its plan, or None: a region member is a recompute
    decision with no recipe, recipe inputs or rebuilt_with of its own, and its region's packs name it."""
    if d.region is None:
        return None
    if not 0 <= d.region < len(regions):
        return f"names region {d.region}, which the plan does not have"
    if (d.action != ACTION_RECOMPUTE or d.recipe or d.recipe_inputs or d.rebuilt_with is not None
            or d.saved_tensor not in regions[d.region].packs):
        return (f"is rebuilt by region {d.region}, but is not a recompute decision without a recipe of its own "
                f"whose tensor that region packs")
    return None


def rebuilt_with_error(d: Decision, by_saved_id: dict[int, Decision]) -> str | None:
    """Why decision `d`'s `rebuilt_with` does not hold in its plan (decisions by SavedTensor id), or None:
    it must be a recompute decision without recipe_inputs of its own, and the decision it is rebuilt with a
    recompute decision with a recipe of its own that runs all of d's recipe ops."""
    if d.rebuilt_with is None:
        return None
    rebuilder = by_saved_id.get(d.rebuilt_with)
    if (d.action != ACTION_RECOMPUTE or rebuilder is None or rebuilder.action != ACTION_RECOMPUTE
            or rebuilder.rebuilt_with is not None or not set(d.recipe) <= set(rebuilder.recipe) or d.recipe_inputs):
        return (f"is rebuilt with saved tensor {d.rebuilt_with}, which is not a recompute decision whose recipe "
                f"runs its ops (and a rebuilt tensor has no recipe_inputs of its own)")
    return None
