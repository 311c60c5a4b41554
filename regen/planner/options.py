"""What a solve is asked for besides the profile and the cap: `SolveOptions`, and their validation.

One object carries every setting that shapes a plan (the strategy, the solver's stop, the host link,
the host memory bound, plans to start from, the profile file it records), so that the planning graph
and the Plan are each built once from it (regen.planner.solve). Errors name the parameters
(`time_limit_s`, `link_ratio`...), as a Python caller writes them; the CLI speaks of its flags
(regen.cli maps the names).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field

from regen.errors import RegenError
from regen.planner.milp.model import DEFAULT_REL_GAP
from regen.planner.strategies import STRATEGIES

DEFAULT_TIME_LIMIT_S = 60.0


@dataclass(frozen=True)
class SolveOptions:
    """How to solve: everything but the profile and the memory cap."""

    strategy: str = "hybrid"  # one of regen.planner.strategies.STRATEGIES
    time_limit_s: float = DEFAULT_TIME_LIMIT_S  # the MILP strategies stop here at the latest ...
    rel_gap: float = DEFAULT_REL_GAP  # ... or once within this relative gap of the solver's bound
    # the host link (regen.planner.host_link): one of these two, or neither for the profile's own bandwidth
    bandwidth_gb_s: float | None = None
    link_ratio: float | None = None
    # bound on the plan's host pool; None: a fraction of this machine's RAM (host_link.default_host_memory_cap_bytes)
    host_memory_cap_bytes: int | None = None
    # (name, choices): plans of this profile's graph the MILP strategies may start from (the least-peak plan
    # of an InfeasibleCapError: regen.planner.solve.solve_within_reach)
    start_plans: tuple[tuple[str, dict], ...] = field(default_factory=tuple)
    profile_path: str | None = None  # the profile file the plan records, when it came from one
    # False: recompute by per-tensor recipes only, no module call replayed whole (the calibration times such a
    # plan beside per-block checkpointing, to measure recipes apart from replays)
    module_replays: bool = True
    # the training loop holds gradients from one step to the next (gradient accumulation, zero_grad(
    # set_to_none=False)): the plan counts them for the whole step (regen.planner.held_gradients)
    gradients_held: bool = False


def solve_options(options: SolveOptions | str | None = None, **settings) -> SolveOptions:
    """SolveOptions from `options` (or a strategy name, the short form) with `settings` (SolveOptions
    fields by name) over them; a TypeError names a setting SolveOptions does not have."""
    if isinstance(options, str):
        settings = {"strategy": options, **settings}
        options = None
    if "start_plans" in settings:
        settings["start_plans"] = tuple(settings["start_plans"] or ())
    base = options if options is not None else SolveOptions()
    return dataclasses.replace(base, **settings) if settings else base


def check_solve_request(memory_cap_bytes: int, options: SolveOptions) -> None:
    """RegenError, naming the parameter, for a request no strategy can take (the link is checked by
    regen.planner.host_link.link_bandwidth)."""
    if options.strategy not in STRATEGIES:
        raise RegenError(f"unknown strategy '{options.strategy}': use one of {', '.join(STRATEGIES)}")
    if not memory_cap_bytes or memory_cap_bytes <= 0:
        raise RegenError(f"the memory cap must be positive (got {memory_cap_bytes})")
    if not (options.time_limit_s and options.time_limit_s > 0 and math.isfinite(options.time_limit_s)):
        raise RegenError(f"time_limit_s must be a positive, finite number of seconds (got {options.time_limit_s})")
    if not 0 <= options.rel_gap < 1:
        raise RegenError(f"rel_gap, the relative gap, must be in [0, 1) (got {options.rel_gap})")
    if options.host_memory_cap_bytes is not None and options.host_memory_cap_bytes <= 0:
        raise RegenError(f"host_memory_cap_bytes must be positive (got {options.host_memory_cap_bytes})")
