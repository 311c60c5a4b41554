"""A planned step that begins with gradients held from before it, under a plan solved for steps that make them.

A profile's step begins without gradients and makes them in backward; a loop that accumulates gradients over
micro-batches, or zeroes them in place (`zero_grad(set_to_none=False)`), holds all of them from its steps'
start, on top of what the plan counted: such a step can pass the plan's cap by up to their bytes. The handle
says so once, with the figure and the remedy (a plan solved with `--gradients-held`, which counts them:
regen.planner.held_gradients). Checked at each planned step's start until said; nothing is changed.
"""

from __future__ import annotations

import warnings
from typing import Callable, Iterable

from torch import nn

from regen.formats.plan import Plan
from regen.opinfo import unique_storage_bytes
from regen.units import format_bytes


class HeldGradientsWarning(UserWarning):
    """A planned step began with gradients its plan did not count (said once per handle)."""


def held_gradient_bytes(parameters: Iterable[nn.Parameter]) -> int:
    """Bytes of the gradients the trainable ones of `parameters` hold now, as a profile counts its step's
    (regen.opinfo.unique_storage_bytes: each storage once, a DTensor's local shard)."""
    return unique_storage_bytes(p.grad for p in parameters if p.requires_grad)


class HeldGradientsCheck:
    """Says once when a planned step begins with gradients its plan did not count; `parameters()` lists the
    model's (the handle's cached list: call_signature.TrainableCount)."""

    def __init__(self, parameters: Callable[[], Iterable[nn.Parameter]]):
        self.parameters = parameters
        self.said = False

    def step_begins(self, plan: Plan) -> None:
        if self.said or plan.gradients_held_bytes:
            return
        held = held_gradient_bytes(self.parameters())
        if not held:
            return
        self.said = True
        warnings.warn(
            f"regen.apply: a planned step began with {format_bytes(held)} of gradients held from before it "
            f"(gradient accumulation, or zero_grad(set_to_none=False)); its plan counts gradients only as the step "
            f"makes them, so the step can pass the cap of {format_bytes(plan.memory_cap_bytes)} by up to that: "
            f"solve with --gradients-held (regen.planner.solve(..., gradients_held=True)), which counts them",
            HeldGradientsWarning, stacklevel=4)
