"""The large-graph search: fix-and-optimize sweeps over blocks, judged against the LP relaxation's bound.

On a few hundred candidates and more, HiGHS's branch and bound spends the whole time limit at the
root (identical layers make many equivalent plans, so branching does not move the bound) and rarely
improves a warm start, while block sub-MIPs of about BLOCK_CANDIDATES candidates solve to a small gap
in a tenth of a second or so. So `solve_by_blocks` re-solves the MILP one block of candidates at a
time, as a model of its own with every other candidate fixed at the incumbent (`improve_by_blocks`,
regen.planner.milp.submodel), keeping each improvement, while the LP relaxation (a valid lower bound;
regen.planner.milp.relaxation) solves on the other core; once it has, the blocks where the plan
differs most from the LP solution go first, and the sweeps stop when the plan is within the gap of the
bound or the time is up; once a sweep ends far from the bound, the full MILP runs on the idle core beside
the sweeps, trading plans with them (regen.planner.milp.background). On a model of repeated layers
(regen.planner.milp.twins), from the second sweep on, the blocks are cut at the layers' boundaries and each
improvement is proposed to the block's twin layers (Note [ Twin layers ]).
docs/milp.md describes the search; regen.planner.milp.search decides when it runs.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import Callable

import pulp

from regen.planner.milp.background import BackgroundMilp
from regen.planner.milp.highs import new_highs, size_message, solver_output_to_stderr, to_highs_lp
from regen.planner.milp.model import Model
from regen.planner.milp.relaxation import Relaxation, lp_disagreement
from regen.planner.milp.submodel import RowwiseModel, SubModel, restrict
from regen.planner.milp.solution import MilpResult, read_choices, result_from_values, warm_start_values
from regen.planner.milp.twins import Proposal, Twins, find_twins, layer_blocks, propose
from regen.planner.result import Choice
from regen.units import format_duration

BLOCK_CANDIDATES = 20  # candidates re-optimised together
MIN_BLOCK_TIME_S = 0.5
# a block's sub-MIP stops at this gap, relative to the *whole* step time: a block can only move the
# objective by a fraction of a percent, so the planner's 1% would stop every block at its warm start
BLOCK_REL_GAP = 1e-4
MAX_BLOCK_SWEEPS = 8
# another sweep only after one that lowered the objective by this fraction: below it the full MILP, started
# from the sweeps' plan, closes the gap sooner (a 32-layer Llama's recompute plan: sweeps 3-5 gained 0.1-0.15%
# each in 6 s, the MILP then closed 1.26% to 1% in 2 s)
SWEEP_MIN_GAIN = 3e-3
MIN_SOLVER_TIME_S = 1e-3
MIN_FULL_MILP_BESIDE_S = 1.0  # the full MILP starts beside the sweeps only with this much of their time left...
FULL_MILP_BESIDE_GAPS = 1.5  # ... and while their plan is further from the bound than this many times the gap
UNGUIDED_BLOCK_TIME_S = 2.0  # at most, per block, while the LP bound is not known yet
FINAL_CHECK_TIME_FRACTION = 0.05  # of the time limit, kept back from the sweeps for the simulator check
FINAL_CHECK_S_PER_CANDIDATE = 5e-4  # and at least this per candidate with a choice (Note [ Final check reserve ])

# NOTE [ Final check reserve ]
# Reading the plan back, ordering its copy-ins and the simulator's final check take up to about 0.5 s per
# 1,000 candidates with a choice, so the sweeps keep back the larger of FINAL_CHECK_TIME_FRACTION of the
# time limit and FINAL_CHECK_S_PER_CANDIDATE per candidate: with 5% only, a 30 s solve of 6,000
# candidates ends at 31.6 s.
FULL_SOLVE_MIN_TIME_FRACTION = 0.2  # sweeps that stop early leave the full MILP at least this much
SWEEP_PROGRESS_INTERVAL_S = 2.0  # at most one progress line per this many seconds during the sweeps
BLOCK_GAP_SHARE = 0.25  # of the plan's gap to the LP bound, per block of the sweep (Note [ A block's gap ])

# NOTE [ A block's gap ]
# A block's sub-MIP finds its better plan early (a sub-MIP heuristic at the root, in a few tenths of a second on a
# 32-layer Llama's blocks) and then spends most of its time proving it within BLOCK_REL_GAP of its own bound
# (root restarts and cuts: 0.3 s to find, 0.95 s in all). What a sweep has to close is the plan's gap to the LP
# bound, so once that bound is known a block proves its plan only to BLOCK_GAP_SHARE of its share of that gap
# (the gap over the number of blocks in the sweep), or BLOCK_REL_GAP, whichever it reaches first. The whole share is
# too loose: a block whose dual bound starts within it of the incumbent stops before it looks for a better
# plan, and most blocks gain less than their share (a 32-layer Llama profile: 60 s and a 2.1% gap, against
# 29 s and 0.99% without; with a quarter, 22 s and 0.40%; a tenth gained nothing).


def solve_by_blocks(model: Model, warm: dict[int, Choice], deadline: float, time_limit_s: float, rel_gap: float,
                    say: Callable[[str], None], relaxation: Relaxation,
                    lp) -> tuple[MilpResult | None, dict[str, float] | None, bool]:
    """Block sweeps from the warm start, judged against the LP bound.

    The LP relaxation runs alongside the sweeps (`relaxation`, started by the caller on `lp`, the model
    as to_highs_lp built it); once it has finished, the sweeps take the blocks where the plan differs
    most from it first and stop within `rel_gap` of its bound. Returns the result judged against the
    bound ("optimal" means within `rel_gap` of it), the values of its discrete variables, and whether the
    full MILP should continue from them (and report its own bound): when the sweeps stop above the gap,
    or the LP did not finish within the time limit, and enough of the time limit is left. The result and
    values are None when no block found a solution.
    """
    t0 = time.perf_counter()
    say(size_message(model.prob, lp))
    reserve_s = final_check_reserve_s(model, time_limit_s)
    guide = SweepGuide(model, warm, relaxation, rel_gap, full_milp_beside=True)
    improved = improve_by_blocks(model, warm, deadline - time.perf_counter() - reserve_s, progress=say, guide=guide,
                                 lp=lp)
    guide.wait()
    bound = guide.bound
    source = "LP relaxation and the full MILP beside the sweeps" if guide.full_milp_ran else "LP relaxation"
    say(f"{source}: " + (f"bound {format_duration(bound * model.time_unit, model.graph.time_unit)}"
                         if bound is not None else "infeasible: no plan meets the MILP's rows at this cap"
                         if relaxation.infeasible() else "no bound within the time limit"))
    if improved is None:
        return None, None, False
    choices, values, objective = improved
    result = result_from_values(model, choices, objective, bound, rel_gap, time.perf_counter() - t0)
    if result.gap is not None:
        say(f"block search: objective {format_duration(result.objective_s, model.graph.time_unit)} "
            f"(profiled op times), "
            f"gap {100 * result.gap:.2f}% to the bound")
    # the full MILP continues from this plan (and reports its own bound) only when it has time to: on
    # thousands of candidates its presolve alone takes seconds
    continue_with_full = (not guide.full_milp_ran and (bound is None or result.status != "optimal")
                          and time_for_full_solve(deadline, time_limit_s, relaxation.unfinished_s()))
    return result, values, continue_with_full


def final_check_reserve_s(model: Model, time_limit_s: float) -> float:
    """The time kept back from the LP and the sweeps for what follows them."""
    return max(FINAL_CHECK_TIME_FRACTION * time_limit_s, FINAL_CHECK_S_PER_CANDIDATE * len(model.vars))


def time_for_full_solve(deadline: float, time_limit_s: float, lp_unfinished_s: float = 0.0) -> bool:
    """Enough of the time limit is left for the full MILP after the block search: more than
    FULL_SOLVE_MIN_TIME_FRACTION of it, and more than the LP relaxation ran without finishing
    (`lp_unfinished_s`): the full MILP solves that LP first, after a presolve."""
    left_s = deadline - time.perf_counter()
    return left_s > FULL_SOLVE_MIN_TIME_FRACTION * time_limit_s and left_s > lp_unfinished_s


class SweepGuide:
    """What steers the sweeps once the LP relaxation has finished: the blocks where the plan differs most
    from the LP solution first (`priority`), and a stop within the planner's gap of its bound
    (`target_objective`). Both stay None until then, and without a relaxation."""

    def __init__(self, model: Model | None = None, warm: dict[int, Choice] | None = None,
                 relaxation: Relaxation | None = None, rel_gap: float = 0.0, full_milp_beside: bool = False):
        self._model, self._warm, self._relaxation, self.rel_gap = model, warm or {}, relaxation, rel_gap
        self.bound: float | None = None
        self.priority: dict[int, float] | None = None
        self.target_objective: float | None = None
        self.full_milp_beside = full_milp_beside  # the full MILP runs beside the sweeps once the bound is in
        self.full_milp_ran = False

    def poll(self) -> None:
        """Take the relaxation's result if it has finished."""
        if self._relaxation is not None and self._relaxation.done():
            self.wait()

    def wait(self) -> None:
        """Wait for the relaxation (it stops at its own time limit) and take its result."""
        relaxation, self._relaxation = self._relaxation, None
        solved = relaxation.result() if relaxation is not None else None
        if solved is None:
            return
        self.priority = lp_disagreement(self._model, solved[1], self._warm)
        self.raise_bound(solved[0])

    def raise_bound(self, bound: float | None) -> None:
        """Take a lower bound on the objective (the LP relaxation's, the full MILP's dual bound) if higher."""
        if bound is None or (self.bound is not None and bound <= self.bound):
            return
        self.bound = bound
        if bound > 0:
            self.target_objective = bound / (1 - self.rel_gap)


@dataclass
class _Search:
    """The whole model in row-wise form, which columns each block frees, and the best solution so far."""

    full: RowwiseModel
    variables: list
    shared: object  # bool by column: columns of no candidate (savings chain, stalls, regions), free in every block
    owned: dict[int, object]  # candidate -> its columns
    copies: dict[int, object]  # candidate -> its copy fractions (continuous)
    window_steps: dict[int, set[int]]  # candidate -> the steps of its copy windows
    by_step: dict[int, list[int]]  # step -> candidates with a copy window there
    rel_gap: float
    twins: Twins | None = None  # the model's twin layers (regen.planner.milp.twins)
    best_obj: float = math.inf
    solution: object | None = None  # every column of the best solution (numpy, integers rounded)
    activity: object | None = None  # every row's activity at `solution`
    improved: bool = False
    stop_at_objective: float | None = None  # a block's sub-MIP stops once its plan is this good
    block_abs_gap: float | None = None  # a block's sub-MIP stops this close to its own bound (Note [ A block's gap ])

    def stop_when_good_enough(self, event) -> None:
        """HiGHS's MIP interrupt callback: stop the block once its incumbent reaches `stop_at_objective`."""
        if self.stop_at_objective is not None and event.data_out.mip_primal_bound <= self.stop_at_objective:
            event.interrupt()

    def keep(self, sub: SubModel, col_value, objective: float) -> None:
        """Take a sub-model's solution if it improves."""
        import numpy as np

        if not objective < self.best_obj - 1e-9:
            return
        if math.isfinite(self.best_obj):
            self.improved = True
        self.best_obj = objective
        change = np.zeros(len(self.solution))
        new = np.asarray(col_value)
        new = np.where(self.full.is_integer[sub.columns], np.round(new), new)
        change[sub.columns] = new - self.solution[sub.columns]
        self.activity += self.full.activity_change(sub.nonzeros, change)
        self.solution[sub.columns] = new


def improve_by_blocks(model: Model, incumbent: dict[int, Choice], time_budget_s: float,
                      block_candidates: int = BLOCK_CANDIDATES, rel_gap: float = BLOCK_REL_GAP,
                      progress: Callable[[str], None] | None = None, max_sweeps: int = MAX_BLOCK_SWEEPS,
                      guide: SweepGuide | None = None,
                      lp=None) -> tuple[dict[int, Choice], dict[str, float], float] | None:
    """Fix-and-optimize: re-solve the MILP one block of candidates (by producer) at a time, every other
    candidate's action fixed to the incumbent's, keeping each improvement.

    The warm plan is first solved as an LP with its discrete values fixed, and every block starts from
    the best complete solution so far (continuous values included, so HiGHS need not solve a sub-MIP
    to complete a partial start) and is kept only if it improves on it.
    Returns the plan, the values of its discrete variables (a warm start for a model built with the
    same options) and its objective (model units; the model's variables hold the solution), or None
    when no block found a solution. `guide`, once the LP relaxation it waits on has finished, orders
    each following sweep's blocks and stops the search within the planner's gap of the bound. `lp`:
    the model as to_highs_lp built it, when the caller has it already.
    """
    if time_budget_s <= 0:
        return None
    deadline = time.perf_counter() + time_budget_s
    search = _new_search(model, incumbent, rel_gap, lp)
    _solve_warm_plan(search, deadline)
    order = sorted(model.vars, key=lambda i: (model.vars[i].c.producer, i))
    sweeps = 0
    guide = guide or SweepGuide()

    beside = _FullMilpBeside(search, guide, deadline)

    def reached() -> bool:
        guide.poll()
        beside.exchange()
        return guide.target_objective is not None and search.best_obj <= guide.target_objective

    report = _SweepProgress(model, progress)
    try:
        while search.solution is not None and time.perf_counter() < deadline:
            guide.poll()
            blocks = _sweep_blocks(search, order, block_candidates, sweeps, guide.priority)
            sweep_start_obj = search.best_obj
            report.sweep(sweeps + 1, len(blocks))
            _one_sweep(search, blocks, guide, deadline, report, reached, proposals=sweeps > 0)
            sweeps += 1
            beside.start_if_far_from_bound()
            if reached():
                break
            if sweeps >= max_sweeps or not search.best_obj < sweep_start_obj - SWEEP_MIN_GAIN * abs(search.best_obj):
                break
        beside.finish(stop_now=reached())
    finally:
        beside.stop()  # on an exception too: no MILP left running (a no-op once finished)
    if progress:
        plan = ("none" if search.solution is None
                else format_duration(search.best_obj * model.time_unit, model.graph.time_unit))
        progress(f"block improvement: {sweeps} sweep(s) over blocks of {block_candidates} candidates, plan {plan}"
                 + ("" if search.improved else " (no improvement)"))
    if search.solution is None:
        return None
    for v in search.variables:
        v.varValue = float(search.solution[v.index])
    binaries = {v.name: float(round(search.solution[v.index])) for v in search.variables if v.cat == pulp.LpInteger}
    return read_choices(model), binaries, search.best_obj


class _FullMilpBeside:
    """The full MILP on the core the LP relaxation leaves idle (regen.planner.milp.background), started from the
    sweeps' best plan once the guide has its bound (and the guide asks for it), trading plans with the sweeps:
    theirs offered to it as they improve, its incumbents taken when better. When the sweeps stop it goes on to
    its gap or the deadline (it is the full MILP that would follow them), unless the sweeps reached the gap."""

    def __init__(self, search: _Search, guide: SweepGuide, deadline: float):
        self._search, self._guide, self._deadline = search, guide, deadline
        self._milp: BackgroundMilp | None = None
        self._offered_obj = math.inf

    def start_if_far_from_bound(self) -> None:
        """At a sweep's end: start the full MILP when the guide asks for it, its bound is in, the plan is more than
        FULL_MILP_BESIDE_GAPS x the gap above it and MIN_FULL_MILP_BESIDE_S of the sweeps' time is left."""
        search, guide = self._search, self._guide
        if (self._milp is not None or not guide.full_milp_beside or guide.bound is None or search.solution is None
                or not guide.bound > 0 or search.best_obj <= guide.bound / (1 - FULL_MILP_BESIDE_GAPS * guide.rel_gap)
                or self._deadline - time.perf_counter() < MIN_FULL_MILP_BESIDE_S):
            return
        self._milp = BackgroundMilp(search.full.lp, search.solution, guide.rel_gap,
                                    self._deadline - time.perf_counter())
        self._offered_obj = search.best_obj
        guide.full_milp_ran = True

    def exchange(self) -> None:
        """Take its better plan, or offer it the sweeps'; its dual bound to the guide once it has ended."""
        import numpy as np

        milp, search = self._milp, self._search
        if milp is None:
            return
        found = milp.take_better(search.best_obj)
        if found is not None:
            objective, columns = found
            columns = np.where(search.full.is_integer, np.round(columns), columns)
            search.solution, search.activity = columns, search.full.activity(columns)
            search.best_obj, search.improved = objective, True
        elif search.best_obj < self._offered_obj:
            milp.offer(search.solution)
            self._offered_obj = search.best_obj
        if milp.done():
            self._guide.raise_bound(milp.bound())

    def stop(self) -> None:
        if self._milp is not None:
            self._milp.stop()

    def finish(self, stop_now: bool) -> None:
        """Stop it (the sweeps reached the gap) or wait for it until the deadline, then take what it found."""
        if self._milp is not None and not stop_now:
            self._milp.wait(self._deadline - time.perf_counter())
        self.stop()
        self.exchange()


def _one_sweep(search: _Search, blocks: list[list[int]], guide: SweepGuide, deadline: float,
               report: "_SweepProgress", reached: Callable[[], bool], proposals: bool) -> None:
    """Solve the sweep's blocks in turn until they are done, the time is up or the plan is within the gap."""
    guided = guide.priority is not None
    sweep_blocks = len(blocks)
    while blocks:
        report.now(len(blocks), search.best_obj, guide.bound)
        remaining = deadline - time.perf_counter()
        if remaining <= 0 or reached():
            return
        if not guided and guide.priority is not None:  # the bound came mid-sweep: its order for the rest
            blocks, guided = _by_priority(blocks, guide.priority), True
        limit_s = min(remaining, max(MIN_BLOCK_TIME_S, 2 * remaining / len(blocks)))
        if not guided:  # back soon to see whether the bound has come
            limit_s = min(limit_s, UNGUIDED_BLOCK_TIME_S)
        search.stop_at_objective = guide.target_objective
        search.block_abs_gap = _block_abs_gap(search.best_obj, guide.bound, sweep_blocks)
        _solve_block_and_twins(search, blocks.pop(0), limit_s, proposals=proposals)


def _block_abs_gap(objective: float, bound: float | None, sweep_blocks: int) -> float | None:
    """How close to its own bound a block's sub-MIP must prove its plan (Note [ A block's gap ]); None while
    the LP bound is not known (the blocks stop at BLOCK_REL_GAP)."""
    if bound is None or not math.isfinite(objective):
        return None
    return BLOCK_GAP_SHARE * max(0.0, objective - bound) / max(1, sweep_blocks)


class _SweepProgress:
    """A progress line every SWEEP_PROGRESS_INTERVAL_S while the sweeps run: they can take most of the
    time limit on thousands of candidates."""

    def __init__(self, model: Model, say: Callable[[str], None] | None):
        self._model, self._say = model, say
        self._last = time.perf_counter()
        self._sweep, self._blocks = 0, 0

    def sweep(self, number: int, blocks: int) -> None:
        self._sweep, self._blocks = number, blocks

    def now(self, blocks_left: int, objective: float, bound: float | None) -> None:
        if self._say is None or time.perf_counter() - self._last < SWEEP_PROGRESS_INTERVAL_S:
            return
        self._last = time.perf_counter()
        unit, time_unit = self._model.time_unit, self._model.graph.time_unit
        line = (f"  sweep {self._sweep}: {self._blocks - blocks_left} of {self._blocks} blocks, plan "
                f"{format_duration(objective * unit, time_unit)}")
        if bound is None:
            self._say(line + ", LP bound still solving")
        else:
            self._say(line + f", LP bound {format_duration(bound * unit, time_unit)} "
                             f"(gap {100 * (1 - bound / objective):.2f}%)")


def _new_search(model: Model, incumbent: dict[int, Choice], rel_gap: float, lp) -> _Search:
    import numpy as np

    variables = model.columns()
    full = RowwiseModel.of(lp if lp is not None else to_highs_lp(model.prob, variables))
    shared = np.ones(len(variables), dtype=bool)
    owned, copies, window_steps, by_step = {}, {}, {}, {}
    for i, v in model.vars.items():
        cols = v.actions() + list(v.od.values()) + list(v.is_.values()) + list(v.yout.values()) + list(v.yin.values())
        owned[i] = np.array([x.index for x in cols], dtype=np.int64)
        copies[i] = np.array([x.index for x in list(v.yout.values()) + list(v.yin.values())], dtype=np.int64)
        shared[owned[i]] = False
        window_steps[i] = set(v.yout) | set(v.yin)
        for s in window_steps[i]:
            by_step.setdefault(s, []).append(i)
    search = _Search(full=full, variables=variables, shared=shared, owned=owned, copies=copies,
                     window_steps=window_steps, by_step=by_step, rel_gap=rel_gap, twins=find_twins(model))
    # the warm plan's discrete values; its continuous ones come from _solve_warm_plan
    search.solution = np.zeros(len(variables))
    by_name = {v.name: v for v in variables}
    for name, value in warm_start_values(model, incumbent).items():
        if name in by_name:
            search.solution[by_name[name].index] = value
    return search


def _solve_warm_plan(search: _Search, deadline: float) -> None:
    """The warm plan's own complete solution (every discrete variable fixed: an LP), so that blocks
    start from it and keep only what improves on it."""
    import numpy as np

    search.activity = search.full.activity(search.solution)
    _run_sub_model(search, np.flatnonzero(~search.full.is_integer),
                   max(MIN_BLOCK_TIME_S, deadline - time.perf_counter()), start=False)
    if not math.isfinite(search.best_obj):  # the blocks' sub-models need a feasible solution to fix others at
        search.solution = None


def _sweep_blocks(search: _Search, order: list[int], block_candidates: int, sweeps: int,
                  priority: dict[int, float] | None) -> list[list[int]]:
    """The blocks of one sweep: from the second sweep on, cut at the twin layers' boundaries when the model
    has them, else every `block_candidates`. Every other sweep shifts the boundaries by half a block, so no
    pair of neighbours is always split; with a priority, the most promising blocks come first (the time may
    run out mid-sweep)."""
    if search.twins is not None and sweeps > 0:
        blocks = layer_blocks(search.twins, order, block_candidates, sweeps - 1)
    else:
        shift = (block_candidates // 2) if sweeps % 2 else 0
        cuts = [0] + list(range(shift or block_candidates, len(order), block_candidates)) + [len(order)]
        blocks = [order[a:b] for a, b in zip(cuts, cuts[1:]) if b > a]
    return _by_priority(blocks, priority) if priority is not None else blocks


def _by_priority(blocks: list[list[int]], priority: dict[int, float]) -> list[list[int]]:
    """The blocks where the plan differs most from the LP solution first."""
    return sorted(blocks, key=lambda blk: -sum(priority.get(i, 0.0) for i in blk))


# NOTE [ Twin layers ]
# 1. A block's improvement is a proposal for its twins, never an assumption: its action values are copied
#    onto every twin it does not overlap, the rows of fixed columns only are checked at the copied values,
#    and the rest (continuous columns, shared ones, the changed twins' copy-window binaries) is solved
#    again; the result replaces the incumbent only if it is better.
# 2. Most proposals are refused (the improvement spent the slack under the cap that its twins would need
#    as well); refusal costs one LP-sized sub-solve, a tenth of a block's.
# 3. Every block is solved, even one with the same actions as a twin solved before it in the sweep: what a
#    block can gain depends on the slack around it, which the blocks before it have just changed (skipping
#    such blocks stopped a 10,000-candidate search after 20 of its 668 blocks).
# 4. Layer blocks and proposals start with the second sweep: the first, by plain blocks, lets every layer
#    reach its own optimum given the others. A copy made before that imposes one layer's choice on layers not
#    yet improved, and the slack it spends uniformly can trap the search (a synthetic 3,000-candidate
#    transformer: 1791 ms of op time against 1773 without proposals).


def _solve_block_and_twins(search: _Search, block: list[int], time_limit_s: float, proposals: bool) -> None:
    """Solve the block; when it improves (and `proposals`: after the first sweep), propose its actions to its
    twins (Note [ Twin layers ])."""
    before = search.best_obj
    _solve_block(search, set(block), time_limit_s)
    if search.twins is not None and proposals and search.best_obj < before:
        proposal = propose(search.twins, search.solution, block)
        if proposal is not None:
            _try_proposal(search, proposal, time_limit_s)


def _try_proposal(search: _Search, proposal: Proposal, time_limit_s: float) -> None:
    """Take the proposal if, with its changed twins' copy windows, the continuous columns and the shared
    ones solved again, it is a plan (every row holds) that improves on the best; else leave the best as it
    was."""
    import numpy as np

    full = search.full
    free = search.shared | ~full.is_integer
    free[proposal.windows] = True
    activity = full.activity(proposal.values)
    touched = np.bincount(full.row_of_nonzero, weights=free[full.index], minlength=full.lp.num_row_) > 0
    fixed_rows = ~touched  # rows the sub-model leaves out: they must hold at the proposal's values
    tol = 1e-6
    if np.any(activity[fixed_rows] < full.row_lower[fixed_rows] - tol) or \
            np.any(activity[fixed_rows] > full.row_upper[fixed_rows] + tol):
        return
    old = search.solution, search.activity
    search.solution, search.activity = proposal.values, activity
    before = search.best_obj
    _run_sub_model(search, np.flatnonzero(free), time_limit_s, start=False)
    if not search.best_obj < before:
        search.solution, search.activity = old


def _solve_block(search: _Search, free_candidates: set[int], time_limit_s: float) -> None:
    """Re-solve the block's own sub-model (every other candidate's action fixed at the best solution's,
    the copy fractions of candidates whose windows share a step with the block's left free); keep an
    improvement."""
    import numpy as np

    free = search.shared.copy()
    for i in free_candidates:
        free[search.owned[i]] = True
    steps = set().union(*(search.window_steps[i] for i in free_candidates))
    for j in {j for s in steps for j in search.by_step[s]}:
        free[search.copies[j]] = True
    _run_sub_model(search, np.flatnonzero(free), time_limit_s, start=True)


def _run_sub_model(search: _Search, columns, time_limit_s: float, start: bool) -> None:
    """Solve the sub-model over `columns` (sorted) from the best solution (`start`: as a warm start)."""
    import numpy as np

    sub = restrict(search.full, columns, search.solution, search.activity)
    h = new_highs(rel_gap=search.rel_gap, time_limit_s=max(MIN_SOLVER_TIME_S, time_limit_s))
    if search.block_abs_gap is not None:
        h.setOptionValue("mip_abs_gap", search.block_abs_gap)
    h.passModel(sub.lp)
    if start:
        x = search.solution[sub.columns]
        h.setSolution(len(x), np.arange(len(x), dtype=np.int32), x)
    h.cbMipInterrupt.subscribe(search.stop_when_good_enough)
    with solver_output_to_stderr():
        h.run()
    info = h.getInfo()
    if info.primal_solution_status != 2:  # no feasible solution
        return
    search.keep(sub, h.getSolution().col_value, info.objective_function_value)
