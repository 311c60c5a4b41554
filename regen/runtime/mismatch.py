"""What a step does when it does not match its plan: raise, or warn and run the rest unplanned.

on_mismatch="raise" raises `PlanMismatchError`; "keep" and "dynamic" warn (`PlanMismatchWarning`) and the
step keeps every later tensor (a step cannot turn to dynamic mode once it has begun; under "dynamic" the
handle sends calls whose steps keep leaving their plan to dynamic mode: regen.runtime.apply). With
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

    def act(self, message: str, planned: bool) -> None:
        """Raise (on_mismatch="raise"), or warn and count the unplanned step once (`planned`: it was
        following the plan until now)."""
        if self.on_mismatch == "raise":
            raise PlanMismatchError(f"regen.apply: {message}. Profile and solve for this model and batch "
                                    f"shape, or pass on_mismatch='keep' to run such steps unplanned (a model whose "
                                    f"first forward builds modules or buffers leaves its plan so in its first step "
                                    f"only: run one step before regen.apply)")
        if not planned:
            return
        self.stats.unplanned_steps += 1
        if self.on_mismatch == "keep":
            warnings.warn(f"regen.apply: {message}; running this step unplanned (on_mismatch='keep')",
                          PlanMismatchWarning, stacklevel=4)
        else:
            warnings.warn(f"regen.apply: {message}; the rest of this step runs unplanned (it keeps every tensor "
                          f"it saves from here, over the plan's cap if it needs more). A model whose first forward "
                          f"differs from its later ones (one that builds modules or buffers at its first call) does "
                          f"this once; calls like this one keep their plan until {MAX_DIVERGED_STEPS} such steps, then "
                          f"run in dynamic mode", PlanMismatchWarning, stacklevel=4)

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
