"""PuLP models solved on HiGHS (highspy): the bridge between the two, and the solver's process plumbing.

Models are written with PuLP (readable constraints) and handed to HiGHS in one call (`to_highs_lp`),
not constraint by constraint. PuLP's own HiGHS interface reads a solution back through each
variable's `index` attribute (its column in the HiGHS model), so `to_highs_lp` sets it, and the block
search uses the same columns. HiGHS (highspy) is required: `require_highspy` says so in one line.
"""

from __future__ import annotations

import contextlib
import math
import os
import sys
import time
from dataclasses import dataclass
from typing import Callable

import pulp

from regen.errors import SolverError

SOLVER_THREADS = 2
PROGRESS_INTERVAL_S = 0.5  # at most one incumbent message per this many seconds


def require_highspy():
    """The highspy module, or a SolverError saying it is required."""
    try:
        import highspy
    except ImportError:
        raise SolverError("HiGHS (highspy) is required to solve the MILP: pip install highspy") from None
    return highspy


def new_var(name: str, low=None, up=None, cat: str = pulp.LpContinuous):
    """A PuLP variable (PuLP 3.3 deprecates constructing LpVariable directly, 2.x lacks add_variable)."""
    if hasattr(pulp.LpProblem, "add_variable"):
        return pulp.LpProblem.add_variable(None, name, low, up, cat=cat)
    return pulp.LpVariable(name, low, up, cat=cat)


def linear(pairs, constant: float = 0.0) -> pulp.LpAffineExpression:
    """sum(coef * x) + constant over (coef, variable) pairs, a variable's repeats added up: one dict
    built in one pass, where PuLP's operators copy an expression per term (most of a large model's
    build time)."""
    acc: dict = {}
    for coef, x in pairs:
        acc[x] = acc.get(x, 0.0) + coef
    return pulp.LpAffineExpression(acc, constant=constant)


def constraints_of(prob: pulp.LpProblem) -> list:
    cons = prob.constraints
    return cons() if callable(cons) else list(cons.values())


def value_of(x) -> float:
    """A solved variable's value, a constant as a float, 0 for None."""
    if x is None:
        return 0.0
    if isinstance(x, (int, float)):
        return float(x)
    return float(x.varValue or 0.0)


def size_message(prob: pulp.LpProblem, lp=None, variables: list | None = None) -> str:
    """The model's size in one line (`lp`: the model as to_highs_lp built it, which has the counts; `variables`:
    the problem's, when the caller has them)."""
    if lp is not None:
        binaries = sum(1 for t in lp.integrality_ if t == require_highspy().HighsVarType.kInteger)
        return (f"MILP: {lp.num_col_} variables ({binaries} binary), {lp.num_row_} constraints, "
                f"{len(lp.a_matrix_.value_)} nonzeros")
    cons, variables = constraints_of(prob), variables if variables is not None else prob.variables()
    binaries = sum(1 for v in variables if v.cat == pulp.LpInteger)
    return (f"MILP: {len(variables)} variables ({binaries} binary), {len(cons)} constraints, "
            f"{sum(len(c) for c in cons)} nonzeros")


def to_highs_lp(prob: pulp.LpProblem, variables: list):
    """The PuLP problem as a highspy HighsLp, built in bulk; sets each variable's and constraint's
    `index` (its column / row)."""
    highspy = require_highspy()
    import numpy as np

    for i, var in enumerate(variables):
        var.index = i
    n = len(variables)
    inf = highspy.kHighsInf
    model = highspy.HighsLp()
    model.num_col_ = n
    model.col_cost_ = np.array([prob.objective.get(v, 0.0) for v in variables], dtype=float)
    model.col_lower_ = np.array([-inf if v.lowBound is None else v.lowBound for v in variables], dtype=float)
    model.col_upper_ = np.array([inf if v.upBound is None else v.upBound for v in variables], dtype=float)
    model.offset_ = float(prob.objective.constant)
    starts, index, value, lower, upper = [0], [], [], [], []
    for i, con in enumerate(constraints_of(prob)):
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


def new_highs(rel_gap: float | None = None, time_limit_s: float | None = None):
    """A quiet highspy.Highs with the planner's thread count (built with stdout sent to stderr: the first
    Highs() of a process prints a banner, and a program that calls the planner keeps its stdout)."""
    with solver_output_to_stderr():
        h = require_highspy().Highs()
    h.setOptionValue("output_flag", False)
    h.setOptionValue("threads", SOLVER_THREADS)
    if rel_gap is not None:
        h.setOptionValue("mip_rel_gap", rel_gap)
    if time_limit_s is not None:
        h.setOptionValue("time_limit", float(time_limit_s))
    return h


class BulkHighs(pulp.HiGHS):
    """PuLP's HiGHS interface, with the model passed in one call, a warm start and progress."""

    def __init__(self, warm_values: dict[str, float] | None = None,
                 progress: Callable[[str], None] | None = None, variables: list | None = None, **kwargs):
        super().__init__(**kwargs)
        self.warm_values = warm_values or {}
        self.variables = variables  # the problem's, in column order, when the caller has them (Model.columns)
        self.progress = progress
        self.info = None
        self.model_status = None

    def buildSolverModel(self, lp):  # noqa: N802 (PuLP's name)
        import numpy as np

        # PuLP's dummy column (a constant objective gets one for the solve) is not among the caller's
        variables = self.variables if self.variables is not None and lp.dummyVar is None else lp.variables()
        lp.solverModel.passModel(to_highs_lp(lp, variables))
        if self.warm_values:
            idx = [v.index for v in variables if v.name in self.warm_values]
            vals = [self.warm_values[v.name] for v in variables if v.name in self.warm_values]
            lp.solverModel.setSolution(len(idx), np.array(idx, dtype=np.int32), np.array(vals, dtype=float))
        if self.progress is not None:
            progress = self.progress
            last = [0.0]

            def improving(event):
                now = time.perf_counter()
                if now - last[0] < PROGRESS_INTERVAL_S:
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


@dataclass
class HighsRun:
    """How one solve of a PuLP problem on HiGHS ended (the solution is in the problem's variables)."""

    pulp_status: int  # what prob.solve returned
    solution_status: int  # prob.sol_status
    optimal: bool  # HiGHS proved optimality (within the gap)
    bound: float | None  # HiGHS's dual bound (model units)
    gap: float | None  # relative gap, when finite
    elapsed_s: float

    @property
    def has_solution(self) -> bool:
        return self.solution_status in (pulp.LpSolutionOptimal, pulp.LpSolutionIntegerFeasible)

    @property
    def infeasible(self) -> bool:
        return self.pulp_status == pulp.LpStatusInfeasible or self.solution_status == pulp.LpSolutionInfeasible


def run_highs(prob: pulp.LpProblem, time_limit_s: float, rel_gap: float, warm_values: dict[str, float] | None = None,
              progress: Callable[[str], None] | None = None, variables: list | None = None) -> HighsRun:
    """Solve `prob` on HiGHS; the values land in its variables (`variables`: the problem's in PuLP's order, when
    the caller has them, so PuLP need not walk every row for them once more)."""
    highspy = require_highspy()
    solver = BulkHighs(warm_values=warm_values, progress=progress, variables=variables, msg=False,
                       timeLimit=time_limit_s, gapRel=rel_gap, threads=SOLVER_THREADS)
    t0 = time.perf_counter()
    with solver_output_to_stderr():
        status = prob.solve(solver)
    elapsed = time.perf_counter() - t0
    optimal, bound, gap = False, None, None
    if solver.info is not None:
        optimal = solver.model_status == highspy.HighsModelStatus.kOptimal
        bound = solver.info.mip_dual_bound
        gap = solver.info.mip_gap if math.isfinite(solver.info.mip_gap) else None
        if optimal:
            gap = max(0.0, gap or 0.0)
    return HighsRun(pulp_status=status, solution_status=prob.sol_status, optimal=optimal, bound=bound, gap=gap,
                    elapsed_s=elapsed)


@contextlib.contextmanager
def solver_output_to_stderr():
    """Send file descriptor 1 to stderr while a solver runs.

    HiGHS prints its banner from C++ to the process's stdout when the first `Highs()` of a process is
    built (before any option can turn it off); `regen solve` keeps stdout for its own output, so
    solver text goes to stderr with the progress messages.
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
    """Give HiGHS a fresh thread pool. HiGHS keeps one pool per process across solves, and each solve
    in a process can run slower than the one before on it; a reset between solves keeps them
    independent."""
    try:
        import highspy
    except ImportError:
        return
    reset = getattr(highspy.Highs, "resetGlobalScheduler", None)
    if reset is not None:
        reset(True)
