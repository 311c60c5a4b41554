"""PEFT LoRA on a Hugging Face GPT-2 built from a config (examples/lora.py): profile, solve, apply.

The frozen base weights are read by the step as any parameter is: they are never candidates, no op of
the step copies them, and no gradient is made for them; the adapters' gradients under a hybrid plan
(emulated link) and a recompute plan equal the unplanned ones bit for bit.
"""

import contextlib
import functools
from pathlib import Path

import pytest

pytest.importorskip("peft")
pytest.importorskip("transformers")

import regen  # noqa: E402
from common import assert_nothing_left, assert_same, run_and_grads  # noqa: E402
from plans import profile, solve_halfway  # noqa: E402
from regen.formats.profile import KIND_PARAMETER  # noqa: E402
from regen.workloads import Workload, build_workload  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
LORA_ARGS = {"seq_len": 32, "n_embd": 32, "n_head": 2, "vocab_size": 128}
COPY_OPS = ("aten._to_copy.default", "aten.clone.default", "aten.copy_.default", "aten.contiguous.default")


@functools.lru_cache(maxsize=None)
def _lora():
    with contextlib.chdir(ROOT):  # `examples.lora:build` is imported from the current directory, as the CLI does
        w = build_workload("examples.lora:build", args=LORA_ARGS)
    return w, profile(w)


@functools.lru_cache(maxsize=None)
def _plan(strategy):
    if strategy == "hybrid":  # a cap low enough that the plan needs recompute besides the link's swaps
        return solve_halfway(_lora()[1], strategy, link_ratio=1.0, fraction=0.25)
    return solve_halfway(_lora()[1], strategy)


def test_frozen_base_weights_are_neither_candidates_nor_copied():
    w, prof = _lora()
    frozen = [p for p in w.model.parameters() if not p.requires_grad]
    trainable = [p for p in w.model.parameters() if p.requires_grad]
    assert frozen and trainable and all("lora_" in n for n, p in w.model.named_parameters() if p.requires_grad)
    parameter_ids = {t.id for t in prof.tensors if t.kind == KIND_PARAMETER}
    frozen_shapes = {tuple(p.shape) for p in frozen if p.dim() == 2}
    # the base projections' weights are saved by their matmuls (for the input's gradient): excluded entries
    saved_parameters = [e for e in prof.saved_entries if e.tensor in parameter_ids]
    assert any(tuple(e.shape) in frozen_shapes for e in saved_parameters)
    assert all(e.saved_tensor is None and e.excluded_reason == KIND_PARAMETER for e in saved_parameters)
    # no forward op copies a parameter, and no candidate is one
    forward = prof.ops[:prof.num_forward_ops]
    assert not [op.name for op in forward if op.name in COPY_OPS and parameter_ids & set(op.inputs)]
    tensors = {t.id: t for t in prof.tensors}
    assert all(tensors[s.tensor].kind != KIND_PARAMETER for s in prof.saved_tensors)
    # gradients and optimizer state exist for the adapters only
    trainable_bytes = sum(p.numel() * p.element_size() for p in trainable)
    assert prof.static_memory.gradient_bytes == trainable_bytes
    assert prof.static_memory.optimizer_state_bytes < 3 * trainable_bytes


@pytest.mark.parametrize("strategy", ["hybrid", "recompute"])
def test_lora_adapter_gradients_equal_unplanned(strategy):
    w, _ = _lora()
    plan = _plan(strategy)
    counts = plan.action_counts()
    assert counts["recompute"] > 0 and (strategy == "recompute" or counts["swap"] > 0)
    reference = run_and_grads(w)
    assert reference[1] and all("lora_" in name for name in reference[1])
    with regen.apply(w.model, plan, emulate_link=True) as handle:
        first = run_and_grads(w)
        second = run_and_grads(w)  # the pack-order fast path
    assert_same(reference, first)
    assert_same(reference, second)
    assert handle.stats.planned_steps == 2
    assert_nothing_left(handle)


def _lora_llama():
    """LoRA adapters on a Llama at its config's defaults (`use_cache=True`), eager attention: a plan solved at
    60% of its peak replayed its layers and appended to the key/value cache a second time, before regen turned
    the cache off for training steps."""
    from peft import LoraConfig, get_peft_model

    from regen.zoo import llama

    model, batch = llama(batch_size=2)
    model.config._attn_implementation = "eager"
    assert model.config.use_cache is True
    model = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0,
                                             target_modules=["q_proj", "v_proj", "up_proj"]))
    return Workload(name="lora-llama", model=model, batch=batch, loss_fn=None)


def test_lora_on_a_llama_at_its_defaults_trains_exactly_under_a_plan():
    from regen.planner.solve import solve_within_reach

    w = _lora_llama()
    prof = profile(w)
    assert not any(c.leaves_behind for c in prof.module_calls)  # the cache is off: layers can be replayed
    plan = solve_within_reach(prof, int(prof.peak_bytes * 0.6), "recompute", time_limit_s=20)
    assert plan.action_counts()["recompute"] > 0 and plan.regions
    reference = [run_and_grads(w) for _ in range(2)]
    with regen.apply(w.model, plan, on_mismatch="raise") as handle:
        for ref in reference:
            assert_same(ref, run_and_grads(w))
    assert handle.stats.planned_steps == 2 and handle.stats.region_replays > 0
    assert w.model.base_model.model.config.use_cache is True  # put back
    assert_nothing_left(handle)
