"""Profiles and plans for the tests that need plans the same on any machine: op times and runtime costs
fixed from the graph, tiny models, so each profile and solve takes a fraction of a second."""

from __future__ import annotations

# the built-in GPT at its smallest that still has every kind of candidate (dropout masks, attention)
TINY_GPT = {"vocab_size": 128, "context": 32, "d_model": 32, "n_layer": 2, "n_head": 2}


def profile(workload):
    """A profile whose times are a function of the ops alone (`fixed_times`): the plans solved from it are
    the same on a busy machine as on a quiet one."""
    from regen.profiler import profile_workload

    return fixed_times(profile_workload(workload, device="cpu", repeats=1, warmup_steps=0, progress=None))


def fixed_times(prof):
    """The profile with every op's time set from the bytes it reads and outputs (1 us, plus 1 us per KiB), the
    step's time their sum, and `fixed_runtime_costs`: what a plan chooses then depends on the graph, not on how
    loaded the machine was while it was profiled."""
    sizes = {t.id: t.bytes for t in prof.tensors}
    for op in prof.ops:
        moved = sum(sizes.get(x, 0) for x in list(op.inputs) + list(op.outputs))
        op.time_s = 1e-6 * (1 + moved / 1024)
    prof.step_time_s = sum(op.time_s for op in prof.ops)
    prof.forward_time_s = sum(op.time_s for op in prof.ops[:prof.num_forward_ops])
    prof.runtime_costs = fixed_runtime_costs()
    return prof


def fixed_runtime_costs():
    """Runtime costs for the tests (1 us per tracked, captured or replayed op and per recipe, 50 us of the
    compute thread's time per swap), in place of what the profile's probe measured on this machine."""
    from regen.formats.profile import RuntimeCosts

    return RuntimeCosts(dispatch_op_s=1e-6, capture_op_s=1e-6, replay_op_s=1e-6, recipe_s=1e-6,
                        method="fixed for the tests", swap_s=50e-6)


def solve_halfway(prof, strategy: str, link_ratio: float | None = None, fraction: float = 0.5):
    """A plan at a cap `fraction` of the way from the lowest peak recompute can reach to the unplanned peak
    (halfway by default): on tiny models the parameters dominate, so a fraction of the unplanned peak may be
    infeasible."""
    from regen.planner import solve
    from regen.planner.graph import build_graph
    from regen.planner.residency import lower_bound_peak

    lower = lower_bound_peak(build_graph(prof), allow_swap=False, allow_recompute=True)
    cap = int(lower + fraction * (prof.peak_bytes - lower))
    link = {"link_ratio": link_ratio} if link_ratio is not None else {}
    # a limit far past the seconds these take on a quiet machine (6-11 s for hybrid): a loaded one still ends
    # within the gap, with the plan the test asks for, not at the time limit with the warm start
    return solve(prof, memory_cap_bytes=cap, strategy=strategy, time_limit_s=120, **link)


def weights_and_buffers(model) -> dict:
    """Copies of a model's parameters and buffers by name, for comparing two training runs."""
    out = {n: p.detach().clone() for n, p in model.named_parameters()}
    out.update({f"buffer {n}": b.detach().clone() for n, b in model.named_buffers()})
    return out
