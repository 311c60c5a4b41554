"""What the runtime costs: a keep-all plan against plain eager, and regen's plans against per-block
`torch.utils.checkpoint` and Hugging Face `gradient_checkpointing_enable()` at matched memory.

* Overhead: the keep-all plan changes nothing but runs all of regen's machinery (the dispatch mode that
  numbers forward ops, the writer map, the pack/unpack hooks, the first step's fingerprint). Eager and
  keep-all steps are interleaved (A B A B ...) and the ratio of their medians is reported: this
  machine is shared and noisy, so only ratios measured side by side mean anything. Target: <= 3%.
* Matched memory: per-block checkpoint (and HF's own, for GPT-2) is measured first; regen's recompute
  and hybrid plans are then solved with the cap set to that measured peak and measured the same way.
  Peak memory is the allocator's (regen.measure; torch.profiler's timeline on CPU, the host pool of
  swapped tensors counted apart), as the increase over the step's start, gradients allocated inside
  the step.

    .venv/bin/python bench/runtime_overhead.py [--models gpt hf-gpt2] [--steps 20] [--device cpu] [--overhead-only] [--threads N]
"""

from __future__ import annotations

import argparse
import copy
import statistics
import sys
import time

import torch
from torch.utils.checkpoint import checkpoint

import regen
from regen.errors import InfeasibleCapError
from regen.heap import keep_freed_host_memory
from regen.measure import measure_memory
from regen.models import repeated_blocks
from regen.workloads import build_workload, forward_loss

WARMUP_STEPS = 3
# (strategy, cap as a fraction of the unplanned peak increase). On CPU profiles swap is cheap, so hybrid
# plans tend to be swap-only too; the recompute plan shows the (minimal) dispatch-mode path.
OVERHEAD_STRATEGIES = (("swap", 0.5), ("hybrid", 0.25), ("recompute", 0.5))


def _sync(device):
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def _step(w):
    w.model.zero_grad(set_to_none=True)
    forward_loss(w).backward()


def _timed(w, device) -> float:
    _sync(device)
    t0 = time.perf_counter()
    _step(w)
    _sync(device)
    return time.perf_counter() - t0


def _peak(w, device) -> int:
    w.model.zero_grad(set_to_none=True)
    return measure_memory(lambda: forward_loss(w).backward(), device, collect_garbage=True).peak_increase_bytes


class _PerBlockCheckpoint:
    """Wrap each repeated block's forward in torch.utils.checkpoint (non-reentrant) while active."""

    def __init__(self, model):
        self.blocks = repeated_blocks(model)

    def __enter__(self):
        for b in self.blocks:
            fwd = b.forward
            b.forward = (lambda f: lambda *a, **k: checkpoint(f, *a, use_reentrant=False, **k))(fwd)
            b._regen_bench_forward = fwd
        return self

    def __exit__(self, *exc):
        for b in self.blocks:
            b.forward = b._regen_bench_forward
            del b._regen_bench_forward


def overhead(w, plan, steps, device):
    """Eager steps on the model and planned steps on an identical copy under one long-lived handle,
    interleaved (the order alternating: A B, B A, ...) so both see the same machine load. Returns the
    medians of each and the median of the per-pair ratios planned/eager (the figure reported)."""
    twin = copy.copy(w)
    twin.model = copy.deepcopy(w.model)
    eager, planned = [], []
    with regen.apply(twin.model, plan):
        for i in range(steps + WARMUP_STEPS):
            if i % 2:
                tp, te = _timed(twin, device), _timed(w, device)
            else:
                te, tp = _timed(w, device), _timed(twin, device)
            if i >= WARMUP_STEPS:
                eager.append(te)
                planned.append(tp)
    ratio = statistics.median(p / e for p, e in zip(planned, eager))
    return statistics.median(eager), statistics.median(planned), ratio


def _solve_at(profile, strategy, cap_bytes):
    from regen.planner import solve

    # the CPU profile's memcpy "link", given explicitly: this measures the runtime's own cost of swaps
    memcpy_gb_s = profile.device.d2h_bytes_per_s / 1e9
    try:
        return solve(profile, memory_cap_bytes=cap_bytes, strategy=strategy, time_limit_s=30,
                     bandwidth_gb_s=memcpy_gb_s)
    except InfeasibleCapError as exc:
        if exc.smallest_feasible_cap_bytes is None:
            raise
        return solve(profile, memory_cap_bytes=exc.smallest_feasible_cap_bytes, strategy=strategy, time_limit_s=30,
                     bandwidth_gb_s=memcpy_gb_s)


def overhead_rows(w, profile, steps, device, out):
    """Overhead of the keep-all plan (pure machinery), and of swap-only, hybrid and recompute plans
    (machinery plus the copies and recomputes they choose; on CPU the copies are synchronous). Plans
    without recompute run the pack-order fast path after their first step; recompute plans match by pack
    order too but keep a minimal dispatch mode (counting ops, capturing recipe ops)."""
    from regen.planner import solve

    plans = [("keep-all", solve(profile, memory_cap_bytes=profile.peak_bytes, strategy="keep-all", time_limit_s=10))]
    start = profile.memory_at_start_bytes
    for strategy, fraction in OVERHEAD_STRATEGIES:
        plans.append((strategy, _solve_at(profile, strategy, start + int((profile.peak_bytes - start) * fraction))))
    for label, plan in plans:
        actions = {}
        for d in plan.decisions:
            actions[d.action] = actions.get(d.action, 0) + 1
        e, k, ratio = overhead(w, plan, steps, device)
        out(f"  {label:9s} plan: eager {e * 1e3:8.2f} ms, planned {k * 1e3:8.2f} ms (medians), overhead "
            f"{(ratio - 1) * 100:+6.1f}% (median of paired ratios)  decisions {dict(sorted(actions.items()))}")


def run(name, steps, device, out, overhead_only=False):
    from regen.planner import solve
    from regen.profiler import profile_workload
    from regen.runtime.self_timing import measure_runtime_costs

    w = build_workload(name, device=device)
    profile = profile_workload(w, device=device, repeats=1, warmup_steps=1, progress=None,
                               runtime_probe=measure_runtime_costs)
    out(f"{name}: {len(profile.ops)} ops, {profile.num_forward_ops} forward, "
        f"{len(profile.saved_entries)} saved entries; overhead vs eager, interleaved, median of {steps} steps:")
    overhead_rows(w, profile, steps, device, out)
    if overhead_only:
        return

    def median_time(ctx_factory):
        ts = []
        for i in range(steps + WARMUP_STEPS):
            with ctx_factory():
                t = _timed(w, device)
            if i >= WARMUP_STEPS:
                ts.append(t)
        return statistics.median(ts)

    class _Nothing:
        def __enter__(self):
            return self

        def __exit__(self, *exc):
            return False

    rows = [("no plan", _peak(w, device), median_time(_Nothing))]
    with _PerBlockCheckpoint(w.model):
        ckpt_peak = _peak(w, device)
    rows.append(("per-block checkpoint", ckpt_peak, median_time(lambda: _PerBlockCheckpoint(w.model))))
    if hasattr(w.model, "gradient_checkpointing_enable"):
        w.model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        try:
            rows.append(("HF gradient_checkpointing", _peak(w, device), median_time(_Nothing)))
        finally:
            w.model.gradient_checkpointing_disable()
    start = profile.memory_at_start_bytes
    for strategy in ("recompute", "hybrid", "swap"):
        cap = start + ckpt_peak
        try:
            plan = solve(profile, memory_cap_bytes=cap, strategy=strategy, time_limit_s=30)
        except InfeasibleCapError as exc:
            if exc.smallest_feasible_cap_bytes is None:
                raise
            plan = solve(profile, memory_cap_bytes=exc.smallest_feasible_cap_bytes, strategy=strategy,
                         time_limit_s=30)
        with regen.apply(w.model, plan) as h:
            _step(w)
            peak = _peak(w, device)
            t = median_time(_Nothing)
        rows.append((f"regen {strategy} (cap {(plan.memory_cap_bytes - start) / 2**20:.2f} MiB, "
                     f"pool {h.pool.capacity_bytes / 2**20:.2f} MiB apart)", peak, t))
    base_peak, base_t = rows[0][1], rows[0][2]
    for label, peak, t in rows:
        out(f"  {label:58s} peak +{peak / 2**20:7.2f} MiB ({peak / base_peak:5.2f}x)  "
            f"step {t * 1e3:8.2f} ms ({t / base_t:5.2f}x)")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--models", nargs="+", default=["gpt", "hf-gpt2"])
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--device", default="cpu")
    p.add_argument("--overhead-only", action="store_true", help="skip the matched-memory comparison")
    p.add_argument("--threads", type=int, default=0, help="torch.set_num_threads (0: torch's default)")
    args = p.parse_args(argv)
    keep_freed_host_memory()  # every variant's step meets the heap alike (regen.heap)
    if args.threads:
        torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    for name in args.models:
        run(name, args.steps, args.device, print, overhead_only=args.overhead_only)
    return 0


if __name__ == "__main__":
    sys.exit(main())
