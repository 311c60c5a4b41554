"""The pack-order fast path: steps after the verified one of a plan without recompute decisions run
without the dispatch mode, matching saved tensors by pack order. Same gradients bit for bit, mismatches
still caught (raise and on_mismatch="keep"), gradient accumulation intact."""

import pytest
import torch
from torch.utils._python_dispatch import _get_current_dispatch_mode_stack

import regen
from common import accumulate_grads, assert_nothing_left, assert_same, other_batch, run_and_grads, step, traced
from handmade import PLANS
from regen.errors import PlanMismatchError
from regen.runtime import PlanMismatchWarning

STEPS = 4


class _ModeProbe:
    """Records, at every call of a block, whether the handle's dispatch mode was on the stack."""

    def __init__(self, handle, block):
        self.seen: list[bool] = []
        self.hook = block.register_forward_pre_hook(
            lambda *_: self.seen.append(handle.tracker in _get_current_dispatch_mode_stack()))


def test_swap_plan_steps_after_the_first_match_eager_bit_for_bit_without_the_mode():
    w, trace = traced("gpt")
    plan = PLANS["swap"](trace)
    references = [run_and_grads(w, seed=s) for s in range(STEPS)]
    with regen.apply(w.model, plan) as handle:
        probe = _ModeProbe(handle, w.model.blocks[0])
        swapped = []
        for s in range(STEPS):
            assert_same(references[s], run_and_grads(w, seed=s))
            swapped.append(handle.stats.swapped_tensors)
        probe.hook.remove()
    assert handle.plan_states[0].pack_sequence is not None and len(handle.plan_states[0].pack_sequence) > 0
    assert probe.seen == [True] + [False] * (STEPS - 1), "steps after the verified one must skip the mode"
    per_step = [b - a for a, b in zip([0] + swapped, swapped)]
    assert per_step[0] > 0 and len(set(per_step)) == 1, f"every step swaps the same tensors: {per_step}"
    assert handle.stats.planned_steps == STEPS and handle.stats.unplanned_steps == 0
    assert handle.pool.checked_out_bytes == 0 and handle.active_steps == 0


def test_keep_all_plan_uses_the_fast_path():
    w, trace = traced("gpt")
    reference = run_and_grads(w)
    with regen.apply(w.model, PLANS["keep-all"](trace)) as handle:
        for _ in range(3):
            assert_same(reference, run_and_grads(w))
    assert handle.plan_states[0].pack_sequence is not None
    assert handle.stats.planned_steps == 3


def test_recompute_plans_keep_the_mode_on_fast_steps():
    """Recipe ops must still be captured: the mode stays, but packs match by order after step 1."""
    w, trace = traced("gpt")
    reference = run_and_grads(w)
    with regen.apply(w.model, PLANS["hybrid"](trace)) as handle:
        probe = _ModeProbe(handle, w.model.blocks[0])
        for _ in range(2):
            assert_same(reference, run_and_grads(w))
        probe.hook.remove()
    assert handle.plan_states[0].pack_sequence is not None and handle.plan_states[0].fast_ops is not None
    assert probe.seen == [True, True]


def test_later_step_with_other_batch_shape_raises():
    w, trace = traced("gpt")
    plan = PLANS["swap"](trace)
    other = other_batch(w)
    with pytest.raises(PlanMismatchError, match="verified step"):
        with regen.apply(w.model, plan, on_mismatch="raise") as handle:
            run_and_grads(w)
            run_and_grads(w)
            assert handle.plan_states[0].pack_sequence is not None
            run_and_grads(other)
    assert_nothing_left(handle, w.model)


def test_later_step_with_other_batch_shape_keep_runs_unplanned():
    w, trace = traced("gpt")
    plan = PLANS["swap"](trace)
    other = other_batch(w)
    reference_other = run_and_grads(other)
    reference = run_and_grads(w)
    with regen.apply(w.model, plan, on_mismatch="keep") as handle:
        assert_same(reference, run_and_grads(w))
        assert_same(reference, run_and_grads(w))
        with pytest.warns(PlanMismatchWarning, match="verified step"):
            assert_same(reference_other, run_and_grads(other))
        assert_same(reference, run_and_grads(w))  # and the next right-shaped step is planned again
    assert handle.stats.steps == 4 and handle.stats.unplanned_steps == 1 and handle.stats.planned_steps == 3
    assert handle.pool.checked_out_bytes == 0


def test_fewer_saved_tensors_before_backward_is_a_mismatch():
    """A later forward that stops early (here: backward from an intermediate block output) saved fewer
    tensors than the verified step: the fast path notices at the first unpack."""
    w, trace = traced("gpt")
    plan = PLANS["swap"](trace)
    block_out = None

    def stop(m, a, out):
        nonlocal block_out
        block_out = out
        raise _Stop

    with pytest.raises(PlanMismatchError, match="before backward began"):
        with regen.apply(w.model, plan, on_mismatch="raise") as handle:
            run_and_grads(w)
            w.model.zero_grad(set_to_none=True)
            hook = w.model.blocks[0].register_forward_hook(stop)
            try:
                w.model(*w.batch)  # the forward stops after block 0
            except _Stop:
                pass
            finally:
                hook.remove()
            block_out.sum().backward()
    assert_nothing_left(handle, w.model)


class _Stop(Exception):
    pass


@pytest.mark.parametrize("strategy", ["swap", "hybrid"])
@pytest.mark.parametrize("interleaved", [False, True])
def test_gradient_accumulation_on_the_fast_path(interleaved, strategy):
    w, trace = traced("gpt")
    plan = PLANS[strategy](trace)
    reference = accumulate_grads(w, interleaved)
    with regen.apply(w.model, plan) as handle:
        step(w)  # the verified step
        assert handle.plan_states[0].pack_sequence is not None
        for _ in range(2):
            planned = accumulate_grads(w, interleaved)
            assert reference.keys() == planned.keys()
            assert all(torch.equal(reference[k], planned[k]) for k in reference)
    assert handle.stats.steps == 5 and handle.stats.planned_steps == 5
    assert handle.pool.checked_out_bytes == 0 and handle.active_steps == 0


class _Boom(RuntimeError):
    pass


def test_exception_in_a_fast_step_leaves_nothing_behind():
    w, trace = traced("gpt")
    plan = PLANS["swap"](trace)
    reference = run_and_grads(w)

    def explode(*_):
        raise _Boom("user code failed")

    with pytest.raises(_Boom):
        with regen.apply(w.model, plan) as handle:
            run_and_grads(w)
            hook = w.model.blocks[1].register_forward_hook(explode)
            try:
                step(w)  # a fast-path step, stopped halfway through its forward
            finally:
                hook.remove()
    assert handle.plan_states[0].pack_sequence is not None
    assert_nothing_left(handle, w.model)
    with regen.apply(w.model, plan) as handle2:
        for _ in range(2):
            assert_same(reference, run_and_grads(w))
    assert handle2.stats.planned_steps == 2


def test_only_a_verified_planned_step_records_the_pack_sequence():
    """A step that ran unplanned leaves the handle unverified, without a pack sequence; the next
    matching step verifies the plan and records it."""
    w, trace = traced("gpt")
    other = other_batch(w)
    with regen.apply(w.model, PLANS["swap"](trace), on_mismatch="keep") as handle:
        with pytest.warns(PlanMismatchWarning):
            run_and_grads(other)
        assert not handle.plan_states[0].verified and handle.plan_states[0].pack_sequence is None
        run_and_grads(w)
        assert handle.plan_states[0].verified and handle.plan_states[0].pack_sequence is not None
    assert handle.stats.unplanned_steps == 1 and handle.stats.planned_steps == 1
