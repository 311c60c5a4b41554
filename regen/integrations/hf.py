"""The Hugging Face Trainer: the step it runs as a workload to profile, and a `TrainerCallback` that applies a
regen plan to the Trainer's model.

    from regen.integrations.hf import regen_callback, trainer_step

    def build():                                   # regen profile --model mypkg.train:build -o run.profile.yaml
        return trainer_step(make_trainer())         # (model, the keyword arguments the Trainer calls it with)

    trainer = make_trainer(callbacks=[regen_callback("run.plan.yaml")])
    trainer.train()

A plan fits the steps whose call it was profiled with (shapes, dtypes, which arguments): `trainer_step` takes
that call from the Trainer itself (its first training batch through its own `get_batch_samples`,
`_prepare_inputs` and `compute_loss`), so arguments the Trainer adds on its own (`num_items_in_batch`, a
float32 scalar in transformers 5) are profiled as it passes them, whatever its version does.

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


class _Called(Exception):
    """Raised by `trainer_step`'s hook once it has the Trainer's call of the model."""


def trainer_step(trainer) -> tuple:
    """`(model, batch)` of the step `trainer.train()` runs: the Trainer's model and the keyword arguments its
    `compute_loss` calls it with for the first training batch (the model is not run). The loss is the model's
    own `.loss`: a Trainer that computes its loss outside the model (`compute_loss_func`, label smoothing) is
    refused."""
    import torch

    if trainer.compute_loss_func is not None or trainer.label_smoother is not None:
        raise RegenError("trainer_step: this Trainer computes its loss outside the model (compute_loss_func or "
                         "label smoothing); profile a workload with that loss as its loss_fn instead")
    batches, num_items = trainer.get_batch_samples(iter(trainer.get_train_dataloader()),
                                                   trainer.args.gradient_accumulation_steps, trainer.args.device)
    if not batches:
        raise RegenError("trainer_step: the Trainer's training data loader gave no batch")
    inputs = trainer._prepare_inputs(batches[0])
    model = trainer.model
    call: dict = {}

    def seen(module, args, kwargs):
        call["args"], call["kwargs"] = args, kwargs
        raise _Called

    hook = model.register_forward_pre_hook(seen, with_kwargs=True, prepend=True)
    try:
        with torch.no_grad():
            trainer.compute_loss(model, inputs, num_items_in_batch=num_items)
    except _Called:
        pass
    finally:
        hook.remove()
    if not call:
        raise RegenError("trainer_step: the Trainer's compute_loss did not call its model")
    if call["args"]:
        raise RegenError("trainer_step: the Trainer calls its model with positional arguments; profile that call "
                         "with a workload of your own")
    return model, dict(call["kwargs"])


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
            self.stats = None  # the last handle's RuntimeStats (planned, dynamic and unplanned steps), kept after it

        def on_train_begin(self, args, state, control, model=None, **kwargs):
            from regen.runtime import apply

            if model is None:
                raise RegenError("regen callback: the Trainer gave no model to on_train_begin")
            self.remove()
            self.handle = apply(model, self.plan, **self.apply_kwargs)
            self.stats = self.handle.stats

        def on_train_end(self, args, state, control, **kwargs):
            self.remove()

        def remove(self) -> None:
            """Remove the plan's hooks from the model (done at the end of training)."""
            if self.handle is not None:
                self.handle.remove()
                self.handle = None

    return RegenCallback
