"""Region decisions in the MILP (docs/milp.md "Regions"), next to the per-candidate actions.

For every region R (regen.planner.region_candidates) with a member that has variables:
* `z_R` (binary): R is replayed, at its replay step b_R; its replay time is charged there (objective and
  copy-in channel, as recipes are);
* `reg_{t,R}` (binary) for each member t: t is rebuilt by R. It is one of t's actions (at most one
  action per candidate), `reg_{t,R} <= z_R`, and t is not resident from f_t+1 until b_R; a replay
  rebuilds something: `z_R <= sum_t reg_{t,R}` (a replay rebuilding nothing only costs, and the plan
  would not run it);
* R's arguments are held from the call to the replay: `z_R + (actions of a) <= 1` for each argument
  candidate a (kept while R is chosen);
* at b_R the replay's transient: its intermediates and buffer snapshot (`z_R x transient_bytes`), and
  at most the bytes of every member that R does not rebuild (`m_u (z_R - reg_{u,R})`).

regen.planner.milp.model calls these while it builds the model; `Model.regions` holds the variables.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import pulp

from regen.planner.milp.highs import new_var
from regen.planner.region_candidates import Region

if TYPE_CHECKING:
    from regen.planner.milp.model import Model


@dataclass
class RegionVars:
    region: Region
    z: object
    members: dict[int, object] = field(default_factory=dict)  # candidate index -> reg_{t,R}


def add_region_vars(model: Model) -> None:
    """`z_R` and `reg_{t,R}` for every region with a member that has variables (into model.regions and
    each member's CandidateVars.regions), with `reg <= z` and `z <= sum of reg`; none unless the options allow recompute."""
    if not model.options.allow_recompute:
        return
    prob = model.prob
    for region in model.graph.regions:
        members = [t for t in region.members if t in model.vars and model.vars[t].region_ok]
        if not members:
            continue
        r = region.index
        rv = RegionVars(region=region, z=new_var(f"z_{r}", 0, 1, cat=pulp.LpBinary))
        for t in members:
            x = new_var(f"reg_{t}_{r}", 0, 1, cat=pulp.LpBinary)
            rv.members[t] = x
            model.vars[t].regions.append((r, x))
            prob += x <= rv.z, f"reg_in_{t}_{r}"
        prob += rv.z <= pulp.lpSum(rv.members.values()), f"reg_some_{r}"
        model.regions[r] = rv


def add_region_input_constraints(model: Model) -> None:
    """A chosen region's argument candidates are kept (the runtime holds them until the replay)."""
    for r, rv in model.regions.items():
        for a in rv.region.inputs:
            av = model.vars.get(a)
            if av is not None and av.actions():
                model.prob += rv.z + pulp.lpSum(av.actions()) <= 1, f"reg_input_{r}_{a}"


def region_time_terms(model: Model) -> dict[int, list]:
    """Replay time (time units) charged at each replay step, as {step: [coefficient x z_R]}."""
    out: dict[int, list] = {}
    for rv in model.regions.values():
        out.setdefault(rv.region.replay_step, []).append((rv.region.time_s / model.time_unit) * rv.z)
    return out


def region_transients(model: Model, transients: dict[int, list]) -> None:
    """Add each region's transient at its replay step to `transients` ({step: [(coef in memory units,
    variable)]}); coefficients of reg_{u,R} are negative (a rebuilt member is resident, not transient)."""
    mu = model.mem_unit
    g = model.graph
    for rv in model.regions.values():
        region = rv.region
        at = transients.setdefault(region.replay_step, [])
        total = region.transient_bytes + sum(g.candidates[u].bytes for u in region.members)
        if total:
            at.append((total / mu, rv.z))
        for t, x in rv.members.items():
            if g.candidates[t].bytes:
                at.append((-g.candidates[t].bytes / mu, x))

