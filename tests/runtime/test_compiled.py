"""A plan on a torch.compile'd model (regen.runtime.compiled): the compiler carries the plan's decisions out.

Two zoo decoders at their defaults (Llama and GPT-2, tiny configs at a batch where activations, not weights,
make their peaks) and the built-in GPT (dropout, its loss outside the model), profiled eagerly and solved for
recompute at half the peak increase, then trained compiled (Inductor on CPU) with and without the plan: the same
losses and module buffers bit for bit, gradients within what a differently partitioned compiled backward rounds
differently, most of the plan placed in the compiled graph, and the planned step's allocator-measured peak below
the unplanned compiled step's and within the plan's cap + 5%. A model compiled under its (eager) handle runs the
plan as one compiled first. The refusals need no compile, or a trace that stops at the model's first hook. Each
compile takes seconds (a planned one bypasses Inductor's caches): runs are shared between tests where they can be.
"""

import copy
import dataclasses
import functools

import pytest

pytest.importorskip("transformers")

import torch  # noqa: E402

import regen  # noqa: E402
from regen.errors import RegenError  # noqa: E402
from regen.formats.plan import load_plan, save_plan  # noqa: E402
from regen.measure import measure_memory  # noqa: E402
from regen.runtime.compiled import CompiledPlanWarning  # noqa: E402
from regen.workloads import build_workload, training_step  # noqa: E402

WORKLOAD = "regen.zoo:llama"
ARGS = {"size": "tiny"}
BATCH = 8
# (workload, its arguments, batch): two zoo decoders whose loss is in their forward (GPT-2 with its dropout as
# shipped and tied embeddings), and the built-in GPT (dropout, tied embeddings, its loss outside the model)
MODELS = {"llama": (WORKLOAD, ARGS, BATCH), "gpt2": ("regen.zoo:gpt2", ARGS, BATCH), "gpt": ("gpt", None, 8)}
STEPS = 2
# the planned compiled step's peak over the plan's cap, at most (regen's tolerance)
CAP_TOLERANCE = 0.05


def _compiler_settings() -> tuple:
    """The settings a planned model's calls change (Note [ Plans under torch.compile ] 7)."""
    return (torch._inductor.config.joint_custom_pre_pass, torch._inductor.config.score_fusion_memory_threshold,
            torch._functorch.config.force_non_lazy_backward_lowering)


USER_SETTINGS = _compiler_settings()
OP_TIME_S = 1e-4


def _build(model: str = "llama"):
    name, args, batch = MODELS[model]
    return build_workload(name, batch_size=batch, args=args)


@functools.lru_cache(maxsize=None)
def _profile_and_plan(model: str = "llama"):
    from plans import fixed_runtime_costs
    from regen.planner.solve import solve_within_reach
    from regen.profiler import profile_workload

    profile = profile_workload(_build(model), device="cpu", repeats=1, warmup_steps=1, progress=None)
    for op in profile.ops:  # the same op times under any load, so the same plan every run
        op.time_s = OP_TIME_S
    profile.step_time_s = profile.forward_time_s = OP_TIME_S * len(profile.ops)
    profile.runtime_costs = fixed_runtime_costs()  # and the same charges for what regen adds
    half = profile.memory_at_start_bytes + (profile.peak_bytes - profile.memory_at_start_bytes) // 2
    return profile, solve_within_reach(profile, half, "recompute", time_limit_s=10, rel_gap=0.2)


def _compile(w, how: str) -> None:
    if how == "in place":
        w.model.compile()
    else:
        w.model = torch.compile(w.model)


def _train_compiled(model: str, plan, apply_plan=regen.apply, compiled_under_the_handle: str | None = None):
    """STEPS steps of a fresh compiled model from one seed, under `apply_plan(model, plan)`: (losses, last
    gradients, buffers, last step's peak increase, the handle). `compiled_under_the_handle`: the plan is applied
    to the eager model, which is then compiled ("in place" or "wrapped")."""
    w = _build(model)
    if compiled_under_the_handle is None:
        w.model = torch.compile(w.model)
    handle = apply_plan(w.model, plan) if plan is not None else None
    if compiled_under_the_handle is not None:
        _compile(w, compiled_under_the_handle)
    losses = []
    torch.manual_seed(5)  # dropout's draws
    try:
        for k in range(STEPS):
            w.model.zero_grad(set_to_none=True)
            if k == STEPS - 1:
                measured = measure_memory(lambda: losses.append(training_step(w).detach()), collect_garbage=True)
            else:
                losses.append(training_step(w).detach())
        grads = {n.removeprefix("_orig_mod."): p.grad.clone() for n, p in w.model.named_parameters()
                 if p.grad is not None}
        buffers = {n.removeprefix("_orig_mod."): b.clone() for n, b in w.model.named_buffers()}
    finally:
        if handle is not None:
            handle.remove()
    return losses, grads, buffers, measured.peak_increase_bytes, handle


@functools.lru_cache(maxsize=None)
def _unplanned(model: str):
    """`_train_compiled` without a plan, once per model (each compile takes seconds)."""
    return _train_compiled(model, None)


@functools.lru_cache(maxsize=None)
def _planned(model: str):
    """`_train_compiled` under the model's plan (`_profile_and_plan`), once per model."""
    return _train_compiled(model, _profile_and_plan(model)[1])


@pytest.mark.parametrize("model", list(MODELS))
def test_a_compiled_model_trains_under_its_plan_within_the_cap(model):
    profile, plan = _profile_and_plan(model)
    assert plan.action_counts()["recompute"] > 0
    losses, grads, buffers, unplanned_peak, _ = _unplanned(model)
    p_losses, p_grads, p_buffers, planned_peak, handle = _planned(model)
    assert all(torch.equal(a, b) for a, b in zip(losses, p_losses)), (losses, p_losses)
    assert buffers.keys() == p_buffers.keys() and all(torch.equal(buffers[k], p_buffers[k]) for k in buffers)
    assert grads.keys() == p_grads.keys()
    for k in grads:
        torch.testing.assert_close(p_grads[k], grads[k], rtol=1e-5, atol=1e-7, msg=f"gradient of {k}")
    placed = handle.placement.placed
    assert len(placed) >= 0.6 * len(plan.decisions), f"{len(placed)} of {len(plan.decisions)} decisions placed"
    assert planned_peak < unplanned_peak
    measured = profile.memory_at_start_bytes + planned_peak
    assert measured <= plan.memory_cap_bytes * (1 + CAP_TOLERANCE), (measured, plan.memory_cap_bytes)
    assert _compiler_settings() == USER_SETTINGS  # the handle's settings were the compiler's only in its calls


def test_plan_files_name_each_decisions_op_for_a_compiled_graph(tmp_path):
    profile, plan = _profile_and_plan()
    path = tmp_path / "p.plan.yaml"
    save_plan(plan, path)
    loaded = load_plan(path)
    for d, e in zip(plan.decisions, loaded.decisions):
        op = profile.ops[d.producer_op]
        assert (e.producer_name, e.producer_module) == (op.name, op.module)
        assert e.producer_rank == d.producer_rank
    ranks = {(d.producer_module, d.producer_name, d.producer_rank) for d in plan.decisions}
    producers = {d.producer_op for d in plan.decisions}
    assert len(ranks) == len(producers)  # the rank tells apart every producer op


def _compiled_model():
    w = _build()
    return torch.compile(w.model)


def test_a_plan_without_op_names_is_refused_on_a_compiled_model():
    _, plan = _profile_and_plan()
    old = copy.copy(plan)
    old.decisions = [dataclasses.replace(d, producer_name=None, producer_module=None, producer_rank=None)
                     for d in plan.decisions]
    with pytest.raises(RegenError, match="solve it again"):
        regen.apply(_compiled_model(), old)


def test_a_plan_for_another_model_is_refused_on_a_compiled_model():
    _, plan = _profile_and_plan()
    other = torch.compile(torch.nn.Sequential(torch.nn.Linear(4, 4)))
    with pytest.raises(RegenError, match="another model"):
        regen.apply(other, plan)


@pytest.mark.parametrize("kwargs", [{"memory_cap": "1GiB"}, {"emulate_link": True}, {"on_mismatch": "raise"}])
def test_what_only_the_eager_runtime_does_is_refused_on_a_compiled_model(kwargs):
    _, plan = _profile_and_plan()
    with pytest.raises(RegenError, match="compiled model runs one plan"):
        regen.apply(_compiled_model(), plan, **kwargs)


def test_a_plan_set_is_refused_on_a_compiled_model():
    _, plan = _profile_and_plan()
    with pytest.raises(RegenError, match="plan set"):
        regen.apply(_compiled_model(), [plan, plan])


def test_dynamic_mode_is_refused_on_a_compiled_model():
    with pytest.raises(RegenError, match="torch.compile"):
        regen.apply(_compiled_model(), memory_cap="1GiB")


def test_a_swap_is_said_to_be_recomputed_under_compile():
    from regen.planner import solve

    profile, _ = _profile_and_plan()
    cap = profile.memory_at_start_bytes + (profile.peak_bytes - profile.memory_at_start_bytes) * 9 // 10
    swapping = solve(profile, memory_cap_bytes=cap, strategy="swap", time_limit_s=10, rel_gap=0.2,
                     link_ratio=0.5)
    assert swapping.action_counts()["swap"] > 0
    with pytest.warns(CompiledPlanWarning, match="off CUDA recomputes what its plan would swap"):
        regen.apply(_compiled_model(), swapping).remove()


def test_swaps_are_offloaded_by_the_compiler_when_asked():
    """On CUDA a plan's swaps go to the compiler's offloading pass; asked to on CPU, its copies are the
    graphs' device_put nodes (to the CPU: a copy), and the step trains as the unplanned compiled one."""
    from regen.planner import solve
    from regen.runtime.compiled import CompiledPlanHandle

    profile, _ = _profile_and_plan()
    cap = profile.memory_at_start_bytes + (profile.peak_bytes - profile.memory_at_start_bytes) * 3 // 4
    swapping = solve(profile, memory_cap_bytes=cap, strategy="swap", time_limit_s=10, rel_gap=0.2,
                     link_ratio=0.5)
    puts = []
    count_puts = torch._inductor.config.patch(post_grad_custom_pre_pass=lambda graph: puts.append(
        sum(1 for n in graph.nodes if n.target is torch.ops.prims.device_put.default)))
    losses, grads, buffers, _, _ = _unplanned("llama")
    with count_puts:
        p_losses, p_grads, p_buffers, _, handle = _train_compiled(
            "llama", swapping, lambda model, plan: CompiledPlanHandle(model, plan, offload_swaps=True))
    offloaded = handle.placement.offloaded
    swaps = {d.saved_tensor for d in swapping.decisions if d.action == "swap"}
    assert offloaded and offloaded <= swaps and len(offloaded) >= len(swaps) // 2, (len(offloaded), len(swaps))
    assert puts[-2:] == [len(offloaded)] * 2  # one copy out in the forward graph, one back in the backward's
    assert all(torch.equal(a, b) for a, b in zip(losses, p_losses))
    assert buffers.keys() == p_buffers.keys() and all(torch.equal(buffers[k], p_buffers[k]) for k in buffers)
    assert grads.keys() == p_grads.keys()
    for name in grads:
        torch.testing.assert_close(p_grads[name], grads[name], rtol=1e-5, atol=1e-7, msg=f"gradient of {name}")


def test_another_compiled_model_compiles_without_the_plan():
    _, plan = _profile_and_plan()
    with regen.apply(_compiled_model(), plan) as handle:
        other = _build()
        other.model = torch.compile(other.model)
        training_step(other)  # the same architecture, compiled while the handle is in place
        assert handle.placement.graphs == 0 and not handle.placement.placed


def test_every_instance_of_a_class_compiles_under_its_own_plan():
    """torch.compile shares compiled code among a class's instances; each planned model gets its own (from the
    third instance on too, where a changing integer guard would have turned into a dynamic input)."""
    _, plan = _profile_and_plan("gpt")
    workloads = [_build("gpt") for _ in range(3)]
    handles = []
    for w in workloads:
        w.model = torch.compile(w.model)
        handles.append(regen.apply(w.model, plan))  # each resets torch.compile: all three compile after
    for w in workloads:
        training_step(w)
    try:
        assert [h.placement.graphs for h in handles] == [1, 1, 1]
    finally:
        for h in handles:
            h.remove()


def test_instances_compile_their_own_graphs_past_a_graph_break():
    """The zoo's GPT-2 breaks torch.compile's graph in its forward (its loss logs); the frame compiled after the
    break is the class's own code unless the handle's forward copies it: a second planned instance would then
    run the first one's graph."""
    from regen.planner.solve import solve_within_reach

    profile, plan = _profile_and_plan("gpt2")  # at half the peak increase
    start = profile.memory_at_start_bytes
    plans = [solve_within_reach(profile, start + int((profile.peak_bytes - start) * 0.7), "recompute",
                                time_limit_s=10, rel_gap=0.2), plan]
    workloads = [_build("gpt2") for _ in plans]
    handles = []
    for w, plan in zip(workloads, plans):
        w.model = torch.compile(w.model)
        handles.append(regen.apply(w.model, plan))
    try:
        for w in workloads:
            training_step(w)
        for h, plan in zip(handles, plans):
            assert h.placement.graphs >= 1 and len(h.placement.placed) >= 0.6 * len(plan.decisions)
    finally:
        for h in handles:
            h.remove()


@torch._dynamo.config.patch(recompile_limit=1)
def test_a_planned_step_that_torch_compile_ran_eagerly_is_warned():
    _, plan = _profile_and_plan("gpt")
    workloads = [_build("gpt") for _ in range(2)]
    handles = []
    for w in workloads:
        w.model = torch.compile(w.model)
        handles.append(regen.apply(w.model, plan))
    try:
        training_step(workloads[0])
        with pytest.warns(CompiledPlanWarning, match="ran without compiling a graph of its own"):
            training_step(workloads[1])  # past the limit: torch.compile runs it eagerly
        assert handles[1].placement.graphs == 0
    finally:
        for h in handles:
            h.remove()


def test_a_model_compiled_in_place_takes_the_plan_and_gets_its_own_back():
    _, plan = _profile_and_plan()
    w = _build()
    w.model.compile()
    compiled_call = w.model._compiled_call_impl
    with regen.apply(w.model, plan) as handle:
        training_step(w)
        assert len(handle.placement.placed) >= 0.6 * len(plan.decisions)
        assert _compiler_settings() == USER_SETTINGS
    assert w.model._compiled_call_impl is compiled_call and "forward" not in w.model.__dict__


def test_a_compiled_step_over_the_cap_is_warned_with_the_allocators_figure():
    from regen.runtime.peak_check import CapExceededWarning

    _, plan = _profile_and_plan()
    w = _build()
    w.model = torch.compile(w.model)
    readings = iter([0, 2 * plan.memory_cap_bytes])  # a stand-in for the CUDA allocator: at the step's start, end
    with regen.apply(w.model, plan) as handle:
        handle.peak_check.read_peak = lambda: next(readings)
        with pytest.warns(CapExceededWarning, match="100% over"):
            training_step(w)


@pytest.mark.parametrize("how", ["in place", "wrapped"])
def test_a_model_compiled_under_its_handle_runs_the_plan_as_one_compiled_first(how):
    profile, plan = _profile_and_plan("gpt")
    losses, grads, buffers, peak, first = _planned("gpt")
    c_losses, c_grads, c_buffers, c_peak, handle = _train_compiled("gpt", plan, compiled_under_the_handle=how)
    assert handle.compiled is not None and handle.stats.steps == 0  # no eager step ran
    assert all(torch.equal(a, b) for a, b in zip(losses, c_losses)), (losses, c_losses)
    assert buffers.keys() == c_buffers.keys() and all(torch.equal(buffers[k], c_buffers[k]) for k in buffers)
    assert grads.keys() == c_grads.keys()
    for k in grads:
        torch.testing.assert_close(c_grads[k], grads[k], rtol=1e-5, atol=1e-7, msg=f"gradient of {k}")
    assert handle.compiled.placement.placed == first.placement.placed
    assert profile.memory_at_start_bytes + c_peak <= plan.memory_cap_bytes * (1 + CAP_TOLERANCE)
    assert _compiler_settings() == USER_SETTINGS


def test_a_model_compiled_under_its_handle_is_not_served_code_compiled_for_another_instance():
    """torch.compile shares compiled code among a class's instances: one compiled before the handle was made
    (a Trainer's earlier run, say) would otherwise run in place of the plan's."""
    _, plan = _profile_and_plan("gpt")
    *_, first = _planned("gpt")
    other = _build("gpt")
    other.model.compile()
    training_step(other)  # the class's code compiled without a plan
    w = _build("gpt")
    with regen.apply(w.model, plan) as handle:
        w.model.compile()
        training_step(w)
        assert handle.compiled.placement.graphs >= 1
        assert handle.compiled.placement.placed == first.placement.placed


def test_what_only_the_eager_runtime_does_is_refused_when_the_model_is_compiled_under_the_handle():
    _, plan = _profile_and_plan("gpt")
    w = _build("gpt")
    with regen.apply(w.model, plan, on_mismatch="raise"):
        w.model.compile()
        with pytest.raises(Exception, match="on_mismatch is for an eager model.*compiled under regen.apply"):
            training_step(w)


def test_dynamic_mode_refuses_a_model_compiled_under_it():
    w = _build("gpt")
    with regen.apply(w.model, memory_cap="64MiB"):
        w.model.compile()
        with pytest.raises(Exception, match="being run by torch.compile; dynamic mode runs eager"):
            training_step(w)
