"""Synthetic profiles (regen.graphs): a transformer whose layers are recorded as module calls, as the profiler
records a model's, gives the planner a region per layer and twin layers, and the solve over them gives a plan
the simulator accepts."""

from regen.graphs.synthetic import transformer_profile
from regen.planner.graph import build_graph

LAYERS = 6


def test_layers_recorded_as_module_calls_hold_their_saved_entries_and_are_regions():
    plain = transformer_profile(n_layers=LAYERS)
    profile = transformer_profile(n_layers=LAYERS, module_calls=True)
    assert plain.module_calls == [] and profile.fingerprint == plain.fingerprint  # the same step, calls aside
    calls = profile.module_calls
    assert [c.module for c in calls] == [f"blocks.{k}" for k in range(LAYERS)]
    for c in calls:
        inside = [e for e in profile.saved_entries if c.first_op <= e.pack_after_op <= c.last_op]
        assert c.num_entries == len(inside) > 0 and c.first_entry == inside[0].index
        assert c.inputs and profile.tensors[c.inputs[0]].producer_op < c.first_op
    graph = build_graph(profile)
    assert sorted(r.call.module for r in graph.regions) == sorted(c.module for c in calls)
    assert build_graph(plain).regions == []


def test_a_hybrid_plan_over_twin_layers_fits_its_cap():
    from regen.planner import solve

    profile = transformer_profile(n_layers=LAYERS, module_calls=True)
    cap = int(profile.peak_bytes * 0.5)
    plan = solve(profile, cap, "hybrid", time_limit_s=30)
    assert plan.simulated.peak_bytes <= cap
    assert plan.action_counts()["recompute"] + plan.action_counts()["swap"] > 0
