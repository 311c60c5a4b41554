"""The liveness probe (regen.profiler.liveness): its step leaves the model's and the batch's gradients
as it found them, and reports held storages for the recorded op sequence."""

import torch
from torch import nn

from regen.profiler.liveness import probe_step
from regen.profiler.record import record_step
from regen.workloads import Workload


def test_the_probe_leaves_gradients_as_it_found_them():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 2))
    x = torch.randn(4, 8, requires_grad=True)
    workload = Workload(name="probe", model=model, batch=(x,), loss_fn=lambda out, batch: out.sum())
    capture = record_step(workload, torch.device("cpu"))
    found = {name: p.grad for name, p in model.named_parameters()} | {"x": x.grad}
    assert all(g is not None for g in found.values())
    snapshot = {name: g.clone() for name, g in found.items()}
    found_by_probe = probe_step(workload, {e for s in capture.saved_tensors for e in s.entries},
                          capture.op_names)
    assert found_by_probe is not None  # the probe ran the recorded op sequence although gradients were there
    after = {name: p.grad for name, p in model.named_parameters()} | {"x": x.grad}
    for name, grad in found.items():
        assert after[name] is grad and torch.equal(grad, snapshot[name]), name
