"""What profiling costs: `regen profile`'s wall time as a number of plain training steps, where it goes,
and the host memory it takes, on a Llama decoder family of growing depth.

Each depth runs in a process of its own (its memory is its own): a Llama decoder (width 256, 4 heads,
2 key/value heads, sequence 256, batch 2, vocabulary 2048, Hugging Face transformers, defaults as
shipped) is built; a plain forward+backward+optimizer step is timed (median of PLAIN_STEPS after
WARMUP_STEPS); then `profile_workload` runs as `regen profile` runs it (the runtime probe, repeats 3,
the warm-up by time) and the calibration after it. Reported: ops and saved tensors, the plain step,
the profile's and the calibration's wall time in plain steps, the profile's phases (from its progress
lines), the process's peak resident memory through its plain steps (model, optimizer state, a step's
activations: "RSS of steps") and how much higher profiling took it ("profiling RSS"). Then the profile
is written and planned as a user plans it: `regen solve --memory-cap 75% --link-ratio 0.9` with
`--strategy recompute` and `hybrid`, each a process of its own, timed from start to exit ("plan":
start-up, loading the profile, solving, writing the plan).

    .venv/bin/python bench/profile_cost.py [--layers 4 8 16 32] [--no-calibrate] [--no-plan]

Time it only on a quiet machine (nothing else running).
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
PLAIN_STEPS = 5
WARMUP_STEPS = 2
WIDTH, HEADS, KV_HEADS, SEQ_LEN, BATCH, VOCAB = 256, 4, 2, 256, 2, 2048


def llama(layers: int):
    """The held-out family: a Llama causal LM of `layers` layers (defaults as shipped)."""
    import transformers

    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=WIDTH, intermediate_size=2 * WIDTH,
                                      num_hidden_layers=layers, num_attention_heads=HEADS,
                                      num_key_value_heads=KV_HEADS, max_position_embeddings=2 * SEQ_LEN)
    ids = torch.randint(0, VOCAB, (BATCH, SEQ_LEN), generator=torch.Generator().manual_seed(0))
    return transformers.LlamaForCausalLM(config), {"input_ids": ids, "labels": ids.clone()}


def _rss_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def measure(layers: int, calibrate: bool, profile_path: str | None) -> dict:
    """One depth, in this process; the profile written to `profile_path` when given."""
    from regen.calibration import calibrate as calibrate_profile
    from regen.profiler import profile_workload
    from regen.runtime.self_timing import measure_runtime_costs
    from regen.workloads import build_workload, forward_loss

    workload = build_workload("bench.profile_cost:llama", args={"layers": layers})
    optimizer = torch.optim.AdamW(workload.model.parameters(), lr=0.0)  # lr 0: the weights stay as built

    def plain_step_s() -> float:
        t0 = time.perf_counter()
        forward_loss(workload).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return time.perf_counter() - t0

    for _ in range(WARMUP_STEPS):
        plain_step_s()
    step_s = statistics.median(plain_step_s() for _ in range(PLAIN_STEPS))
    rss_before = _rss_bytes()
    phases: list[tuple[float, str]] = []
    t0 = time.perf_counter()
    profile = profile_workload(workload, "cpu", repeats=3, warmup_steps=1, warmup_s=2.0,
                               progress=lambda m: phases.append((time.perf_counter(), m.split(":")[0])),
                               runtime_probe=measure_runtime_costs)
    t1 = time.perf_counter()
    if calibrate:
        calibrate_profile(workload, profile, lambda m: None)
    t2 = time.perf_counter()
    if profile_path is not None:
        from regen.formats import save_profile

        save_profile(profile, profile_path)
    spent: dict[str, float] = {}
    for (start, name), (end, _) in zip(phases, phases[1:] + [(t1, "")]):
        key = name.split(" step")[0].split(" 1/")[0]
        spent[key] = spent.get(key, 0.0) + end - start
    return {"layers": layers, "ops": len(profile.ops), "saved": len(profile.saved_tensors), "step_s": step_s,
            "profile_s": t1 - t0, "calibration_s": t2 - t1, "phases": spent,
            "profiling_rss_bytes": max(0, _rss_bytes() - rss_before), "rss_before_bytes": rss_before}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", type=int, nargs="+", default=[4, 8, 16, 32])
    parser.add_argument("--no-calibrate", action="store_true", help="profile only, as `regen profile --no-calibrate`")
    parser.add_argument("--no-plan", action="store_true", help="do not time `regen solve` on the profiles")
    parser.add_argument("--one", type=int, help=argparse.SUPPRESS)  # a child process: one depth, JSON out
    parser.add_argument("--profile-out", help=argparse.SUPPRESS)  # ... and where it writes its profile
    args = parser.parse_args(argv)
    if args.one is not None:
        print(json.dumps(measure(args.one, not args.no_calibrate, args.profile_out)))
        return 0
    print(f"profiling cost on {torch.get_num_threads()} CPU thread(s), torch {torch.__version__}; Llama, width "
          f"{WIDTH}, sequence {SEQ_LEN}, batch {BATCH}; each depth in its own process")
    print(f"{'layers':>6} {'ops':>6} {'saved':>6} {'step':>9} {'profile':>9} {'in steps':>9} {'calibration':>12} "
          f"{'RSS of steps':>13} {'profiling RSS':>14} {'plan (recompute, hybrid)':>25}  largest phases")
    with tempfile.TemporaryDirectory() as directory:
        for layers in args.layers:
            _one_depth(layers, args, Path(directory))
    return 0


def _plan_s(profile: Path, strategy: str) -> str:
    """`regen solve` on `profile` as a user runs it, timed from start to exit."""
    t0 = time.perf_counter()
    done = subprocess.run([sys.executable, "-m", "regen.cli", "solve", str(profile), "--memory-cap", "75%",
                           "--link-ratio", "0.9", "--strategy", strategy, "-q", "-o",
                           str(profile.with_name(f"{strategy}.plan.yaml"))], capture_output=True, text=True, cwd=ROOT)
    return f"{time.perf_counter() - t0:.1f} s" if done.returncode == 0 else "failed"


def _one_depth(layers: int, args, directory: Path) -> None:
    profile = directory / f"llama{layers}.profile.yaml"
    child = subprocess.run([sys.executable, __file__, "--one", str(layers), "--profile-out", str(profile)]
                           + (["--no-calibrate"] if args.no_calibrate else []),
                           capture_output=True, text=True, cwd=ROOT)
    if child.returncode != 0:
        print(f"{layers:>6} failed: {child.stderr.strip().splitlines()[-1:]}")
        return
    r = json.loads(child.stdout.strip().splitlines()[-1])
    top = sorted(r["phases"].items(), key=lambda kv: -kv[1])[:3]
    plans = "-" if args.no_plan else ", ".join(_plan_s(profile, s) for s in ("recompute", "hybrid"))
    print(f"{layers:>6} {r['ops']:>6} {r['saved']:>6} {r['step_s'] * 1e3:>6.0f} ms {r['profile_s']:>7.1f} s "
          f"{r['profile_s'] / r['step_s']:>8.0f}x {r['calibration_s'] / r['step_s']:>10.0f}x "
          f"{r['rss_before_bytes'] / 2**20:>9.0f} MiB {r['profiling_rss_bytes'] / 2**20:>10.0f} MiB "
          f"{plans:>25}  " + ", ".join(f"{name} {s:.1f} s" for name, s in top), flush=True)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
