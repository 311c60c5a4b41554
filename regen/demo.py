"""`regen demo` (what `make demo` runs): the main job end to end on a built-in GPT.

1. profile one training step of a small GPT on the CPU;
2. solve a hybrid plan at 50% of the unplanned peak (on a CPU device, which has no host link, the
   planner makes it recompute only and says so: regen.planner.host_link);
3. train a few steps without the plan and with it (same initial weights, same RNG seed), measuring
   peak memory with the allocator (regen.measure) and step time;
4. print a table: measured peak (unplanned, cap, planned), step time (unplanned, planned, predicted),
   whether gradients matched, and where the profile, the plan and a memory-timeline PNG went.

Sized to take about half a minute to a minute on 2 CPU cores (a 6-layer GPT, ~700 MiB unplanned peak).
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch

DEMO_WORKLOAD = {  # the same as configs/gpt-demo.yaml (a test keeps them equal)
    "workload": "gpt",
    "batch_size": 8,
    "args": {"vocab_size": 4096, "context": 256, "d_model": 256, "n_layer": 6, "n_head": 8, "dropout": 0.1},
}
DEMO_CAP_FRACTION = 0.5
DEMO_TRAIN_STEPS = 4
DEMO_PROFILE_REPEATS = 3
DEMO_TIME_LIMIT_S = 30.0
DEMO_SEED = 1234
LEARNING_RATE = 1e-3
CAP_TOLERANCE = 1.05  # a measured planned peak up to 5% over the cap still counts as within it


def _timed_step(workload, optimizer, seed: int) -> float:
    """One training step; returns the forward+backward time (what the profile and plan predict)."""
    from regen.workloads import training_step

    torch.manual_seed(seed)
    start = time.perf_counter()
    training_step(workload)
    elapsed = time.perf_counter() - start
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return elapsed


def _grads_after_one_step(workload, seed: int) -> tuple[torch.Tensor, list[torch.Tensor]]:
    from regen.workloads import training_step

    torch.manual_seed(seed)
    loss = training_step(workload)
    grads = [p.grad.detach().clone() for p in workload.model.parameters() if p.grad is not None]
    workload.model.zero_grad(set_to_none=True)
    return loss, grads


@dataclass
class DemoRun:
    """What the demo measured, for its closing table."""

    grads_equal: bool
    max_grad_diff: float
    unplanned_time_s: float
    planned_time_s: float
    unplanned_peak_increase_bytes: int
    planned_peak_increase_bytes: int


def run_demo(output_dir: str | Path = "demo-output", config: str | None = None,
             progress: Callable[[str], None] = print) -> int:
    from regen.workloads import build_workload, load_config

    out = Path(output_dir)
    out.mkdir(parents=True, exist_ok=True)
    spec = load_config(config) if config else DEMO_WORKLOAD
    torch.set_num_threads(max(1, min(torch.get_num_threads(), 2)))
    t0 = time.perf_counter()

    def build():
        return build_workload(spec["workload"], batch_size=spec.get("batch_size"), args=spec.get("args"))

    progress(f"[1/4] profiling one step of {spec['workload']} {spec.get('args', {})} batch {spec.get('batch_size')}")
    profile, profile_path = _profile(build(), out, progress)
    plan, plan_path, png_path = _solve(profile, profile_path, out, progress)
    run = _train_side_by_side(build, plan, progress)
    cap_bytes = plan.memory_cap_bytes
    peak_planned = profile.memory_at_start_bytes + run.planned_peak_increase_bytes
    within_cap = peak_planned <= cap_bytes * CAP_TOLERANCE
    files = [("profile", str(profile_path)), ("plan", str(plan_path)),
             ("memory timeline", str(png_path) if png_path else "(not drawn)")]
    _print_table(spec, profile, plan, run, within_cap, files, time.perf_counter() - t0)
    return 0 if run.grads_equal and within_cap else 1


def _profile(workload, out: Path, progress):
    from regen.formats import save_profile
    from regen.profiler import profile_workload
    from regen.runtime.self_timing import measure_runtime_costs

    profile = profile_workload(workload, device="cpu", repeats=DEMO_PROFILE_REPEATS, warmup_steps=1,
                               progress=progress, runtime_probe=measure_runtime_costs)
    profile_path = out / "demo.profile.yaml"
    save_profile(profile, profile_path)
    return profile, profile_path


def _solve(profile, profile_path: Path, out: Path, progress):
    """The hybrid plan at DEMO_CAP_FRACTION of the peak (or the smallest feasible cap), saved and plotted."""
    from regen.errors import InfeasibleCapError
    from regen.formats import save_plan
    from regen.planner import SolveOptions, solve
    from regen.show import plot_timeline
    from regen.units import format_bytes

    cap_bytes = int(profile.peak_bytes * DEMO_CAP_FRACTION)
    progress(f"[2/4] solving at {DEMO_CAP_FRACTION:.0%} of the unplanned peak ({format_bytes(cap_bytes)})")
    options = SolveOptions(strategy="hybrid", time_limit_s=DEMO_TIME_LIMIT_S, profile_path=str(profile_path))
    try:
        plan = solve(profile, cap_bytes, options, progress=progress)
    except InfeasibleCapError as exc:  # a --config whose static memory is over half the peak
        if exc.smallest_feasible_cap_bytes is None:
            raise
        cap_bytes = exc.smallest_feasible_cap_bytes
        progress(f"      50% is out of reach for this workload; using the smallest feasible cap, "
                 f"{format_bytes(cap_bytes)} ({cap_bytes / profile.peak_bytes:.0%})")
        plan = solve(profile, cap_bytes, options, progress=progress)
    plan_path = out / "demo.plan.yaml"
    save_plan(plan, plan_path)
    png_path = out / "demo.timeline.png"
    try:
        plot_timeline(plan, png_path)
    except Exception as exc:  # the plot is a convenience; say why it is missing
        progress(f"      (no timeline plot: {exc})")
        png_path = None
    return plan, plan_path, png_path


def _train_side_by_side(build, plan, progress) -> DemoRun:
    """Gradients of one step with and without the plan (same weights and RNG seed), then steps of both
    interleaved (so machine noise hits both alike), then each step's peak from the allocator."""
    from regen.measure import measure_memory
    from regen.runtime import apply
    from regen.workloads import training_step

    progress("[3/4] checking gradients against the unplanned step")
    plain = build()
    planned = build()
    planned.model.load_state_dict(plain.model.state_dict())
    handle = apply(planned.model, plan, on_mismatch="raise")  # the plan itself, never a dynamic step
    try:
        loss_plain, grads_plain = _grads_after_one_step(plain, DEMO_SEED)
        loss_planned, grads_planned = _grads_after_one_step(planned, DEMO_SEED)
        grads_equal = bool(torch.equal(loss_plain, loss_planned)) and all(
            torch.equal(a, b) for a, b in zip(grads_plain, grads_planned))
        max_diff = max((float((a - b).abs().max()) for a, b in zip(grads_plain, grads_planned)), default=0.0)
        progress(f"[4/4] training {DEMO_TRAIN_STEPS} steps without and with the plan, interleaved")
        optimizers = {id(w): torch.optim.AdamW(w.model.parameters(), lr=LEARNING_RATE) for w in (plain, planned)}
        times = {"unplanned": [], "planned": []}
        for i in range(DEMO_TRAIN_STEPS):
            times["unplanned"].append(_timed_step(plain, optimizers[id(plain)], DEMO_SEED + i))
            times["planned"].append(_timed_step(planned, optimizers[id(planned)], DEMO_SEED + i))
        # peaks from the allocator (the host pool, allocated by apply(), is counted apart)
        mem = {label: measure_memory(lambda w=w: training_step(w)) for label, w in
               (("unplanned", plain), ("planned", planned))}
    finally:
        handle.remove()
    return DemoRun(grads_equal=grads_equal, max_grad_diff=max_diff,
                   unplanned_time_s=statistics.median(times["unplanned"][1:] or times["unplanned"]),
                   planned_time_s=statistics.median(times["planned"][1:] or times["planned"]),
                   unplanned_peak_increase_bytes=mem["unplanned"].peak_increase_bytes,
                   planned_peak_increase_bytes=mem["planned"].peak_increase_bytes)


def _print_table(spec, profile, plan, run: DemoRun, within_cap: bool, files, elapsed_s: float) -> None:
    from regen.units import format_bytes

    # The allocator timeline sees what the step allocates; put both on the profile's absolute scale.
    start = profile.memory_at_start_bytes
    cap_bytes = plan.memory_cap_bytes
    base_time, plan_time = run.unplanned_time_s, run.planned_time_s
    counts = plan.action_counts()
    rows = [
        ("peak memory, unplanned (measured)", format_bytes(start + run.unplanned_peak_increase_bytes)),
        (f"memory cap ({cap_bytes / profile.peak_bytes:.0%} of profiled peak)", format_bytes(cap_bytes)),
        ("peak memory, planned (measured)", f"{format_bytes(start + run.planned_peak_increase_bytes)}  "
                                            f"({'within' if within_cap else 'OVER'} the cap; "
                                            f"simulator said {format_bytes(plan.simulated.peak_bytes)})"),
        ("step time, unplanned (measured)", f"{base_time * 1e3:.1f} ms"),
        ("step time, planned (measured)", f"{plan_time * 1e3:.1f} ms = {plan_time / base_time:.2f}x of unplanned"),
        ("step time, planned (predicted)", f"{plan.simulated.step_time_s / plan.baseline.step_time_s:.2f}x of "
                                           f"unplanned (the plan's {plan.simulated.step_time_s * 1e3:.1f} ms over "
                                           f"the profile's {plan.baseline.step_time_s * 1e3:.1f} ms)"),
        ("decisions", f"keep {counts['keep']}, swap {counts['swap']}, recompute {counts['recompute']}"),
        ("swaps on this CPU", "copied to a host buffer in the same RAM at memcpy speed, counted apart from "
                              "device memory: not what a GPU's host link costs" if counts["swap"] else
                              "none: without a host link a CPU profile is planned with recompute only"),
        ("gradients match unplanned", "yes (bitwise)" if run.grads_equal
         else f"NO (max |diff| {run.max_grad_diff:.3g})"),
    ] + files
    width = max(len(k) for k, _ in rows)
    print()
    print(f"regen demo: {spec['workload']} on CPU, {elapsed_s:.0f} s end to end")
    for key, value in rows:
        print(f"  {key:<{width}}  {value}")
