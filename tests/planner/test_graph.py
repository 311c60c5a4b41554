"""The planning graph: lifetimes, copy windows and recompute recipes."""

from regen.formats.profile import KIND_INPUT
from regen.planner.graph import (LARGE_GRAPH_TRANSFER_FACTOR, MAX_WINDOW_STEPS, MIN_WINDOW_STEPS_CAP,
                                  WINDOW_STEP_BUDGET, WINDOW_TRANSFER_FACTOR, build_graph, window_steps_cap,
                                  window_transfer_factor)
from regen.planner.residency import resident_whatever_action
from regen.graphs.builder import FLOAT32_BYTES, ProfileBuilder
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
        assert all(resident_whatever_action(c, s) for s in range(c.producer, c.last_forward + 1))
        if c.can_swap:
            assert c.out_window[0] == c.issue_after + 1 and c.in_window[-1] == c.first_backward - 1
            assert len(c.out_window) <= MAX_WINDOW_STEPS and c.out_window[-1] < c.in_window[-1]
    # the last candidate is read by the loss and right away by its backward: nothing to decide
    assert graph.candidates[-1].trivial


def test_recipes_read_alive_candidates_as_inputs_and_walk_through_with_depth():
    graph = build_graph(chain_profile(5, seed=1))
    c = graph.candidates[2]  # produced by op 1 from candidate 1's tensor... chain: x_k = op_k(x_{k-1})
    shallow, deeper = c.recipes[0], c.recipes[1]
    assert shallow.ops == [c.producer] and shallow.inputs == [c.index - 1]
    assert deeper.ops == [c.producer - 1, c.producer] and deeper.inputs == [c.index - 2]
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
        assert not c.recipes[0].inputs
        assert [ops[q].name for q in c.recipes[0].random_ops] == ["aten.bernoulli_.float"]
    after = smallest_feasible_cap(graph, allow_swap=False, allow_recompute=True)
    # without in-place replays: no recipe replays an in-place op (so no candidate made in place is recomputable)
    for c in graph.candidates:
        c.recipes = [r for r in c.recipes if not any(ops[q].is_inplace for q in r.ops)]
    before = smallest_feasible_cap(graph, allow_swap=False, allow_recompute=True)
    assert after is not None and before is not None and after < before


def _burst_profile(chain_ops: int = 120):
    """Three 4 MiB tensors made one after another, then `chain_ops` ops of 0.2 ms on small tensors and a
    10 MiB one the loss reads, over a 1 GB/s link: copying the three out takes 12.6 ms, the time of 63 ops
    after them. In backward, a third of the chain's ops (0.4 ms each) come before each of the three's uses, so
    each can come back alone."""
    mb = 1 << 20
    b = ProfileBuilder("burst", 1e9, 1e9)
    x = b.external(mb, kind=KIND_INPUT)
    w = b.external(mb // 4)
    burst = [b.forward("aten.mm.default", 0.2e-3, [x, w], [4 * mb], saves="outputs")[0] for _ in range(3)]
    y, chain = x, []
    for _ in range(chain_ops):
        op, (y,) = b.forward("aten.relu.default", 0.2e-3, [y], [mb // 64], saves=[y])
        chain.append(op)
    _, (logits,) = b.forward("aten.mm.default", 0.2e-3, [y, w], [10 * mb])  # alive at the forward's end
    loss_op, (loss,) = b.forward("aten.sum.default", 0.1e-3, [logits], [FLOAT32_BYTES], saves=[logits])
    (g,) = b.backward("aten.expand.default", 0.1e-3, loss_op, [loss], [mb // 64])
    third = chain_ops // 3
    for k, op in enumerate(reversed(chain)):
        (g,) = b.backward("aten.threshold_backward.default", 0.4e-3, op, [g], [mb // 64])
        if k % third == third - 1:
            b.backward("aten.mm.default", 0.4e-3, burst[2 - k // third], [g], [mb // 4])
    return b.build(), 12 * mb


def test_copy_windows_cover_a_burst_of_copies_on_a_slow_link():
    """Windows are sized in time (WINDOW_TRANSFER_FACTOR x the tensor's own copy), so tensors made together
    can share the link over the ops that follow them: a swap-only plan frees all three before the backward."""
    from regen.planner.milp.search import smallest_feasible_cap

    profile, burst_bytes = _burst_profile()
    graph = build_graph(profile)
    burst = [c for c in graph.candidates if c.bytes == 4 << 20]
    assert len(burst) == 3
    for c in burst:
        covered_s = sum(graph.time_s[s] for s in c.out_window)
        assert covered_s >= WINDOW_TRANSFER_FACTOR * c.bytes / graph.d2h_bytes_per_s - graph.time_s[c.out_window[-1]]
    # the three are resident at once right after they are made; at the forward's end they can all be out
    made = graph.after_bytes[burst[-1].producer]
    smallest = smallest_feasible_cap(graph, allow_swap=True, allow_recompute=False)
    assert smallest is not None and smallest <= max(made, graph.unplanned_peak_bytes - burst_bytes) + (1 << 20)


def test_window_steps_shrink_on_large_graphs_within_bounds():
    assert window_steps_cap(10) == MAX_WINDOW_STEPS
    assert window_steps_cap(3000) == MIN_WINDOW_STEPS_CAP
    assert MIN_WINDOW_STEPS_CAP <= window_steps_cap(200) < MAX_WINDOW_STEPS


def test_windows_cover_less_transfer_time_past_the_window_budget():
    """Within the budget windows cover WINDOW_TRANSFER_FACTOR x a tensor's transfer time; past it, where every
    window is capped at MIN_WINDOW_STEPS_CAP steps, the smaller factor keeps the large model smaller."""
    last_within = WINDOW_STEP_BUDGET // MIN_WINDOW_STEPS_CAP
    assert window_transfer_factor(10) == window_transfer_factor(last_within) == WINDOW_TRANSFER_FACTOR
    assert window_transfer_factor(last_within + 1) == window_transfer_factor(3000) == LARGE_GRAPH_TRANSFER_FACTOR
    assert LARGE_GRAPH_TRANSFER_FACTOR < WINDOW_TRANSFER_FACTOR
