"""Sub-MIPs of one HiGHS model: every column but a chosen few fixed at a solution's values and taken out.

The block search (regen.planner.milp.blocks) re-optimises a few dozen candidates at a time. Fixing the
other columns by their bounds leaves HiGHS the whole model to presolve on every block, a cost paid
before any search that grows with the model; `restrict` instead builds the block's own model: the free
columns, the rows that touch one of them (their bounds shifted by the fixed columns' activity), and
the fixed columns' cost as the objective offset. Any solution of the sub-model, with the fixed values,
is a solution of the whole model with the same objective; rows without a free column keep the
activity of the solution the values come from, so they hold when it did.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from regen.planner.milp.highs import require_highspy


@dataclass
class RowwiseModel:
    """A row-wise HighsLp (as to_highs_lp builds it), with each nonzero's row and the nonzeros of each
    column (so a block's rows are found from its columns alone), computed once."""

    lp: object
    index: np.ndarray  # column of each nonzero
    value: np.ndarray
    row_of_nonzero: np.ndarray
    nonzeros_by_column: np.ndarray  # nonzero positions ordered by column
    column_start: np.ndarray  # column c's nonzeros: nonzeros_by_column[column_start[c]:column_start[c + 1]]
    is_integer: np.ndarray  # by column
    integrality: np.ndarray  # the HighsLp's integrality_, by column (objects)
    col_cost: np.ndarray
    col_lower: np.ndarray
    col_upper: np.ndarray
    row_lower: np.ndarray
    row_upper: np.ndarray

    @classmethod
    def of(cls, lp) -> RowwiseModel:
        highspy = require_highspy()
        if lp.a_matrix_.format_ != highspy.MatrixFormat.kRowwise:
            raise ValueError("RowwiseModel needs a row-wise HighsLp")
        start = np.asarray(lp.a_matrix_.start_)
        index = np.asarray(lp.a_matrix_.index_).astype(np.int64)
        rows = np.repeat(np.arange(lp.num_row_, dtype=np.int64), np.diff(start))
        integrality = np.asarray(lp.integrality_, dtype=object)
        if len(integrality) == 0:
            integrality = np.full(lp.num_col_, highspy.HighsVarType.kContinuous, dtype=object)
        integer = np.array([t == highspy.HighsVarType.kInteger for t in integrality], dtype=bool)
        column_start = np.concatenate([[0], np.cumsum(np.bincount(index, minlength=lp.num_col_))])
        return cls(lp=lp, index=index, value=np.asarray(lp.a_matrix_.value_), row_of_nonzero=rows,
                   nonzeros_by_column=np.argsort(index, kind="stable"), column_start=column_start,
                   is_integer=integer, integrality=integrality, col_cost=np.asarray(lp.col_cost_),
                   col_lower=np.asarray(lp.col_lower_), col_upper=np.asarray(lp.col_upper_),
                   row_lower=np.asarray(lp.row_lower_), row_upper=np.asarray(lp.row_upper_))

    def rounded(self, values: np.ndarray) -> np.ndarray:
        """`values` with the integer columns rounded."""
        return np.where(self.is_integer, np.round(values), values)

    def activity_change(self, nonzeros: np.ndarray, change: np.ndarray) -> np.ndarray:
        """Every row's change of activity when the columns owning `nonzeros` change by `change` (by
        column)."""
        return np.bincount(self.row_of_nonzero[nonzeros], weights=self.value[nonzeros] * change[self.index[nonzeros]],
                           minlength=self.lp.num_row_)

    def activity(self, values: np.ndarray) -> np.ndarray:
        """Every row's activity at `values` (by column)."""
        return np.bincount(self.row_of_nonzero, weights=self.value * values[self.index], minlength=self.lp.num_row_)

    def nonzeros_of(self, columns: np.ndarray) -> np.ndarray:
        """The positions of the columns' nonzeros, in row order."""
        first, last = self.column_start[columns], self.column_start[columns + 1]
        lengths = last - first
        offsets = np.repeat(first - (np.cumsum(lengths) - lengths), lengths)
        return np.sort(self.nonzeros_by_column[np.arange(lengths.sum()) + offsets])


@dataclass
class SubModel:
    lp: object  # highspy.HighsLp over the free columns
    columns: np.ndarray  # the whole model's column of each sub-model column
    nonzeros: np.ndarray  # the whole model's nonzeros in the free columns


def restrict(model: RowwiseModel, columns: np.ndarray, values: np.ndarray, activity: np.ndarray) -> SubModel:
    """The sub-model over `columns` (sorted), every other column fixed at `values` (the whole model's
    columns, integers rounded), whose row activities are `activity` (RowwiseModel.activity)."""
    highspy = require_highspy()
    lp = model.lp
    nz = model.nonzeros_of(columns)
    rows = model.row_of_nonzero[nz]
    kept_rows, local_row, counts = np.unique(rows, return_inverse=True, return_counts=True)
    free_activity = np.bincount(local_row, weights=model.value[nz] * values[model.index[nz]],
                                minlength=len(kept_rows))
    shift = activity[kept_rows] - free_activity  # the fixed columns' activity
    new_col = np.full(lp.num_col_, -1, dtype=np.int64)
    new_col[columns] = np.arange(len(columns))

    sub = highspy.HighsLp()
    sub.num_col_ = len(columns)
    sub.num_row_ = len(kept_rows)
    cost = model.col_cost
    sub.col_cost_ = cost[columns]
    sub.col_lower_ = model.col_lower[columns]
    sub.col_upper_ = model.col_upper[columns]
    sub.offset_ = float(lp.offset_ + np.dot(cost, values) - np.dot(cost[columns], values[columns]))
    sub.row_lower_ = model.row_lower[kept_rows] - shift  # -inf stays -inf
    sub.row_upper_ = model.row_upper[kept_rows] - shift
    sub.a_matrix_.format_ = highspy.MatrixFormat.kRowwise
    sub.a_matrix_.start_ = np.concatenate([[0], np.cumsum(counts)]).astype(np.int32)
    sub.a_matrix_.index_ = new_col[model.index[nz]].astype(np.int32)
    sub.a_matrix_.value_ = model.value[nz]
    sub.a_matrix_.num_col_ = len(columns)
    sub.a_matrix_.num_row_ = len(kept_rows)
    sub.integrality_ = list(model.integrality[columns])
    return SubModel(lp=sub, columns=columns, nonzeros=nz)
