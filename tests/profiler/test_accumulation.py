"""The recorded step's gradient sums as the step itself runs them (regen/profiler/accumulation.py)."""

import torch
from torch import nn

from regen.profiler import accumulation
from regen.workloads import Workload


class Scan(nn.Module):
    """A scan that reads its input one time step at a time, as a recurrent layer's reference path does: the
    input's gradient is summed from one part per step (each a full-size `select_backward`)."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(64, 64)

    def forward(self, x):
        h = self.fc(x)
        s = h[:, 0].tanh()
        for t in range(1, h.shape[1]):
            s = s + h[:, t].tanh()
        return s.pow(2).mean()


def _scan() -> Workload:
    torch.manual_seed(0)
    return Workload(name="scan", model=Scan(), batch=(torch.randn(8, 32, 64),), loss_fn=None)


def test_the_recorded_peak_is_the_steps_own_where_the_engine_sums_gradients(monkeypatch, peak_increases):
    recorded, measured = peak_increases(_scan)
    assert abs(recorded - measured) <= 0.02 * measured
    # recorded as the dispatch mode runs the sums (out of place), the peak is a gradient too high
    monkeypatch.setattr(accumulation.EngineSums, "_node_ended", lambda self, grad_inputs, grad_outputs: None)
    assert peak_increases(_scan)[0] >= measured + 8 * 32 * 64 * 4 // 2


class TiedLM(nn.Module):
    """An embedding and an output layer sharing one weight (as most language models): the weight's gradient is
    the sum of two parts, and the engine sums into the part already in its buffer only, which here is not alone
    on its storage, so the step sums out of place and the recorded step must say so."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(4096, 64)
        self.out = nn.Linear(64, 4096)
        self.out.weight = self.embed.weight

    def forward(self, ids):
        return self.out(self.embed(ids).tanh()).logsumexp(-1).mean()


def test_a_sum_the_step_runs_out_of_place_is_recorded_so(peak_increases):
    def build():
        torch.manual_seed(0)
        return Workload(name="tied", model=TiedLM(), batch=(torch.randint(0, 4096, (2, 16)),), loss_fn=None)

    recorded, measured = peak_increases(build)
    assert abs(recorded - measured) <= 0.02 * measured
