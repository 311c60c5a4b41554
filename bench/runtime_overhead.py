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

    .venv/bin/python bench/runtime_overhead.py [--models gpt hf-gpt2] [--steps 20] [--device cpu]
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
from regen.measure import measure_memory
from regen.models import repeated_blocks
from regen.workloads import build_workload, forward_loss

WARMUP_STEPS = 3


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
    return measure_memory(lambda: forward_loss(w).backward(), device).peak_increase_bytes


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
    """Eager steps on the model and keep-all steps on an identical copy under one long-lived handle,
    interleaved; the ratio of medians."""
    twin = copy.copy(w)
    twin.model = copy.deepcopy(w.model)
    eager, planned = [], []
    with regen.apply(twin.model, plan):
        for i in range(steps + WARMUP_STEPS):
            te, tp = _timed(w, device), _timed(twin, device)
            if i >= WARMUP_STEPS:
                eager.append(te)
                planned.append(tp)
    return statistics.median(eager), statistics.median(planned)


def run(name, steps, device, out):
    from regen.planner import solve
    from regen.profiler import profile_workload

    w = build_workload(name, device=device)
    profile = profile_workload(w, device=device, repeats=1, warmup_steps=1, progress=None)
    keep_all = solve(profile, memory_cap_bytes=profile.peak_bytes, strategy="keep-all", time_limit_s=10)
    e, k = overhead(w, keep_all, steps, device)
    out(f"{name}: eager {e * 1e3:.2f} ms, keep-all plan {k * 1e3:.2f} ms, overhead {(k / e - 1) * 100:+.1f}% "
        f"({len(profile.ops)} ops, {profile.num_forward_ops} forward, {len(profile.saved_entries)} saved entries)")

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
    args = p.parse_args(argv)
    torch.manual_seed(0)
    for name in args.models:
        run(name, args.steps, args.device, print)
    return 0


if __name__ == "__main__":
    sys.exit(main())
