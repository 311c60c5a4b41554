"""The probe of what the runtime adds per event (regen.runtime.self_timing), as `regen profile` runs it."""

import math
import time

import torch

from regen.runtime.self_timing import measure_runtime_costs


def test_the_probe_measures_the_runtime_s_own_work_on_cpu():
    costs = measure_runtime_costs(torch.device("cpu"))
    figures = [costs.dispatch_op_s, costs.capture_op_s, costs.replay_op_s, costs.recipe_s]
    assert all(math.isfinite(f) and 0.0 <= f < 0.01 for f in figures)
    # capturing and replaying an op run Python of regen's own around it: never free
    assert costs.capture_op_s > 0 and costs.replay_op_s > 0
    assert "regen.runtime.self_timing" in costs.method
    # a swap's cost to the compute thread (its calls through the emulated link's engine, and what it adds
    # next to compute): never free
    assert 0.0 < costs.swap_s < 0.01


def test_given_the_workload_s_forward_the_dispatch_cost_is_measured_there():
    """With `timed_forward`, dispatch_op_s comes from the workload's own forward, timed plainly and under
    the tracker in turn (the tracker counting its ops); the method says so."""
    from contextlib import nullcontext

    from regen.runtime.self_timing import FORWARD_PROBE_PAIRS, WORKLOAD_METHOD
    from regen.runtime.tracker import ForwardTracker

    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.GELU(), torch.nn.Linear(64, 1))
    x = torch.randn(16, 32)
    contexts = []

    def timed_forward(context) -> float:
        contexts.append(type(context))
        t0 = time.perf_counter()
        with context:
            loss = model(x).square().mean()
        forward_s = time.perf_counter() - t0
        loss.backward()
        return forward_s

    costs = measure_runtime_costs(torch.device("cpu"), timed_forward)
    assert contexts == [nullcontext, ForwardTracker] * FORWARD_PROBE_PAIRS
    assert math.isfinite(costs.dispatch_op_s) and 0.0 <= costs.dispatch_op_s < 0.01
    assert costs.method.endswith(WORKLOAD_METHOD)
    assert not measure_runtime_costs(torch.device("cpu")).method.endswith(WORKLOAD_METHOD)


def test_the_workload_probe_stops_at_its_time_budget_after_one_pair(monkeypatch):
    """A slow workload (a large model's steps) is timed for one plain and one tracked forward, not for
    FORWARD_PROBE_PAIRS of each."""
    from regen.runtime import self_timing as costs

    monkeypatch.setattr(costs, "FORWARD_PROBE_BUDGET_S", 0.05)
    calls = []

    def slow_forward(context) -> float:
        calls.append(type(context))
        with context:
            torch.ones(4).add(1)
        time.sleep(0.03)
        return 0.03

    measure_runtime_costs(torch.device("cpu"), slow_forward)
    assert len(calls) == 2 < 2 * costs.FORWARD_PROBE_PAIRS


def test_the_swap_figure_counts_what_a_swap_adds_next_to_compute(monkeypatch):
    """The swap figure includes what swaps cost a computing thread: an engine whose copy-in issue takes
    2 ms of the compute thread (off the calls-alone probe's tiny tensors) measures about that per swap."""
    from regen.runtime import self_timing as probe
    from regen.runtime.swap import EmulatedEngine

    plain = probe._swap_s(torch.device("cpu"))
    original = EmulatedEngine.copy_in

    def slow_copy_in(self, out):
        if out.slot.nbytes >= probe.SWAP_PROBE_BYTES:  # the interleaved probe's sources only
            t0 = time.perf_counter()
            while time.perf_counter() - t0 < 2e-3:
                pass
        return original(self, out)

    monkeypatch.setattr(EmulatedEngine, "copy_in", slow_copy_in)
    slowed = probe._swap_s(torch.device("cpu"))
    assert slowed > 1.5e-3 + 0.5 * plain, (plain, slowed)
