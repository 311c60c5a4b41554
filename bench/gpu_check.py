"""The GPU check: bench/compare.py's link comparison over a real GPU's host link, and regen's CUDA path.

On a CUDA machine, a GPT-2-sized workload is profiled and calibrated as `regen profile` does (the profile
measures the pinned copy bandwidth per direction: the plans are solved for that real link, whose link ratio is
printed, and the sum of the op times is printed next to the measured step), profiled again with
`torch.cuda.set_per_process_memory_fraction` below the unplanned peak (PARKED_FRACTION of it: the unplanned
warm-up step runs out of memory and the profiler retries parked, saved tensors held in host memory; its
computed peak must be the first profile's within 1%), then trained TRAIN_STEPS steps each: no plan; per-block
checkpointing (Hugging Face's); offload-all (every saved tensor of 1 MiB or more swapped through regen's
runtime, as torchtune's activation offloading); regen's region plan of per-block checkpointing (each block's
forward run again in backward by regen's runtime); regen's recompute-only, swap-only and hybrid plans at 50%
of the unplanned peak and at checkpointing's measured peak; regen's dynamic mode (no plan: swapping over the
measured link and dropping at run time) at 50%, or at the smallest cap a recompute plan reaches if larger,
and at DYNAMIC_REACH x checkpointing's measured peak (a cap dynamic mode reaches: held to it within 5%).
Each step runs as the profile ran it: the model output held through backward, and the peak
(torch.cuda.max_memory_allocated, next to max_memory_reserved: fragmentation is what makes a GPU run out of
memory) read right after backward, before the optimizer step (AdamW with lr=0, as the profiler's: real kernels
and state, the weights never change). Each row is printed as soon as it is measured: the plan's cap and
simulated peak, the measured step time next to the predicted one, the simulated stall, the copy-outs still
unfinished when the forward ended (per step), and a gradient check against no plan (seeds reset, same
weights): plans without recompute must give the unplanned gradients bit for bit where two unplanned runs agree
bit for bit (the check that catches stream races), other plans must stay within twice the spread of two
unplanned runs (a third sample of the same nondeterminism: attention's backward may use atomics). Solver time
limits and a time budget keep the whole check under 5 minutes (plans not started within the budget are
skipped, said so).

Exits 0 with a message on a machine without CUDA; 1 if a plan's measured peak is over its cap + 5%, a gradient
check fails, or the parked profile is not parked or not the unplanned one. Run it through bench/gpu_check.sh
(docs/limitations.md: how to run it on a lent GPU). `--cpu-dry-run` runs the same code on CPU with a tiny
model and the emulated link (no memory figures, no cap check; the parked profile is asked for, the memory
fraction step skipped), so the script is tested without a GPU (tests/bench/test_gpu_check.py).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from dataclasses import dataclass, replace
from pathlib import Path

import torch

CAP_FRACTION = 0.5
DYNAMIC_REACH = 1.1  # dynamic mode's second cap, over checkpointing's measured peak: one it reaches
CAP_TOLERANCE = 0.05
STRATEGIES = ("recompute", "swap", "hybrid")
GRAD_SEED = 1234
RECOMPUTE_SPREAD_FACTOR = 2.0  # a plan with recompute: its gradient difference within this x the unplanned spread
GIB = 2**30
PARKED_FRACTION = 0.8  # the device memory the parked profile may use, as a fraction of the unplanned peak
PARKED_PEAK_TOLERANCE = 0.01  # a parked profile's computed peak is the normal one's within this
ZOO_GPU_BATCH = 4  # a zoo architecture at size "gpu" (regen.zoo.SIZES): sequences of 1,024


@dataclass(frozen=True)
class Config:
    device: torch.device
    workload: str  # a built-in workload or module:function (regen.workloads.build_workload)
    workload_args: dict
    batch_size: int
    train_steps: int
    warmup_steps: int
    profile_repeats: int
    solve_time_limit_s: float
    budget_s: float  # no plan is started after this long
    link_ratio: float | None  # None: the profile's own link (CUDA); the CPU dry run gives one

    @property
    def cuda(self) -> bool:
        return self.device.type == "cuda"


# GPT-2 small's shape (12 layers, 768 wide, 12 heads, 50257 vocabulary) at a batch that fits comfortably
GPU = Config(device=torch.device("cuda"), workload="hf-gpt2", batch_size=8, train_steps=10, warmup_steps=3,
             profile_repeats=3,
             workload_args={"n_layer": 12, "n_embd": 768, "n_head": 12, "vocab_size": 50257, "seq_len": 512,
                            "dropout": 0.1},
             solve_time_limit_s=12.0, budget_s=230.0, link_ratio=None)
CPU_DRY_RUN = Config(device=torch.device("cpu"), workload="hf-gpt2", batch_size=2, train_steps=1, warmup_steps=1,
                     profile_repeats=1,
                     workload_args={"n_layer": 1, "n_embd": 32, "n_head": 2, "vocab_size": 64, "seq_len": 16,
                                    "dropout": 0.1},
                     solve_time_limit_s=5.0, budget_s=float("inf"), link_ratio=0.5)


@dataclass
class Row:
    label: str
    allocated_bytes: int | None  # peak read right after backward (CUDA only)
    reserved_bytes: int | None
    step_time_s: float
    plan: object = None  # regen's Plan, for planned rows
    predicted_step_time_s: float | None = None
    stall_s: float | None = None  # the simulator's
    pending_copy_outs: float | None = None  # copy-outs unfinished at the end of the forward, per step
    gradients: str = "-"
    ok: bool = True


def _sync(cfg: Config) -> None:
    if cfg.cuda:
        torch.cuda.synchronize(cfg.device)


def train(w, optimizer, cfg: Config) -> tuple[int | None, int | None, float]:
    """(peak allocated, peak reserved, median step time) over the steps after the warm-up, each step run as
    the profile ran it: the output held through backward, the peak read right after backward."""
    from regen.workloads import forward_with_output

    times, allocated, reserved = [], [], []
    for i in range(cfg.warmup_steps + cfg.train_steps):
        _sync(cfg)
        if cfg.cuda:
            torch.cuda.reset_peak_memory_stats(cfg.device)
        t0 = time.perf_counter()
        loss, output = forward_with_output(w)
        loss.backward()
        _sync(cfg)
        if i >= cfg.warmup_steps:
            times.append(time.perf_counter() - t0)
            if cfg.cuda:
                allocated.append(torch.cuda.max_memory_allocated(cfg.device))
                reserved.append(torch.cuda.max_memory_reserved(cfg.device))
        del loss, output
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    return max(allocated, default=None), max(reserved, default=None), statistics.median(times)


def gradients(w) -> dict[str, torch.Tensor]:
    """The gradients of one step from GRAD_SEED (the weights are the same for every row: lr=0)."""
    from regen.workloads import forward_with_output

    w.model.zero_grad(set_to_none=True)
    torch.manual_seed(GRAD_SEED)
    loss, output = forward_with_output(w)
    loss.backward()
    del loss, output
    # kept in host memory: a device copy would add the gradients' bytes to every measured peak after it
    grads = {n: p.grad.detach().to("cpu", copy=True) for n, p in w.model.named_parameters() if p.grad is not None}
    w.model.zero_grad(set_to_none=True)
    return grads


def max_difference(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    if a.keys() != b.keys():
        return float("inf")
    return max((float((a[k].float() - b[k].float()).abs().max()) for k in a), default=0.0)


def check_gradients(plan, planned: dict, reference: dict, spread: float) -> tuple[bool, str]:
    """Without recompute (recipes or regions), when two unplanned runs agree bit for bit: bit for bit;
    otherwise within RECOMPUTE_SPREAD_FACTOR x the unplanned spread (a backward with atomics, such as
    memory-efficient attention's with dropout, differs from itself)."""
    diff = max_difference(planned, reference)
    if spread == 0.0 and not plan.action_counts().get("recompute") and not plan.regions:
        return diff == 0.0, "bitwise" if diff == 0.0 else f"DIFFER {diff:.1e}"
    ok = diff <= RECOMPUTE_SPREAD_FACTOR * spread
    return ok, f"{diff:.1e}/{spread:.1e}" + ("" if ok else " OVER")


def simulated_stall_s(plan, profile) -> float:
    """The simulator's step time over the unplanned one, less the recompute it adds: time spent waiting on
    the link."""
    recompute_s = sum(profile.ops[q].time_s for d in plan.decisions if d.recipe and d.rebuilt_with is None
                      for q in d.recipe)
    recompute_s += sum(r.time_s for r in plan.regions)
    return max(0.0, plan.simulated.step_time_s - plan.baseline.step_time_s - recompute_s)


def planned_row(label: str, w, optimizer, plan, profile, cfg: Config, reference: dict, spread: float) -> Row:
    import regen

    with regen.apply(w.model, plan, emulate_link=not cfg.cuda) as handle:
        allocated, reserved, t = train(w, optimizer, cfg)
        ok, grads = check_gradients(plan, gradients(w), reference, spread)
    steps = max(1, handle.stats.steps)
    row = Row(label, allocated, reserved, t, plan, plan.simulated.step_time_s, simulated_stall_s(plan, profile),
              handle.stats.copy_outs_held_at_end_forward / steps, grads, ok)
    if cfg.cuda and plan.strategy != "offload-all":
        row.ok = row.ok and allocated <= plan.memory_cap_bytes * (1 + CAP_TOLERANCE)
    print_row(row)
    print(f"    {plan.action_counts()}, {len(plan.regions)} regions ({handle.stats.region_replays / steps:.0f} "
          f"replays per step), host pool {handle.pool.capacity_bytes / GIB:.3f} GiB (apart, pinned on CUDA), "
          f"copy-ins at their consumer {handle.stats.synchronous_copy_ins}", flush=True)
    return row


def _dynamic_cap(cap: int, planned: list[Row]) -> int:
    """`cap`, or the smallest cap a recompute plan reached when that is larger: below it dynamic mode has
    nothing left to drop either and runs over the cap by design."""
    reached = [r.plan.memory_cap_bytes for r in planned if r.plan is not None and r.plan.strategy == "recompute"]
    return max([cap, *reached[:1]])


def dynamic_row(cap: int, w, optimizer, cfg: Config, reference: dict, spread: float) -> Row:
    """regen's dynamic mode (no plan) at `cap`: on CUDA swapping over the measured link and dropping; on the
    CPU dry run over the emulated link. Its gradients are checked as a recompute plan's."""
    import regen

    link = {} if cfg.cuda else {"emulate_link": True, "link_gb_s": 1.0}
    with regen.apply(w.model, memory_cap=cap, **link) as handle:
        allocated, reserved, t = train(w, optimizer, cfg)
        diff = max_difference(gradients(w), reference)
    ok = diff <= RECOMPUTE_SPREAD_FACTOR * spread
    row = Row(f"regen dynamic @ {cap / GIB:.3f} GiB", allocated, reserved, t, gradients=f"{diff:.1e}/{spread:.1e}",
              ok=ok)
    if cfg.cuda:
        row.ok = row.ok and allocated <= cap * (1 + CAP_TOLERANCE)
    print_row(row)
    print(f"    cap {cap / GIB:.3f} GiB; {handle.stats}", flush=True)
    return row


def _checkpoint_blocks_plan(profile):
    """regen's regions at every repeated block, at the unplanned peak or the smallest cap they reach (on a
    tiny model the block inputs kept and a block's replay can pass the unplanned peak)."""
    from regen.planner import solve_within_reach

    return solve_within_reach(profile, profile.peak_bytes, "checkpoint-blocks")


def regen_rows(profile, caps: list[tuple[str, int]], w, optimizer, cfg: Config, t_start: float,
               reference: dict, spread: float) -> list[Row]:
    """regen's plans at each (name, cap); a strategy that cannot reach a cap runs once at its smallest."""
    from regen.errors import InfeasibleCapError, SolverError
    from regen.planner import solve

    def solved(cap, strategy, start_plans=()):
        return solve(profile, memory_cap_bytes=cap, strategy=strategy, time_limit_s=cfg.solve_time_limit_s,
                     link_ratio=cfg.link_ratio, start_plans=start_plans)

    rows, smallest_done = [], set()
    for cap_name, cap in caps:
        for strategy in STRATEGIES:
            label = f"regen {strategy} @ {cap_name}"
            if time.perf_counter() - t_start > cfg.budget_s:
                print(f"  {label}: skipped (the check's {cfg.budget_s:.0f} s budget is spent)", flush=True)
                continue
            try:
                plan = solved(cap, strategy)
            except SolverError as exc:  # no plan within the time limit: said, and the check goes on
                print(f"  {label}: no plan: {exc}", flush=True)
                continue
            except InfeasibleCapError as exc:
                smallest = exc.smallest_feasible_cap_bytes
                print(f"  {label}: out of reach; smallest cap {(smallest or 0) / GIB:.3f} GiB", flush=True)
                if smallest is None or strategy in smallest_done:
                    continue
                smallest_done.add(strategy)
                label = f"regen {strategy} @ its smallest cap"
                plan = solved(smallest, strategy, exc.start_plans)
            rows.append(planned_row(label, w, optimizer, plan, profile, cfg, reference, spread))
    return rows


HEADER = (f"{'variant':40s} {'alloc GiB':>9s} {'reserv GiB':>10s} {'cap':>6s} {'sim':>6s} {'step ms':>8s} "
          f"{'pred ms':>8s} {'meas/pred':>9s} {'stall ms':>8s} {'pending':>7s} {'gradients':>17s}")


def _gib(n: int | None) -> str:
    return "-" if n is None else f"{n / GIB:.3f}"


def print_row(r: Row) -> None:
    plan, pred = r.plan, r.predicted_step_time_s
    pred_s, ratio_s = (f"{pred * 1e3:.1f}", f"{r.step_time_s / pred:.2f}") if pred else ("-", "-")
    print(f"{r.label[:40]:40s} {_gib(r.allocated_bytes):>9s} {_gib(r.reserved_bytes):>10s} "
          f"{_gib(plan.memory_cap_bytes) if plan else '-':>6s} {_gib(plan.simulated.peak_bytes) if plan else '-':>6s} "
          f"{r.step_time_s * 1e3:8.1f} {pred_s:>8s} {ratio_s:>9s} "
          f"{'-' if r.stall_s is None else f'{r.stall_s * 1e3:.1f}':>8s} "
          f"{'-' if r.pending_copy_outs is None else f'{r.pending_copy_outs:.1f}':>7s} {r.gradients:>17s}"
          + ("" if r.ok else "  <- FAILED"), flush=True)


def profile_and_report(w, cfg: Config):
    from regen.calibration import calibrate
    from regen.profiler import profile_workload
    from regen.runtime.self_timing import measure_runtime_costs

    t0 = time.perf_counter()
    profile = profile_workload(w, device=str(cfg.device), repeats=cfg.profile_repeats,
                               warmup_steps=cfg.warmup_steps, progress=None, runtime_probe=measure_runtime_costs)
    profile.calibration = calibrate(w, profile)  # as `regen profile` does: the plans' charges checked on the workload
    dev = profile.device
    ops_s = sum(o.time_s for o in profile.ops)
    print(f"profiled in {time.perf_counter() - t0:.0f} s: {len(profile.ops)} ops, {len(profile.saved_tensors)} saved "
          f"tensors, unplanned peak {profile.peak_bytes / GIB:.3f} GiB\n"
          f"  step {profile.step_time_s * 1e3:.1f} ms measured, sum of op times {ops_s * 1e3:.1f} ms\n"
          f"  link measured ({dev.bandwidth_method}): device-to-host {dev.d2h_bytes_per_s / 1e9:.1f} GB/s, "
          f"host-to-device {dev.h2d_bytes_per_s / 1e9:.1f} GB/s\n"
          f"  calibrated: recompute x{profile.calibration.recompute_scale:.2f}, swaps "
          f"{profile.calibration.swap_byte_s * 2**20 * 1e3:.3f} ms per MiB ({profile.calibration.rounds} rounds)"
          + "".join(f"\n    {note}" for note in profile.calibration.notes), flush=True)
    return profile


def _device_index(device: torch.device) -> int:
    """`device`'s index (the current device for a bare "cuda"): the memory-fraction calls want one."""
    return device.index if device.index is not None else torch.cuda.current_device()


def parked_profile_ok(w, cfg: Config, profile) -> bool:
    """Profile `w` again with less device memory than its unplanned peak: the profiler must fall back to a
    parked step and compute the same peak (within PARKED_PEAK_TOLERANCE). On CPU there is no memory fraction
    to set: the step is skipped, said so, and the parked profile asked for."""
    from regen.profiler import profile_workload

    limit_bytes = int(PARKED_FRACTION * profile.peak_bytes)
    if cfg.cuda:
        torch.cuda.empty_cache()
        total_bytes = torch.cuda.get_device_properties(cfg.device).total_memory
        torch.cuda.set_per_process_memory_fraction(limit_bytes / total_bytes, _device_index(cfg.device))
    else:
        print("  memory fraction: skipped on CPU (no per-process device memory limit); profiling parked on request",
              flush=True)
    try:
        parked = profile_workload(w, device=str(cfg.device), repeats=1, warmup_steps=1, progress=None,
                                  park=not cfg.cuda)
    finally:
        if cfg.cuda:
            torch.cuda.set_per_process_memory_fraction(1.0, _device_index(cfg.device))
            torch.cuda.empty_cache()
    was_parked = any(n.startswith("recorded parked") for n in parked.notes)
    difference = abs(parked.peak_bytes - profile.peak_bytes) / profile.peak_bytes
    ok = was_parked and difference <= PARKED_PEAK_TOLERANCE
    print(f"parked profile under {limit_bytes / GIB:.3f} GiB: {'parked' if was_parked else 'NOT parked'}, "
          f"unplanned peak {parked.peak_bytes / GIB:.3f} GiB ({difference:.2%} from the first profile)"
          + ("" if ok else "  <- FAILED"), flush=True)
    return ok


def run(cfg: Config) -> int:
    from regen.models import repeated_blocks
    from regen.planner import solve
    from regen.workloads import build_workload

    t_start = time.perf_counter()
    w = build_workload(cfg.workload, batch_size=cfg.batch_size, args=cfg.workload_args, device=str(cfg.device))
    name = torch.cuda.get_device_name(cfg.device) if cfg.cuda else "CPU (dry run: emulated link, no memory figures)"
    print(f"gpu_check on {name}: {cfg.workload} {cfg.workload_args}, batch {cfg.batch_size}", flush=True)
    profile = profile_and_report(w, cfg)
    parked_ok = parked_profile_ok(w, cfg, profile)
    optimizer = torch.optim.AdamW(w.model.parameters(), lr=0.0)  # the weights stay those of the reference
    reference = gradients(w)
    spread = max_difference(gradients(w), reference)
    print(f"two unplanned runs from one seed differ by at most {spread:.1e}\n\n{HEADER}", flush=True)
    rows = [Row("no plan", *train(w, optimizer, cfg), predicted_step_time_s=profile.step_time_s)]
    print_row(rows[0])
    blocks = repeated_blocks(w.model)
    w.model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    rows.append(Row(f"checkpoint per block ({len(blocks)} blocks, HF)", *train(w, optimizer, cfg)))
    w.model.gradient_checkpointing_disable()
    print_row(rows[1])
    offload = solve(profile, memory_cap_bytes=profile.peak_bytes, strategy="offload-all", link_ratio=cfg.link_ratio)
    print(f"  the link: ratio {offload.link.link_ratio:.2f} (copying every saved tensor one way takes "
          f"{offload.link.link_ratio:.2f} x the unplanned step)", flush=True)
    rows.append(planned_row("offload-all", w, optimizer, offload, profile, cfg, reference, spread))
    blocks_plan = _checkpoint_blocks_plan(profile)
    rows.append(planned_row("regen checkpoint-blocks (regions)", w, optimizer, blocks_plan, profile, cfg, reference,
                            spread))
    caps = [(f"{CAP_FRACTION:.0%}", int(profile.peak_bytes * CAP_FRACTION))]
    caps += [(r.label.split(" (")[0], r.allocated_bytes) for r in rows[1:2] if r.allocated_bytes is not None]
    planned = regen_rows(profile, caps, w, optimizer, cfg, t_start, reference, spread)
    rows += planned
    rows.append(dynamic_row(_dynamic_cap(caps[0][1], planned), w, optimizer, cfg, reference, spread))
    checkpointed = rows[1].allocated_bytes or profile.peak_bytes // 2  # no figure in the CPU dry run
    rows.append(dynamic_row(int(DYNAMIC_REACH * checkpointed), w, optimizer, cfg, reference, spread))
    ok = all(r.ok for r in rows)
    print(f"\nevery regen plan within its cap + 5% and its gradients as checked: {'yes' if ok else 'NO'}; "
          f"the parked profile: {'yes' if parked_ok else 'NO'}; total {time.perf_counter() - t_start:.0f} s",
          flush=True)
    return 0 if ok and parked_ok else 1


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cpu-dry-run", action="store_true",
                        help="run the check's code on CPU with a tiny model and the emulated link (no figures)")
    parser.add_argument("--zoo", metavar="NAME",
                        help="check a Hugging Face architecture of regen.zoo at its defaults (size 'gpu'; tiny in "
                             "the dry run) instead of GPT-2 small, e.g. llama")
    args = parser.parse_args(argv)
    import regen
    import regen.planner  # noqa: F401 (pulp and highspy: bench/gpu_check.sh installs them from .whl/ when there)

    print(f"regen from {Path(regen.__file__).parent}, torch {torch.__version__}", flush=True)
    cpu, gpu = CPU_DRY_RUN, GPU
    if args.zoo:
        from regen.zoo import ZOO

        if args.zoo not in ZOO:
            print(f"gpu_check: --zoo {args.zoo}: not in regen.zoo (one of {', '.join(sorted(ZOO))})")
            return 2
        cpu = replace(cpu, workload=f"regen.zoo:{args.zoo}", workload_args={"size": "tiny"})
        gpu = replace(gpu, workload=f"regen.zoo:{args.zoo}", workload_args={"size": "gpu"}, batch_size=ZOO_GPU_BATCH)
    if args.cpu_dry_run:
        return run(cpu)
    if not torch.cuda.is_available():
        print(f"gpu_check: no CUDA device here (torch {torch.__version__}, CUDA build: {torch.version.cuda or 'no'}); "
              f"nothing to check (--cpu-dry-run runs its code on CPU)")
        return 0
    return run(gpu)


if __name__ == "__main__":
    sys.exit(main())
