"""The GPU check: bench/compare.py's link comparison over a real GPU's host link.

On a CUDA machine, a GPT-2-sized workload is profiled (the profile measures the pinned copy bandwidth:
the plans are solved for that real link, whose link ratio is printed), then trained TRAIN_STEPS steps
each: no plan; per-block checkpointing (Hugging Face's); offload-all (every saved tensor of 1 MiB or
more swapped through regen's runtime, as torchtune's activation offloading); regen's recompute-only,
swap-only and hybrid plans at 50% of the unplanned peak and at each peer's measured peak. Each row
prints torch.cuda.max_memory_allocated next to max_memory_reserved (fragmentation is what makes a GPU
run out of memory), the plan's cap and simulated peak, and the measured step time next to the
predicted one. Exits 0 with a message on a machine without CUDA, 1 if a plan's measured peak is over
its cap + 5%. Run it through bench/gpu_check.sh; it is sized to finish in under 5 minutes.
"""

from __future__ import annotations

import statistics
import sys
import time
from dataclasses import dataclass

import torch

TRAIN_STEPS = 10
WARMUP_STEPS = 3
CAP_FRACTION = 0.5
SOLVE_TIME_LIMIT_S = 15.0
CAP_TOLERANCE = 0.05
STRATEGIES = ("recompute", "swap", "hybrid")
# GPT-2 small's shape (12 layers, 768 wide, 12 heads, 50257 vocabulary) at a batch that fits comfortably
WORKLOAD_ARGS = {"n_layer": 12, "n_embd": 768, "n_head": 12, "vocab_size": 50257, "seq_len": 512, "dropout": 0.1}
BATCH_SIZE = 8
GIB = 2**30


@dataclass
class Row:
    label: str
    allocated_bytes: int
    reserved_bytes: int
    step_time_s: float
    plan: object = None  # regen's Plan, for planned rows
    predicted_step_time_s: float | None = None


def train(w, optimizer, n: int) -> tuple[int, int, float]:
    """(max allocated, max reserved, median step time) over `n` steps after the warm-up."""
    from regen.workloads import forward_loss

    times = []
    for i in range(WARMUP_STEPS + n):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        if i == WARMUP_STEPS:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        start.record()
        forward_loss(w).backward()
        end.record()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        torch.cuda.synchronize()
        if i >= WARMUP_STEPS:
            times.append(start.elapsed_time(end) / 1e3)
    return torch.cuda.max_memory_allocated(), torch.cuda.max_memory_reserved(), statistics.median(times)


def planned_row(label: str, w, optimizer, plan) -> Row:
    import regen

    with regen.apply(w.model, plan) as handle:
        allocated, reserved, t = train(w, optimizer, TRAIN_STEPS)
    print(f"  {label}: {plan.action_counts()}, pinned host pool {handle.pool.capacity_bytes / GIB:.2f} GiB (apart), "
          f"copy-ins at their consumer {handle.stats.synchronous_copy_ins}", flush=True)
    return Row(label, allocated, reserved, t, plan, plan.simulated.step_time_s)


def regen_rows(profile, caps: list[tuple[str, int]], w, optimizer) -> list[Row]:
    """regen's plans at each (name, cap); a strategy that cannot reach a cap runs once at its smallest."""
    from regen.errors import InfeasibleCapError
    from regen.planner import solve

    rows, smallest_done = [], set()
    for cap_name, cap in caps:
        for strategy in STRATEGIES:
            label = f"regen {strategy} @ {cap_name}"
            try:
                plan = solve(profile, memory_cap_bytes=cap, strategy=strategy, time_limit_s=SOLVE_TIME_LIMIT_S)
            except InfeasibleCapError as exc:
                smallest = exc.smallest_feasible_cap_bytes
                print(f"  {label}: out of reach; smallest cap {(smallest or 0) / GIB:.2f} GiB", flush=True)
                if smallest is None or strategy in smallest_done:
                    continue
                smallest_done.add(strategy)
                label = f"regen {strategy} @ its smallest cap"
                plan = solve(profile, memory_cap_bytes=smallest, strategy=strategy, time_limit_s=SOLVE_TIME_LIMIT_S)
            rows.append(planned_row(label, w, optimizer, plan))
    return rows


def print_table(rows: list[Row]) -> bool:
    """The comparison; True when every plan's measured peak is within its cap + 5%."""
    base_t = rows[0].step_time_s
    print(f"\n{'variant':44s} {'alloc GiB':>9s} {'reserv GiB':>10s} {'cap':>6s} {'sim':>6s} {'step ms':>8s} "
          f"{'pred ms':>8s} {'meas/pred':>9s} {'vs eager':>8s}")
    ok = True
    for r in rows:
        plan = r.plan
        cap_s = f"{plan.memory_cap_bytes / GIB:.2f}" if plan else "-"
        sim_s = f"{plan.simulated.peak_bytes / GIB:.2f}" if plan else "-"
        pred = r.predicted_step_time_s
        pred_s, ratio_s = (f"{pred * 1e3:.1f}", f"{r.step_time_s / pred:.2f}") if pred else ("-", "-")
        print(f"{r.label[:44]:44s} {r.allocated_bytes / GIB:9.2f} {r.reserved_bytes / GIB:10.2f} {cap_s:>6s} "
              f"{sim_s:>6s} {r.step_time_s * 1e3:8.1f} {pred_s:>8s} {ratio_s:>9s} {r.step_time_s / base_t:8.2f}")
        if plan is not None and plan.strategy != "offload-all":
            ok = ok and r.allocated_bytes <= plan.memory_cap_bytes * (1 + CAP_TOLERANCE)
    return ok


def main() -> int:
    if not torch.cuda.is_available():
        print(f"gpu_check: no CUDA device here (torch {torch.__version__}, CUDA build: {torch.version.cuda or 'no'}); "
              f"nothing to check")
        return 0
    from regen.models import repeated_blocks
    from regen.planner import solve
    from regen.profiler import profile_workload
    from regen.runtime.costs import measure_runtime_costs
    from regen.workloads import build_workload

    t_start = time.perf_counter()
    w = build_workload("hf-gpt2", batch_size=BATCH_SIZE, args=WORKLOAD_ARGS, device="cuda")
    print(f"gpu_check on {torch.cuda.get_device_name()}: hf-gpt2 {WORKLOAD_ARGS}, batch {BATCH_SIZE}", flush=True)
    profile = profile_workload(w, device="cuda", repeats=3, warmup_steps=1, progress=None,
                               runtime_probe=measure_runtime_costs)
    print(f"profiled in {time.perf_counter() - t_start:.0f} s: {len(profile.ops)} ops, unplanned peak "
          f"{profile.peak_bytes / GIB:.2f} GiB, step {profile.step_time_s * 1e3:.1f} ms, link d2h "
          f"{profile.device.d2h_bytes_per_s / 1e9:.1f} GB/s, h2d {profile.device.h2d_bytes_per_s / 1e9:.1f} GB/s",
          flush=True)
    optimizer = torch.optim.AdamW(w.model.parameters(), lr=1e-4)
    rows = [Row("no plan", *train(w, optimizer, TRAIN_STEPS), predicted_step_time_s=profile.step_time_s)]
    blocks = repeated_blocks(w.model)
    w.model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    rows.append(Row(f"checkpoint per block ({len(blocks)} blocks, HF)", *train(w, optimizer, TRAIN_STEPS)))
    w.model.gradient_checkpointing_disable()
    offload = solve(profile, memory_cap_bytes=profile.peak_bytes, strategy="offload-all")
    print(f"the profile's link: ratio {offload.link.link_ratio:.2f} (copying every saved tensor one way takes "
          f"{offload.link.link_ratio:.2f} x the unplanned step)", flush=True)
    rows.append(planned_row("offload-all", w, optimizer, offload))
    caps = [(f"{CAP_FRACTION:.0%}", int(profile.peak_bytes * CAP_FRACTION)),
            ("checkpoint", rows[1].allocated_bytes), ("offload-all", rows[2].allocated_bytes)]
    rows += regen_rows(profile, caps, w, optimizer)
    ok = print_table(rows)
    print(f"\nmeasured peak (allocated) within cap + 5% for every regen plan: {'yes' if ok else 'NO'}; "
          f"total {time.perf_counter() - t_start:.0f} s")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
