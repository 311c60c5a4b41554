"""A planned step that begins with gradients held from before it, under a plan solved for steps that make them.

A profile's step begins without gradients and makes them in backward; a loop that accumulates gradients over
micro-batches, or zeroes them in place (`zero_grad(set_to_none=False)`), holds all of them from its steps'
start, on top of what the plan counted: such a step can pass the plan's cap by up to their bytes. The handle
says so once, with the figure and the remedy (a plan solved with `--gradients-held`, which counts them:
regen.planner.held_gradients). Checked at each planned step's start until said; nothing is changed.
"""

from __future__ import annotations

import warnings

import torch
from torch import nn

from regen.formats.plan import Plan
from regen.units import format_bytes


class HeldGradientsWarning(UserWarning):
    """A planned step began with gradients its plan did not count (said once per handle)."""


def held_gradient_bytes(model: nn.Module) -> int:
    """Bytes of the gradients the model's trainable parameters hold now (each storage once; a DTensor's, FSDP2's
    sharded gradient, is its local shard's; a gradient without a plain storage, a sparse one, by its elements)."""
    storages = {}
    for p in model.parameters():
        if not p.requires_grad or p.grad is None:
            continue
        g = p.grad
        local = getattr(g, "_local_tensor", None)
        g = local if isinstance(local, torch.Tensor) else g
        try:
            s = g.untyped_storage()
            storages[s.data_ptr()] = s.nbytes()
        except (NotImplementedError, RuntimeError):
            storages[id(g)] = g.numel() * g.element_size()
    return sum(storages.values())


class HeldGradientsCheck:
    """Says once when a planned step begins with gradients its plan did not count."""

    def __init__(self, model: nn.Module):
        self.model = model
        self.said = False

    def step_begins(self, plan: Plan) -> None:
        if self.said or plan.gradients_held_bytes:
            return
        held = held_gradient_bytes(self.model)
        if not held:
            return
        self.said = True
        warnings.warn(
            f"regen.apply: a planned step began with {format_bytes(held)} of gradients held from before it "
            f"(gradient accumulation, or zero_grad(set_to_none=False)); its plan counts gradients only as the step "
            f"makes them, so the step can pass the cap of {format_bytes(plan.memory_cap_bytes)} by up to that: "
            f"solve with --gradients-held (regen.planner.solve(..., gradients_held=True)), which counts them",
            HeldGradientsWarning, stacklevel=4)
