"""Hugging Face task heads at their defaults under a plan: heads that read the batch's padding (a decoder's
sequence classification pools at each row's last non-pad token), a multiple-choice head (inputs of three
dimensions), and PEFT's prompt tuning (virtual tokens put before every row): loss, gradients and buffers equal
to the unplanned steps, every step planned, the allocator's peak within the cap."""

import pytest

pytest.importorskip("transformers")

import torch  # noqa: E402

from regen.check import check_plan  # noqa: E402
from regen.planner.solve import solve_within_reach  # noqa: E402
from regen.profiler import profile_workload  # noqa: E402
from regen.workloads import Workload  # noqa: E402

VOCAB, SEQ, BATCH = 128, 32, 4
LLAMA = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=4 * SEQ)


def _padded() -> tuple[torch.Tensor, torch.Tensor, torch.Generator]:
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(3, VOCAB, (BATCH, SEQ), generator=g)
    mask = torch.ones_like(ids)
    for i in range(BATCH):
        kept = SEQ - (i * SEQ) // (2 * BATCH)
        ids[i, kept:], mask[i, kept:] = 0, 0
    return ids, mask, g


def _llama_sequence_classification() -> Workload:
    import transformers

    torch.manual_seed(0)
    model = transformers.LlamaForSequenceClassification(transformers.LlamaConfig(**LLAMA, pad_token_id=0,
                                                                                  num_labels=3))
    ids, mask, g = _padded()
    batch = {"input_ids": ids, "attention_mask": mask, "labels": torch.randint(0, 3, (BATCH,), generator=g)}
    return Workload(name="llama-seqcls", model=model, batch=batch, loss_fn=None)


def _roberta_multiple_choice() -> Workload:
    import transformers

    torch.manual_seed(0)
    config = transformers.RobertaConfig(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                                        intermediate_size=128, max_position_embeddings=4 * SEQ)
    g = torch.Generator().manual_seed(0)
    batch = {"input_ids": torch.randint(3, VOCAB, (BATCH, 3, SEQ // 2), generator=g),
             "labels": torch.randint(0, 3, (BATCH,), generator=g)}
    return Workload(name="roberta-mc", model=transformers.RobertaForMultipleChoice(config), batch=batch,
                    loss_fn=None)


def _llama_prompt_tuning() -> Workload:
    peft = pytest.importorskip("peft")
    import transformers

    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**LLAMA))
    model = peft.get_peft_model(model, peft.PromptTuningConfig(task_type="CAUSAL_LM", num_virtual_tokens=8))
    ids = torch.randint(3, VOCAB, (BATCH, SEQ), generator=torch.Generator().manual_seed(0))
    return Workload(name="llama-prompt-tuning", model=model, batch={"input_ids": ids, "labels": ids.clone()},
                    loss_fn=None)


@pytest.mark.parametrize("build", [_llama_sequence_classification, _roberta_multiple_choice, _llama_prompt_tuning],
                         ids=["llama-seqcls-padded", "roberta-multiple-choice", "llama-prompt-tuning"])
def test_a_task_head_trains_exactly_within_its_cap(build):
    profile = profile_workload(build(), device="cpu", repeats=1, warmup_steps=1, progress=None)
    cap = profile.memory_at_start_bytes + (profile.peak_bytes - profile.memory_at_start_bytes) * 6 // 10
    plan = solve_within_reach(profile, cap, "recompute", time_limit_s=20)
    assert plan.action_counts()["recompute"] > 0
    report = check_plan(build, plan, timed_steps=1, compared_steps=1)
    assert report.differences == []
    assert report.planned_steps == 3  # the verified step, the compared one and the timed one
    assert report.within_cap, (report.planned_peak_bytes, report.cap_bytes)
