"""`regen solve`'s planning: validate the request, run a strategy, check the result, build the Plan.

The walk from `solve` to the written Plan: validate the request (regen.planner.options), settle the host
link and host memory (regen.planner.host_link: a CPU device without an explicit link plans recompute
only), build the planning graph with everything it needs (regen.planner.graph), run the strategy
(regen.planner.strategies), put the copy-ins where the runtime issues them (regen.planner.copy_order),
replay the plan in the simulator (the one final check: a plan that is inconsistent or over the cap is
never returned), and build the Plan once (regen.planner.export).
"""

from __future__ import annotations

import dataclasses
import time
from typing import Callable

from regen.errors import InfeasibleCapError
from regen.formats.plan import Plan
from regen.formats.profile import Profile
from regen.planner.copy_order import order_copy_ins
from regen.planner.export import build_plan
from regen.planner.graph import build_graph
from regen.planner.held_gradients import held_gradient_bytes, with_gradients_held
from regen.planner.host_link import (default_host_memory_cap_bytes, has_no_link, host_memory_error, link_bandwidth,
                                     no_link_error, no_link_note, plan_link)
from regen.planner.milp.highs import reset_solver_threads
from regen.planner.options import SolveOptions, check_solve_request, solve_options
from regen.planner.strategies import MILP_STRATEGIES, STRATEGIES
from regen.units import format_bytes, format_duration

Progress = Callable[[str], None] | None
SWAPPING_STRATEGIES = ("hybrid", "swap", "str", "offload-all")  # strategies that may swap (hybrid can do without)


# ---- solve -------------------------------------------------------------------------------------


def solve(profile: Profile, memory_cap_bytes: int, options: SolveOptions | str | None = None, *,
          progress: Progress = None, **settings) -> Plan:
    """A plan for `profile` under `memory_cap_bytes`, checked by the simulator.

    `options`: a SolveOptions (regen.planner.options), or a strategy name; `settings` are SolveOptions
    fields by name, over `options` (`solve(profile, cap, "hybrid", time_limit_s=20)`). The MILP strategies
    stop at `rel_gap` (relative gap between the plan and the solver's bound, 1% by default) or at
    `time_limit_s`, whichever comes first. The host link is `bandwidth_gb_s` or `link_ratio` (one of them,
    or neither for the profile's own bandwidth; regen.planner.host_link), and the host pool stays within
    `host_memory_cap_bytes` (default: a fraction of this machine's RAM). `start_plans`: (name, choices)
    plans of this profile's graph the MILP strategies may start from (the least-peak plan of an
    InfeasibleCapError). `gradients_held`: the training loop keeps its gradients from one step to the next
    (gradient accumulation), and the plan counts them for the whole step (regen.planner.held_gradients).
    `progress` gets one line per stage."""
    options = solve_options(options, **settings)
    check_solve_request(memory_cap_bytes, options)
    bw, link_source = link_bandwidth(profile, options.bandwidth_gb_s, options.link_ratio)
    host_memory_cap_bytes = options.host_memory_cap_bytes
    if host_memory_cap_bytes is None:
        host_memory_cap_bytes = default_host_memory_cap_bytes()
    strategy = options.strategy
    say = progress or (lambda _m: None)
    notes = []
    if has_no_link(profile, link_source) and strategy in SWAPPING_STRATEGIES:
        if strategy != "hybrid":
            raise no_link_error(strategy)
        notes.append(no_link_note(strategy))
        say(notes[-1])
        strategy = "recompute"
    held_bytes = 0
    if options.gradients_held:
        held_bytes = held_gradient_bytes(profile)
        profile = with_gradients_held(profile)
        notes.append(f"gradients held from step to step: {format_bytes(held_bytes)} counted for the whole step")
        say(notes[-1])
    reset_solver_threads()
    t0 = time.perf_counter()
    graph = build_graph(profile, bw, bw, host_memory_cap_bytes=host_memory_cap_bytes,
                        start_plans=list(options.start_plans), module_replays=options.module_replays)
    decidable = [c for c in graph.candidates if c.can_swap or c.can_recompute]
    say(f"planning {len(graph.candidates)} saved tensors ({len(decidable)} with a choice) over "
        f"{graph.num_steps} ops; cap {format_bytes(memory_cap_bytes)} of unplanned peak "
        f"{format_bytes(profile.peak_bytes)}; "
        f"strategy {strategy}")
    run = STRATEGIES[strategy]
    keep_everything = strategy in MILP_STRATEGIES and memory_cap_bytes >= graph.unplanned_peak_bytes
    if keep_everything:  # nothing to save: any swap or recompute would only cost time
        run = STRATEGIES["keep-all"]
        say("the cap is at or above the unplanned peak: every tensor is kept")
    result = run(graph, memory_cap_bytes, options.time_limit_s, options.rel_gap, say)
    if keep_everything:
        result.notes.append("the cap is at or above the unplanned peak: every tensor is kept")
    choices, sim = order_copy_ins(graph, result.choices, memory_cap_bytes)
    result = dataclasses.replace(result, choices=choices)
    if not sim.valid:
        raise AssertionError(f"internal error: strategy {strategy} produced an inconsistent plan: {sim.errors[:3]}")
    if sim.peak_bytes > memory_cap_bytes:
        raise AssertionError(f"internal error: strategy {strategy} produced a plan whose simulated peak "
                             f"{sim.peak_bytes} is over the cap {memory_cap_bytes}; not writing it")
    result.report.solve_time_s = time.perf_counter() - t0
    link = plan_link(profile, graph.d2h_bytes_per_s, graph.h2d_bytes_per_s, link_source)
    plan = build_plan(graph, result, memory_cap_bytes, strategy, sim, link=link, notes=notes,
                      profile_path=options.profile_path)
    plan.gradients_held_bytes = held_bytes
    if host_memory_cap_bytes is not None and plan.host_pool_bytes > host_memory_cap_bytes:
        raise host_memory_error(plan.host_pool_bytes, host_memory_cap_bytes, strategy)
    unit = graph.time_unit
    say(f"simulated: peak {format_bytes(sim.peak_bytes)}, step {format_duration(plan.simulated.step_time_s, unit)} "
        f"(predicted {format_duration(plan.predicted.step_time_s, unit)}, unplanned "
        f"{format_duration(plan.baseline.step_time_s, unit)})")
    return plan


def solve_within_reach(profile: Profile, memory_cap_bytes: int, options: SolveOptions | str | None = None, *,
                       progress: Progress = None, **settings) -> Plan:
    """`solve` at `memory_cap_bytes`, or, when no plan of the strategy reaches it, at the smallest cap one
    reaches (the plan's `memory_cap_bytes` says which), starting from the least-peak plan found; the
    arguments are solve's."""
    options = solve_options(options, **settings)
    try:
        return solve(profile, memory_cap_bytes, options, progress=progress)
    except InfeasibleCapError as exc:
        if exc.smallest_feasible_cap_bytes is None:
            raise
        again = dataclasses.replace(options, start_plans=exc.start_plans)
        return solve(profile, exc.smallest_feasible_cap_bytes, again, progress=progress)
