"""Between the planner and the Plan file: a StrategyResult becomes a formats.Plan, built once.

`build_plan` is the one place a Plan is assembled: from the planning graph, the strategy's result, the
simulator's figures for it, the link it was solved for, the notes of the request and the profile file
it came from; nothing is set on a Plan after it. It is also the one place where candidate indices
(inside the planner) become SavedTensor ids (in files), for the decisions, recipe inputs and the
"rebuilt with" link, and where the planner's regions (indices into PlanningGraph.regions) become the
Plan's (`Plan.regions`, the chosen ones only).
"""

from __future__ import annotations

import dataclasses

from regen.formats.plan import (ACTION_KEEP, ACTION_RECOMPUTE, ACTION_SWAP, Decision, Plan, PlanCharges, PlanFigures,
                                PlanLink, RecipeOp, RegionDecision, TrackingStart, op_family)
from regen.planner.costs import reported_step_time_s
from regen.planner.graph import PlanningGraph
from regen.planner.residency import host_pool_bytes
from regen.planner.result import Choice, StrategyResult
from regen.planner.simulator import SimulationResult, recipe_tracked_ops


def build_plan(graph: PlanningGraph, result: StrategyResult, cap: int, strategy: str, sim: SimulationResult,
               link: PlanLink | None = None, notes: list[str] | None = None, profile_path: str | None = None) -> Plan:
    """The Plan of a strategy's result, with the simulator's figures for it: solved for `link`, under the
    graph's host memory cap, its `notes` (the request's: regen.planner.solve) before the strategy's."""
    profile = graph.profile
    unpacks = sorted((e.unpack_before_op, e.unpack_order) for e in profile.saved_entries
                     if e.unpack_order is not None and e.unpack_before_op is not None)
    first_unpack = min((o for _, o in unpacks), default=None)
    decisions = []
    regions = _region_decisions(graph, result.choices)
    plan_region = {r.index: k for k, r in enumerate(graph.regions[i] for i in sorted(
        {ch.region for ch in result.choices.values() if ch.region is not None}))}
    recipe_ops: dict[int, RecipeOp] = {}
    ranks = _op_ranks(profile.ops[:graph.num_forward_ops])
    for c in graph.candidates:
        s = c.saved
        ch = result.choices.get(c.index, Choice())
        producer = profile.ops[s.producer_op]
        d = Decision(saved_tensor=s.id, producer_op=s.producer_op, output_slot=s.output_slot, shape=list(s.shape),
                     dtype=s.dtype, bytes=c.bytes, action=ch.action, producer_name=producer.name,
                     producer_module=producer.module, producer_rank=ranks[s.producer_op])
        if ch.action == ACTION_SWAP:
            d.swap_out_after_op = c.issue_after
            d.swap_in_before_op = ch.swap_in_step
            d.swap_in_at_unpack = _unpack_position(unpacks, ch.swap_in_step, first_unpack)
            d.release_before_op = sim.release_steps[c.index]
            d.release_at_pack, d.release_at_unpack = graph.release_position(c, d.release_before_op)
        elif ch.action == ACTION_RECOMPUTE and ch.region is not None:
            d.region = plan_region[ch.region]
            d.recompute_before_op = graph.regions[ch.region].replay_step
        elif ch.action == ACTION_RECOMPUTE:
            d.recompute_before_op = c.first_backward
            if ch.rebuilt_with is not None:
                other = graph.candidates[ch.rebuilt_with]
                d.rebuilt_with = other.id
                d.recompute_before_op = other.first_backward
            d.recipe = list(ch.recipe.ops)
            d.recipe_inputs = [graph.candidates[a].id for a in ch.recipe.inputs]
            for q in ch.recipe.ops:
                op = profile.ops[q]
                recipe_ops[q] = RecipeOp(index=q, name=op.name, is_random=op.is_random)
        decisions.append(d)
    compute = graph.compute_time_s
    base_time = profile.step_time_s
    return Plan(
        fingerprint=profile.fingerprint, workload=dict(profile.workload), strategy=strategy, memory_cap_bytes=int(cap),
        baseline=PlanFigures(peak_bytes=int(profile.peak_bytes), step_time_s=float(base_time)),
        predicted=PlanFigures(peak_bytes=int(result.predicted_peak_bytes),
                              step_time_s=reported_step_time_s(graph, result.predicted_step_time_s)),
        simulated=PlanFigures(peak_bytes=int(sim.peak_bytes), step_time_s=reported_step_time_s(graph, sim.step_time_s)),
        solver=result.report, d2h_bytes_per_s=graph.d2h_bytes_per_s, h2d_bytes_per_s=graph.h2d_bytes_per_s,
        host_pool_bytes=host_pool_bytes(graph.candidates, result.choices), num_forward_ops=graph.num_forward_ops,
        num_forward_packs=sum(1 for e in profile.saved_entries
                              if e.pack_after_op is not None and e.pack_after_op < graph.num_forward_ops),
        memory_at_start_bytes=int(profile.memory_at_start_bytes),
        decisions=decisions, recipe_ops=[recipe_ops[q] for q in sorted(recipe_ops)],
        baseline_timeline_bytes=list(graph.after_bytes), planned_timeline_bytes=[int(x) for x in sim.timeline_bytes],
        notes=list(notes or []) + list(result.notes) + _figure_notes(decisions, compute), regions=regions,
        call=profile.call, tracking_starts=_tracking_starts(graph, result.choices), simulated_parts=sim.parts,
        link=link, host_memory_cap_bytes=graph.host_memory_cap_bytes, profile_path=profile_path,
        num_decisions=len(decisions), charges=PlanCharges(**dataclasses.asdict(graph.costs)),
    )



def _tracking_starts(graph: PlanningGraph, choices: dict[int, Choice]) -> list[TrackingStart]:
    """The module calls that open the tracking windows of the chosen recipes (regen.planner.tracking_windows)."""
    return graph.window_starts.opening(recipe_tracked_ops(graph, choices))


def _op_ranks(forward_ops) -> dict[int, int]:
    """For each forward op, how many forward ops of its family ran before it in its innermost module."""
    seen: dict[tuple[str | None, str], int] = {}
    ranks = {}
    for op in forward_ops:
        key = (op.module, op_family(op.name))
        ranks[op.index] = seen.get(key, 0)
        seen[key] = ranks[op.index] + 1
    return ranks


def _region_decisions(graph: PlanningGraph, choices: dict[int, Choice]) -> list[RegionDecision]:
    """The Plan's regions: the chosen ones in region order, each with the SavedTensor ids it rebuilds at
    the positions of their packs inside the call."""
    rebuilt: dict[int, set[int]] = {}
    for i, ch in choices.items():
        if ch.region is not None:
            rebuilt.setdefault(ch.region, set()).add(i)
    out = []
    for r in sorted(rebuilt):
        region = graph.regions[r]
        call = region.call
        packs = [graph.candidates[t].id if t is not None and t in rebuilt[r] else None for t in region.packs]
        out.append(RegionDecision(
            id=len(out), module=call.module, call=call.call, first_op=call.first_op, last_op=call.last_op,
            replay_before_op=region.replay_step, replay_at_unpack=region.replay_at_unpack, packs=packs,
            inputs=[graph.candidates[a].id for a in region.inputs], is_random=region.is_random,
            time_s=region.time_s))
    return out


def _figure_notes(decisions: list[Decision], compute_time_s: float) -> list[str]:
    counts = {a: sum(1 for d in decisions if d.action == a) for a in (ACTION_KEEP, ACTION_SWAP, ACTION_RECOMPUTE)}
    rebuilt = sum(1 for d in decisions if d.rebuilt_with is not None)
    by_region = sum(1 for d in decisions if d.region is not None)
    return [
        "step times are the profile's measured step time plus the plan's added time over the sum of op times "
        f"({compute_time_s:.6g} s)",
        f"actions: keep {counts[ACTION_KEEP]}, swap {counts[ACTION_SWAP]}, recompute {counts[ACTION_RECOMPUTE]}"
        + (f" ({rebuilt} of them rebuilt with another's recipe)" if rebuilt else "")
        + (f" ({by_region} of them rebuilt by a module replay)" if by_region else ""),
    ]


def _unpack_position(unpacks: list[tuple[int, int]], before_op: int, first_unpack: int | None) -> int | None:
    """The largest unpack_order whose unpack_before_op <= before_op (docs/internals.md)."""
    best = None
    for op, order in unpacks:
        if op > before_op:
            break
        best = order if best is None else max(best, order)
    return best if best is not None else first_unpack


