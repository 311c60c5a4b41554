"""Recipes with in-place ops: CPU dropout (`empty_like`, `bernoulli_`, `div_`) recomputed from the RNG state.

A recompute-only plan on the CPU GPT profile that recomputes dropout masks must give the unplanned loss
and gradients bit for bit on every step (the verified first step and the fast later ones).
"""

import functools

import pytest

import regen
from common import assert_same, make, run_and_grads
from regen.errors import PlanMismatchError
from regen.runtime.recompute import CapturedOp, Ref, replay_recipe
from regen.runtime.storage_views import Geometry

STEPS = 3
GPT_ARGS = dict(batch_size=2, vocab_size=256, context=32, d_model=64, n_layer=2, n_head=4, dropout=0.1)
SOLVE_TIME_LIMIT_S = 30


@functools.lru_cache(maxsize=None)
def _dropout_recompute_plan():
    from regen.planner import solve
    from regen.planner.graph import build_graph
    from regen.planner.milp.search import smallest_feasible_cap
    from regen.profiler import profile_workload

    w = make("gpt", **GPT_ARGS)
    profile = profile_workload(w, device="cpu", repeats=1, warmup_steps=1, progress=None)
    cap = smallest_feasible_cap(build_graph(profile), allow_swap=False, allow_recompute=True)
    assert cap is not None
    plan = solve(profile, memory_cap_bytes=cap, strategy="recompute", time_limit_s=SOLVE_TIME_LIMIT_S)
    return w, profile, plan


def test_recompute_only_plan_replays_dropout_masks_bit_for_bit():
    w, profile, plan = _dropout_recompute_plan()
    ops = profile.ops
    by_id = {s.id: s for s in profile.saved_tensors}
    masks = [d for d in plan.decisions if d.action == "recompute" and ops[by_id[d.saved_tensor].producer_op].is_inplace
             and any(ops[q].name == "aten.bernoulli_.float" for q in d.recipe)]
    assert masks, "the plan recomputes no dropout mask"
    references = [run_and_grads(w, seed=100 + k) for k in range(STEPS)]
    with regen.apply(w.model, plan) as handle:
        for k in range(STEPS):
            assert_same(references[k], run_and_grads(w, seed=100 + k))
    assert handle.stats.planned_steps == STEPS and handle.stats.unplanned_steps == 0
    assert handle.stats.recomputes >= STEPS * len(masks)
    assert handle.active_steps == 0


def test_inplace_recipe_op_on_a_tensor_the_recipe_did_not_create_is_refused():
    import torch

    x = torch.ones(4)
    geometry = Geometry.of(x)
    caps = {0: CapturedOp(index=0, func=torch.ops.aten.mul.Tensor, args=(Ref(9, 0, geometry), 2.0), kwargs={},
                       refs=((9, 0),)),
            1: CapturedOp(index=1, func=torch.ops.aten.add_.Tensor, args=(Ref(9, 0, geometry), Ref(0, 0, geometry)),
                       kwargs={}, refs=((9, 0), (0, 0)))}
    with pytest.raises(PlanMismatchError, match="writes in place"):
        replay_recipe((1, 0), [0, 1], caps, lambda key: x, x.shape, x.dtype)
    assert torch.equal(x, torch.ones(4))  # the recipe input was not touched
