"""The simulator, the judge of every plan: exact memory and time of hand-made plans on a small chain.

chain_profile(5, seed=1): candidates 0..3 have a gap (candidate 4 is read by the loss and right away
by its backward); candidate k is produced by op k, last read in forward by op k+1 and first read in
backward by op 10-k. Its recipes: [k] with input candidate k-1, then walking further back.
"""

import pytest
import torch

from regen.formats.plan import ACTION_RECOMPUTE, ACTION_SWAP
from regen.planner.graph import build_graph
from regen.planner.recipes import rebuilt_with_recipe
from regen.planner.result import Choice
from regen.planner.simulator import simulate
from regen.graphs.synthetic import chain_profile

INSTANT_BYTES_PER_S = 1e21  # a copy of a few MB takes less than the simulator's time tolerance
SLOW_BYTES_PER_S = 1e9


def _graph(bytes_per_s=SLOW_BYTES_PER_S):
    graph = build_graph(chain_profile(5, seed=1), bytes_per_s, bytes_per_s)
    c = graph.candidates
    # what the tests below rely on
    assert [(x.producer, x.last_forward, x.first_backward) for x in c[:4]] == [(0, 1, 10), (1, 2, 9), (2, 3, 8),
                                                                              (3, 4, 7)]
    assert c[0].recipes[0].inputs == [] and c[2].recipes[0].inputs == [1] and c[1].recipes[0].inputs == [0]
    return graph


def _reduction(graph, sim):
    """Bytes the plan removes from the unplanned timeline after and inside each op."""
    after = [u - p for u, p in zip(graph.after_bytes, sim.timeline_bytes)]
    during = [u - p for u, p in zip(graph.peak_bytes, sim.peak_timeline_bytes)]
    return after, during


def test_keep_all_reproduces_the_unplanned_step():
    graph = _graph()
    sim = simulate(graph, {})
    assert sim.valid and sim.errors == []
    assert sim.timeline_bytes == graph.after_bytes and sim.peak_timeline_bytes == graph.peak_bytes
    assert sim.peak_bytes == graph.unplanned_peak_bytes
    assert sim.step_time_s == pytest.approx(graph.compute_time_s, rel=1e-12)
    assert sim.fits(graph.unplanned_peak_bytes) and not sim.fits(graph.unplanned_peak_bytes - 1)


def test_recompute_frees_exactly_its_bytes_over_its_gap_and_costs_its_recipe():
    graph = _graph()
    c = graph.candidates[0]
    recipe = c.recipes[0]
    sim = simulate(graph, {0: Choice(ACTION_RECOMPUTE, recipe=recipe)})
    assert sim.valid
    after, during = _reduction(graph, sim)
    # gone after its last forward use (op 1) until its recipe runs before op 10
    assert after == [c.bytes if 1 <= s <= 9 else 0 for s in range(graph.num_steps)]
    assert during == [c.bytes if 2 <= s <= 9 else (-recipe.transient_bytes if s == 10 else 0)
                      for s in range(graph.num_steps)]
    assert sim.step_time_s == pytest.approx(graph.compute_time_s + recipe.time_s, rel=1e-12)


def test_swap_frees_exactly_its_bytes_until_its_copy_in_and_hides_a_fast_copy():
    graph = _graph(INSTANT_BYTES_PER_S)
    c = graph.candidates[0]
    sim = simulate(graph, {0: Choice(ACTION_SWAP, swap_in_step=7)})
    assert sim.valid
    after, during = _reduction(graph, sim)
    # copied out when op 1 ends, released at the first point the runtime acts on after that (the next
    # forward pack, after op 2), back on the device from its copy-in before op 7 on
    assert graph.pack_steps[c.last_pack + 1] == 3 and sim.release_steps == {0: 3}
    assert after == [c.bytes if 2 <= s <= 6 else 0 for s in range(graph.num_steps)]
    assert during == [c.bytes if 3 <= s <= 6 else 0 for s in range(graph.num_steps)]
    assert sim.step_time_s == pytest.approx(graph.compute_time_s, rel=1e-12)
    assert sim.peak_bytes == max(max(p - d for p, d in zip(graph.peak_bytes, during)),
                                 max(a - d for a, d in zip(graph.after_bytes, after)))


def test_a_late_copy_in_is_a_stall_in_the_step_time():
    graph = _graph(SLOW_BYTES_PER_S)
    c = graph.candidates[0]
    transfer_s = c.bytes / SLOW_BYTES_PER_S
    # issued before op 7, the copy has ops 7-9 (longer than the transfer) to hide behind
    assert sum(graph.time_s[7:10]) > transfer_s
    early = simulate(graph, {0: Choice(ACTION_SWAP, swap_in_step=7)})
    assert early.valid and early.step_time_s == pytest.approx(graph.compute_time_s, rel=1e-12)
    # issued right before its first backward use, op 10 waits for the whole transfer
    late = simulate(graph, {0: Choice(ACTION_SWAP, swap_in_step=10)})
    assert late.valid and late.step_time_s == pytest.approx(graph.compute_time_s + transfer_s, rel=1e-12)
    # ... and it holds the memory for less time: gone up to op 9
    after, _during = _reduction(graph, late)
    assert after[9] == c.bytes and after[10] == 0


def test_a_late_copy_out_stalls_compute_at_its_release_step():
    graph = _graph(SLOW_BYTES_PER_S)
    c = graph.candidates[0]
    transfer_s = c.bytes / SLOW_BYTES_PER_S
    assert graph.time_s[2] < transfer_s  # not done by the next pack (before op 3)
    free = simulate(graph, {0: Choice(ACTION_SWAP, swap_in_step=7)})
    late_step = free.release_steps[0]
    assert late_step > 3 and free.step_time_s == pytest.approx(graph.compute_time_s, rel=1e-12)
    # released where a plan says, before op 3: compute waits there for the rest of the copy, and the copy is
    # gone from then on
    forced = simulate(graph, {0: Choice(ACTION_SWAP, swap_in_step=7, release_step=3)})
    assert forced.valid and forced.release_steps == {0: 3}
    stall_s = transfer_s - graph.time_s[2]
    assert forced.step_time_s == pytest.approx(graph.compute_time_s + stall_s, rel=1e-9)
    after, during = _reduction(graph, forced)
    assert during == [c.bytes if 3 <= s <= 6 else 0 for s in range(graph.num_steps)]
    later_after, _ = _reduction(graph, free)
    assert later_after[2] == 0 and after[2] == c.bytes
    # the release step must lie after its copy-out and at the latest at its copy-in
    for bad in (c.issue_after, 8):
        assert any("release step" in e for e in simulate(graph, {0: Choice(ACTION_SWAP, swap_in_step=7,
                                                                           release_step=bad)}).errors)


def test_a_recipe_input_that_is_not_resident_makes_the_plan_invalid():
    graph = _graph()
    c1, c2 = graph.candidates[1], graph.candidates[2]
    own = {2: Choice(ACTION_RECOMPUTE, recipe=c2.recipes[0])}  # its input is candidate 1, which is kept
    assert simulate(graph, own).valid
    both = dict(own)
    both[1] = Choice(ACTION_RECOMPUTE, recipe=c1.recipes[0])  # candidate 1 is rebuilt only at op 9, after op 8
    sim = simulate(graph, both)
    assert not sim.valid and not sim.fits(graph.unplanned_peak_bytes)
    assert any(f"recipe input {c1.id}" in e for e in sim.errors)


def test_rebuilt_with_holds_the_tensor_from_the_other_recipe_and_needs_that_recipe():
    graph = _graph()
    c1, c2 = graph.candidates[1], graph.candidates[2]
    k = next(k for k, r in enumerate(c2.recipes) if c1.producer in r.ops[:-1])
    recipe = c2.recipes[k]
    choices = {2: Choice(ACTION_RECOMPUTE, recipe=recipe),
               1: Choice(ACTION_RECOMPUTE, recipe=rebuilt_with_recipe(graph, c1, 2, k), rebuilt_with=2)}
    sim = simulate(graph, choices)
    assert sim.valid
    # candidate 1 costs no time of its own and is back when candidate 2's recipe runs (before op 8), not op 9
    assert sim.step_time_s == pytest.approx(graph.compute_time_s + recipe.time_s, rel=1e-12)
    after, _during = _reduction(graph, sim)
    assert after[7] == c1.bytes + c2.bytes and after[8] == 0
    # without candidate 2's recipe in the plan, candidate 1 is never rebuilt
    del choices[2]
    broken = simulate(graph, choices)
    assert not broken.valid and any("not recomputed by a recipe of its own" in e for e in broken.errors)


def test_a_copy_in_outside_the_gap_is_an_error():
    graph = _graph()
    c = graph.candidates[0]
    for step in (c.issue_after, c.first_backward + 1, None):
        sim = simulate(graph, {0: Choice(ACTION_SWAP, swap_in_step=step)})
        assert not sim.valid and "copy-in step" in sim.errors[0]


def test_copy_ins_issued_at_one_step_go_in_pack_order_as_the_runtime_issues_them():
    """The runtime's queue issues the copy-ins due at one point in the order their copy-outs started (the
    step's pack order, regen.runtime.swap.queue): candidate 0, packed first, goes before candidate 3 even
    though op 7 reads candidate 3 first, so op 7 waits for both copies."""
    graph = build_graph(chain_profile(5, seed=1), INSTANT_BYTES_PER_S, SLOW_BYTES_PER_S)  # copy-outs take no time
    c = graph.candidates
    assert c[0].first_pack_index < c[3].first_pack_index and c[3].first_backward == 7
    sim = simulate(graph, {0: Choice(ACTION_SWAP, swap_in_step=7), 3: Choice(ACTION_SWAP, swap_in_step=7)})
    assert sim.valid
    both_s = (c[0].bytes + c[3].bytes) / SLOW_BYTES_PER_S
    assert sim.step_time_s == pytest.approx(graph.compute_time_s + both_s, rel=1e-9)


class _Attention(torch.nn.Module):
    """Eager attention: the probabilities are saved by softmax and again by the matmul after it; queries and
    keys (two storages) by one matmul."""

    def __init__(self, width: int = 128, layers: int = 3):
        super().__init__()
        self.qkv = torch.nn.ModuleList(torch.nn.ModuleList(torch.nn.Linear(width, width) for _ in range(3))
                                       for _ in range(layers))

    def forward(self, x):
        for q, k, v in self.qkv:
            x = x + torch.softmax(q(x) @ k(x).transpose(-1, -2), dim=-1) @ v(x)
        return x.square().mean()


def test_copy_outs_start_at_a_tensors_first_pack_in_pack_order_as_the_runtime_issues_them():
    """The runtime starts a swap's copy-out when autograd first packs the tensor, and the link runs copies
    in issue order: a tensor saved twice (attention probabilities, by softmax and by the matmul after it)
    is copied from its first pack, and copy-outs issued after one op keep the step's pack order."""
    from regen.planner import solve
    from plan_choices import choices_from_plan
    from regen.planner.simulator import _events
    from regen.profiler import profile_workload
    from regen.workloads import Workload

    torch.manual_seed(0)
    w = Workload(name="attention", model=_Attention(), batch=(torch.randn(16, 128, 128),), loss_fn=None)
    profile = profile_workload(w, device="cpu", repeats=1, warmup_steps=1, progress=None)
    graph = build_graph(profile)
    entries: dict[int, list] = {}
    for e in profile.saved_entries:
        if e.saved_tensor is not None:
            entries.setdefault(e.saved_tensor, []).append(e)
    assert any(len({e.pack_after_op for e in entries[c.id]}) > 1 for c in graph.candidates)
    for c in graph.candidates:
        first = min(entries[c.id], key=lambda e: e.index)
        assert (c.issue_after, c.first_pack_index) == (max(c.producer, first.pack_after_op), first.index)
    plan = solve(profile, profile.peak_bytes, "offload-all", link_ratio=0.9)
    issued = {d.saved_tensor: d.swap_out_after_op for d in plan.decisions if d.action == ACTION_SWAP}
    assert len(issued) > 1 and all(op == graph.by_saved_id()[i].issue_after for i, op in issued.items())
    events = _events(graph, choices_from_plan(graph, plan))
    assert max(len(out) for out in events.swap_out_at.values()) > 1
    for out in events.swap_out_at.values():
        assert [c.first_pack_index for c in out] == sorted(c.first_pack_index for c in out)
