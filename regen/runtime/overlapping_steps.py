"""A planned step that begins while the step before still holds its saved tensors, said once per handle.

A plan's cap is for one call of the model per backward: the profiled step. A loop that calls the model twice
before one backward (a contrastive or preference loss: chosen and rejected sequences, two views of an image)
holds the first call's saved tensors through the second: both plans' memory at once, over the cap (the zoo's
Llama, GPT-2 and Mixtral at a recompute plan of 0.6: 1.31-1.52x with AdamW's state). The remedy is a step that
makes all the calls: a module whose forward makes them, profiled and planned as one, with the plan applied to
it. Nothing is changed here.
"""

from __future__ import annotations

import warnings


class OverlappingStepsWarning(UserWarning):
    """The model was called again before the backward of its call before (said once per handle)."""


class OverlapCheck:
    """Says once when a planned step begins while a step before it holds saved tensors its backward has not read."""

    def __init__(self):
        self.said = False

    def step_begins(self, live_steps) -> None:
        if self.said or not any(s.unpack_count == 0 and not s.released for s in live_steps):
            return
        self.said = True
        warnings.warn(
            "regen.apply: the model was called again while its call before still holds its saved tensors (no backward "
            "ran in between: two calls before one backward, as contrastive and preference losses make them); a plan's "
            "cap is for one call per backward, so together they can pass it: profile the calls as one step (a module "
            "whose forward makes them all) and apply that plan to it", OverlappingStepsWarning, stacklevel=4)
