"""Models that regen profiles and plans end to end (regen.profiler, regen.planner, regen.apply), in the ways
a training loop uses them: an LSTM whose kernel returns other outputs without grad, a user's forward
pre-hook on the root module, and a module used two ways in one loop (a GAN's discriminator, planned by a
plan set). Each planned step gives the unplanned loss, gradients and buffers bit for bit."""

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import regen
import regen.formats
from common import assert_same, run_and_grads
from plans import profile as fixed_profile
from regen.errors import InfeasibleCapError, PlanMismatchError, RegenError
from regen.planner import solve
from regen.runtime import PlanMismatchWarning
from regen.workloads import Workload

LINK_RATIO = 0.5  # a CPU profile plans swaps only over a given link (docs/limitations.md "CPU vs GPU")


def _profile(w: Workload):
    """A profile with fixed times (tests/plans.py): the plans solved from it are the same on a busy machine."""
    return fixed_profile(w)


def _solve_tight(profile, strategy: str, fraction: float = 0.5):
    """A plan at `fraction` of the unplanned peak, or at the smallest cap the strategy reaches."""
    link = {} if strategy == "recompute" else {"link_ratio": LINK_RATIO}
    try:
        return solve(profile, int(profile.peak_bytes * fraction), strategy=strategy, time_limit_s=30, **link)
    except InfeasibleCapError as exc:
        return solve(profile, exc.smallest_feasible_cap_bytes, strategy=strategy, time_limit_s=30, **link)


def _count(plan, action: str) -> int:
    return sum(1 for d in plan.decisions if d.action == action)


# ---- an LSTM under recompute ---------------------------------------------------------------------


class TwoLayerLSTM(nn.Module):
    def __init__(self):
        super().__init__()
        self.lstm = nn.LSTM(8, 16, num_layers=2, batch_first=True)
        self.head = nn.Linear(16, 1)

    def forward(self, x):
        return self.head(self.lstm(x)[0]).mean()


def test_lstm_recompute_replays_under_the_grad_mode_it_ran_with():
    """On CPU an LSTM layer is `aten.mkldnn_rnn_layer`, which returns its workspace only with grad on: a
    recipe replayed without grad did not rebuild it."""
    torch.manual_seed(0)
    w = Workload("lstm", TwoLayerLSTM(), (torch.randn(4, 12, 8),), None)
    plan = _solve_tight(_profile(w), "recompute")
    assert "aten.mkldnn_rnn_layer.default" in {op.name for op in plan.recipe_ops}, "no LSTM layer replayed"
    reference = run_and_grads(w)
    with regen.apply(w.model, plan) as handle:
        for _ in range(3):  # the verified step, then the fast path
            assert_same(reference, run_and_grads(w))
    assert handle.stats.planned_steps == 3 and handle.stats.recomputes > 0


# ---- a forward pre-hook on the root module -------------------------------------------------------


class MLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b, self.c = nn.Linear(8, 128), nn.Linear(128, 128), nn.Linear(128, 1)

    def forward(self, x):
        return self.c(torch.tanh(self.b(torch.tanh(self.a(x))))).mean()


@pytest.fixture(scope="module")
def hooked_mlp():
    """A model whose root has a user pre-hook that runs tensor ops, and its profile (hook included)."""
    torch.manual_seed(0)
    model = MLP()
    model.register_forward_pre_hook(lambda module, args: (args[0] * 2 + 1,))
    w = Workload("hooked", model, (torch.randn(512, 8),), None)
    return w, _profile(w)


@pytest.mark.parametrize("strategy", ["recompute", "swap", "hybrid"])
def test_root_pre_hook_ops_are_counted_at_run_time_as_in_the_profile(hooked_mlp, strategy):
    w, profile = hooked_mlp
    assert [op.name for op in profile.ops[:2]] == ["aten.mul.Tensor", "aten.add.Tensor"]  # the hook's ops
    plan = _solve_tight(profile, strategy)
    assert _count(plan, "keep") < len(plan.decisions)
    reference = run_and_grads(w)
    with regen.apply(w.model, plan, emulate_link=strategy != "recompute") as handle:
        for _ in range(3):
            assert_same(reference, run_and_grads(w))
    assert handle.stats.planned_steps == 3 and handle.stats.unplanned_steps == 0


# ---- a module used two ways: a GAN's discriminator -----------------------------------------------

BATCH = 256
ONES = torch.ones(BATCH, 1)
D_LABELS = torch.cat([torch.ones(BATCH // 2, 1), torch.zeros(BATCH // 2, 1)])


def _generator():
    return nn.Sequential(nn.Linear(16, 128), nn.ReLU(), nn.Linear(128, 32))


def _discriminator():
    return nn.Sequential(nn.Linear(32, 128), nn.LeakyReLU(0.2), nn.Linear(128, 128), nn.Tanh(), nn.Linear(128, 1))


def _bce(labels):
    return lambda out, batch: F.binary_cross_entropy_with_logits(out, labels)


@pytest.fixture(scope="module")
def gan():
    """(G, D, plan of D's own step, plan of D in G's step): D's two uses, each profiled by a workload whose
    batch is what the loop gives D there (a detached batch; the generator's output, which requires grad)."""
    torch.manual_seed(0)
    g, d = _generator(), _discriminator()
    d_step = Workload("d-step", d, (torch.randn(BATCH, 32),), _bce(D_LABELS))
    g_step = Workload("g-step", d, (torch.randn(BATCH, 32, requires_grad=True),), _bce(ONES))
    profiles = [_profile(d_step), _profile(g_step)]
    assert [p.call.inputs[0].requires_grad for p in profiles] == [False, True]
    assert profiles[0].fingerprint == profiles[1].fingerprint  # the same ops (the batch's own hooks count none)
    assert len(profiles[1].saved_entries) > len(profiles[0].saved_entries)  # the G step saves more
    plans = [_solve_tight(p, "recompute") for p in profiles]
    assert all(_count(plan, "recompute") > 0 for plan in plans)
    return g, d, plans[0], plans[1]


def _gan_loop(g, d, plans=None, steps: int = 3, **apply_kwargs):
    """SGD steps of a GAN from copies of `g` and `d`, with `d` under `plans` (or unplanned; regen.apply's
    `apply_kwargs`): every loss and the final parameters of both."""
    import copy

    g, d = copy.deepcopy(g), copy.deepcopy(d)
    opt_g, opt_d = torch.optim.SGD(g.parameters(), lr=0.1), torch.optim.SGD(d.parameters(), lr=0.1)
    handle = regen.apply(d, plans, **apply_kwargs) if plans is not None else None
    torch.manual_seed(1)
    losses = []
    try:
        for _ in range(steps):
            fake = g(torch.randn(BATCH, 16))
            real = torch.randn(BATCH, 32)
            d_input = torch.cat([real[: BATCH // 2], fake.detach()[: BATCH // 2]])
            loss_d = F.binary_cross_entropy_with_logits(d(d_input), D_LABELS)
            loss_d.backward()
            opt_d.step()
            opt_d.zero_grad()
            loss_g = F.binary_cross_entropy_with_logits(d(fake), ONES)  # D's input requires grad here
            loss_g.backward()
            opt_g.step()
            opt_g.zero_grad()
            opt_d.zero_grad()
            losses += [loss_d.detach(), loss_g.detach()]
    finally:
        if handle is not None:
            handle.remove()
    return losses, [p.detach().clone() for p in [*g.parameters(), *d.parameters()]], handle


def test_gan_discriminator_runs_each_step_under_the_plan_of_its_use(gan, tmp_path):
    g, d, plan_d, plan_g = gan
    paths = [tmp_path / "d.plan.yaml", tmp_path / "g.plan.yaml"]
    for plan, path in zip((plan_d, plan_g), paths):
        regen.formats.save_plan(plan, path)
    assert regen.load_plan(paths[1]).call == plan_g.call
    ref_losses, ref_params, _ = _gan_loop(g, d)
    losses, params, handle = _gan_loop(g, d, paths)
    assert all(torch.equal(a, b) for a, b in zip(ref_losses, losses))
    assert all(torch.equal(a, b) for a, b in zip(ref_params, params))
    assert handle.stats.planned_steps == 6 and handle.stats.unplanned_steps == 0
    assert handle.stats.recomputes >= 6 * 2
    assert all(s.verified and s.pack_sequence is not None for s in handle.plan_states)  # each its own fast path


def test_one_plan_for_a_module_used_two_ways_says_how_to_plan_both(gan):
    g, d, plan_d, _ = gan
    with pytest.raises(PlanMismatchError, match=r"input 0 requires grad here, it did not in the profiled step.*"
                                                r"regen\.apply\(model, \[plan_a, plan_b\]\)"):
        _gan_loop(g, d, plan_d, steps=1, on_mismatch="raise")


def test_a_call_no_plan_of_the_set_fits(gan):
    g, d, plan_d, plan_g = gan
    other = torch.randn(BATCH // 2, 32)
    with regen.apply(d, [plan_d, plan_g], on_mismatch="raise") as handle:
        with pytest.raises(PlanMismatchError, match=r"none of the plan set's .*plan 0: 0: \[256, 32\] float32"):
            d(other).sum().backward()
    with regen.apply(d, [plan_d, plan_g], on_mismatch="keep") as handle:
        with pytest.warns(PlanMismatchWarning, match="none of the plan set's"):
            d(other).sum().backward()
        assert handle.stats.unplanned_steps == 1 and handle.active_steps == 0


def test_a_plan_set_needs_one_plan_per_call(gan):
    import copy

    _, d, plan_d, plan_g = gan
    with pytest.raises(RegenError, match="plans 0 and 1 of the set were profiled with the same call"):
        regen.apply(d, [plan_d, plan_d])
    old = copy.deepcopy(plan_g)
    old.call = None
    with pytest.raises(RegenError, match="plan 1 of the set does not record how its step called the model"):
        regen.apply(d, [plan_d, old])
    with pytest.raises(RegenError, match="an empty list of plans"):
        regen.apply(d, [])


# ---- two models, each under its own handle, trained in turn -------------------------------------------


def _hook_stack_depth() -> int:
    """How many saved-tensor hooks autograd's stack holds on this thread."""
    from regen.runtime.stacks import _hook_stack

    return len(_hook_stack())


@pytest.mark.parametrize("mode", ["planned", "dynamic"])
def test_two_handles_trained_in_turn_leave_no_hooks_behind(mode):
    """Two models trained in turn (a teacher and a student, two networks of a loop), each under its own
    handle: each step leaves its hooks pushed until the next step (they cannot be popped inside backward),
    and the next step of either handle pops them, whichever is on top, so the stacks do not grow, no
    warning is raised, and after remove() nothing is left; both models' steps stay exact."""
    from torch.overrides import _get_current_function_mode_stack
    from torch.utils._python_dispatch import _get_current_dispatch_mode_stack

    from common import make

    models = [make("gpt"), make("gpt")]
    with torch.no_grad():  # two different models
        for p in models[1].model.parameters():
            p.mul_(0.5)
    expected = [run_and_grads(w) for w in models]
    if mode == "planned":  # per-tensor recipes: the tracker (a dispatch mode) runs as well as the hooks
        plan = _solve_tight(_profile(make("gpt")), "recompute")
        assert any(d.action == "recompute" and d.region is None for d in plan.decisions)
        handles = [regen.apply(w.model, plan) for w in models]
    else:
        cap = int(_profile(make("gpt")).peak_bytes * 0.6)
        handles = [regen.apply(w.model, memory_cap=cap) for w in models]
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)
        for _ in range(4):
            for w, want in zip(models, expected):
                assert_same(run_and_grads(w), want)
            assert _hook_stack_depth() <= 1  # the last step's, popped when the next step begins
            # each handle's watchers of its last step at most (a dynamic step's backward gate, a recording step's
            # watcher), taken out of the stack under the other's when its next step begins: no growth
            assert len(_get_current_function_mode_stack()) <= 2 * len(handles)
        assert len(_get_current_function_mode_stack()) <= len(handles)  # no step records any more
    for h in handles:
        h.remove()
    assert _hook_stack_depth() == 0
    assert not any(h.hooks_installed for h in handles)
    assert not _get_current_dispatch_mode_stack() and not _get_current_function_mode_stack()


def test_a_watcher_taken_out_from_under_a_users_function_mode_leaves_the_users_in_place():
    """regen's pass-through torch function modes are taken out of the stack wherever they are when their step closes
    (regen.runtime.stacks.take_out): a user's mode above one (`with torch.device(...)`) stays, in its place, and its
    own exit pops it."""
    from torch.overrides import TorchFunctionMode, _get_current_function_mode_stack

    from regen.runtime import stacks

    class Watcher(TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            return func(*args, **(kwargs or {}))

    below, mine = Watcher(), Watcher()
    below.__enter__()
    mine.__enter__()
    with torch.device("cpu"):
        users = _get_current_function_mode_stack()[-1]
        stacks.take_out(mine)
        assert _get_current_function_mode_stack() == [below, users]
        assert torch.empty(1).device.type == "cpu"  # the user's mode still applies
        stacks.take_out(mine)  # not on the stack any more: nothing to do
    assert _get_current_function_mode_stack() == [below]
    stacks.take_out(below)
    assert _get_current_function_mode_stack() == []


def test_a_dynamic_step_over_leaves_no_mode_under_the_next_models_step():
    """Dynamic mode's dispatch mode stays pushed after a step's forward (its backward's ops count against the
    cap), and goes once no step of its handle is alive: another model's step in the same thread, and the
    program's ops between steps after it, run without it (every op would pass through it in Python). A step
    whose graph is kept alive (retain_graph) keeps it."""
    from torch.utils._python_dispatch import _get_current_dispatch_mode_stack

    from common import make

    models = [make("gpt"), make("gpt")]
    cap = int(_profile(make("gpt")).peak_bytes * 0.6)
    handles = [regen.apply(w.model, memory_cap=cap) for w in models]
    seen = []
    models[1].model.register_forward_hook(lambda *_: seen.append(list(_get_current_dispatch_mode_stack())))
    for _ in range(2):
        for w in models:
            run_and_grads(w)
    assert len(seen) == 2 and all(handles[0].mode not in stack for stack in seen)
    assert all(handles[1].mode in stack for stack in seen)
    loss = models[0].loss_fn(models[0].model(*models[0].batch), models[0].batch)
    loss.backward(retain_graph=True)
    run_and_grads(models[1])  # its step's start: model 0's step is alive (its graph kept)
    assert handles[0].mode in seen[-1]
    del loss
    for h in handles:
        h.remove()
    assert not _get_current_dispatch_mode_stack()


@pytest.mark.parametrize("around", ["each step", "the loop"])
def test_a_users_saved_tensor_hooks_around_steps_are_popped_as_the_user_meant(around):
    """A context manager's exit pops the top of the hook stack: a user's `saved_tensors_hooks` entered
    around a step (or around the whole loop) exits while the step's hooks are still on top (they cannot
    be popped inside backward) and takes them instead of its own. regen takes the user's entry out at
    its next step or remove(), so the user's hooks do not pile up or outlive their context; steps stay
    exact."""
    from common import make, step

    from regen.runtime.stacks import _hook_stack

    w = make("gpt")
    expected = run_and_grads(w)
    plan = _solve_tight(_profile(make("gpt")), "recompute")
    user_packs = []

    def user_hooks():
        def pack(x):
            user_packs.append(1)
            return x

        return torch.autograd.graph.saved_tensors_hooks(pack, lambda x: x)

    handle = regen.apply(w.model, plan)
    if around == "each step":
        for _ in range(3):
            with user_hooks():
                assert_same(run_and_grads(w), expected)
            assert len(_hook_stack()) <= 1  # the user's stale entry, taken out at the next step
    else:
        with user_hooks():
            for _ in range(3):
                assert_same(run_and_grads(w), expected)
    handle.remove()
    assert _hook_stack() == []
    user_packs.clear()
    step(w)  # no hook of the user's left to see this step's saved tensors
    assert not user_packs


# ---- a router that drops topk's values: its indices saved twice, the first save freed in forward ----------------
class DroppedValuesRouter(nn.Module):
    """`torch.topk(...)[1]`, as a mixture of experts' router writes it (DeepSeek-V3's): topk's values go at once,
    and with them its backward node and the indices it saved; the gather then saves the same indices again."""

    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(16, 8)
        self.out = nn.Linear(16, 16)

    def forward(self, x):
        scores = self.proj(x).sigmoid()
        indices = torch.topk(scores, 2, dim=-1, sorted=False)[1]
        weights = scores.gather(-1, indices)
        return self.out(x) * weights.sum(-1, keepdim=True)


@pytest.mark.parametrize("action", ["recompute", "swap"])
def test_a_storage_saved_again_after_its_first_save_was_freed_in_forward(action):
    """Note [ A handle that dies in forward ] (regen.runtime.planned_storages): the indices' planned storage is not
    released when topk's node goes in forward, so the gather's save of them is rebuilt or restored in backward,
    exactly, on every step."""
    from handmade import build_plan, trace_workload

    torch.manual_seed(0)
    w = Workload("router", DroppedValuesRouter(), (torch.randn(64, 16),), lambda out, batch: out.square().mean())
    trace = trace_workload(w)
    topk = next(op.index for op in trace.ops if op.name == "aten.topk.default")
    assert (topk, 1) in trace.candidates
    gather = next(op.index for op in trace.ops if op.name == "aten.gather.default")
    # the router's tensors only: the model's output is held by the loop through backward (dropping it frees nothing)
    plan = build_plan(trace, lambda i, c: action if c.key[0] <= gather else "keep", action)
    assert next(d for d in plan.decisions if d.producer_op == topk and d.output_slot == 1).action == action
    reference = [run_and_grads(w, seed=k) for k in range(3)]
    with regen.apply(w.model, plan, on_mismatch="raise", emulate_link=action == "swap") as handle:
        planned = [run_and_grads(w, seed=k) for k in range(3)]
        assert handle.stats.planned_steps == 3
    for a, b in zip(reference, planned):
        assert_same(a, b)


@pytest.mark.parametrize("action", ["recompute", "swap"])
def test_a_handle_that_died_in_forward_counts_as_its_unpack_done(action, monkeypatch):
    """Note [ A handle that dies in forward ], rule 2: topk's save of the indices dies in forward, so the rebuilt or
    restored storage goes at the gather's unpack, its last real use, not only when the gather's handle dies."""
    from handmade import build_plan, trace_workload
    from regen.runtime.planned_storages import PlannedStorages

    torch.manual_seed(0)
    w = Workload("router", DroppedValuesRouter(), (torch.randn(64, 16),), lambda out, batch: out.square().mean())
    trace = trace_workload(w)
    topk = next(op.index for op in trace.ops if op.name == "aten.topk.default")
    gather = next(op.index for op in trace.ops if op.name == "aten.gather.default")
    plan = build_plan(trace, lambda i, c: action if c.key[0] <= gather else "keep", action)
    events: list[str] = []
    died, drop = PlannedStorages.handle_died, PlannedStorages._drop_device_copy

    def handle_died(self, ps, unpacked):
        if ps.key == (topk, 1):
            events.append(f"died {'after' if unpacked else 'before'} its unpack")
        died(self, ps, unpacked)

    def drop_device_copy(self, ps):
        if ps.key == (topk, 1) and ps.storage is not None:
            events.append("storage dropped")
        drop(self, ps)

    monkeypatch.setattr(PlannedStorages, "handle_died", handle_died)
    monkeypatch.setattr(PlannedStorages, "_drop_device_copy", drop_device_copy)
    with regen.apply(w.model, plan, on_mismatch="raise", emulate_link=action == "swap") as handle:
        run_and_grads(w)
        assert handle.stats.planned_steps == 1
    assert events == ["died before its unpack", "storage dropped", "died after its unpack"]
