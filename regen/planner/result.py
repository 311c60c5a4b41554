"""What a strategy decides: a `Choice` per candidate and the `StrategyResult` every strategy returns.

Inside the planner a candidate is named by its index in `PlanningGraph.candidates`, also in
`Choice.rebuilt_with`, and a region by its index in `PlanningGraph.regions` (`Choice.region`);
regen.planner.export turns indices into SavedTensor ids (and Plan.regions) for the Plan. A choices
dict maps candidate index -> Choice and holds only non-keep choices (absent means keep).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from regen.formats.plan import ACTION_KEEP, SolverReport
from regen.planner.recipes import Recipe


@dataclass
class Choice:
    """What to do with one candidate (internal form of a plan Decision)."""

    action: str = ACTION_KEEP
    recipe: Recipe | None = None
    swap_in_step: int | None = None  # the copy-in starts before this op
    # swap: the device storage is released before this op (a plan's release_before_op); None: the simulator
    # releases it at the first release step by which the copy-out is done
    release_step: int | None = None
    rebuilt_with: int | None = None  # recompute: rebuilt by this candidate's recipe (Candidate.rebuilt_with_options)
    region: int | None = None  # recompute: rebuilt by replaying this region (PlanningGraph.regions), no recipe


@dataclass
class StrategyResult:
    """A strategy's plan and the figures it predicts for it (checked by the simulator in `solve`)."""

    choices: dict[int, Choice]
    report: SolverReport
    predicted_step_time_s: float  # sum of profiled op times plus the plan's added time
    predicted_peak_bytes: int
    notes: list[str] = field(default_factory=list)
