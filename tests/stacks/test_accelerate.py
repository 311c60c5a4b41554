"""The Accelerate loop of docs/recipes.md: a model prepared by `Accelerator(mixed_precision="bf16")` on CPU,
profiled as prepared (Accelerate runs its forward under autocast and returns fp32 outputs), trained 3
steps under a hybrid plan over the emulated link: the losses and weights of the unplanned loop, bit for bit."""

import contextlib

import pytest

pytest.importorskip("accelerate")

import torch  # noqa: E402

import regen  # noqa: E402
from plans import TINY_GPT, profile, solve_halfway, weights_and_buffers  # noqa: E402
from regen.models import gpt  # noqa: E402
from regen.workloads import Workload  # noqa: E402

STEPS = 3


@pytest.fixture
def accelerator():
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState, GradientState

    def reset():
        AcceleratorState._reset_state(True)
        GradientState._reset_state()

    reset()  # a Trainer run earlier in this process left its Accelerator's state (no mixed precision)
    yield Accelerator(cpu=True, mixed_precision="bf16")
    reset()  # the next Accelerator (a Trainer's) starts from defaults


def _prepared(accelerator):
    model, batch, loss_fn = gpt(batch_size=2, **TINY_GPT)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model, optimizer = accelerator.prepare(model, optimizer)
    return model, optimizer, batch, loss_fn


def _train(accelerator, plan=None):
    """The recipe's loop: (losses, weights after STEPS steps)."""
    model, optimizer, batch, loss_fn = _prepared(accelerator)
    torch.manual_seed(0)
    losses = []
    with regen.apply(model, plan, emulate_link=True) if plan is not None else contextlib.nullcontext():
        for _ in range(STEPS):
            loss = loss_fn(model(*batch), batch)
            accelerator.backward(loss)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            losses.append(loss.detach())
    return losses, weights_and_buffers(model)


def test_accelerate_bf16_loop_under_a_plan_equals_unplanned(accelerator):
    model, _, batch, loss_fn = _prepared(accelerator)
    prof = profile(Workload(name="accelerate-gpt", model=model, batch=batch, loss_fn=loss_fn))
    assert any(t.dtype == "torch.bfloat16" for t in prof.tensors)  # Accelerate's autocast was recorded
    plan = solve_halfway(prof, "hybrid", link_ratio=0.5, fraction=0.25)  # low enough to need recompute too
    counts = plan.action_counts()
    assert counts["swap"] > 0 and counts["recompute"] > 0
    losses, weights = _train(accelerator)
    planned_losses, planned_weights = _train(accelerator, plan)
    assert all(torch.equal(a, b) for a, b in zip(losses, planned_losses)), (losses, planned_losses)
    for name in weights:
        assert torch.equal(weights[name], planned_weights[name]), f"{name} differs after {STEPS} steps"
