"""Gradients a training loop holds from one step to the next, counted in a plan's memory.

A profile records a step that begins without gradients (its loop zeroes them with `set_to_none=True`, as
torch's optimizers do by default) and makes each one in backward. A loop that accumulates gradients over
micro-batches, or zeroes them in place (`zero_grad(set_to_none=False)`), begins its steps with every
gradient allocated: at any op its memory is the profiled step's plus the gradients that step had not made
yet. A plan solved with `gradients_held=True` (`regen solve --gradients-held`) counts, at each op, the
gradients the profiled step had not made before it (`Profile.gradients_made`: in the held loop autograd adds
each new gradient into the held one and frees it, where the profiled step kept it). A profile without
`gradients_made` counts all of them at every op: an upper bound, exact in forward and at the loss.
"""

from __future__ import annotations

import dataclasses

from regen.formats.profile import Profile


def held_gradient_bytes(profile: Profile) -> int:
    """The bytes of the gradients such a loop holds through the whole step (all of the profiled step's)."""
    return int(profile.static_memory.gradient_bytes)


def with_gradients_held(profile: Profile) -> Profile:
    """`profile` with the held gradients it had not made yet in its memory at each op (a copy)."""
    held = held_gradient_bytes(profile)
    not_made = _not_made_bytes(profile, held)
    ops = [dataclasses.replace(op, memory_after_bytes=op.memory_after_bytes + extra,
                               memory_peak_bytes=op.memory_peak_bytes + extra)
           for op, extra in zip(profile.ops, not_made)]
    return dataclasses.replace(profile, ops=ops, memory_at_start_bytes=profile.memory_at_start_bytes + held,
                               peak_bytes=max([profile.memory_at_start_bytes + held]
                                              + [op.memory_peak_bytes for op in ops]))


def _not_made_bytes(profile: Profile, held: int) -> list[int]:
    """Per op, the held gradient bytes the profiled step had not made before it (all of them without
    `gradients_made`)."""
    made_after = [0] * len(profile.ops)
    for g in profile.gradients_made or []:
        if g.after_op + 1 < len(made_after):
            made_after[g.after_op + 1] += g.bytes
    not_made, left = [], held
    for made in made_after:
        left -= made
        not_made.append(max(left, 0))
    return not_made
