"""Release points: a swapped storage is released at a fixed forward pack or backward unpack, as planned.

Over the emulated link (regen.apply(..., emulate_link=True)), a solved plan's swapped storages are alive at
each release point exactly when the simulator has them resident, step after step, with the gradients of
no plan bit for bit; the end of the forward waits for no copy-out that is due in backward; and a pack looks
at no more than the first pending copy-out (the link's events are queried O(1) times per pack).
"""

import time

import pytest
import torch
from torch.multiprocessing.reductions import StorageWeakRef

import regen
from common import assert_same, make, run_and_grads, step, traced
from handmade import PLANS
from regen.errors import InfeasibleCapError
from regen.formats.plan import ACTION_SWAP
from plan_choices import choices_from_plan
from regen.planner.graph import build_graph
from regen.planner.simulator import simulate
from regen.runtime.swap import SwapQueue
from regen.runtime.swap.emulated import LinkCopy
from regen.runtime.tracker import STAGE_CLOSED

LINK_RATIO = 0.9  # PCIe next to a fast GPU
CAP_FRACTION = 0.8  # of the unplanned peak
STEPS = 3
VERY_SLOW_BYTES_PER_S = 6e6  # the handmade swap plan's copies take over a second each way
SLOW_BYTES_PER_S = 2e7  # ... and under a third of that: still far longer than the tiny model's forward


class _Recorder:
    """Records, at each release point the runtime acts on, the swapped device storages regen still holds
    (sources not released yet) and those still alive at all (the model may hold one longer)."""

    def __init__(self, monkeypatch):
        self.started: list = []  # (candidate, weak ref to its storage, bytes)
        self.points: list[tuple[str, int, int, int]] = []  # (clock, position, held bytes, alive bytes)
        start, at_pack, at_unpack = SwapQueue.start, SwapQueue.release_due_at_pack, SwapQueue.release_due_at_unpack
        recorder = self

        def started(queue, cand, x):
            storage = x.untyped_storage()
            recorder.started.append((cand, StorageWeakRef(storage), storage.nbytes()))
            start(queue, cand, x)

        def released_at_pack(queue, k):
            at_pack(queue, k)
            recorder.record("pack", k)

        def released_at_unpack(queue, u):
            at_unpack(queue, u)
            recorder.record("unpack", u)

        monkeypatch.setattr(SwapQueue, "start", started)
        monkeypatch.setattr(SwapQueue, "release_due_at_pack", released_at_pack)
        monkeypatch.setattr(SwapQueue, "release_due_at_unpack", released_at_unpack)

    def record(self, clock: str, position: int) -> None:
        held = sum(n for c, _, n in self.started if c.copy_out is not None and c.copy_out.source is not None)
        alive = sum(n for _, ref, n in self.started if not ref.expired())
        self.points.append((clock, position, held, alive))

    def take(self):
        points, self.points, self.started = self.points, [], []
        return points


def _solved_swap_plan():
    from regen.planner import solve
    from plans import profile as fixed_profile  # fixed times: the same plan on a busy machine

    w = make("gpt")
    profile = fixed_profile(w)
    cap = int(profile.peak_bytes * CAP_FRACTION)
    try:
        plan = solve(profile, cap, "swap", time_limit_s=30, link_ratio=LINK_RATIO)
    except InfeasibleCapError as exc:
        plan = solve(profile, int(exc.smallest_feasible_cap_bytes * 1.02), "swap", time_limit_s=30,
                     link_ratio=LINK_RATIO)
    return w, profile, plan


def _simulated_held_bytes(profile, plan):
    """The simulator's view, per (clock, position): bytes of swapped storages packed before that release point
    and released after it (their release step is later than the point's op)."""
    graph = build_graph(profile, plan.d2h_bytes_per_s, plan.h2d_bytes_per_s)
    sim = simulate(graph, choices_from_plan(graph, plan))
    by_id = graph.by_saved_id()
    swaps = [by_id[d.saved_tensor] for d in plan.decisions if d.action == ACTION_SWAP]

    def held(clock: str, position: int) -> int:
        step_ = graph.pack_steps[position] if clock == "pack" else graph.unpack_steps[position]
        return sum(c.bytes for c in swaps if (clock == "unpack" or min(c.saved.entries) < position)
                   and step_ < sim.release_steps[c.index])

    return held


@pytest.mark.slow
def test_swapped_memory_at_each_release_point_is_the_simulators(monkeypatch):
    w, profile, plan = _solved_swap_plan()
    swaps = [d for d in plan.decisions if d.action == ACTION_SWAP]
    assert swaps and all(d.release_before_op is not None for d in swaps)
    assert any(d.release_at_pack is not None for d in swaps)  # released in forward
    planned = {("pack", d.release_at_pack) if d.release_at_pack is not None else ("unpack", d.release_at_unpack)
               for d in swaps}
    simulated_held = _simulated_held_bytes(profile, plan)
    reference = run_and_grads(w)
    recorder = _Recorder(monkeypatch)
    steps = []
    with regen.apply(w.model, plan, emulate_link=True) as handle:
        for n in range(STEPS):
            assert_same(reference, run_and_grads(w))
            points = recorder.take()
            # one point per release position of the plan, where regen holds what the simulator has resident
            assert {(clock, pos) for clock, pos, _, _ in points} == planned, f"step {n}"
            assert [held for _, _, held, _ in points] == [simulated_held(clock, pos) for clock, pos, _, _ in points]
            steps.append(points)
    assert handle.stats.planned_steps == STEPS
    # the memory really alive at each point (regen's and the model's own references) is the same every step:
    # it follows op order, not how far the copies have got
    assert all(points == steps[0] for points in steps)


def _slow_swap_plan(release_in_backward: bool, bytes_per_s: float = VERY_SLOW_BYTES_PER_S):
    w, trace = traced("gpt")
    plan = PLANS["swap"](trace)
    plan.d2h_bytes_per_s = plan.h2d_bytes_per_s = bytes_per_s
    if release_in_backward:
        for d in plan.decisions:
            if d.action == ACTION_SWAP:
                d.release_at_pack, d.release_at_unpack = None, d.swap_in_at_unpack
                d.release_before_op = d.swap_in_before_op
    return w, plan


def test_the_forward_does_not_wait_for_copy_outs_due_in_backward():
    w, plan = _slow_swap_plan(release_in_backward=True)
    reference = run_and_grads(w)
    with regen.apply(w.model, plan, emulate_link=True) as handle:
        assert_same(reference, run_and_grads(w))  # the first step verifies; later ones match packs by order
        w.model.zero_grad(set_to_none=True)
        waited_s = handle.stats.link_wait_s
        torch.manual_seed(0)
        t0 = time.perf_counter()
        loss = w.loss_fn(w.model(*w.batch), w.batch)
        forward_s = time.perf_counter() - t0
        step_ = handle.current
        assert step_.stage == STAGE_CLOSED  # the forward ended at its last pack
        # no barrier: the copy-outs are still running and their storages held, nothing was waited for
        assert handle.stats.link_wait_s == waited_s
        assert step_.swaps.due_at_unpack and any(c.copy_out.source is not None for _, _, c in step_.swaps.due_at_unpack)
        copy_s = handle.plan_states[0].index.swap_bytes / VERY_SLOW_BYTES_PER_S
        assert forward_s < copy_s / 2
        loss.backward()
        del loss
        assert handle.stats.link_wait_s > waited_s  # backward waited at the release points


def test_a_pack_looks_only_at_the_first_pending_copy_out(monkeypatch):
    w, plan = _slow_swap_plan(release_in_backward=True, bytes_per_s=SLOW_BYTES_PER_S)
    queries = [0]
    query = LinkCopy.query

    def counted(event):
        queries[0] += 1
        return query(event)

    monkeypatch.setattr(LinkCopy, "query", counted)
    with regen.apply(w.model, plan, emulate_link=True) as handle:
        step(w)
        queries[0] = 0
        swapped = handle.stats.swapped_tensors
        loss = w.loss_fn(w.model(*w.batch), w.batch)
        packs = handle.current.forward_packs_seen
        # many copy-outs pending (the link is slow) over many packs
        assert handle.stats.swapped_tensors - swapped >= 10 and packs >= 50
        assert queries[0] <= packs  # O(1) per pack (none at all: nothing is due before backward)
        loss.backward()
        del loss


def test_copy_ins_due_at_one_unpack_are_issued_in_pack_order(monkeypatch):
    """The simulator runs the copy-ins due at one point in the order their copy-outs started (the step's pack
    order: regen.planner.simulator); so does the runtime's queue."""
    w, trace = traced("gpt")
    plan = PLANS["swap"](trace)
    swaps = [d for d in plan.decisions if d.action == ACTION_SWAP]
    assert len(swaps) >= 3
    first = min(d.swap_in_at_unpack for d in swaps)
    for d in swaps:  # all due at the first one's point
        d.swap_in_at_unpack = first
    started, issued = [], []
    start, issue = SwapQueue.start, SwapQueue._issue

    def record_start(queue, ps, x):
        started.append(ps.info.decision.saved_tensor)
        start(queue, ps, x)

    def record_issue(queue, ps):
        issued.append(ps.info.decision.saved_tensor)
        issue(queue, ps)

    monkeypatch.setattr(SwapQueue, "start", record_start)
    monkeypatch.setattr(SwapQueue, "_issue", record_issue)
    reference = run_and_grads(w)
    with regen.apply(w.model, plan, emulate_link=True) as handle:
        assert_same(reference, run_and_grads(w))
    assert handle.stats.synchronous_copy_ins == 0
    assert len(started) == len(swaps) and issued == started
