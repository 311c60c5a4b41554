"""Random ops given a private `torch.Generator` (`torch.randn(..., generator=g)`): a recipe replays them
with the state that generator had at the original call and leaves it where the step left it; a module
call that draws from one is never a region (its replay could not restore it)."""

import torch

import regen
from common import assert_same, run_and_grads
from handmade import PLANS, trace_workload
from regen.workloads import Workload

STEPS = 3
SEED = 11


class PrivateNoise(torch.nn.Module):
    def __init__(self, width=32, depth=3):
        super().__init__()
        torch.manual_seed(0)
        self.layers = torch.nn.ModuleList(torch.nn.Linear(width, width) for _ in range(depth))
        self.generator = torch.Generator().manual_seed(SEED)

    def forward(self, x):
        for layer in self.layers:
            h = layer(x)
            x = torch.tanh(h + torch.randn(h.shape, generator=self.generator))
        return x.pow(2).mean()


def _workload():
    return Workload(name="private", model=PrivateNoise(), batch=(torch.randn(8, 32),), loss_fn=None)


def _steps(w):
    """Loss, gradients and buffers of each step, with the private generator's state after it."""
    results = []
    for k in range(STEPS):
        results.append((run_and_grads(w, seed=20 + k), w.model.generator.get_state()))
    return results


def test_recipes_replay_private_generators_and_leave_them_where_the_step_did():
    w = _workload()
    plan = PLANS["recompute"](trace_workload(w))
    random_ops = {r.index for r in plan.recipe_ops if r.is_random and r.name == "aten.randn.generator"}
    assert random_ops and any(set(d.recipe) & random_ops for d in plan.decisions if d.action == "recompute")
    w.model.generator.manual_seed(SEED)
    references = _steps(w)
    w.model.generator.manual_seed(SEED)
    with regen.apply(w.model, plan) as handle:
        planned = _steps(w)
    for (reference, state), (got, got_state) in zip(references, planned):
        assert_same(reference, got)
        assert torch.equal(state, got_state), "the replay moved the user's generator"
    assert handle.stats.planned_steps == STEPS and handle.stats.recomputes > 0


class NoisyBlock(torch.nn.Module):
    def __init__(self, generator):
        super().__init__()
        self.lin = torch.nn.Linear(32, 32)
        self.generator = generator

    def forward(self, x):
        h = self.lin(x)
        return torch.tanh(h * torch.randn(h.shape, generator=self.generator))


class Blocks(torch.nn.Module):
    def __init__(self, generator):
        super().__init__()
        torch.manual_seed(0)
        self.blocks = torch.nn.Sequential(*(NoisyBlock(generator) for _ in range(3)))

    def forward(self, x):
        return self.blocks(x).pow(2).mean()


def _regions(generator):
    from regen.planner.graph import build_graph
    from regen.profiler import profile_workload

    w = Workload(name="blocks", model=Blocks(generator), batch=(torch.randn(64, 32),), loss_fn=None)
    profile = profile_workload(w, device="cpu", repeats=1, warmup_steps=0, progress=None)
    flagged = [op.index for op in profile.ops if op.private_generator]
    return flagged, [(r.call.module, r.call.call) for r in build_graph(profile).regions]


def test_a_module_call_drawing_from_a_private_generator_is_never_a_region():
    flagged, regions = _regions(None)
    assert not flagged and {m for m, _ in regions} >= {"blocks.0", "blocks.1"}  # the global RNG: replayable
    flagged, regions = _regions(torch.Generator().manual_seed(SEED))
    assert len(flagged) == 3
    assert not [m for m, _ in regions if m.startswith("blocks.")]
