"""The MILP's device memory rows (docs/milp.md "Memory"): the bytes a plan frees, S, as a running sum
over the steps where some candidate's residency can change, and on every segment between them the
cap as a lower bound on S (plus the recipe and region transients charged at their steps).

N_t(s), candidate t not resident at step s of its gap (CandidateVars.nonresident), changes only at
window steps, so S is a chain of continuous variables `S_k = S_{k-1} + changes at k`, O(candidates)
nonzeros; segments already under the cap get no row.
"""

from __future__ import annotations


from regen.planner.milp.captures import CaptureTerms
from regen.planner.milp.highs import linear, new_var
from regen.planner.milp.region_vars import region_transients
from regen.planner.residency import unplanned_step_bytes


class CapInfeasible(Exception):
    """The MILP has no solution under the cap (solve turns it into an InfeasibleCapError)."""


def add_memory_constraints(model) -> None:
    """The savings S as a running sum over change points, bounded below on every segment (model:
    milp.model.Model; its `segments` and, when minimising the peak, `cap_var` are set here)."""
    g, prob, mu = model.graph, model.prob, model.mem_unit
    margin_at = model.options.step_margin_bytes
    changes, transients = savings_changes(model)
    captures = CaptureTerms(model)
    for s, terms in captures.changes.items():
        changes.setdefault(s, []).extend(terms)
    cap = model.cap_bytes
    if model.options.minimize_peak:
        model.cap_var = new_var("cap", 0)
    points = sorted(changes)
    bounds = [0] + points + [g.num_steps]
    # steps before the first change point have no savings at all
    head = range(0, points[0] if points else g.num_steps)
    head_peak = max((unplanned_step_bytes(g, s) + margin_at.get(s, 0) for s in head), default=0)
    if model.cap_var is not None:
        prob += model.cap_var >= head_peak / mu, "mem_head"
    elif head_peak > cap:
        raise CapInfeasible()
    prev_var = None
    for k, s0 in enumerate(points):
        s1 = bounds[k + 2] - 1
        var = new_var(f"S_{s0}")
        chain = [(1.0, var)] + ([(-1.0, prev_var)] if prev_var is not None else [])
        prob += linear(chain + [(-coef, x) for coef, x in changes[s0]]) == 0, f"run_{s0}"
        prev_var = var
        margin = max((margin_at.get(s, 0) for s in range(s0, s1 + 1)), default=0)
        held = captures.worst_bytes_until(s1)  # a bound: the exact amount is in S
        seg_peak = max(unplanned_step_bytes(g, s) for s in range(s0, s1 + 1)) + margin
        trans = transients.get(s0, [])
        worst_trans = sum(coef for coef, _ in trans if coef > 0) * mu
        model.segments.append((s0, s1, var))
        if model.cap_var is not None:
            _add_cap_row(model, var + model.cap_var >= seg_peak / mu, f"mem_{s0}")
            if trans:
                _add_cap_row(model, linear([(1.0, var), (1.0, model.cap_var)] + [(-cf, x) for cf, x in trans])
                             >= (g.peak_bytes[s0] + margin) / mu, f"memt_{s0}")
            continue
        if seg_peak + held > cap:
            _add_cap_row(model, var >= (seg_peak - cap) / mu, f"mem_{s0}")
        if trans and g.peak_bytes[s0] + margin + worst_trans + held > cap:
            _add_cap_row(model, linear([(1.0, var)] + [(-cf, x) for cf, x in trans])
                         >= (g.peak_bytes[s0] + margin - cap) / mu, f"memt_{s0}")


def _add_cap_row(model, row, name: str) -> None:
    model.prob += row, name
    model.cap_rows.append(name)


def savings_changes(model) -> tuple[dict[int, list], dict[int, list]]:
    """Where S changes, as step -> [(coefficient in memory units, variable)], and the recipe
    transients charged at each first backward use."""
    g, mu = model.graph, model.mem_unit
    changes: dict[int, list] = {}
    transients: dict[int, list] = {}
    for v in model.vars.values():
        c = v.c
        f, b = c.last_forward, c.first_backward
        points = {f + 1, b}
        points.update(g.candidates[ri].first_backward for ri, _, _ in v.rebuilt_with)
        points.update(g.regions[ri].replay_step for ri, _ in v.regions)
        if v.swap is not None:
            points.update(s + 1 for s in c.out_breaks)
            points.update(c.in_breaks)
        prev: dict = {}
        for s in sorted(p for p in points if f + 1 <= p <= b):
            cur = v.nonresident(s, g) if s < b else {}
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
    region_transients(model, transients)
    return changes, transients
