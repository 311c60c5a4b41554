"""A plan applied to another batch shape or model raises PlanMismatchError with on_mismatch="raise", or
warns and runs the step unplanned (same gradients as without regen); under the default ("dynamic") a call
whose steps keep leaving their plan mid-step runs in dynamic mode (a step that leaves it in forward goes on in
dynamic mode)."""

import warnings

import pytest
import torch
from torch import nn

import regen
from common import assert_nothing_left, assert_same, make, run_and_grads, step, traced
from handmade import PLANS, trace_workload
from regen.errors import FormatError, PlanMismatchError, RegenError
from regen.runtime import PlanMismatchWarning
from regen.workloads import Workload, call_model, compute_loss


def test_other_batch_size_raises():
    _, trace = traced("gpt")
    plan = PLANS["hybrid"](trace)
    other = make("gpt", batch_size=2)
    with pytest.raises(PlanMismatchError, match="plan expects"):
        with regen.apply(other.model, plan, on_mismatch="raise") as handle:
            step(other)
    assert_nothing_left(handle, other.model)
    other.model.zero_grad(set_to_none=True)
    step(other)  # the model trains normally afterwards


def test_other_batch_size_keep_runs_unplanned():
    _, trace = traced("gpt")
    plan = PLANS["hybrid"](trace)
    other = make("gpt", batch_size=2)
    reference = run_and_grads(other)
    with regen.apply(other.model, plan, on_mismatch="keep") as handle:
        with pytest.warns(PlanMismatchWarning, match="unplanned"):
            planned = run_and_grads(other)
    assert_same(reference, planned)
    assert handle.stats.unplanned_steps == 1 and handle.stats.planned_steps == 0
    assert handle.stats.swapped_tensors == 0 and handle.stats.dropped_tensors == 0
    assert_nothing_left(handle, other.model)


def test_other_model_raises():
    _, trace = traced("mlp")
    plan = PLANS["swap"](trace)
    cnn = make("cnn")
    with pytest.raises(PlanMismatchError):
        with regen.apply(cnn.model, plan, on_mismatch="raise"):
            step(cnn)


class _MLP(torch.nn.Module):
    def __init__(self, act):
        super().__init__()
        torch.manual_seed(0)
        self.a, self.b, self.act = torch.nn.Linear(32, 32), torch.nn.Linear(32, 1), act

    def forward(self, x):
        return self.b(self.act(self.a(x))).pow(2).mean()


def test_same_shapes_other_ops_caught_by_fingerprint():
    """Every saved tensor has the plan's shape and dtype; only the fingerprint tells the models apart."""
    from regen.workloads import Workload
    from handmade import trace_workload

    x = torch.randn(8, 32)
    relu = Workload(name="relu", model=_MLP(torch.nn.ReLU()), batch=(x,), loss_fn=None)
    tanh = Workload(name="tanh", model=_MLP(torch.nn.Tanh()), batch=(x,), loss_fn=None)
    plan = PLANS["swap"](trace_workload(relu))
    assert trace_workload(tanh).num_forward_ops == plan.num_forward_ops
    with pytest.raises(PlanMismatchError, match="fingerprint"):
        with regen.apply(tanh.model, plan, on_mismatch="raise"):
            step(tanh)
    with regen.apply(relu.model, plan) as handle:  # the right model passes
        step(relu)
    assert handle.stats.planned_steps == 1


def test_recipe_op_name_is_checked():
    w, trace = traced("mlp")
    plan = PLANS["recompute"](trace)
    plan.recipe_ops[0].name = "aten.cos.default"
    with pytest.raises(PlanMismatchError, match="aten.cos.default"):
        with regen.apply(w.model, plan, on_mismatch="raise"):
            step(w)


def test_no_grad_forwards_are_left_alone():
    w, trace = traced("gpt")
    plan = PLANS["hybrid"](trace)
    with regen.apply(w.model, plan) as handle:
        with torch.no_grad():
            w.model(*w.batch)
        assert handle.stats.steps == 0
        assert torch._C._autograd._top_saved_tensors_default_hooks(False) is None
        reference = run_and_grads(w)  # inside: the first training step is planned
    assert handle.stats.steps == 1 and handle.stats.planned_steps == 1
    assert_same(reference, run_and_grads(w))


def test_eval_forwards_with_grad_are_planned_when_their_ops_match():
    """eval() with grad (no dropout or batch norm in the mlp): the same ops, a planned step."""
    w, trace = traced("mlp")
    plan = PLANS["recompute"](trace)
    w.model.eval()
    try:
        reference = run_and_grads(w)
        with regen.apply(w.model, plan) as handle:
            planned = run_and_grads(w)
    finally:
        w.model.train()
    assert_same(reference, planned)
    assert handle.stats.planned_steps == 1 and handle.stats.dropped_tensors > 0


def test_eval_forwards_with_grad_and_other_ops_are_a_mismatch():
    """eval() with grad on a model with dropout runs other ops than the plan's: never silently unplanned."""
    w, trace = traced("gpt")
    plan = PLANS["recompute"](trace)
    w.model.eval()
    try:
        with pytest.raises(PlanMismatchError):
            with regen.apply(w.model, plan, on_mismatch="raise"):
                step(w)
        with regen.apply(w.model, plan, on_mismatch="keep") as handle:
            with pytest.warns(PlanMismatchWarning):
                step(w)
    finally:
        w.model.train()
    assert handle.stats.unplanned_steps == 1 and handle.stats.planned_steps == 0


class Stack(torch.nn.Module):
    """`depth` identical layers: a shorter stack runs the same ops as a prefix of a longer one."""

    def __init__(self, depth: int):
        super().__init__()
        torch.manual_seed(0)
        self.layers = torch.nn.ModuleList(torch.nn.Linear(32, 32) for _ in range(depth))

    def forward(self, x):
        for layer in self.layers:
            x = torch.tanh(layer(x))
        return x.pow(2).mean()


def stack_workload(depth: int) -> Workload:
    return Workload(name=f"stack-{depth}", model=Stack(depth), batch=(torch.randn(64, 32),), loss_fn=None)


@pytest.mark.parametrize("strategy", ["keep-all", "swap", "recompute"])
def test_a_forward_shorter_than_the_plan_is_a_mismatch(strategy):
    """A plan for a 2-layer stack on a 1-layer one: its forward ends (backward begins) before the plan's."""
    plan = PLANS[strategy](trace_workload(stack_workload(2)))
    shorter = stack_workload(1)
    why = "the forward ran|the plan's recipe expects"  # a recompute plan's recipe op names may see it first
    with pytest.raises(PlanMismatchError, match=why):
        with regen.apply(shorter.model, plan, on_mismatch="raise"):
            step(shorter)
    with regen.apply(shorter.model, plan, on_mismatch="keep") as handle:
        with pytest.warns(PlanMismatchWarning, match=why):
            step(shorter)
    assert handle.stats.unplanned_steps == 1 and handle.stats.planned_steps == 0


def test_bad_arguments_are_clear_errors():
    w, trace = traced("mlp")
    plan = PLANS["recompute"](trace)
    with pytest.raises(RegenError, match="on_mismatch"):
        regen.apply(w.model, plan, on_mismatch="ignore")
    with pytest.raises(RegenError, match="Plan"):
        regen.apply(w.model, {"decisions": []})
    with pytest.raises(RegenError, match="solve it again"):  # a handmade plan names no ops for a compiled graph
        regen.apply(torch.compile(w.model), plan)  # compiled lazily: nothing is compiled here
    broken = PLANS["recompute"](trace)
    d = next(d for d in broken.decisions if d.action == "recompute")
    d.recipe = [r for r in d.recipe if r != d.producer_op]
    with pytest.raises(FormatError, match="producer"):
        regen.apply(w.model, broken)
    assert not w.model._forward_pre_hooks


def _gradient_penalty_step(w):
    """A step whose backward runs with create_graph=True (a gradient penalty), then the real backward."""
    torch.manual_seed(1234)
    loss = compute_loss(w.name, call_model(w.model, w.batch), w.batch, w.loss_fn)
    params = [p for p in w.model.parameters() if p.requires_grad]
    grads = torch.autograd.grad(loss, params, create_graph=True)
    (loss + sum(g.pow(2).sum() for g in grads)).backward()
    return {n: p.grad.detach().clone() for n, p in w.model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("strategy", ["recompute", "swap"])
def test_double_backward_is_a_mismatch(strategy):
    """What a create_graph backward saves is outside the plan: raise, naming the cause."""
    w, trace = traced("mlp")
    plan = PLANS[strategy](trace)
    with pytest.raises(PlanMismatchError, match="create_graph=True"):
        with regen.apply(w.model, plan, on_mismatch="raise") as handle:
            _gradient_penalty_step(w)
    assert_nothing_left(handle, w.model)
    w.model.zero_grad(set_to_none=True)


def test_double_backward_keep_warns_and_gives_the_unplanned_gradients():
    w, trace = traced("mlp")
    plan = PLANS["recompute"](trace)
    w.model.zero_grad(set_to_none=True)
    reference = _gradient_penalty_step(w)
    w.model.zero_grad(set_to_none=True)
    with regen.apply(w.model, plan, on_mismatch="keep") as handle:
        with pytest.warns(PlanMismatchWarning, match="create_graph=True"):
            planned = _gradient_penalty_step(w)
        w.model.zero_grad(set_to_none=True)
        run_and_grads(w)  # a plain step afterwards follows the plan
    assert reference.keys() == planned.keys()
    for name in reference:
        assert torch.equal(reference[name], planned[name]), name
    assert handle.stats.unplanned_steps == 1 and handle.stats.planned_steps == 1
    assert_nothing_left(handle, w.model)


class _BuiltAtFirstCall(torch.nn.Module):
    """Sets a buffer at its first call, midway through its forward (a model that builds modules or buffers
    at its first call, as BigBird does): the profile's warm-up step hides it."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.a, self.b, self.c = torch.nn.Linear(32, 64), torch.nn.Linear(64, 64), torch.nn.Linear(64, 1)
        self.register_buffer("scale", torch.zeros(64))
        self.built = False

    def forward(self, x):
        h = torch.tanh(self.b(torch.tanh(self.a(x))))
        if not self.built:
            self.scale.fill_(0.5)
            self.built = True
        return self.c(torch.tanh(h * self.scale)).pow(2).mean()


def _first_call_workload() -> Workload:
    return Workload(name="built-at-first-call", model=_BuiltAtFirstCall(), batch=(torch.randn(256, 32),), loss_fn=None)


def _recompute_plan(w: Workload):
    from regen.planner import solve_within_reach
    from regen.profiler import profile_workload

    profile = profile_workload(w, device="cpu", repeats=1, warmup_steps=1, progress=None)
    start = profile.memory_at_start_bytes
    plan = solve_within_reach(profile, start + (profile.peak_bytes - start) // 2, "recompute", time_limit_s=30)
    assert plan.action_counts()["recompute"] > 0 and plan.call is not None
    return plan


def test_a_step_that_leaves_its_plan_mid_step_runs_the_rest_in_dynamic_mode_and_the_next_keep_the_plan():
    plan = _recompute_plan(_first_call_workload())
    reference_w = _first_call_workload()
    reference = [run_and_grads(reference_w) for _ in range(3)]
    w = _first_call_workload()
    with regen.apply(w.model, plan) as handle:
        with pytest.warns(PlanMismatchWarning, match="rest of this step runs in dynamic mode under the cap"):
            first = run_and_grads(w)
        later = [run_and_grads(w) for _ in range(2)]
    for a, b in zip(reference, [first] + later):
        assert_same(a, b)
    assert handle.stats.unplanned_steps == 0 and handle.stats.dynamic_steps == 1 and handle.stats.planned_steps == 2
    assert handle.dynamic_stats.steps == 1
    assert_nothing_left(handle, w.model)


def test_a_call_whose_steps_keep_leaving_their_plan_runs_in_dynamic_mode():
    plan = _recompute_plan(_first_call_workload())
    w = _first_call_workload()
    reference = run_and_grads(w)
    with regen.apply(w.model, plan) as handle:
        for k in range(4):
            w.model.built = False  # every step builds again: its ops leave the plan's mid-step
            said = ["rest of this step runs in dynamic mode"] * 2 + ["2 steps of this call left its plan mid-step"]
            with pytest.warns(PlanMismatchWarning, match=said[k]) if k < 3 else warnings.catch_warnings():
                assert_same(reference, run_and_grads(w))
    assert handle.stats.unplanned_steps == 0 and handle.stats.planned_steps == 0
    assert handle.stats.dynamic_steps == 4 and handle.dynamic_stats.steps == 4
    assert_nothing_left(handle, w.model)


class _Attention(nn.Module):
    """One attention call on CPU (its kernel allocates its output through the dispatcher, then fills it); with
    `detour` set, in float64 (a forward the plan did not see, which leaves it at the attention's saved query)."""

    def __init__(self):
        super().__init__()
        self.qkv = nn.Linear(32, 96)
        self.proj = nn.Linear(32, 32)
        self.detour = False

    def forward(self, x):
        q, k, v = self.qkv(x).view(4, 16, 3, 2, 16).permute(2, 0, 3, 1, 4).unbind(0)
        if self.detour:
            q, k, v = q.double(), k.double(), v.double()
        out = torch.nn.functional.scaled_dot_product_attention(q, k, v).float()
        return self.proj(out.transpose(1, 2).reshape(4, 16, 32)).pow(2).mean()


def test_a_step_that_leaves_its_plan_at_a_kernels_saved_input_goes_on_exactly():
    """The step leaves its plan at the attention's saved query (another dtype), packed before the kernel runs:
    dynamic mode must not see the ops that kernel dispatches (the empty output it then fills), or a rebuild of the
    output gives the empty buffer (engine.py, `_follow_ops_from_next_module_call`). The plan keeps every tensor (its
    later steps match packs by order, with no dispatch mode)."""
    from handmade import build_plan

    torch.manual_seed(0)
    w = Workload(name="attention", model=_Attention(), batch=(torch.randn(4, 16, 32),), loss_fn=None)
    plan = build_plan(trace_workload(w), lambda i, c: "keep", "keep")
    # the model, its gradients and 64 KiB: a dynamic mode that saw the kernel's own ops dropped its output and
    # rebuilt an empty buffer here
    plan.memory_cap_bytes = sum(p.numel() * 4 for p in w.model.parameters()) * 2 + 64 * 1024
    w.model.detour = True
    reference = run_and_grads(w)
    w.model.detour = False
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the leaving step's, and a cap no step can hold
        with regen.apply(w.model, plan) as handle:
            run_and_grads(w)  # the verified step
            w.model.detour = True
            got = run_and_grads(w)
    assert_same(reference, got)
    assert handle.stats.dynamic_steps == 1
