"""Planned steps give the unplanned loss and gradients bit for bit, dropout included, on every built-in
workload and Hugging Face GPT-2/BERT, under hand-made keep-all, swap, recompute and hybrid plans."""

import pytest
import torch

import regen
from common import assert_same, run_and_grads, traced
from handmade import PLANS, trace_workload
from regen.workloads import Workload

WORKLOADS = ["mlp", "cnn", "gpt", "hf-gpt2", "hf-bert"]


@pytest.mark.parametrize("name", WORKLOADS)
@pytest.mark.parametrize("strategy", list(PLANS))
def test_planned_step_matches_unplanned(name, strategy):
    if name.startswith("hf-"):
        pytest.importorskip("transformers")
    w, trace = traced(name)
    plan = PLANS[strategy](trace)
    counts = plan.action_counts()
    if strategy != "keep-all":
        assert counts["keep"] < len(plan.decisions), "the hand-made plan must act on something"
    reference = run_and_grads(w)
    with regen.apply(w.model, plan) as handle:
        planned = run_and_grads(w)
    assert_same(reference, planned)
    stats = handle.stats
    assert stats.steps == 1 and stats.planned_steps == 1 and stats.unplanned_steps == 0
    assert stats.swapped_tensors == counts["swap"]
    assert stats.dropped_tensors == counts["recompute"]
    assert stats.recomputes >= counts["recompute"]  # each dropped tensor was rebuilt (nested ones once)
    assert handle.pool.checked_out_bytes == 0 and handle.active_steps == 0
    assert not handle.hooks_installed


class NoisyMLP(torch.nn.Module):
    """Functional random ops (native_dropout, normal): on CPU, nn.Dropout decomposes into in-place ops
    that are never recomputed, so this model is what makes recipes replay random ops."""

    def __init__(self, width=64, depth=3):
        super().__init__()
        self.layers = torch.nn.ModuleList(torch.nn.Linear(width, width) for _ in range(depth))

    def forward(self, x):
        for layer in self.layers:
            h, _ = torch.native_dropout(layer(x), 0.3, True)
            x = torch.tanh(torch.normal(h, 0.05))
        return x.pow(2).mean()


def noisy_workload():
    torch.manual_seed(0)
    return Workload(name="noisy", model=NoisyMLP(), batch=(torch.randn(16, 64),), loss_fn=None)


def test_random_ops_are_replayed_with_their_rng_state():
    w = noisy_workload()
    trace = trace_workload(w)
    plan = PLANS["recompute"](trace)
    random_recipes = [d for d in plan.decisions if d.action == "recompute"
                      and any(r.is_random for r in plan.recipe_ops if r.index in d.recipe)]
    assert len(random_recipes) >= 2, "expected recipes that replay native_dropout / normal"
    reference = run_and_grads(w, seed=7)
    with regen.apply(w.model, plan) as handle:
        planned = run_and_grads(w, seed=7)
        after_planned = torch.rand(3)
    assert_same(reference, planned)
    assert handle.stats.recomputes >= len(random_recipes)
    # the ambient RNG stream is where an unplanned step leaves it: replays restored it
    run_and_grads(w, seed=7)
    assert torch.equal(torch.rand(3), after_planned)
