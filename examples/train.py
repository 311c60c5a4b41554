"""Train a workload for N steps under a regen plan, printing measured peak memory and step time.

    python examples/train.py --plan run.plan.yaml --model gpt --steps 20
    python examples/train.py --plan run.plan.yaml --config configs/gpt-small.yaml --device cuda

The only regen-specific line of the loop is `with regen.apply(model, plan):`. Peak memory is what the
allocator saw (regen.measure: torch.cuda.max_memory_allocated on CUDA, torch.profiler's allocator
timeline on CPU) for one measured step after the timed ones; the host pool of swapped tensors is not in
that figure and is printed apart. Without --plan the same loop runs unplanned, for comparison.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch

import regen
from regen.errors import RegenError
from regen.measure import measure_memory
from regen.workloads import build_workload, forward_loss, load_config

WARMUP_STEPS = 2


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def train(workload, plan, steps: int, device: str, lr: float) -> dict:
    model = workload.model
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr)

    def train_step():
        loss = forward_loss(workload)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return loss.detach()

    times_s, losses = [], []
    handle = regen.apply(model, plan) if plan is not None else None
    try:
        for i in range(WARMUP_STEPS + steps):
            _sync(device)
            t0 = time.perf_counter()
            losses.append(float(train_step()))
            _sync(device)
            if i >= WARMUP_STEPS:
                times_s.append(time.perf_counter() - t0)
        memory = measure_memory(train_step, device)
    finally:
        if handle is not None:
            handle.remove()
    return {"median_step_s": statistics.median(times_s), "peak_bytes": memory.peak_bytes,
            "peak_increase_bytes": memory.peak_increase_bytes, "first_loss": losses[0], "last_loss": losses[-1],
            "host_pool_bytes": handle.pool.capacity_bytes if handle else 0,
            "stats": handle.stats if handle else None}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--plan", help="a plan file from `regen solve` (omit to train unplanned)")
    p.add_argument("--model", help="built-in workload or module:function (default: the plan's workload)")
    p.add_argument("--config", help="a workload config (configs/*.yaml)")
    p.add_argument("--batch-size", type=int)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--device", default="cpu")
    p.add_argument("--lr", type=float, default=1e-3)
    args = p.parse_args(argv)
    try:
        plan = regen.load_plan(args.plan) if args.plan else None
        spec, wargs, batch_size = args.model, {}, args.batch_size
        if args.config:
            config = load_config(args.config)
            spec, wargs = spec or config["workload"], config["args"]
            batch_size = batch_size if batch_size is not None else config["batch_size"]
        if spec is None and plan is not None:
            spec = plan.workload.get("name")
            wargs = wargs or dict(plan.workload.get("args") or {})
            batch_size = batch_size if batch_size is not None else plan.workload.get("batch_size")
        if not spec:
            raise RegenError("give a workload: --model, --config, or a --plan that names one")
        if args.device.startswith("cuda") and not torch.cuda.is_available():
            raise RegenError(f"--device {args.device}: no CUDA device here")
        workload = build_workload(spec, batch_size=batch_size, args=wargs, device=args.device)
        r = train(workload, plan, args.steps, args.device, args.lr)
    except RegenError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return exc.exit_code
    where = "allocator, CUDA" if args.device.startswith("cuda") else "torch.profiler allocator timeline, CPU"
    print(f"workload {spec} on {args.device}, {args.steps} steps, plan: {args.plan or 'none (unplanned)'}")
    if plan is not None:
        print(f"  plan: {plan.strategy}, cap {plan.memory_cap_bytes / 2**20:.2f} MiB, simulated peak "
              f"{plan.simulated.peak_bytes / 2**20:.2f} MiB, {plan.action_counts()}")
    print(f"  loss {r['first_loss']:.4f} -> {r['last_loss']:.4f}")
    if args.device.startswith("cuda"):
        print(f"  measured peak {r['peak_bytes'] / 2**20:.2f} MiB ({where}); host pool (pinned, apart) "
              f"{r['host_pool_bytes'] / 2**20:.2f} MiB")
    else:  # the CPU timeline's absolute level depends on what it saw; its increase over the start does not
        print(f"  measured peak increase over the step's start {r['peak_increase_bytes'] / 2**20:.2f} MiB ({where}); "
              f"host pool (apart) {r['host_pool_bytes'] / 2**20:.2f} MiB")
    if plan is not None and plan.memory_at_start_bytes:
        # CUDA's counter is absolute; torch.profiler's CPU timeline sees only the step's own allocations,
        # so put it on the cap's scale with the profile's memory at the start of the step
        peak = r["peak_bytes"] if args.device.startswith("cuda") else plan.memory_at_start_bytes + r["peak_increase_bytes"]
        verdict = "within" if peak <= plan.memory_cap_bytes else "OVER"
        print(f"  peak on the plan's scale {peak / 2**20:.2f} MiB: {verdict} the cap of "
              f"{plan.memory_cap_bytes / 2**20:.2f} MiB (simulator: {plan.simulated.peak_bytes / 2**20:.2f} MiB)")
    print(f"  median step time {r['median_step_s'] * 1e3:.2f} ms")
    if r["stats"] is not None:
        print(f"  runtime: {r['stats']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
