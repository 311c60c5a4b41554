"""What a step does when it does not match its plan: raise, or warn and run the rest in dynamic mode or unplanned.

on_mismatch="raise" raises `PlanMismatchError`; "keep" and "dynamic" warn (`PlanMismatchWarning`). Under "keep"
the step keeps every later tensor; under "dynamic" a step that leaves its plan in forward goes on in dynamic mode
(one that leaves it in backward runs the rest unplanned), and the handle sends calls whose steps keep leaving
their plan to dynamic mode from their start (regen.runtime.apply, Note [ A step that leaves its plan ]). With
torch.distributed initialized, a mismatch found before backward is held until
the first unpack, where the ranks agree on it (regen/ranks.py), so all ranks raise or all go on.
The step applies the verdicts (regen.runtime.step); this module words them and holds the deferral.
"""

from __future__ import annotations

import warnings
from typing import Callable

from regen.errors import PlanMismatchError
from regen.ranks import rank_agreement
from regen.runtime.stats import RuntimeStats
from regen.runtime.tracker import regen_ops


# under on_mismatch="dynamic", a call whose steps left its plan mid-step this many times runs in dynamic mode
# from its next step (regen/runtime/apply.py, Note [ A step that leaves its plan ])
MAX_DIVERGED_STEPS = 2


class PlanMismatchWarning(UserWarning):
    """A step ran unplanned, or in dynamic mode, because the plan did not fit it."""


class MismatchPolicy:
    """One step's mismatch handling; `call_difference()`: how the step's call differs from the profiled
    one, for the message."""

    def __init__(self, on_mismatch: str, stats: RuntimeStats, call_difference: Callable[[], str | None]):
        self.on_mismatch = on_mismatch
        self.stats = stats
        self.call_difference = call_difference
        self.any_rank = rank_agreement()  # None without torch.distributed
        self.ranks_agreed = False
        self.deferred: str | None = None  # found before the ranks agreed (any_rank set)

    def describe(self, message: str, planned: bool) -> str:
        if self.on_mismatch == "raise" or planned:
            difference = self.call_difference()
            if difference is not None:
                return f"{message}; {difference}"
        return message

    def defer(self, message: str) -> bool:
        """Hold the mismatch for the ranks' agreement; False when it is to be acted on now."""
        if self.any_rank is None or self.ranks_agreed:
            return False
        if self.deferred is None:
            self.deferred = message
        return True

    def act(self, message: str, planned: bool, taken_over: bool = False) -> None:
        """Raise (on_mismatch="raise"), or warn and count the step once (`planned`: it was following the plan
        until now; `taken_over`: dynamic mode runs the rest of its forward)."""
        if self.on_mismatch == "raise":
            raise PlanMismatchError(f"regen.apply: {message}. Profile and solve for this model and batch "
                                    f"shape, or pass on_mismatch='keep' to run such steps unplanned (a model whose "
                                    f"first forward builds modules or buffers leaves its plan so in its first step "
                                    f"only: run one step before regen.apply)")
        if not planned:
            return
        if taken_over:
            self.stats.dynamic_steps += 1
            warnings.warn(f"regen.apply: {message}; the rest of this step runs in dynamic mode under the cap "
                          f"(on_mismatch='dynamic'). Calls like this one keep their plan until {MAX_DIVERGED_STEPS} "
                          f"steps, and more than half of their steps, have left it, then run in dynamic mode",
                          PlanMismatchWarning, stacklevel=4)
            return
        self.stats.unplanned_steps += 1
        if self.on_mismatch == "keep":
            warnings.warn(f"regen.apply: {message}; running this step unplanned (on_mismatch='keep')",
                          PlanMismatchWarning, stacklevel=4)
        else:
            warnings.warn(f"regen.apply: {message}; the rest of this step runs unplanned (it keeps every tensor "
                          f"it saves from here, over the plan's cap if it needs more). A model whose first forward "
                          f"differs from its later ones (one that builds modules or buffers at its first call) does "
                          f"this once; calls like this one keep their plan until {MAX_DIVERGED_STEPS} steps, and "
                          f"more than half of their steps, have left it, then run in dynamic mode",
                          PlanMismatchWarning, stacklevel=4)

    def agree(self) -> str | None:
        """At the first unpack: the message to act on when any rank's step did not match the plan, or
        None (this rank follows its plan)."""
        self.ranks_agreed = True
        with regen_ops():
            anywhere = self.any_rank(self.deferred is not None)
        if not anywhere:
            return None
        if self.deferred is None and self.on_mismatch != "raise":
            warnings.warn("regen.apply: another rank's step did not match the plan and ran unplanned there; "
                          "this rank's step followed the plan", PlanMismatchWarning, stacklevel=4)
            return None
        return self.deferred or "another rank's step did not match the plan"
