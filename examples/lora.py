"""A PEFT LoRA workload: a Hugging Face GPT-2 built from a config (no download), its base weights frozen
and LoRA adapters on the attention and MLP projections; the loss is the model's own `.loss`.

    regen profile --model examples.lora:build --batch-size 2 -o lora.profile.yaml
    regen solve lora.profile.yaml --memory-cap 60% -o lora.plan.yaml

Only the adapters train: the frozen base weights are read by the forward (and by recipes) as any
parameter is, never saved as activations, swapped or copied.
"""

from __future__ import annotations

import torch


def build(batch_size: int = 2, seq_len: int = 64, n_layer: int = 2, n_embd: int = 128, n_head: int = 4,
          vocab_size: int = 1024, rank: int = 8, dropout: float = 0.1, seed: int = 0):
    from peft import LoraConfig, get_peft_model
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(seed)
    config = GPT2Config(vocab_size=vocab_size, n_positions=max(seq_len, 64), n_embd=n_embd, n_layer=n_layer,
                        n_head=n_head, resid_pdrop=dropout, embd_pdrop=dropout, attn_pdrop=dropout,
                        bos_token_id=0, eos_token_id=0, use_cache=False)
    lora = LoraConfig(r=rank, lora_alpha=2 * rank, lora_dropout=dropout, target_modules=["c_attn", "c_fc"],
                      fan_in_fan_out=True)  # GPT-2's projections are Conv1D: weights stored transposed
    model = get_peft_model(GPT2LMHeadModel(config), lora)
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab_size, (batch_size, seq_len), generator=g)
    return model, {"input_ids": ids, "labels": ids.clone()}
