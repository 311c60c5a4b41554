"""A swapped storage's host range lives from its copy-out to the last backward node that saved it: the
runtime gives it back when autograd frees the last handle, and the plan sizes the host pool over the same
interval (docs/milp.md "Host memory"), so the pool never grows past the plan's `host_pool_bytes`, even
for storages that backward reads more than once."""

import regen
from common import assert_same, make, run_and_grads
from plans import profile as fixed_profile
from regen.errors import InfeasibleCapError
from regen.formats.plan import ACTION_SWAP
from regen.formats.plan_rules import host_range_bytes
from regen.runtime.swap import HostPool

LINK_RATIO = 0.9
CAP_FRACTION = 0.5
STEPS = 3


def _swap_plan(w):
    """A swap plan from a profile with fixed times (tests/plans.py), so the plan is the same on a busy machine."""
    from regen.planner import solve

    profile = fixed_profile(w)
    try:
        return profile, solve(profile, int(profile.peak_bytes * CAP_FRACTION), "swap", time_limit_s=30,
                              link_ratio=LINK_RATIO)
    except InfeasibleCapError as exc:
        return profile, solve(profile, int(exc.smallest_feasible_cap_bytes * 1.02), "swap", time_limit_s=30,
                              link_ratio=LINK_RATIO)


def test_host_ranges_live_as_the_plan_sizes_them(monkeypatch):
    w = make("gpt")
    profile, plan = _swap_plan(w)
    swapped = [d for d in plan.decisions if d.action == ACTION_SWAP]
    entries = {s.id: s for s in profile.saved_tensors}
    assert any(len(entries[d.saved_tensor].backward_uses) > 1 for d in swapped)  # its range outlives its first use
    assert plan.host_pool_bytes == sum(host_range_bytes(d.bytes) for d in swapped)

    checked_out: list[int] = []
    allocate, release = HostPool.allocate, HostPool.release

    def allocated(pool, nbytes):
        slot = allocate(pool, nbytes)
        checked_out.append(pool.checked_out_bytes)
        return slot

    def released(pool, slot):
        release(pool, slot)
        checked_out.append(pool.checked_out_bytes)

    monkeypatch.setattr(HostPool, "allocate", allocated)
    monkeypatch.setattr(HostPool, "release", released)
    reference = run_and_grads(w)
    with regen.apply(w.model, plan, emulate_link=True) as handle:
        for n in range(STEPS):
            checked_out.clear()
            assert_same(reference, run_and_grads(w))
            assert max(checked_out) == plan.host_pool_bytes, f"step {n}"  # what the plan sized, no more
            assert checked_out[-1] == 0, f"step {n}"  # every range back once backward freed the handles
        assert handle.pool.grow_count == 1  # the first chunk, the plan's size, was enough every step
    assert handle.stats.planned_steps == STEPS
