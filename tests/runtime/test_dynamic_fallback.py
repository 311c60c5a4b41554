"""A call no plan fits runs in dynamic mode (on_mismatch="dynamic", the default), and plans are learned
for such calls while training (learn=True), with real profiles and plans (regen.profiler + regen.planner).

The plan is solved for batch A; a batch B twice its size is a call no plan fits: it runs under the plan's
cap (measured on CPU as the model's memory at the step's start plus the allocator's increase, as in
test_dynamic.py) with the unplanned loss, gradients and buffers bit for bit, and batch A still runs
planned. Learning: each call's first dynamic step yields a plan, used from the first call after it is
solved; every step's results and the RNG state after it equal the unplanned run's.
"""

import functools
import warnings

import pytest
import torch

import regen
from common import assert_nothing_left, assert_same, fail_inside_a_step, make, run_and_grads
from regen.errors import InfeasibleCapError, PlanMismatchError
from regen.measure import measure_memory
from regen.runtime import PlanMismatchWarning
from regen.runtime.dynamic import OverCapWarning
from regen.runtime.dynamic.cap_memory import model_storages

CAP_TOLERANCE = 0.05
# (the plan's cap as a fraction of batch A's unplanned peak, batch B's size): B passes the cap unplanned by
# more than the tolerance; the cnn's cap leaves room for its convolutions' own temporaries, which dynamic
# mode does not see on CPU (regen.runtime.dynamic.cap_memory)
CASES = {"gpt": (0.6, 8), "cnn": (0.9, 5)}


@functools.lru_cache(maxsize=None)
def _plan_for_batch_a(name):
    from regen.planner import solve
    from regen.profiler import profile_workload

    w = make(name)
    profile = profile_workload(w, device="cpu", repeats=1, warmup_steps=1, progress=None)
    cap = int(profile.peak_bytes * CASES[name][0])
    try:
        plan = solve(profile, memory_cap_bytes=cap, strategy="recompute", time_limit_s=30)
    except InfeasibleCapError as exc:
        plan = solve(profile, memory_cap_bytes=exc.smallest_feasible_cap_bytes, strategy="recompute",
                     time_limit_s=30)
    return w, plan


def _batch_b(w):
    other = make(w.name, batch_size=CASES[w.name][1])
    other.model = w.model
    return other


def _start_bytes(w) -> int:
    w.model.zero_grad(set_to_none=True)
    return sum(model_storages(w.model).values())


@pytest.mark.parametrize("name", ["gpt", "cnn"])
def test_a_call_no_plan_fits_runs_dynamic_under_the_plan_cap(name):
    w, plan = _plan_for_batch_a(name)
    other = _batch_b(w)
    reference_a, reference_b = run_and_grads(w), run_and_grads(other)
    start = _start_bytes(other)
    unplanned = measure_memory(lambda: run_and_grads(other))
    assert start + unplanned.peak_increase_bytes > (1 + CAP_TOLERANCE) * plan.memory_cap_bytes  # the cap binds B
    got_b = []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with regen.apply(w.model, plan) as handle:
            got_b.append(run_and_grads(other))
            measured = measure_memory(lambda: got_b.append(run_and_grads(other)))  # (it silences warnings)
            got_a = run_and_grads(w)
            got_b.append(run_and_grads(other))
    for got in got_b:
        assert_same(reference_b, got)
    assert_same(reference_a, got_a)
    assert start + measured.peak_increase_bytes <= (1 + CAP_TOLERANCE) * plan.memory_cap_bytes
    assert handle.stats.dynamic_steps == 3 and handle.stats.planned_steps == 1
    assert handle.dynamic_stats.steps == 3 and handle.dynamic_stats.evictions > 0
    notices = [c for c in caught if issubclass(c.category, PlanMismatchWarning)]
    assert len(notices) == 1 and "running such steps in dynamic mode under the cap" in str(notices[0].message)
    assert not [c for c in caught if issubclass(c.category, OverCapWarning)]
    assert_nothing_left(handle, w.model)


def test_raise_stays_a_choice():
    w, plan = _plan_for_batch_a("gpt")
    other = _batch_b(w)
    with pytest.raises(PlanMismatchError, match="the plan expects"):  # found within the step, as without "dynamic"
        with regen.apply(w.model, plan, on_mismatch="raise") as handle:
            run_and_grads(other)
    assert handle.stats.dynamic_steps == 0
    assert_nothing_left(handle, w.model)


@pytest.mark.parametrize("where", ["forward", "between", "backward"])
def test_exception_inside_a_dynamic_step_of_a_plan_leaves_nothing_behind(where):
    w, plan = _plan_for_batch_a("gpt")
    other = _batch_b(w)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", PlanMismatchWarning)
        handle = fail_inside_a_step(other, plan, where)
    assert handle.stats.dynamic_steps == 1
    assert_nothing_left(handle, w.model)
    assert_same(run_and_grads(other), run_and_grads(other))  # the model trains normally afterwards


def _steps(batches, learn_handle=None):
    """(loss, gradients, buffers, RNG state after the step) of each batch's step; with a learning handle,
    each plan being learned is solved before the next step."""
    results = []
    for w in batches:
        loss, grads, buffers = run_and_grads(w)
        results.append((loss, grads, buffers, torch.get_rng_state()))
        if learn_handle is not None:
            learn_handle.wait_for_learning()
    return results


def _assert_steps_same(reference, got):
    """Each step's loss, gradients, buffers and the RNG state after it, bit for bit."""
    assert len(reference) == len(got)
    for (loss, grads, buffers, rng), (loss2, grads2, buffers2, rng2) in zip(reference, got):
        assert_same((loss, grads, buffers), (loss2, grads2, buffers2))
        assert torch.equal(rng, rng2)


def test_learned_plans_are_used_from_the_next_step_and_saved(tmp_path):
    w = make("gpt")
    other = _batch_b(w)
    batches = [w, w, w, other, other, other, w]
    reference = _steps(batches)
    cap = _start_bytes(other) + int(0.6 * measure_memory(lambda: run_and_grads(other)).peak_increase_bytes)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the notices, and a learned plan at its smallest feasible cap
        with regen.apply(w.model, memory_cap=cap, learn=True) as handle:
            got = _steps(batches, handle)
        _assert_steps_same(reference, got)
        # A: dynamic (observed), dynamic (profiled before it), planned; B the same; A planned
        assert handle.stats.dynamic_steps == 4 and handle.stats.planned_steps == 3
        assert len(handle.save_learned_plans(tmp_path)) == 2
        with regen.apply(w.model, tmp_path, on_mismatch="raise") as loaded:
            assert_same(reference[0][:3], run_and_grads(w))
            assert_same(reference[3][:3], run_and_grads(other))
    assert loaded.stats.planned_steps == 2
    assert_nothing_left(handle, w.model)


@pytest.mark.parametrize("accumulating", [False, True])
def test_a_plan_learned_for_a_loop_that_holds_its_gradients_counts_them(tmp_path, accumulating):
    """Micro-batches accumulating into the same gradients (the observed step begins without them, the next with
    them all): the learned plan is solved with them held for the whole step (regen.planner.held_gradients); a
    loop that zeroes them to None before each step gets a plan that counts them as the step makes them."""
    from common import step

    from regen.formats import load_plan

    w = make("gpt")
    cap = _start_bytes(w) + int(0.7 * measure_memory(lambda: run_and_grads(w)).peak_increase_bytes)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the notices, and a learned plan at its smallest feasible cap
        with regen.apply(w.model, memory_cap=cap, learn=True) as handle:
            w.model.zero_grad(set_to_none=True)
            for _ in range(3):
                if not accumulating:
                    w.model.zero_grad(set_to_none=True)
                step(w)
                handle.wait_for_learning()
    (path,) = handle.save_learned_plans(tmp_path)
    held = load_plan(path).gradients_held_bytes
    assert (held > 0) == accumulating and handle.stats.planned_steps == 1


def test_a_model_that_returns_its_loss_is_learned():
    """A Hugging Face model given labels returns its loss (`output.loss`): nothing runs between the model's
    return and backward, and the learned plan takes the loss from the output as `regen profile` does."""
    w = make("hf-gpt2")
    batches = [w, w, w]
    reference = _steps(batches)
    cap = _start_bytes(w) + int(0.7 * measure_memory(lambda: run_and_grads(w)).peak_increase_bytes)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the cache notice, a plan at its smallest feasible cap
        with regen.apply(w.model, memory_cap=cap, learn=True) as handle:
            got = _steps(batches, handle)
    _assert_steps_same(reference, got)
    assert handle.stats.dynamic_steps == 2 and handle.stats.planned_steps == 1
    assert_nothing_left(handle, w.model)
