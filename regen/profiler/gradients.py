"""When the recorded step makes each parameter's gradient (the profile's `gradients_made`).

A post-accumulate-grad hook on every parameter that requires grad and has none yet: the first time autograd
stores its gradient, the hook notes the last op recorded before it and the gradient's storage bytes (each
storage once, as `static_memory.gradient_bytes` counts them: a DTensor's by its local shard). A loop that holds its
gradients from step to step holds, at op t, those made after t (regen.planner.held_gradients).
"""

from __future__ import annotations

from typing import Callable

import torch

from regen.formats.profile import GradientMade
from regen.opinfo import storage_key_and_bytes


class GradientWatch:
    """Context manager over a recorded step; `made` holds what it saw, in the order the gradients came."""

    def __init__(self, parameters: list[torch.nn.Parameter], last_op: Callable[[], int]):
        """`last_op`: the index of the last op recorded so far."""
        self.made: list[GradientMade] = []
        self._parameters = [p for p in parameters if p.requires_grad and p.grad is None]
        self._last_op = last_op
        self._seen: set[int] = set()
        self._handles = []

    def _stored(self, parameter: torch.Tensor) -> None:
        # the storage as static_memory.gradient_bytes counts it (regen.opinfo.unique_storage_bytes)
        found = storage_key_and_bytes(parameter.grad) if isinstance(parameter.grad, torch.Tensor) else None
        if found is None or not found[0] or found[0] in self._seen:
            return
        self._seen.add(found[0])
        self.made.append(GradientMade(after_op=max(self._last_op(), 0), bytes=found[1]))

    def __enter__(self) -> GradientWatch:
        self._handles = [p.register_post_accumulate_grad_hook(self._stored) for p in self._parameters]
        return self

    def __exit__(self, *exc) -> None:
        for h in self._handles:
            h.remove()
        self._handles = []
