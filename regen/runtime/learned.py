"""Plans learned while training (`regen.apply(..., learn=True)`): the runtime's side.

A call no plan fits runs as a dynamic step (dynamic/engine.py). With a learner (regen/learning.py makes
one for `regen.apply`; the runtime never imports the profiler or the planner), the first such step of
each call signature is observed: a copy of its call arguments, where the model's output came from, and
the ops it ran after the model returned until backward began, the loss among them (`LossTail`). At the
model's next call, before that call's step begins, the handle hands them to the learner
(`LearnRequest`), which records a profile of the call at once and solves a plan in the background,
returning a `Future`; a solved plan joins the handle's plan set at the first call after it is ready.
"""

from __future__ import annotations

import hashlib
import warnings
from concurrent.futures import Future, wait
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch
from torch import nn
from torch.utils._pytree import tree_flatten, tree_map

from regen.call_signature import describe
from regen.errors import RegenError
from regen.formats.plan import Plan, save_plan
from regen.formats.profile import CallSignature
from regen.opinfo import storage_key
from regen.runtime.plan_set import PLAN_SUFFIX
from regen.runtime.recompute import CapturedOp
from regen.runtime.storage_views import Geometry
from regen.runtime.writers import live_writer
from regen.runtime.held_gradients_check import held_gradient_bytes

LEARNED_PREFIX = "learned-"


class LearningWarning(UserWarning):
    """A plan could not be learned for a call (its steps keep running in dynamic mode)."""


@dataclass
class LossTail:
    """What a step ran after the model returned and before backward: its captured ops (the loss among
    them), and for each tensor of the model's output (flattened) the writer of its storage, (op, slot),
    and its view of it."""

    ops: list[CapturedOp]
    outputs: list[tuple[tuple[int, int], Geometry] | None]  # None: an output the step did not write


@dataclass
class LearnRequest:
    """A call to learn a plan for: the model (DDP unwrapped), the call's signature, a copy of its
    arguments, its loss tail, the cap, and whether the loop holds gradients from step to step (the observed
    step began with them, or the next call did: gradient accumulation; regen.planner.held_gradients)."""

    model: nn.Module
    signature: CallSignature
    args: tuple
    kwargs: dict
    loss_tail: LossTail
    cap_bytes: int
    gradients_held: bool = False


# learner(request): records the profile now (on the calling thread, between steps) and returns the plan's
# Future (None when it cannot be solved); raises RegenError when the call cannot be profiled
Learner = Callable[[LearnRequest], "Future[Plan | None]"]


@dataclass
class _Observed:
    step: object  # the DynamicStep
    model: nn.Module
    signature: CallSignature
    args: tuple
    kwargs: dict
    cap_bytes: int
    gradients_held: bool
    outputs: list[tuple[tuple[int, int], Geometry] | None] | None = None  # set when the model returns


class LearnedPlans:
    """A handle's learning: the step observed, the plans being solved, the plans learned."""

    def __init__(self, learner: Learner | None):
        self.learner = learner
        self.plans: list[Plan] = []
        self._seen: set[str] = set()  # call signatures observed (learned, being learned, or refused)
        self._observed: _Observed | None = None
        self._futures: list[Future] = []

    @property
    def learning(self) -> bool:
        return self.learner is not None

    def observe(self, step, root: nn.Module, signature: CallSignature, key: str, args: tuple, kwargs: dict,
                cap_bytes: int) -> None:
        """A dynamic step of the call `signature` (described as `key`) began: the first of each is observed."""
        if self.learner is None:
            return
        if key in self._seen:
            return
        self._seen.add(key)
        if any(torch.is_autocast_enabled(device) for device in ("cpu", "cuda")):
            warnings.warn(f"regen.apply: no plan learned for {key}: the step runs under autocast, which a learned "
                          f"profile does not record; its steps run in dynamic mode", LearningWarning, stacklevel=4)
            return
        self._observed = _Observed(step, root, signature, tree_map(_copy, args), tree_map(_copy, kwargs), cap_bytes,
                                   gradients_held=held_gradient_bytes(root.parameters()) > 0)

    def model_returned(self, step, output) -> None:
        """The model's forward returned in `step`: the ops from here to backward are the loss tail."""
        observed = self._observed
        if observed is None or observed.step is not step or observed.outputs is not None:
            return
        outputs = []
        for t in tree_flatten(output)[0]:
            if isinstance(t, torch.Tensor):
                w = live_writer(step.writer, storage_key(t))  # None: no op of the step wrote it (an input returned)
                outputs.append(((w.op, w.slot), Geometry.of(t)) if w is not None else None)
        observed.outputs = outputs
        step.keep_tail_from(step.count)

    def request(self, pause: Callable) -> None:
        """The model's next call: hand the observed step to the learner (its ops paused by `pause()`)."""
        observed, self._observed = self._observed, None
        if observed is None or observed.outputs is None or observed.step.aborted:
            return
        tail = LossTail(observed.step.tail_ops(), observed.outputs)
        held = observed.gradients_held or held_gradient_bytes(observed.model.parameters()) > 0
        request = LearnRequest(observed.model, observed.signature, observed.args, observed.kwargs, tail,
                               observed.cap_bytes, gradients_held=held)
        try:
            with pause():
                future = self.learner(request)
        except RegenError as exc:
            warnings.warn(f"regen.apply: no plan learned for {describe(observed.signature)}: {exc}; its steps run "
                          f"in dynamic mode", LearningWarning, stacklevel=4)
            return
        self._futures.append(future)

    def ready(self) -> list[Plan]:
        """The plans solved since the last call (each once)."""
        done = [f for f in self._futures if f.done()]
        self._futures = [f for f in self._futures if not f.done()]
        plans = []
        for future in done:
            exc = future.exception()
            if exc is not None:
                warnings.warn(f"regen.apply: solving a learned plan failed ({type(exc).__name__}: {exc}); its "
                              f"steps run in dynamic mode", LearningWarning, stacklevel=4)
            elif future.result() is not None:
                plans.append(future.result())
        self.plans.extend(plans)
        return plans

    def wait(self, timeout_s: float | None) -> None:
        wait(list(self._futures), timeout=timeout_s)

    def save(self, directory: str | Path) -> list[Path]:
        """Each learned plan to `directory` as learned-<hash of its call>.plan.yaml."""
        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        written = []
        for plan in self.plans:
            digest = hashlib.sha1(describe(plan.call).encode()).hexdigest()[:12]
            path = directory / f"{LEARNED_PREFIX}{digest}{PLAN_SUFFIX}"
            save_plan(plan, path)
            written.append(path)
        return written


def _copy(value):
    """A call argument as it is now (the loop may reuse its batch tensors in place)."""
    if not isinstance(value, torch.Tensor):
        return value
    return value.detach().clone().requires_grad_(value.requires_grad)
