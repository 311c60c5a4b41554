"""Gradients a training loop holds from one step to the next, counted in a plan's memory.

A profile records a step that begins without gradients (its loop zeroes them with `set_to_none=True`, as
torch's optimizers do by default) and makes each one in backward. A loop that accumulates gradients over
micro-batches, or zeroes them in place (`zero_grad(set_to_none=False)`), begins its steps with every
gradient allocated: at any op its memory is the profiled step's plus the gradients that step had not made
yet. A plan solved with `gradients_held=True` (`regen solve --gradients-held`) counts all of them at every
op: an upper bound, exact in forward and at the loss, where a step's peak mostly lies.
"""

from __future__ import annotations

import dataclasses

from regen.formats.profile import Profile


def held_gradient_bytes(profile: Profile) -> int:
    """The bytes of the gradients such a loop holds through the whole step (all of the profiled step's)."""
    return int(profile.static_memory.gradient_bytes)


def with_gradients_held(profile: Profile) -> Profile:
    """`profile` with the held gradients in its memory from the step's start to its end (a copy)."""
    held = held_gradient_bytes(profile)
    ops = [dataclasses.replace(op, memory_after_bytes=op.memory_after_bytes + held,
                               memory_peak_bytes=op.memory_peak_bytes + held) for op in profile.ops]
    return dataclasses.replace(profile, ops=ops, memory_at_start_bytes=profile.memory_at_start_bytes + held,
                               peak_bytes=profile.peak_bytes + held)
