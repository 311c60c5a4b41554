"""The steps of a plan handle that no plan fits, run in dynamic mode (`on_mismatch="dynamic"`).

`RegenHandle` (apply.py) owns one `DynamicFallback` and calls it at its step boundaries:

* `between_steps()`: the model's next call begins: the last dynamic step's saved-tensor hooks are popped,
  a step observed for learning is handed to the learner, and the plans solved since come back to join
  the set (learned.py);
* `run(args, kwargs)`: this call runs as a dynamic step on the fallback's `DynamicEngine` (made at the
  first), whose saved-tensor hooks and dispatch mode stand in for the plan's tracker and hooks, with a
  notice the first time per call signature;
* `take_over(args, kwargs, held_bytes)`: a planned step left its plan in forward: the rest of it runs as a
  dynamic step;
* `planned_step_begins()`: the engine's dispatch mode is popped, so a planned step runs as without it;
* `model_returned(output)`: the model's forward returned (the loss tail of a step observed for learning).
"""

from __future__ import annotations

import contextlib
import warnings
from pathlib import Path
from typing import Callable

import torch
from torch import nn

from regen.call_signature import call_signature, describe, signature_key
from regen.formats.plan import Plan
from regen.runtime.dynamic.engine import DynamicEngine, DynamicStats
from regen.runtime.learned import LearnedPlans, Learner
from regen.runtime.mismatch import PlanMismatchWarning
from regen.units import format_bytes


class DynamicFallback:
    """Dynamic steps of a plan handle under `cap_bytes` (eviction score `policy`), and its learning."""

    def __init__(self, root: nn.Module, cap_bytes: int, policy: str, learner: Learner | None):
        self.root = root
        self.cap_bytes = cap_bytes
        self.policy = policy
        self.engine = None  # the DynamicEngine, made at the first dynamic step
        self.learned = LearnedPlans(learner)
        self._noticed: set[str] = set()  # call signatures told that they run in dynamic mode

    @property
    def live_steps(self) -> int:
        return len(self.engine.live_steps) if self.engine is not None else 0

    @property
    def hooks_installed(self) -> bool:
        return self.engine is not None and self.engine.hooks_installed

    @property
    def stats(self):

        return self.engine.stats if self.engine is not None else DynamicStats()

    def between_steps(self) -> list[Plan]:
        """The model's next call begins: the plans learned since the last call."""
        if self.engine is not None:
            self.engine.close_current()
        ready = self.learned.ready()  # before this call's request: its own plan joins at the next call, always
        if self.learned.learning:
            self.learned.request(self.engine.mode.pause if self.engine is not None else contextlib.nullcontext)
        return ready

    def run(self, args: tuple, kwargs: dict, why: str | None = None) -> None:
        """Run this call as a dynamic step; `why`: why its plan does not run it, when it has one (said the
        first time, with the call)."""
        signature = call_signature(self.root, args, kwargs)
        described = describe(signature)
        if described not in self._noticed:
            self._noticed.add(described)
            learning = ", learning a plan for it" if self.learned.learning else ""
            reason = why or "no plan fits this call of the model"
            warnings.warn(f"regen.apply: {reason} ({described}); running such steps in "
                          f"dynamic mode under the cap {format_bytes(self.cap_bytes)} (on_mismatch='dynamic'"
                          f"{learning})", PlanMismatchWarning, stacklevel=5)
        if self.engine is None:
            self.engine = DynamicEngine(self.root, self.cap_bytes, self.policy)
        step = self.engine.start_step(signature_key(signature))
        self.learned.observe(step, self.root, signature, described, args, kwargs, self.cap_bytes)

    def take_over(self, args: tuple, kwargs: dict, held_bytes: int) -> Callable[[torch.Tensor], None]:
        """A planned step of this call left its plan in forward: dynamic mode runs the rest of it (Note [ A step
        that leaves its plan ] in apply.py); `held_bytes`: what the planned part holds. Not learned from: its
        forward is a part. Returns what the planned step calls with each kept tensor its backward reads."""
        if self.engine is None:
            self.engine = DynamicEngine(self.root, self.cap_bytes, self.policy)
        self.engine.start_step(signature_key(call_signature(self.root, args, kwargs)), held_bytes=held_bytes)
        return self.engine.memory.release_held

    def planned_step_begins(self) -> None:
        if self.engine is not None:
            self.engine.pop_mode()

    def model_returned(self, output) -> None:
        if self.engine is not None and self.engine.current is not None:
            self.learned.model_returned(self.engine.current, output)
            self.engine.model_returned()

    def remove(self, abort: bool) -> None:
        if self.engine is not None:
            self.engine.remove(abort)

    def save_learned_plans(self, directory: str | Path) -> list[Path]:
        return self.learned.save(directory)
