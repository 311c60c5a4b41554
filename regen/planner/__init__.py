"""regen.planner: the MILP that chooses keep, swap or recompute (not yet implemented)."""

from regen.errors import RegenError


def _not_yet(*args, **kwargs):
    raise RegenError("regen solve: not yet implemented")


load_solver_input = parse_memory_cap = solve = plan_summary = plan_summary_json = plot_timeline = _not_yet
