"""The Hugging Face Trainer with regen.integrations.hf's callback: 3 training steps under a plan give the
unplanned losses and weights bit for bit, and the callback leaves no hook on the model."""

import pytest

pytest.importorskip("transformers")

import torch  # noqa: E402

import regen  # noqa: E402
from plans import profile, solve_halfway, weights_and_buffers  # noqa: E402
from regen.integrations.hf import regen_callback, trainer_step  # noqa: E402
from regen.models import hf_gpt2  # noqa: E402
from regen.workloads import Workload  # noqa: E402

BATCH, SEQ, SAMPLES, STEPS = 2, 32, 6, 3
GPT2_ARGS = {"seq_len": SEQ, "n_layer": 2, "n_embd": 32, "n_head": 2, "vocab_size": 128}


def _dataset():
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, GPT2_ARGS["vocab_size"], (SAMPLES, SEQ), generator=g)
    return [{"input_ids": row, "labels": row.clone()} for row in ids]


def _trainer(tmp_path, callbacks, model, **arguments):
    """A Trainer of `model` for STEPS steps (more TrainingArguments: `arguments`), and the losses its training
    steps return."""
    from transformers import Trainer, TrainingArguments

    losses = []

    class RecordingTrainer(Trainer):
        def training_step(self, *args, **kwargs):
            loss = super().training_step(*args, **kwargs)
            losses.append(loss)
            return loss

    args = TrainingArguments(output_dir=str(tmp_path), max_steps=STEPS, per_device_train_batch_size=BATCH,
                             learning_rate=1e-3, use_cpu=True, report_to="none", save_strategy="no",
                             logging_strategy="no", disable_tqdm=True, dataloader_num_workers=0, seed=0,
                             **arguments)
    return RecordingTrainer(model=model, args=args, train_dataset=_dataset(), callbacks=callbacks), losses


def _model(name: str):
    """GPT-2 as regen's built-in, or a Qwen3 at its config's defaults (`use_cache=True`, which the Trainer
    turns off)."""
    from regen.zoo import qwen3

    return qwen3(batch_size=BATCH)[0] if name == "qwen3" else hf_gpt2(batch_size=BATCH, **GPT2_ARGS)[0]


def _train(tmp_path, callbacks, name: str, **arguments):
    """3 Trainer steps of a fresh model: (the losses, the weights after them, the model)."""
    model = _model(name)
    trainer, losses = _trainer(tmp_path, callbacks, model, **arguments)
    torch.manual_seed(0)  # the sampler's order and dropout: the same in both runs
    trainer.train()
    return losses, weights_and_buffers(model), model


@pytest.mark.parametrize("name", ["gpt2", "qwen3"])
def test_trainer_steps_under_a_plan_equal_unplanned_and_every_step_is_planned(tmp_path, name):
    """The profile is taken through the Trainer's own step (`trainer_step`): the call it makes, with the
    `num_items_in_batch` it computes (a float32 in transformers 5, an int64 in 4), so every step runs under the
    plan and none in dynamic mode."""
    model, batch = trainer_step(_trainer(tmp_path / "profiled", [], _model(name))[0])
    assert "num_items_in_batch" in batch
    plan = solve_halfway(profile(Workload(name="trainer", model=model, batch=batch, loss_fn=None)), "recompute")
    assert plan.action_counts()["recompute"] > 0

    losses, weights, _ = _train(tmp_path / "plain", [], name)
    callback = regen_callback(plan, on_mismatch="dynamic")
    planned_losses, planned_weights, planned_model = _train(tmp_path / "planned", [callback], name)
    assert callback.stats.planned_steps == STEPS and callback.stats.dynamic_steps == 0
    assert len(losses) == STEPS
    assert all(torch.equal(a, b) for a, b in zip(losses, planned_losses)), (losses, planned_losses)
    assert weights.keys() == planned_weights.keys()
    for name in weights:
        assert torch.equal(weights[name], planned_weights[name]), f"{name} differs after {STEPS} steps"
    assert callback.handle is None  # removed at the end of training
    assert not planned_model._forward_pre_hooks and not planned_model._forward_hooks
    assert torch._C._autograd._top_saved_tensors_default_hooks(False) is None


def test_a_trainer_that_compiles_its_model_carries_the_plan_out_compiled(tmp_path):
    """`torch_compile=True`: the Trainer compiles the model after the callback applied the plan to it (a model
    compiled under its handle, regen.runtime.compiled Note 8), here after a run that compiled the same class
    without a plan: the plan reaches the compiled graph, and the losses are the unplanned compiled run's."""
    model, batch = trainer_step(_trainer(tmp_path / "profiled", [], _model("gpt2"))[0])
    plan = solve_halfway(profile(Workload(name="trainer", model=model, batch=batch, loss_fn=None)), "recompute")
    losses, weights, _ = _train(tmp_path / "plain", [], "gpt2", torch_compile=True)
    callback = regen_callback(plan)
    handles = []
    callback.on_train_end = lambda *a, **k: handles.append(callback.handle)  # kept past the end of training
    planned_losses, planned_weights, _ = _train(tmp_path / "planned", [callback], "gpt2", torch_compile=True)
    handle, = handles
    try:
        assert handle.compiled is not None and handle.compiled.placement.graphs >= 1
        assert len(handle.compiled.placement.placed) >= 0.6 * len(plan.decisions)
        # the first step's loss bit for bit; a recomputed op rounds its gradient differently in a fused backward
        # kernel (within 1e-8), so the later losses and the weights agree within rounding
        assert torch.equal(losses[0], planned_losses[0]), (losses, planned_losses)
        torch.testing.assert_close(torch.stack(planned_losses), torch.stack(losses), rtol=1e-6, atol=0)
        for name in weights:
            torch.testing.assert_close(planned_weights[name], weights[name], rtol=1e-5, atol=1e-7)
    finally:
        callback.remove()


def test_callback_without_transformers_is_a_one_line_error(monkeypatch):
    """regen.integrations.hf imports transformers only when a callback is made."""
    import sys

    import regen.integrations.hf as hf
    from regen.errors import RegenError

    monkeypatch.setitem(sys.modules, "transformers", None)  # as if not installed
    hf._callback_class.cache_clear()
    try:
        with pytest.raises(RegenError, match="needs Hugging Face transformers"):
            hf.regen_callback("any.plan.yaml")
    finally:
        hf._callback_class.cache_clear()
