"""The probe of what the runtime adds per event (regen.runtime.self_timing), as `regen profile` runs it."""

import math
import time

import pytest
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
    the tracker in turn (the tracker counting its ops); the method says so. The forwards report fixed times (the
    tracked one 10 us longer), so that a loaded machine cannot make the workload's figure read as a burst of load
    (over 8x the tiny tensors', which would be charged instead)."""
    from contextlib import nullcontext

    from regen.runtime.self_timing import FORWARD_PROBE_PAIRS, WORKLOAD_METHOD
    from regen.runtime.tracker import ForwardTracker

    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.GELU(), torch.nn.Linear(64, 1))
    x = torch.randn(16, 32)
    contexts = []

    def timed_forward(context) -> float:
        contexts.append(type(context))
        with context:
            loss = model(x).square().mean()
        loss.backward()
        return 1e-3 + (1e-5 if isinstance(context, ForwardTracker) else 0.0)

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


def test_the_workload_probe_starts_no_pair_that_would_end_past_its_budget(monkeypatch):
    """Pairs of 60 ms against a 150 ms budget: a third would end at 180 ms, so two are timed, not three (a large
    model whose pair takes 0.9 s of the 1-s budget is timed for one pair, not two: half a second of its profile)."""
    from regen.runtime import self_timing as costs

    monkeypatch.setattr(costs, "FORWARD_PROBE_BUDGET_S", 0.15)
    calls = []

    def forward_of_30_ms(context) -> float:
        calls.append(type(context))
        with context:
            torch.ones(4).add(1)
        time.sleep(0.03)  # a loaded machine only sleeps longer: fewer pairs, never more
        return 0.03

    measure_runtime_costs(torch.device("cpu"), forward_of_30_ms)
    assert 2 <= len(calls) <= 4 < 2 * costs.FORWARD_PROBE_PAIRS


def test_the_dispatch_figure_is_not_lowered_by_plain_forwards_slowed_by_what_came_before():
    """Plain forwards that come first after other work run slow (NOTE [ The workload's dispatch figure ]): two of
    the three pairs' plain forwards here, which made the median of pair differences read 0. The least tracked
    forward less the least plain one, the profile's plain forwards among them, reads the tracker's cost."""
    from contextlib import nullcontext

    from regen.runtime.self_timing import FORWARD_PROBE_PAIRS, WORKLOAD_METHOD

    settled_s, per_op_s, slow_plain_s = 20e-3, 6e-6, iter([26e-3, 25e-3])
    counted = []

    def timed_forward(context) -> float:
        with context:
            y = torch.ones(8)
            for _ in range(100):
                y = y.add(1)
        if isinstance(context, nullcontext):
            return next(slow_plain_s, settled_s)
        counted.append(context.step.count)
        return settled_s + context.step.count * per_op_s

    assert FORWARD_PROBE_PAIRS == 3
    costs = measure_runtime_costs(torch.device("cpu"), timed_forward, plain_forward_times_s=[20.5e-3, settled_s])
    assert costs.method.endswith(WORKLOAD_METHOD)
    assert counted and counted[0] >= 100
    assert abs(costs.dispatch_op_s - per_op_s) < 0.01 * per_op_s


class _Clock:
    """A clock that only the test moves: what the probe times is what the test says each piece of work costs."""

    def __init__(self):
        self.now_s = 0.0

    def perf_counter(self) -> float:
        return self.now_s


def test_the_swap_figure_counts_what_a_swap_adds_next_to_compute(monkeypatch):
    """The swap figure includes what swaps cost a computing thread: an engine whose copy-in issue takes 2 ms of
    the compute thread (off the calls-alone probe's tiny tensors) measures that per swap, and 0 without it. The
    probe reads a clock the test moves (a matmul 0.1 ms, an engine call nothing), so no load can change the
    figures this test compares."""
    from regen.runtime import self_timing as probe
    from regen.runtime import stats
    from regen.runtime.swap import EmulatedEngine

    clock = _Clock()

    def matmuls(a, n):
        clock.now_s += n * 1e-4

    class NoMemmoves(stats.RuntimeStats):  # the link's memmoves are timed on the real clock: none here
        link_copy_cpu_s = property(lambda self: 0.0, lambda self, value: None)

    monkeypatch.setattr(probe, "time", clock)
    monkeypatch.setattr(probe, "_matmuls", matmuls)
    monkeypatch.setattr(stats, "RuntimeStats", NoMemmoves)
    plain = probe._swap_reading(torch.device("cpu")).value_s
    original = EmulatedEngine.copy_in

    def slow_copy_in(self, out):
        if out.slot.nbytes >= probe.SWAP_PROBE_BYTES:  # the interleaved probe's sources only
            clock.now_s += 2e-3
        return original(self, out)

    monkeypatch.setattr(EmulatedEngine, "copy_in", slow_copy_in)
    slowed = probe._swap_reading(torch.device("cpu")).value_s
    assert plain == 0.0 and slowed == pytest.approx(2e-3), (plain, slowed)


def _busy(stop: "threading.Event") -> None:
    """What a loaded machine does beside the probe: matmuls (off the GIL) and Python (on it), in turns."""
    a = torch.randn(256, 256)
    while not stop.is_set():
        a @ a
        sum(range(2000))


def test_beside_a_busy_thread_every_figure_stays_within_its_bound():
    """The probe under load: each figure is in bounds, or its default with a note and a warning; the
    profile that holds them loads (a figure out of bounds would be refused there)."""
    import threading
    import warnings as warnings_module

    from regen.formats.profile import RUNTIME_COST_BOUNDS_S, RUNTIME_COST_DEFAULTS_S

    stop = threading.Event()
    threads = [threading.Thread(target=_busy, args=(stop,), daemon=True) for _ in range(2)]
    for t in threads:
        t.start()
    try:
        with warnings_module.catch_warnings(record=True) as caught:
            warnings_module.simplefilter("always")
            costs = measure_runtime_costs(torch.device("cpu"))
    finally:
        stop.set()
        for t in threads:
            t.join()
    for name, value in costs.figures().items():
        assert 0.0 <= value <= RUNTIME_COST_BOUNDS_S[name], (name, value)
        fell_back = any(note.startswith(f"{name}:") for note in costs.notes)
        assert not fell_back or value == RUNTIME_COST_DEFAULTS_S[name]
    assert len([w for w in caught if issubclass(w.category, RuntimeWarning)]) == len(costs.notes)
    assert set(costs.spreads) == set(RUNTIME_COST_BOUNDS_S)


def test_a_figure_out_of_bounds_is_measured_again_then_falls_back_and_never_reaches_a_plan(monkeypatch, tmp_path):
    """A reading above its bound is measured again (PROBE_ATTEMPTS in all) and then charged its default,
    with a one-line warning; written into a profile by hand, the same figure is refused on load, so the
    planner never charges it."""
    import dataclasses

    import pytest

    from regen.errors import FormatError
    from regen.formats import load_profile, save_profile
    from regen.formats.profile import RUNTIME_COST_BOUNDS_S, RUNTIME_COST_DEFAULTS_S
    from regen.graphs.synthetic import chain_profile
    from regen.runtime import self_timing as probe

    calls = []
    steady = {name: probe.Reading(value / 2, 0.0) for name, value in RUNTIME_COST_DEFAULTS_S.items()}

    def poisoned(device):
        calls.append(device)
        return {name: r for name, r in steady.items() if name != "swap_s"} | {"dispatch_op_s": probe.Reading(1.2e-3, 0.1)}

    monkeypatch.setattr(probe, "_op_readings", poisoned)
    monkeypatch.setattr(probe, "_swap_reading", lambda device: steady["swap_s"])
    with pytest.warns(RuntimeWarning, match="dispatch_op_s: read 0.0012 s .* charged its default"):
        costs = measure_runtime_costs(torch.device("cpu"))
    assert len(calls) == probe.PROBE_ATTEMPTS
    assert costs.dispatch_op_s == RUNTIME_COST_DEFAULTS_S["dispatch_op_s"]
    assert costs.capture_op_s == steady["capture_op_s"].value_s and len(costs.notes) == 1

    profile = chain_profile(4, seed=1, copy_bytes_per_s=5e9)
    profile.runtime_costs = dataclasses.replace(costs, dispatch_op_s=2 * RUNTIME_COST_BOUNDS_S["dispatch_op_s"])
    save_profile(profile, tmp_path / "poisoned.yaml")
    with pytest.raises(FormatError, match="runtime_costs: dispatch_op_s 0.0004 s is above its bound"):
        load_profile(tmp_path / "poisoned.yaml")


def test_an_unsteady_figure_is_measured_again_and_its_steadier_reading_kept(monkeypatch):
    from regen.formats.profile import RUNTIME_COST_DEFAULTS_S
    from regen.runtime import self_timing as probe

    readings = iter([{"capture_op_s": probe.Reading(90e-6, 2.0)}, {"capture_op_s": probe.Reading(30e-6, 0.1)}])
    steady = {name: probe.Reading(value, 0.0) for name, value in RUNTIME_COST_DEFAULTS_S.items() if name != "swap_s"}
    monkeypatch.setattr(probe, "_op_readings", lambda device: steady | next(readings))
    monkeypatch.setattr(probe, "_swap_reading", lambda device: probe.Reading(1e-4, 0.0))
    costs = measure_runtime_costs(torch.device("cpu"))
    assert costs.capture_op_s == 30e-6 and costs.spreads["capture_op_s"] == 0.1 and costs.notes == []


def test_only_the_unsettled_group_of_figures_is_measured_again(monkeypatch):
    """A steady swap figure is not measured again because an op figure was unsteady (the swap probe is the
    costly one)."""
    from regen.formats.profile import RUNTIME_COST_DEFAULTS_S
    from regen.runtime import self_timing as probe

    readings = iter([{"recipe_s": probe.Reading(60e-6, 3.0)}, {"recipe_s": probe.Reading(50e-6, 0.2)}])
    steady = {name: probe.Reading(value, 0.0) for name, value in RUNTIME_COST_DEFAULTS_S.items() if name != "swap_s"}
    swaps = []
    monkeypatch.setattr(probe, "_op_readings", lambda device: steady | next(readings))
    monkeypatch.setattr(probe, "_swap_reading", lambda device: swaps.append(device) or probe.Reading(1e-4, 0.0))
    costs = measure_runtime_costs(torch.device("cpu"))
    assert len(swaps) == 1 and costs.recipe_s == 50e-6
