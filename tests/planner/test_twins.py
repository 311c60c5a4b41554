"""Twin layers (regen.planner.milp.twins): the repeated blocks' candidates line up column by column, a
block's actions are copied onto its twins and nowhere else, sweeps cut blocks at the layers' boundaries,
and the block search that proposes to twins ends with a plan the whole model and the simulator accept,
no worse than its start."""

import numpy as np
import pytest

from plans import profile as fixed_profile
from regen.planner.graph import build_graph
from regen.planner.host_link import link_bandwidth
from regen.planner.milp.highs import constraints_of, to_highs_lp
from regen.planner.milp.model import MilpOptions, Model
from regen.planner.milp.twins import find_twins, layer_blocks, propose
from regen.planner.simulator import simulate

LAYERS = 5


@pytest.fixture(scope="module")
def layered():
    """A 5-layer GPT's profile (fixed times), its graph over a link, and a cap 30% of the way from the lowest
    peak recompute reaches to the unplanned one (tight enough that a second sweep improves blocks)."""
    from regen.planner.residency import lower_bound_peak
    from regen.workloads import build_workload

    workload = build_workload("gpt", batch_size=2, args=dict(vocab_size=128, context=32, d_model=32, n_layer=LAYERS,
                                                              n_head=2))
    prof = fixed_profile(workload)
    bandwidth, _ = link_bandwidth(prof, None, 0.9)
    graph = build_graph(prof, bandwidth, bandwidth)
    lower = lower_bound_peak(graph, allow_swap=False, allow_recompute=True)
    return graph, int(lower + 0.3 * (prof.peak_bytes - lower))


def _model(graph, cap):
    model = Model(graph, cap, MilpOptions())
    to_highs_lp(model.prob, model.prob.variables())  # numbers the columns
    return model


def test_the_repeated_blocks_are_twins_position_by_position(layered):
    model = _model(*layered)
    twins = find_twins(model)
    assert twins is not None and len(twins.members) == LAYERS
    largest = max(set(twins.group), key=twins.group.count)
    same = [k for k in range(LAYERS) if twins.group[k] == largest]
    assert len(same) >= 3
    first_ops = [min(model.vars[i].c.producer for i in twins.members[k]) for k in same]
    for k in same[1:]:
        assert len(twins.members[k]) == len(twins.members[same[0]])
        for a, b in zip(twins.members[same[0]], twins.members[k]):
            ca, cb = model.vars[a].c, model.vars[b].c
            assert ca.bytes == cb.bytes and len(twins.columns[a]) == len(twins.columns[b]) > 0
            assert twins.twin(a, twins.layer_of[b] - twins.layer_of[a]) == b
        assert first_ops[same.index(k)] > first_ops[0]


def test_a_proposal_copies_a_layers_actions_onto_its_twins_and_nowhere_else(layered):
    model = _model(*layered)
    twins = find_twins(model)
    largest = max(set(twins.group), key=twins.group.count)
    k = next(k for k in range(LAYERS) if twins.group[k] == largest)
    solution = np.zeros(len(model.prob.variables()))
    rng = np.random.default_rng(0)
    for i in twins.members[k]:
        solution[twins.columns[i]] = rng.integers(0, 2, len(twins.columns[i]))
    proposal = propose(twins, solution, twins.members[k])
    targets = [j for j in range(LAYERS) if j != k and twins.group[j] == largest]
    assert proposal is not None and proposal.layers == len(targets)
    changed = np.zeros(len(solution), dtype=bool)
    for j in targets:
        for a, b in zip(twins.members[k], twins.members[j]):
            assert np.array_equal(proposal.values[twins.columns[b]], solution[twins.columns[a]])
            changed[twins.columns[b]] = True
    assert np.array_equal(proposal.values[~changed], solution[~changed])
    assert propose(twins, proposal.values, twins.members[k]) is None  # nothing left to change


def test_sweep_blocks_are_cut_at_the_layers_boundaries(layered):
    model = _model(*layered)
    twins = find_twins(model)
    order = sorted(model.vars, key=lambda i: (model.vars[i].c.producer, i))
    for sweeps in (0, 1):
        blocks = layer_blocks(twins, order, 20, sweeps)
        assert [i for b in blocks for i in b] == order
        starts = {b[0] for b in blocks}
        layers = [m for m in twins.members if m]
        if sweeps == 0:
            assert all(m[0] in starts for m in layers)
        else:
            assert all(m[len(m) // 2] in starts for m in layers)


def test_the_block_search_with_twins_gives_a_plan_the_model_and_simulator_accept(layered, monkeypatch):
    import regen.planner.milp.blocks as blocks
    from regen.planner.milp.solution import solve_model

    tried = []
    real = blocks._try_proposal
    monkeypatch.setattr(blocks, "_try_proposal", lambda search, proposal, limit_s: tried.append(proposal.layers)
                        or real(search, proposal, limit_s))
    graph, cap = layered
    recompute_only = solve_model(Model(graph, cap, MilpOptions(allow_swap=False)), 30, rel_gap=1e-6)
    model = Model(graph, cap, MilpOptions())
    choices, _, objective = blocks.improve_by_blocks(model, recompute_only.choices, 30, block_candidates=10)
    assert tried, "no block's improvement was proposed to its twins (proposals start with the second sweep)"
    assert all(con.valid(1e-6) for con in constraints_of(model.prob))
    assert objective * model.time_unit <= recompute_only.objective_s * (1 + 1e-6)
    sim = simulate(graph, choices)
    assert sim.valid and sim.peak_bytes <= cap
