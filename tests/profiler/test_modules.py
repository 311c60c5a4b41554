"""Module paths and module calls in the profile (regen.profiler.modules, optional profile fields)."""

import torch

import regen
from regen.formats import load_profile, save_profile
from regen.formats.profile import KIND_ACTIVATION, PHASE_BACKWARD, PHASE_FORWARD


def _calls(profile):
    return {(c.module, c.call): c for c in profile.module_calls}


def test_forward_ops_name_their_innermost_module(profiled):
    _, profile = profiled("gpt")
    calls = _calls(profile)
    fc = calls[("blocks.0.fc", 0)]
    block = calls[("blocks.0", 0)]
    for op in profile.ops[fc.first_op:fc.last_op + 1]:
        assert op.module == "blocks.0.fc"
    assert any(op.name == "aten.addmm.default" for op in profile.ops[fc.first_op:fc.last_op + 1])
    # the block's extent holds its children's, and each op of it is named by the block or a child
    assert block.first_op <= fc.first_op <= fc.last_op <= block.last_op
    for op in profile.ops[block.first_op:block.last_op + 1]:
        assert op.module == "blocks.0" or op.module.startswith("blocks.0.")
    assert block.depth == 2 and fc.depth == 3  # blocks (1) -> blocks.0 (2) -> blocks.0.fc (3)
    # the loss is computed outside the model
    assert profile.ops[profile.num_forward_ops - 1].module is None


def test_backward_ops_are_named_by_the_module_whose_backward_runs(profiled):
    _, profile = profiled("gpt")
    backward = [op for op in profile.ops if op.phase == PHASE_BACKWARD]
    named = [op.module for op in backward if op.module is not None]
    assert len(named) > len(backward) // 2
    assert any(m.startswith("blocks.1") for m in named) and any(m.startswith("blocks.0") for m in named)
    # backward runs the blocks in reverse: block 1's ops come before block 0's
    first_1 = next(i for i, op in enumerate(backward) if (op.module or "").startswith("blocks.1"))
    first_0 = next(i for i, op in enumerate(backward) if (op.module or "").startswith("blocks.0"))
    assert first_1 < first_0


def test_module_calls_hold_their_inputs_and_saved_entries(profiled):
    _, profile = profiled("gpt")
    tensors = profile.tensor_by_id()
    block = _calls(profile)[("blocks.1", 0)]
    assert len(block.inputs) == 1
    x = tensors[block.inputs[0]]
    assert x.kind == KIND_ACTIVATION and x.producer_op < block.first_op  # block 0's output
    entries = profile.saved_entries[block.first_entry:block.first_entry + block.num_entries]
    assert entries and all(block.first_op - 1 <= e.pack_after_op <= block.last_op for e in entries)
    # the call's entries are consecutive in pack order; those of its children are among them
    attn = _calls(profile)[("blocks.1.attn", 0)]
    assert block.first_entry <= attn.first_entry
    assert attn.first_entry + attn.num_entries <= block.first_entry + block.num_entries
    assert all(op.phase == PHASE_FORWARD for op in profile.ops[block.first_op:block.last_op + 1])


def test_batch_norm_calls_count_their_buffers(profiled):
    _, profile = profiled("cnn")
    calls = _calls(profile)
    bn = calls[("blocks.0.bn1", 0)]
    channels = 8
    assert bn.buffer_bytes == 2 * channels * 4 + 8  # running mean and var (float32), num_batches_tracked
    assert calls[("blocks.0", 0)].buffer_bytes == 2 * bn.buffer_bytes


def test_module_fields_survive_a_round_trip(profiled, tmp_path):
    _, profile = profiled("gpt")
    path = tmp_path / "p.yaml"
    save_profile(profile, path)
    back = load_profile(path)
    assert back.module_calls == profile.module_calls
    assert [op.module for op in back.ops] == [op.module for op in profile.ops]


def test_a_profile_without_module_fields_still_loads(profiled, tmp_path):
    import yaml

    _, profile = profiled("mlp")
    doc = profile.to_dict()
    doc.pop("module_calls")
    for op in doc["ops"]:
        op.pop("module")
    path = tmp_path / "old.yaml"
    path.write_text(yaml.safe_dump(doc))
    back = load_profile(path)
    assert back.module_calls == [] and all(op.module is None for op in back.ops)


class _Coupling(torch.autograd.Function):
    """y = (a + f(b), b) for x = (a, b), as a reversible layer computes it (Reformer's _ReversibleFunction):
    f runs inside the Function's forward, on views made there under no grad (they require grad and have no
    autograd node), and its backward calls f again and runs a backward of its own."""

    @staticmethod
    def forward(ctx, x, f, *params):
        ctx.f = f
        ctx.save_for_backward(x)
        a, b = torch.chunk(x, 2, dim=-1)
        return torch.cat([a + f(b), b], dim=-1)

    @staticmethod
    def backward(ctx, gy):
        (x,) = ctx.saved_tensors
        ga, gb = torch.chunk(gy, 2, dim=-1)
        with torch.enable_grad():
            b = torch.chunk(x, 2, dim=-1)[1].detach()
            b.requires_grad = True
            ctx.f(b).backward(ga)
        return (torch.cat([ga, gb + b.grad], dim=-1), None) + (None,) * len(tuple(ctx.f.parameters()))


class _CouplingNet(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.inp = torch.nn.Linear(16, 16)
        self.norm = torch.nn.BatchNorm1d(16)  # buffers, which a replay must not update twice
        self.f = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Tanh())
        self.out = torch.nn.Linear(16, 1)

    def forward(self, x):
        return self.out(_Coupling.apply(self.norm(self.inp(x)), self.f, *self.f.parameters())).square().mean()


def test_a_module_called_inside_a_custom_function_is_recorded_and_the_profile_plans_exactly():
    """register_multi_grad_hook finds no node on such views: the call is recorded without backward
    attribution (its backward ops count as the enclosing module's) instead of a crash."""
    from regen.planner import solve
    from regen.profiler import profile_workload
    from regen.workloads import Workload, training_step

    def workload():
        torch.manual_seed(0)
        return Workload(name="coupling", model=_CouplingNet(), batch=(torch.randn(64, 16),), loss_fn=None)

    profile = profile_workload(workload(), device="cpu", repeats=1, warmup_steps=1, progress=None)
    assert {"inp", "f", "f.0", "out"} <= {c.module for c in profile.module_calls}
    plan = solve(profile, 2 * profile.peak_bytes, "chen")
    # what the Function saved (the norm's output) is recomputed too
    assert any(d.action == "recompute" and d.producer_module == "norm" and d.shape == [64, 16] for d in plan.decisions)

    def grads_of_two_steps(plan):
        w = workload()
        handle = regen.apply(w.model, plan) if plan is not None else None
        out = []
        for _ in range(2):
            w.model.zero_grad(set_to_none=True)
            out.append((training_step(w).detach(), [p.grad.clone() for p in w.model.parameters()]))
        if handle is not None:
            assert handle.stats.planned_steps == 2
            handle.remove()
        return out, [b.clone() for b in w.model.buffers()]

    (unplanned, buffers), (planned, p_buffers) = grads_of_two_steps(None), grads_of_two_steps(plan)
    for (loss, grads), (p_loss, p_grads) in zip(unplanned, planned):
        assert torch.equal(loss, p_loss) and all(torch.equal(a, b) for a, b in zip(grads, p_grads))
    assert len(buffers) == 3 and all(torch.equal(a, b) for a, b in zip(buffers, p_buffers))
