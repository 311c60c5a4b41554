"""Gradient accumulation under a plan: micro-batches after the first begin with every gradient allocated.

    .venv/bin/python bench/accumulation.py [--models llama opt ...] [--cap-fraction 0.6] [--micro-batches 2]

Each decoder of regen.zoo (defaults as shipped) is profiled as `regen profile` takes a step (gradients made in
backward) and solved with recompute at --cap-fraction of its peak increase, twice: as the profiled loop runs
(gradients made by each step) and with `gradients_held=True` (`regen solve --gradients-held`: at each op the
gradients the profiled step had not made before it, regen.planner.held_gradients). Each plan then runs two
optimizer steps (AdamW) of --micro-batches micro-batches accumulating into the same gradients, against the unplanned loop from the same
state: per plan, the largest allocator peak of a micro-batch that began without gradients and of one that began
with them, as a fraction of the plan's cap (what the step held at its start, parameters, gradients, optimizer
state and batch, plus the allocator's peak increase), whether the final parameters and module buffers equal the
unplanned loop's bit for bit, and the HeldGradientsWarnings the handle gave.
"""

from __future__ import annotations

import argparse
import copy
import warnings

import torch

import regen
from regen.caches import training_caches_off
from regen.measure import measure_memory
from regen.opinfo import unique_storage_bytes
from regen.planner import solve_within_reach
from regen.profiler import profile_workload
from regen.runtime import HeldGradientsWarning
from regen.workloads import Workload, build_workload, training_step
from regen.zoo import FAMILIES

BATCH = 4


def _held_bytes(model, optimizer, batch) -> int:
    tensors = [*model.parameters(), *(p.grad for p in model.parameters())]
    tensors += [t for s in optimizer.state.values() for t in s.values() if torch.is_tensor(t)]
    tensors += [t for t in batch.values() if torch.is_tensor(t)]
    return unique_storage_bytes(tensors)


def _loop(w: Workload, model, micro_batches: int, plan=None):
    """(peaks without gradients held, peaks with them, final parameters and buffers, HeldGradientsWarnings)."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    fresh, holding = [], []
    context = regen.apply(model, plan) if plan is not None else training_caches_off(model)
    with warnings.catch_warnings(record=True) as caught, context:
        warnings.simplefilter("always")
        for step in range(2):
            for k in range(micro_batches):
                batch = {name: t.roll(k, 1) if name == "input_ids" else t for name, t in w.batch.items()}
                held = any(p.grad is not None for p in model.parameters())
                start = _held_bytes(model, optimizer, batch)
                torch.manual_seed(10 * step + k)
                micro = Workload(name=w.name, model=model, batch=batch, loss_fn=w.loss_fn)
                measured = measure_memory(lambda: training_step(micro))
                (holding if held else fresh).append(start + measured.peak_increase_bytes)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
    said = sum(issubclass(c.category, HeldGradientsWarning) for c in caught)
    return fresh, holding, [t.detach().clone() for t in (*model.parameters(), *model.buffers())], said


def check(name: str, cap_fraction: float, micro_batches: int) -> str:
    w = build_workload(f"regen.zoo:{name}", batch_size=BATCH)
    initial = copy.deepcopy(w.model)
    profile = profile_workload(w, device="cpu", repeats=1, warmup_steps=1, progress=None)
    _, _, expected, _ = _loop(w, copy.deepcopy(initial), micro_batches)
    cells = []
    for held in (False, True):
        extra = profile.static_memory.gradient_bytes if held else 0
        start, peak = profile.memory_at_start_bytes + extra, profile.peak_bytes + extra
        plan = solve_within_reach(profile, int(start + cap_fraction * (peak - start)), "recompute", time_limit_s=20,
                                  gradients_held=held)
        fresh, holding, params, said = _loop(w, copy.deepcopy(initial), micro_batches, plan)
        exact = all(torch.equal(a, b) for a, b in zip(params, expected))
        cap = plan.memory_cap_bytes
        cells.append(f"{max(fresh) / cap:.2f} / {max(holding) / cap:.2f}, {'exact' if exact else 'DIFFERS'}, "
                     f"{said} warning{'s' if said != 1 else ''}")
    return f"| {name} | " + " | ".join(cells) + " |"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    default = [f.__name__ for f in FAMILIES["decoder"] + FAMILIES["mixture of experts"]]
    parser.add_argument("--models", nargs="+", default=default, metavar="NAME")
    parser.add_argument("--cap-fraction", type=float, default=0.6, help="of the profiled step's peak increase")
    parser.add_argument("--micro-batches", type=int, default=2)
    args = parser.parse_args()
    print(f"recompute at {args.cap_fraction:g} of the peak increase, {args.micro_batches} micro-batches a step; per "
          f"plan: largest peak / cap of a micro-batch without gradients held / with them, final parameters and "
          f"buffers against unplanned, HeldGradientsWarnings")
    print("| decoder | plan as profiled | plan with --gradients-held |")
    print("| --- | --- | --- |")
    for name in args.models:
        print(check(name, args.cap_fraction, args.micro_batches), flush=True)


if __name__ == "__main__":
    main()
