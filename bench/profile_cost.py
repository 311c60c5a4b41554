"""What profiling costs: wall time of `profile_workload` (repeats=3) as a ratio to one plain training step.

Measured side by side in one run (this machine is shared and noisy): for each config, a plain
forward+backward+optimizer step is timed (median of a few, after a warm-up), then a full profile.
The first profile in a process also pays one-time initialisation (torch.profiler's backend, the
optimizer's lazy imports); a tiny MLP is profiled first so that cost is reported on its own line.

    .venv/bin/python bench/profile_cost.py [configs/X.yaml ...]
"""

from __future__ import annotations

import statistics
import sys
import time
from pathlib import Path

import torch

from regen.profiler import profile_workload
from regen.workloads import build_workload, forward_loss, load_config

ROOT = Path(__file__).resolve().parent.parent
DEFAULT_CONFIGS = ("configs/gpt-small.yaml", "configs/hf-gpt2.yaml")
PROFILE_REPEATS = 3
PLAIN_STEPS = 5
WARMUP_STEPS = 1
TINY_MLP = {"in_features": 8, "hidden": 8, "depth": 1}
TINY_BATCH = 2


def plain_step_s(workload, optimizer) -> float:
    t0 = time.perf_counter()
    forward_loss(workload).backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return time.perf_counter() - t0


def measure(config_path: Path) -> dict:
    config = load_config(config_path)
    workload = build_workload(config["workload"], batch_size=config["batch_size"], args=config["args"])
    optimizer = torch.optim.AdamW(workload.model.parameters(), lr=0.0)  # lr 0: weights unchanged
    for _ in range(WARMUP_STEPS):
        plain_step_s(workload, optimizer)
    step_s = statistics.median(plain_step_s(workload, optimizer) for _ in range(PLAIN_STEPS))
    t0 = time.perf_counter()
    profile = profile_workload(workload, "cpu", repeats=PROFILE_REPEATS, warmup_steps=WARMUP_STEPS, progress=None)
    profile_s = time.perf_counter() - t0
    return {"config": config_path.name, "ops": len(profile.ops), "saved": len(profile.saved_tensors),
            "step_s": step_s, "profile_s": profile_s, "ratio": profile_s / step_s}


def main(argv: list[str] | None = None) -> int:
    paths = [Path(p) for p in (argv if argv else [ROOT / c for c in DEFAULT_CONFIGS])]
    print(f"profiling cost on {torch.get_num_threads()} CPU thread(s), torch {torch.__version__}, "
          f"repeats={PROFILE_REPEATS}, warm-up {WARMUP_STEPS}")
    t0 = time.perf_counter()
    tiny = build_workload("mlp", batch_size=TINY_BATCH, args=TINY_MLP)
    profile_workload(tiny, "cpu", repeats=1, warmup_steps=0, progress=None)
    print(f"one-time initialisation (first profile in the process, a tiny MLP): {time.perf_counter() - t0:.2f} s")
    print(f"{'config':<18} {'ops':>6} {'saved':>6} {'plain step':>11} {'profile':>9} {'ratio':>7}")
    for path in paths:
        r = measure(path)
        print(f"{r['config']:<18} {r['ops']:>6} {r['saved']:>6} {r['step_s'] * 1e3:>8.1f} ms "
              f"{r['profile_s']:>7.2f} s {r['ratio']:>6.1f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
