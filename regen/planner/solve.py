"""`regen solve`: read the input, parse the cap, run a strategy, check the result, build the Plan.

Strategies: `hybrid` (the MILP over keep/swap/recompute), `recompute` and `swap` (the same MILP with
one action switched off), `str` (STR's formulation, regen.planner.str_milp), and the heuristics
`keep-all` and `chen`. Every plan is replayed by the simulator before it is returned: a MILP plan
whose simulated peak is over the cap (the MILP's copy channel is a per-step relaxation of the
runtime's FIFO streams) is repaired by adding FIFO-order constraints between the swaps involved and,
if that is not enough, headroom at the offending steps, then re-solved; a heuristic plan over the cap
is an InfeasibleCapError naming the strategy's own peak.
"""

from __future__ import annotations

import time
from typing import Callable

from regen.errors import InfeasibleCapError, RegenError, SolverError
from regen.formats.plan import (ACTION_KEEP, ACTION_RECOMPUTE, ACTION_SWAP, Decision, Plan, PlanFigures, RecipeOp,
                                SolverReport)
from regen.formats.profile import Profile
from regen.planner import heuristics
from regen.planner.graph import PlanningGraph, build_graph
from regen.planner.milp import (DEFAULT_REL_GAP, MilpOptions, MilpResult, Model, _Infeasible, highs_available,
                                highs_model, improve_by_blocks, lp_bound, lp_disagreement, model_size_message,
                                reset_solver_threads, result_from_values, solve_model)
from regen.planner.simulator import Choice, SimulationResult, simulate
from regen.units import BYTES_PER_GB, format_bytes

STRATEGIES = ("hybrid", "recompute", "swap", "str", "keep-all", "chen")
MILP_STRATEGIES = {"hybrid": (True, True), "recompute": (False, True), "swap": (True, False)}
MAX_REPAIR_ROUNDS = 4
MIN_CAP_TIME_LIMIT_S = 30.0  # for the smallest-feasible-cap search after an infeasible cap
MIN_SOLVER_TIME_S = 1e-3  # a repair round gets at least this long even past the deadline
WARM_START_TIME_FRACTION = 0.2  # of the time limit, for the recompute-only warm start of hybrid
BLOCK_IMPROVE_MIN_CANDIDATES = 200  # graphs with more decidable candidates are solved block by block
LP_BOUND_TIME_FRACTION = 0.4  # of the time limit, at most, for their LP bound (~3 s on 1,000 candidates, ~19 s on 3,000)
FINAL_CHECK_TIME_FRACTION = 0.05  # ... kept back from the block sweeps for the simulator check
FULL_SOLVE_MIN_TIME_FRACTION = 0.2  # sweeps that stop early leave the full MILP at least this much
NO_BOUND_BLOCK_TIME_FRACTION = 0.5  # of the time left, for the sweeps when the LP was too slow for a bound

Progress = Callable[[str], None] | None


# ---- solve -------------------------------------------------------------------------------------


def solve(profile: Profile, memory_cap_bytes: int, strategy: str = "hybrid", time_limit_s: float = 60.0,
          bandwidth_gb_s: float | None = None, progress: Progress = None, rel_gap: float = DEFAULT_REL_GAP) -> Plan:
    """A plan for `profile` under `memory_cap_bytes`, checked by the simulator.

    The MILP strategies stop at `rel_gap` (relative gap between the plan and the solver's bound, 1% by
    default) or at `time_limit_s`, whichever comes first."""
    if strategy not in STRATEGIES:
        raise RegenError(f"unknown strategy '{strategy}': use one of {', '.join(STRATEGIES)}")
    if not memory_cap_bytes or memory_cap_bytes <= 0:
        raise RegenError(f"the memory cap must be positive (got {memory_cap_bytes})")
    if not time_limit_s or time_limit_s <= 0:
        raise RegenError(f"--time-limit must be positive (got {time_limit_s})")
    if not 0 <= rel_gap < 1:
        raise RegenError(f"the relative gap must be in [0, 1) (got {rel_gap})")
    bw = bandwidth_gb_s * BYTES_PER_GB if bandwidth_gb_s else None
    reset_solver_threads()
    t0 = time.perf_counter()
    graph = build_graph(profile, bw, bw)
    say = progress or (lambda _m: None)
    decidable = [c for c in graph.candidates if c.can_swap or c.can_recompute]
    say(f"planning {len(graph.candidates)} saved tensors ({len(decidable)} with a choice) over "
        f"{graph.num_steps} ops; cap {format_bytes(memory_cap_bytes)} of unplanned peak "
        f"{format_bytes(profile.peak_bytes)}; "
        f"strategy {strategy}")
    notes: list[str] = []
    if strategy in MILP_STRATEGIES:
        choices, report, predicted_time, predicted_peak = _solve_milp(
            graph, memory_cap_bytes, strategy, time_limit_s, say, notes, rel_gap)
    elif strategy == "str":
        from regen.planner.str_milp import solve_str

        choices, report, predicted_time, predicted_peak = solve_str(graph, memory_cap_bytes, time_limit_s, say, notes)
    else:
        choices = heuristics.keep_all(graph) if strategy == "keep-all" else heuristics.chen(graph)
        sim = simulate(graph, choices)
        report = SolverReport(name="heuristic", status="heuristic", objective_s=sim.step_time_s, bound_s=None,
                              gap=None, solve_time_s=time.perf_counter() - t0)
        predicted_time, predicted_peak = sim.step_time_s, sim.peak_bytes
        if sim.peak_bytes > memory_cap_bytes:
            raise InfeasibleCapError(
                f"strategy {strategy} reaches a peak of {format_bytes(sim.peak_bytes)}, over the cap of "
                f"{format_bytes(memory_cap_bytes)}; use a cap of at least {format_bytes(sim.peak_bytes)} "
                "or --strategy hybrid",
                smallest_feasible_cap_bytes=sim.peak_bytes)
    for ch in choices.values():  # copy-ins start where the runtime issues them (docs/internals.md)
        if ch.action == ACTION_SWAP and ch.swap_in_step is not None:
            ch.swap_in_step = graph.snap_copy_in(ch.swap_in_step)
    _unblock_copy_ins(graph, choices, memory_cap_bytes)
    sim = simulate(graph, choices)
    if not sim.valid:
        raise AssertionError(f"internal error: strategy {strategy} produced an inconsistent plan: {sim.errors[:3]}")
    if sim.peak_bytes > memory_cap_bytes:
        raise AssertionError(f"internal error: strategy {strategy} produced a plan whose simulated peak "
                             f"{sim.peak_bytes} is over the cap {memory_cap_bytes}; not writing it")
    report.solve_time_s = time.perf_counter() - t0
    plan = build_plan(graph, choices, memory_cap_bytes, strategy, report, predicted_time, predicted_peak, sim, notes)
    say(f"simulated: peak {format_bytes(sim.peak_bytes)}, step {plan.simulated.step_time_s * 1e3:.3f} ms "
        f"(predicted {plan.predicted.step_time_s * 1e3:.3f} ms, unplanned {plan.baseline.step_time_s * 1e3:.3f} ms)")
    return plan


MAX_UNBLOCK_TRIES = 400  # simulations the copy-in reordering may spend


def _unblock_copy_ins(graph: PlanningGraph, choices: dict[int, Choice], cap: int) -> None:
    """Repair head-of-line blocking on the runtime's single host-to-device stream.

    The MILP lets copies share the channel within a step; the runtime's stream runs them in issue
    order, so a large copy Y issued before a copy X that is needed sooner can delay X. For each such
    pair, try issuing Y together with X (the stream then takes X first), or X together with Y (X
    resident a little earlier: kept only if the simulated peak stays within the cap), and keep a
    change when the simulated step time drops.
    """
    swaps = [(i, ch) for i, ch in choices.items() if ch.action == ACTION_SWAP and ch.swap_in_step is not None]
    if len(swaps) < 2:
        return
    best = simulate(graph, choices).step_time_s
    tries = 0

    def attempt(ch: Choice, step: int) -> bool:
        nonlocal best, tries
        tries += 1
        old = ch.swap_in_step
        ch.swap_in_step = step
        trial = simulate(graph, choices)
        if trial.valid and trial.peak_bytes <= cap and trial.step_time_s < best * (1 - 1e-9):
            best = trial.step_time_s
            return True
        ch.swap_in_step = old
        return False

    for i, ch_y in sorted(swaps, key=lambda x: x[1].swap_in_step):
        b_y = graph.candidates[i].first_backward
        blocked = sorted(((ch_x.swap_in_step, j, ch_x) for j, ch_x in swaps
                          if ch_y.swap_in_step < ch_x.swap_in_step < b_y
                          and graph.candidates[j].first_backward < b_y), key=lambda x: (x[0], x[1]))
        for step, _, ch_x in blocked:
            if tries >= MAX_UNBLOCK_TRIES:
                return
            if ch_y.swap_in_step < step < b_y and not attempt(ch_y, step):
                attempt(ch_x, ch_y.swap_in_step)


def _solve_milp(graph: PlanningGraph, cap: int, strategy: str, time_limit_s: float, say, notes: list[str],
                rel_gap: float = DEFAULT_REL_GAP):
    allow_swap, allow_rec = MILP_STRATEGIES[strategy]
    deadline = time.perf_counter() + time_limit_s
    lower = lower_bound_peak(graph, allow_swap, allow_rec)
    if lower > cap:
        _raise_infeasible(graph, cap, allow_swap, allow_rec, time_limit_s, say, lower)
    warm = _warm_start(graph, cap, strategy, time_limit_s, say)
    warm_values = None
    options = MilpOptions(allow_swap=allow_swap, allow_recompute=allow_rec, rel_gap=rel_gap)
    notes.append(f"the solver stops at a {100 * rel_gap:g}% relative gap or the time limit")
    result, timed_out = None, False
    for round_ in range(MAX_REPAIR_ROUNDS + 1):
        model = Model(graph, cap, options)
        if round_ == 0 and warm is not None and _is_large(graph) and highs_available():
            result, warm_values = _solve_by_blocks(model, warm, deadline, time_limit_s, rel_gap, say)
            if result is not None:
                sim = simulate(graph, result.choices)
                if sim.peak_bytes <= cap and sim.valid:
                    break
                result = None
        remaining = max(MIN_SOLVER_TIME_S, deadline - time.perf_counter())
        try:
            result = solve_model(model, remaining, rel_gap=options.rel_gap, warm_start=warm, progress=say,
                                 warm_values=warm_values)
        except _Infeasible:
            if round_ == 0:
                _raise_infeasible(graph, cap, allow_swap, allow_rec, time_limit_s, say, lower)
            result = None
            break
        except SolverError:
            if warm is None:
                raise
            timed_out, result = True, None  # fall back to the warm start, which passes the simulator
            break
        sim = simulate(graph, result.choices)
        if sim.peak_bytes <= cap and sim.valid:
            break
        say(f"simulated peak {format_bytes(sim.peak_bytes)} is over the cap (copy-out order); adding FIFO constraints")
        notes.append(f"repair round {round_ + 1}: simulated peak {sim.peak_bytes} over the cap, re-solved")
        _add_repairs(graph, result.choices, sim, cap, options)
    final = result
    if final is not None:  # `sim` is the loop's simulation of final.choices
        if sim.peak_bytes <= cap and sim.valid:
            report = SolverReport(name=final.solver, status=final.status, objective_s=final.objective_s,
                                  bound_s=final.bound_s, gap=final.gap, solve_time_s=final.solve_time_s,
                                  time_limit_s=time_limit_s)
            return final.choices, report, final.objective_s, final.predicted_peak_bytes
    if warm is not None:
        notes.append("the MILP found no plan within the time limit; the warm-start plan is used instead" if timed_out
                     else "the MILP's plans did not pass the simulator; the warm-start plan is used instead")
        say(notes[-1])
        sim = simulate(graph, warm)
        report = SolverReport(name="heuristic", status="heuristic", objective_s=sim.step_time_s, bound_s=None,
                              gap=None, solve_time_s=0.0, time_limit_s=time_limit_s)
        return warm, report, sim.step_time_s, sim.peak_bytes
    raise AssertionError("internal error: no plan passed the simulator under the cap")


def _is_large(graph: PlanningGraph) -> bool:
    return sum(1 for c in graph.candidates if c.can_swap or c.can_recompute) > BLOCK_IMPROVE_MIN_CANDIDATES


def _solve_by_blocks(model: Model, warm: dict[int, Choice], deadline: float, time_limit_s: float, rel_gap: float,
                     say) -> tuple[MilpResult | None, dict[str, float] | None]:
    """Large graphs: the LP relaxation's bound, then fix-and-optimize sweeps over blocks of candidates
    from the warm start for the rest of the time.

    On a few hundred candidates and more, HiGHS's branch and bound spends the whole time limit at the
    root (identical layers make many equivalent plans, so branching does not move the bound) and
    rarely improves a warm start, while block sub-MIPs solve in a second or two each. The result is
    judged against the LP bound; "optimal" means within `rel_gap` of it. When the sweeps stop early
    (no sweep improves any more) above the gap, or the LP did not finish in its share of the time
    (thousands of candidates), the caller's full solve continues from the plan and reports its bound.
    """
    t0 = time.perf_counter()
    say(model_size_message(model))
    lp = highs_model(model.prob, model.prob.variables())
    relaxation = lp_bound(model, max(MIN_SOLVER_TIME_S, LP_BOUND_TIME_FRACTION * time_limit_s), lp=lp)
    bound = relaxation[0] if relaxation is not None else None
    priority = lp_disagreement(model, relaxation[1], warm) if relaxation is not None else None
    say("LP relaxation: " + (f"bound {bound * model.time_unit * 1e3:.3f} ms" if bound is not None
                             else "no bound within its time share"))
    budget_s = deadline - time.perf_counter() - FINAL_CHECK_TIME_FRACTION * time_limit_s
    if bound is None:  # no bound to judge the plan against: leave the full MILP (and its bound) half the rest
        budget_s = NO_BOUND_BLOCK_TIME_FRACTION * budget_s
    target = bound / (1 - rel_gap) if bound is not None and bound > 0 else None
    improved = improve_by_blocks(model, warm, budget_s, progress=say, priority=priority, target_objective=target,
                                 lp=lp)
    if improved is None:
        return None, None
    choices, values, objective = improved
    result = result_from_values(model, choices, objective, bound, rel_gap, time.perf_counter() - t0)
    if result.gap is not None:
        say(f"block search: objective {result.objective_s * 1e3:.3f} ms (profiled op times), gap {100 * result.gap:.2f}% to the LP bound")
    if bound is None or (result.status != "optimal"
                         and deadline - time.perf_counter() > FULL_SOLVE_MIN_TIME_FRACTION * time_limit_s):
        return None, values  # the full MILP starts from this plan (and reports its own bound)
    return result, values


def _warm_start(graph: PlanningGraph, cap: int, strategy: str, time_limit_s: float, say) -> dict[int, Choice] | None:
    """The greedy plan, or for hybrid the recompute-only MILP's plan when it is cheaper (it solves fast:
    few binaries), so the hybrid search starts from a plan at least as good as recompute-only's."""
    allow_swap, allow_rec = MILP_STRATEGIES[strategy]
    candidates = []
    greedy = heuristics.greedy(graph, cap, allow_swap, allow_rec)
    if greedy is not None:
        candidates.append(("greedy", greedy))
    if strategy == "hybrid":
        # the recompute-only MILP (few binaries: a plan in seconds), with the rebuilt-with options
        # (sharing rebuilt work is often most of what recompute-only plans gain) or, when that finds
        # no plan within its share of the time, without them
        for label, byproducts in (("recompute-only MILP", True), ("recompute-only MILP without sharing", False)):
            try:
                model = Model(graph, cap, MilpOptions(allow_swap=False, allow_recompute=True,
                                                      allow_byproducts=byproducts))
                result = solve_model(model, max(1.0, WARM_START_TIME_FRACTION * time_limit_s))
            except SolverError:
                continue
            except _Infeasible:
                break
            candidates.append((label, result.choices))
            break
    best = None
    for name, choices in candidates:
        sim = simulate(graph, choices)
        if sim.valid and sim.peak_bytes <= cap and (best is None or sim.step_time_s < best[0]):
            best = (sim.step_time_s, name, choices)
    say("warm start: " + (f"{best[1]} plan, {best[0] * 1e3:.3f} ms" if best else "none found under the cap"))
    return best[2] if best else None


def _add_repairs(graph: PlanningGraph, choices: dict[int, Choice], sim: SimulationResult, cap: int,
                 options: MilpOptions) -> None:
    swapped = sorted((graph.candidates[i] for i, ch in choices.items() if ch.action == ACTION_SWAP),
                     key=lambda c: (c.issue_after, c.index))
    pairs = set(options.fifo_pairs)
    for k, a in enumerate(swapped):
        for b in swapped[k + 1:]:
            if b.out_window[0] > a.out_window[-1]:
                break
            pairs.add((a.index, b.index))
    added = len(pairs) - len(options.fifo_pairs)
    options.fifo_pairs = sorted(pairs)
    if added == 0:  # FIFO order already enforced: leave headroom where the simulator went over
        for s, (p, a) in enumerate(zip(sim.peak_timeline_bytes, sim.timeline_bytes)):
            over = max(p, a) - cap
            if over > 0:
                options.step_margin_bytes[s] = options.step_margin_bytes.get(s, 0) + over


def lower_bound_peak(graph: PlanningGraph, allow_swap: bool = True, allow_recompute: bool = True) -> int:
    """No plan's peak is below this: every candidate that can be gone at a step is gone."""
    n = graph.num_steps
    diff = [0] * (n + 1)
    for c in graph.candidates:
        lo = hi = None
        if allow_recompute and c.can_recompute:
            lo, hi = c.gap.start, c.gap.stop
        elif allow_swap and c.can_swap:
            lo, hi = max(c.gap.start, c.out_window[0] + 1), c.in_window[-1]
        if lo is not None and hi > lo:
            diff[lo] += c.bytes
            diff[hi] -= c.bytes
    best, run = 0, 0
    for s in range(n):
        run += diff[s]
        best = max(best, max(graph.peak_bytes[s], graph.after_bytes[s]) - run)
    return best


def _raise_infeasible(graph: PlanningGraph, cap: int, allow_swap: bool, allow_rec: bool, time_limit_s: float,
                      say, lower: int) -> None:
    say("the cap is infeasible; searching for the smallest feasible cap")
    smallest = smallest_feasible_cap(graph, allow_swap, allow_rec, min(time_limit_s, MIN_CAP_TIME_LIMIT_S))
    found = (f"the smallest feasible cap found is {format_bytes(smallest)} ({smallest} bytes)" if smallest is not None
             else "no feasible plan was found at any cap")
    raise InfeasibleCapError(
        f"no plan meets the memory cap of {format_bytes(cap)} ({cap} bytes): {found}; no plan can go below "
        f"{format_bytes(lower)} (memory that stays resident whatever the actions)",
        smallest_feasible_cap_bytes=smallest)


def smallest_feasible_cap(graph: PlanningGraph, allow_swap: bool = True, allow_recompute: bool = True,
                          time_limit_s: float = MIN_CAP_TIME_LIMIT_S) -> int | None:
    """The lowest cap at which a plan passes the simulator: the min-peak MILP, else the greedy at cap 0."""
    best = None
    try:
        model = Model(graph, None, MilpOptions(allow_swap=allow_swap, allow_recompute=allow_recompute,
                                                minimize_peak=True))
        result = solve_model(model, time_limit_s)
        sim = simulate(graph, result.choices)
        if sim.valid:
            best = max(sim.peak_bytes, result.min_cap_bytes or 0)
    except (_Infeasible, SolverError):
        pass
    if best is None:  # the most aggressive greedy plan: it stops when nothing more can go
        choices = heuristics.greedy(graph, 0, allow_swap, allow_recompute, best_effort=True)
        sim = simulate(graph, choices)
        if sim.valid:
            best = sim.peak_bytes
    return best


# ---- the plan ----------------------------------------------------------------------------------


def build_plan(graph: PlanningGraph, choices: dict[int, Choice], cap: int, strategy: str, report: SolverReport,
               predicted_time_s: float, predicted_peak_bytes: int, sim: SimulationResult,
               notes: list[str]) -> Plan:
    profile = graph.profile
    unpacks = sorted((e.unpack_before_op, e.unpack_order) for e in profile.saved_entries
                     if e.unpack_order is not None and e.unpack_before_op is not None)
    first_unpack = min((o for _, o in unpacks), default=None)
    decisions = []
    recipe_ops: dict[int, RecipeOp] = {}
    host_intervals = []
    for c in graph.candidates:
        s = c.saved
        ch = choices.get(c.index, Choice())
        d = Decision(saved_tensor=s.id, producer_op=s.producer_op, output_slot=s.output_slot, shape=list(s.shape),
                     dtype=s.dtype, bytes=c.bytes, action=ch.action)
        if ch.action == ACTION_SWAP:
            d.swap_out_after_op = c.issue_after
            d.swap_in_before_op = ch.swap_in_step
            d.swap_in_at_unpack = _unpack_position(unpacks, ch.swap_in_step, first_unpack)
            host_intervals.append((c.issue_after, c.first_backward, c.bytes))
        elif ch.action == ACTION_RECOMPUTE:
            d.recompute_before_op = c.first_backward
            if ch.rebuilt_with is not None:
                host = graph.candidates[ch.rebuilt_with]
                d.rebuilt_with = host.id
                d.recompute_before_op = host.first_backward
            d.recipe = list(ch.recipe.ops)
            d.recipe_inputs = [graph.candidates[a].id for a in ch.recipe.anchors]
            for q in ch.recipe.ops:
                op = profile.ops[q]
                recipe_ops[q] = RecipeOp(index=q, name=op.name, is_random=op.is_random)
        decisions.append(d)
    compute = graph.compute_time_s
    base_time = profile.step_time_s
    counts = {a: sum(1 for d in decisions if d.action == a) for a in (ACTION_KEEP, ACTION_SWAP, ACTION_RECOMPUTE)}
    notes = list(notes) + [
        "step times are the profile's measured step time plus the plan's added time over the sum of op times "
        f"({compute:.6g} s)",
        f"actions: keep {counts[ACTION_KEEP]}, swap {counts[ACTION_SWAP]}, recompute {counts[ACTION_RECOMPUTE]}"
        + (f" ({rebuilt} of them rebuilt with another's recipe)"
           if (rebuilt := sum(1 for d in decisions if d.rebuilt_with is not None)) else ""),
    ]
    return Plan(
        fingerprint=profile.fingerprint, workload=dict(profile.workload), strategy=strategy, memory_cap_bytes=int(cap),
        baseline=PlanFigures(peak_bytes=int(profile.peak_bytes), step_time_s=float(base_time)),
        predicted=PlanFigures(peak_bytes=int(predicted_peak_bytes),
                              step_time_s=float(base_time + predicted_time_s - compute)),
        simulated=PlanFigures(peak_bytes=int(sim.peak_bytes), step_time_s=float(base_time + sim.step_time_s - compute)),
        solver=report, d2h_bytes_per_s=graph.d2h_bytes_per_s, h2d_bytes_per_s=graph.h2d_bytes_per_s,
        host_pool_bytes=_peak_concurrent(host_intervals), num_forward_ops=graph.num_forward_ops,
        memory_at_start_bytes=int(profile.memory_at_start_bytes),
        decisions=decisions, recipe_ops=[recipe_ops[q] for q in sorted(recipe_ops)],
        baseline_timeline_bytes=list(graph.after_bytes), planned_timeline_bytes=[int(x) for x in sim.timeline_bytes],
        notes=notes,
    )


def _unpack_position(unpacks: list[tuple[int, int]], before_op: int, first_unpack: int | None) -> int | None:
    """The largest unpack_order whose unpack_before_op <= before_op (docs/internals.md)."""
    best = None
    for op, order in unpacks:
        if op > before_op:
            break
        best = order if best is None else max(best, order)
    return best if best is not None else first_unpack


def _peak_concurrent(intervals: list[tuple[int, int, int]]) -> int:
    events = []
    for lo, hi, nbytes in intervals:
        events.append((lo, nbytes))
        events.append((hi + 1, -nbytes))
    events.sort(key=lambda e: (e[0], e[1]))
    run = best = 0
    for _, delta in events:
        run += delta
        best = max(best, run)
    return best
