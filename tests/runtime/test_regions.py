"""Region plans in the runtime: module calls replayed in backward (Plan.regions).

Plans come from real profiles (a Llama decoder's blocks take the causal mask the model computes once, held
for their replays): per-block checkpointing (`checkpoint-blocks`) and the recompute MILP
solved with regions as the only way to recompute (per-tensor recipes switched off), at a cap between
per-block checkpointing's peak and the unplanned one, so some regions rebuild only part of what they
saved. Gradients and module buffers (BatchNorm running stats) are bitwise those of the unplanned run,
on the verified step and on the fast path; the measured peak is within the cap + 5% and within 10% of
the simulator; mismatches, exceptions, gradient accumulation and 50 steps behave as for other plans.
"""

import functools
import random
from unittest import mock

import pytest
import torch
from torch.utils._python_dispatch import _get_current_dispatch_mode_stack

import regen
from common import (accumulate_grads, assert_flat, assert_next_step_exact, assert_nothing_left, assert_same,
                    fail_inside_a_step, make, run_and_grads, step, train_fifty_steps)
from regen.errors import PlanMismatchError
from regen.measure import measure_memory
from regen.runtime import PlanMismatchWarning

CAP_TOLERANCE = 0.05
SIMULATOR_TOLERANCE = 0.10
KINDS = ["blocks", "milp"]


class _MaskedBlock(torch.nn.Module):
    def __init__(self, width: int):
        super().__init__()
        self.fc1, self.fc2 = torch.nn.Linear(width, 4 * width), torch.nn.Linear(4 * width, width)
        self.bn = torch.nn.BatchNorm1d(4 * width)

    def forward(self, x, mask):
        return x + self.fc2(torch.relu(self.bn(self.fc1(x)) + mask))


class _MaskedNet(torch.nn.Module):
    """Blocks that all take one mask the model computes and no backward saves (added, never multiplied),
    as a decoder's attention mask: a replay of a block needs it, so a region plan holds it into backward."""

    def __init__(self, width: int = 64, blocks: int = 4):
        super().__init__()
        self.embed = torch.nn.Linear(width, width)
        self.blocks = torch.nn.ModuleList(_MaskedBlock(width) for _ in range(blocks))
        self.head = torch.nn.Linear(width, 1)

    def forward(self, x):
        x = self.embed(x)
        mask = (x.detach() > 0).float().repeat(1, 4)
        for block in self.blocks:
            x = block(x, mask)
        return self.head(x).square().mean()


def _masked_workload():
    from regen.workloads import Workload

    torch.manual_seed(0)
    return Workload(name="masked-blocks", model=_MaskedNet(), batch=(torch.randn(512, 64),), loss_fn=None)


@functools.lru_cache(maxsize=None)
def _region_plan(name: str, kind: str):
    """(workload, profile, plan) of a region plan for a built-in workload (see the module doc), or for the
    masked blocks (`masked-blocks`)."""
    from regen.planner import solve
    from regen.profiler import profile_workload

    if name.startswith("hf-"):
        pytest.importorskip("transformers")
    w = _masked_workload() if name == "masked-blocks" else make(name)
    profile = profile_workload(w, device="cpu", repeats=1, warmup_steps=1, progress=None)
    blocks = solve(profile, memory_cap_bytes=profile.peak_bytes, strategy="checkpoint-blocks")
    if kind == "blocks":
        return w, profile, blocks
    cap = (blocks.simulated.peak_bytes + profile.peak_bytes) // 2
    with mock.patch("regen.planner.graph.add_recipes", lambda graph: None):
        plan = solve(profile, memory_cap_bytes=cap, strategy="recompute", time_limit_s=30)
    return w, profile, plan


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("name", ["cnn", "gpt", "hf-gpt2", "hf-llama", "masked-blocks"])
def test_gradients_and_buffers_are_bitwise_the_unplanned_ones(name, kind):
    w, _, plan = _region_plan(name, kind)
    assert plan.regions and plan.region_member_count() > 0
    reference = [run_and_grads(w) for _ in range(2)]  # loss, gradients and buffers after each step
    with regen.apply(w.model, plan) as handle:
        for ref in reference:  # the verified step, then the pack-order fast path
            assert_same(ref, run_and_grads(w))
    stats = handle.stats
    counts = plan.action_counts()
    assert stats.planned_steps == 2 and stats.region_replays == 2 * len(plan.regions)
    assert stats.dropped_tensors == 2 * counts["recompute"]
    assert stats.recomputes == 2 * (counts["recompute"] - plan.rebuilt_count() - plan.region_member_count())
    assert_nothing_left(handle, w.model)


class _HostNoiseBlock(torch.nn.Module):
    """A block that draws a mask from NumPy and a scale from Python's `random` in its forward: draws no op
    shows (older data-noise and spec-augment code does this)."""

    def __init__(self, width: int):
        super().__init__()
        self.fc1, self.fc2 = torch.nn.Linear(width, 4 * width), torch.nn.Linear(4 * width, width)

    def forward(self, x):
        import numpy

        keep = torch.from_numpy(numpy.random.rand(x.shape[0], 4 * x.shape[1]) > 0.2)
        return x + random.random() * self.fc2(torch.relu(self.fc1(x)) * keep)


class _BlockNet(torch.nn.Module):
    """`blocks` blocks of `block_class` in a row, the mean square of the last one's output the loss."""

    def __init__(self, block_class, width: int = 32, blocks: int = 3):
        super().__init__()
        self.blocks = torch.nn.ModuleList(block_class(width) for _ in range(blocks))

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        return x.square().mean()


def test_a_replay_draws_what_its_call_drew_from_python_and_numpy_and_leaves_their_states_as_they_were():
    numpy = pytest.importorskip("numpy")
    from regen.planner import solve
    from regen.profiler import profile_workload
    from regen.workloads import Workload

    torch.manual_seed(0)
    w = Workload(name="host-noise", model=_BlockNet(_HostNoiseBlock), batch=(torch.randn(64, 32),), loss_fn=None)
    profile = profile_workload(w, device="cpu", repeats=1, warmup_steps=1, progress=None)
    plan = solve(profile, memory_cap_bytes=profile.peak_bytes, strategy="checkpoint-blocks")
    assert len(plan.regions) == 3

    def two_steps():
        numpy.random.seed(7)
        random.seed(7)
        out = [run_and_grads(w) for _ in range(2)]
        return out, numpy.random.rand(), random.random()  # what the loop draws next

    reference, numpy_next, python_next = two_steps()
    with regen.apply(w.model, plan) as handle:
        planned, planned_numpy_next, planned_python_next = two_steps()
    assert handle.stats.region_replays == 2 * 3
    for ref, got in zip(reference, planned):
        assert_same(ref, got)
    assert (planned_numpy_next, planned_python_next) == (numpy_next, python_next)


def test_regions_that_draw_nothing_from_python_or_numpy_read_their_states_on_the_first_step_only():
    import regen.runtime.region_replays as region_replays

    w, _, plan = _region_plan("masked-blocks", "blocks")
    readings = []
    real = region_replays.host_rng_states
    with mock.patch.object(region_replays, "host_rng_states", lambda: readings.append(1) or real()):
        with regen.apply(w.model, plan):
            first = [run_and_grads(w), len(readings)]
            for _ in range(2):
                run_and_grads(w)
    assert first[1] == 2 * len(plan.regions)  # at each call and at its return: no draw seen
    assert len(readings) == first[1]  # later steps read nothing (about 40 us a reading)


def test_a_model_without_replayable_blocks_is_one_clear_error():
    """mlp's layers save their ReLU output, which the next layer (or the head) reads first in backward:
    no layer call can rebuild it, so there are no regions."""
    from regen.errors import RegenError
    from regen.planner import solve
    from regen.profiler import profile_workload

    w = make("mlp")
    profile = profile_workload(w, device="cpu", repeats=1, warmup_steps=0, progress=None)
    with pytest.raises(RegenError, match="no repeated blocks"):
        solve(profile, memory_cap_bytes=profile.peak_bytes, strategy="checkpoint-blocks")


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("name", ["cnn", "gpt", "hf-gpt2", "hf-llama", "masked-blocks"])
def test_measured_peak_is_within_the_cap_and_the_simulator(name, kind):
    w, profile, plan = _region_plan(name, kind)
    with regen.apply(w.model, plan):
        step(w)
        w.model.zero_grad(set_to_none=True)  # as profiled: gradients are allocated inside the step
        measured = measure_memory(lambda: step(w))
    start = profile.memory_at_start_bytes
    cap_increase = plan.memory_cap_bytes - start
    simulated_increase = plan.simulated.peak_bytes - start
    peak = measured.peak_increase_bytes
    assert peak <= cap_increase * (1 + CAP_TOLERANCE), (peak, cap_increase)
    assert abs(peak - simulated_increase) <= SIMULATOR_TOLERANCE * simulated_increase, (peak, simulated_increase)


def test_a_block_argument_no_backward_saves_is_held_until_the_last_replay_and_charged():
    """The mask every block takes is no candidate: the blocks are still regions, and a plan replaying them
    is charged the mask from after its last forward read until the last replay that takes it."""
    from dataclasses import replace

    from plan_choices import choices_from_plan
    from regen.planner.graph import build_graph
    from regen.planner.simulator import simulate

    _, profile, plan = _region_plan("masked-blocks", "blocks")
    graph = build_graph(profile)
    blocks = [r for r in graph.regions if r.call.module in {f"blocks.{k}" for k in range(4)}]
    assert len(blocks) == 4 and all(len(r.held) == 1 for r in blocks)
    mask = blocks[0].held[0]
    assert {r.held[0] for r in blocks} == {mask} and mask.bytes == 512 * 256 * 4
    assert len(plan.regions) == 4
    choices = choices_from_plan(graph, plan)
    charged = simulate(graph, choices)
    graph.regions[:] = [replace(r, held=[]) for r in graph.regions]
    added = charged.peak_bytes - simulate(graph, choices).peak_bytes  # the peak moves by a few kernel temporaries
    assert 0.95 * mask.bytes <= added <= mask.bytes, (added, mask.bytes)


class _LocalsBlock(torch.nn.Module):
    """An attention-like block whose forward keeps its score terms (no saved tensor among them) in locals until
    it returns, long past their last read, as a Funnel Transformer's attention does."""

    def __init__(self, width: int):
        super().__init__()
        self.v, self.out = torch.nn.Linear(width, width), torch.nn.Linear(width, width)

    def forward(self, x):
        scores = x @ x.transpose(1, 2)
        scaled = scores * 0.5
        shifted = scaled - 1.0
        probs = shifted.softmax(-1)
        mixed = self.out(probs @ self.v(x))
        return x + mixed


def test_a_replay_holds_what_the_modules_code_holds_and_is_charged_for_it():
    """A replay runs the block's code again, its locals included: per-block checkpointing of blocks whose
    scores live in a local to the end measures what the simulator says (Note [ A replay's memory as the
    forward measured it ]: counted only to their last read, the scores made the replays measure over it)."""
    from regen.planner import solve
    from regen.profiler import profile_workload
    from regen.workloads import Workload

    torch.manual_seed(0)
    model = torch.nn.Sequential(*(_LocalsBlock(32) for _ in range(3)))
    w = Workload(name="locals-blocks", model=model, batch=(torch.randn(8, 128, 32),),
                 loss_fn=lambda out, batch: out.square().mean())
    profile = profile_workload(w, device="cpu", repeats=1, warmup_steps=1, progress=None)
    plan = solve(profile, memory_cap_bytes=profile.peak_bytes, strategy="checkpoint-blocks")
    assert len(plan.regions) == 3
    with regen.apply(w.model, plan):
        step(w)
        w.model.zero_grad(set_to_none=True)
        measured = measure_memory(lambda: step(w)).peak_increase_bytes
    simulated = plan.simulated.peak_bytes - profile.memory_at_start_bytes
    assert abs(measured - simulated) <= 0.02 * simulated, (measured, simulated)


class _LossModuleNet(torch.nn.Module):
    """A language model that returns its loss from a loss module, as Hugging Face heads do (`self.loss_fct(...)`):
    that call runs the step's last forward ops."""

    def __init__(self, vocab: int = 64, width: int = 32):
        super().__init__()
        self.embed, self.head = torch.nn.Embedding(vocab, width), torch.nn.Linear(width, vocab)
        self.loss_fct = torch.nn.CrossEntropyLoss()

    def forward(self, ids, labels):
        logits = self.head(torch.tanh(self.embed(ids)))
        return self.loss_fct(logits.view(-1, logits.size(-1)), labels.view(-1))


def test_a_loss_module_replayed_as_a_region_closes_its_call_after_the_forward_closed():
    """The loss module's call holds the plan's last forward op, which closes the step's forward before the call
    returns; replaying it in backward still rebuilds its members, on the verified step and the fast path."""
    from regen.check import check_plan
    from regen.formats.plan import SolverReport
    from regen.planner.copy_order import order_copy_ins
    from regen.planner.export import build_plan
    from regen.planner.graph import build_graph
    from regen.planner.result import Choice, StrategyResult
    from regen.profiler import profile_workload
    from regen.workloads import Workload

    def build():
        torch.manual_seed(0)
        ids = torch.randint(0, 64, (8, 32))
        return Workload(name="loss-module", model=_LossModuleNet(), batch=(ids, ids.roll(1, 1)), loss_fn=None)

    profile = profile_workload(build(), device="cpu", repeats=1, warmup_steps=1, progress=None)
    graph = build_graph(profile)
    region = next(r for r in graph.regions if r.call.module == "loss_fct")
    choices, sim = order_copy_ins(graph, {t: Choice("recompute", region=region.index) for t in region.members},
                                  profile.peak_bytes)
    report = SolverReport(name="heuristic", status="heuristic", objective_s=sim.step_time_s, bound_s=None, gap=None,
                          solve_time_s=0.0, time_limit_s=1.0)
    plan = build_plan(graph, StrategyResult(choices=choices, report=report, predicted_step_time_s=sim.step_time_s,
                                            predicted_peak_bytes=sim.peak_bytes), profile.peak_bytes, "recompute", sim)
    assert [r.module for r in plan.regions] == ["loss_fct"]
    checked = check_plan(build, plan, timed_steps=1, compared_steps=2)
    assert not checked.differences and checked.planned_steps >= 2


def test_later_steps_run_the_forward_without_a_dispatch_mode():
    w, _, plan = _region_plan("gpt", "blocks")
    seen = []
    hook = w.model.blocks[1].register_forward_hook(lambda *_: seen.append(len(_get_current_dispatch_mode_stack())))
    try:
        with regen.apply(w.model, plan):
            run_and_grads(w)
            run_and_grads(w)
    finally:
        hook.remove()
    assert seen[0] == 1 and seen[1] == 0  # the verified step is tracked op by op, the next is not


def test_a_replay_stops_at_the_pack_of_its_last_member():
    """As torch.utils.checkpoint's early stop: block 1's replay ends where its MLP dropout packs its mask
    (the last member it rebuilds), so the dropout's multiply and the residual add after it do not run
    again: fc_out returns twice a step (forward, replay), mlp_drop once."""
    w, _, plan = _region_plan("gpt", "blocks")
    block = w.model.blocks[1]
    returned = {"fc_out": 0, "mlp_drop": 0}
    hooks = [getattr(block, name).register_forward_hook(lambda *_, name=name: returned.__setitem__(
        name, returned[name] + 1)) for name in returned]
    reference = [run_and_grads(w) for _ in range(2)]
    returned.update(fc_out=0, mlp_drop=0)
    try:
        with regen.apply(w.model, plan) as handle:
            for ref in reference:
                assert_same(ref, run_and_grads(w))
    finally:
        for h in hooks:
            h.remove()
    assert handle.stats.region_replays == 2 * len(plan.regions)
    assert returned == {"fc_out": 4, "mlp_drop": 2}


def test_other_batch_size_raises_or_runs_unplanned():
    _, _, plan = _region_plan("gpt", "blocks")
    other = make("gpt", batch_size=2)
    with pytest.raises(PlanMismatchError):
        with regen.apply(other.model, plan, on_mismatch="raise") as handle:
            step(other)
    assert_nothing_left(handle, other.model)
    reference = run_and_grads(other)
    with regen.apply(other.model, plan, on_mismatch="keep") as handle:
        with pytest.warns(PlanMismatchWarning):
            planned = run_and_grads(other)
    assert_same(reference, planned)
    assert handle.stats.unplanned_steps == 1 and handle.stats.region_replays == 0
    assert_nothing_left(handle, other.model)


class _HiddenStateBlock(torch.nn.Module):
    """A block whose forward depends on state the probe cannot see (a count kept inside a list it mutates):
    its replay in backward does not run as its forward ran."""

    def __init__(self, width: int, how: str):
        super().__init__()
        self.fc1, self.fc2 = torch.nn.Linear(width, 4 * width), torch.nn.Linear(4 * width, width)
        self.how, self.count = how, [0]

    def forward(self, x):
        self.count[0] += 1
        rows = x.shape[0]
        if self.count[0] % 2 == 0:  # the replay, as the second call of the step
            if self.how == "raises":
                raise ValueError("called twice")
            x = torch.cat([x, x])  # saves tensors twice the size
        return x[:rows] + self.fc2(torch.relu(self.fc1(x)))[:rows]


@pytest.mark.parametrize("how", ["geometry", "raises"])
def test_a_replay_that_does_not_run_as_its_forward_is_one_clear_error_naming_the_module(how):
    from regen.planner import solve
    from regen.profiler import profile_workload
    from regen.workloads import Workload

    class Net(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.blocks = torch.nn.ModuleList(_HiddenStateBlock(32, how) for _ in range(2))

        def forward(self, x):
            for b in self.blocks:
                b.count[0] = 0  # each block's call in a forward is its first of the step
                x = b(x)
            return x.square().mean()

    torch.manual_seed(0)
    w = Workload(name="hidden-state", model=Net(), batch=(torch.randn(64, 32),), loss_fn=None)
    profile = profile_workload(w, device="cpu", repeats=1, warmup_steps=0, progress=None)
    assert not any(c.leaves_behind for c in profile.module_calls)  # invisible to the probe
    plan = solve(profile, memory_cap_bytes=profile.peak_bytes, strategy="checkpoint-blocks")
    with regen.apply(w.model, plan, on_mismatch="raise"):
        loss = w.model(*w.batch)
        with pytest.raises(PlanMismatchError, match="replaying module 'blocks.1'") as caught:
            loss.backward()
    assert ("called twice" in str(caught.value)) == (how == "raises")
    assert ("storage bytes" in str(caught.value)) == (how == "geometry")


def test_a_plan_for_a_module_the_model_lacks_is_refused():
    _, _, plan = _region_plan("gpt", "blocks")
    mlp = make("mlp")
    with pytest.raises(PlanMismatchError, match="replays module"):
        regen.apply(mlp.model, plan)


@pytest.mark.parametrize("where", ["forward", "between", "backward"])
def test_exception_inside_a_step_leaves_nothing_behind(where):
    w, _, plan = _region_plan("gpt", "blocks")
    handle = fail_inside_a_step(w, plan, where)
    assert_nothing_left(handle, w.model)
    assert_next_step_exact(w, plan)


@pytest.mark.parametrize("name", ["gpt", "cnn"])
def test_gradient_accumulation_pairs_and_interleaved(name):
    w, _, plan = _region_plan(name, "milp")
    for interleaved in (False, True):  # gradients and the buffers each run left (from one start)
        reference = accumulate_grads(w, interleaved)
        with regen.apply(w.model, plan) as handle:
            planned = accumulate_grads(w, interleaved)
        assert reference.keys() == planned.keys()
        assert name != "cnn" or any(k.startswith("buffer:") for k in reference)  # BatchNorm's statistics
        assert all(torch.equal(reference[k], planned[k]) for k in reference)
        assert handle.stats.steps == 2 and handle.stats.planned_steps == 2
        assert_nothing_left(handle, w.model)


def test_fifty_steps_without_growth():
    w, _, plan = _region_plan("cnn", "blocks")
    handle, measured, tensors, _ = train_fifty_steps(w, plan)
    assert handle.stats.steps == 50 and handle.stats.planned_steps == 50
    assert handle.stats.region_replays == 50 * len(plan.regions)
    assert_flat(measured, tensors)


class _DetourBlock(torch.nn.Module):
    """relu's output (a member a replay rebuilds), then, with `detour` set, a wider second layer the plan did not
    see: its saved input has another shape, so a step leaves its plan inside this block's call."""

    def __init__(self, width: int = 32):
        super().__init__()
        self.fc1, self.fc2 = torch.nn.Linear(width, 4 * width), torch.nn.Linear(4 * width, width)
        self.fc2_wide = torch.nn.Linear(8 * width, width)
        self.detour = False

    def forward(self, x):
        a = torch.relu(self.fc1(x))
        b = self.fc2_wide(torch.cat([a, a], -1)) if self.detour else self.fc2(a)
        return x + torch.tanh(b)


def test_a_step_that_leaves_its_plan_inside_a_region_replays_it_only_up_to_what_it_dropped():
    """The step leaves its plan inside block 1's call (its detour), after dropping relu's output there: the block's
    replay, which follows the detour, stops at that pack instead of going on to the plan's last member (whose
    position the detour's packs no longer match: a PlanMismatchError in backward), and the step is exact."""
    from plans import profile as fixed_time_profile
    from regen.planner import solve
    from regen.workloads import Workload

    torch.manual_seed(0)
    w = Workload(name="detour-blocks", model=_BlockNet(_DetourBlock), batch=(torch.randn(256, 32),), loss_fn=None)
    profile = fixed_time_profile(w)
    plan = solve(profile, memory_cap_bytes=profile.peak_bytes, strategy="checkpoint-blocks")
    w.model.blocks[1].detour = True
    reference = run_and_grads(w)
    w.model.blocks[1].detour = False
    with regen.apply(w.model, plan) as handle:
        run_and_grads(w)  # the verified step
        w.model.blocks[1].detour = True
        with pytest.warns(PlanMismatchWarning, match="rest of this step runs in dynamic mode"):
            assert_same(reference, run_and_grads(w))
    assert handle.stats.dynamic_steps == 1 and handle.stats.region_replays >= 3


def test_a_step_that_leaves_its_plan_counts_what_the_planned_part_holds(monkeypatch):
    """On CPU the dynamic part of a step that left its plan in block 3 of 6 counts what the planned part made and
    the forward still holds (its frames' tensors, what it packs), and holds the plan's cap as the allocator measures
    it (without those counted: 1.105x, silent)."""
    import itertools

    from plans import profile as fixed_time_profile
    from regen.planner import solve
    from regen.runtime.dynamic import dynamic_step
    from regen.runtime.dynamic.cap_memory import model_storages
    from regen.workloads import Workload

    monkeypatch.setattr(dynamic_step, "op_clock", itertools.count().__next__)  # the same evictions on any machine
    torch.manual_seed(0)
    w = Workload(name="detour-blocks", model=_BlockNet(_DetourBlock, blocks=6), batch=(torch.randn(1024, 32),),
                 loss_fn=None)
    profile = fixed_time_profile(w)
    blocks = solve(profile, memory_cap_bytes=profile.peak_bytes, strategy="checkpoint-blocks")
    cap = int(blocks.simulated.peak_bytes + 0.3 * (profile.peak_bytes - blocks.simulated.peak_bytes))
    plan = solve(profile, memory_cap_bytes=cap, strategy="recompute", time_limit_s=30)
    w.model.zero_grad(set_to_none=True)
    start = sum(model_storages(w.model).values())
    with regen.apply(w.model, plan) as handle:
        run_and_grads(w)  # the verified step
        w.model.zero_grad(set_to_none=True)
        w.model.blocks[3].detour = True
        with pytest.warns(PlanMismatchWarning, match="rest of this step runs in dynamic mode"):
            measured = measure_memory(lambda: step(w))
    assert handle.stats.dynamic_steps == 1
    assert start + measured.peak_increase_bytes <= (1 + CAP_TOLERANCE) * plan.memory_cap_bytes
