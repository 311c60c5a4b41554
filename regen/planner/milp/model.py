"""regen's MILP formulation: keep, swap or recompute every candidate, minimising the predicted step time.

The formulation of docs/milp.md, O(candidates x window) in size:

* actions: binaries `swap_t`, `rec_{t,k}` (one per recipe option k) and `built_{t,r,k}` (t "rebuilt
  with" candidate r's recipe k, which replays t's producer on the way: `built <= rec_{r,k}`, no time
  of its own, t resident from r's rebuild on; graph.Candidate.rebuilt_with_options), keep = 1 - their
  sum;
* copy-out: fractions `yout_{t,s}` over the bounded window after the pack, per-step channel capacity
  `sum_t m_t yout_{t,s} <= d2h x c_s` (copy-outs never stall compute in the runtime, so they get the
  op's compute time only; late copy-outs cost memory, not time), and monotone binaries
  `od_{t,s}` = "copy-out complete by the end of s" bounded by the cumulative fraction;
* copy-in: fractions `yin_{t,s}` over the window before b, monotone binaries `is_{t,s}` = "copy-in
  started by s" (it may start only once the copy-out is complete, and a step may copy only once it
  has started), per-step capacity `sum_t m_t yin_{t,s} <= h2d x T_s` where
  `T_s = c_s + recompute at s + stall_s` and `stall_s >= 0` is exposed transfer time;
* recompute: option k's time is charged at b (the first backward use); its inputs must be resident
  then: `rec_{t,k} <= keep_a + (fraction of a copied in before b)` unless a is resident anyway;
* memory: t not resident at step s of its gap: N_t(s) = rec_t + od_t(s-1) - is_t(s). The savings
  `S(s) = sum_t m_t N_t(s)` are a running sum whose terms change only at window steps, so they are
  variables at change points only (`S_k = S_{k-1} + changes`), and the cap becomes a lower bound on
  S over each segment where the resident set cannot change: max unplanned memory in it - S <= cap
  (plus recipe transients at b). Segments already under the cap get no constraint
  (regen.planner.milp.memory_rows).
* regions (regen.planner.milp.region_vars): `z_R` replays module call R at its replay step, a member t
  may be rebuilt by it (`reg_{t,R}`, one of t's actions: gone from f_t+1 until the replay), its
  arguments are kept, its time and transient are charged at the replay step;
* objective: sum_s T_s, plus the runtime's dispatch mode on the forward ops of the chosen per-tensor
  recipes' tracking windows (regen.planner.tracking_windows, charged by regen.planner.milp.tracking), plus the compute thread's share of each swap
  (`costs.swap_time_s(bytes_i)` x swap_i; the simulator charges it at the copy-out).

Memory is in units of `mem_unit` bytes, time in `time_unit` seconds, so coefficients stay near 1.
Solving and reading a solution back: regen.planner.milp.solution.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass, field

import pulp

from regen.errors import SolverError
from regen.formats.plan import ACTION_KEEP, ACTION_RECOMPUTE, ACTION_SWAP
from regen.planner.costs import copy_in_bytes_per_s, copy_out_bytes_per_s
from regen.planner.graph import Candidate, PlanningGraph
from regen.planner.milp.highs import linear, new_var
from regen.planner.milp.region_vars import (RegionVars, add_region_input_constraints, add_region_vars,
                                            region_time_terms)
from regen.planner.milp.host_memory import add_host_memory_constraints
from regen.planner.milp.memory_rows import add_memory_constraints
from regen.planner.milp.tracking import add_dispatch_charge
from regen.planner.residency import resident_without_plan

MEMORY_UNITS_PER_PEAK = 1e4  # memory unit = unplanned peak / this
TIME_UNITS_PER_STEP = 1e3  # time unit = unplanned compute time / this
# minimise-peak objective: one memory unit outweighs 100x the whole step time, so the peak comes first
PEAK_WEIGHT_PER_MEMORY_UNIT = 100 * TIME_UNITS_PER_STEP
DEFAULT_REL_GAP = 0.01  # stop once the incumbent is within 1% of the bound


@dataclass
class MilpOptions:
    allow_swap: bool = True
    allow_recompute: bool = True
    rel_gap: float = DEFAULT_REL_GAP
    minimize_peak: bool = False  # the cap becomes a variable: find the smallest feasible cap
    fixed_actions: dict[int, str] | None = None  # candidate index -> action (brute-force evaluation)
    allow_rebuilt_with: bool = True  # a candidate may be rebuilt with another's recipe
    fifo_pairs: list[tuple[int, int]] = field(default_factory=list)  # (issued first, issued later)
    step_margin_bytes: dict[int, int] = field(default_factory=dict)  # extra headroom at steps (repair)


@dataclass
class CandidateVars:
    """One candidate's variables."""

    c: Candidate
    rec: list  # per recipe option
    swap: object | None = None
    od: dict = field(default_factory=dict)  # step -> binary (window steps but the last)
    is_: dict = field(default_factory=dict)
    yout: dict = field(default_factory=dict)
    yin: dict = field(default_factory=dict)
    # (candidate r, its recipe option k, binary): rebuilt with r's recipe k
    rebuilt_with: list = field(default_factory=list)
    region_ok: bool = False  # may be rebuilt by a region (Candidate.regions)
    regions: list = field(default_factory=list)  # (region index, binary reg_{t,R}): rebuilt by region R

    def actions(self) -> list:
        """The binaries of every non-keep action (their sum is at most 1)."""
        return (self.rec + [x for _, _, x in self.rebuilt_with] + [x for _, x in self.regions]
                + ([self.swap] if self.swap is not None else []))

    def od_expr(self, j: int):
        """Copy-out complete by the end of step j: 0 before the first break, swap_t from the last."""
        return _piecewise(self.c.out_breaks, self.od, self.swap, j)

    def is_expr(self, s: int):
        """Copy-in started by step s."""
        return _piecewise(self.c.in_breaks, self.is_, self.swap, s)

    def nonresident(self, s: int, graph: PlanningGraph) -> dict:
        """N_t(s) as {variable: coefficient} for a step s of the gap (rec + od(s-1) - is(s), plus each
        "rebuilt with" option until the other recipe runs)."""
        out: dict = {}
        for r in self.rec:
            out[r] = out.get(r, 0) + 1
        for ri, _, x in self.rebuilt_with:
            if s < graph.candidates[ri].first_backward:
                out[x] = out.get(x, 0) + 1
        for ri, x in self.regions:
            if s < graph.regions[ri].replay_step:
                out[x] = out.get(x, 0) + 1
        od = self.od_expr(s - 1)
        if od is not None:
            out[od] = out.get(od, 0) + 1
        st = self.is_expr(s)
        if st is not None:
            out[st] = out.get(st, 0) - 1
        return {k: x for k, x in out.items() if x}


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
        self.vars: dict[int, CandidateVars] = {}
        self.stall: dict[int, object] = {}
        self.segments: list[tuple[int, int, object]] = []  # (first step, last step, S variable)
        self.regions: dict[int, RegionVars] = {}  # region index -> its variables (milp/region_vars.py)
        # rows the LP relaxation leaves out (milp/relaxation.py): the host-memory rows and the copy-in
        # start rows, by name
        self.rows_not_in_relaxation: list[str] = []
        # the cap rows (milp/memory_rows.py), by name: the LP relaxation adds them only when violated
        self.cap_rows: list[str] = []
        self.cap_var = None
        self._columns: list | None = None
        self._build()

    def columns(self) -> list:
        """Every variable, in the order of the model's HiGHS columns (PuLP's: by name). PuLP finds them by walking
        every row, a second or more on thousands of candidates, so the list is made once: no row or variable is
        added after the build."""
        if self._columns is None:
            self._columns = self.prob.variables()
        return self._columns

    def _build(self) -> None:
        g, opt, prob = self.graph, self.options, self.prob
        fixed = opt.fixed_actions or {}
        for c in g.candidates:
            v = self._candidate_vars(c, fixed.get(c.index))
            if v is not None:
                self.vars[c.index] = v
        if opt.allow_rebuilt_with:
            self._rebuilt_with_vars()
        add_region_vars(self)
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
        self._recipe_input_constraints()
        add_region_input_constraints(self)
        for a, b in opt.fifo_pairs:
            self._fifo_constraint(a, b)
        objective_terms = self._channel_constraints()
        add_memory_constraints(self)
        add_host_memory_constraints(self)
        tu = self.time_unit
        for v in self.vars.values():
            for k, r in enumerate(v.rec):
                objective_terms.append((v.c.recipes[k].time_s / tu) * r)
            if v.swap is not None and g.costs.swap_time_s(v.c.bytes):
                objective_terms.append((g.costs.swap_time_s(v.c.bytes) / tu) * v.swap)
        objective_terms += [x for terms in region_time_terms(self).values() for x in terms]
        objective_terms += add_dispatch_charge(self)
        time_obj = pulp.lpSum(objective_terms) + sum(g.time_s) / tu
        if opt.minimize_peak:
            # lexicographic enough: a unit of memory outweighs the whole step time
            prob += self.cap_var * PEAK_WEIGHT_PER_MEMORY_UNIT + time_obj
        else:
            prob += time_obj

    def _candidate_vars(self, c: Candidate, want: str | None) -> CandidateVars | None:
        """The action and copy variables of a candidate with a choice, or None when it is kept."""
        opt = self.options
        if c.trivial or c.bytes <= 0:
            return None
        rec_ok = opt.allow_recompute and c.can_recompute and want in (None, ACTION_RECOMPUTE)
        swap_ok = opt.allow_swap and c.can_swap and want in (None, ACTION_SWAP)
        region_ok = opt.allow_recompute and bool(c.regions) and want in (None, ACTION_RECOMPUTE)
        if not rec_ok and not swap_ok and not region_ok:
            if want not in (None, ACTION_KEEP):
                raise SolverError(f"candidate {c.id} cannot be {want}")
            return None
        v = CandidateVars(c=c, rec=[], region_ok=region_ok)
        i = c.index
        if rec_ok:
            v.rec = [new_var(f"rec_{i}_{k}", 0, 1, cat=pulp.LpBinary) for k in range(len(c.recipes))]
        if swap_ok:
            v.swap = new_var(f"swap_{i}", 0, 1, cat=pulp.LpBinary)
            for s in c.out_window:
                v.yout[s] = new_var(f"yout_{i}_{s}", 0, 1)
            for s in c.out_breaks[:-1]:
                v.od[s] = new_var(f"od_{i}_{s}", 0, 1, cat=pulp.LpBinary)
            for s in c.in_window:
                v.yin[s] = new_var(f"yin_{i}_{s}", 0, 1)
            for s in c.in_breaks[:-1]:
                v.is_[s] = new_var(f"is_{i}_{s}", 0, 1, cat=pulp.LpBinary)
        return v

    def _rebuilt_with_vars(self) -> None:
        for i, v in self.vars.items():
            if not v.rec:
                continue
            for ri, k in v.c.rebuilt_with_options:
                other = self.vars.get(ri)
                # only if r runs recipe k (checked again: callers may prune recipes)
                if (other is not None and k < len(other.rec)
                        and v.c.producer in other.c.recipes[k].ops[:-1]):
                    x = new_var(f"built_{i}_{ri}_{k}", 0, 1, cat=pulp.LpBinary)
                    v.rebuilt_with.append((ri, k, x))
                    self.prob += x <= other.rec[k], f"rebuilt_with_{i}_{ri}_{k}"

    def _swap_constraints(self, v: CandidateVars) -> None:
        prob, c, i = self.prob, v.c, v.c.index
        prob += linear([(1.0, y) for y in v.yout.values()] + [(-1.0, v.swap)]) == 0, f"out_all_{i}"
        prob += linear([(1.0, y) for y in v.yin.values()] + [(-1.0, v.swap)]) == 0, f"in_all_{i}"
        ob, ib = c.out_breaks, c.in_breaks
        for k, j in enumerate(ob[:-1]):
            prob += linear([(1.0, y) for s, y in v.yout.items() if s <= j] + [(-1.0, v.od[j])]) >= 0, f"od_frac_{i}_{j}"
            prob += linear([(1.0, v.od[j]), (-1.0, v.od_expr(ob[k + 1]))]) <= 0, f"od_mono_{i}_{j}"
        for k, s in enumerate(ib):
            started = v.is_expr(s)
            if k + 1 < len(ib):
                prob += linear([(1.0, v.is_[s]), (-1.0, v.is_expr(ib[k + 1]))]) <= 0, f"is_mono_{i}_{s}"
            done = v.od_expr(s - 1)
            if done is None:
                prob += linear([(1.0, started)]) == 0, f"in_after_out_{i}_{s}"
            elif done is not started:
                prob += linear([(1.0, started), (-1.0, done)]) <= 0, f"in_after_out_{i}_{s}"
        # nothing flows before the copy-in starts: the fraction copied in by the end of a segment where
        # "started" is constant is at most that indicator (aggregated over the segment, which is what
        # keeps the LP relaxation tight: a half-started copy-in cannot free memory it has not copied yet)
        in_steps = sorted(v.yin)
        for k, s0 in enumerate(ib):
            s1 = ib[k + 1] - 1 if k + 1 < len(ib) else None
            if s1 is None:
                break  # from the last break on, "started" is swap_t itself: implied by in_all
            upto = [(1.0, v.yin[s]) for s in in_steps if s <= s1]
            if upto:
                prob += linear(upto + [(-1.0, v.is_expr(s0))]) <= 0, f"in_started_{i}_{s0}"
                self.rows_not_in_relaxation.append(f"in_started_{i}_{s0}")

    def _recipe_input_constraints(self) -> None:
        g, prob = self.graph, self.prob
        for i, v in self.vars.items():
            b = v.c.first_backward
            for k, r in enumerate(v.rec):
                for a_idx in v.c.recipes[k].inputs:
                    if resident_without_plan(g.candidates[a_idx], b):
                        continue
                    av = self.vars.get(a_idx)
                    if av is None:
                        continue  # always kept
                    # r <= keep_a + the fraction of a's copy-in done before b starts, keep_a = 1 - a's actions
                    # (a rebuilt-with input counts as gone: conservative)
                    back = [(-1.0, av.yin[s]) for s in av.c.in_window if s < b] if av.swap is not None else []
                    prob += linear([(1.0, r)] + [(1.0, x) for x in av.actions()] + back) <= 1, f"recipe_input_{i}_{k}_{a_idx}"

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
        """Per-step copy capacity in each direction; returns the stall variables (objective terms)."""
        g, prob, mu, tu = self.graph, self.prob, self.mem_unit, self.time_unit
        out_at: dict[int, list] = {}
        in_at: dict[int, list] = {}
        rec_at: dict[int, list] = region_time_terms(self)  # region replays, then recipes, at their steps
        for v in self.vars.values():
            for s, y in v.yout.items():
                out_at.setdefault(s, []).append((v.c.bytes / mu, y))
            for s, y in v.yin.items():
                in_at.setdefault(s, []).append((v.c.bytes / mu, y))
            for k, r in enumerate(v.rec):
                rec_at.setdefault(v.c.first_backward, []).append((v.c.recipes[k].time_s / tu) * r)
        for s, terms in out_at.items():
            prob += linear(terms) <= copy_out_bytes_per_s(g) * g.time_s[s] / mu, f"d2h_{s}"
        stalls = []
        rate = copy_in_bytes_per_s(g) * tu / mu  # memory units per time unit
        for s, terms in in_at.items():
            st = new_var(f"stall_{s}", 0)
            self.stall[s] = st
            stalls.append(st)
            recomputes = linear([(-rate * coef, x) for term in rec_at.get(s, []) for x, coef in term.items()])
            prob += (linear(terms + [(-rate, st)]) + recomputes
                     <= copy_in_bytes_per_s(g) * g.time_s[s] / mu), f"h2d_{s}"
        return stalls
