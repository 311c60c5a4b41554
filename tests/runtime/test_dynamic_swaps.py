"""Dynamic mode with a host link (regen.runtime.dynamic.swaps): saved tensors swapped out and back as well
as dropped, under the cap, with exact results.

On a CPU device the link is emulated (`emulate_link=True, link_gb_s=...`): a clock per direction,
copy-in buffers poisoned until their bytes land, so a consumer that did not wait for its copy-in reads
poison and its gradients differ. The peak is measured by the allocator (regen.measure) as in
test_dynamic.py: the model's memory at the step's start plus the measured increase; the host pool is
host memory, counted apart (allocated by the warm-up step, reused by the measured one).
"""

import warnings

import pytest
import torch

import regen
from common import accumulate_grads, assert_same, fail_inside_a_step, make, retained_graph_grads, run_and_grads
from regen.errors import RegenError
from regen.measure import measure_memory
from regen.runtime.dynamic import OverCapWarning
from regen.runtime.dynamic.cap_memory import model_storages

CAP_TOLERANCE = 0.05
CAP_FRACTIONS = {"gpt": 0.6, "cnn": 0.8, "hf-gpt2": 0.8}


def _capped(name):
    if name.startswith("hf-"):
        pytest.importorskip("transformers")
    w = make(name)
    run_and_grads(w)
    reference = run_and_grads(w)
    unplanned = measure_memory(lambda: run_and_grads(w))
    w.model.zero_grad(set_to_none=True)
    start = sum(model_storages(w.model).values())
    cap = int(start + CAP_FRACTIONS[name] * unplanned.peak_increase_bytes)
    return w, reference, cap, start


@pytest.mark.parametrize("name, link_gb_s", [("gpt", 5.0), ("gpt", 0.2), ("cnn", 5.0), ("hf-gpt2", 5.0)])
def test_swapping_dynamic_mode_is_exact_and_under_cap(name, link_gb_s):
    w, reference, cap, start = _capped(name)
    got = []
    with warnings.catch_warnings(record=True) as caught, \
            regen.apply(w.model, memory_cap=cap, emulate_link=True, link_gb_s=link_gb_s) as handle:
        warnings.simplefilter("always", OverCapWarning)
        got.append(run_and_grads(w))  # the host pool grows in this step; the measured one reuses it
        measured = measure_memory(lambda: got.append(run_and_grads(w)))
        pool = handle.engine.swaps.pool
        assert pool.checked_out_bytes == 0  # every host range went back when its step was released
    for g in got:
        assert_same(reference, g)  # a copy-in read before it landed would read poison bytes
    assert start + measured.peak_increase_bytes <= (1 + CAP_TOLERANCE) * cap
    stats = handle.stats
    assert stats.copy_outs > 0 and stats.swap_evictions > 0 and stats.copy_ins > 0
    # regen's own reading of memory in use stays within the cap + 5%; rarely, under load, copy-ins in flight
    # leave nothing to drop at some op and the step passes the cap by about 1% (seen once in 13 runs of hf-gpt2
    # at 5 GB/s: 7,463,948 B against 7,391,686), under the tolerance past which it warns
    assert stats.peak_in_use_bytes <= (1 + CAP_TOLERANCE) * cap
    # and never silently
    assert (stats.over_cap_steps > 0) == any(issubclass(c.category, OverCapWarning) for c in caught)
    assert not handle.engine.swaps.engine.running  # every copy landed by the time the handle was removed


def test_a_fast_link_swaps_instead_of_rebuilding():
    w, reference, cap, _ = _capped("gpt")
    with regen.apply(w.model, memory_cap=cap) as dropping:
        assert_same(reference, run_and_grads(w))
    with regen.apply(w.model, memory_cap=cap, emulate_link=True, link_gb_s=50.0) as swapping:
        assert_same(reference, run_and_grads(w))
    assert swapping.stats.swap_evictions > 0
    assert swapping.stats.rebuilds < dropping.stats.rebuilds  # a copied-back tensor rebuilds nothing


def test_many_steps_reuse_the_host_pool():
    w, reference, cap, _ = _capped("gpt")
    with regen.apply(w.model, memory_cap=cap, emulate_link=True, link_gb_s=5.0) as handle:
        assert_same(reference, run_and_grads(w))
        capacity = handle.engine.swaps.pool.capacity_bytes
        for _ in range(4):
            assert_same(reference, run_and_grads(w))
        assert handle.engine.swaps.pool.capacity_bytes == capacity
    assert handle.stats.steps == 5


@pytest.mark.parametrize("where", ["forward", "between", "backward"])
def test_an_exception_stops_the_link_and_gives_every_range_back(where):
    w = make("gpt")
    reference = run_and_grads(w)
    cap = sum(model_storages(w.model).values()) + 4 * 2**20
    handle = fail_inside_a_step(w, None, where, memory_cap=cap, emulate_link=True, link_gb_s=5.0)
    assert not handle.engine.swaps.engine.running  # every copy landed
    assert handle.engine.swaps.pool.checked_out_bytes == 0 and not handle.engine.swaps.in_flight
    assert not handle.hooks_installed and handle.active_steps == 0
    assert_same(reference, run_and_grads(w))


def test_link_gb_s_is_for_dynamic_mode_alone():
    from handmade import PLANS
    from common import traced

    w, trace = traced("gpt")
    with pytest.raises(RegenError, match="link_gb_s is for dynamic mode"):
        regen.apply(w.model, PLANS["hybrid"](trace), link_gb_s=12)
    with pytest.raises(RegenError, match="learn=True's dynamic steps recompute only"):
        regen.apply(w.model, memory_cap="1GiB", learn=True, emulate_link=True, link_gb_s=12)
    assert not w.model._forward_pre_hooks


def test_a_consumer_that_does_not_wait_reads_poison(monkeypatch):
    """The test above fails when the runtime reads a copy-in before its bytes landed."""
    from regen.runtime.swap import EmulatedEngine

    w, reference, cap, _ = _capped("gpt")
    monkeypatch.setattr(EmulatedEngine, "wait_copy_in", lambda self, cin: None)
    with regen.apply(w.model, memory_cap=cap, emulate_link=True, link_gb_s=0.2) as handle:
        got = run_and_grads(w)
    assert handle.stats.copy_ins > 0
    with pytest.raises(AssertionError):
        assert_same(reference, got)


def test_interleaved_steps_and_a_retained_graph_swap_exactly():
    """Two forwards before one backward (their nodes share (op, slot) names), and a second backward over a
    retained graph: each copy-in lands in its own step's node."""
    w = make("gpt")
    cap = sum(model_storages(w.model).values()) + 6 * 2**20  # two steps' activations (interleaved) pass it
    reference = accumulate_grads(w, True)
    with regen.apply(w.model, memory_cap=cap, emulate_link=True, link_gb_s=5.0) as handle:
        got = accumulate_grads(w, True)
    assert all(torch.equal(reference[k], got[k]) for k in reference)
    assert handle.stats.swap_evictions > 0 and handle.stats.copy_ins > 0

    reference = retained_graph_grads(w)
    with regen.apply(w.model, memory_cap=cap, emulate_link=True, link_gb_s=5.0) as handle:
        got = retained_graph_grads(w)
    assert all(torch.equal(reference[k], got[k]) for k in reference)
    assert handle.engine.swaps.pool.checked_out_bytes == 0


class _Node:
    """What swaps.py reads of a dynamic step's node."""

    def __init__(self, tensor):
        self.key, self.tensor, self.host = (5, 0), tensor, None
        self.nbytes, self.evictable, self.last_access = tensor.untyped_storage().nbytes(), True, 0


def test_copy_ins_are_told_apart_across_steps():
    """Two live steps' nodes share their (op, slot) name: a copy-in issued ahead for one is never handed
    to the other."""
    from regen.runtime.dynamic import DynamicStats
    from regen.runtime.dynamic.swaps import DynamicSwaps

    swaps = DynamicSwaps(torch.device("cpu"), (1e9, 1e9), DynamicStats(), emulated=True)
    try:
        first, second = _Node(torch.full((65536,), 1.0)), _Node(torch.full((65536,), 2.0))
        swaps.copy_out_ahead([first, second])
        for node in (first, second):
            swaps.evict(node)
            node.tensor = None
        swaps.prefetch([first], room_bytes=1 << 30, track=lambda buffer: None)
        restored = swaps.bring_in(second).view(torch.float32)
        assert torch.equal(restored, torch.full((65536,), 2.0))
        assert torch.equal(swaps.bring_in(first).view(torch.float32), torch.full((65536,), 1.0))
        for node in (first, second):
            swaps.forget(node)
        assert swaps.pool.checked_out_bytes == 0
    finally:
        swaps.close()
