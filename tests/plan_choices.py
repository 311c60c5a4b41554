"""Test helper: a Plan's decisions as the planner's choices again, for the simulator (the planner itself
only goes the other way: regen.planner.export.build_plan)."""

from regen.errors import RegenError
from regen.formats.plan import ACTION_RECOMPUTE, ACTION_SWAP, Plan
from regen.planner.graph import PlanningGraph
from regen.planner.recipes import Recipe, recipe_transient_bytes
from regen.planner.result import Choice


def choices_from_plan(graph: PlanningGraph, plan: Plan) -> dict[int, Choice]:
    """The simulator's view of a plan's decisions (recipes re-derived from their op lists)."""
    by_id = graph.by_saved_id()
    ops = graph.profile.ops
    tensors = graph.profile.tensor_by_id()
    choices: dict[int, Choice] = {}
    region_index = {(r.call.module, r.call.call): r.index for r in graph.regions}
    for d in plan.decisions:
        c = by_id.get(d.saved_tensor)
        if c is None:
            raise RegenError(f"plan decision for saved tensor {d.saved_tensor}, which the profile does not have")
        if d.action == ACTION_RECOMPUTE and d.region is not None:
            pr = plan.regions[d.region]
            r = region_index.get((pr.module, pr.call))
            if r is None:
                raise RegenError(f"plan region {pr.module!r} call {pr.call}, which is no region of the profile")
            choices[c.index] = Choice(ACTION_RECOMPUTE, region=r)
        elif d.action == ACTION_SWAP:
            choices[c.index] = Choice(ACTION_SWAP, swap_in_step=d.swap_in_before_op, release_step=d.release_before_op)
        elif d.action == ACTION_RECOMPUTE and d.rebuilt_with is not None:
            other = by_id.get(d.rebuilt_with)
            if other is None:
                raise RegenError(f"plan decision for saved tensor {d.saved_tensor} is rebuilt with saved tensor "
                                 f"{d.rebuilt_with}, which the profile does not have")
            choices[c.index] = Choice(ACTION_RECOMPUTE, recipe=Recipe(ops=list(d.recipe), inputs=[], time_s=0.0,
                                                                      transient_bytes=0),
                                      rebuilt_with=other.index)
        elif d.action == ACTION_RECOMPUTE:
            inputs = [by_id[a].index for a in d.recipe_inputs if a in by_id]
            op_times_s = float(sum(graph.time_s[q] for q in d.recipe))
            recipe = Recipe(ops=list(d.recipe), inputs=inputs,
                            time_s=graph.costs.recipe_time_s(op_times_s, len(d.recipe)),
                            transient_bytes=recipe_transient_bytes(graph.profile, tensors, list(d.recipe),
                                                                   c.saved.storage),
                            random_ops=[q for q in d.recipe if ops[q].is_random])
            choices[c.index] = Choice(ACTION_RECOMPUTE, recipe=recipe)
    return choices
