"""The safety net: a planned step's measured peak compared with the plan's cap, warned about once.

On CUDA the handle reads `torch.cuda.max_memory_allocated` at the start of every PEAK_CHECK_EVERY_STEPS-th
step (the 1st, the 11th, ...) and when that step is released. regen never resets the allocator's peak
statistics (a training loop's own figures stay its own), so a step's peak is known when it set a new
maximum (the figure grew during the step), or is known to be at most the maximum it started under; a
step under an earlier, higher peak of the process (an unplanned step before `regen.apply`) cannot be
checked: reset the statistics before training under a plan. A peak over the cap by more than
PEAK_TOLERANCE gets one `CapExceededWarning` per handle, with the figures. `PeakCheck.observe` takes a
measured figure from any source.

On every device the same steps are also counted by regen itself (a CPU's allocator keeps no counter): the
storages a checked step drops for recompute are watched by weak references, and those still alive when its
backward begins were freed in the plan's figures but not in fact (something other than autograd holds
them: a cache, a list, a module attribute, the training loop, which the profile did not see). Their bytes
over the plan's predicted peak is the step's counted peak, warned about the same way
(`observe_drops_held`).
"""

from __future__ import annotations

import warnings
from typing import Callable

import torch

from regen.allocator import peak_bytes_reader

PEAK_CHECK_EVERY_STEPS = 10
PEAK_TOLERANCE = 0.05  # over the cap by more than this fraction: warn


def cuda_peak_reader(device: torch.device | None) -> Callable[[], int] | None:
    """What reads the allocator's peak so far (`torch.cuda.max_memory_allocated`): CUDA only, None elsewhere
    (a CPU's allocator keeps no counter)."""
    if device is None or device.type != "cuda":
        return None
    return peak_bytes_reader(device)


class CapExceededWarning(RuntimeWarning):
    """A planned step's measured peak went over the plan's memory cap."""


def over_cap_message(measured_bytes: int, cap_bytes: int) -> str | None:
    """The warning for a planned step that peaked at `measured_bytes` under a cap of `cap_bytes`, or None
    when it is within the cap + PEAK_TOLERANCE, or when the plan names no cap (0: a plan made by hand)."""
    if cap_bytes <= 0 or measured_bytes <= cap_bytes * (1 + PEAK_TOLERANCE):
        return None
    return (f"regen.apply: a planned step peaked at {measured_bytes} B of device memory, "
            f"{measured_bytes / cap_bytes - 1:.0%} over the plan's cap of {cap_bytes} B: something the plan does "
            f"not know holds memory (tensors the model keeps, another model, a profile of another setup); "
            f"profile again as you train (docs/limitations.md)")


class PeakCheck:
    """One handle's safety net; `read_peak` (None: nothing to read) gives the allocator's peak so far."""

    def __init__(self, cap_bytes: int, read_peak: Callable[[], int] | None):
        self.cap_bytes = cap_bytes  # the cap of the step being checked (a plan set's steps have their own)
        self.read_peak = read_peak
        self.warned = False
        self._checked: object | None = None  # the step being checked
        self._peak_at_start = 0  # the allocator's peak when it began

    def step_started(self, step: object, step_number: int, cap_bytes: int | None = None) -> bool:
        """`step`, the handle's `step_number`-th (from 1), began under `cap_bytes` (its plan's cap; None:
        the handle's): read the peak so far if it is checked. True when it is checked (its dropped storages
        are then counted too, on any device: `observe_drops_held`)."""
        if self.warned or (step_number - 1) % PEAK_CHECK_EVERY_STEPS != 0:
            return False
        if cap_bytes is not None:
            self.cap_bytes = cap_bytes
        if self.read_peak is not None:
            self._checked, self._peak_at_start = step, self.read_peak()
        return True

    def observe_drops_held(self, held_bytes: int, predicted_peak_bytes: int) -> bool:
        """regen's own count: a checked step's storages dropped for recompute that something else still held
        when backward began (`held_bytes`) were counted as freed by its plan, whose peak was
        `predicted_peak_bytes`; warn (once per handle) when the two together are over the cap + tolerance."""
        if not held_bytes or self.warned or self.cap_bytes <= 0:  # 0: a plan made by hand names no cap
            return False
        counted = predicted_peak_bytes + held_bytes
        if counted <= self.cap_bytes * (1 + PEAK_TOLERANCE):
            return False
        self.warned = True
        warnings.warn(f"regen.apply: by regen's count a planned step peaks at about {counted} B, "
                      f"{counted / self.cap_bytes - 1:.0%} over the plan's cap of {self.cap_bytes} B: {held_bytes} B of "
                      f"the saved tensors it dropped are still held by something other than autograd when backward "
                      f"begins (a cache, a list, a module attribute, the loop), which the profile did not see; "
                      f"profile again as you train (docs/limitations.md)", CapExceededWarning, stacklevel=2)
        return True

    def step_released(self, step: object, followed_plan: bool) -> None:
        """`step` ended: if it is the one being checked, compare its peak with the cap when it is known."""
        if step is not self._checked:
            return
        self._checked, before = None, self._peak_at_start
        if not followed_plan:
            return
        peak = self.read_peak()
        if peak > before:  # a new maximum: this step's peak
            self.observe(peak)

    def observe(self, measured_bytes: int) -> bool:
        """Warn (once per handle) when a planned step's measured peak is over the cap; True if it is."""
        message = over_cap_message(measured_bytes, self.cap_bytes)
        if message is None:
            return False
        if not self.warned:
            self.warned = True
            warnings.warn(message, CapExceededWarning, stacklevel=2)
        return True
