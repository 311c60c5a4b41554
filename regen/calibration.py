"""Calibration: the planner's charges checked against the workload's own planned steps.

A plan's predicted time is the unplanned step plus what the planner charges for its recomputes and swaps
(regen.planner.costs.RuntimeCharges): the ops' profiled times and the runtime probe's per-event figures.
Three things neither sees, and all are paid by the step:

* a planned step costs something whatever its decisions: regen's saved-tensor hooks run at every pack and
  unpack (parameters' included), its module hooks at every region call, its bookkeeping at every step
  (0.3-0.7 ms a step on four held-out Hugging Face models of 3-22 ms steps on this machine's CPU, 3-11% of
  the step: docs/benchmarks.md "Held-out architectures timed");
* a recompute runs in backward, next to backward's own working set, on operands gone cold in the caches,
  with regen's hooks and replays around it (docs/benchmarks.md: the zoo's measured recomputes against their
  charge);
* a swap's copies take from compute beside them in proportion to their bytes (on a CPU device the emulated
  link's memcpy runs on the cores the ops use; on a GPU the copy engines share its memory bandwidth).

`calibrate` measures all three on the workload, in the stages' own terms (a Profile in, Plans from the planner,
steps under `regen.apply`, the figures back into the Profile as `formats.Calibration`):

1. it takes the plan that keeps every tensor (the runtime's cost alone), the plan that replays every
   repeated block and nothing else (per-block checkpointing, REGIONS: module replays alone, when the profile
   has such blocks), and solves a recompute plan (per-tensor recipes only when REGIONS is timed beside it:
   NOTE [ Replays and recipes apart ]) and a swap plan at CAP_FRACTION of the profile's peak
   increase (or the smallest cap each reaches), the swaps over the device's link (on a CPU device an
   emulated link at LINK_RATIO): one unknown per plan. A calibration plan need only be a typical one:
   each solve stops at its SOLVE_REL_GAPS or after SOLVE_STEPS of the profile's steps (within
   [SOLVE_MIN_S, SOLVE_MAX_S]); a solve that finds no plan in that time (a graph of
   thousands of ops, where the greedy plan misses the cap and building the MILP takes most of a second) is
   tried once more with RETRY_TIME_FACTOR times the time (not at a looser cap: a plan with little recompute
   measures mostly what no charge covers, x3.7-7 its charge on the zoo's Mamba, BART and Mixtral at 75%, and
   would set a scale for every plan);
2. it runs rounds of blocks (the unplanned step, the keep-everything plan, the replays' plan, the recompute
   plan, the swap plan; each block STEPS_PER_BLOCK timed steps under one handle, its time the least of its
   steps after the first: the first under a new handle verifies the plan, and load on the machine only adds
   time; NOTE [ A block's time ]), the order turned each round, so that load and drift hit all five alike;
   the step is forward and backward, gradients dropped after each. From MIN_ROUNDS on it stops once the
   rounds agree (each plan's extra time within SETTLED_FRACTION of the step from round to round), at
   MAX_ROUNDS at most;
3. per round, each plan's extra time over the unplanned block against the simulator's parts of that plan
   (`Plan.simulated_parts`): runtime_step_s = the keep-everything plan's extra (at least 0);
   region_scale = (extra - runtime_step_s - dispatch - swap calls - link waits) / charged replays, from the
   replays' plan; recompute_scale = (extra - runtime_step_s - region_scale x replays - dispatch - swap calls -
   link waits) / charged recipes, from the recompute plan (over all its recomputes when it has too few
   recipes, or no region_scale was measured); swap_byte_s = (extra - runtime_step_s - the recomputes as
   scaled - dispatch - swap calls - link waits) / swapped bytes, from the swap plan, at least what an
   emulated link's memmoves took per swapped byte in those steps (`RuntimeStats.link_copy_cpu_s`: measured,
   where the residual takes the others' errors: it read 0 to 0.8 ms per MiB on the zoo's decoders); the
   median over rounds of each. Module replays and per-tensor recipes get scales of their own because they
   measure apart (the zoo's Qwen3 at bench size: replays x0.87, recipes x1.21), and one scale over both made
   the planner trade replays for recipes and swaps that measured slower (NOTE [ Replays and recipes apart ]).

All of it costs MIN_ROUNDS to MAX_ROUNDS x 5 x STEPS_PER_BLOCK steps and two short solves (`bench/profile_cost.py`).
A figure whose plan has too little of it to measure (charged recompute under MIN_SIGNAL_FRACTION of the
step; no swap), whose plan could not be solved, or that lands outside the bounds `formats.Calibration`
accepts (a runtime cost over CALIBRATION_MAX_RUNTIME_STEP_FRACTION of the step), keeps its default (scale 1,
no per-byte charge, no per-step charge) with a note in the calibration and on the progress line, never silently. A
plan step that fails is the same: no calibration, a note, and the profile is kept.
"""

from __future__ import annotations

import dataclasses
import statistics
import time
from dataclasses import dataclass, field
from typing import Callable

import torch

from regen.caches import training_caches_off
from regen.errors import RegenError, SolverError
from regen.formats.plan import ACTION_SWAP, Plan, TimeParts
from regen.formats.profile import (CALIBRATION_MAX_RUNTIME_STEP_FRACTION, CALIBRATION_MAX_SWAP_BYTE_S,
                                  CALIBRATION_SCALE_BOUNDS, Calibration, Profile)
from regen.heap import give_back_freed_host_memory
from regen.workloads import Workload, training_state_kept, training_step

CAP_FRACTION = 0.5  # of the profile's peak increase over the memory at start
RETRY_TIME_FACTOR = 5  # a solve that found no plan in its time gets this many times the time, once
KEEP_ALL = "keep-all"  # the strategy, and the variant, that keeps every tensor: the runtime's cost alone
REGIONS = "checkpoint-blocks"  # the strategy, and the variant, that replays every repeated block and nothing else
LINK_RATIO = 0.9  # the emulated link of a CPU device's swap plan (regen.planner.host_link)
MIN_ROUNDS, MAX_ROUNDS = 2, 3
STEPS_PER_BLOCK = 3
SETTLED_FRACTION = 0.05  # rounds agree when each plan's extra time spreads less than this x the step
BUDGET_S = 60.0  # rounds after MIN_ROUNDS stop once the calibration has taken this long
SOLVE_STEPS = 4  # a calibration solve's time limit, in the profile's steps...
SOLVE_MIN_S, SOLVE_MAX_S = 1.0, 20.0  # ... within these
# the gap each calibration plan is solved to: the recompute plan's as the plans users solve are (what a recipe
# costs beyond its charge depends on which recipes a plan takes), the swap plan's looser (the per-byte charge
# does not depend on which tensors move)
SOLVE_REL_GAPS = {"recompute": 0.05, "swap": 0.10}
MIN_SIGNAL_FRACTION = 0.02  # of the unplanned step: less charged recompute than this is not measured
METHOD = (f"a keep-everything plan, per-block checkpointing, and a recompute and a swap plan at {CAP_FRACTION:.0%} "
          f"of the peak increase, "
          f"against the unplanned step, "
          f"interleaved blocks of {STEPS_PER_BLOCK} timed steps (the least after the first), median over rounds "
          f"(regen.calibration)")


# NOTE [ Replays and recipes apart ]
# Measured on the zoo's Llama and Qwen3 at bench size (21 interleaved rounds each, CPU, one thread), with a
# single scale fitted on the recompute plan at half the peak (replays and recipes mixed): per-block replays
# (4 regions, nothing else) measured 0.86x (Llama) and 0.76x (Qwen3) of what the calibrated planner charged them,
# the machine's drift taken out: a replays' scale of about 0.82 and 0.85 where the fitted one said x0.95 and
# x1.12. A Llama plan of 3 replays and 4 recipes (its swaps kept) measured within 1% of its calibrated charge:
# what its replays cost less than charged, its recipes cost more. The hybrid plan at checkpointing's peak, which
# traded a replay for recipes and 5 swaps for a predicted 0.7% gain, measured 3% slower than the replays alone.
# Fitted apart (per-block checkpointing timed beside the other plans): Llama replays x0.80 / recipes x0.88,
# Qwen3 x0.87 / x1.21.
# Where per-block checkpointing is timed, the recompute plan is solved with per-tensor recipes only
# (SolveOptions.module_replays=False): at half the peak a decoder's recompute plan is otherwise per-block
# checkpointing again (the zoo's Llama: 19.3 ms of replays, no recipe; Qwen3: 15.0 ms of replays and 0.6 ms of
# recipes), so the recipes' scale was a second reading of the replays' (x1.64 against x1.30 in one calibration
# of Qwen3) while the hybrid plans at checkpointing's peak recompute by recipes.


# NOTE [ A block's time ]
# The calibration's figures are differences of block times, a few percent of the step each, on a machine whose
# steps vary by as much. Five or six calibrations in a row of one profile (the zoo's Llama and Qwen3 at bench
# size, twice each), every one fitted from the same steps both ways: with the block's median as its time, the
# figures' standard deviations over the runs were 0.11-0.20 (replays' scale), 0.10-0.31 (recipes') and 0.06-0.19
# ms/MiB (swaps); with the least of the steps after the first, 0.08-0.12, 0.07-0.19 and 0.04-0.12, lower in 11
# of the 12 comparisons, at the same means (within their spread). Load only adds time, so the least step is the
# one it touched least; the first step under a new handle verifies the plan (tens of ms at 32 layers) and is left
# out.


@dataclass
class _Variant:
    name: str
    plan: Plan | None
    times_s: list[list[float]] = field(default_factory=list)  # per round, the block's timed steps
    memmove_s: float = 0.0  # an emulated link's memmoves over all its blocks' steps (RuntimeStats.link_copy_cpu_s)


def calibrate(workload: Workload, profile: Profile, progress: Callable[[str], None] | None = None) -> Calibration:
    """The workload's calibration of `profile`'s charges (see the module doc); the profile is not changed."""
    say = progress or (lambda _m: None)
    notes: list[str] = []
    profile = dataclasses.replace(profile, calibration=None)  # plans charged as the probe alone says
    try:
        variants = [_Variant("unplanned", None)] + _calibration_plans(profile, notes, say)
    except RegenError as exc:
        return _defaults([f"no calibration plan: {exc}"], say)
    give_back_freed_host_memory()  # the solvers' heap, before the steps (regen.heap)
    if len(variants) == 1:
        return _defaults(notes or ["no calibration plan"], say)
    try:
        rounds = _measure(workload, variants, profile.device.type, say)
    except (RegenError, torch.OutOfMemoryError) as exc:
        return _defaults([f"a calibration step failed: {exc}"], say)
    base, by_name = variants[0], {v.name: v for v in variants}
    runtime_s = _fit_runtime_step_s(base, by_name.get(KEEP_ALL), profile.step_time_s, notes)
    region_scale = _fit_region_scale(base, by_name.get(REGIONS), profile.step_time_s, notes, runtime_s)
    scale = _fit_recompute_scale(base, by_name.get("recompute"), profile.step_time_s, notes, runtime_s, region_scale)
    charged = _Scales(scale, scale if region_scale is None else region_scale)
    byte_s = _fit_swap_byte_s(base, by_name.get("swap"), charged, notes, runtime_s)
    for note in notes:
        say(f"calibration: {note}")
    regions = "" if region_scale is None else f", module replays x{region_scale:.2f}"
    say(f"calibration: {runtime_s * 1e3:.2f} ms a planned step, recompute x{scale:.2f}{regions}, swaps "
        f"{byte_s * 2**20 * 1e3:.3f} ms per MiB over {rounds} rounds")
    return Calibration(recompute_scale=scale, swap_byte_s=byte_s, rounds=rounds, method=METHOD, notes=notes,
                       runtime_step_s=runtime_s, region_scale=region_scale)


def _defaults(notes: list[str], say) -> Calibration:
    for note in notes:
        say(f"calibration: {note}; the probe's charges stand")
    return Calibration(recompute_scale=1.0, swap_byte_s=0.0, rounds=0, method=METHOD, notes=notes)


def _calibration_plans(profile: Profile, notes: list[str], say) -> list[_Variant]:
    """The plan that keeps every tensor, per-block checkpointing (when the profile has repeated blocks), and a
    recompute plan and a swap plan at CAP_FRACTION (or the smallest cap each reaches), each solve tried again
    with RETRY_TIME_FACTOR times the time when it found no plan; a plan that cannot be solved leaves its
    figure at the default, with a note."""
    from regen.planner.solve import solve, solve_within_reach

    start = profile.memory_at_start_bytes
    cap = start + int(CAP_FRACTION * max(0, profile.peak_bytes - start))
    link = {"link_ratio": LINK_RATIO} if profile.device.type == "cpu" else {}
    time_limit_s = min(SOLVE_MAX_S, max(SOLVE_MIN_S, SOLVE_STEPS * profile.step_time_s))
    retry_limit_s = min(SOLVE_MAX_S, RETRY_TIME_FACTOR * time_limit_s)
    say(f"calibration: solving a recompute and a swap plan at {CAP_FRACTION:.0%} of the peak increase "
        f"({time_limit_s:.0f} s each, {retry_limit_s:.0f} s if none is found)")
    variants = [_Variant(KEEP_ALL, solve(profile, profile.peak_bytes, KEEP_ALL))]
    try:  # the module replays alone, when the profile has repeated blocks to replay
        variants.append(_Variant(REGIONS, solve(profile, profile.peak_bytes, REGIONS)))
        recipes_only = {"module_replays": False}  # NOTE [ Replays and recipes apart ]
    except RegenError as exc:
        notes.append(f"no plan of module replays alone ({exc}): recompute's scale stands for them")
        recipes_only = {}
    for strategy, options in (("recompute", recipes_only), ("swap", link)):
        plan = None
        for limit_s in (time_limit_s, retry_limit_s):
            try:
                plan = solve_within_reach(profile, cap, strategy, time_limit_s=limit_s,
                                          rel_gap=SOLVE_REL_GAPS[strategy], **options)
                break
            except SolverError as exc:  # no plan within the time: once more with more of it
                notes.append(f"no {strategy} plan in {limit_s:.0f} s ({exc})")
            except RegenError as exc:
                notes.append(f"no {strategy} plan ({exc})")
                break
        if plan is None:
            notes[-1] += ": its figure keeps the default"
            continue
        if plan.simulated_parts is None:
            raise RegenError(f"the {strategy} plan has no simulated parts")
        if strategy == "swap" and not plan.action_counts()[ACTION_SWAP]:
            notes.append("the swap plan swaps nothing: no per-byte swap charge")
            continue
        variants.append(_Variant(strategy, plan))
    return variants


def _measure(workload: Workload, variants: list[_Variant], device_type: str, say) -> int:
    """Rounds of one block per variant, the order turned each round, from MIN_ROUNDS until the rounds agree
    (`_settled`) or MAX_ROUNDS or the BUDGET_S ran; the rounds run."""
    import regen
    from regen.runtime import stacks

    caches = training_caches_off(workload.model)  # as under regen.apply and while profiling
    t0 = time.perf_counter()
    try:
        with training_state_kept(workload.model):  # its steps leave buffers and RNG states as found
            for r in range(MAX_ROUNDS):
                if r >= MIN_ROUNDS and (_settled(variants) or time.perf_counter() - t0 > BUDGET_S):
                    break
                order = variants[r % len(variants):] + variants[:r % len(variants)]
                for v in order:
                    handle = None if v.plan is None else regen.apply(
                        workload.model, v.plan, on_mismatch="raise",
                        emulate_link=device_type == "cpu" and v.plan.action_counts()[ACTION_SWAP] > 0)
                    try:
                        v.times_s.append(_block(workload, device_type, stacks.pop_finished))
                    finally:
                        if handle is not None:
                            handle.remove()
                            v.memmove_s += handle.stats.link_copy_cpu_s
                say(f"calibration: round {r + 1} (at most {MAX_ROUNDS})")
    finally:
        caches.restore()
    return len(variants[0].times_s)


def _block(workload: Workload, device_type: str, pop_finished) -> list[float]:
    """STEPS_PER_BLOCK timed steps; gradients dropped after each."""
    times = []
    for _ in range(STEPS_PER_BLOCK):
        pop_finished()  # hooks a finished regen step left pushed: not this step's time
        _sync(device_type)
        t0 = time.perf_counter()
        training_step(workload)
        _sync(device_type)
        times.append(time.perf_counter() - t0)
        workload.model.zero_grad(set_to_none=True)
    return times


def _sync(device_type: str) -> None:
    if device_type == "cuda":
        torch.cuda.synchronize()


def _settled(variants: list[_Variant]) -> bool:
    """Each plan's extra time over the unplanned block spreads over the rounds so far by less than
    SETTLED_FRACTION x the unplanned step: another round would move their medians little."""
    base = variants[0]
    step_s = statistics.median(t for block in base.times_s for t in block)
    return all(max(extras) - min(extras) <= SETTLED_FRACTION * step_s
               for extras in (_extras_s(base, v) for v in variants[1:]))


def _extras_s(base: _Variant, v: _Variant) -> list[float]:
    """Per round, the plan's block time over the unplanned block's (`block_time_s`)."""
    return [block_time_s(p) - block_time_s(b) for b, p in zip(base.times_s, v.times_s)]


def block_time_s(times_s: list[float]) -> float:
    """A block's time: the least of its steps after the first (NOTE [ A block's time ])."""
    return min(times_s[1:] or times_s)


def _unexplained_s(parts: TimeParts) -> float:
    """What the simulator charges besides recomputes and the per-byte part of swaps."""
    return parts.dispatch_s + parts.swap_calls_s + parts.link_wait_s


def _fit_runtime_step_s(base: _Variant, v: _Variant | None, step_time_s: float, notes: list[str]) -> float:
    """What a planned step costs with every tensor kept: the keep-everything plan's extra time (at least 0)."""
    if v is None:
        return 0.0
    runtime_s = max(0.0, statistics.median(_extras_s(base, v)))
    if runtime_s > CALIBRATION_MAX_RUNTIME_STEP_FRACTION * step_time_s:
        notes.append(f"a planned step that keeps every tensor measured {runtime_s * 1e3:.2f} ms over the unplanned "
                     f"one, over {CALIBRATION_MAX_RUNTIME_STEP_FRACTION:.0%} of the step: no per-step charge")
        return 0.0
    return runtime_s


@dataclass(frozen=True)
class _Scales:
    """Measured over charged time: of per-tensor recipes (`recipes`) and of module replays (`regions`)."""

    recipes: float = 1.0
    regions: float = 1.0

    def recompute_s(self, parts: TimeParts) -> float:
        """A plan's charged recomputes, as measured."""
        return self.regions * parts.region_s + self.recipes * (parts.recompute_s - parts.region_s)


def _fit_region_scale(base: _Variant, v: _Variant | None, step_time_s: float, notes: list[str],
                      runtime_s: float = 0.0) -> float | None:
    """The module replays' scale, from the plan that replays every repeated block and nothing else; None when
    there is no such plan or it measures nothing usable (recompute's scale then stands for them)."""
    if v is None:
        return None
    parts = v.plan.simulated_parts
    if parts.region_s < MIN_SIGNAL_FRACTION * step_time_s:
        notes.append(f"the module replays' plan replays {parts.region_s * 1e3:.2f} ms, too little to measure: "
                     f"recompute's scale stands for them")
        return None
    return _scale_within_bounds(base, v, runtime_s, 0.0, parts.region_s, "module replays", notes,
                                "recompute's scale stands for them")


def _fit_recompute_scale(base: _Variant, v: _Variant | None, step_time_s: float, notes: list[str],
                         runtime_s: float = 0.0, region_scale: float | None = None) -> float:
    """The recipes' scale, from the recompute plan: what it measures beyond its module replays (at
    `region_scale`) over its recipes' charge; all of its recomputes together when the replays' scale is not
    known or its recipes are too few to measure."""
    if v is None:
        return 1.0
    parts = v.plan.simulated_parts
    if parts.recompute_s < MIN_SIGNAL_FRACTION * step_time_s:
        notes.append(f"the recompute plan recomputes {parts.recompute_s * 1e3:.2f} ms, too little to measure: scale 1")
        return 1.0
    recipes_s = parts.recompute_s - parts.region_s
    if region_scale is None or recipes_s < MIN_SIGNAL_FRACTION * step_time_s:
        replays_s, charged_s = 0.0, parts.recompute_s
    else:
        replays_s, charged_s = region_scale * parts.region_s, recipes_s
    scale = _scale_within_bounds(base, v, runtime_s, replays_s, charged_s, "recompute", notes, "scale 1")
    return 1.0 if scale is None else scale


def _scale_within_bounds(base: _Variant, v: _Variant, runtime_s: float, known_s: float, charged_s: float, what: str,
                         notes: list[str], fallback: str) -> float | None:
    """The median over rounds of (the plan's extra - runtime_s - its unexplained parts - `known_s`) / `charged_s`;
    None, with a note saying `fallback`, when it lands outside CALIBRATION_SCALE_BOUNDS."""
    parts = v.plan.simulated_parts
    scale = statistics.median((e - runtime_s - _unexplained_s(parts) - known_s) / charged_s for e in _extras_s(base, v))
    lo, hi = CALIBRATION_SCALE_BOUNDS
    if not lo <= scale <= hi:
        notes.append(f"{what} measured x{scale:.2f} its charge, outside [{lo}, {hi}]: {fallback}")
        return None
    return scale


def _fit_swap_byte_s(base: _Variant, v: _Variant | None, scales: _Scales, notes: list[str],
                     runtime_s: float = 0.0) -> float:
    """Seconds per swapped byte beyond the swap calls: the swap plan's residual, at least its memmoves'."""
    if v is None:
        return 0.0
    parts = v.plan.simulated_parts
    swapped = sum(d.bytes for d in v.plan.decisions if d.action == ACTION_SWAP)
    per_round = [(e - runtime_s - scales.recompute_s(parts) - _unexplained_s(parts)) / swapped
                 for e in _extras_s(base, v)]
    memmove_byte_s = v.memmove_s / (sum(len(block) for block in v.times_s) * swapped)
    byte_s = max(memmove_byte_s, statistics.median(per_round))
    if byte_s > CALIBRATION_MAX_SWAP_BYTE_S:
        notes.append(f"swaps measured {byte_s * 1e9:.1f} ns a byte, over {CALIBRATION_MAX_SWAP_BYTE_S * 1e9:g}: "
                     f"no per-byte charge")
        return 0.0
    return byte_s
