"""A tensor saved on another device than the step's (CUDA attention saves its dropout seed on the host) is
none of the device's memory: never a candidate, never parked, copied by the liveness probe like every storage
autograd holds, and a plan or dynamic mode leaves it to autograd. Here a CPU step saves a tensor on the meta
device, the one other device a CPU machine has (its storage has no data pointer, so what a real host tensor
would do to the probe's "left behind" watch is not reproduced here: the probe's entries are checked instead)."""

import pytest
import torch
from torch import nn

from regen.formats.profile import EXCLUDED_OTHER_DEVICE
from regen.planner import solve
from regen.profiler import profile_workload
from regen.profiler.park import ParkingHooks, ParkStore
from regen.profiler.record import record_step
from regen.workloads import Workload, training_step


class _WithSeed(torch.autograd.Function):
    """tanh, saving its output and a "seed" on the meta device, as a CUDA op saves one on the host."""

    @staticmethod
    def forward(ctx, x):
        y = torch.tanh(x)
        ctx.save_for_backward(y, torch.empty(2, dtype=torch.int64, device="meta"))
        return y

    @staticmethod
    def backward(ctx, grad):
        y, seed = ctx.saved_tensors
        assert seed.device.type == "meta"  # handed back as it was saved
        return grad * (1 - y * y)


class _Model(nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(64, 64) for _ in range(3))
        self.norm = nn.BatchNorm1d(64)  # running statistics: a replay must not update them twice

    def forward(self, x):
        for layer in self.layers:
            x = _WithSeed.apply(layer(x))
        return self.norm(x).square().mean()


def _workload() -> Workload:
    torch.manual_seed(0)
    return Workload(name="with-seed", model=_Model(), batch=(torch.randn(1024, 64),), loss_fn=None)


def _recorded(park: bool):
    workload = _workload()
    training_step(workload)
    workload.model.zero_grad(set_to_none=True)
    return record_step(workload, torch.device("cpu"), park=park)


def test_a_tensor_saved_on_another_device_is_excluded():
    normal, parked = _recorded(park=False), _recorded(park=True)
    other = [e for e in normal.saved_entries if e.dtype == "torch.int64"]
    assert len(other) == 3
    assert all(e.excluded_reason == EXCLUDED_OTHER_DEVICE and e.saved_tensor is None for e in other)
    assert normal.saved_tensors and all(s.dtype == "torch.float32" for s in normal.saved_tensors)
    assert [(e.excluded_reason, e.saved_tensor) for e in parked.saved_entries] == \
        [(e.excluded_reason, e.saved_tensor) for e in normal.saved_entries]


def test_a_parked_plain_step_leaves_a_tensor_on_another_device_to_autograd():
    """The profiler's parked plain steps (a step that does not fit) park every saved activation but those on
    another device: parking one would copy out of a storage the device does not hold."""
    workload = _workload()
    model = workload.model
    hooks = ParkingHooks(ParkStore(torch.device("cpu")), list(model.parameters()) + list(model.buffers()))
    with hooks.hooks():
        loss = training_step(workload)
    assert torch.isfinite(loss) and hooks.store.parked_bytes > 0


def test_the_liveness_probe_copies_what_autograd_holds_on_another_device(monkeypatch):
    from regen.profiler import record

    workload = _workload()
    training_step(workload)
    workload.model.zero_grad(set_to_none=True)
    capture = record_step(workload, torch.device("cpu"))
    copied = []
    monkeypatch.setattr(record, "probe_step", lambda w, entries, names: copied.append(entries))
    record.record_probe(workload, capture)
    other = {e.index for e in capture.saved_entries if e.excluded_reason == EXCLUDED_OTHER_DEVICE}
    assert other and other <= copied[0]


def _buffers(model):
    return [b.clone() for b in model.buffers()]


@pytest.mark.parametrize("planned", [True, False], ids=["recompute-plan", "dynamic-mode"])
def test_a_step_saving_on_another_device_runs_exact(planned):
    import regen

    workload = _workload()
    profile = profile_workload(workload, "cpu", repeats=1, warmup_steps=1, progress=None)
    cap = int(profile.peak_bytes * 0.9)
    plan = solve(profile, memory_cap_bytes=cap, strategy="recompute") if planned else None
    start_buffers = _buffers(workload.model)
    workload.model.zero_grad(set_to_none=True)
    reference = training_step(workload)
    expected, expected_buffers = [p.grad.clone() for p in workload.model.parameters()], _buffers(workload.model)
    for b, saved in zip(workload.model.buffers(), start_buffers):
        b.copy_(saved)
    workload.model.zero_grad(set_to_none=True)
    with regen.apply(workload.model, plan) if planned else regen.apply(workload.model, memory_cap=cap):
        loss = training_step(workload)
    assert torch.equal(loss, reference)
    assert all(torch.equal(p.grad, g) for p, g in zip(workload.model.parameters(), expected))
    assert all(torch.equal(b, e) for b, e in zip(workload.model.buffers(), expected_buffers))
