"""When the recorded step makes each gradient (regen.profiler.gradients, `Profile.gradients_made`)."""

import torch
from torch import nn

from regen.formats.profile import PHASE_BACKWARD
from regen.profiler import profile_workload
from regen.workloads import Workload


def _loss(out, batch):
    return out.square().mean()


def test_each_gradient_is_listed_once_after_the_op_that_made_it():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 32), nn.Tanh(), nn.Linear(32, 2))
    w = Workload("two", model, (torch.randn(8, 4),), _loss)
    profile = profile_workload(w, "cpu", repeats=1, warmup_steps=1, progress=None)
    made = profile.gradients_made
    assert sum(g.bytes for g in made) == profile.static_memory.gradient_bytes
    assert all(profile.ops[g.after_op].phase == PHASE_BACKWARD for g in made)
    # backward makes the last layer's gradients (256 and 8 bytes) before the first's (512 and 128)
    assert sorted(g.bytes for g in made[:2]) == [8, 256] and sorted(g.bytes for g in made[2:]) == [128, 512]
    assert max(g.after_op for g in made[:2]) < min(g.after_op for g in made[2:])


def test_a_parameter_called_twice_has_its_gradient_listed_once():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4, bias=False), nn.Tanh(), nn.Linear(4, 4, bias=False))
    model[2].weight = model[0].weight  # one parameter called twice: its gradient is stored once
    w = Workload("tied", model, (torch.randn(8, 4),), _loss)
    profile = profile_workload(w, "cpu", repeats=1, warmup_steps=1, progress=None)
    assert [g.bytes for g in profile.gradients_made] == [64]
    assert profile.static_memory.gradient_bytes == 64
