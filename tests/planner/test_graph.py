"""The planning graph: lifetimes, copy windows and recompute recipes."""

from regen.formats.profile import KIND_INPUT
from regen.planner.graph import MAX_WINDOW_STEPS, build_graph
from regen.graphs.builder import ProfileBuilder
from regen.graphs.synthetic import chain_profile


def test_lifetimes_and_gaps_follow_the_profile():
    profile = chain_profile(5, seed=1)
    graph = build_graph(profile)
    by_id = {s.id: s for s in profile.saved_tensors}
    assert len(graph.candidates) == len(profile.saved_tensors) == 5
    for c in graph.candidates:
        s = by_id[c.id]
        assert (c.producer, c.last_forward, c.first_backward) == (s.producer_op, s.last_forward_use,
                                                                    s.backward_uses[0])
        assert list(c.gap) == list(range(s.last_forward_use + 1, s.backward_uses[0]))
        assert all(c.alive_at(s) for s in range(c.producer, c.last_forward + 1))
        if c.can_swap:
            assert c.out_window[0] == c.issue_after + 1 and c.in_window[-1] == c.first_backward - 1
            assert len(c.out_window) <= MAX_WINDOW_STEPS and c.out_window[-1] < c.in_window[-1]
    # the last candidate is read by the loss and right away by its backward: nothing to decide
    assert graph.candidates[-1].trivial


def test_recipes_anchor_on_alive_candidates_and_walk_through_with_depth():
    graph = build_graph(chain_profile(5, seed=1))
    c = graph.candidates[2]  # produced by op 1 from candidate 1's tensor... chain: x_k = op_k(x_{k-1})
    shallow, deeper = c.recipes[0], c.recipes[1]
    assert shallow.ops == [c.producer] and shallow.anchors == [c.index - 1]
    assert deeper.ops == [c.producer - 1, c.producer] and deeper.anchors == [c.index - 2]
    assert deeper.time_s > shallow.time_s and deeper.transient_bytes > 0 == shallow.transient_bytes


def test_inplace_ops_are_never_replayed_and_random_ops_are_flagged():
    b = ProfileBuilder("inplace")
    x = b.external(1000, kind=KIND_INPUT)
    w = b.external(100)
    op_a, (a,) = b.forward("aten.mm.default", 1e-3, [x, w], [4000])
    op_d, (d,) = b.forward("aten.native_dropout.default", 1e-3, [a], [4000], saves="outputs", is_random=True)
    op_r, (r,) = b.forward("aten.relu_.default", 1e-3, [d], [4000], saves="outputs")
    b.ops[op_r].is_inplace = True
    op_s, (s,) = b.forward("aten.mm.default", 1e-3, [r, w], [4000], saves=[r])
    op_l, (loss,) = b.forward("aten.sum.default", 1e-3, [s], [4], saves=[s])
    (g,) = b.backward("aten.expand.default", 1e-3, op_l, [loss], [4000])
    (g, _) = b.backward("aten.mm.default", 1e-3, op_s, [g], [4000, 100])
    (g,) = b.backward("aten.threshold_backward.default", 1e-3, op_r, [g], [4000])
    b.backward("aten.native_dropout_backward.default", 1e-3, op_d, [g], [4000])
    graph = build_graph(b.build())
    by_producer = {c.producer: c for c in graph.candidates}
    dropout, relu_ = by_producer[op_d], by_producer[op_r]
    assert not relu_.recipes and "in-place" in relu_.not_recomputable
    assert dropout.recipes and dropout.recipes[0].random_ops == [op_d]


def test_cpu_gpt_dropout_masks_are_recomputable_and_lower_the_recompute_only_cap(real_gpt_profile):
    from regen.planner.milp.search import smallest_feasible_cap

    profile = real_gpt_profile
    ops = profile.ops
    graph = build_graph(profile)
    masks = [c for c in graph.candidates if ops[c.producer].is_inplace and not c.trivial]
    assert masks and all(ops[c.producer].name == "aten.div_.Scalar" for c in masks)
    for c in masks:
        assert c.can_recompute, c.not_recomputable
        names = [ops[q].name for q in c.recipes[0].ops]
        # empty_like reads only its argument's shape: the mask's recipe is these three ops and nothing before
        assert names == ["aten.empty_like.default", "aten.bernoulli_.float", "aten.div_.Scalar"]
        assert not c.recipes[0].anchors
        assert [ops[q].name for q in c.recipes[0].random_ops] == ["aten.bernoulli_.float"]
    after = smallest_feasible_cap(graph, allow_swap=False, allow_recompute=True)
    # without in-place replays: no recipe replays an in-place op (so no candidate made in place is recomputable)
    for c in graph.candidates:
        c.recipes = [r for r in c.recipes if not any(ops[q].is_inplace for q in r.ops)]
    before = smallest_feasible_cap(graph, allow_swap=False, allow_recompute=True)
    assert after is not None and before is not None and after < before
