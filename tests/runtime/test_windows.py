"""Tracking windows (regen.runtime.window_hooks): a fast step's dispatch mode follows only the ops around what
its recipes capture and read, opened at the module calls the plan names, and loss, gradients and module
buffers (BatchNorm running statistics) stay bitwise the unplanned ones."""

import functools
import importlib
from dataclasses import replace

import pytest
import torch

import regen
from common import assert_nothing_left, assert_same, make, run_and_grads
from regen.runtime.window_hooks import ROOT, tracking_windows
from regen.workloads import Workload

forward_ops_module = importlib.import_module("regen.runtime.forward_ops")
STEPS = 4


def test_each_tracked_op_is_followed_from_the_latest_call_that_started_before_it():
    entries = {("a", 0): 2, ("b", 0): 10, ("c", 0): 11, ("d", 0): 25, ("a", 1): 40}
    windows = tracking_windows(frozenset({3, 5, 12, 13, 30}), entries)
    assert windows.opens == {("a", 0): (2, 5), ("c", 0): (11, 13), ("d", 0): (25, 30)}
    assert windows.at_step_start() is None
    # an op before every recorded call: from the step's start; a call inside (or right after) an open window
    # opens nothing
    assert tracking_windows(frozenset({1, 4}), {("a", 0): 2}).opens == {ROOT: (0, 4)}
    assert tracking_windows(frozenset(), entries).opens == {}


def test_a_window_runs_on_to_the_first_pack_after_its_last_tracked_op():
    """The runtime lets its dispatch mode go in a pack hook: given the ops after which the forward packs,
    the shared rule ends each window there, and a window that then reaches the next one merges with it."""
    from regen.formats.plan_rules import merged_windows

    starts = [(0, "root"), (8, "a"), (30, "b")]
    assert merged_windows(starts, {3, 31}) == [(0, 3, "root"), (30, 31, "b")]
    assert merged_windows(starts, {3, 31}, [2, 5, 40]) == [(0, 5, "root"), (30, 40, "b")]
    assert merged_windows(starts, {3, 12}, [9, 20]) == [(0, 20, "root")]  # [0, 9] then [8, 20]: one window
    assert merged_windows(starts, {45}, [9, 20]) == [(30, 45, "b")]  # no pack after it: to the op itself


class _BnBlock(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1, self.bn, self.fc2 = torch.nn.Linear(64, 256), torch.nn.BatchNorm1d(256), torch.nn.Linear(256, 64)

    def forward(self, x):
        return x + self.fc2(torch.relu(self.bn(self.fc1(x))))


class _BnNet(torch.nn.Module):
    """Residual blocks with BatchNorm: their running statistics must end as without a plan."""

    def __init__(self):
        super().__init__()
        self.blocks = torch.nn.Sequential(*[_BnBlock() for _ in range(4)])
        self.head = torch.nn.Linear(64, 1)

    def forward(self, x):
        return self.head(self.blocks(x)).square().mean()


@functools.lru_cache(maxsize=None)
def _recipe_plan(name: str):
    """(workload, plan, profile) of a recompute plan with per-tensor recipes from a real profile: the built-in GPT
    as solved; the BatchNorm blocks with the recipes past their first block only (no regions), and every module call
    named as a window start (the runtime then opens each window at the latest call before its tracked
    ops, whatever the solver chose)."""
    from regen.planner import solve
    from plans import profile as fixed_profile  # fixed times: the same plan on a busy machine
    from regen.planner.graph import build_graph

    if name == "gpt":
        w, fraction = make("gpt"), 0.9
    else:
        torch.manual_seed(0)
        w, fraction = Workload(name="bn-blocks", model=_BnNet(), batch=(torch.randn(512, 64),), loss_fn=None), 0.7
    profile = fixed_profile(w)
    # the BatchNorm blocks are solved without their module calls, so without regions: per-tensor recipes only (a
    # block replayed whole may simulate faster, and the planner then takes it), windows named from the calls below
    solved = profile if name == "gpt" else replace(profile, module_calls=[])
    plan = solve(solved, memory_cap_bytes=int(profile.peak_bytes * fraction), strategy="recompute", time_limit_s=30)
    if name != "gpt":  # only the recipes past the first block: no window can open at the step's start
        cutoff = profile.module_calls[[c.module for c in profile.module_calls].index("blocks.1")].first_op
        for d in plan.decisions:
            if d.action == "recompute" and min(d.recipe) < cutoff:
                d.action, d.recipe, d.recipe_inputs, d.recompute_before_op, d.rebuilt_with = "keep", [], [], None, None
        used = {q for d in plan.decisions for q in d.recipe}
        plan = replace(plan, tracking_starts=build_graph(profile).window_starts.starts,
                       recipe_ops=[r for r in plan.recipe_ops if r.index in used])
    return w, plan, profile


@pytest.mark.parametrize("name", ["gpt", "bn-blocks"])
def test_fast_steps_follow_only_their_windows_and_match_the_unplanned_run(name, monkeypatch):
    from plan_choices import choices_from_plan
    from regen.planner.graph import build_graph
    from regen.planner.simulator import tracked_forward_ops

    w, plan, profile = _recipe_plan(name)
    recipe_ops = {r.index for r in plan.recipe_ops}
    assert recipe_ops and plan.tracking_starts
    assert any(s.module for s in plan.tracking_starts), "the plan opens a window at some module call"
    seen: list[set[int]] = []
    real_fast_op = forward_ops_module.ForwardOps.fast_op

    def fast_op(self, func, args, kwargs):
        seen[-1].add(self.count)
        return real_fast_op(self, func, args, kwargs)

    monkeypatch.setattr(forward_ops_module.ForwardOps, "fast_op", fast_op)
    references = [run_and_grads(w, seed=s) for s in range(STEPS)]
    with regen.apply(w.model, plan) as handle:
        for s in range(STEPS):
            seen.append(set())
            assert_same(references[s], run_and_grads(w, seed=s))  # loss, gradients and module buffers
        fast = handle.plan_states[0].fast_ops
    assert handle.stats.planned_steps == STEPS and handle.stats.recomputes > 0
    assert any(key != ROOT for key in fast.windows.opens)  # a module call's hook opened a window
    assert not seen[0]  # the verified step follows every op (slow path)
    for ops in seen[1:]:
        assert fast.tracked <= ops  # every recipe op and producer it reads was seen...
        assert len(ops) < max(fast.tracked)  # ... and fewer ops than from the first to the last of them
        assert ops == seen[1]
    graph = build_graph(profile)
    # the planner charges exactly the ops the runtime follows: a window runs on to the pack after its last op
    assert seen[1] == tracked_forward_ops(graph, choices_from_plan(graph, plan))
    assert_nothing_left(handle, w.model)


def test_a_plan_naming_a_module_the_model_lacks_is_one_clear_error():
    from regen.errors import PlanMismatchError
    from regen.formats.plan import TrackingStart

    w, plan, _ = _recipe_plan("gpt")
    other = replace(plan, tracking_starts=[TrackingStart("blocks.99", 0, 3)])
    with pytest.raises(PlanMismatchError, match="blocks.99"):
        regen.apply(w.model, other)
