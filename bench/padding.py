"""Padded batches as users train decoders: a plan profiled on one padded batch, trained on batches padded otherwise.

    .venv/bin/python bench/padding.py [--strategy recompute|hybrid] [--models llama opt ...] [--cap-fraction 0.6]
                                      [--heldout NAME ... | --heldout all]

Each decoder of regen.zoo (defaults as shipped, dropout as shipped) is profiled on a right-padded batch (an
attention mask, labels -100 at the pads) and solved at --cap-fraction of its peak increase (or the smallest cap the
strategy reaches; hybrid over an emulated link at R = 0.9). Then four steps under the plan: the profiled padding,
no padding, left padding, and another right padding, each against the unplanned step from the same state and seeds
(losses, gradients and buffers bit for bit; the key/value cache off in both, as regen runs the steps), its peak as
the allocator measures it over the plan's cap, how the handle ran it, and its warnings. A Hugging Face decoder
skips its attention mask for a batch without padding: that step leaves the plan and goes on in dynamic mode
(regen/runtime/apply.py, Note [ A step that leaves its plan ]). With --heldout, the causal LMs of bench/heldout.py
instead (regen was not built around them; "all": every one of them).
"""

from __future__ import annotations

import argparse
import copy
import random
import warnings

import numpy as np
import torch

import regen
from regen.caches import training_caches_off
from regen.check import compare_results
from regen.errors import RegenError
from regen.measure import measure_memory
from regen.planner import solve_within_reach
from regen.profiler import profile_workload
from regen.runtime.dynamic import OverCapWarning
from regen.runtime.dynamic.cap_memory import model_storages
from regen.workloads import Workload, build_workload, training_step
from regen.zoo import FAMILIES

LINK_RATIO = 0.9
BATCH = 4
TOKENS = 200  # below every zoo vocabulary, above its special tokens


def padded(ids: torch.Tensor, lengths: list[int], left: bool = False) -> dict:
    """A batch of `ids` with `lengths` real tokens per row (the rest padding, on the right or the left)."""
    mask = torch.zeros_like(ids)
    seq = ids.shape[1]
    for row, n in enumerate(lengths):
        if left:
            mask[row, seq - n:] = 1
        else:
            mask[row, :n] = 1
    return {"input_ids": ids, "attention_mask": mask, "labels": ids.masked_fill(mask == 0, -100)}


def batches(seq: int) -> list[tuple[str, dict]]:
    g = torch.Generator().manual_seed(1)

    def ids():
        return torch.randint(3, TOKENS, (BATCH, seq), generator=g)

    return [("profiled padding", padded(ids(), [seq, seq - 5, seq - 20, seq // 2])),
            ("no padding", padded(ids(), [seq] * BATCH)),
            ("left padding", padded(ids(), [seq, seq - 3, 9, seq], left=True)),
            ("other padding", padded(ids(), [seq - 1, seq, seq // 3, seq - 7]))]


def _results(w: Workload, model, batch: dict, k: int, measured: bool):
    """One step's (loss, gradients, buffers) and, when `measured`, the allocator's measurement of it."""
    step = Workload(name=w.name, model=model, batch=batch, loss_fn=w.loss_fn)
    torch.manual_seed(k)
    random.seed(k)
    np.random.seed(k)
    out = []

    def run():
        loss = training_step(step).detach()
        out.append((loss, {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}))

    measurement = measure_memory(run) if measured else run()
    result = out[0] + ({n: b.clone() for n, b in model.named_buffers()},)
    model.zero_grad(set_to_none=True)
    return result, measurement


def _references(w: Workload, initial, steps: list[tuple[str, dict]]) -> list:
    """The unplanned steps' results from `initial`, as regen runs the steps: the key/value cache off (Mamba2's
    cached path differs)."""
    plain = copy.deepcopy(initial)
    with training_caches_off(plain):
        return [_results(w, plain, b, k, False)[0] for k, (_, b) in enumerate(steps)]


def _verdict(w: Workload, initial, steps, expected: list, k: int, differences: list) -> str:
    """'exact', or 'DIFFERS', or 'irreproducible' where the unplanned step run again differs from itself (a CPU
    kernel whose reduction order follows the threads the machine gives it, as gpt-oss's under load)."""
    if not differences:
        return "exact"
    again = []
    compare_results(expected[k], _references(w, initial, steps)[k], again, "")
    return "irreproducible" if again else "DIFFERS"


def check(name: str, strategy: str, cap_fraction: float, heldout: bool) -> str:
    if heldout:
        w = build_workload("bench.heldout:build", batch_size=BATCH, args={"name": name})
    else:
        w = build_workload(f"regen.zoo:{name}", batch_size=BATCH)
    steps = batches(w.batch["input_ids"].shape[1])
    w.batch = steps[0][1]
    initial = copy.deepcopy(w.model)
    profile = profile_workload(w, device="cpu", repeats=1, warmup_steps=1, progress=None)
    start = profile.memory_at_start_bytes
    link = {"link_ratio": LINK_RATIO} if strategy == "hybrid" else {}
    plan = solve_within_reach(profile, int(start + cap_fraction * (profile.peak_bytes - start)), strategy,
                              time_limit_s=20, **link)
    expected = _references(w, initial, steps)
    planned = copy.deepcopy(initial)
    model_bytes = sum(model_storages(planned).values())
    cells = []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with regen.apply(planned, plan, emulate_link=strategy == "hybrid") as handle:
            for k, (_, batch) in enumerate(steps):
                got, measured = _results(w, planned, batch, k, True)
                differences = []
                compare_results(expected[k], got, differences, "")
                peak = (model_bytes + measured.peak_increase_bytes) / plan.memory_cap_bytes
                cells.append(f"{_verdict(w, initial, steps, expected, k, differences)} {peak:.2f}")
    left = sum(1 for c in caught if "runs in dynamic mode" in str(c.message) or "unplanned" in str(c.message))
    over = sum(1 for c in caught if issubclass(c.category, OverCapWarning))
    s = handle.stats
    return (f"{name:10} | {' | '.join(cells)} | {s.planned_steps} planned, {s.dynamic_steps} dynamic, "
            f"{s.unplanned_steps} unplanned | {left} | {over}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--strategy", default="recompute", choices=["recompute", "hybrid"])
    default = [f.__name__ for f in FAMILIES["decoder"] + FAMILIES["mixture of experts"]]
    parser.add_argument("--models", nargs="+", default=default, metavar="NAME")
    parser.add_argument("--cap-fraction", type=float, default=0.6, help="of the profiled step's peak increase")
    parser.add_argument("--heldout", nargs="+", metavar="NAME",
                        help="causal LMs of bench/heldout.py instead of the zoo ('all': every one)")
    args = parser.parse_args()
    models = args.models
    if args.heldout:
        from heldout import HELD_OUT

        models = [n for n, (model_class, _, _, _) in HELD_OUT.items() if model_class.endswith("ForCausalLM")]
        if args.heldout != ["all"]:
            unknown = sorted(set(args.heldout) - set(models))
            if unknown:
                parser.error(f"not a causal LM of bench/heldout.py: {', '.join(unknown)}")
            models = args.heldout
    names = ", ".join(n for n, _ in batches(8))
    print(f"{args.strategy} at {args.cap_fraction:g} of the peak increase; per batch ({names}): results against "
          f"unplanned, allocator peak / cap; steps by kind; warnings of a step leaving its plan; over-cap warnings")
    for name in models:
        try:
            print(check(name, args.strategy, args.cap_fraction, bool(args.heldout)), flush=True)
        except (RegenError, TypeError, ValueError) as exc:  # a model that takes no attention mask: TypeError
            print(f"{name:10} | {type(exc).__name__}: {str(exc)[:200]}", flush=True)


if __name__ == "__main__":
    main()
