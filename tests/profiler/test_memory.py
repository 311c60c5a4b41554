"""The profile's memory timeline against the allocator, and base + live saved tensors against the timeline."""

import pytest
import torch

from regen.measure import measure_memory
from torch.utils._pytree import tree_flatten

from regen.opinfo import unique_storage_bytes
from regen.workloads import call_model, training_step

WORKLOADS = ["mlp", "cnn", "gpt", "hf-gpt2"]
PEAK_TOLERANCE = 0.05  # the bar: the profile's unplanned peak within 5% of the allocator's


def live_candidate_bytes(profile):
    """Bytes of candidates alive after each op of the unplanned step: from the producer to the last use."""
    live = [0] * len(profile.ops)
    for s in profile.saved_tensors:
        end = s.last_backward_use if s.backward_uses else s.last_forward_use
        for i in range(s.producer_op, end + 1):
            live[i] += s.bytes
    return live


def _output_bytes(workload) -> int:
    """Bytes of the distinct storages the model's output holds (logits, HF caches)."""
    import torch

    with torch.no_grad():
        out = call_model(workload.model, workload.batch)
    leaves = [out] if isinstance(out, torch.Tensor) else list(out.values())
    return unique_storage_bytes(tree_flatten(leaves)[0])


@pytest.mark.parametrize("name", WORKLOADS)
def test_unplanned_peak_agrees_with_the_allocator(name, profiled):
    workload, profile = profiled(name)
    model = workload.model
    for p in model.parameters():
        p.grad = None  # the recorded step starts without gradients, as after zero_grad()
    measured = measure_memory(lambda: training_step(workload))  # output held through backward, as profiled
    for p in model.parameters():
        p.grad = None
    # What each counts: the profile's peak is absolute (parameters, buffers, optimizer state and batch are in
    # memory_at_start_bytes) and comes from the storages regen saw live plus the allocator's in-op peaks;
    # torch.profiler's CPU timeline only knows allocations made inside the measured region, so compare the
    # increase over the start of the step on both sides.
    profile_increase = profile.peak_bytes - profile.memory_at_start_bytes
    measured_increase = measured.peak_increase_bytes
    print(f"{name}: profile peak increase {profile_increase} B, allocator {measured_increase} B")
    assert measured_increase > 0
    assert abs(profile_increase - measured_increase) <= PEAK_TOLERANCE * measured_increase


@pytest.mark.parametrize("name", WORKLOADS)
def test_base_plus_live_saved_tensors_reproduces_the_timeline(name, profiled):
    workload, profile = profiled(name)
    start = profile.memory_at_start_bytes
    output_bytes = _output_bytes(workload)
    live = live_candidate_bytes(profile)
    base = [op.memory_after_bytes - lv for op, lv in zip(profile.ops, live)]
    # The base (everything but candidates) never dips below what existed at the start: a candidate counted
    # twice (shared storage), or counted live after it was freed, would push it under.
    assert min(base) >= start
    # At the end of the forward every activation still held is a saved tensor or the model's output (held
    # through backward, as a training loop does): the base is back to the start plus the output, the loss
    # and a few scalars, and the timeline is at least start + all candidates.
    last_forward = profile.num_forward_ops - 1
    assert base[last_forward] - start <= output_bytes + 0.01 * profile.candidate_bytes
    assert profile.ops[last_forward].memory_after_bytes >= start + profile.candidate_bytes
    # After the step only the gradients remain.
    assert profile.ops[-1].memory_after_bytes - start == pytest.approx(profile.static_memory.gradient_bytes,
                                                                       rel=0.01)
    # And the peak is where the timeline says: never below memory after the same op.
    assert all(op.memory_peak_bytes >= op.memory_after_bytes for op in profile.ops)
    assert profile.peak_bytes == max(op.memory_peak_bytes for op in profile.ops)
    assert profile.peak_bytes >= start + profile.candidate_bytes


class _Side(torch.nn.Module):
    """A branch whose output the loss never reads: a module's call (its backward hooks) and ops that save their
    own outputs (softmax, tanh)."""

    def __init__(self):
        super().__init__()
        self.fc = torch.nn.Linear(64, 512)

    def forward(self, x):
        return self.fc(x).softmax(-1).tanh()


class _WithAnUnusedBranch(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.up, self.down, self.side = torch.nn.Linear(64, 1024), torch.nn.Linear(1024, 64), _Side()

    def forward(self, x):
        self.side(x)  # computed, never used (a model's output a classification head does not read)
        return self.down(self.up(x).relu()).pow(2).mean()


def test_what_the_loss_does_not_use_is_freed_when_the_forward_lets_go_of_it(peak_increases):
    """Backward never runs the unused branch's nodes, so the step frees what they saved once the forward drops
    the branch; the recorded step did so too, not at the step's end (its pack hooks and module hooks made
    each such node hold itself)."""
    from regen.workloads import Workload

    def build():
        torch.manual_seed(0)
        return Workload(name="unused", model=_WithAnUnusedBranch(), batch=(torch.randn(256, 64),), loss_fn=None)

    recorded, measured = peak_increases(build)
    side_saved = 2 * 256 * 512 * 4  # the softmax's and the tanh's outputs: held to the end, over the peak
    assert side_saved > 0.1 * measured
    assert abs(recorded - measured) <= 0.02 * measured
