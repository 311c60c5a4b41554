"""Dynamic mode next to a plan on a language model trained with sequence lengths drawn per step.

The model is the built-in GPT (`--model gpt`, the default) or a causal LM of the architecture zoo at bench
size, its config defaults as shipped (`--model llama`, `--model mixtral`: a mixture of experts, whose routing
changes what runs with every batch, so no plan covers its steps exactly).

Issue 14's variants, each over the same seeded batches (lengths uniform in [--min-len, --max-len], the
dropout seed fixed per step):

* `none`: no cap (the reference time and peak), unpadded;
* `none-padded`: no cap, every batch padded to --max-len (the reference for `pad-plan`'s gradients);
* `pad-plan`: padded to --max-len, one recompute plan solved for --max-len at the cap;
* `none-buckets`: no cap, every batch padded to its bucket (the next of --buckets, a multiple of
  --max-len / 4 by default), the reference for `bucket-plans`;
* `bucket-plans`: padded to its bucket, a plan set with one recompute plan per bucket, each solved at the
  cap (the plans' profiles are taken before the timed steps);
* `dynamic-graph`, `dynamic-dtr`: dynamic mode at the cap, unpadded, with the extended and the plain
  DTR score;
* `dynamic-uncapped`: dynamic mode with a cap no step reaches (UNCAPPED x the cap): nothing is dropped or
  rebuilt, so its time over `none` is what the engine itself costs a step (the dispatch mode's Python per op,
  its checks and captures), and the capped variants' time over it is what their drops and rebuilds cost;
* `dynamic-swap`: `dynamic-graph` with a host link (CPU: emulated, `emulate_link=True`) at link ratio
  --link-ratio (copying every saved tensor of the length-256 step one way takes that x its unplanned
  step time: 0.9 is PCIe next to a fast GPU), swapping as well as dropping (on CUDA the real link);
* `dynamic-buckets`: `dynamic-graph` padded to its bucket: a bucket's steps after its first repeat the last
  step of their shape, so their backward runs without the dispatch mode (docs/internals.md, "Dynamic mode");
* `dynamic-learn`: padded to its bucket, no plan at first: dynamic mode at the cap, learning a plan per
  bucket (`learn=True`): a bucket's first step runs dynamic, the model's next call profiles it (the
  profile's time and memory are in that step's) and its plan is used once solved, so learning settles
  after one profile per bucket (unpadded lengths would each be a new shape).

The cap is 50% (--cap-fraction) of the unplanned step's peak increase at --max-len (from the profile)
(raised to the smallest cap the plan reaches when it reaches no lower, dynamic mode's by as much) above the
step's start (the plan: the profile's memory at start; dynamic mode: the model's parameters and
buffers, its own start figure on CPU). Steps are forward and backward only (no optimizer step), so every
variant sees the same weights and its gradients are compared bit for bit with its reference's
(`exact`). Tokens/s counts real tokens (padding excluded) over the timed steps, every step but the first
--warmup-steps (default 1: a step time is the steady state's; dynamic mode's first step also records its
backward's temporaries on CPU, a plan's first step has none of that) whose mean time is printed apart
("warm-up ms"); the peak is the highest per-step peak the allocator saw (regen.measure), every step's, in a
second, measured pass. Each variant trains its own copy of the model under its own handle, and the variants
are interleaved: step k of every variant, one after the other, then step k + 1 (a machine's drift over the run
reaches them alike; `dynamic-learn`'s background solves are waited for outside the timed steps, as a host core
beside a GPU would run them). Figures on a shared, loaded machine are only comparable side by side, within one
run.

With `--min-len` equal to `--max-len` every step has the plan's shape: `pad-plan` is then the MILP plan
itself, next to dynamic mode's overhead at the same cap.

    .venv/bin/python bench/dynamic.py [--model gpt] [--steps 4] [--max-len 256] [--min-len 32] [--device cpu]
"""

from __future__ import annotations

import argparse
import time
import warnings
from contextlib import ExitStack
from copy import deepcopy
from dataclasses import dataclass, field
from typing import Callable

import torch
import torch.nn.functional as F

import regen
from regen.heap import keep_freed_host_memory
from regen.measure import measure_memory
from regen.models import gpt
from regen.runtime.dynamic.cap_memory import model_storages
from regen.workloads import Workload
from regen.zoo import FAMILIES, ZOO

CAUSAL_LMS = [f.__name__ for f in FAMILIES["decoder"] + FAMILIES["mixture of experts"]]

IGNORE = -100
UNCAPPED = 100  # dynamic-uncapped's cap, in multiples of the others': a cap no step reaches


def batches(steps, batch_size, vocab, min_len, max_len, seed=0):
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(steps):
        length = int(torch.randint(min_len, max_len + 1, (1,), generator=g))
        tokens = torch.randint(0, vocab, (batch_size, length + 1), generator=g)
        out.append((tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()))
    return out


def padded(idx, targets, max_len):
    pad = max_len - idx.size(1)
    return F.pad(idx, (0, pad)), F.pad(targets, (0, pad), value=IGNORE)


def logits_of(output):
    """The logits a model returned: the built-in GPT's tensor, or a Hugging Face output's `.logits`."""
    return output.logits if hasattr(output, "logits") else output


def build_model(name: str, batch_size: int, max_len: int):
    """(model, vocabulary size, description): the built-in GPT, or a causal LM of regen.zoo at bench size."""
    if name == "gpt":
        vocab = 512
        model, _, _ = gpt(batch_size=batch_size, vocab_size=vocab, context=max_len)
        return model, vocab, "GPT (d_model 128, 2 layers)"
    model, _ = ZOO[name](batch_size=batch_size, size="bench")
    limit = getattr(model.config, "max_position_embeddings", None)
    if limit is not None and limit < max_len:
        raise SystemExit(f"bench/dynamic.py: --max-len {max_len} is past {name}'s {limit} positions")
    return model, model.config.vocab_size, f"{type(model).__name__} (regen.zoo {name}, size bench, defaults as shipped)"


def one_step(model, idx, targets, seed):
    model.zero_grad(set_to_none=True)
    torch.manual_seed(seed)
    logits = logits_of(model(idx))
    F.cross_entropy(logits.reshape(-1, logits.size(-1)), targets.reshape(-1), ignore_index=IGNORE).backward()
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def solve_padded_plan(model, batch_size, max_len, vocab, fraction, device, cap_bytes=None):
    """A recompute plan for batches padded to `max_len`, at `fraction` of its unplanned increase above the
    profile's start (or at `cap_bytes`), or at its smallest feasible cap: (plan, the increase, how far the
    plan's cap is above the one asked for)."""
    from regen.planner import solve_within_reach
    from regen.profiler import profile_workload

    idx = torch.zeros(batch_size, max_len, dtype=torch.long, device=device)
    targets = torch.zeros(batch_size, max_len, dtype=torch.long, device=device)

    def loss_fn(output, batch):
        logits = logits_of(output)
        return F.cross_entropy(logits.reshape(-1, logits.size(-1)), targets.reshape(-1), ignore_index=IGNORE)

    w = Workload(name="gpt-padded", model=model, batch=(idx,), loss_fn=loss_fn)
    profile = profile_workload(w, device=device, repeats=1, warmup_steps=1, progress=None)
    increase = profile.peak_bytes - profile.memory_at_start_bytes
    cap = cap_bytes if cap_bytes is not None else profile.memory_at_start_bytes + int(fraction * increase)
    plan = solve_within_reach(profile, cap, "recompute", time_limit_s=30)
    if plan.memory_cap_bytes != cap:
        print(f"  the plan for length {max_len} cannot reach the cap; solved at its smallest cap "
              f"{plan.memory_cap_bytes} B")
    return plan, increase, plan.memory_cap_bytes - cap


def bucket_of(length, buckets):
    return next(b for b in buckets if b >= length)


@dataclass
class Running:
    """One variant as the interleaved rounds time it: its own copy of the model under its own handle."""

    name: str
    model: torch.nn.Module
    pad_to: Callable[[int], int] | None  # the padded length, or None for no padding
    handle: object
    reference: str | None
    grads: list = field(default_factory=list)
    seconds: float = 0.0
    tokens: int = 0
    peak: int = 0
    warmup_s: float = 0.0


def run_step(v: Running, k: int, idx, targets, device, warmup_steps, start) -> None:
    """Step `k` of variant `v`, timed, then measured untimed (the allocator's peak, a second pass)."""
    real = idx.numel()
    if v.pad_to is not None:
        idx, targets = padded(idx, targets, v.pad_to(idx.size(1)))
    idx, targets = idx.to(device), targets.to(device)
    cuda = device.startswith("cuda")
    t0 = time.perf_counter()
    v.grads.append(one_step(v.model, idx, targets, seed=k))
    if cuda:
        torch.cuda.synchronize()
    if k < warmup_steps:
        v.warmup_s += time.perf_counter() - t0
    else:
        v.seconds += time.perf_counter() - t0
        v.tokens += real
    # gradients dropped first: the measured increase is over the model's own memory, as `start` counts it
    # (left, the step before's gradients would be in the baseline and freed by the step's zero_grad)
    v.model.zero_grad(set_to_none=True)
    # the profiler's garbage collected now, not inside the next timed step
    m = measure_memory(lambda: one_step(v.model, idx, targets, seed=k), device, collect_garbage=True)
    v.peak = max(v.peak, m.peak_bytes if cuda else start + m.peak_increase_bytes)
    v.model.zero_grad(set_to_none=True)
    wait_for_learning = getattr(v.handle, "wait_for_learning", None)
    if wait_for_learning is not None:  # learn=True's background solve never runs beside a timed step
        wait_for_learning()


def run_interleaved(variants: list[Running], data, device, warmup_steps, start) -> None:
    """Every variant's step k, one variant after the other, for each k: a machine's drift between the start
    and the end of the run reaches every variant alike."""
    from regen.runtime import stacks

    for k, (idx, targets) in enumerate(data):
        for v in variants:
            # what a regen step leaves pushed until its handle's next step would take the next variant's
            # packs: popped untimed
            stacks.pop_finished()
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                run_step(v, k, idx, targets, device, warmup_steps, start)


def same(a, b):
    return all(torch.equal(x[n], y[n]) for x, y in zip(a, b) for n in x)


class _Nothing:
    stats = None

    def __init__(self, model=None):
        pass

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        pass


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="gpt", choices=["gpt", *CAUSAL_LMS],
                    help="the built-in GPT, or a causal LM of regen.zoo at bench size (defaults as shipped)")
    ap.add_argument("--steps", type=int, default=4, help="steps per variant, warm-up steps included")
    ap.add_argument("--warmup-steps", type=int, default=1, help="untimed first steps of each variant")
    ap.add_argument("--min-len", type=int, default=32)
    ap.add_argument("--max-len", type=int, default=256)
    ap.add_argument("--batch-size", type=int, default=4)
    ap.add_argument("--cap-fraction", type=float, default=0.5)
    ap.add_argument("--buckets", type=int, nargs="*", help="bucket lengths (default: 4 up to --max-len)")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--link-ratio", type=float, default=0.9, help="dynamic-swap's emulated link (CPU device)")
    args = ap.parse_args()
    if not 0 <= args.warmup_steps < args.steps:
        ap.error("--warmup-steps: at least 0 and fewer than --steps")
    keep_freed_host_memory()  # every variant's step meets the heap alike (regen.heap)
    buckets = sorted(args.buckets or [args.max_len * k // 4 for k in range(1, 5)])
    if buckets[-1] < args.max_len:
        ap.error("--buckets: the largest bucket must hold --max-len")
    model, vocab, description = build_model(args.model, args.batch_size, args.max_len)
    model.to(args.device)
    data = batches(args.steps, args.batch_size, vocab, args.min_len, args.max_len)
    print(f"{description}, batch {args.batch_size}, lengths {[d[0].size(1) for d in data]}, device {args.device}")
    plan, increase, raised = solve_padded_plan(model, args.batch_size, args.max_len, vocab, args.cap_fraction,
                                               args.device)
    model.zero_grad(set_to_none=True)
    # raised by as much as the plan's, when no plan reaches the fraction: a cap below everyone's reach
    # measures only how dynamic mode degrades
    dyn_cap = sum(model_storages(model).values()) + int(args.cap_fraction * increase) + raised
    print(f"cap: the step's start + {args.cap_fraction:.0%} of the unplanned increase at length {args.max_len} "
          f"({increase / 2**20:.2f} MiB): dynamic mode {dyn_cap / 2**20:.2f} MiB (from the model's memory), the plan "
          f"{plan.memory_cap_bytes / 2**20:.2f} MiB (from the profile's start, which also counts the batch and "
          f"the profiler's optimizer state); peaks below are the model's memory + the measured increase")
    used = sorted({bucket_of(d[0].size(1), buckets) for d in data})
    bucket_plans = [solve_padded_plan(model, args.batch_size, b, vocab, args.cap_fraction, args.device,
                                      cap_bytes=plan.memory_cap_bytes)[0] for b in used]
    model.zero_grad(set_to_none=True)
    to_max, to_bucket = (lambda n: args.max_len), (lambda n: bucket_of(n, buckets))
    # (name, padding, handle of a model copy, the variant whose gradients it must equal)
    variants = [
        ("none", None, _Nothing, None),
        ("none-padded", to_max, _Nothing, None),
        ("pad-plan", to_max, lambda m: regen.apply(m, plan), "none-padded"),
        ("none-buckets", to_bucket, _Nothing, None),
        ("bucket-plans", to_bucket, lambda m: regen.apply(m, bucket_plans), "none-buckets"),
        ("dynamic-graph", None, lambda m: regen.apply(m, memory_cap=dyn_cap, policy="graph"), "none"),
        ("dynamic-dtr", None, lambda m: regen.apply(m, memory_cap=dyn_cap, policy="dtr"), "none"),
        ("dynamic-uncapped", None, lambda m: regen.apply(m, memory_cap=UNCAPPED * dyn_cap, policy="graph"), "none"),
        ("dynamic-swap", None, lambda m: regen.apply(m, memory_cap=dyn_cap, **link), "none"),
        ("dynamic-buckets", to_bucket, lambda m: regen.apply(m, memory_cap=dyn_cap, policy="graph"), "none-buckets"),
        ("dynamic-learn", to_bucket, lambda m: regen.apply(m, memory_cap=dyn_cap, learn=True), "none-buckets"),
    ]
    print(f"buckets {buckets}: plans for {used}")
    link = {}
    if not args.device.startswith("cuda"):
        link_gb_s = plan.link.candidate_bytes / (args.link_ratio * plan.baseline.step_time_s) / 1e9
        link = {"emulate_link": True, "link_gb_s": link_gb_s}
        print(f"dynamic-swap: an emulated link of {link_gb_s:.2f} GB/s (link ratio {args.link_ratio} at length "
              f"{args.max_len}; its memmoves run on the compute thread: emulation only)")
    start = sum(model_storages(model).values())
    with ExitStack() as stack:
        running = []
        for name, pad_to, context, reference in variants:
            copy = deepcopy(model)
            handle = stack.enter_context(context(copy))
            running.append(Running(name, copy, pad_to, handle, reference))
        run_interleaved(running, data, args.device, args.warmup_steps, start)
    print(f"{'variant':14s} {'tokens/s':>10s} {'warm-up ms':>10s} {'peak MiB':>9s} {'exact':>6s}  stats")
    grads = {v.name: v.grads for v in running}
    for v in running:
        exact = "-" if v.reference is None else ("yes" if same(v.grads, grads[v.reference]) else "NO")
        warmup_ms = f"{v.warmup_s / args.warmup_steps * 1e3:10.1f}" if args.warmup_steps else f"{'-':>10s}"
        print(f"{v.name:14s} {v.tokens / v.seconds:10.0f} {warmup_ms} {v.peak / 2**20:9.2f} {exact:>6s}  "
              f"{describe_stats(v.handle)}")
    for line in summary({v.name: v for v in running}, args.steps - args.warmup_steps, args.min_len == args.max_len):
        print(line)


def summary(by_name: dict[str, Running], timed_steps: int, fixed_shape: bool) -> list[str]:
    """The ratios the issue's targets are stated in, and where dynamic mode's time goes: the engine's own cost
    (`dynamic-uncapped` over `none`) and, above it, each score's drops and rebuilds."""
    ms = {name: 1e3 * v.seconds / timed_steps for name, v in by_name.items()}
    rate = {name: v.tokens / v.seconds for name, v in by_name.items()}
    lines = []
    if fixed_shape:
        lines.append(f"fixed shape: dynamic-graph's step {rate['pad-plan'] / rate['dynamic-graph']:.3f}x the plan's, "
                     f"dynamic-dtr's {rate['pad-plan'] / rate['dynamic-dtr']:.3f}x")
    lines.append(f"dynamic-graph / dynamic-dtr tokens/s: {rate['dynamic-graph'] / rate['dynamic-dtr']:.3f}x")
    lines.append(f"a step: none {ms['none']:.1f} ms; the engine's own cost (dynamic-uncapped) "
                 f"+{ms['dynamic-uncapped'] - ms['none']:.1f} ms; above it, drops and rebuilds: graph "
                 f"+{ms['dynamic-graph'] - ms['dynamic-uncapped']:.1f} ms, DTR "
                 f"+{ms['dynamic-dtr'] - ms['dynamic-uncapped']:.1f} ms")
    return lines


def describe_stats(handle) -> str:
    """The handle's counters: a plan handle's, with its dynamic steps' when it ran any."""
    if handle.stats is None:
        return ""
    dynamic = getattr(handle, "dynamic_stats", None)
    if dynamic is None or not dynamic.steps:
        return str(handle.stats)
    return f"{handle.stats} {dynamic}"


if __name__ == "__main__":
    main()
