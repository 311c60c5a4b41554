"""Shared helpers of the runtime tests: one training step, gradient snapshots, workload traces."""

from __future__ import annotations

import functools

import torch

from regen.workloads import build_workload, call_model, compute_loss

from handmade import trace_workload

STEP_SEED = 1234
ACCUMULATE_SEED = 3
# small sizes so each step takes milliseconds on a loaded CPU
WORKLOAD_ARGS = {
    "mlp": {},
    "cnn": {"batch_size": 4, "num_blocks": 2},
    "gpt": {},
    "hf-gpt2": {},
    "hf-bert": {},
    "hf-llama": {},
}


def make(name: str, **overrides):
    args = dict(WORKLOAD_ARGS.get(name, {}))
    args.update(overrides)
    batch_size = args.pop("batch_size", None)
    return build_workload(name, batch_size=batch_size, args=args)


@functools.lru_cache(maxsize=None)
def traced(name: str):
    """(workload, trace) for a built-in workload, traced once per test session."""
    w = make(name)
    return w, trace_workload(w)


def step(w, seed: int = STEP_SEED) -> torch.Tensor:
    """Forward (the model called directly, so runtime errors are not wrapped) and backward."""
    torch.manual_seed(seed)
    out = call_model(w.model, w.batch)
    loss = compute_loss(w.name, out, w.batch, w.loss_fn)
    loss.backward()
    return loss.detach()


def grads(model) -> dict[str, torch.Tensor]:
    return {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}


def other_batch(w):
    """The same (gpt) model on a batch of another size (its own loss targets)."""
    other = make("gpt", batch_size=2)
    assert other.batch[0].shape != w.batch[0].shape
    other.model = w.model
    return other


def accumulate_grads(w, interleaved: bool) -> dict[str, torch.Tensor]:
    """Gradients and module buffers (`buffer:` names) after two accumulated micro-batches: forward/backward
    pairs, or (interleaved) two forwards then one backward over both losses; buffers put back after."""
    def run():
        torch.manual_seed(ACCUMULATE_SEED)
        if interleaved:
            l1 = w.loss_fn(w.model(*w.batch), w.batch)
            l2 = w.loss_fn(w.model(*w.batch), w.batch)
            (l1 + l2).backward()
        else:
            for _ in range(2):
                w.loss_fn(w.model(*w.batch), w.batch).backward()

    return _grads_and_buffers(w, run)


def retained_graph_grads(w) -> dict[str, torch.Tensor]:
    """Gradients and module buffers (`buffer:` names) after two backwards over one retained graph (the
    second rebuilds what the first dropped again); buffers put back after."""
    def run():
        torch.manual_seed(7)
        loss = w.loss_fn(w.model(*w.batch), w.batch)
        loss.backward(retain_graph=True)
        loss.backward()

    return _grads_and_buffers(w, run)


def _grads_and_buffers(w, run) -> dict[str, torch.Tensor]:
    """`run()` from zero gradients: its gradients and the module buffers it left, by name (buffers as
    `buffer:<name>`); the buffers are then put back as they were, so every call starts from one state."""
    w.model.zero_grad(set_to_none=True)
    before = buffers(w.model)
    run()
    after = {f"buffer:{n}": b for n, b in buffers(w.model).items()}
    _restore_buffers(w.model, before)
    return {**grads(w.model), **after}


def buffers(model) -> dict[str, torch.Tensor]:
    return {n: b.detach().clone() for n, b in model.named_buffers()}


def _restore_buffers(model, saved: dict[str, torch.Tensor]) -> None:
    with torch.no_grad():
        for name, b in model.named_buffers():
            b.copy_(saved[name])


def run_and_grads(w, seed: int = STEP_SEED):
    """(loss, gradients, module buffers after the step) of one step; the buffers are then put back as
    they were before it, so every call starts from the same state (BatchNorm statistics included)."""
    w.model.zero_grad(set_to_none=True)
    before = buffers(w.model)
    loss = step(w, seed)
    after = buffers(w.model)
    _restore_buffers(w.model, before)
    return loss, grads(w.model), after


def assert_same(a, b):
    """Same loss, gradients and module buffers, bit for bit."""
    loss_a, g_a, buf_a = a
    loss_b, g_b, buf_b = b
    assert torch.equal(loss_a, loss_b), (loss_a, loss_b)
    assert g_a.keys() == g_b.keys()
    for k in g_a:
        assert torch.equal(g_a[k], g_b[k]), f"gradient of {k} differs"
    assert buf_a.keys() == buf_b.keys()
    for k in buf_a:
        assert torch.equal(buf_a[k], buf_b[k]), f"buffer {k} differs"


def assert_nothing_left(handle, model=None):
    """After a `regen.apply` handle is gone: no hook, no dispatch mode, no host buffer, no live step."""
    from torch.utils._python_dispatch import _get_current_dispatch_mode_stack

    assert not handle.hooks_installed
    if model is not None:
        assert not model._forward_pre_hooks and not model._forward_hooks
    assert torch._C._autograd._top_saved_tensors_default_hooks(False) is None
    assert handle.tracker not in _get_current_dispatch_mode_stack()
    assert handle.pool.checked_out_bytes == 0, "host buffers still checked out"
    assert handle.active_steps == 0


def train_fifty_steps(w, plan):
    """50 AdamW steps under `plan`: (handle, the allocator's figures of step 5 and step 50, the live tensor
    counts after them, the host pool's capacity after step 5)."""
    import gc

    import regen
    from regen.measure import measure_memory

    opt = torch.optim.AdamW(w.model.parameters(), lr=1e-3)

    def train_step():
        loss = w.loss_fn(w.model(*w.batch), w.batch)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    def live_tensors():
        gc.collect()
        return sum(1 for o in gc.get_objects() if isinstance(o, torch.Tensor))

    with regen.apply(w.model, plan) as handle:
        for _ in range(4):
            train_step()
        gc.collect()  # what earlier tests left to the cyclic collector is not this step's
        early = measure_memory(train_step)
        early_tensors, pool_capacity = live_tensors(), handle.pool.capacity_bytes
        for _ in range(44):
            train_step()
        late = measure_memory(train_step)
        late_tensors = live_tensors()
    return handle, (early, late), (early_tensors, late_tensors), pool_capacity


def assert_flat(measured, tensors):
    """Nothing grows from step 5 to step 50: memory at the end of a step, its peak, live tensors."""
    early, late = measured
    assert early.end_bytes - early.start_bytes == 0 and late.end_bytes - late.start_bytes == 0
    assert late.peak_increase_bytes == early.peak_increase_bytes
    assert tensors[1] == tensors[0]


class Boom(RuntimeError):
    """The user's code failing inside a planned step."""


def fail_inside_a_step(w, plan, where: str, after_forward=lambda handle: None, **apply_kwargs):
    """Run one step of `w` under `regen.apply(w.model, plan, **apply_kwargs)` (plan None and a memory_cap:
    dynamic mode) that raises Boom in the forward (a hook of the second block), between forward and
    backward, or in backward; return the handle. `after_forward(handle)` runs once the forward is over,
    in the last two cases."""
    import pytest

    import regen

    def explode(*_):
        raise Boom("user code failed")

    with pytest.raises(Boom):
        with regen.apply(w.model, plan, **apply_kwargs) as handle:
            if where == "forward":
                h = w.model.blocks[1].register_forward_hook(explode)
                try:
                    step(w)
                finally:
                    h.remove()
            else:
                out = w.model(*w.batch)
                loss = w.loss_fn(out, w.batch)
                after_forward(handle)
                if where == "backward":
                    out.register_hook(explode)
                    loss.backward()
                raise Boom("after forward")
    return handle


def assert_next_step_exact(w, plan):
    """The next planned step starts clean and gives the unplanned loss, gradients and buffers."""
    import regen

    reference = run_and_grads(w)
    with regen.apply(w.model, plan) as handle:
        planned = run_and_grads(w)
    assert_same(reference, planned)
    assert_nothing_left(handle, w.model)
