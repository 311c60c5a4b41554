"""Ops that write an argument and return another tensor (`rrelu_with_noise(Tensor self, Tensor(b!) noise)`):
what an op writes comes from its schema (regen.opinfo.op_outputs), in the profile, the planner and the
runtime.

* Every op that the built-in workloads dispatch (forward and backward) changes no argument its schema does
  not declare written, and every written argument is one of its outputs (slots after the returned ones).
* A model with `F.rrelu(training=True)` planned with recompute and with the default hybrid plan (over a link,
  so it swaps too) gives the unplanned loss, gradients and buffers bit for bit over several steps.
"""

import functools

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

import regen
from common import assert_same, make, run_and_grads
from regen import opinfo
from regen.workloads import Workload, training_step

STEPS = 3
SOLVE_TIME_LIMIT_S = 30
BUILT_INS = ["mlp", "cnn", "gpt", "hf-gpt2"]


class _WriteAudit(TorchDispatchMode):
    """Runs every op with a byte copy of each tensor argument taken before it; records the op names and every
    argument whose bytes changed that `op_outputs` does not list (a write the schema does not declare)."""

    def __init__(self):
        super().__init__()
        self.names: set[str] = set()
        self.undeclared: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        tensors = [a for a in tree_flatten((args, kwargs))[0] if isinstance(a, torch.Tensor)]
        before = [_bytes_of(t) for t in tensors]
        out = func(*args, **kwargs)
        name = opinfo.op_name(func)
        self.names.add(name)
        outputs = {opinfo.storage_key(o) for o in opinfo.op_outputs(func, args, kwargs, out) if o is not None}
        written = {opinfo.storage_key(t) for pos, n in opinfo.written_arguments(func)
                   for t in tree_flatten(opinfo.argument_value(func, args, kwargs, pos, n))[0]
                   if isinstance(t, torch.Tensor)}
        for t, b in zip(tensors, before):
            key = opinfo.storage_key(t)
            if b is not None and not torch.equal(b, _bytes_of(t)) and key not in written:
                self.undeclared.append(f"{name} changed an argument its schema does not write")
            if key in written and func._schema.is_mutable and key not in outputs and not opinfo.is_view(func):
                self.undeclared.append(f"{name} writes an argument that is not among its outputs")
        return out


def _bytes_of(t: torch.Tensor):
    if t.untyped_storage().nbytes() == 0 or t.device.type != "cpu":
        return None
    with torch._C._DisableTorchDispatch():
        return torch.empty(0, dtype=torch.uint8).set_(t.untyped_storage(), 0, (t.untyped_storage().nbytes(),),
                                                      (1,)).clone()


@pytest.mark.parametrize("name", BUILT_INS)
def test_every_op_of_the_built_ins_writes_only_what_its_schema_declares(name):
    if name.startswith("hf-"):
        pytest.importorskip("transformers")
    w = make(name)
    audit = _WriteAudit()
    with audit:
        training_step(w)
    assert audit.names
    assert not audit.undeclared, sorted(set(audit.undeclared))


def test_rrelu_noise_is_an_output_of_rrelu_with_noise():
    x = torch.randn(4, 3)
    noise = torch.empty_like(x)
    func = torch.ops.aten.rrelu_with_noise.default
    out = func(x, noise, 0.1, 0.3, True)
    outs = opinfo.op_outputs(func, (x, noise, 0.1, 0.3, True), {}, out)
    assert outs[0] is out and outs[1] is noise
    assert opinfo.written_outputs(func, (x, noise), {}, outs) == [(0, opinfo.storage_key(out)),
                                                                   (1, opinfo.storage_key(noise))]


class RReLUMLP(torch.nn.Module):
    def __init__(self, width=64, depth=4):
        super().__init__()
        self.layers = torch.nn.ModuleList(torch.nn.Linear(width, width) for _ in range(depth))
        self.head = torch.nn.Linear(width, 1)

    def forward(self, x):
        for layer in self.layers:
            x = torch.nn.functional.rrelu(layer(x), training=True)
        return self.head(x).pow(2).mean()


def _rrelu_workload():
    torch.manual_seed(0)
    return Workload(name="rrelu", model=RReLUMLP(), batch=(torch.randn(256, 64),), loss_fn=None)


@functools.lru_cache(maxsize=None)
def _rrelu_profile():
    from regen.profiler import profile_workload

    w = _rrelu_workload()
    return w, profile_workload(w, device="cpu", repeats=1, warmup_steps=1, progress=None)


def _solve(strategy: str, fraction: float, **link):
    """A plan at `fraction` of the way from the smallest cap feasible with recompute to the profile's peak."""
    from regen.planner import solve
    from regen.planner.graph import build_graph
    from regen.planner.milp.search import smallest_feasible_cap

    w, profile = _rrelu_profile()
    smallest = smallest_feasible_cap(build_graph(profile), allow_swap=False, allow_recompute=True)
    cap = smallest + int(fraction * (profile.peak_bytes - smallest))
    return w, profile, solve(profile, memory_cap_bytes=cap, strategy=strategy, time_limit_s=SOLVE_TIME_LIMIT_S,
                             **link)


def test_the_profile_names_the_noise_by_the_op_that_wrote_it():
    _, profile = _rrelu_profile()
    ops, tensors = profile.ops, profile.tensor_by_id()
    rrelu = [op for op in ops if op.name == "aten.rrelu_with_noise.default"]
    assert len(rrelu) == 4
    for op in rrelu:
        assert len(op.outputs) == 2  # the returned tensor, then the noise it wrote
        noise = tensors[op.outputs[1]]
        assert noise.storage == tensors[op.inputs[1]].storage and noise.output_slot == 1
    noise_storages = {tensors[op.outputs[1]].storage for op in rrelu}
    from regen.planner.graph import build_graph

    graph = build_graph(profile, d2h_bytes_per_s=1e9, h2d_bytes_per_s=1e9)
    noise_cands = [c for c in graph.candidates if c.saved.storage in noise_storages]
    assert len(noise_cands) == 4
    for c in noise_cands:  # packed before rrelu wrote it: neither swapped (copy at the pack) nor recomputed
        assert not c.can_swap and not c.can_recompute
        assert "writes its storage in place" in c.not_recomputable


@pytest.mark.parametrize("strategy, fraction, link", [
    ("recompute", 0.0, {}),
    ("hybrid", 0.5, {}),
    ("hybrid", 0.3, {"link_ratio": 0.9}),
])
def test_rrelu_plans_give_unplanned_gradients_bit_for_bit(strategy, fraction, link):
    w, profile, plan = _solve(strategy, fraction, **link)
    counts = plan.action_counts()
    assert counts["keep"] < len(plan.decisions), "the plan must act on something"
    references = [run_and_grads(w, seed=50 + k) for k in range(STEPS)]
    with regen.apply(w.model, plan, emulate_link=bool(link)) as handle:
        for k in range(STEPS):
            assert_same(references[k], run_and_grads(w, seed=50 + k))
    assert handle.stats.planned_steps == STEPS and handle.stats.unplanned_steps == 0
