"""Region candidates: module calls whose forward the runtime can run again in backward.

A *region* is one call of a submodule (`Profile.module_calls`) replayed once in backward, the way
`torch.utils.checkpoint` (non-reentrant) re-runs a checkpointed function: just before the first of the
tensors packed during the call is needed (`replay_step`, b_R: the first backward op after the first
unpack of one of its entries; the runtime issues it at that unpack, `replay_at_unpack`), re-running the
module's forward from its arguments rebuilds every tensor the call saved at once. A candidate produced
inside the call with an entry packed inside it and no backward use before b_R is a *member*: it may be
rebuilt by the region (a per-candidate choice, docs/milp.md), and is then gone from after its last
forward use until b_R and resident from b_R to its last backward use. The replay holds each member it
rebuilds from the op that makes it; everything else it makes (its intermediates, the candidates produced
inside that it does not rebuild) lives as in the forward: at least until its last read inside the call,
and as long as the module's Python holds it (a local variable lives until its function returns, read or
not). So the replay's peak over the memory before it is `sum of the members it rebuilds + transient`, with
`transient_bytes` the most, over the call's ops, of the intermediates alive there less the rebuilt
members not made yet (all members rebuilt; each member it does not rebuild adds at most its own bytes):
the larger of that count by last reads and the forward's own measured rise over the call's ops (Note
[ A replay's memory as the forward measured it ]).

A call is a region only if its replay is exact and its memory is what the planner charges:
* it leaves nothing behind besides its output and what autograd saves (`ModuleCall.leaves_behind`: no
  tensor stored in a cache object, a module attribute or a list, no attribute rebound), which a replay
  would write a second time (regen.profiler.outside_state);
* every op in it is a forward op, and every activation an op in it reads that was produced before the
  call is (a view of) one of its arguments;
* the runtime holds the arguments from the call to the replay: a chosen region requires its argument
  candidates (`inputs`) kept, and an activation argument no backward saves (an attention mask, a position
  index shared by every block) is held past its last forward read until the latest replay of the chosen
  regions that take it (`held`: its bytes are charged from the op after that read, regen.planner.residency
  and docs/milp.md "Captures");
* no op in it writes in place a storage made before the call, except module buffers (BatchNorm's
  running stats), which the runtime restores after the replay (their bytes are part of the transient);
* no op in it is a collective or FSDP's gathering (one rank alone cannot replay those), and every
  parameter FSDP gathered that it reads is unsharded at the replay (regen.planner.fsdp_reads).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from regen.formats.plan_rules import replay_stop_pack
from regen.formats.profile import KIND_ACTIVATION, KIND_BUFFER, PHASE_FORWARD, ModuleCall
from regen.opnames import is_distributed
from regen.planner.fsdp_reads import gathered_storages, resharded_read

if TYPE_CHECKING:
    from regen.planner.graph import PlanningGraph


@dataclass(frozen=True)
class HeldArgument:
    """An activation argument of a region that no backward saves: the runtime holds its storage from the
    call to the replay, where the unplanned step may free it after its last forward read."""

    storage: int
    bytes: int
    last_read: int  # the last forward op that reads the storage

    @property
    def first_held_step(self) -> int:
        """The first step where holding it costs memory the unplanned step would not: after its last read."""
        return self.last_read + 1


@dataclass
class Region:
    """One replayable module call (see the module doc)."""

    index: int  # position in PlanningGraph.regions
    call: ModuleCall
    replay_step: int  # b_R
    replay_at_unpack: int | None
    members: list[int]  # candidate indices it may rebuild
    inputs: list[int]  # candidate indices among its arguments (kept while it is chosen)
    held: list[HeldArgument]  # its activation arguments that are no candidate (held until the replay)
    packs: list[int | None]  # per entry packed inside the call: a member's candidate index, else None
    time_s: float  # the replay up to its stop: its ops' profiled times and the Python between them (RuntimeCharges)
    transient_bytes: int  # the replay's peak less its rebuilt members (see the module doc), and the buffers' snapshot
    is_random: bool = False
    notes: list[str] = field(default_factory=list)

    @property
    def name(self) -> str:
        return f"{self.call.module}#{self.call.call}"


# NOTE [ A replay's memory as the forward measured it ]
# A replay runs the module's forward code again, so what that code keeps alive it keeps alive again: a
# Funnel Transformer's attention holds its content, positional and token-type scores (each a local of its
# forward) until its last line, long past their last read, and per-block checkpointing's replays measured
# 8.3% over the peak the simulator gave them when each storage was counted only until its last read (a
# recompute plan at checkpointing's peak: 11.3% over its cap). The forward's own memory timeline, measured
# by the allocator around each op of the call (the op's peak, its temporaries included), bounds what the
# replay holds at that op: the members made so far, every intermediate still held, and the saved tensors that
# are no members (held by autograd in the forward; the replay lets them go: counted, so the bound errs high).
# It can err low only where the call frees storages made before it (a caller's temporary it is the last to
# hold), so the transient is the larger of the two counts.


def add_regions(graph: PlanningGraph) -> None:
    """Every region of the profile's module calls (graph.regions), and each candidate's `regions`."""
    profile = graph.profile
    if not profile.module_calls:
        return
    tensors = profile.tensor_by_id()
    cand_by_storage = {}
    for c in graph.candidates:
        cand_by_storage.setdefault(c.saved.storage, c)
    by_id = graph.by_saved_id()
    gathered = gathered_storages(profile, tensors)
    last_read = _last_forward_reads(profile, tensors)
    for call in profile.module_calls:
        region = _region_of(graph, call, tensors, cand_by_storage, by_id, last_read, len(graph.regions))
        if region is not None and resharded_read(profile, tensors, gathered, range(call.first_op, call.last_op + 1),
                                                 region.replay_step) is None:
            graph.regions.append(region)
            for t in region.members:
                graph.candidates[t].regions.append(region.index)


def _last_forward_reads(profile, tensors: dict) -> dict[int, int]:
    """Storage -> the last forward op that reads it."""
    out: dict[int, int] = {}
    for op in profile.ops:
        if op.phase != PHASE_FORWARD:
            continue
        for x in op.inputs:
            rec = tensors.get(x)
            if rec is not None:
                out[rec.storage] = op.index
    return out


def _region_of(graph: PlanningGraph, call: ModuleCall, tensors: dict, cand_by_storage: dict, by_id: dict,
               last_read: dict[int, int], index: int) -> Region | None:
    """The region of one module call, or None when it is not replayable (see the module doc)."""
    profile = graph.profile
    ops = profile.ops
    if call.depth < 1 or call.num_entries <= 0 or ops[call.last_op].phase != PHASE_FORWARD:
        return None
    if call.leaves_behind:
        return None  # a replay would write that state again
    extent = range(call.first_op, call.last_op + 1)
    if any(ops[q].private_generator for q in extent):
        return None  # a replay restores the global RNG states, not a generator the forward keeps elsewhere
    if any(is_distributed(ops[q].name) for q in extent):
        return None  # a replay on one rank would wait for the others in a collective
    input_storages = {tensors[x].storage for x in call.inputs if x in tensors}
    inputs, held = [], []
    for st in sorted(input_storages):
        rec = next(tensors[x] for x in call.inputs if x in tensors and tensors[x].storage == st)
        if rec.kind != KIND_ACTIVATION:
            continue
        cand = cand_by_storage.get(st)
        if cand is not None:
            inputs.append(cand.index)
        elif rec.storage_bytes:
            held.append(HeldArgument(st, rec.storage_bytes, last_read.get(st, call.first_op)))
    created_inside = set()
    for q in extent:
        op = ops[q]
        for x in op.inputs:
            rec = tensors.get(x)
            if rec is None or rec.producer_op is None or rec.producer_op >= call.first_op:
                continue
            if rec.storage not in input_storages and rec.storage not in created_inside:
                return None  # reads an activation made before the call that is not an argument
        for o in op.outputs:
            rec = tensors.get(o)
            if rec is None:
                continue
            if op.is_inplace:
                if rec.storage not in created_inside and rec.kind != KIND_BUFFER:
                    return None  # writes in place a storage made before the call
            elif not op.is_view:
                created_inside.add(rec.storage)
    entries = profile.saved_entries[call.first_entry:call.first_entry + call.num_entries]
    produced = {}
    for e in entries:
        c = by_id.get(e.saved_tensor) if e.saved_tensor is not None else None
        if c is not None and call.first_op <= c.producer <= call.last_op and e.unpack_order is not None:
            produced.setdefault(c.index, []).append(e)
    if not produced:
        return None
    first = min((e for es in produced.values() for e in es), key=lambda e: e.unpack_order)
    b = first.unpack_before_op if first.unpack_before_op is not None else min(
        graph.candidates[t].first_backward for t in produced)
    members = [t for t in produced if _can_be_member(graph.candidates[t], b)]
    if not members:
        return None
    member_set = set(members)
    packs = []
    for e in entries:
        c = by_id.get(e.saved_tensor) if e.saved_tensor is not None else None
        packs.append(c.index if c is not None and c.index in member_set else None)
    member_bytes = {graph.candidates[t].saved.storage: graph.candidates[t].bytes for t in members}
    # the replay stops at a pack (regen.runtime.region_replays): the last op it runs is the last one dispatched
    # before that pack (the op that packs its inputs has not run yet; one that packs its output has)
    replayed = range(call.first_op, entries[replay_stop_pack(packs)].pack_after_op + 1)
    return Region(index=index, call=call, replay_step=b, replay_at_unpack=first.unpack_order, members=members,
                  inputs=sorted(inputs), held=held, packs=packs,
                  time_s=graph.costs.region_time_s(float(sum(graph.time_s[q] for q in replayed)), len(replayed)),
                  transient_bytes=_replay_transient_bytes(graph, tensors, call, replayed, member_bytes)
                  + int(call.buffer_bytes),
                  is_random=any(ops[q].is_random for q in extent))


def _can_be_member(c, replay_step: int) -> bool:
    """Rebuilt by a replay at `replay_step`: not needed before it, and gone for at least one step."""
    return (not c.trivial and c.bytes > 0 and c.first_backward >= replay_step
            and c.last_forward + 1 < replay_step)


def _replay_transient_bytes(graph: PlanningGraph, tensors: dict, call: ModuleCall, replayed: range,
                            member_bytes: dict[int, int]) -> int:
    """The replay's peak over the memory before it, less its rebuilt members (all of them rebuilt), over
    the ops it runs (`replayed`, from the call's first op to its stop): each storage an op of the call
    creates that is no member lives until its last read inside the call (to the end when a later
    forward op reads it: the call's output); a member (`member_bytes`: storage -> bytes) is held from
    the op that makes it, and is charged as resident from the replay on, so the members not made yet at
    an op are subtracted there."""
    ops = graph.profile.ops
    last = call.last_op
    last_read: dict[int, int] = {}
    for op in ops[call.first_op:]:
        if op.phase != PHASE_FORWARD:
            break
        for x in op.inputs:
            rec = tensors.get(x)
            if rec is not None:
                last_read[rec.storage] = min(op.index, last + 1)
    pending = sum(member_bytes.values())  # members the replay has not made yet
    measured = _forward_rise_bytes(graph, call, replayed) - pending  # Note [ A replay's memory as the ... ]
    live: dict[int, int] = {}
    peak = 0
    for q in replayed:
        op = ops[q]
        if not op.is_view and not op.is_inplace:
            for o in op.outputs:
                rec = tensors.get(o)
                if rec is None or not rec.storage_bytes:
                    continue
                if rec.storage in member_bytes:
                    pending -= member_bytes.pop(rec.storage)
                else:
                    live[rec.storage] = rec.storage_bytes
        peak = max(peak, sum(live.values()) - pending)
        for st in [st for st in live if last_read.get(st, -1) <= q]:
            del live[st]
    return int(max(peak, measured))


def _forward_rise_bytes(graph: PlanningGraph, call: ModuleCall, replayed: range) -> int:
    """The most the unplanned forward's memory rose over the call's ops in `replayed` (each op's peak in the
    graph's unplanned timeline, temporaries included) above the memory before the call."""
    before = graph.after_bytes[call.first_op - 1] if call.first_op > 0 else graph.profile.memory_at_start_bytes
    return max((graph.peak_bytes[q] for q in replayed), default=before) - before


def region_transient_bytes(graph: PlanningGraph, region: Region, rebuilt: set[int]) -> int:
    """A replay's transient when it rebuilds the members in `rebuilt`: its intermediates and buffer
    snapshot, and at most the bytes of every member it does not rebuild (docs/milp.md "Regions")."""
    return region.transient_bytes + sum(graph.candidates[u].bytes for u in region.members if u not in rebuilt)
