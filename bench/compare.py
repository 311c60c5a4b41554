"""Side-by-side benchmark: regen against what users reach for today, measured in one run.

The default run is over an emulated host link (`--link-ratio R`, default R = 0.9 and R = 0.1): the link
copies every saved tensor of the step one way in R x the unplanned step time, as a GPU's host link
does (0.9: PCIe next to a fast GPU; 0.1: NVLink-C2C), and regen's runtime runs every swap over it
(`regen.apply(..., emulate_link=True)`: copies on the link's clock, real stalls, their bytes moved by the
compute thread), with compute on one core fewer than the (at most 2) it would use, as in the runs whose
tables docs/benchmarks.md keeps, when the link's copies ran on threads of their own (`--compute-threads`
sets it). Rows, per model and ratio: no plan;
per-block `torch.utils.checkpoint`; offload-all (every saved tensor of 1 MiB or more swapped, as
torchtune's activation offloading, through the same link); regen's recompute-only, swap-only and
hybrid plans at 50% of the unplanned peak and at each peer's measured peak. Every row gives the
measured peak, the measured step time and the predicted step time (the plan's simulator figure).

    python bench/compare.py                                  # R = 0.9 and 0.1, writes docs/benchmarks.md
    python bench/compare.py --models gpt --link-ratio 0.9 --no-write --timed-steps 2 --time-limit 10

`--memcpy-link` runs the comparison below instead, where swaps copy at memcpy speed (no link at all),
labelled as such.

For each model (the built-in GPT, Hugging Face GPT-2, the built-in CNN) and each way of saving
memory, this runs forward+backward steps on the same weights and batch and measures:

* peak memory: the allocator's own timeline (regen.measure; torch.profiler on CPU,
  max_memory_allocated on CUDA), as the increase over the step's start plus the profile's memory at
  the start of the step, so every variant is on one absolute scale;
* step time: the median of several steps after a warm-up.

Variants: no plan; per-block `torch.utils.checkpoint`; Hugging Face `gradient_checkpointing_enable()`
(models that support it); `torch.compile` with `activation_memory_budget=0.5` (the
`aot_eager_decomp_partition` backend, which runs the min-cut partitioner that honours the budget);
`torch.autograd.graph.save_on_cpu` (offload everything); and regen's recompute-only, swap-only and
hybrid plans solved at caps matched to each peer's measured peak (rows "regen recompute @ checkpoint
per block's peak", "@ HF gradient checkpointing's peak"...), each with its plan's predicted step time
next to the measured one. Everything is reported as a ratio to no plan. It writes
docs/benchmarks-memcpy.md with the machine, the date and the command; `--json PATH` also writes every
row as JSON (either run).

    python bench/compare.py --memcpy-link   # all models, writes docs/benchmarks-memcpy.md

`--compile` runs the compiled comparison instead (bench/compiled.py, its arguments): torch.compile alone,
`activation_memory_budget`, regen's plan on the compiled model at the budget's measured peak, and with
`--regen-cap F` the budget that measures the peak of regen's plan at F.

    python bench/compare.py --compile --model regen.zoo:llama --regen-cap 0.5
    python bench/compare.py --memcpy-link --models gpt --no-write --json rows.json
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import os
import platform
import statistics
import sys
import time
import types
import warnings
from dataclasses import dataclass
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from regen.cli import DEFAULT_TIME_LIMIT_S, DEFAULT_WARMUP_S  # noqa: E402
from regen.errors import InfeasibleCapError  # noqa: E402
from regen.heap import keep_freed_host_memory  # noqa: E402
from regen.measure import measure_memory  # noqa: E402
from regen.models import repeated_blocks  # noqa: E402
from regen.workloads import build_workload, training_step  # noqa: E402

MODELS = {
    "gpt": {"workload": "gpt", "batch_size": 8,
            "args": {"vocab_size": 2048, "context": 128, "d_model": 192, "n_layer": 4, "n_head": 6}},
    "hf-gpt2": {"workload": "hf-gpt2", "batch_size": 4,
                "args": {"seq_len": 128, "n_layer": 4, "n_embd": 192, "n_head": 6, "vocab_size": 2048}},
    "cnn": {"workload": "cnn", "batch_size": 16, "args": {"channels": 32, "num_blocks": 4, "image_size": 32}},
    # not in the default run: a decoder none of regen's tuning was done on (--models hf-llama)
    "hf-llama": {"workload": "hf-llama", "batch_size": 4,
                 "args": {"seq_len": 128, "num_layers": 4, "hidden": 192, "n_head": 6, "n_kv_head": 2,
                          "intermediate": 512, "vocab_size": 2048}},
}
DEFAULT_MODELS = ["gpt", "hf-gpt2", "cnn"]
TIMED_STEPS = 11  # medians of 7 moved hybrid rows by 5-10% between runs of the same code
WARMUP_STEPS = 2
PROFILE_WARMUP_S = DEFAULT_WARMUP_S  # as `regen profile`: the step time settles before the profile measures it
SOLVE_TIME_LIMIT_S = DEFAULT_TIME_LIMIT_S  # as `regen solve`: hybrid plans at R = 0.9 still improve past 30 s
COMPILE_MEMORY_BUDGET = 0.5
SEED = 0


@dataclass
class Result:
    model: str
    variant: str
    cap_bytes: int | None
    peak_bytes: int
    step_time_s: float
    note: str = ""
    predicted_step_time_s: float | None = None  # the plan's simulated step time (link runs)
    link_ratio: float | None = None  # the emulated link's R (link runs)


@dataclass
class Variant:
    """One way of running the step: its own model copy, plus what wraps the step."""

    name: str
    workload: object
    context: object = None  # a context-manager factory around each step (save_on_cpu)
    cap_bytes: int | None = None
    note: str = ""
    handle: object = None  # a regen.apply handle, removed at the end
    increase_bytes: int = 0
    times_s: list = None
    predicted_step_time_s: float | None = None

    def step(self) -> None:
        from contextlib import nullcontext

        with (self.context() if self.context else nullcontext()):
            torch.manual_seed(SEED)
            training_step(self.workload)
        self.workload.model.zero_grad(set_to_none=True)


def time_round_robin(variants: list[Variant], steps: int, label: str, progress) -> None:
    """Each variant's step times, one step of each in turn, so load on a shared machine hits all alike."""
    for v in variants:
        v.times_s = []
    from regen.runtime import stacks

    for round_ in range(steps):
        for v in variants:
            # the saved-tensor hooks a regen step leaves pushed until its handle's next step would take every
            # pack and unpack of the next variant's step (about 1 ms a step on HF models): popped untimed
            stacks.pop_finished()
            t0 = time.perf_counter()
            v.step()
            v.times_s.append(time.perf_counter() - t0)
        progress(f"[{label}] timing round {round_ + 1}/{steps}")


def build(spec):
    return build_workload(spec["workload"], batch_size=spec["batch_size"], args=spec["args"])


def checkpoint_blocks(model) -> int:
    """Wrap each repeated block's forward in torch.utils.checkpoint (non-reentrant)."""
    from torch.utils.checkpoint import checkpoint

    blocks = repeated_blocks(model)
    for block in blocks:
        original = block.forward

        def forward(self, *args, _original=original, **kwargs):
            return checkpoint(_original, *args, use_reentrant=False, **kwargs)

        block.forward = types.MethodType(forward, block)
    return len(blocks)


def peer_variants(name: str, spec: dict, progress) -> list[Variant]:
    variants = [Variant("no plan", build(spec))]
    w = build(spec)
    n = checkpoint_blocks(w.model)
    variants.append(Variant("checkpoint per block", w, note=f"{n} blocks"))
    w = build(spec)
    if getattr(w.model, "supports_gradient_checkpointing", False):
        w.model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        variants.append(Variant("HF gradient checkpointing", w))
    import torch._functorch.config as functorch_config

    w = build(spec)
    old_budget = functorch_config.activation_memory_budget
    functorch_config.activation_memory_budget = COMPILE_MEMORY_BUDGET
    try:
        w.model = torch.compile(w.model, backend="aot_eager_decomp_partition")
        v = Variant(f"torch.compile budget {COMPILE_MEMORY_BUDGET}", w, note="aot_eager_decomp_partition")
        v.step()  # compile now, under the budget
        variants.append(v)
    except Exception as exc:  # report, do not hide: a peer that fails is a finding
        progress(f"[{name}] torch.compile failed: {type(exc).__name__}: {exc}")
    finally:
        functorch_config.activation_memory_budget = old_budget
    variants.append(Variant("save_on_cpu (offload all)", build(spec),
                            context=lambda: torch.autograd.graph.save_on_cpu(pin_memory=torch.cuda.is_available()),
                            note="no-op on a CPU device"))
    return variants


def bench_model(name: str, spec: dict, progress) -> list[Result]:
    import regen
    from regen.planner import solve
    from regen.profiler import profile_workload
    from regen.runtime.self_timing import measure_runtime_costs

    progress(f"[{name}] profiling")
    profile = profile_workload(build(spec), device="cpu", repeats=3, warmup_steps=1, warmup_s=PROFILE_WARMUP_S,
                               progress=None,
                               runtime_probe=measure_runtime_costs)
    memcpy_gb_s = profile.device.d2h_bytes_per_s / 1e9  # the memcpy "link", given explicitly
    start = profile.memory_at_start_bytes
    variants = peer_variants(name, spec, progress)
    for v in variants:  # memory first: the allocator's figures do not depend on machine load
        for _ in range(WARMUP_STEPS):
            v.step()
        v.increase_bytes = measure_memory(v.step, collect_garbage=True).peak_increase_bytes
        progress(f"[{name}] {v.name:<30} peak {(start + v.increase_bytes) / 2**20:8.1f} MiB")
    failed: list[Result] = []
    smallest_done: set[str] = set()  # strategies already run at their smallest feasible cap
    for peer in [v for v in variants if v.name != "no plan" and not v.name.startswith("save_on_cpu")]:
        peer_cap = start + peer.increase_bytes
        for strategy in ("recompute", "swap", "hybrid"):
            cap = peer_cap
            label = f"regen {strategy} @ {peer.name}'s peak"
            try:
                plan = solve(profile, memory_cap_bytes=cap, strategy=strategy, time_limit_s=SOLVE_TIME_LIMIT_S,
                             bandwidth_gb_s=memcpy_gb_s)
            except InfeasibleCapError as exc:
                smallest = exc.smallest_feasible_cap_bytes
                progress(f"[{name}] {label}: no plan under {cap / 2**20:.1f} MiB; smallest feasible "
                         f"{(smallest or 0) / 2**20:.1f} MiB")
                failed.append(Result(name, label, cap, 0, 0.0, f"no {strategy} plan reaches this cap; the "
                                     f"smallest it reaches is {(smallest or 0) / 2**20:.1f} MiB"))
                if smallest is None or strategy in smallest_done:
                    continue
                smallest_done.add(strategy)
                cap, label = smallest, f"regen {strategy} @ its smallest cap"
                plan = solve(profile, memory_cap_bytes=cap, strategy=strategy, time_limit_s=SOLVE_TIME_LIMIT_S,
                             bandwidth_gb_s=memcpy_gb_s)
            w = build(spec)
            v = Variant(label, w, cap_bytes=cap, handle=regen.apply(w.model, plan),
                        predicted_step_time_s=plan.simulated.step_time_s,
                        note=f"{plan.action_counts()['swap']} swap, {plan.action_counts()['recompute']} recompute"
                             + (f" ({plan.region_member_count()} by {len(plan.regions)} module replays)"
                                if plan.regions else ""))
            for _ in range(WARMUP_STEPS):
                v.step()
            v.increase_bytes = measure_memory(v.step, collect_garbage=True).peak_increase_bytes
            progress(f"[{name}] {v.name:<30} peak {(start + v.increase_bytes) / 2**20:8.1f} MiB (cap {cap / 2**20:.1f})")
            variants.append(v)
    time_round_robin(variants, TIMED_STEPS, name, progress)
    results = []
    for v in variants:
        if v.handle is not None:
            v.handle.remove()
        results.append(Result(name, v.name, v.cap_bytes, start + v.increase_bytes, statistics.median(v.times_s),
                              v.note, v.predicted_step_time_s))
    torch._dynamo.reset()
    return results + failed


def table(results: list[Result]) -> str:
    lines = []
    for model in dict.fromkeys(r.model for r in results):
        rows = [r for r in results if r.model == model]
        base = next(r for r in rows if r.variant == "no plan")
        lines += [f"### {model}", "",
                  "| variant | cap | measured peak | peak vs no plan | step time | time vs no plan | predicted time "
                  "| note |",
                  "| --- | --- | --- | --- | --- | --- | --- | --- |"]
        for r in rows:
            if not r.peak_bytes:
                lines.append(f"| {r.variant} | {r.cap_bytes / 2**20:.1f} MiB | – | – | – | – | – | {r.note} |")
                continue
            cap = f"{r.cap_bytes / 2**20:.1f} MiB" if r.cap_bytes else ""
            predicted = (f"{r.predicted_step_time_s * 1e3:.1f} ms ({r.predicted_step_time_s / r.step_time_s:.2f} of "
                         f"measured)" if r.predicted_step_time_s else "")
            lines.append(f"| {r.variant} | {cap} | {r.peak_bytes / 2**20:.1f} MiB | {r.peak_bytes / base.peak_bytes:.2f} "
                         f"| {r.step_time_s * 1e3:.1f} ms | {r.step_time_s / base.step_time_s:.2f} | {predicted} "
                         f"| {r.note} |")
        lines.append("")
    return "\n".join(lines)


# ---- over an emulated host link (the default run) ----------------------------------------------------

LINK_RATIOS = (0.9, 0.1)
LINK_CAP_FRACTION = 0.5
LINK_STRATEGIES = ("recompute", "swap", "hybrid")


def _measured(v: Variant, start: int, label: str, progress) -> Variant:
    """Warm the variant up and measure its peak (the allocator's increase over the step's start)."""
    for _ in range(WARMUP_STEPS):
        v.step()
    v.increase_bytes = measure_memory(v.step, collect_garbage=True).peak_increase_bytes
    cap = f" (cap {v.cap_bytes / 2**20:.1f})" if v.cap_bytes else ""
    progress(f"[{label}] {v.name:<34} peak {(start + v.increase_bytes) / 2**20:8.1f} MiB{cap}")
    return v


def _planned(label: str, spec: dict, plan, cap_bytes: int | None) -> Variant:
    """A fresh model under `plan`, its swaps over the emulated link at the plan's bandwidth."""
    import regen

    w = build(spec)
    counts = plan.action_counts()
    return Variant(label, w, cap_bytes=cap_bytes, handle=regen.apply(w.model, plan, emulate_link=True),
                   note=f"{counts['swap']} swap, {counts['recompute']} recompute",
                   predicted_step_time_s=plan.simulated.step_time_s)


def _link_plans(model: str, profile, caps: list[tuple[str, int]], link_ratio: float, time_limit_s: float, label: str,
                progress) -> tuple[list[tuple[str, object, int]], list[Result]]:
    """regen's plans at each (name, cap): (row label, plan, cap), and rows for caps a strategy cannot reach
    (each strategy then runs once at the smallest cap it reaches)."""
    from regen.planner import solve

    plans, failed, smallest_done = [], [], set()
    for cap_name, cap in caps:
        for strategy in LINK_STRATEGIES:
            row = f"regen {strategy} @ {cap_name}"
            try:
                plans.append((row, solve(profile, cap, strategy, time_limit_s=time_limit_s, link_ratio=link_ratio),
                              cap))
                continue
            except InfeasibleCapError as exc:
                smallest = exc.smallest_feasible_cap_bytes
            progress(f"[{label}] {row}: no plan under {cap / 2**20:.1f} MiB; "
                     f"smallest {(smallest or 0) / 2**20:.1f} MiB")
            failed.append(Result(model, row, cap, 0, 0.0,
                                 f"no {strategy} plan reaches this cap; the smallest it reaches is "
                                 f"{(smallest or 0) / 2**20:.1f} MiB", link_ratio=link_ratio))
            if smallest is not None and strategy not in smallest_done:
                smallest_done.add(strategy)
                plan = solve(profile, smallest, strategy, time_limit_s=time_limit_s, link_ratio=link_ratio)
                plans.append((f"regen {strategy} @ its smallest cap", plan, smallest))
    return plans, failed


def bench_model_on_link(name: str, spec: dict, link_ratio: float, progress, time_limit_s: float = SOLVE_TIME_LIMIT_S,
                        timed_steps: int = TIMED_STEPS) -> list[Result]:
    """One model over an emulated link of ratio `link_ratio` (see the module doc)."""
    from regen.planner import solve
    from regen.profiler import profile_workload
    from regen.runtime.self_timing import measure_runtime_costs

    label = f"{name} R={link_ratio:g}"
    progress(f"[{label}] profiling")
    profile = profile_workload(build(spec), device="cpu", repeats=3, warmup_steps=1, warmup_s=PROFILE_WARMUP_S,
                               progress=None,
                               runtime_probe=measure_runtime_costs)
    start = profile.memory_at_start_bytes
    variants = [_measured(Variant("no plan", build(spec), predicted_step_time_s=profile.step_time_s), start, label,
                          progress)]
    w = build(spec)
    n = checkpoint_blocks(w.model)
    peers = [_measured(Variant("checkpoint per block", w, note=f"{n} blocks"), start, label, progress)]
    offload = solve(profile, profile.peak_bytes, "offload-all", link_ratio=link_ratio)
    peers.append(_measured(_planned("offload-all", spec, offload, None), start, label, progress))
    variants += peers
    caps = [(f"{LINK_CAP_FRACTION:.0%}", int(profile.peak_bytes * LINK_CAP_FRACTION))]
    caps += [(peer.name, start + peer.increase_bytes) for peer in peers]
    plans, failed = _link_plans(name, profile, caps, link_ratio, time_limit_s, label, progress)
    for row, plan, cap in plans:
        variants.append(_measured(_planned(row, spec, plan, cap), start, label, progress))
    time_round_robin(variants, timed_steps, label, progress)
    results = []
    for v in variants:
        steps = WARMUP_STEPS + 1 + timed_steps
        waited = v.handle.stats.link_wait_s if v.handle is not None else 0.0
        copy_cpu = v.handle.stats.link_copy_cpu_s if v.handle is not None else 0.0
        if v.handle is not None:
            v.handle.remove()
        note = v.note + (f"; waited on the link {waited * 1e3 / steps:.1f} ms/step" if waited else "")
        note += (f"; the link's memmoves {copy_cpu * 1e3 / steps:.1f} ms/step (emulation only)" if copy_cpu else "")
        results.append(Result(name, v.name, v.cap_bytes, start + v.increase_bytes, statistics.median(v.times_s),
                              note, predicted_step_time_s=v.predicted_step_time_s, link_ratio=link_ratio))
    return results + failed


def link_table(results: list[Result]) -> str:
    """One table per model and link ratio: measured peak, measured and predicted step time."""
    lines = []
    for model, ratio in dict.fromkeys((r.model, r.link_ratio) for r in results):
        rows = [r for r in results if r.model == model and r.link_ratio == ratio]
        base = next(r for r in rows if r.variant == "no plan")
        lines += [f"### {model}, link ratio R = {ratio:g}", "",
                  "| variant | cap | measured peak | peak vs no plan | step time | time vs no plan | predicted step "
                  "time | measured vs predicted | note |",
                  "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
        for r in rows:
            cap = f"{r.cap_bytes / 2**20:.1f} MiB" if r.cap_bytes else ""
            if not r.peak_bytes:
                lines.append(f"| {r.variant} | {cap} | – | – | – | – | – | – | {r.note} |")
                continue
            pred = r.predicted_step_time_s
            pred_s = f"{pred * 1e3:.1f} ms" if pred else "–"
            ratio_s = f"{r.step_time_s / pred:.2f}" if pred else "–"
            lines.append(f"| {r.variant} | {cap} | {r.peak_bytes / 2**20:.1f} MiB "
                         f"| {r.peak_bytes / base.peak_bytes:.2f} "
                         f"| {r.step_time_s * 1e3:.1f} ms | {r.step_time_s / base.step_time_s:.2f} | {pred_s} | "
                         f"{ratio_s} | {r.note} |")
        lines.append("")
    return "\n".join(lines)


def link_document(body: str, command: str, elapsed_s: float, timed_steps: int, compute_threads: int) -> str:
    return "\n".join([
        "# Benchmarks: regen against checkpointing and offloading over an emulated host link",
        "",
        f"Produced by `{command}` on {datetime.date.today().isoformat()} ({elapsed_s:.0f} s), on {machine()}.",
        "",
        "A CPU has no host link, so these runs emulate one (`regen.apply(..., emulate_link=True)`): one copy "
        "thread per direction, each copy of n bytes taking n / bandwidth of wall time, the compute thread "
        "waiting on it where the plan needs the bytes. The link ratio R sets the bandwidth: copying every saved "
        "tensor of the step one way takes R x the unplanned step time (R = 0.9: PCIe next to a fast GPU; "
        "R = 0.1: NVLink-C2C). offload-all swaps every saved tensor of 1 MiB or more through the same link, "
        "run by regen's runtime. Peak memory is measured by the allocator (torch.profiler's timeline) as the "
        "increase over the step's start plus the profile's memory at the start of the step; copy-in buffers "
        "count from their allocation, and the host pool (the same RAM on a CPU) is allocated before the step "
        "and counted apart, as a GPU's pinned host memory is. Step time is the median of "
        f"{timed_steps} forward+backward steps after {WARMUP_STEPS} warm-up steps, round-robin over all variants. "
        "The predicted step time is the plan's simulated one (the profile's for no plan). regen's plans are "
        f"solved at {LINK_CAP_FRACTION:.0%} of the unplanned peak and at each peer's measured peak. Compute runs "
        f"on {compute_threads} thread{'s' if compute_threads > 1 else ''} (`--compute-threads`; the profile too). "
        "The compute thread moves the copies' bytes when they are due (the note's \"link's memmoves\", about "
        "0.1-0.15 ms per MiB each way on this machine, besides the cache they evict), which a GPU's copy "
        "engines would do beside its SMs: an emulation cost in the measured time and, since the profile's swap "
        "probe and the calibration's per-MiB charge measure it, in the plans' swap charge and so in the "
        "prediction: plans solved here swap less than they would for a GPU.",
        "",
        body,
    ])


# bench/zoo.py writes its table between these lines of docs/benchmarks.md; this script keeps it when it writes
ZOO_BEGIN = "<!-- zoo: written by bench/zoo.py -->"
ZOO_END = "<!-- /zoo -->"


def kept_zoo_section(path: Path) -> str:
    """The zoo section of the page at `path` (with a blank line before it), or nothing."""
    text = path.read_text() if path.exists() else ""
    begin, end = text.find(ZOO_BEGIN), text.find(ZOO_END)
    return "\n\n" + text[begin:end + len(ZOO_END)] + "\n" if 0 <= begin < end else ""


def machine() -> str:
    return (f"{platform.machine()} {platform.processor() or ''}, {os.cpu_count()} cores, "
            f"Python {platform.python_version()}, torch {torch.__version__}, "
            f"{'CUDA ' + torch.cuda.get_device_name() if torch.cuda.is_available() else 'CPU only'}").strip()


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if "--compile" in argv:  # the compiled comparison: bench/compiled.py
        from compiled import main as compiled_main

        return compiled_main([a for a in argv if a != "--compile"])
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", nargs="+", default=DEFAULT_MODELS, choices=list(MODELS),
                        help=f"default {' '.join(DEFAULT_MODELS)}")
    parser.add_argument("--no-write", action="store_true", help="print only; do not write the benchmarks page")
    parser.add_argument("--output", default=None,
                        help="default docs/benchmarks.md (docs/benchmarks-memcpy.md with --memcpy-link)")
    parser.add_argument("--link-ratio", type=float, nargs="+", default=list(LINK_RATIOS), metavar="R",
                        help=f"emulated link ratios (default {' and '.join(map(str, LINK_RATIOS))})")
    parser.add_argument("--compile", action="store_true",
                        help="the compiled comparison instead (bench/compiled.py; pass its arguments)")
    parser.add_argument("--memcpy-link", action="store_true",
                        help="the memcpy comparison instead (torch.compile, save_on_cpu, HF checkpointing; no link)")
    parser.add_argument("--time-limit", type=float, default=SOLVE_TIME_LIMIT_S, help="solver time limit per plan (s)")
    parser.add_argument("--timed-steps", type=int, default=TIMED_STEPS, help="timed steps per variant (link runs)")
    parser.add_argument("--json", metavar="PATH", help="also write every row as JSON (a list of objects) to PATH")
    parser.add_argument("--compute-threads", type=int, default=None, metavar="N",
                        help="torch's intra-op threads (default: at most 2; link runs use one fewer, as the runs "
                             "in docs/benchmarks.md did)")
    args = parser.parse_args(argv)
    keep_freed_host_memory()  # every variant's step meets the heap alike (regen.heap)
    warnings.filterwarnings("ignore")
    if args.compute_threads is not None and args.compute_threads < 1:
        parser.error(f"--compute-threads must be at least 1 (got {args.compute_threads})")
    cores = max(1, min(2, torch.get_num_threads()))
    compute_threads = args.compute_threads or (cores if args.memcpy_link else max(1, cores - 1))
    torch.set_num_threads(compute_threads)

    def progress(msg):
        print(msg, file=sys.stderr, flush=True)

    t0 = time.perf_counter()
    if not args.memcpy_link:
        results = []
        for ratio in args.link_ratio:
            for name in args.models:
                results += bench_model_on_link(name, MODELS[name], ratio, progress, args.time_limit, args.timed_steps)
        body = link_table(results)
        print(body)
        _write_json(args.json, results)
        if not args.no_write:
            output = args.output or str(ROOT / "docs" / "benchmarks.md")
            command = "python bench/compare.py" + (f" {' '.join(argv)}" if argv else "")
            Path(output).write_text(link_document(body, command, time.perf_counter() - t0, args.timed_steps,
                                                  compute_threads) + kept_zoo_section(Path(output)))
            print(f"wrote {output}", file=sys.stderr)
        return 0
    results = []
    for name in args.models:
        results += bench_model(name, MODELS[name], progress)
    body = table(results)
    print(body)
    _write_json(args.json, results)
    if not args.no_write:
        args.output = args.output or str(ROOT / "docs" / "benchmarks-memcpy.md")
        command = "python bench/compare.py --memcpy-link" + (f" --models {' '.join(args.models)}" if argv else "")
        text = "\n".join([
            "# Benchmarks over a memcpy link: regen against checkpointing, torch.compile and offloading",
            "",
            f"Produced by `{command}` on {datetime.date.today().isoformat()} "
            f"({time.perf_counter() - t0:.0f} s), on {machine()}.",
            "",
            "Peak memory is measured by the allocator (torch.profiler's timeline on CPU, "
            "`torch.cuda.max_memory_allocated` on CUDA), as the increase over the step's start plus the "
            "profile's memory at the start of the step (parameters, batch). Step time is the median of "
            f"{TIMED_STEPS} forward+backward steps after {WARMUP_STEPS} warm-up steps, taken round-robin over all "
            "variants (one step of each in turn), so machine load hits every variant alike. Ratios are to no "
            "plan, measured side by side in this one run. regen's plans are solved at caps matched to each peer's "
            "measured peak (`@ checkpoint per block's peak` and so on); the predicted time is the plan's own "
            "(its simulated step time).",
            "",
            "On a CPU device there is no host/device link: regen's swaps copy to a host buffer counted apart "
            "(not in the measured peak), and `save_on_cpu` moves nothing. Step times on CPU show the cost of "
            "recomputation and of copies at memcpy speed; a GPU run of `bench/gpu_check.sh` is where overlap "
            "of copies and compute shows.",
            "",
            "Reading the tables: on a CPU device `nn.Dropout` runs as `empty_like`, `bernoulli_` and an in-place "
            "`div_`; regen replays that chain with the RNG state it ran with, so dropout masks are recomputed too "
            "(on CUDA dropout is one `native_dropout` op). Where a recompute-only plan cannot reach a peer's peak, "
            "the row `@ its smallest cap` shows the lowest cap it reaches. Swap plans on a CPU copy at memcpy "
            "speed into a host buffer that is not device memory, so their cost here is a lower bound of the "
            "GPU's, where the copies cross the host link and must hide behind compute.",
            "",
            body,
        ])
        Path(args.output).write_text(text)
        print(f"wrote {args.output}", file=sys.stderr)
    return 0


def _write_json(path: str | None, results: list[Result]) -> None:
    if path:
        Path(path).write_text(json.dumps([dataclasses.asdict(r) for r in results], indent=1))
        print(f"wrote {path}", file=sys.stderr)


if __name__ == "__main__":
    sys.exit(main())
