"""The MILP strategies (hybrid, recompute, swap): from a warm start to a plan that passes the simulator.

`plan_with_milp` takes a warm start (the greedy plan, or for hybrid the recompute-only MILP's plan
when it is cheaper), solves the MILP (on small graphs from the LP neighbourhood of the warm plan,
regen.planner.milp.neighbourhood; on large graphs first by blocks against the LP bound,
regen.planner.milp.blocks), and replays the plan in the simulator. The MILP's copy channel is a
per-step relaxation of the runtime's FIFO streams, so a plan whose simulated peak is over the cap is
repaired: FIFO-order constraints between the swaps whose copy-out windows overlap, and once those are
all in, headroom at the steps where the simulator went over; then the MILP is solved again. Without a
warm start, the MILP starts from any feasible solution (regen.planner.milp.feasibility). When no
MILP plan passes, the warm start (simulator-feasible by construction) is the plan. An infeasible cap
is an InfeasibleCapError naming the smallest feasible cap found (`smallest_feasible_cap`).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, replace
from typing import Callable

import pulp

from regen.errors import InfeasibleCapError, SolverError
from regen.formats.plan import ACTION_SWAP, SolverReport
from regen.planner import heuristics
from regen.planner.graph import PlanningGraph
from regen.planner.milp.blocks import (MIN_SOLVER_TIME_S, final_check_reserve_s, solve_by_blocks,
                                       time_for_full_solve)
from regen.planner.milp.feasibility import (FEASIBILITY_RESERVE_FRACTION, FEASIBILITY_TIME_FRACTION,
                                            FeasibleSolution, feasible_solution)
from regen.planner.milp.highs import require_highspy, to_highs_lp
from regen.planner.milp.memory_rows import CapInfeasible
from regen.planner.milp.model import MilpOptions, Model
from regen.planner.milp.neighbourhood import improve_where_lp_disagrees
from regen.planner.milp.relaxation import Relaxation
from regen.planner.milp.solution import MilpResult, read_choices, relative_gap, result_from_values, solve_model
from regen.planner.residency import host_pool_bytes, lower_bound_peak
from regen.planner.result import Choice, StrategyResult
from regen.planner.simulator import SimulationResult, simulate
from regen.units import format_bytes, format_duration

MAX_REPAIR_ROUNDS = 4
MIN_CAP_TIME_LIMIT_S = 30.0  # for the smallest-feasible-cap search after an infeasible cap
WARM_START_TIME_FRACTION = 0.5  # of the time limit, for the recompute-only warm start of hybrid (its Note)
BLOCK_IMPROVE_MIN_CANDIDATES = 200  # graphs with more decidable candidates are solved block by block
SWAP_BLOCK_IMPROVE_MIN_CANDIDATES = 60  # with swaps, from this many (Note [ Block search with swaps ])
# hybrid's recompute-only MILP warm start, up to this many decidable candidates (Note [ Recompute-only warm start ])
RECOMPUTE_WARM_START_MAX_CANDIDATES = 2000
MIN_WARM_MILP_S = 1.0  # the least a recompute-only warm-start MILP is given (HiGHS's presolve and its start)

# why the warm start stands in for the MILP's plan
MILP_TIMED_OUT = "the MILP found no plan within the time limit"
MILP_PLANS_OVER_CAP = "the MILP's plans did not pass the simulator"
MILP_ROWS_INFEASIBLE = "the MILP's rows admit no plan at this cap, where the simulator passes one"
MILP_SLOWER = "the MILP's plan simulates slower than the warm start ({milp} against {warm})"

# NOTE [ The simulator over the MILP's rows ]
# The simulator is the one judge of a plan's peak (regen.planner.solve's final check). The MILP's memory
# rows model it, with bounds that can be stricter than it somewhere (a capture's worst case, a transient
# charged at its step), so at a cap just at a plan's simulated peak the MILP can be infeasible while that
# plan passes: the smallest cap an InfeasibleCapError names, solved again from its least-peak plan, is one
# (a Llama at size "gpu" under the swap strategy, on an H200). A cap is infeasible only when no plan in
# hand passes the final check under it (the simulator's peak, and the host pool within its cap: the greedy
# plans do not see the host pool, so warm_start leaves out those over it); otherwise the best such plan
# (the warm start) is the plan. The copy-out rows can be stricter too (no plan of the MILP's waits for a
# copy-out, where the simulator lets compute wait at a release point): a large graph's LP relaxation that is
# infeasible proves the MILP so, and the warm start is the plan without a full MILP run (a 32-layer Llama's
# swap plan at half its peak increase, R = 0.9).

# NOTE [ The faster of the MILP's plan and the warm start ]
# The MILP's objective is a model of the simulator's step time (the copy channel a per-step relaxation of the
# runtime's FIFO streams, a gap of 1%), so its plan can simulate slower than the warm start it began from: a
# hybrid plan that swaps for no simulated gain (a zoo Gemma2 at checkpointing's peak: 35 swaps, 112.7 ms
# against the recompute-only plan's 112.6 ms, measured 2.4% slower). The simulator is the judge of time as of
# peak, so the warm start is the plan whenever it simulates faster: hybrid never ends slower than the
# recompute-only plans it started from, by the simulator.

# NOTE [ Block search with swaps ]
# With swaps the copy-channel rows make branch and bound stall far sooner, so the block search takes
# over from fewer candidates. The built-in GPT's 88 candidates at R = 0.9 and a 50% cap: the full MILP
# is 13.8% from its bound after 30 s, with a plan of 151.8 ms of op time, where the block sweeps reach
# 140.2 ms in 15 s; the CNN's 39 candidates solve alike either way.

# NOTE [ Recompute-only warm start ]
# Above RECOMPUTE_WARM_START_MAX_CANDIDATES the block sweeps improve on the greedy plans faster than the
# recompute-only MILP does: on 3,000 candidates it takes 6.7 s of a 30 s limit, and the sweeps started from
# its plan end 1.65% from the LP bound, against 1.03% from the greedy plan.
# Below it, hybrid should not end worse than recompute alone, so the recompute-only solves get up to half the time
# limit together (they stop sooner at their gap), the first as much of it as it takes: split in two halves, a 10-s
# hybrid solve of a 32-layer Llama (553 candidates) gave each 2.5 s beside the LP thread, neither improved on its
# start and the plan was the greedy hybrid one (827.2 ms simulated, +15.9%); with the first free to take all 5 s,
# 786.1 ms (+10.1%); at 16, 30 and 60 s within 0.1% of the halves' plans. A 12-layer GPT-2 (273 candidates, link
# ratio 1.08) solves recompute-only in 1.8-3.4 s. With a fifth of a 12 s limit (1.2 s a solve) hybrid ended 8.2%
# slower than the recompute plan once (a 22% cap, a fresh profile) and 0.6-4.9% faster on a stored profile at
# 18/22/30%; at 6 s, 0.6-2.0% slower. With half: 3.1-7.0% faster at 12 s, and at 6 s from 1.3% slower to 0.6% faster
# (one run each). On an H200 (GPT-2 at checkpointing's peak, near recompute's smallest cap) hybrid's plan was
# predicted 1.8x the recompute plan's step, with a fifth.

Say = Callable[[str], None]


def plan_with_milp(graph: PlanningGraph, cap: int, allow_swap: bool, allow_recompute: bool, time_limit_s: float,
                   rel_gap: float, say: Say) -> StrategyResult:
    """The MILP's plan under `cap`, checked by the simulator (or the warm start's when none passes)."""
    require_highspy()
    deadline = time.perf_counter() + time_limit_s
    lower = lower_bound_peak(graph, allow_swap, allow_recompute)
    if lower > cap:
        raise_infeasible(graph, cap, allow_swap, allow_recompute, time_limit_s, say, lower)
    options = MilpOptions(allow_swap=allow_swap, allow_recompute=allow_recompute, rel_gap=rel_gap)
    over_cap_peaks: list[int] = []  # simulated peaks of the MILP's plans over the cap (each fits its own peak)
    notes = [f"the solver stops at a {100 * rel_gap:g}% relative gap or the time limit"]
    try:
        first = _FirstModel.build(graph, cap, options, deadline, time_limit_s)
    except CapInfeasible:
        first = None
    start = warm_start(graph, cap, allow_swap, allow_recompute, time_limit_s, say)
    warm = start.choices if start is not None else None
    if first is None:  # Note [ The simulator over the MILP's rows ]
        if start is None:
            raise_infeasible(graph, cap, allow_swap, allow_recompute, time_limit_s, say, lower)
        result, fallback = None, MILP_ROWS_INFEASIBLE
    else:
        result, sim, fallback = _solve_and_repair(first, options, warm, deadline, time_limit_s, say, notes, lower,
                                                  over_cap_peaks)
        if result is not None and start is not None:
            fallback = _slower_than_warm(graph, sim, start.sim)
            result = None if fallback else result
    if result is not None:
        report = SolverReport(name="highs", status=result.status, objective_s=result.objective_s,
                              bound_s=result.bound_s, gap=result.gap, solve_time_s=result.solve_time_s,
                              time_limit_s=time_limit_s)
        return StrategyResult(choices=result.choices, report=report, predicted_step_time_s=result.objective_s,
                              predicted_peak_bytes=result.predicted_peak_bytes, notes=notes)
    if start is None:  # a loaded machine can leave the MILP without a plan that passes, and no heuristic fits
        raise no_plan_error(graph, cap, allow_swap, allow_recompute,
                            f"no plan under the cap within the time limit of {time_limit_s:g} s ({fallback}, and "
                            f"no heuristic plan fits it)", over_cap_peaks)
    notes.append(fallback + "; the warm-start plan is used instead")
    say(notes[-1])
    report = SolverReport(name="heuristic", status="heuristic", objective_s=start.sim.step_time_s, bound_s=None,
                          gap=None, solve_time_s=0.0, time_limit_s=time_limit_s)
    return StrategyResult(choices=start.choices, report=report, predicted_step_time_s=start.sim.step_time_s,
                          predicted_peak_bytes=start.sim.peak_bytes, notes=notes)


def _slower_than_warm(graph: PlanningGraph, milp: SimulationResult, warm: SimulationResult) -> str | None:
    """Why the warm start is the plan instead of the MILP's (Note [ The faster of the MILP's plan and the warm
    start ]; both as the simulator ran them), or None when the MILP's plan simulates at least as fast."""
    milp_s, warm_s = milp.step_time_s, warm.step_time_s
    if warm_s >= milp_s:
        return None
    unit = graph.time_unit
    return MILP_SLOWER.format(milp=format_duration(milp_s, unit), warm=format_duration(warm_s, unit))


@dataclass
class _FirstModel:
    """The first round's model, built before the warm start; on a large graph its LP relaxation starts
    solving on a thread of its own right away, alongside the warm start and the block sweeps."""

    model: Model
    relaxation: Relaxation | None
    lp: object  # the model as to_highs_lp built it (large graphs), or None

    @classmethod
    def build(cls, graph: PlanningGraph, cap: int, options: MilpOptions, deadline: float,
              time_limit_s: float) -> _FirstModel:
        model = Model(graph, cap, options)
        if not is_large(graph, options.allow_swap):
            return cls(model, None, None)
        lp = to_highs_lp(model.prob, model.columns())
        reserve_s = final_check_reserve_s(model, time_limit_s)
        return cls(model, Relaxation(model, deadline - time.perf_counter() - reserve_s, lp), lp)


def _solve_and_repair(first: _FirstModel, options: MilpOptions, warm: dict[int, Choice] | None,
                      deadline: float, time_limit_s: float, say: Say, notes: list[str], lower: int,
                      over_cap_peaks: list[int]) -> tuple[MilpResult | None, SimulationResult | None, str | None]:
    """The first MILP plan that passes the simulator, with repair rounds, its simulation and None; (None,
    None, why) when none does and the warm start stands in (why: one of the fallback reasons above). When a
    round's solve ends without a plan, or the last round's plan is over the cap, the feasibility start's plan
    stands if the simulator passes it, whichever round's model it solved. The simulated peaks of the plans over
    the cap go to `over_cap_peaks`."""
    graph, cap = first.model.graph, first.model.cap_bytes
    warm_values, start = None, warm  # the full MILP's start: on small graphs the LP neighbourhood's plan
    feasible = None  # without a warm start: the feasibility start's solution (of the round that ran it)
    block_plan, block_sim = None, None  # large graphs: the block search's plan, kept if the full MILP ends worse
    large = is_large(graph, options.allow_swap)
    for round_ in range(MAX_REPAIR_ROUNDS + 1):
        try:
            model = first.model if round_ == 0 else Model(graph, cap, options)
            if round_ == 0 and warm is not None and not large:
                start, warm_values = improve_where_lp_disagrees(model, warm, time_limit_s, say)
            if warm_values is None and start is None:  # no plan to start from: any feasible one first
                feasible = _feasibility_start(model, first.lp if model is first.model else None, deadline, say)
                warm_values = feasible.discrete if feasible is not None else None
            if round_ == 0 and warm is not None and large:
                result, warm_values, go_on = solve_by_blocks(model, warm, deadline, time_limit_s, options.rel_gap,
                                                             say, first.relaxation, first.lp)
                if first.relaxation.infeasible():
                    raise CapInfeasible()  # the LP relaxes the MILP: no plan of the MILP's at all
                sim = simulate(graph, result.choices) if result is not None else None
                time_left = time_for_full_solve(deadline, time_limit_s, first.relaxation.unfinished_s())
                if sim is not None and sim.fits(cap):
                    block_plan, block_sim = result, sim
                    if not go_on or not time_left:
                        return result, sim, None
                elif not time_left:
                    return None, None, MILP_TIMED_OUT
            remaining = max(MIN_SOLVER_TIME_S, deadline - time.perf_counter())
            result = solve_model(model, remaining, rel_gap=options.rel_gap, warm_start=start, progress=say,
                                 warm_values=warm_values)
        except CapInfeasible:
            if round_ == 0 and warm is None:
                raise_infeasible(graph, cap, options.allow_swap, options.allow_recompute, time_limit_s, say, lower)
            return None, None, MILP_ROWS_INFEASIBLE  # Note [ The simulator over the MILP's rows ]
        except SolverError as exc:
            if block_plan is not None:
                return block_plan, block_sim, None
            if (kept := _feasible_plan(feasible, options.rel_gap, say)) is not None:
                return kept
            if warm is None:  # the time limit asked for, not what was left of it for this last solve
                raise no_plan_error(graph, cap, options.allow_swap, options.allow_recompute,
                                    f"the solver (highs) stopped without a feasible plan within the time limit of "
                                    f"{time_limit_s:g} s", over_cap_peaks) from exc
            return None, None, MILP_TIMED_OUT
        if block_plan is not None:
            result = better_of(block_plan, result, options.rel_gap)
        kept_block_plan = block_plan is not None and result.choices is block_plan.choices
        sim = block_sim if kept_block_plan else simulate(graph, result.choices)
        if sim.fits(cap):
            return result, sim, None
        if sim.valid and within_host_cap(graph, result.choices):
            over_cap_peaks.append(sim.peak_bytes)
        say(f"simulated peak {format_bytes(sim.peak_bytes)} is over the cap (copy-out order); adding FIFO constraints")
        notes.append(f"repair round {round_ + 1}: simulated peak {sim.peak_bytes} over the cap, re-solved")
        add_repairs(graph, result.choices, sim, cap, options)
    if (kept := _feasible_plan(feasible, options.rel_gap, say)) is not None:
        return kept
    return None, None, MILP_PLANS_OVER_CAP


def better_of(block_plan: MilpResult, full: MilpResult, rel_gap: float) -> MilpResult:
    """The full MILP's result, or the block search's plan it started from when that is better (HiGHS stops
    within the gap of its own bound, which can be above the plan it was given), judged against the higher of
    the two bounds."""
    if not block_plan.objective_s < full.objective_s:
        return full
    bounds = [b for b in (block_plan.bound_s, full.bound_s) if b is not None]
    bound = max(bounds) if bounds else None
    gap = relative_gap(block_plan.objective_s, bound)
    return replace(block_plan, bound_s=bound, gap=gap, solve_time_s=full.solve_time_s,
                   status="optimal" if gap is not None and gap <= rel_gap else full.status)


def _feasibility_start(model: Model, lp, deadline: float, say: Say) -> FeasibleSolution | None:
    """Any plan under the cap (Note [ Feasibility first ]): with FEASIBILITY_TIME_FRACTION of the time left,
    then, if none was found, with all of it but the final check's reserve: a plan that fits is worth more
    than the objective's search, which finds a first plan far later (on a loaded machine, never)."""
    feasible = feasible_solution(model, FEASIBILITY_TIME_FRACTION * (deadline - time.perf_counter()), lp=lp)
    if feasible is None:
        left_s = (1 - FEASIBILITY_RESERVE_FRACTION) * (deadline - time.perf_counter())
        if left_s > MIN_SOLVER_TIME_S:
            say("feasibility start: none found yet; searching with the time left")
            feasible = feasible_solution(model, left_s, lp=lp)
    say("feasibility start: " + ("a plan under the cap found" if feasible is not None else "none found"))
    return feasible


def _feasible_plan(feasible: FeasibleSolution | None, rel_gap: float,
                   say: Say) -> tuple[MilpResult, SimulationResult, None] | None:
    """The feasibility start's own plan, when the solve from it ended without a better one that the simulator
    passes (out of time, or its plans over the cap) and the simulator passes it under the cap (None otherwise,
    and without a feasibility start): the time spent finding it is not thrown away."""
    if feasible is None:
        return None
    model = feasible.model
    feasible.load()
    choices = read_choices(model)
    sim = simulate(model.graph, choices)
    if not sim.fits(model.cap_bytes):
        return None
    say("the solve from the feasibility start found no better plan under the cap in its time: its plan stands")
    objective = pulp.value(model.prob.objective) or 0.0
    return result_from_values(model, choices, objective, None, rel_gap, 0.0), sim, None


def decidable_count(graph: PlanningGraph) -> int:
    """Candidates with a choice (swap or recompute)."""
    return sum(1 for c in graph.candidates if c.can_swap or c.can_recompute)


def is_large(graph: PlanningGraph, allow_swap: bool) -> bool:
    """More decidable candidates than branch and bound handles well: solved by blocks first."""
    return decidable_count(graph) > (SWAP_BLOCK_IMPROVE_MIN_CANDIDATES if allow_swap else BLOCK_IMPROVE_MIN_CANDIDATES)


@dataclass
class WarmStart:
    """The plan the search starts from, and the simulator's view of it."""

    name: str
    choices: dict[int, Choice]
    sim: SimulationResult


def warm_start(graph: PlanningGraph, cap: int, allow_swap: bool, allow_recompute: bool, time_limit_s: float,
               say: Say) -> WarmStart | None:
    """The greedy plan, per-block checkpointing (when the profile has regions), or for hybrid the
    recompute-only greedy's or (up to RECOMPUTE_WARM_START_MAX_CANDIDATES) the recompute-only MILP's
    plan, whichever is the fastest under the cap (with its host pool within the host memory cap), so the
    search starts from a plan at least as good as each of them."""
    candidates = list(graph.start_plans)  # plans the caller had (the least-peak plan of this graph)
    greedy = heuristics.greedy(graph, cap, allow_swap, allow_recompute)
    if greedy is not None:
        candidates.append(("greedy", greedy))
    greedy_recompute = None
    if allow_swap and allow_recompute:  # the swapping greedy can stall past the cap where recompute fits
        greedy_recompute = heuristics.greedy(graph, cap, False, True)
        if greedy_recompute is not None:
            candidates.append(("greedy recompute-only", greedy_recompute))
    if allow_recompute and graph.regions:  # per-block checkpointing: the MILP starts no worse than it
        candidates.append(("checkpoint-blocks", heuristics.checkpoint_blocks(graph)))
    if allow_swap and allow_recompute and decidable_count(graph) <= RECOMPUTE_WARM_START_MAX_CANDIDATES:
        candidates += recompute_only_milp_plans(graph, cap, WARM_START_TIME_FRACTION * time_limit_s,
                                                greedy_recompute)
    best = None
    for name, choices in candidates:
        if not within_host_cap(graph, choices):
            continue  # the final check would refuse it (the greedy plans do not see the host pool)
        sim = simulate(graph, choices)
        if sim.fits(cap) and (best is None or sim.step_time_s < best.sim.step_time_s):
            best = WarmStart(name, choices, sim)
    say("warm start: " + (f"{best.name} plan, {format_duration(best.sim.step_time_s, graph.time_unit)} (profiled op "
                          f"times)" if best else "none found under the cap"))
    return best


def within_host_cap(graph: PlanningGraph, choices: dict[int, Choice]) -> bool:
    """The plan's host pool fits the graph's host memory cap (the final check refuses a plan past it)."""
    host_cap = graph.host_memory_cap_bytes
    return host_cap is None or host_pool_bytes(graph.candidates, choices) <= host_cap


def recompute_only_milp_plans(graph: PlanningGraph, cap: int, time_limit_s: float,
                              start: dict[int, Choice] | None = None) -> list[tuple[str, dict]]:
    """The recompute-only MILP's plans (few binaries: seconds), labelled: first without the rebuilt-with
    options (a plan fast at any size), started from `start` (the greedy recompute-only plan), then with them
    (sharing rebuilt work is often most of what recompute-only plans gain), started from the first plan: each
    ends no worse than its start even when its time runs out (above ~2,000 candidates it would find no plan of
    its own in that time). The first may use all of `time_limit_s`, the second what is left (at least
    MIN_WARM_MILP_S): on a 32-layer Llama beside the LP relaxation the first needs 3-8 s, and halves of a
    10-s solve's share (2.5 s each) left both on their start."""
    plans = []
    share_end = time.perf_counter() + time_limit_s
    for label, rebuilt_with in (("recompute-only MILP without sharing", False), ("recompute-only MILP", True)):
        options = MilpOptions(allow_swap=False, allow_recompute=True, allow_rebuilt_with=rebuilt_with)
        try:  # the first may take the whole share (it usually stops at its gap well before), the second the rest
            result = solve_model(Model(graph, cap, options), max(MIN_WARM_MILP_S, share_end - time.perf_counter()),
                                 warm_start=start)
        except SolverError:
            continue
        except CapInfeasible:
            break
        plans.append((label, result.choices))
        start = result.choices
    return plans


def add_repairs(graph: PlanningGraph, choices: dict[int, Choice], sim: SimulationResult, cap: int,
                options: MilpOptions) -> None:
    """FIFO order between swaps whose copy-out windows overlap; once every such pair is ordered,
    headroom at the steps where the simulator went over the cap."""
    swapped = sorted((graph.candidates[i] for i, ch in choices.items() if ch.action == ACTION_SWAP),
                     key=lambda c: (c.issue_after, c.first_pack_index, c.index))
    pairs = set(options.fifo_pairs)
    for k, a in enumerate(swapped):
        for b in swapped[k + 1:]:
            if b.out_window[0] > a.out_window[-1]:
                break
            pairs.add((a.index, b.index))
    added = len(pairs) - len(options.fifo_pairs)
    options.fifo_pairs = sorted(pairs)
    if added == 0:
        for s in range(graph.num_steps):
            over = sim.step_bytes(s) - cap
            if over > 0:
                options.step_margin_bytes[s] = options.step_margin_bytes.get(s, 0) + over


def no_plan_error(graph: PlanningGraph, cap: int, allow_swap: bool, allow_recompute: bool, why: str,
                  plan_peaks: tuple[int, ...] | list[int] = ()) -> SolverError:
    """The error for a search that ended without any plan under `cap`, `why` first, naming the least cap a plan
    is known to fit: the greedy plans' least, or the lowest of `plan_peaks` (the simulated peaks of the search's
    own plans over the cap) where lower (a cap between it and `cap` may have a plan the solver finds with more
    time)."""
    least = min([*plan_peaks, *(greedy_least_peak(graph, swap, allow_recompute)[0]
                                for swap in ({allow_swap, False} if allow_recompute else {allow_swap}))])
    return SolverError(f"{why}: no plan under the cap of {format_bytes(cap)} ({cap} bytes); a plan fits a cap of "
                       f"{format_bytes(least)} ({least} bytes), so raise the cap (to there at most) or time_limit_s")


def raise_infeasible(graph: PlanningGraph, cap: int, allow_swap: bool, allow_recompute: bool, time_limit_s: float,
                     say: Say, lower: int) -> None:
    search_s = min(time_limit_s, MIN_CAP_TIME_LIMIT_S)
    say(f"the cap is infeasible; searching for the smallest feasible cap (up to {search_s:g} s: the search improves "
        f"its cap until then)")
    smallest, choices = least_peak_plan(graph, allow_swap, allow_recompute, search_s)
    found = (f"the smallest feasible cap found is {format_bytes(smallest)} ({smallest} bytes)" if smallest is not None
             else "no feasible plan was found at any cap")
    raise InfeasibleCapError(
        f"no plan meets the memory cap of {format_bytes(cap)} ({cap} bytes): {found}; no plan can go below "
        f"{format_bytes(lower)} (memory that stays resident whatever the actions)",
        smallest_feasible_cap_bytes=smallest, plan_at_smallest=choices)


def min_peak_plan(graph: PlanningGraph, allow_swap: bool, allow_recompute: bool, time_limit_s: float,
                  warm_start: dict[int, Choice] | None = None
                  ) -> tuple[dict[int, Choice], SimulationResult, int] | None:
    """The min-peak MILP's plan, its simulation and the least cap both the MILP and the simulator give it
    (None when the MILP finds none in time, or its plan is not valid)."""
    try:
        model = Model(graph, None, MilpOptions(allow_swap=allow_swap, allow_recompute=allow_recompute,
                                                minimize_peak=True))
        result = solve_model(model, time_limit_s, warm_start=warm_start)
    except (CapInfeasible, SolverError):
        return None
    sim = simulate(graph, result.choices)
    return (result.choices, sim, max(sim.peak_bytes, result.min_cap_bytes or 0)) if sim.valid else None


def smallest_feasible_cap(graph: PlanningGraph, allow_swap: bool = True, allow_recompute: bool = True,
                          time_limit_s: float = MIN_CAP_TIME_LIMIT_S) -> int | None:
    """The lowest cap at which a plan passes the simulator (`least_peak_plan`)."""
    return least_peak_plan(graph, allow_swap, allow_recompute, time_limit_s)[0]


def least_peak_plan(graph: PlanningGraph, allow_swap: bool, allow_recompute: bool,
                    time_limit_s: float) -> tuple[int | None, dict[int, Choice] | None]:
    """(the lowest cap at which a plan passes the simulator, that plan): the min-peak MILP's, else the lower of
    the greedy's at cap 0 and keeping everything (the unplanned peak, which no smallest cap is above). The
    plan is a warm start for a solve at that cap (`solve(..., start_plans=...)`), where the MILP may otherwise
    search long for its first plan. With both actions, the recompute-only min-peak MILP (a smaller model:
    seconds where the hybrid one may stop at its time limit far from its best) gets half the time and
    starts the hybrid one, so hybrid never names a smallest cap above recompute-only's."""
    least = None
    if allow_swap and allow_recompute:
        least = min_peak_plan(graph, False, True, time_limit_s / 2)
        time_limit_s /= 2
    hybrid = min_peak_plan(graph, allow_swap, allow_recompute, time_limit_s,
                           warm_start=least[0] if least is not None else None)
    if hybrid is not None and (least is None or hybrid[2] <= least[2]):
        least = hybrid
    if least is not None and least[2] <= graph.unplanned_peak_bytes:
        return least[2], least[0]
    return greedy_least_peak(graph, allow_swap, allow_recompute)  # at most the unplanned peak: below `least`


def greedy_least_peak(graph: PlanningGraph, allow_swap: bool, allow_recompute: bool) -> tuple[int, dict[int, Choice]]:
    """(the lowest cap at which the greedy plan that drops all it can passes the simulator, that plan), or the
    unplanned peak and keeping everything where that is lower: a smallest cap above it is no answer (a greedy
    plan that swaps everything can peak higher, its copy-ins' buffers on top of what it could not free in time);
    the greedy does not see the host pool, and a plan past the host memory cap is no answer either."""
    choices = heuristics.greedy(graph, 0, allow_swap, allow_recompute, best_effort=True)
    sim = simulate(graph, choices)
    if sim.valid and within_host_cap(graph, choices) and sim.peak_bytes <= graph.unplanned_peak_bytes:
        return sim.peak_bytes, choices
    return graph.unplanned_peak_bytes, {}
