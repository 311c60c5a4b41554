"""Sub-models of a HiGHS model (regen.planner.milp.submodel): columns fixed and taken out, rows shifted."""

import numpy as np
import pulp
import pytest

from regen.planner.milp.highs import constraints_of, new_highs, new_var, to_highs_lp
from regen.planner.milp.submodel import RowwiseModel, restrict


def _small_mip():
    """min x + 2y + 3z + w  s.t.  x + y >= 1,  y + z >= 1,  z + w >= 1,  x + w <= 1,  binaries."""
    prob = pulp.LpProblem("small", pulp.LpMinimize)
    x, y, z, w = (new_var(n, 0, 1, cat=pulp.LpBinary) for n in "xyzw")
    prob += x + 2 * y + 3 * z + w + 5
    prob += x + y >= 1, "a"
    prob += y + z >= 1, "b"
    prob += z + w >= 1, "c"
    prob += x + w <= 1, "d"
    variables = prob.variables()
    return prob, variables, to_highs_lp(prob, variables)


def test_a_sub_model_keeps_the_rows_of_its_columns_shifted_by_the_fixed_ones():
    prob, variables, lp = _small_mip()
    col = {v.name: v.index for v in variables}
    full = RowwiseModel.of(lp)
    start = np.zeros(len(variables))
    start[[col["y"], col["z"]]] = 1  # feasible: y + z covers rows a, b, c; objective 10
    free = np.array(sorted([col["x"], col["w"]]))
    sub = restrict(full, free, start, full.activity(start))
    assert sub.lp.num_col_ == 2
    assert sub.lp.num_row_ == 3  # a, c, d touch x or w; b does not
    assert list(sub.columns) == list(free)
    assert sub.lp.offset_ == pytest.approx(5 + 2 + 3)  # the constant, and y and z at 1
    h = new_highs()
    h.passModel(sub.lp)
    h.run()
    # with y and z fixed at 1, rows a and c already hold: x = w = 0 is the sub-model's optimum
    assert h.getInfo().objective_function_value == pytest.approx(10)
    assert list(np.round(h.getSolution().col_value)) == [0, 0]


def test_a_sub_model_solution_with_the_fixed_values_solves_the_whole_model():
    prob, variables, lp = _small_mip()
    col = {v.name: v.index for v in variables}
    full = RowwiseModel.of(lp)
    start = np.zeros(len(variables))
    start[[col["y"], col["z"]]] = 1
    free = np.array(sorted([col["y"], col["x"], col["w"]]))
    sub = restrict(full, free, start, full.activity(start))
    h = new_highs()
    h.passModel(sub.lp)
    h.run()
    solution = start.copy()
    solution[sub.columns] = np.round(h.getSolution().col_value)
    for v in variables:
        v.varValue = solution[v.index]
    assert all(con.valid(1e-9) for con in constraints_of(prob))
    assert pulp.value(prob.objective) == pytest.approx(h.getInfo().objective_function_value)
    assert pulp.value(prob.objective) == pytest.approx(9)  # x = 1, z = 1 (y freed to 0)
    # the activity follows a change of the free columns
    change = np.zeros(len(variables))
    change[sub.columns] = solution[sub.columns] - start[sub.columns]
    assert np.allclose(full.activity(start) + full.activity_change(sub.nonzeros, change), full.activity(solution))
