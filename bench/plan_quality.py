"""Plan quality: predicted overhead at caps of 30, 50 and 70% of the unplanned peak, every strategy,
on the built-in workloads' profiles (profiled here on CPU; op times are CPU times).

    .venv/bin/python bench/plan_quality.py [--time-limit 30]

Overhead = predicted step time / unplanned step time - 1. "infeasible (min X%)" is the smallest
feasible cap the solver found, as a fraction of the unplanned peak.
"""

import argparse

import torch

from regen.errors import InfeasibleCapError, RegenError
from regen.planner import solve
from regen.profiler import profile_workload
from regen.workloads import build_workload

WORKLOADS = [
    ("mlp", dict(in_features=256, hidden=1024, depth=6), 512),
    ("cnn", dict(channels=16, num_blocks=3, image_size=32), 16),
    ("gpt", dict(vocab_size=512, context=64, d_model=128, n_layer=4, n_head=4), 8),
    ("hf-gpt2", dict(seq_len=64, n_layer=2, n_embd=128, n_head=4, vocab_size=1024), 4),
]
STRATEGIES = ["hybrid", "recompute", "swap", "chen", "keep-all", "str"]
CAPS = [0.3, 0.5, 0.7]
CPU_COPY_GB_S = 16.0  # PCIe-class copies (the CPU profile's memcpy bandwidth is not a transfer)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--time-limit", type=float, default=30.0)
    parser.add_argument("--bandwidth", type=float, default=CPU_COPY_GB_S, help="copy bandwidth in GB/s")
    args = parser.parse_args()
    torch.set_num_threads(2)
    for name, wargs, batch in WORKLOADS:
        try:
            workload = build_workload(name, batch_size=batch, args=wargs)
        except RegenError as exc:
            print(f"{name}: skipped ({exc})")
            continue
        profile = profile_workload(workload, device="cpu", repeats=3, warmup_steps=1, progress=None)
        print(f"\n{name}: {len(profile.ops)} ops, {len(profile.saved_tensors)} saved tensors, unplanned peak "
              f"{profile.peak_bytes / 2**20:.1f} MiB, step {profile.step_time_s * 1e3:.1f} ms")
        print(f"  {'strategy':<10}" + "".join(f"{f'cap {int(c * 100)}%':>26}" for c in CAPS))
        for strategy in STRATEGIES:
            cells = []
            for frac in CAPS:
                cap = int(profile.peak_bytes * frac)
                try:
                    plan = solve(profile, cap, strategy, time_limit_s=args.time_limit, bandwidth_gb_s=args.bandwidth)
                    over = 100 * (plan.predicted.step_time_s / plan.baseline.step_time_s - 1)
                    sim_over = 100 * (plan.simulated.step_time_s / plan.baseline.step_time_s - 1)
                    cells.append(f"+{over:.1f}% (sim +{sim_over:.1f}%)")
                except InfeasibleCapError as exc:
                    smallest = exc.smallest_feasible_cap_bytes
                    cells.append(f"infeasible (min {100 * smallest / profile.peak_bytes:.0f}%)" if smallest
                                 else "infeasible")
                except RegenError as exc:
                    cells.append(f"error: {str(exc)[:18]}")
            print(f"  {strategy:<10}" + "".join(f"{c:>26}" for c in cells), flush=True)


if __name__ == "__main__":
    main()
