"""What every event of a plan costs the step, in seconds: the planner's one answer to "what does it cost".

* an op: its profiled time (`op_times_s`, never negative);
* a per-tensor recompute (a recipe) and a region replay: their ops' profiled times plus regen's own
  charges for them (`RuntimeCharges.recipe_time_s`, `RuntimeCharges.region_time_s`);
* a swap's call on the compute thread (issuing its copies, releasing its source: `RuntimeCharges.swap_time_s`);
* a transfer on the link: a copy-out is its bytes over the graph's device-to-host bandwidth
  (`copy_out_time_s`), a copy-in its bytes over the host-to-device one (`copy_in_time_s`); the MILP's
  channel rows keep their linear form and read the same rates (`copy_out_bytes_per_s`, `copy_in_bytes_per_s`);
* a plan's whole step, as its Plan reports it: the profile's measured step time plus what the plan adds,
  and what a planned step costs whatever its decisions (`RuntimeCharges.runtime_step_s`: regen's hooks on
  every pack and unpack and its step bookkeeping, measured by the calibration) (`reported_step_time_s`);
* an op the runtime's dispatch mode follows (a tracking window: regen.planner.tracking_windows):
  `RuntimeCharges.dispatch_op_s`.

The simulator, the copy-in ordering, the MILP, the heuristics, STR's formulation and the export all
charge through these; docs/internals.md "What a plan's predicted time charges" says where each figure
comes from.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from regen.formats.profile import Profile

if TYPE_CHECKING:
    from regen.planner.graph import PlanningGraph


@dataclass(frozen=True)
class RuntimeCharges:
    """The time regen's runtime adds per event, as the planner charges it (docs/internals.md "What a
    plan's predicted time charges"): the profile's `runtime_costs` (zero without them), the Python time
    between forward ops that a module replay runs again, and the profile's `calibration` (what the
    workload's own planned steps said about those charges: none without it)."""

    dispatch_op_s: float = 0.0  # every forward op in a tracking window of a per-tensor recipe (tracking_windows.py)
    capture_op_s: float = 0.0  # a recipe op, captured in forward
    replay_op_s: float = 0.0  # a recipe op, replayed in backward, beyond its own time
    recipe_s: float = 0.0  # a replayed recipe, besides its ops
    between_forward_ops_s: float = 0.0  # the plain forward's time outside ops, per forward op
    swap_s: float = 0.0  # what a swapped tensor costs the compute thread (not its transfers): RuntimeCosts.swap_s
    swap_byte_s: float = 0.0  # and per byte it moves (Calibration.swap_byte_s)
    recompute_scale: float = 1.0  # measured over charged recompute time on the workload (Calibration)
    runtime_step_s: float = 0.0  # a planned step's own cost, whatever its decisions (Calibration)
    region_scale: float = 1.0  # the same for module calls replayed whole (Calibration.region_scale)

    @staticmethod
    def of(profile: Profile, op_times_s: list[float]) -> RuntimeCharges:
        """The charges of a profile: its probe's figures, the time the plain forward spends outside
        ops, per forward op (the module code a region replay runs again), and its calibration."""
        rc = profile.runtime_costs
        cal = profile.calibration
        measured = {} if cal is None else {
            "recompute_scale": cal.recompute_scale, "swap_byte_s": cal.swap_byte_s,
            "runtime_step_s": cal.runtime_step_s,
            "region_scale": cal.recompute_scale if cal.region_scale is None else cal.region_scale}
        between_s = between_forward_ops_s(profile, op_times_s)
        if rc is None:
            return RuntimeCharges(between_forward_ops_s=between_s, **measured)
        return RuntimeCharges(dispatch_op_s=rc.dispatch_op_s, capture_op_s=rc.capture_op_s,
                              replay_op_s=rc.replay_op_s, recipe_s=rc.recipe_s, between_forward_ops_s=between_s,
                              swap_s=rc.swap_s, **measured)

    def recipe_time_s(self, op_times_s: float, num_ops: int) -> float:
        """A per-tensor recipe of `num_ops` ops whose profiled times sum to `op_times_s`."""
        return self.recompute_scale * (op_times_s + num_ops * (self.capture_op_s + self.replay_op_s) + self.recipe_s)

    def region_time_s(self, op_times_s: float, num_ops: int) -> float:
        """A module call of `num_ops` forward ops replayed by running its forward again."""
        return self.region_scale * (op_times_s + num_ops * self.between_forward_ops_s)

    def swap_time_s(self, nbytes: int) -> float:
        """What swapping a tensor of `nbytes` costs the compute thread (its transfers are the link's)."""
        return self.swap_s + nbytes * self.swap_byte_s


def op_times_s(profile: Profile) -> list[float]:
    """Each op's profiled time, as the planner charges it (a negative figure counts as zero)."""
    return [max(0.0, float(op.time_s)) for op in profile.ops]


def between_forward_ops_s(profile: Profile, op_times_s: list[float]) -> float:
    """The forward's time outside ops per forward op: from the profile's timed forward when it has one,
    else the step's time outside ops spread over all ops (backward runs Python between ops as well)."""
    num_forward = profile.num_forward_ops
    if not num_forward:
        return 0.0
    if profile.forward_time_s is not None:
        return max(0.0, float(profile.forward_time_s) - sum(op_times_s[:num_forward])) / num_forward
    return max(0.0, float(profile.step_time_s) - sum(op_times_s)) / len(op_times_s)


def reported_step_time_s(graph: PlanningGraph, planned_s: float) -> float:
    """A plan's step time as the Plan reports it: the profile's measured step time plus what the plan
    adds to the sum of profiled op times (`planned_s`: the simulator's or the MILP's step over those ops),
    plus what every planned step costs the runtime whatever its decisions (the same for every plan of a graph,
    so neither the MILP nor the simulator's comparisons need it)."""
    return float(graph.profile.step_time_s + planned_s - graph.compute_time_s + graph.costs.runtime_step_s)


def copy_out_bytes_per_s(graph: PlanningGraph) -> float:
    """The rate a copy-out moves at: the graph's device-to-host bandwidth."""
    return graph.d2h_bytes_per_s


def copy_in_bytes_per_s(graph: PlanningGraph) -> float:
    """The rate a copy-in moves at: the graph's host-to-device bandwidth."""
    return graph.h2d_bytes_per_s


def copy_out_time_s(graph: PlanningGraph, nbytes: int) -> float:
    """How long copying `nbytes` from the device to the host takes on the link (alone on its stream)."""
    return nbytes / copy_out_bytes_per_s(graph)


def copy_in_time_s(graph: PlanningGraph, nbytes: int) -> float:
    """How long copying `nbytes` from the host back to the device takes on the link (alone on its stream)."""
    return nbytes / copy_in_bytes_per_s(graph)
