"""Region candidates (module calls replayed in backward) in the planner: what a region is, how the MILP
and the simulator charge it, per-block checkpointing as a point of the solution space, and the plan
format's region fields."""

import pytest

from regen.errors import FormatError
from regen.formats import load_plan, save_plan
from regen.formats.plan import ACTION_RECOMPUTE
from regen.planner import solve
from regen.planner.solve import solve_within_reach
from plan_choices import choices_from_plan
from regen.planner.graph import build_graph
from regen.planner.heuristics import block_regions, checkpoint_blocks
from regen.planner.milp.model import MilpOptions, Model
from regen.planner.milp.solution import solve_model
from regen.planner.region_candidates import region_transient_bytes
from regen.planner.simulator import simulate

SMALL = {
    "cnn": (4, {"channels": 8, "num_blocks": 3, "image_size": 16}),
    "hf-gpt2": (2, {"seq_len": 32, "n_layer": 2, "n_embd": 64, "n_head": 4, "vocab_size": 256}),
}


@pytest.fixture(scope="module")
def profiles(real_gpt_profile):
    from regen.profiler import profile_workload
    from regen.workloads import build_workload

    out = {"gpt": real_gpt_profile}

    def get(name):
        if name not in out:
            if name.startswith("hf-"):
                pytest.importorskip("transformers")
            batch, args = SMALL[name]
            w = build_workload(name, batch_size=batch, args=args)
            out[name] = profile_workload(w, device="cpu", repeats=1, warmup_steps=1, progress=None)
        return out[name]

    return get


def test_block_regions_rebuild_what_the_block_saved(real_gpt_profile):
    graph = build_graph(real_gpt_profile)
    blocks = {r.call.module: r for r in block_regions(graph)}
    assert set(blocks) == {"blocks.0", "blocks.1"}
    b1 = blocks["blocks.1"]
    call = b1.call
    assert len(b1.packs) == call.num_entries
    for t in b1.members:
        c = graph.candidates[t]
        assert call.first_op <= c.producer <= call.last_op
        assert c.first_backward >= b1.replay_step > c.last_forward + 1
        assert t in b1.packs and b1.index in c.regions
    # its argument is block 0's output, a candidate (saved by ln1) that the region needs kept
    assert len(b1.inputs) == 1 and graph.candidates[b1.inputs[0]].producer < call.first_op
    # backward reaches block 1 before block 0
    assert b1.replay_step < blocks["blocks.0"].replay_step
    assert b1.is_random  # dropout inside
    # the replay stops at its last member's pack (the MLP's dropout mask): the block's last ops, the
    # dropout's multiply and the residual add, rebuild nothing and are neither run nor charged
    ops = real_gpt_profile.ops
    assert [ops[q].name for q in (call.last_op - 1, call.last_op)] == ["aten.mul.Tensor", "aten.add.Tensor"]
    replayed = range(call.first_op, call.last_op - 1)
    assert ops[replayed[-1]].name == "aten.div_.Scalar"
    assert b1.time_s == pytest.approx(graph.costs.region_time_s(sum(graph.time_s[q] for q in replayed),
                                                                len(replayed)))
    assert b1.time_s >= sum(graph.time_s[q] for q in replayed)


@pytest.mark.parametrize("name", ["gpt", "cnn", "hf-gpt2"])
def test_checkpoint_blocks_is_a_valid_plan_that_keeps_block_inputs(profiles, name):
    graph = build_graph(profiles(name))
    choices = checkpoint_blocks(graph)
    blocks = block_regions(graph)
    assert len(blocks) >= 2 and choices
    sim = simulate(graph, choices)
    assert sim.valid, sim.errors
    assert sim.peak_bytes < graph.unplanned_peak_bytes
    held = {a for r in blocks for a in r.inputs}
    assert not held & set(choices)
    assert {ch.region for ch in choices.values()} <= {r.index for r in blocks}
    # one replay per block, charged at its replay step
    added = sum(r.time_s for r in blocks if any(ch.region == r.index for ch in choices.values()))
    assert sim.step_time_s == pytest.approx(graph.compute_time_s + added)


@pytest.mark.parametrize("name", ["gpt", "cnn", "hf-gpt2"])
def test_the_milp_is_never_worse_than_per_block_checkpointing(profiles, name):
    profile = profiles(name)
    checkpointed = solve(profile, memory_cap_bytes=profile.peak_bytes, strategy="checkpoint-blocks")
    cap = checkpointed.simulated.peak_bytes
    plan = solve(profile, memory_cap_bytes=cap, strategy="recompute", time_limit_s=30)
    assert plan.simulated.peak_bytes <= cap
    assert plan.simulated.step_time_s <= checkpointed.simulated.step_time_s * (1 + 1e-9)
    assert plan.predicted.step_time_s == pytest.approx(plan.simulated.step_time_s)


def _regions_only(graph):
    """The graph with per-tensor recipes removed: regions are the only way to recompute."""
    for c in graph.candidates:
        c.recipes = []
        c.rebuilt_with_options = []
    return graph


def _with_fixed_times(profile):
    """The profile with op times that do not depend on how busy the machine was while it was made."""
    from dataclasses import replace

    ops = [replace(op, time_s=1e-4 * (1 + op.index % 7)) for op in profile.ops]
    return replace(profile, ops=ops, step_time_s=sum(op.time_s for op in ops))


@pytest.mark.parametrize("name", ["gpt", "cnn"])
def test_region_plans_are_charged_exactly_by_the_milp_and_the_simulator(profiles, name):
    graph = _regions_only(build_graph(_with_fixed_times(profiles(name))))
    blocks = checkpoint_blocks(graph)
    cap = (simulate(graph, blocks).peak_bytes + graph.unplanned_peak_bytes) // 2
    model = Model(graph, cap, MilpOptions(allow_swap=False, rel_gap=1e-6))
    result = solve_model(model, 30)
    regions = {ch.region for ch in result.choices.values()}
    assert regions and None not in regions
    sim = simulate(graph, result.choices)
    assert sim.valid and sim.peak_bytes <= cap
    assert sim.step_time_s == pytest.approx(result.objective_s)
    assert sim.peak_bytes == pytest.approx(result.predicted_peak_bytes, abs=2)
    for r in regions:  # the argument candidates of every chosen region are kept
        assert all(a not in result.choices for a in graph.regions[r].inputs)


def test_a_replay_that_rebuilds_fewer_members_holds_their_copies_as_transient(real_gpt_profile):
    graph = _regions_only(build_graph(real_gpt_profile))
    region = next(r for r in block_regions(graph) if r.call.module == "blocks.1")
    everything = {t: _choice(region.index) for t in region.members}
    some = dict(list(everything.items())[: len(everything) // 2])
    full, part = simulate(graph, everything), simulate(graph, some)
    b = region.replay_step
    dropped = set(everything) - set(some)
    extra = sum(graph.candidates[t].bytes for t in dropped)
    assert region_transient_bytes(graph, region, set(some)) - region_transient_bytes(graph, region, set(everything)) \
        == extra
    # at the replay step: the copies of the members it does not rebuild are on top (they are kept anyway)
    assert part.peak_timeline_bytes[b] - full.peak_timeline_bytes[b] == extra
    assert part.step_time_s == full.step_time_s  # one replay either way


def _choice(region):
    from regen.planner.result import Choice

    return Choice(ACTION_RECOMPUTE, region=region)


def test_a_region_whose_argument_is_not_kept_is_an_inconsistent_plan(real_gpt_profile):
    from regen.planner.result import Choice

    graph = build_graph(real_gpt_profile)
    region = next(r for r in block_regions(graph) if r.call.module == "blocks.1")
    choices = {t: _choice(region.index) for t in region.members}
    arg = region.inputs[0]
    choices[arg] = Choice(ACTION_RECOMPUTE, recipe=graph.candidates[arg].recipes[0])
    assert any("not kept" in e for e in simulate(graph, choices).errors)


def test_region_plans_round_trip_through_the_file(real_gpt_profile, tmp_path):
    profile = real_gpt_profile
    plan = solve(profile, memory_cap_bytes=profile.peak_bytes, strategy="checkpoint-blocks")
    assert plan.regions and plan.region_member_count() > 0
    for d in plan.decisions:
        if d.region is not None:
            r = plan.regions[d.region]
            assert d.action == ACTION_RECOMPUTE and not d.recipe and d.saved_tensor in r.packs
            assert d.recompute_before_op == r.replay_before_op
    path = tmp_path / "plan.yaml"
    save_plan(plan, path)
    back = load_plan(path)
    assert back.regions == plan.regions
    graph = build_graph(profile)
    sim = simulate(graph, choices_from_plan(graph, back))
    assert sim.valid and sim.peak_bytes == plan.simulated.peak_bytes


@pytest.mark.parametrize("edit, message", [
    (lambda d, p: setattr(d, "region", 7), "names region 7"),
    (lambda d, p: setattr(d, "recipe", [d.producer_op]), "without a recipe of its own"),
    (lambda d, p: p.regions[d.region].packs.clear(), "that region packs"),
])
def test_inconsistent_region_decisions_are_refused(real_gpt_profile, tmp_path, edit, message):
    profile = real_gpt_profile
    plan = solve(profile, memory_cap_bytes=profile.peak_bytes, strategy="checkpoint-blocks")
    member = next(d for d in plan.decisions if d.region is not None)
    edit(member, plan)
    path = tmp_path / "plan.yaml"
    save_plan(plan, path)
    with pytest.raises(FormatError, match=message):
        load_plan(path)


def test_profiles_without_module_calls_have_no_regions(small_transformer):
    graph = build_graph(small_transformer)
    assert graph.regions == [] and all(not c.regions for c in graph.candidates)
    assert checkpoint_blocks(graph) == {}


def test_without_module_replays_a_plan_recomputes_by_recipes_alone(real_gpt_profile):
    """SolveOptions.module_replays=False (the calibration's recipes plan): the same profile, whose graph has
    regions to replay, gets a plan of per-tensor recipes only, under the same cap."""
    start = real_gpt_profile.memory_at_start_bytes
    cap = start + int(0.6 * (real_gpt_profile.peak_bytes - start))
    assert build_graph(real_gpt_profile).regions
    assert build_graph(real_gpt_profile, module_replays=False).regions == []
    plan = solve_within_reach(real_gpt_profile, cap, "recompute", time_limit_s=20, module_replays=False)
    recomputed = [d for d in plan.decisions if d.action == ACTION_RECOMPUTE]
    assert recomputed and not plan.regions and all(d.region is None for d in recomputed)
    assert plan.simulated.peak_bytes <= plan.memory_cap_bytes < real_gpt_profile.peak_bytes
