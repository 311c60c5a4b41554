"""Calibration: two of the runtime's costs measured with the runtime itself, on the profiled workload.

The runtime probe (regen.runtime.costs) reads per-event costs on tiny tensors, and the dispatch mode's
on the workload's forward. Two costs depend on the workload more than a probe can show, and plans on
held-out models measured them well over their prediction (a Llama decoder's hybrid plan: 0.37 ms a swap
against 0.26 charged, and about 2 ms a step of hooks charged nothing):

* `hooks_s`: what a planned step's saved-tensor hooks cost (a pack and an unpack for every saved entry,
  matched by order on fast steps) whatever the plan decides: steps under a keep-all plan against plain
  steps;
* `swap_s`, on a CPU device whose swaps run over the emulated link (regen.runtime.link): what one swap
  costs the compute thread next to this workload's compute (issuing and retiring its copies, and the
  copy threads' wake-ups, Python and memcpy taking the GIL and memory bandwidth from it), transfers left
  out: steps under an offload-all plan over a link fast enough that no copy is waited for, against the
  keep-all steps, per swap. Kept when it reads less than the probe's figure, and on CUDA (the copy
  engines take nothing from compute; the probe's figure is the calls).

The steps run in cycles (plain, keep-all, offload-all, each variant's verified first step and a warm-up
step untimed), so a change of machine load hits all three alike; medians over the cycles. Not run for a
parked profile (the step does not fit), under torch.distributed (every rank would have to run the same
steps), or without the probe's figures. `calibrate` is called by `regen profile` after profiling.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import replace

import torch

from regen.errors import InfeasibleCapError
from regen.formats.profile import Profile
from regen.workloads import Workload, training_step

CALIBRATION_BUDGET_S = 3.0  # the cycles go on while they have taken less than this...
MAX_CYCLES = 4  # ... up to this many...
TIMED_STEPS = 3  # ... of this many timed steps per variant
INSTANT_LINK_GB_S = 1e6  # the offload-all plan's link: every copy lands as soon as its thread runs it
METHOD = "; hooks and swaps calibrated on the workload with the runtime (regen.calibration)"


def calibrate(profile: Profile, workload: Workload, say=None) -> Profile:
    """`profile` with `runtime_costs.hooks_s` and `swap_s` measured on `workload` (see the module doc);
    `profile` itself when it cannot be calibrated."""
    say = say or (lambda _m: None)
    rc = profile.runtime_costs
    if rc is None or _parked(profile) or _distributed():
        return profile
    from regen.planner import solve

    say("calibrating the runtime's hooks and swaps on the workload")
    keep = solve(profile, profile.peak_bytes, "keep-all")
    offload = None
    if profile.device.type == "cpu":
        try:
            offload = solve(profile, profile.peak_bytes, "offload-all", bandwidth_gb_s=INSTANT_LINK_GB_S)
        except InfeasibleCapError:
            offload = None
        if offload is not None and not offload.action_counts()["swap"]:
            offload = None
    times = _cycles(workload, [None, keep] + ([offload] if offload is not None else []))
    hooks_s = max(0.0, statistics.median(times[1]) - statistics.median(times[0]))
    swap_s = rc.swap_s
    if offload is not None:
        measured = (statistics.median(times[2]) - statistics.median(times[1])) / offload.action_counts()["swap"]
        swap_s = max(swap_s, measured)
    say(f"calibrated: hooks {hooks_s * 1e3:.2f} ms a step, {swap_s * 1e3:.3f} ms a swap "
        f"(probe {rc.swap_s * 1e3:.3f})")
    return replace(profile, runtime_costs=replace(rc, hooks_s=hooks_s, swap_s=swap_s, method=rc.method + METHOD))


def _cycles(workload: Workload, plans: list) -> list[list[float]]:
    """Step times of `workload` under each of `plans` (None: plain), cycle after cycle (see the module doc)."""
    import regen

    device = next((p.device for p in workload.model.parameters()), torch.device("cpu"))
    times: list[list[float]] = [[] for _ in plans]
    t0 = time.perf_counter()
    for _ in range(MAX_CYCLES):
        for k, plan in enumerate(plans):
            handle = (regen.apply(workload.model, plan, emulate_link=device.type == "cpu")
                      if plan is not None else None)
            try:
                _step(workload, device)  # a plan's verified step; for all, a warm-up
                _step(workload, device)
                for _ in range(TIMED_STEPS):
                    times[k].append(_step(workload, device))
            finally:
                if handle is not None:
                    handle.remove()
        if time.perf_counter() - t0 > CALIBRATION_BUDGET_S:
            break
    return times


def _step(workload: Workload, device: torch.device) -> float:
    cuda = device.type == "cuda"
    if cuda:
        torch.cuda.synchronize(device)
    t0 = time.perf_counter()
    training_step(workload)
    if cuda:
        torch.cuda.synchronize(device)
    elapsed = time.perf_counter() - t0
    workload.model.zero_grad(set_to_none=True)
    return elapsed


def _parked(profile: Profile) -> bool:
    return any("recorded parked" in note for note in profile.notes)


def _distributed() -> bool:
    import torch.distributed as dist

    return dist.is_available() and dist.is_initialized()
