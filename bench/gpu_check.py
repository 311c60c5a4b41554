"""The GPU check: on a CUDA machine, a GPT-2-sized workload profiled, solved at 50% of its unplanned peak
(hybrid, recompute, swap), trained 20 steps under each plan and with per-block torch.utils.checkpoint,
printing the measured peak (torch.cuda.max_memory_allocated) against the cap and the simulator's
prediction, and the step time against the prediction and each baseline. Exits 0 with a message on a
machine without CUDA. Run it through bench/gpu_check.sh; it is sized to finish in under 5 minutes.
"""

from __future__ import annotations

import statistics
import sys
import time

import torch

TRAIN_STEPS = 20
WARMUP_STEPS = 3
CAP_FRACTION = 0.5
# GPT-2 small's shape (12 layers, 768 wide, 12 heads, 50257 vocabulary) at a batch that fits comfortably
WORKLOAD_ARGS = {"n_layer": 12, "n_embd": 768, "n_head": 12, "vocab_size": 50257, "seq_len": 512, "dropout": 0.1}
BATCH_SIZE = 8


def main() -> int:
    if not torch.cuda.is_available():
        print(f"gpu_check: no CUDA device here (torch {torch.__version__}, CUDA build: {torch.version.cuda or 'no'}); "
              f"nothing to check")
        return 0
    import regen
    from regen.errors import InfeasibleCapError
    from regen.models import repeated_blocks
    from regen.planner import solve
    from regen.profiler import profile_workload
    from regen.workloads import build_workload, forward_loss

    device = "cuda"
    t_start = time.perf_counter()
    w = build_workload("hf-gpt2", batch_size=BATCH_SIZE, args=WORKLOAD_ARGS, device=device)
    print(f"gpu_check on {torch.cuda.get_device_name()}: hf-gpt2 {WORKLOAD_ARGS}, batch {BATCH_SIZE}", flush=True)
    profile = profile_workload(w, device=device, repeats=3, warmup_steps=1, progress=None)
    print(f"profiled in {time.perf_counter() - t_start:.0f} s: {len(profile.ops)} ops, unplanned peak "
          f"{profile.peak_bytes / 2**30:.2f} GiB, step {profile.step_time_s * 1e3:.1f} ms", flush=True)
    optimizer = torch.optim.AdamW(w.model.parameters(), lr=1e-4)

    def train(n):
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
        return torch.cuda.max_memory_allocated(), statistics.median(times)

    rows = []
    peak, t = train(TRAIN_STEPS)
    rows.append(("no plan", peak, t, None))
    blocks = repeated_blocks(w.model)
    w.model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    peak, t = train(TRAIN_STEPS)
    w.model.gradient_checkpointing_disable()
    rows.append((f"per-block checkpoint ({len(blocks)} blocks, HF)", peak, t, None))
    cap = int(profile.peak_bytes * CAP_FRACTION)
    for strategy in ("hybrid", "recompute", "swap"):
        try:
            plan = solve(profile, memory_cap_bytes=cap, strategy=strategy, time_limit_s=40)
        except InfeasibleCapError as exc:
            if exc.smallest_feasible_cap_bytes is None:
                raise
            print(f"{strategy}: 50% is out of reach; smallest cap {exc.smallest_feasible_cap_bytes / 2**30:.2f} GiB")
            plan = solve(profile, memory_cap_bytes=exc.smallest_feasible_cap_bytes, strategy=strategy, time_limit_s=40)
        with regen.apply(w.model, plan) as handle:
            peak, t = train(TRAIN_STEPS)
        rows.append((f"regen {strategy} {plan.action_counts()}", peak, t, plan))
        print(f"  {strategy}: pinned host pool {handle.pool.capacity_bytes / 2**30:.2f} GiB (apart); "
              f"copy-ins at their consumer: {handle.stats.synchronous_copy_ins}", flush=True)
    base_t = rows[0][2]
    print(f"\n{'variant':60s} {'peak GiB':>9s} {'cap':>7s} {'sim':>7s} {'step ms':>8s} {'pred ms':>8s} {'vs eager':>8s}")
    for label, peak, t, plan in rows:
        cap_s = f"{plan.memory_cap_bytes / 2**30:.2f}" if plan else "-"
        sim_s = f"{plan.simulated.peak_bytes / 2**30:.2f}" if plan else "-"
        pred_s = f"{plan.simulated.step_time_s * 1e3:.1f}" if plan else "-"
        print(f"{label[:60]:60s} {peak / 2**30:9.2f} {cap_s:>7s} {sim_s:>7s} {t * 1e3:8.1f} {pred_s:>8s} {t / base_t:8.2f}")
    ok = all(peak <= plan.memory_cap_bytes * 1.05 for _, peak, _, plan in rows if plan)
    print(f"\nmeasured peak within cap + 5% for every plan: {'yes' if ok else 'NO'}; total {time.perf_counter() - t_start:.0f} s")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
