"""The Hugging Face Trainer: a `TrainerCallback` that applies a regen plan to the Trainer's model.

    from regen.integrations.hf import regen_callback
    trainer = Trainer(model=model, args=args, train_dataset=data, callbacks=[regen_callback("run.plan.yaml")])
    trainer.train()

The plan is applied when training begins (`on_train_begin`, to the model the Trainer trains) and removed
when it ends (`on_train_end`): no hook is left on the model after `train()` returns. Evaluation inside
training runs under `torch.no_grad()` and is left alone. If `train()` raises, the Trainer does not call
`on_train_end`: call the callback's `remove()` (or wrap `trainer.train()` in `with regen.apply(...)`
instead, which cleans up on an exception).

transformers is imported when a callback is made, never when this module is imported.
"""

from __future__ import annotations

import functools
from typing import Any

from regen.errors import RegenError


def regen_callback(plan, **apply_kwargs: Any):
    """A TrainerCallback applying `plan` (a Plan or a path) for the Trainer's training; `apply_kwargs` go to
    `regen.apply` (on_mismatch, emulate_link)."""
    return _callback_class()(plan, apply_kwargs)


@functools.cache
def _callback_class():
    try:
        from transformers import TrainerCallback
    except ImportError:
        raise RegenError("regen.integrations.hf needs Hugging Face transformers: pip install 'regen[hf]'") from None

    class RegenCallback(TrainerCallback):
        """Applies a regen plan from `on_train_begin` to `on_train_end` (see regen.integrations.hf)."""

        def __init__(self, plan, apply_kwargs: dict[str, Any]):
            from regen.formats import load_plan
            from regen.formats.plan import Plan

            self.plan = plan if isinstance(plan, Plan) else load_plan(plan)
            self.apply_kwargs = apply_kwargs
            self.handle = None

        def on_train_begin(self, args, state, control, model=None, **kwargs):
            from regen.runtime import apply

            if model is None:
                raise RegenError("regen callback: the Trainer gave no model to on_train_begin")
            self.remove()
            self.handle = apply(model, self.plan, **self.apply_kwargs)

        def on_train_end(self, args, state, control, **kwargs):
            self.remove()

        def remove(self) -> None:
            """Remove the plan's hooks from the model (done at the end of training)."""
            if self.handle is not None:
                self.handle.remove()
                self.handle = None

    return RegenCallback
