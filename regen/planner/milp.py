"""regen's MILP: keep, swap or recompute every candidate, minimising the predicted step time.

The formulation of DESIGN.md "Planner: the MILP", O(candidates x window) in size:

* actions: binaries `swap_t`, `rec_{t,k}` (one per recipe option k) and `bp_{t,g,k}` ("rebuilt with"
  candidate g's recipe k, which replays t's producer on the way: `bp <= rec_{g,k}`, no time of its
  own, t resident from g's rebuild on; graph.Candidate.hosts), keep = 1 - their sum;
* copy-out: fractions `yout_{t,s}` over the bounded window after the pack, per-step channel capacity
  `sum_t m_t yout_{t,s} <= d2h x c_s` (copy-outs never stall compute in the runtime, so they get the
  op's compute time only; late copy-outs cost memory, not time), and monotone binaries
  `od_{t,s}` = "copy-out complete by the end of s" bounded by the cumulative fraction;
* copy-in: fractions `yin_{t,s}` over the window before b, monotone binaries `is_{t,s}` = "copy-in
  started by s" (it may start only once the copy-out is complete, and a step may copy only once it
  has started), per-step capacity `sum_t m_t yin_{t,s} <= h2d x T_s` where
  `T_s = c_s + recompute at s + stall_s` and `stall_s >= 0` is exposed transfer time;
* recompute: option k's time is charged at b (the first backward use); its anchors must be resident
  then: `rec_{t,k} <= keep_a + (fraction of a copied in before b)` unless a is resident anyway;
* memory: t not resident at step s of its gap: N_t(s) = rec_t + od_t(s-1) - is_t(s). The savings
  `S(s) = sum_t m_t N_t(s)` are a running sum whose terms change only at window steps, so they are
  variables at change points only (`S_k = S_{k-1} + changes`), and the cap becomes a lower bound on
  S over each segment where the resident set cannot change: max unplanned peak in it - S <= cap
  (plus recipe transients at b). Segments already under the cap get no constraint.
* objective: sum_s T_s.

Memory is in units of `mem_unit_bytes`, time in `time_unit_s`, so coefficients stay near 1.
Solved with PuLP's HiGHS interface (highspy), the model passed in bulk, a heuristic warm start, a
time limit and a progress callback; CBC (PULP_CBC_CMD) when highspy is missing.
"""

from __future__ import annotations

import bisect
import contextlib
import math
import os
import sys
import time
from dataclasses import dataclass, field
from typing import Callable

import pulp

from regen.errors import SolverError
from regen.formats.plan import ACTION_KEEP, ACTION_RECOMPUTE, ACTION_SWAP
from regen.planner.graph import Candidate, PlanningGraph, anchor_resident_without_plan, byproduct_recipe
from regen.planner.simulator import Choice

MEMORY_UNITS_PER_PEAK = 1e4  # memory unit = unplanned peak / this
TIME_UNITS_PER_STEP = 1e3  # time unit = unplanned compute time / this
# minimise-peak objective: one memory unit outweighs 100x the whole step time, so the peak comes first
PEAK_WEIGHT_PER_MEMORY_UNIT = 100 * TIME_UNITS_PER_STEP
DEFAULT_REL_GAP = 0.01  # stop once the incumbent is within 1% of the bound (issue 3's target)
SOLVER_THREADS = 2
BINARY_THRESHOLD = 0.5
BLOCK_CANDIDATES = 70  # candidates re-optimised together by the block improvement of large graphs
MIN_BLOCK_TIME_S = 0.5
# a block's sub-MIP stops at this gap, relative to the *whole* step time: a block can only move the
# objective by a fraction of a percent, so the planner's 1% would stop every block at its warm start
BLOCK_REL_GAP = 3e-4
MAX_BLOCK_SWEEPS = 8
SWEEP_MIN_GAIN = 1e-4  # another sweep only after one that lowered the objective by this fraction


@dataclass
class MilpOptions:
    allow_swap: bool = True
    allow_recompute: bool = True
    rel_gap: float = DEFAULT_REL_GAP
    minimize_peak: bool = False  # the cap becomes a variable: find the smallest feasible cap
    fixed_actions: dict[int, str] | None = None  # candidate index -> action (brute-force evaluation)
    allow_byproducts: bool = True  # a candidate may be rebuilt with another's recipe (Candidate.hosts)
    fifo_pairs: list[tuple[int, int]] = field(default_factory=list)  # (issued first, issued later)
    step_margin_bytes: dict[int, int] = field(default_factory=dict)  # extra headroom at steps (repair)


@dataclass
class MilpResult:
    choices: dict[int, Choice]
    objective_s: float  # predicted step time (sum of T_s)
    bound_s: float | None
    gap: float | None
    status: str  # optimal | time_limit
    solver: str  # highs | cbc
    solve_time_s: float
    predicted_peak_bytes: int
    min_cap_bytes: int | None = None  # minimize_peak: the cap found
    num_variables: int = 0
    num_constraints: int = 0


@dataclass
class _Vars:
    c: Candidate
    rec: list  # per recipe option
    swap: object | None = None
    od: dict = field(default_factory=dict)  # step -> binary (window steps but the last)
    is_: dict = field(default_factory=dict)
    yout: dict = field(default_factory=dict)
    yin: dict = field(default_factory=dict)
    bp: list = field(default_factory=list)  # (host candidate, its recipe option, binary): rebuilt with it

    def actions(self) -> list:
        """The binaries of every non-keep action (their sum is at most 1)."""
        return self.rec + [x for _, _, x in self.bp] + ([self.swap] if self.swap is not None else [])

    def od_expr(self, j: int):
        """Copy-out complete by the end of step j: 0 before the first break, swap_t from the last."""
        return _piecewise(self.c.out_breaks, self.od, self.swap, j)

    def is_expr(self, s: int):
        """Copy-in started by step s."""
        return _piecewise(self.c.in_breaks, self.is_, self.swap, s)


def _piecewise(breaks: list[int], binaries: dict, swap, s: int):
    if swap is None or s < breaks[0]:
        return None
    if s >= breaks[-1]:
        return swap
    k = bisect.bisect_right(breaks, s) - 1
    return binaries[breaks[k]]


class Model:
    """The PuLP problem and the variables needed to read a plan back."""

    def __init__(self, graph: PlanningGraph, cap_bytes: int | None, options: MilpOptions):
        self.graph = graph
        self.options = options
        self.cap_bytes = cap_bytes
        self.mem_unit = max(1.0, graph.unplanned_peak_bytes / MEMORY_UNITS_PER_PEAK)
        self.time_unit = max(1e-12, graph.compute_time_s / TIME_UNITS_PER_STEP)
        self.prob = pulp.LpProblem("regen", pulp.LpMinimize)
        self.vars: dict[int, _Vars] = {}
        self.stall: dict[int, object] = {}
        self.segments: list[tuple[int, int, object]] = []  # (first step, last step, S variable)
        self.cap_var = None
        self._build()

    # ---- construction ---------------------------------------------------------------------------
    def _build(self) -> None:
        g, opt = self.graph, self.options
        tu = self.time_unit
        prob = self.prob
        fixed = opt.fixed_actions or {}
        for c in g.candidates:
            if c.trivial or c.bytes <= 0:
                continue
            want = fixed.get(c.index)
            rec_ok = opt.allow_recompute and c.can_recompute and want in (None, ACTION_RECOMPUTE)
            swap_ok = opt.allow_swap and c.can_swap and want in (None, ACTION_SWAP)
            if not rec_ok and not swap_ok:
                if want not in (None, ACTION_KEEP):
                    raise SolverError(f"candidate {c.id} cannot be {want}")
                continue
            v = _Vars(c=c, rec=[])
            i = c.index
            if rec_ok:
                v.rec = [_var(f"rec_{i}_{k}", 0, 1, cat=pulp.LpBinary) for k in range(len(c.recipes))]
            if swap_ok:
                v.swap = _var(f"swap_{i}", 0, 1, cat=pulp.LpBinary)
                for s in c.out_window:
                    v.yout[s] = _var(f"yout_{i}_{s}", 0, 1)
                for s in c.out_breaks[:-1]:
                    v.od[s] = _var(f"od_{i}_{s}", 0, 1, cat=pulp.LpBinary)
                for s in c.in_window:
                    v.yin[s] = _var(f"yin_{i}_{s}", 0, 1)
                for s in c.in_breaks[:-1]:
                    v.is_[s] = _var(f"is_{i}_{s}", 0, 1, cat=pulp.LpBinary)
            self.vars[i] = v
        if opt.allow_byproducts:
            for i, v in self.vars.items():
                if not v.rec:
                    continue
                for gi, k in v.c.hosts:
                    host = self.vars.get(gi)
                    # rebuilt with host's recipe k: only if host runs it (checked again: callers may prune recipes)
                    if (host is not None and k < len(host.rec)
                            and v.c.producer in host.c.recipes[k].ops[:-1]):
                        x = _var(f"bp_{i}_{gi}_{k}", 0, 1, cat=pulp.LpBinary)
                        v.bp.append((gi, k, x))
                        prob += x <= host.rec[k], f"bp_host_{i}_{gi}_{k}"
        for i, v in self.vars.items():
            want = fixed.get(i)
            chosen = v.actions()
            if want is not None and want != ACTION_KEEP:
                prob += pulp.lpSum(chosen) == 1, f"fix_{i}"
            elif want == ACTION_KEEP:
                prob += pulp.lpSum(chosen) == 0, f"fix_{i}"
            elif len(chosen) > 1:
                prob += pulp.lpSum(chosen) <= 1, f"one_{i}"
            if v.swap is not None:
                self._swap_constraints(v)
        self._anchor_constraints()
        for a, b in opt.fifo_pairs:
            self._fifo_constraint(a, b)
        objective_terms = self._channel_constraints()
        self._memory_constraints()
        for v in self.vars.values():
            for k, r in enumerate(v.rec):
                objective_terms.append((v.c.recipes[k].time_s / tu) * r)
        time_obj = pulp.lpSum(objective_terms) + sum(g.time_s) / tu
        if opt.minimize_peak:
            # lexicographic enough: a unit of memory outweighs the whole step time
            prob += self.cap_var * PEAK_WEIGHT_PER_MEMORY_UNIT + time_obj
        else:
            prob += time_obj

    def _swap_constraints(self, v: _Vars) -> None:
        prob, c, i = self.prob, v.c, v.c.index
        prob += pulp.lpSum(v.yout.values()) == v.swap, f"out_all_{i}"
        prob += pulp.lpSum(v.yin.values()) == v.swap, f"in_all_{i}"
        ob, ib = c.out_breaks, c.in_breaks
        for k, j in enumerate(ob[:-1]):
            prob += pulp.lpSum(y for s, y in v.yout.items() if s <= j) >= v.od[j], f"od_frac_{i}_{j}"
            prob += v.od[j] <= v.od_expr(ob[k + 1]), f"od_mono_{i}_{j}"
        for k, s in enumerate(ib):
            started = v.is_expr(s)
            if k + 1 < len(ib):
                prob += v.is_[s] <= v.is_expr(ib[k + 1]), f"is_mono_{i}_{s}"
            done = v.od_expr(s - 1)
            if done is None:
                prob += started == 0, f"in_after_out_{i}_{s}"
            elif done is not started:
                prob += started <= done, f"in_after_out_{i}_{s}"
        # nothing flows before the copy-in starts: the fraction copied in by the end of a segment where
        # "started" is constant is at most that indicator (aggregated over the segment, which is what
        # keeps the LP relaxation tight: a half-started copy-in cannot free memory it has not copied yet)
        in_steps = sorted(v.yin)
        for k, s0 in enumerate(ib):
            s1 = ib[k + 1] - 1 if k + 1 < len(ib) else None
            if s1 is None:
                break  # from the last break on, "started" is swap_t itself: implied by in_all
            upto = [v.yin[s] for s in in_steps if s <= s1]
            if upto:
                prob += pulp.lpSum(upto) <= v.is_expr(s0), f"in_started_{i}_{s0}"

    def _fraction_in_before(self, a: _Vars, step: int):
        """Fraction of a's copy-in done before `step` starts."""
        return [a.yin[s] for s in a.c.in_window if s < step]

    def _anchor_constraints(self) -> None:
        g, prob = self.graph, self.prob
        for i, v in self.vars.items():
            b = v.c.first_backward
            for k, r in enumerate(v.rec):
                for a_idx in v.c.recipes[k].anchors:
                    anchor = g.candidates[a_idx]
                    if anchor_resident_without_plan(anchor, b):
                        continue
                    av = self.vars.get(a_idx)
                    if av is None:
                        continue  # always kept
                    keep = 1 - pulp.lpSum(av.actions())  # a rebuilt-with anchor counts as gone (conservative)
                    back = self._fraction_in_before(av, b) if av.swap is not None else []
                    prob += r <= keep + pulp.lpSum(back), f"anchor_{i}_{k}_{a_idx}"

    def _fifo_constraint(self, first: int, later: int) -> None:
        """Copy-outs complete in issue order: `later` done by j implies `first` done by j."""
        a, b = self.vars.get(first), self.vars.get(later)
        if a is None or b is None or a.swap is None or b.swap is None:
            return
        for j in b.c.out_breaks:
            if j >= a.c.out_breaks[-1]:
                break
            lhs = b.od_expr(j)
            rhs = a.od_expr(j)
            if lhs is None:
                continue
            self.prob += lhs <= (rhs if rhs is not None else 0) + 1 - a.swap, f"fifo_{first}_{later}_{j}"

    def _channel_constraints(self) -> list:
        g, prob, mu, tu = self.graph, self.prob, self.mem_unit, self.time_unit
        out_at: dict[int, list] = {}
        in_at: dict[int, list] = {}
        rec_at: dict[int, list] = {}
        for v in self.vars.values():
            for s, y in v.yout.items():
                out_at.setdefault(s, []).append((v.c.bytes / mu) * y)
            for s, y in v.yin.items():
                in_at.setdefault(s, []).append((v.c.bytes / mu) * y)
            for k, r in enumerate(v.rec):
                rec_at.setdefault(v.c.first_backward, []).append((v.c.recipes[k].time_s / tu) * r)
        for s, terms in out_at.items():
            prob += pulp.lpSum(terms) <= g.d2h_bytes_per_s * g.time_s[s] / mu, f"d2h_{s}"
        stalls = []
        for s, terms in in_at.items():
            st = _var(f"stall_{s}", 0)
            self.stall[s] = st
            stalls.append(st)
            rate = g.h2d_bytes_per_s * tu / mu  # memory units per time unit
            prob += (pulp.lpSum(terms) - rate * st - rate * pulp.lpSum(rec_at.get(s, []))
                     <= g.h2d_bytes_per_s * g.time_s[s] / mu), f"h2d_{s}"
        return stalls

    def _memory_constraints(self) -> None:
        g, prob, mu = self.graph, self.prob, self.mem_unit
        n = g.num_steps
        changes: dict[int, list] = {}  # step -> [(coef, var)] change of S at that step
        transients: dict[int, list] = {}
        for v in self.vars.values():
            c = v.c
            f, b = c.last_forward, c.first_backward
            points = {f + 1, b}
            points.update(g.candidates[gi].first_backward for gi, _, _ in v.bp)
            if v.swap is not None:
                points.update(s + 1 for s in c.out_breaks)
                points.update(c.in_breaks)
            prev: dict = {}
            for s in sorted(p for p in points if f + 1 <= p <= b):
                cur = self._nonresident(v, s) if s < b else {}
                keys = set(cur) | set(prev)
                delta = [(cur.get(k, 0) - prev.get(k, 0), k) for k in keys]
                delta = [(coef * c.bytes / mu, var) for coef, var in delta if coef]
                if delta:
                    changes.setdefault(s, []).extend(delta)
                prev = cur
            for k, r in enumerate(v.rec):
                tb = c.recipes[k].transient_bytes
                if tb:
                    transients.setdefault(b, []).append((tb / mu, r))
        cap = self.cap_bytes
        if self.options.minimize_peak:
            self.cap_var = _var("cap", 0)
        points = sorted(changes)
        bounds = [0] + points + [n]
        # steps before the first change point have no savings at all
        head = range(0, points[0] if points else n)
        head_peak = max((max(g.peak_bytes[s], g.after_bytes[s]) + self.options.step_margin_bytes.get(s, 0)
                         for s in head), default=0)
        if self.cap_var is not None:
            prob += self.cap_var >= head_peak / mu, "mem_head"
        elif head_peak > cap:
            raise _Infeasible()
        prev_var = None
        for k, s0 in enumerate(points):
            s1 = bounds[k + 2] - 1
            var = _var(f"S_{s0}")
            expr = pulp.lpSum(coef * x for coef, x in changes[s0])
            prob += var - (prev_var if prev_var is not None else 0) - expr == 0, f"run_{s0}"
            prev_var = var
            margin = max((self.options.step_margin_bytes.get(s, 0) for s in range(s0, s1 + 1)), default=0)
            seg_peak = max(max(g.peak_bytes[s], g.after_bytes[s]) for s in range(s0, s1 + 1)) + margin
            trans = transients.get(s0, [])
            worst_trans = sum(coef for coef, _ in trans) * mu
            self.segments.append((s0, s1, var))
            if self.cap_var is not None:
                prob += var + self.cap_var >= seg_peak / mu, f"mem_{s0}"
                if trans:
                    prob += (var + self.cap_var - pulp.lpSum(cf * x for cf, x in trans)
                             >= (g.peak_bytes[s0] + margin) / mu), f"memt_{s0}"
                continue
            if seg_peak > cap:
                prob += var >= (seg_peak - cap) / mu, f"mem_{s0}"
            if trans and g.peak_bytes[s0] + margin + worst_trans > cap:
                prob += (var - pulp.lpSum(cf * x for cf, x in trans)
                         >= (g.peak_bytes[s0] + margin - cap) / mu), f"memt_{s0}"

    def _nonresident(self, v: _Vars, s: int) -> dict:
        """N_t(s) as {variable: coefficient} for a step s of the gap (rec + od(s-1) - is(s), plus each
        "rebuilt with" option until its host's recipe runs)."""
        out: dict = {}
        for r in v.rec:
            out[r] = out.get(r, 0) + 1
        for gi, _, x in v.bp:
            if s < self.graph.candidates[gi].first_backward:
                out[x] = out.get(x, 0) + 1
        od = v.od_expr(s - 1)
        if od is not None:
            out[od] = out.get(od, 0) + 1
        st = v.is_expr(s)
        if st is not None:
            out[st] = out.get(st, 0) - 1
        return {k: x for k, x in out.items() if x}

    # ---- reading a solution back ----------------------------------------------------------------
    def choices(self) -> dict[int, Choice]:
        out: dict[int, Choice] = {}
        for i, v in self.vars.items():
            for k, r in enumerate(v.rec):
                if (r.varValue or 0) > BINARY_THRESHOLD:
                    out[i] = Choice(ACTION_RECOMPUTE, recipe=v.c.recipes[k])
            for gi, k, x in v.bp:
                if (x.varValue or 0) > BINARY_THRESHOLD:
                    out[i] = Choice(ACTION_RECOMPUTE, recipe=byproduct_recipe(self.graph, v.c, gi, k),
                                    rebuilt_with=gi)
            if v.swap is not None and (v.swap.varValue or 0) > BINARY_THRESHOLD:
                start = next(s for s in v.c.in_breaks if _value(v.is_expr(s)) > BINARY_THRESHOLD)
                out[i] = Choice(ACTION_SWAP, swap_in_step=start)
        self._schedule_copy_ins(out)
        return out

    def _schedule_copy_ins(self, choices: dict[int, Choice]) -> None:
        """Turn the MILP's fractional copy-ins into an order the runtime's FIFO stream can keep.

        The MILP shares the host-to-device channel among copies within a step; the runtime's stream
        runs them one after another in issue order. Going backwards from the last deadline, each
        copy-in gets the latest start that still finishes before its first backward use and before
        the copy-ins due after it (earliest deadline first); it is issued at the last op that begins
        by then, but never before the step the MILP chose (a later copy-in holds memory for less
        time, so the MILP's memory bound still holds).
        """
        g = self.graph
        swaps = [(g.candidates[i], ch) for i, ch in choices.items() if ch.action == ACTION_SWAP]
        if not swaps:
            return
        begin, now = [], 0.0
        rec_at = [0.0] * g.num_steps
        for ch_i, ch in choices.items():
            if ch.action == ACTION_RECOMPUTE:
                rec_at[g.candidates[ch_i].first_backward] += ch.recipe.time_s
        for s in range(g.num_steps):
            now += rec_at[s] + _value(self.stall.get(s)) * self.time_unit
            begin.append(now)
            now += g.time_s[s]
        # a swapped tensor is needed at its first backward use, or earlier by a recipe that reads it
        need_at = {c.index: c.first_backward for c, _ in swaps}
        for ch_i, ch in choices.items():
            if ch.action == ACTION_RECOMPUTE:
                at = g.candidates[ch_i].first_backward
                for a in ch.recipe.anchors:
                    if a in need_at and not anchor_resident_without_plan(g.candidates[a], at):
                        need_at[a] = min(need_at[a], at)
        latest_end = math.inf
        for c, ch in sorted(swaps, key=lambda x: (-need_at[x[0].index], -x[0].index)):
            end = min(begin[need_at[c.index]], latest_end)
            start_time = end - c.bytes / g.h2d_bytes_per_s
            latest_end = start_time
            step = bisect.bisect_right(begin, start_time + 1e-15) - 1
            step = g.snap_copy_in(min(step, need_at[c.index] - 1))  # where the runtime can issue it
            ch.swap_in_step = max(ch.swap_in_step, step)

    def predicted_peak_bytes(self) -> int:
        g = self.graph
        peak = 0
        n = g.num_steps
        seg_of = [None] * n
        for s0, s1, var in self.segments:
            for s in range(s0, s1 + 1):
                seg_of[s] = var
        trans = [0.0] * n
        for v in self.vars.values():
            for k, r in enumerate(v.rec):
                if _value(r) > BINARY_THRESHOLD:
                    trans[v.c.first_backward] += v.c.recipes[k].transient_bytes
        for s in range(n):
            saved = (_value(seg_of[s]) * self.mem_unit) if seg_of[s] is not None else 0.0
            peak = max(peak, max(g.peak_bytes[s], g.after_bytes[s]) - saved + trans[s])
        return int(math.ceil(peak))

    def warm_start_values(self, choices: dict[int, Choice]) -> dict[str, float]:
        """Values of the discrete variables for a heuristic plan (HiGHS completes the rest)."""
        values: dict[str, float] = {}
        for i, v in self.vars.items():
            ch = choices.get(i, Choice())
            for k, r in enumerate(v.rec):
                values[r.name] = 1.0 if (ch.action == ACTION_RECOMPUTE and ch.recipe is v.c.recipes[k]) else 0.0
            for gi, k, x in v.bp:
                host = choices.get(gi, Choice())
                values[x.name] = 1.0 if (ch.rebuilt_with == gi and host.recipe is self.graph.candidates[gi].recipes[k]) \
                    else 0.0
            if v.swap is not None:
                on = ch.action == ACTION_SWAP
                values[v.swap.name] = 1.0 if on else 0.0
                for s, x in v.od.items():
                    values[x.name] = 0.0  # copy-out done only at the window's end (always feasible)
                for s, x in v.is_.items():
                    values[x.name] = 1.0 if on and ch.swap_in_step is not None and s >= ch.swap_in_step else 0.0
        return values


def _var(name: str, low=None, up=None, cat: str = pulp.LpContinuous):
    """A PuLP variable (PuLP 3.3 deprecates constructing LpVariable directly, 2.x lacks add_variable)."""
    if hasattr(pulp.LpProblem, "add_variable"):
        return pulp.LpProblem.add_variable(None, name, low, up, cat=cat)
    return pulp.LpVariable(name, low, up, cat=cat)


def constraints_of(prob: pulp.LpProblem) -> list:
    cons = prob.constraints
    return cons() if callable(cons) else list(cons.values())


def _value(x) -> float:
    if x is None:
        return 0.0
    if isinstance(x, (int, float)):
        return float(x)
    return float(x.varValue or 0.0)


# ---- solving -----------------------------------------------------------------------------------


def highs_model(lp: pulp.LpProblem, variables: list):
    """The PuLP problem as a highspy HighsLp, built in bulk; sets each variable's and constraint's index."""
    import highspy
    import numpy as np

    for i, var in enumerate(variables):
        var.index = i
    n = len(variables)
    inf = highspy.kHighsInf
    model = highspy.HighsLp()
    model.num_col_ = n
    model.col_cost_ = np.array([lp.objective.get(v, 0.0) for v in variables], dtype=float)
    model.col_lower_ = np.array([-inf if v.lowBound is None else v.lowBound for v in variables], dtype=float)
    model.col_upper_ = np.array([inf if v.upBound is None else v.upBound for v in variables], dtype=float)
    model.offset_ = float(lp.objective.constant)
    starts, index, value, lower, upper = [0], [], [], [], []
    for i, con in enumerate(constraints_of(lp)):
        for var, coef in con.items():
            if coef:
                index.append(var.index)
                value.append(coef)
        starts.append(len(index))
        lb, ub = con.getLb(), con.getUb()
        lower.append(-inf if lb is None else lb)
        upper.append(inf if ub is None else ub)
        con.index = i
    model.num_row_ = len(lower)
    model.row_lower_ = np.array(lower, dtype=float)
    model.row_upper_ = np.array(upper, dtype=float)
    model.a_matrix_.format_ = highspy.MatrixFormat.kRowwise
    model.a_matrix_.start_ = np.array(starts, dtype=np.int32)
    model.a_matrix_.index_ = np.array(index, dtype=np.int32)
    model.a_matrix_.value_ = np.array(value, dtype=float)
    model.a_matrix_.num_col_ = n
    model.a_matrix_.num_row_ = len(lower)
    model.integrality_ = [highspy.HighsVarType.kInteger if v.cat == pulp.LpInteger else
                          highspy.HighsVarType.kContinuous for v in variables]
    return model


class _BulkHiGHS(pulp.HiGHS):
    """PuLP's HiGHS interface, with the model passed in one call, a warm start and progress."""

    def __init__(self, warm_values: dict[str, float] | None = None,
                 progress: Callable[[str], None] | None = None, **kwargs):
        super().__init__(**kwargs)
        self.warm_values = warm_values or {}
        self.progress = progress
        self.info = None

    def buildSolverModel(self, lp):  # noqa: N802 (PuLP's name)
        import numpy as np

        variables = lp.variables()
        model = highs_model(lp, variables)
        lp.solverModel.passModel(model)
        if self.warm_values:
            idx = [v.index for v in variables if v.name in self.warm_values]
            vals = [self.warm_values[v.name] for v in variables if v.name in self.warm_values]
            lp.solverModel.setSolution(len(idx), np.array(idx, dtype=np.int32), np.array(vals, dtype=float))
        if self.progress is not None:
            progress = self.progress
            last = [0.0]

            def improving(event):
                now = time.perf_counter()
                if now - last[0] < 0.5:
                    return
                last[0] = now
                out = event.data_out
                progress(f"  incumbent {out.mip_primal_bound:.6g}, bound {out.mip_dual_bound:.6g} "
                         f"(gap {100 * out.mip_gap:.2f}%)")

            lp.solverModel.cbMipImprovingSolution.subscribe(improving)

    def findSolutionValues(self, lp):  # noqa: N802
        self.info = lp.solverModel.getInfo()
        self.model_status = lp.solverModel.getModelStatus()
        return super().findSolutionValues(lp)


@contextlib.contextmanager
def solver_output_to_stderr():
    """Send file descriptor 1 to stderr while a solver runs.

    HiGHS prints its banner from C++ to the process's stdout when the first `Highs()` of a process is
    built (before any option can turn it off), and CBC may log there too; `regen solve` keeps stdout
    for its own output, so solver text goes to stderr with the progress messages.
    """
    try:
        sys.stdout.flush()
        saved = os.dup(1)
    except (OSError, ValueError):  # no usable stdout: nothing to protect
        yield
        return
    try:
        os.dup2(2, 1)
        yield
    finally:
        try:
            sys.stdout.flush()
        except (OSError, ValueError):
            pass
        os.dup2(saved, 1)
        os.close(saved)


def reset_solver_threads() -> None:
    """Give HiGHS a fresh thread pool. HiGHS keeps one pool per process across solves, and on this
    workload each solve in a process ran slower than the one before (the same 1,000-candidate solve:
    17 s alone, 29 s after two smaller ones); a reset between solves keeps them independent."""
    try:
        import highspy
    except ImportError:
        return
    reset = getattr(highspy.Highs, "resetGlobalScheduler", None)
    if reset is not None:
        reset(True)


def highs_available() -> bool:
    try:
        import highspy  # noqa: F401
    except ImportError:
        return False
    return True


def model_size_message(model: Model) -> str:
    prob = model.prob
    cons = constraints_of(prob)
    binaries = sum(1 for v in prob.variables() if v.cat == pulp.LpInteger)
    return (f"MILP: {len(prob.variables())} variables ({binaries} binary), {len(cons)} constraints, "
            f"{sum(len(c) for c in cons)} nonzeros")


def solve_model(model: Model, time_limit_s: float, rel_gap: float = DEFAULT_REL_GAP,
                warm_start: dict[int, Choice] | None = None,
                progress: Callable[[str], None] | None = None, force_cbc: bool = False,
                warm_values: dict[str, float] | None = None) -> MilpResult:
    """Solve a built model; SolverError when it stops without a feasible plan.

    The warm start is a plan (`warm_start`) or the values of discrete variables by name (`warm_values`,
    e.g. from `improve_by_blocks`), which take precedence."""
    prob = model.prob
    nvars, ncons = len(prob.variables()), len(constraints_of(prob))
    if progress:
        progress(model_size_message(model))
    warm = model.warm_start_values(warm_start) if warm_start is not None else None
    if warm_values is not None:
        warm = dict(warm or {}, **warm_values)
    use_highs = highs_available() and not force_cbc
    if use_highs:
        solver = _BulkHiGHS(warm_values=warm, progress=progress, msg=False, timeLimit=time_limit_s,
                            gapRel=rel_gap, threads=SOLVER_THREADS)
        name = "highs"
    else:
        if warm:
            for var in prob.variables():
                if var.name in warm:
                    var.setInitialValue(warm[var.name])
        solver = pulp.PULP_CBC_CMD(msg=False, timeLimit=max(1, int(math.ceil(time_limit_s))), gapRel=rel_gap,
                                   threads=SOLVER_THREADS, warmStart=bool(warm))
        name = "cbc"
    if progress:
        progress(f"solver {name} started (time limit {time_limit_s:g} s, stops at a {100 * rel_gap:g}% gap, "
                 f"{SOLVER_THREADS} threads)")
    t0 = time.perf_counter()
    with solver_output_to_stderr():
        status = prob.solve(solver)
    elapsed = time.perf_counter() - t0
    has_solution = prob.sol_status in (pulp.LpSolutionOptimal, pulp.LpSolutionIntegerFeasible)
    if status == pulp.LpStatusInfeasible or prob.sol_status == pulp.LpSolutionInfeasible:
        raise _Infeasible()
    if not has_solution:
        raise SolverError(f"the solver ({name}) stopped after {elapsed:.1f} s without a feasible plan "
                          f"(time limit {time_limit_s:g} s); raise --time-limit or the memory cap")
    objective = pulp.value(prob.objective) or 0.0
    bound = gap = None
    optimal = prob.sol_status == pulp.LpSolutionOptimal
    if use_highs and solver.info is not None:
        import highspy

        optimal = solver.model_status == highspy.HighsModelStatus.kOptimal
        bound = solver.info.mip_dual_bound
        gap = solver.info.mip_gap if math.isfinite(solver.info.mip_gap) else None
        if optimal:
            gap = max(0.0, gap or 0.0)
    elif optimal:
        bound, gap = objective, 0.0
    tu = model.time_unit
    if model.options.minimize_peak:
        obj_s = _time_of(model)
        bound_s = None
    else:
        obj_s = objective * tu
        bound_s = bound * tu if bound is not None and math.isfinite(bound) else None
    if progress:
        progress(f"solver done in {elapsed:.2f} s: {'optimal' if optimal else 'time limit'}, objective "
                 f"{obj_s * 1e3:.3f} ms (profiled op times)" + (f", gap {100 * gap:.2f}%" if gap is not None else ""))
    result = MilpResult(choices=model.choices(), objective_s=obj_s, bound_s=bound_s, gap=gap,
                        status="optimal" if optimal else "time_limit", solver=name, solve_time_s=elapsed,
                        predicted_peak_bytes=model.predicted_peak_bytes(), num_variables=nvars,
                        num_constraints=ncons)
    if model.cap_var is not None:
        result.min_cap_bytes = int(math.ceil(_value(model.cap_var) * model.mem_unit))
    return result


def improve_by_blocks(model: Model, incumbent: dict[int, Choice], time_budget_s: float,
                      block_candidates: int = BLOCK_CANDIDATES, rel_gap: float = BLOCK_REL_GAP,
                      progress: Callable[[str], None] | None = None, max_sweeps: int = MAX_BLOCK_SWEEPS,
                      priority: dict[int, float] | None = None, target_objective: float | None = None,
                      lp=None) -> tuple[dict[int, Choice], dict[str, float], float] | None:
    """Fix-and-optimize: re-solve the MILP one block of candidates (by producer) at a time, every other
    candidate's action fixed to the incumbent's, keeping each improvement.

    On large graphs HiGHS spends its time at the root and rarely improves a warm start; blocks of
    about BLOCK_CANDIDATES candidates solve to a small gap in a second or two, so sweeping them is
    the search itself (solve._solve_by_blocks). One HiGHS model, only bounds change between blocks.
    The warm plan is first solved as an LP with its discrete values fixed, and every block starts from
    the best complete solution so far (continuous values included, so HiGHS need not solve a sub-MIP
    to complete a partial start) and is kept only if it improves on it.
    Returns the plan, the values of its discrete variables (a warm start for a model built with the
    same options) and its objective (model units; the model's variables hold the solution), or None
    when no block found a solution (or HiGHS is missing). Stops early once the objective is at most
    `target_objective` (model units), e.g. within the planner's gap of a known bound. `lp`: the model
    as highs_model built it, when the caller has it already.
    """
    if not highs_available() or time_budget_s <= 0:
        return None
    import highspy
    import numpy as np

    deadline = time.perf_counter() + time_budget_s
    prob = model.prob
    variables = prob.variables()
    h = highspy.Highs()
    h.setOptionValue("output_flag", False)
    h.setOptionValue("threads", SOLVER_THREADS)
    h.setOptionValue("mip_rel_gap", rel_gap)
    h.passModel(lp if lp is not None else highs_model(prob, variables))
    lower = np.array([-highspy.kHighsInf if v.lowBound is None else v.lowBound for v in variables], dtype=float)
    upper = np.array([highspy.kHighsInf if v.upBound is None else v.upBound for v in variables], dtype=float)
    warm = model.warm_start_values(incumbent)
    by_name = {v.name: v for v in variables}
    values = {name: float(x) for name, x in warm.items()}
    actions = {i: v.actions() for i, v in model.vars.items()}
    order = sorted(model.vars, key=lambda i: (model.vars[i].c.producer, i))
    best_obj, improved, solution = math.inf, False, None
    integer_idx = np.array([v.index for v in variables if v.cat == pulp.LpInteger], dtype=np.int64)
    # the warm plan's own complete solution (every discrete variable fixed: an LP), so that blocks start
    # from it and keep only what improves on it
    known = [by_name[n] for n in values if n in by_name]
    if known:
        h.changeColsBounds(len(known), np.array([v.index for v in known], dtype=np.int32),
                           np.array([values[v.name] for v in known], dtype=float),
                           np.array([values[v.name] for v in known], dtype=float))
        h.setOptionValue("time_limit", float(max(MIN_BLOCK_TIME_S, deadline - time.perf_counter())))
        with solver_output_to_stderr():
            h.run()
        info = h.getInfo()
        if info.primal_solution_status == 2:
            best_obj, solution = info.objective_function_value, list(h.getSolution().col_value)
        h.changeColsBounds(len(known), np.array([v.index for v in known], dtype=np.int32),
                           np.array([lower[v.index] for v in known], dtype=float),
                           np.array([upper[v.index] for v in known], dtype=float))
    sweeps = 0
    while time.perf_counter() < deadline:
        # every other sweep shifts the block boundaries by half a block, so no pair of neighbours
        # is always split; sweeps go on while one still improves the objective
        shift = (block_candidates // 2) if sweeps % 2 else 0
        cuts = [0] + list(range(shift or block_candidates, len(order), block_candidates)) + [len(order)]
        blocks = [order[a:b] for a, b in zip(cuts, cuts[1:]) if b > a]
        if priority is not None:  # the most promising blocks first: the time may run out mid-sweep
            blocks.sort(key=lambda blk: -sum(priority.get(i, 0.0) for i in blk))
        sweep_start_obj = best_obj
        for k, block in enumerate(blocks):
            remaining = deadline - time.perf_counter()
            if remaining <= 0 or (target_objective is not None and best_obj <= target_objective):
                break
            free = set(block)
            idx, lo, up = [], [], []
            for i, xs in actions.items():
                for x in xs:
                    fixed = i not in free
                    val = values.get(x.name, 0.0)
                    idx.append(x.index)
                    lo.append(round(val) if fixed else lower[x.index])
                    up.append(round(val) if fixed else upper[x.index])
            h.changeColsBounds(len(idx), np.array(idx, dtype=np.int32), np.array(lo, dtype=float),
                               np.array(up, dtype=float))
            if solution is not None:  # the best complete solution so far is feasible for this block
                start = np.array(solution, dtype=float)
                start[integer_idx] = np.round(start[integer_idx])
                h.setSolution(len(start), np.arange(len(start), dtype=np.int32), start)
            else:
                names = [n for n in values if n in by_name]
                h.setSolution(len(names), np.array([by_name[n].index for n in names], dtype=np.int32),
                              np.array([values[n] for n in names], dtype=float))
            left = len(blocks) - k
            h.setOptionValue("time_limit", float(max(MIN_BLOCK_TIME_S, min(remaining, 2 * remaining / left))))
            with solver_output_to_stderr():
                h.run()
            info = h.getInfo()
            if info.primal_solution_status != 2:  # no feasible solution
                continue
            obj = info.objective_function_value
            if obj < best_obj - 1e-9:
                if math.isfinite(best_obj):
                    improved = True
                best_obj, solution = obj, list(h.getSolution().col_value)
                for v in variables:
                    if v.cat == pulp.LpInteger:
                        values[v.name] = float(round(solution[v.index]))
        sweeps += 1
        if target_objective is not None and best_obj <= target_objective:
            break
        if sweeps >= max_sweeps or not best_obj < sweep_start_obj - SWEEP_MIN_GAIN * abs(best_obj):
            break
    if progress:
        progress(f"block improvement: {sweeps} sweep(s) over blocks of {block_candidates} candidates, objective "
                 f"{best_obj:.6g}" + ("" if improved else " (no improvement)"))
    if solution is None:
        return None
    for v in variables:
        v.varValue = solution[v.index]
    return model.choices(), {v.name: float(round(solution[v.index])) for v in variables if v.cat == pulp.LpInteger}, \
        best_obj


def lp_bound(model: Model, time_limit_s: float, lp=None) -> tuple[float, list[float]] | None:
    """The LP relaxation's optimum (a valid lower bound on the MILP's objective, in model units) and its
    solution (by variable index), or None when HiGHS is missing or the LP does not finish in time.
    `lp`: the model as highs_model built it, when the caller has it already."""
    if not highs_available() or time_limit_s <= 0:
        return None
    import highspy

    lp = lp if lp is not None else highs_model(model.prob, model.prob.variables())
    integrality = lp.integrality_
    lp.integrality_ = []
    h = highspy.Highs()
    h.setOptionValue("output_flag", False)
    h.setOptionValue("threads", SOLVER_THREADS)
    h.setOptionValue("time_limit", float(time_limit_s))
    h.passModel(lp)
    lp.integrality_ = integrality
    with solver_output_to_stderr():
        h.run()
    if h.getModelStatus() != highspy.HighsModelStatus.kOptimal:
        return None
    return h.getInfo().objective_function_value, list(h.getSolution().col_value)


def lp_disagreement(model: Model, lp_values: list[float], plan: dict[int, Choice]) -> dict[int, float]:
    """Per candidate, how far the plan's action is from the LP relaxation's (L1 over the action
    variables, weighted by the candidate's bytes): where a better plan most likely differs."""
    warm = model.warm_start_values(plan)
    out = {}
    for i, v in model.vars.items():
        xs = v.actions()
        out[i] = v.c.bytes * sum(abs(lp_values[x.index] - warm.get(x.name, 0.0)) for x in xs)
    return out


def result_from_values(model: Model, choices: dict[int, Choice], objective: float, bound: float | None,
                       rel_gap: float, solve_time_s: float) -> MilpResult:
    """A MilpResult for the solution already loaded into the model's variables (e.g. by
    improve_by_blocks, which read `choices` from them), judged against `bound` (model units):
    "optimal" when within `rel_gap`."""
    gap = None
    if bound is not None and objective > 0:
        gap = max(0.0, (objective - bound) / objective)
    prob = model.prob
    return MilpResult(choices=choices, objective_s=objective * model.time_unit,
                      bound_s=None if bound is None else bound * model.time_unit, gap=gap,
                      status="optimal" if gap is not None and gap <= rel_gap else "time_limit", solver="highs",
                      solve_time_s=solve_time_s, predicted_peak_bytes=model.predicted_peak_bytes(),
                      num_variables=len(prob.variables()), num_constraints=len(constraints_of(prob)))


def _time_of(model: Model) -> float:
    total = model.graph.compute_time_s
    for v in model.vars.values():
        for k, r in enumerate(v.rec):
            total += _value(r) * v.c.recipes[k].time_s
    total += sum(_value(s) for s in model.stall.values()) * model.time_unit
    return total


class _Infeasible(Exception):
    """The MILP has no solution under the cap (turned into InfeasibleCapError by solve)."""
