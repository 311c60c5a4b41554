"""bf16 autocast on CPU: profiles of a forward under autocast, plans whose recipes, regions and swaps
give the unplanned loss, gradients and buffers bit for bit, and autocast's low-precision weight copies
(a `_to_copy` of a parameter) planned as cheap recomputes, never swapped."""

import contextlib
import functools

import pytest
import torch

import regen
from common import STEP_SEED, assert_nothing_left, assert_same, buffers, grads
from plans import TINY_GPT, profile, solve_halfway
from regen.formats.profile import KIND_PARAMETER
from regen.workloads import build_workload, call_model, compute_loss


def _autocast():
    return torch.autocast("cpu", dtype=torch.bfloat16)


def _run(w, forward_autocast=True, backward_autocast=False):
    """(loss, gradients, buffers) of one step; the forward (and the backward) under bf16 autocast or not."""
    w.model.zero_grad(set_to_none=True)
    torch.manual_seed(STEP_SEED)
    with _autocast() if forward_autocast else contextlib.nullcontext():
        loss = compute_loss(w.name, call_model(w.model, w.batch), w.batch, w.loss_fn)
        if forward_autocast and backward_autocast:  # inside the forward's autocast block
            loss.backward()
    if not forward_autocast and backward_autocast:
        with _autocast():
            loss.backward()
    elif not backward_autocast:
        loss.backward()
    return loss.detach(), grads(w.model), buffers(w.model)


@functools.lru_cache(maxsize=None)
def _bf16_gpt():
    w = build_workload("gpt", batch_size=2, args=TINY_GPT, autocast="bf16")
    return w, profile(w)


@functools.lru_cache(maxsize=None)
def _plan(strategy):
    from regen.planner import solve

    _, prof = _bf16_gpt()
    if strategy == "checkpoint-blocks":  # region decisions: each block's call replayed in backward
        return solve(prof, memory_cap_bytes=prof.peak_bytes, strategy=strategy)
    if strategy == "hybrid":  # a cap low enough that the plan needs recompute besides the link's swaps, over a
        # link fast enough that swaps clearly pay (at R = 2 the MILP's plan with swaps and the recompute-only warm
        # start simulate within 0.5% of each other, and which one the solver returns varies from run to run)
        return solve_halfway(prof, strategy, link_ratio=0.5, fraction=0.25)
    return solve_halfway(prof, strategy)


def _weight_copies(prof):
    """Saved tensors that are a `_to_copy` of a parameter (autocast's bf16 weight copies)."""
    parameters = {t.id for t in prof.tensors if t.kind == KIND_PARAMETER}
    return {s.id for s in prof.saved_tensors
            if prof.ops[s.producer_op].name == "aten._to_copy.default" and prof.ops[s.producer_op].inputs[0] in parameters}


def test_profile_under_autocast_records_bf16_weight_copies():
    w, prof = _bf16_gpt()
    assert prof.workload["autocast"] == "bf16"
    copies = _weight_copies(prof)
    linears = [m for m in w.model.modules() if isinstance(m, torch.nn.Linear)]
    assert len(copies) >= len(linears) - 1  # the tied lm_head's copy is made once, as every other weight's
    assert all(s.dtype == "torch.bfloat16" for s in prof.saved_tensors if s.id in copies)


def test_weight_copies_are_recomputed_never_swapped():
    from regen.planner.graph import build_graph

    _, prof = _bf16_gpt()
    copies = _weight_copies(prof)
    graph = build_graph(prof, 1e9, 1e9)  # a link under which swapping anything is cheap
    by_id = graph.by_saved_id()
    for sid in copies:
        c = by_id[sid]
        assert not c.can_swap and c.can_recompute and len(c.recipes[0].ops) == 1, sid
    plan = _plan("hybrid")
    decisions = {d.saved_tensor: d for d in plan.decisions}
    assert plan.action_counts()["swap"] > 0  # the link is used: other tensors are swapped
    assert not [sid for sid in copies if decisions[sid].action == "swap"]
    assert any(decisions[sid].action == "recompute" for sid in copies)


@pytest.mark.parametrize("strategy", ["recompute", "hybrid", "checkpoint-blocks"])
def test_bf16_plans_give_unplanned_gradients(strategy):
    """Recipes (the weight copies' among them), swaps over the emulated link, and regions, which replay
    a block's call under the autocast state it ran with (bf16, in a backward outside autocast)."""
    w, _ = _bf16_gpt()
    plan = _plan(strategy)
    assert strategy != "checkpoint-blocks" or plan.regions
    reference = _run(w)
    assert reference[0].dtype == torch.float32 and any(g.dtype == torch.float32 for g in reference[1].values())
    with regen.apply(w.model, plan, emulate_link=True) as handle:
        first = _run(w)
        second = _run(w)  # the pack-order fast path
        inside = _run(w, backward_autocast=True)  # backward inside the autocast block, as many loops write it
    for planned in (first, second, inside):
        assert_same(reference, planned)
    assert handle.stats.planned_steps == 3
    assert handle.stats.recomputes > 0 or handle.stats.region_replays == 3 * len(plan.regions) > 0
    assert_nothing_left(handle, w.model)


def test_recipes_replay_with_autocast_off_when_backward_runs_under_autocast():
    """Recipe ops are recorded below autocast (the casts it chose are ops of their own): a backward
    inside an autocast block must not cast them again. An fp32 forward, backward under bf16 autocast."""
    w = build_workload("gpt", batch_size=2, args=TINY_GPT)
    prof = profile(w)
    plan = solve_halfway(prof, "recompute")
    recipe_names = {prof.ops[i].name for d in plan.decisions if d.action == "recompute" for i in d.recipe}
    assert "aten.addmm.default" in recipe_names  # an op autocast would run in bf16
    reference = _run(w, forward_autocast=False, backward_autocast=True)
    with regen.apply(w.model, plan) as handle:
        planned = _run(w, forward_autocast=False, backward_autocast=True)
    assert_same(reference, planned)
    assert handle.stats.recomputes > 0


def test_cli_profiles_under_autocast(tmp_path, capsys):
    from regen.cli import main
    from regen.formats import load_profile

    out = tmp_path / "p.yaml"
    assert main(["profile", "--model", "mlp", "--autocast", "bf16", "--batch-size", "4", "--arg", "hidden=32",
                 "--arg", "depth=2", "--repeats", "1", "--warmup", "0", "-q", "-o", str(out)]) == 0
    loaded = load_profile(out)
    assert loaded.workload["autocast"] == "bf16"
    assert any(t.dtype == "torch.bfloat16" for t in loaded.tensors)
    config = tmp_path / "c.yaml"
    config.write_text("workload: mlp\nautocast: fp8\n")
    assert main(["profile", "--config", str(config), "-q", "-o", str(out)]) == 2
    assert "autocast 'fp8': use one of bf16, fp16" in capsys.readouterr().err
