"""`regen show PLAN`: a readable summary, one JSON object, or a plot of the memory timelines."""

from __future__ import annotations

from regen.errors import RegenError
from regen.units import BYTES_PER_GB, BYTES_PER_GIB, format_bytes, format_duration
from regen.formats.plan import ACTION_RECOMPUTE, ACTIONS, Plan

PLOT_DPI = 120
PLOT_SIZE_IN = (10, 4.5)
MAX_LISTED_WINDOWS = 6  # tracking-window starts named in the summary, at most


def _ratio(a: float, b: float) -> str:
    return f"{100.0 * a / b:.1f}%" if b else "n/a"


def plan_summary(plan: Plan) -> str:
    counts, nbytes = plan.action_counts(), plan.action_bytes()
    s = plan.solver
    time_unit = plan.workload.get("time_unit")

    def duration(seconds: float) -> str:
        return format_duration(seconds, time_unit)

    lines = [
        f"regen plan ({plan.format}) for {plan.workload.get('name', '?')}: strategy {plan.strategy}",
        f"  memory cap        {format_bytes(plan.memory_cap_bytes)} "
        f"({_ratio(plan.memory_cap_bytes, plan.baseline.peak_bytes)} of the unplanned peak)",
        f"  peak memory       unplanned {format_bytes(plan.baseline.peak_bytes)}, predicted "
        f"{format_bytes(plan.predicted.peak_bytes)}, simulated {format_bytes(plan.simulated.peak_bytes)}",
        f"  step time         unplanned {duration(plan.baseline.step_time_s)}, predicted "
        f"{duration(plan.predicted.step_time_s)} "
        f"(+{_ratio(plan.predicted.step_time_s - plan.baseline.step_time_s, plan.baseline.step_time_s)}), "
        f"simulated {duration(plan.simulated.step_time_s)}",
    ]
    parts = plan.simulated_parts
    if parts is not None:
        replays = f" (module replays {duration(parts.region_s)})" if parts.region_s > 0 else ""
        lines.append(f"  simulated extra   recompute {duration(parts.recompute_s)}{replays}, swap calls "
                     f"{duration(parts.swap_calls_s)}, dispatch {duration(parts.dispatch_s)}, link waits "
                     f"{duration(parts.link_wait_s)}")
    charges = plan.charges
    if charges is not None:
        lines.append(f"  charged           dispatch {charges.dispatch_op_s * 1e6:.1f} us/op, capture "
                     f"{charges.capture_op_s * 1e6:.1f} us/op, replay {charges.replay_op_s * 1e6:.1f} us/op, recipe "
                     f"{charges.recipe_s * 1e6:.1f} us, swap {charges.swap_s * 1e6:.1f} us + "
                     f"{charges.swap_byte_s * 2**20 * 1e3:.3f} ms/MiB, recompute x{charges.recompute_scale:.2f}"
                     + (f" (module replays x{charges.region_scale:.2f})" if charges.region_scale is not None else "")
                     + ", "
                     f"{charges.runtime_step_s * 1e3:.2f} ms a step")
    lines += [
        "  actions:",
    ]
    rebuilt = plan.rebuilt_count()
    for a in ACTIONS:
        extra = f"  ({rebuilt} rebuilt with another's recipe)" if a == ACTION_RECOMPUTE and rebuilt else ""
        lines.append(f"    {a:<10} {counts[a]:>6} tensors  {format_bytes(nbytes[a]):>12}{extra}")
    gap = "n/a" if s.gap is None else f"{100 * s.gap:.2f}%"
    lines += [
        f"  solver            {s.name}, {s.status}, gap {gap}, {s.solve_time_s:.2f} s"
        + (f" (limit {s.time_limit_s:g} s)" if s.time_limit_s else ""),
        f"  host pool         {format_bytes(plan.host_pool_bytes)} (pinned on CUDA)"
        + (f" of a host memory cap of {format_bytes(plan.host_memory_cap_bytes)}"
           if plan.host_memory_cap_bytes is not None else "")
        + f"; copy bandwidth d2h {plan.d2h_bytes_per_s / BYTES_PER_GB:.2f} GB/s, "
        f"h2d {plan.h2d_bytes_per_s / BYTES_PER_GB:.2f} GB/s",
        f"  host link         {_link_line(plan)}",
        f"  recipes           {len(plan.recipe_ops)} distinct ops replayed"
        + (f" ({sum(1 for r in plan.recipe_ops if r.is_random)} random)" if plan.recipe_ops else ""),
    ]
    if plan.gradients_held_bytes:
        lines.append(f"  gradients held    {format_bytes(plan.gradients_held_bytes)} from step to step, counted for "
                     f"the whole step (--gradients-held)")
    if plan.tracking_starts:
        lines.append(f"  tracking windows  {len(plan.tracking_starts)}, opened at "
                     + ", ".join(_call_name(s.module, s.call) for s in plan.tracking_starts[:MAX_LISTED_WINDOWS])
                     + (", ..." if len(plan.tracking_starts) > MAX_LISTED_WINDOWS else ""))
    return "\n".join(lines)


def _call_name(module: str, call: int) -> str:
    """`blocks.0.attn` (its first call), `blocks.0.attn#2` (its third), `the step's start` (the root)."""
    if not module:
        return "the step's start"
    return module if call == 0 else f"{module}#{call}"


def _link_line(plan: Plan) -> str:
    link = plan.link
    if link is None:
        return "not recorded"
    source = {"link-ratio": "from --link-ratio", "bandwidth": "from --bandwidth",
              "profile": "the profile's bandwidth"}.get(link.source, link.source)
    return (f"link ratio {link.link_ratio:.3g} ({source}): copying all {format_bytes(link.candidate_bytes)} of saved "
            f"tensors one way takes {link.link_ratio:.3g}x the unplanned step time")


def plan_summary_json(plan: Plan) -> dict:
    return {
        "format": plan.format,
        "workload": plan.workload,
        "strategy": plan.strategy,
        "memory_cap_bytes": plan.memory_cap_bytes,
        "predicted_peak_bytes": plan.predicted.peak_bytes,
        "predicted_step_time_s": plan.predicted.step_time_s,
        "simulated_peak_bytes": plan.simulated.peak_bytes,
        "simulated_step_time_s": plan.simulated.step_time_s,
        "baseline_peak_bytes": plan.baseline.peak_bytes,
        "baseline_step_time_s": plan.baseline.step_time_s,
        "time_unit": plan.workload.get("time_unit", "s"),
        "solver": plan.solver.name,
        "status": plan.solver.status,
        "solve_time_s": plan.solver.solve_time_s,
        "gap": plan.solver.gap,
        "actions": plan.action_counts(),
        "action_bytes": plan.action_bytes(),
        "rebuilt_with_another": plan.rebuilt_count(),
        "host_pool_bytes": plan.host_pool_bytes,
        "host_memory_cap_bytes": plan.host_memory_cap_bytes,
        "gradients_held_bytes": plan.gradients_held_bytes,
        "link": None if plan.link is None else {"source": plan.link.source, "link_ratio": plan.link.link_ratio,
                                                "candidate_bytes": plan.link.candidate_bytes},
        "tracking_starts": [{"module": s.module, "call": s.call, "first_op": s.first_op} for s in plan.tracking_starts],
    }


def plot_timeline(plan: Plan, png_path) -> None:
    """Unplanned and planned memory after each op, against the cap (matplotlib, Agg backend)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise RegenError("--plot needs matplotlib: pip install 'regen[plot]'") from None
    if not plan.baseline_timeline_bytes:
        raise RegenError("this plan has no memory timelines to plot")
    fig, ax = plt.subplots(figsize=PLOT_SIZE_IN)
    xs = range(len(plan.baseline_timeline_bytes))
    ax.plot(xs, [b / BYTES_PER_GIB for b in plan.baseline_timeline_bytes], label="unplanned", color="tab:gray")
    if plan.planned_timeline_bytes:
        ax.plot(range(len(plan.planned_timeline_bytes)), [b / BYTES_PER_GIB for b in plan.planned_timeline_bytes],
                label=f"planned ({plan.strategy})", color="tab:blue")
    ax.axhline(plan.memory_cap_bytes / BYTES_PER_GIB, color="tab:red", linestyle="--", label="cap")
    ax.axvline(plan.num_forward_ops - 0.5, color="black", linewidth=0.5, alpha=0.5)
    ax.set_xlabel("op (forward | backward)")
    ax.set_ylabel("device memory (GiB)")
    ax.set_title(f"{plan.workload.get('name', '')}: memory after each op")
    ax.legend(loc="upper left")
    fig.tight_layout()
    fig.savefig(png_path, dpi=PLOT_DPI)
    plt.close(fig)
