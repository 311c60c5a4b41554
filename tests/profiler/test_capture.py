"""What the profiler records: op sequence, saved tensors and their naming (docs/internals.md), flags."""

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from regen.errors import DeviceError, WorkloadError
from regen.formats.profile import KIND_ACTIVATION, KIND_PARAMETER, PHASE_BACKWARD, PHASE_FORWARD
from regen.profiler import profile_workload
from regen.workloads import Workload


def run_profile(model, batch, loss_fn=None, name="test", repeats=1):
    workload = Workload(name=name, model=model, batch=batch, loss_fn=loss_fn)
    return profile_workload(workload, "cpu", repeats=repeats, warmup_steps=1, progress=None)


def saved_signature(profile):
    return [(s.producer_op, s.output_slot, s.bytes, tuple(s.shape), s.dtype, s.last_forward_use,
             tuple(s.backward_uses), tuple(s.entries), s.is_random, s.is_inplace) for s in profile.saved_tensors]


def test_profiling_twice_gives_the_same_ops_and_saved_tensors(profiled, profile_small):
    _, first = profiled("gpt")
    _, second = profile_small("gpt")
    assert [op.name for op in first.ops] == [op.name for op in second.ops]
    assert [op.phase for op in first.ops] == [op.phase for op in second.ops]
    assert first.fingerprint == second.fingerprint
    assert saved_signature(first) == saved_signature(second)
    assert [(e.pack_after_op, e.unpack_order, e.unpack_before_op) for e in first.saved_entries] == \
           [(e.pack_after_op, e.unpack_order, e.unpack_before_op) for e in second.saved_entries]


def test_structure_follows_the_contract(profiled):
    _, profile = profiled("gpt")
    n, num_fw = len(profile.ops), profile.num_forward_ops
    assert [op.index for op in profile.ops] == list(range(n))
    assert all(op.phase == PHASE_FORWARD for op in profile.ops[:num_fw])
    assert all(op.phase == PHASE_BACKWARD for op in profile.ops[num_fw:])
    assert profile.fingerprint.startswith(f"{num_fw}:")
    tensors = profile.tensor_by_id()
    assert [t.id for t in profile.tensors] == list(range(len(profile.tensors)))
    for op in profile.ops:  # every output is a fresh tensor produced by this op
        for tid in op.outputs:
            assert tensors[tid].producer_op == op.index
    for s in profile.saved_tensors:
        producer = profile.ops[s.producer_op]
        assert producer.phase == PHASE_FORWARD and not producer.is_view
        out = tensors[s.tensor]
        assert out.producer_op == s.producer_op and out.output_slot == s.output_slot
        assert out.storage == s.storage and s.bytes == out.storage_bytes
        assert s.producer_op <= s.last_forward_use < num_fw
        assert s.backward_uses == sorted(s.backward_uses) and all(u >= num_fw for u in s.backward_uses)
        assert s.backward_uses, "every saved activation is read by some backward op"
        for e in (profile.saved_entries[i] for i in s.entries):
            assert e.saved_tensor == s.id
            assert tensors[e.tensor].storage == s.storage
            assert s.producer_op <= e.pack_after_op < num_fw
            # the unpack happens in backward, right before the op that reads it
            assert e.unpack_order is not None and num_fw <= e.unpack_before_op <= s.last_backward_use
    orders = [e.unpack_order for e in profile.saved_entries if e.unpack_order is not None]
    assert len(orders) == len(set(orders))  # each entry's first unpack has its own position


def test_dropout_is_flagged_random(profiled, profile_small):
    _, profile = profiled("gpt")  # dropout 0.1
    random_ops = [op for op in profile.ops if op.is_random]
    assert random_ops and all(op.phase == PHASE_FORWARD for op in random_ops)
    random_saved = [s for s in profile.saved_tensors if s.is_random]
    # one mask per dropout module: embedding, and per block attention, residual and MLP
    n_layer = 2
    assert len(random_saved) == 1 + 3 * n_layer
    # on CPU dropout is bernoulli_ into an empty tensor, then div_: the mask's writer is the in-place div_,
    # so it is also flagged in-place (never recomputed)
    assert all(s.is_inplace for s in random_saved)
    _, no_dropout = profile_small("gpt", dropout=0.0)
    assert not any(op.is_random for op in no_dropout.ops)
    assert not any(s.is_random for s in no_dropout.saved_tensors)


def test_parameter_views_are_never_candidates(profiled):
    workload, profile = profiled("gpt")
    model = workload.model
    assert model.lm_head.weight is model.tok_emb.weight  # tied: lm_head reads weight.t()
    tensors = profile.tensor_by_id()
    vocab, d_model = model.tok_emb.weight.shape
    excluded = [e for e in profile.saved_entries if e.excluded_reason == KIND_PARAMETER]
    # the tied weight is saved through its transpose (a view, not an nn.Parameter) and still excluded
    assert any(e.shape == [d_model, vocab] for e in excluded)
    param_storages = {tensors[e.tensor].storage for e in excluded}
    for s in profile.saved_tensors:
        assert tensors[s.tensor].kind == KIND_ACTIVATION
        assert s.storage not in param_storages
    assert all(e.saved_tensor is None for e in excluded)


class SharedStorage(nn.Module):
    """relu(x @ w) is saved by relu, and two views of it are saved again by the products."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(16, 32)

    def forward(self, x):
        h = F.relu(self.lin(x))
        a, b = h[:, :16], h[:, 16:]
        return (a * a).sum() + (b * 3 * b).sum()


def test_a_storage_saved_several_times_counts_once():
    torch.manual_seed(0)
    model, x = SharedStorage(), torch.randn(8, 16)
    profile = run_profile(model, (x,))
    relu = [s for s in profile.saved_tensors if profile.ops[s.producer_op].name == "aten.relu.default"]
    assert len(relu) == 1
    shared = relu[0]
    assert shared.bytes == 8 * 32 * 4  # the storage, once
    entries = [profile.saved_entries[i] for i in shared.entries]
    assert len(entries) >= 3  # relu's output, and the views a and b (twice each for a * a)
    geometries = {(tuple(e.shape), tuple(e.stride), e.storage_offset) for e in entries}
    assert ((8, 16), (32, 1), 0) in geometries and ((8, 16), (32, 1), 16) in geometries
    # no other candidate repeats this storage's bytes
    assert sum(1 for s in profile.saved_tensors if s.storage == shared.storage) == 1


class InPlace(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin1 = nn.Linear(16, 16)
        self.lin2 = nn.Linear(16, 4)

    def forward(self, x):
        h = self.lin1(x)
        h.relu_()  # in place on the output of addmm (addmm does not save its output)
        return self.lin2(h).square().mean()


def test_in_place_producers_are_flagged():
    torch.manual_seed(0)
    profile = run_profile(InPlace(), (torch.randn(8, 16),))
    inplace = [s for s in profile.saved_tensors if s.is_inplace]
    assert len(inplace) == 1
    s = inplace[0]
    producer = profile.ops[s.producer_op]
    assert producer.name == "aten.relu_.default" and producer.is_inplace
    # relu_ saves its result, lin2 saves its input: same storage, one candidate named by relu_
    assert len(s.entries) == 2 and s.bytes == 8 * 16 * 4
    addmm = profile.ops[s.producer_op - 1]
    assert addmm.name == "aten.addmm.default"
    assert profile.tensor_by_id()[addmm.outputs[0]].storage == s.storage


def test_times_static_memory_and_environment(profiled):
    workload, profile = profiled("gpt")
    model = workload.model
    param_bytes = sum(p.numel() * p.element_size() for p in model.parameters())  # tied weight listed once
    sm = profile.static_memory
    assert sm.parameter_bytes == param_bytes
    assert sm.gradient_bytes == param_bytes
    assert 2 * param_bytes <= sm.optimizer_state_bytes <= 2 * param_bytes + 64 * len(list(model.parameters()))
    assert profile.step_time_s > 0 and profile.optimizer_step_time_s > 0
    assert all(op.time_s >= 0 for op in profile.ops) and sum(op.time_s for op in profile.ops) > 0
    assert profile.repeats == 2
    assert profile.device.type == "cpu" and profile.device.total_memory_bytes > 0
    assert profile.device.bandwidth_method == "host memcpy (CPU device: no real transfer)"
    assert profile.device.d2h_bytes_per_s > 1e8 and profile.device.h2d_bytes_per_s > 1e8
    assert {"python", "torch", "regen"} <= set(profile.versions)
    assert profile.workload["name"] == "gpt" and profile.workload["batch_size"] == 4


def test_profiling_leaves_the_weights_unchanged(build_small):
    workload = build_small("mlp")
    before = [p.detach().clone() for p in workload.model.parameters()]
    profile_workload(workload, "cpu", repeats=1, warmup_steps=1, progress=None)
    assert all(torch.equal(a, b) for a, b in zip(before, workload.model.parameters()))
    assert all(p.grad is None for p in workload.model.parameters())


def test_progress_is_reported(build_small):
    messages = []
    profile_workload(build_small("mlp"), "cpu", repeats=2, warmup_steps=1, progress=messages.append)
    text = "\n".join(messages)
    for phase in ("warm-up step 1/1", "timing ops: step 2/2", "recording", "bandwidth", "assembling"):
        assert phase in text


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal where there is no CUDA")
def test_cuda_without_a_device_is_refused(build_small):
    with pytest.raises(DeviceError, match="no CUDA device"):
        profile_workload(build_small("mlp"), "cuda", repeats=1, warmup_steps=0, progress=None)


class ChangesEveryStep(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.calls = 0

    def forward(self, x):
        self.calls += 1
        h = self.lin(x)
        for _ in range(self.calls % 3):
            h = torch.tanh(h)
        return h.sum()


def test_an_op_sequence_that_changes_between_steps_is_refused():
    with pytest.raises(WorkloadError, match="op sequence changed.*in each of 3 recordings.*dynamic mode"):
        run_profile(ChangesEveryStep(), (torch.randn(2, 4),), repeats=2)


class SettlesAfterSomeSteps(nn.Module):
    """Its first calls run an extra op (a lazy initialisation that takes a few steps), then it settles."""

    def __init__(self, settles_after: int):
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.calls, self.settles_after = 0, settles_after

    def forward(self, x):
        self.calls += 1
        h = self.lin(x)
        if self.calls <= self.settles_after:
            h = torch.tanh(h)
        return h.sum()


def test_a_model_that_settles_after_its_first_steps_is_profiled_in_its_steady_state():
    model = SettlesAfterSomeSteps(settles_after=4)
    profile = run_profile(model, (torch.randn(2, 4),), repeats=1)
    assert "aten.tanh.default" not in [op.name for op in profile.ops]
    assert any("recorded 2 times" in n or "recorded 3 times" in n for n in profile.notes)


class FailingBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x * 2

    @staticmethod
    def backward(ctx, grad):
        raise RuntimeError("boom in backward")


class BadBackward(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x):
        return FailingBackward.apply(self.lin(x)).sum()


def test_a_backward_that_raises_is_a_workload_error():
    with pytest.raises(WorkloadError, match="backward raised RuntimeError: boom in backward"):
        run_profile(BadBackward(), (torch.randn(2, 4),))


def test_bad_arguments_are_refused(build_small):
    from regen.errors import RegenError

    with pytest.raises(RegenError, match="repeats"):
        profile_workload(build_small("mlp"), "cpu", repeats=0, warmup_steps=0, progress=None)
    with pytest.raises(DeviceError):
        profile_workload(build_small("mlp"), "tpu", repeats=1, warmup_steps=0, progress=None)


class Annotated(nn.Module):
    """A forward that opens record_function regions (as DistributedDataParallel's does)."""

    def __init__(self, annotate: bool):
        super().__init__()
        self.annotate = annotate
        self.lin = nn.Linear(8, 8)

    def forward(self, x):
        if not self.annotate:
            return torch.tanh(self.lin(x)).sum()
        with torch.profiler.record_function("user-region"):
            return torch.tanh(self.lin(x)).sum()


def test_record_function_regions_are_not_numbered():
    torch.manual_seed(0)
    x = torch.randn(4, 8)
    plain = run_profile(Annotated(False), (x,))
    annotated = run_profile(Annotated(True), (x,))
    assert not any(op.name.startswith("profiler.") for op in annotated.ops)
    assert [op.name for op in annotated.ops] == [op.name for op in plain.ops]
    assert annotated.fingerprint == plain.fingerprint


def test_the_bandwidth_probe_is_short_and_labelled():
    import time

    from regen.profiler.bandwidth import CPU_METHOD, measure_bandwidth

    t0 = time.perf_counter()
    bandwidth = measure_bandwidth(torch.device("cpu"))
    took_s = time.perf_counter() - t0
    print(f"CPU memcpy probe: {bandwidth.d2h_bytes_per_s / 1e9:.1f} GB/s in {took_s:.3f} s")
    assert bandwidth.method == CPU_METHOD and bandwidth.d2h_bytes_per_s > 1e8
    assert took_s < 2.0  # about 0.05 s on an idle machine; loose for a loaded CI runner


def test_recording_inside_another_profiler_still_works(build_small):
    from regen.profiler import record_step

    workload = build_small("mlp")
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]):
        capture = record_step(workload, torch.device("cpu"))
    assert capture.ops and capture.saved_tensors
    assert any("another torch.profiler" in note for note in capture.notes)


class PenalisedMLP(nn.Module):
    """The loss adds a gradient penalty: its first backward runs with create_graph=True."""

    def __init__(self):
        super().__init__()
        self.lin1 = nn.Linear(16, 32)
        self.lin2 = nn.Linear(32, 4)

    def forward(self, x):
        out = self.lin2(torch.tanh(self.lin1(x))).square().mean()
        grads = torch.autograd.grad(out, list(self.parameters()), create_graph=True)
        return out + sum(g.pow(2).sum() for g in grads)


def test_a_double_backward_is_said_in_one_line():
    torch.manual_seed(0)
    messages = []
    workload = Workload("penalty", PenalisedMLP(), (torch.randn(8, 16),), None)
    profile = profile_workload(workload, "cpu", repeats=1, warmup_steps=0, progress=messages.append)
    said = [m for m in messages if "create_graph=True" in m]
    assert len(said) == 1 and said[0].startswith("warning: double backward")
    assert sum("create_graph=True" in note for note in profile.notes) == 1
    plain = run_profile(InPlace(), (torch.randn(8, 16),))
    assert not any("create_graph" in note for note in plain.notes)


class _Checkpointed(nn.Module):
    """Two blocks run under torch.utils.checkpoint (or saving to host memory), as a user's model that
    checkpoints itself does."""

    def __init__(self, how: str):
        super().__init__()
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 16)) for _ in range(2))
        self.how = how

    def forward(self, x):
        from torch.utils.checkpoint import checkpoint

        for block in self.blocks:
            if self.how == "offloaded":
                with torch.autograd.graph.save_on_cpu():
                    x = block(x)
            elif self.how == "plain":
                x = block(x)
            else:
                x = checkpoint(block, x, use_reentrant=self.how == "reentrant")
        return x.square().mean()


@pytest.mark.parametrize("how", ["non-reentrant", "reentrant", "offloaded", "plain"])
def test_a_model_that_checkpoints_itself_is_told_how_to_let_regen_choose(how):
    """Its blocks' saved tensors go to hooks of its own (or are saved again in backward): regen sees and plans
    none of them; one warning line says so and how to turn it off, and the profile keeps it as a note."""
    from regen.formats.profile import OTHER_HOOKS_ADVICE

    torch.manual_seed(0)
    messages = []
    workload = Workload("self-checkpointed", _Checkpointed(how), (torch.randn(8, 16, requires_grad=True),), None)
    profile = profile_workload(workload, "cpu", repeats=1, warmup_steps=0, progress=messages.append)
    said = [m for m in messages if OTHER_HOOKS_ADVICE in m]
    noted = [n for n in profile.notes if OTHER_HOOKS_ADVICE in n]
    if how == "plain":
        assert not said and not noted
        return
    assert len(said) == 1 and said[0].startswith("warning: ") and len(noted) == 1
    assert ("reentrant activation checkpointing" in noted[0]) == (how == "reentrant")


def test_a_profile_without_an_optimizer_step_and_with_a_given_bandwidth(build_small):
    """What regen.learning asks between a user's steps: no optimizer state is made, no probe buffers, the
    same ops and saved tensors as a full profile."""
    from regen.profiler.bandwidth import Bandwidth

    w = build_small("gpt")
    full = profile_workload(w, "cpu", repeats=1, warmup_steps=1, progress=None)
    given = Bandwidth(d2h_bytes_per_s=1e9, h2d_bytes_per_s=2e9, method="given")
    w.model.zero_grad(set_to_none=True)
    bare = profile_workload(w, "cpu", repeats=1, warmup_steps=0, progress=None, bandwidth=given, optimizer_step=False)
    assert bare.static_memory.optimizer_state_bytes == 0 and bare.optimizer_step_time_s < 1e-3
    assert (bare.device.d2h_bytes_per_s, bare.device.h2d_bytes_per_s) == (1e9, 2e9)
    assert "optimizer: none (the step alone)" in bare.notes
    assert saved_signature(bare) == saved_signature(full)
    assert all(p.grad is None for p in w.model.parameters())
