"""Plans for the stack tests: tiny models, so each profile and solve takes a fraction of a second."""

from __future__ import annotations

# the built-in GPT at its smallest that still has every kind of candidate (dropout masks, attention)
TINY_GPT = {"vocab_size": 128, "context": 32, "d_model": 32, "n_layer": 2, "n_head": 2}


def profile(workload):
    from regen.profiler import profile_workload

    return profile_workload(workload, device="cpu", repeats=1, warmup_steps=0, progress=None)


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
    return solve(prof, memory_cap_bytes=cap, strategy=strategy, time_limit_s=30, **link)


def weights_and_buffers(model) -> dict:
    """Copies of a model's parameters and buffers by name, for comparing two training runs."""
    out = {n: p.detach().clone() for n, p in model.named_parameters()}
    out.update({f"buffer {n}": b.detach().clone() for n, b in model.named_buffers()})
    return out
