"""Conformance at users' defaults: every architecture of the zoo (regen.zoo: transformers models built from
tiny configs, `use_cache`, attention implementation and dropout as shipped), profiled, planned and trained.

Per architecture, the peer is the checkpointing its users turn on (Hugging Face's gradient checkpointing,
non-reentrant; `torch.utils.checkpoint` around each block where a model has none), its peak measured by the
allocator and put on regen's scale (the profile's memory at the start plus the measured increase). Then:

* a recompute plan and a hybrid plan (an emulated link at R = 0.9) solved at that peak exist (regen's
  smallest cap is at or below checkpointing's peak), and so does a recompute plan at the smallest cap regen
  reaches (for one architecture of each family; for all at bench size);
* 3 AdamW steps under each plan give the losses, and then the weights, gradients and module buffers, of 3
  unplanned steps from the same state, bit for bit;
* the planned step's peak, measured by the allocator, is within the plan's cap + 5%.

`REGEN_ZOO_SIZE=bench pytest tests/test_zoo.py` runs the same at bench size (4 layers, width 192: minutes).
"""

import copy
import functools
import os

import pytest

pytest.importorskip("transformers")

import torch  # noqa: E402

import regen  # noqa: E402
from regen.measure import measure_memory  # noqa: E402
from regen.workloads import build_workload, training_step  # noqa: E402
from regen.zoo import FAMILIES, ZOO, enable_checkpointing  # noqa: E402

SIZE = os.environ.get("REGEN_ZOO_SIZE", "tiny")
BATCH = 4
STEPS = 3
CAP_TOLERANCE = 0.05
LINK_RATIO = 0.9
STEP_SEED = 5
# what is tested is the plans' results and memory, not how fast they are: the solver stops early (at the
# gap); the limit leaves room for a loaded machine, where each stage of a solve runs several times slower
SOLVE_TIME_LIMIT_S = 10.0
SOLVE_GAP = 0.2


def _build(name: str):
    return build_workload(f"regen.zoo:{name}", batch_size=BATCH, args={"size": SIZE})


def _peak_increase(w) -> int:
    """The allocator's peak increase over one training step (after a warm-up step)."""
    training_step(w)
    w.model.zero_grad(set_to_none=True)
    measured = measure_memory(lambda: training_step(w))
    w.model.zero_grad(set_to_none=True)
    return measured.peak_increase_bytes


@functools.lru_cache(maxsize=None)
def _profiled(name: str):
    """(profile, checkpointing's peak on regen's scale, the unplanned run's results)."""
    from regen.profiler import profile_workload

    profile = profile_workload(_build(name), device="cpu", repeats=1, warmup_steps=1, progress=None)
    peer = _build(name)
    enable_checkpointing(peer.model)
    checkpointing_peak = profile.memory_at_start_bytes + _peak_increase(peer)
    return profile, checkpointing_peak, _train(name, None)


@functools.lru_cache(maxsize=None)
def _plan(name: str, strategy: str, at: str):
    from regen.planner import solve
    from regen.planner.solve import solve_within_reach

    profile, checkpointing_peak, _ = _profiled(name)
    options = {"time_limit_s": SOLVE_TIME_LIMIT_S, "rel_gap": SOLVE_GAP}
    if strategy == "hybrid":
        options["link_ratio"] = LINK_RATIO
    if at == "smallest":
        return solve_within_reach(profile, profile.memory_at_start_bytes + 1, strategy, **options)
    return solve(profile, checkpointing_peak, strategy, **options)


def _train(name: str, plan):
    """STEPS AdamW steps of a fresh model (the same initial state every time): (losses, the last step's
    gradients, the state after the steps, the measured peak increase of the last step, the handle)."""
    w = _build(name)
    optimizer = torch.optim.AdamW(w.model.parameters(), lr=1e-3)
    torch.manual_seed(STEP_SEED)
    swaps = plan is not None and plan.action_counts()["swap"] > 0
    handle = regen.apply(w.model, plan, on_mismatch="raise", emulate_link=swaps) if plan is not None else None
    losses, peak = [], 0
    try:
        for k in range(STEPS):
            if k == STEPS - 1:
                measured = measure_memory(lambda: losses.append(training_step(w).detach()))
                peak = measured.peak_increase_bytes
            else:
                losses.append(training_step(w).detach())
            grads = {n: p.grad.clone() for n, p in w.model.named_parameters() if p.grad is not None}
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
    finally:
        if handle is not None:
            handle.remove()
    state = copy.deepcopy(w.model.state_dict())
    return losses, grads, state, peak, handle


def _assert_same(reference, planned):
    losses, grads, state, _, _ = reference
    p_losses, p_grads, p_state, _, _ = planned
    assert all(torch.equal(a, b) for a, b in zip(losses, p_losses)), (losses, p_losses)
    assert grads.keys() == p_grads.keys()
    for k in grads:
        assert torch.equal(grads[k], p_grads[k]), f"gradient of {k} differs"
    assert state.keys() == p_state.keys()
    for k in state:  # parameters after the optimizer steps, and every module buffer
        assert torch.equal(state[k], p_state[k]), f"{k} differs after {STEPS} steps"


CASES = [("recompute", "checkpointing"), ("hybrid", "checkpointing"), ("recompute", "smallest")]
# the plan at the smallest cap (the least-peak search, then a solve there: the slowest case) for one
# architecture per family at tiny size, for every one at bench size
SMALLEST_CAP_FOR = set(ZOO) if SIZE != "tiny" else {family[0].__name__ for family in FAMILIES.values()}
PARAMS = [(name, strategy, at) for name in ZOO for strategy, at in CASES
          if at != "smallest" or name in SMALLEST_CAP_FOR]


@pytest.mark.parametrize("name, strategy, at", PARAMS, ids=[f"{n}-{s}-at-{a}" for n, s, a in PARAMS])
def test_a_plan_trains_exactly_within_its_cap(name, strategy, at):
    profile, checkpointing_peak, reference = _profiled(name)
    plan = _plan(name, strategy, at)
    assert plan.memory_cap_bytes <= checkpointing_peak  # regen goes at least where checkpointing goes
    assert plan.action_counts()["recompute"] + plan.action_counts()["swap"] > 0
    planned = _train(name, plan)
    _assert_same(reference, planned)
    handle = planned[4]
    assert handle.stats.planned_steps == STEPS and handle.stats.dynamic_steps == 0
    measured_peak = profile.memory_at_start_bytes + planned[3]
    assert measured_peak <= plan.memory_cap_bytes * (1 + CAP_TOLERANCE), (
        f"measured {measured_peak} B, cap {plan.memory_cap_bytes} B (checkpointing {checkpointing_peak} B)")
