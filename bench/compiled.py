"""Compiled training under a memory budget: regen's plan on a torch.compile'd model against torch.compile's own
`activation_memory_budget`, at the peak the budget measures.

Rows, each a fresh copy of one workload (default: the zoo's Llama at bench size, defaults as shipped),
compiled with Inductor:

* `compiled`: no plan, no budget (the reference for gradients and time);
* `budget B`: compiled with `torch._functorch.config.activation_memory_budget = B` (a knapsack over
  recompute, run at the partition), for each B of --budgets;
* `regen S @ budget B's peak`: a plan of each strategy S of --strategies (recompute; hybrid, whose swaps the
  compiler offloads on CUDA) solved (from one eager profile) at the peak the `budget B` row measured, applied
  with `regen.apply(compiled, plan)` (regen.runtime.compiled);
* with `--regen-cap F`: `regen recompute @ F x eager`, a plan at F x the eager peak increase, and `budget b @
  regen's peak`, the largest budget (bisection, --search-steps compiles) whose peak is at most that plan's.

Peaks are the allocator's (regen.measure: torch.profiler's timeline on CPU, `max_memory_allocated` on CUDA),
as increases over the step's start; step times are medians of --steps rounds in which every row runs one
step in turn (interleaved). Gradients are compared with the `compiled` row's (largest absolute difference:
compiled recomputation rounds differently from the forward it repeats). Beside each plan, its predicted step
time, which the eager profile gives (the unplanned eager step is printed too): the difference from the compiled
step is what a compiled profile would have to predict. Time on a quiet machine only.

    .venv/bin/python bench/compiled.py [--model regen.zoo:llama] [--size bench] [--batch 4] [--budgets 0.5 0.3]
        [--strategies recompute hybrid] [--regen-cap 0.5] [--device cuda]
    .venv/bin/python bench/compare.py --compile ...   # the same
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import sys
import time
import warnings
from dataclasses import dataclass, field

import torch
import torch._functorch.config

import regen
from regen.heap import keep_freed_host_memory
from regen.measure import measure_memory
from regen.runtime.compiled import forward_of_its_own
from regen.workloads import build_workload, move_batch, training_step


@dataclass
class Row:
    name: str
    workload: object
    context: object = contextlib.nullcontext  # entered around each of its steps
    cap_increase_bytes: int | None = None
    eager_prediction_s: float | None = None  # the plan's predicted step time (from the eager profile)
    peak_increase_bytes: int = 0
    times_s: list[float] = field(default_factory=list)
    grads: dict = field(default_factory=dict)


def _build(args):
    w = _eager(args)
    w.model.forward = forward_of_its_own(w.model)  # each row compiles its own code, under its own budget
    w.model = torch.compile(w.model)
    return w


def _eager(args):
    w = build_workload(args.model, batch_size=args.batch, args={"size": args.size} if args.size else None)
    w.model.to(args.device)
    w.batch = move_batch(w.batch, args.device)
    return w


def _step(row: Row) -> float:
    row.workload.model.zero_grad(set_to_none=True)
    with row.context():
        _synchronize()
        t0 = time.perf_counter()
        training_step(row.workload)
        _synchronize()
        return time.perf_counter() - t0


def _synchronize() -> None:
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.synchronize()


def _measure(row: Row, device: str) -> None:
    _step(row)  # compiles (again, after a handle's reset)
    row.workload.model.zero_grad(set_to_none=True)
    torch.manual_seed(0)  # every row's measured step draws the same dropout masks: gradients compare
    with row.context():
        m = measure_memory(lambda: training_step(row.workload), device=device, collect_garbage=True)
    row.peak_increase_bytes = m.peak_increase_bytes
    row.grads = {n: p.grad.clone() for n, p in row.workload.model.named_parameters() if p.grad is not None}


def _budget(b: float):
    return lambda: torch._functorch.config.patch(activation_memory_budget=b)


def _plan_row(name: str, args, profile, cap: int, strategy: str, handles: list) -> Row:
    """A row of the workload compiled under a `strategy` plan solved at `cap` (absolute bytes)."""
    from regen.planner.solve import solve_within_reach

    plan = solve_within_reach(profile, cap, strategy, time_limit_s=args.solve_time_limit)
    row = Row(name, _build(args), cap_increase_bytes=plan.memory_cap_bytes - profile.memory_at_start_bytes,
              eager_prediction_s=plan.simulated.step_time_s)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the cache notice; what cannot be placed is printed below
        handles.append(regen.apply(row.workload.model, plan))
    return row


def _budget_at(args, device: str, peak_increase_bytes: int) -> Row:
    """The largest activation_memory_budget (bisection, --search-steps compiles) whose measured peak is at most
    `peak_increase_bytes`; the smallest peak found when none is."""
    low, high, best, smallest = 0.0, 1.0, None, None
    for _ in range(args.search_steps):
        b = round((low + high) / 2, 4)
        row = Row(f"budget {b} @ regen's peak", _build(args), _budget(b))
        _measure(row, device)
        if smallest is None or row.peak_increase_bytes < smallest.peak_increase_bytes:
            smallest = row
        if row.peak_increase_bytes <= peak_increase_bytes:
            best, low = row, b
        else:
            high = b
    return best or smallest


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="regen.zoo:llama")
    parser.add_argument("--size", default="bench", help="the zoo's size argument ('' for a workload without one)")
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--budgets", type=float, nargs="+", default=[0.5, 0.3])
    parser.add_argument("--strategies", nargs="+", default=["recompute"], choices=["recompute", "hybrid"],
                        help="regen's plans at each budget's peak (hybrid: swaps offloaded by the compiler on CUDA; "
                             "recomputed elsewhere)")
    parser.add_argument("--regen-cap", type=float, default=None, metavar="F",
                        help="also a recompute plan at F x the eager peak increase, and the budget that measures "
                             "its peak (bisection)")
    parser.add_argument("--search-steps", type=int, default=4, help="compiles the budget search may take")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--solve-time-limit", type=float, default=30.0)
    parser.add_argument("--device", default="cpu", help="cpu or cuda")
    args = parser.parse_args(argv)
    keep_freed_host_memory()  # every variant's step meets the heap alike (regen.heap)
    if any(not 0 < b <= 1 for b in args.budgets):
        parser.error("--budgets are fractions in (0, 1]")
    if args.regen_cap is not None and not 0 < args.regen_cap < 1:
        parser.error("--regen-cap is a fraction in (0, 1)")
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        parser.error("--device cuda: no CUDA device here")
    from regen.profiler import profile_workload

    # every row is an instance of one class compiled with its own code (forward_of_its_own): past torch.compile's
    # recompile limit (8) a later row would run eagerly
    torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 64)
    device = args.device
    eager = _eager(args)
    print(f"profiling {args.model} (size {args.size or '-'}, batch {args.batch}) eagerly ...", flush=True)
    profile = profile_workload(eager, device=device, repeats=3, warmup_steps=1, progress=None)
    start = profile.memory_at_start_bytes
    rows = [Row("compiled", _build(args))] + [Row(f"budget {b}", _build(args), _budget(b)) for b in args.budgets]
    for row in rows:
        _measure(row, device)
    handles: list = []
    for b, budget_row in zip(args.budgets, rows[1:len(args.budgets) + 1]):
        for strategy in args.strategies:
            rows.append(_plan_row(f"regen {strategy} @ budget {b}'s peak", args, profile,
                                  start + budget_row.peak_increase_bytes, strategy, handles))
    if args.regen_cap is not None:
        cap = start + int((profile.peak_bytes - start) * args.regen_cap)
        rows.append(_plan_row(f"regen recompute @ {args.regen_cap:g} x eager", args, profile, cap, "recompute",
                              handles))
    for row in rows:  # every row compiles again after the handles' resets; peaks measured then
        _measure(row, device)
    if args.regen_cap is not None:
        print("searching the budget that measures regen's peak ...", flush=True)
        rows.append(_budget_at(args, device, rows[-1].peak_increase_bytes))
    for _ in range(args.steps):
        for row in rows:
            row.times_s.append(_step(row))
    _print(args, profile, rows, handles)
    return 0


def _print(args, profile, rows: list[Row], handles: list) -> None:
    start = profile.memory_at_start_bytes
    reference = rows[0]
    base_s = statistics.median(reference.times_s)
    print(f"\ntorch {torch.__version__}, {args.steps} interleaved rounds, peaks as increases over the step's start")
    print(f"{'row':36s} {'cap MiB':>8s} {'peak MiB':>9s} {'step ms':>8s} {'x compiled':>10s} {'max |grad diff|':>16s} "
          f"{'eager pred ms':>13s}")
    for row in rows:
        diff = max((row.grads[k] - reference.grads[k]).abs().max().item() for k in reference.grads)
        cap = f"{row.cap_increase_bytes / 2**20:8.2f}" if row.cap_increase_bytes is not None else f"{'-':>8s}"
        median_s = statistics.median(row.times_s)
        pred = f"{row.eager_prediction_s * 1e3:13.1f}" if row.eager_prediction_s is not None else f"{'-':>13s}"
        print(f"{row.name:36s} {cap} {row.peak_increase_bytes / 2**20:9.2f} {median_s * 1e3:8.1f} "
              f"{median_s / base_s:10.2f} {diff:16.1e} {pred}")
    print(f"eager: the unplanned step as profiled took {profile.step_time_s * 1e3:.1f} ms; a plan's prediction is for "
          f"eager execution (regen's runtime), not for the compiled step")
    for h in handles:
        unplaced = [d for d in h.placement.unplaced(h.plan.decisions) if d.action != "keep"]
        swaps = sum(d.action == "swap" for d in h.plan.decisions)
        print(f"  plan at {h.plan.memory_cap_bytes - start} B: {len(h.placement.placed)} of {len(h.plan.decisions)} "
              f"decisions placed; {len(unplaced)} drops not placed ({sum(d.bytes for d in unplaced) / 2**20:.2f} MiB); "
              f"{len(h.placement.offloaded)} of {swaps} swaps offloaded")
        for d in sorted(unplaced, key=lambda d: -d.bytes)[:8]:
            print(f"    not placed: {d.action} {d.producer_name} in {d.producer_module!r} (rank {d.producer_rank}), "
                  f"{d.shape} {d.dtype}, {d.bytes / 2**20:.1f} MiB")
        h.remove()


if __name__ == "__main__":
    sys.exit(main())
