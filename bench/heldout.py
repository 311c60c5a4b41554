"""Held-out architectures: Hugging Face models that are not in regen.zoo, trained under regen's plans.

The zoo (regen.zoo, tests/test_zoo.py) is what regen is tested on; this is what it was not built around.
Each architecture is built from a tiny config of its transformers class with only sizes set (`use_cache`,
the attention implementation, dropout and every other default as shipped), batch 4. Per architecture:
`profile_workload`; Hugging Face's own gradient checkpointing (or `torch.utils.checkpoint` around each
repeated block) measured by the allocator, its peak the cap; a recompute and a hybrid plan (R = 0.9, an
emulated link) solved at that cap (or the smallest cap each reaches); then `regen check`'s comparison
(regen.check.check_plan) over 3 steps under each plan against 3 unplanned steps from the same state and
seeds (torch's, Python's and NumPy's), the handle's verified step and two on its fast path: losses,
gradients and module buffers bit for bit ("exact"), how many steps ran planned (a check raises on any
other), and the planned step's allocator peak against the plan's cap. An architecture whose step dispatches
other ops from step to step (a random layer drop: `regen profile` refuses it and names dynamic mode) gets
one row of dynamic mode instead (regen.check.check_dynamic), at checkpointing's peak increase over its
parameters and buffers. With `--dynamic`, every architecture gets that row, and no plans.

`--configurations` runs the same rows over CONFIGURATIONS instead: what users do with such models beyond
the causal-LM or masked-LM step (task heads on padded batches, hidden states and attention weights in the
output, PEFT methods, one odd-length row, a frozen first layer, packed sequences, a grown vocabulary,
channels-last images). Where checkpointing fails on a configuration (PEFT prefix tuning: Hugging Face's
checkpointing turns off the cache its prefix lives in), the cap is 70% of the unplanned peak.

    .venv/bin/python bench/heldout.py [--models gemma3 cohere ...] [--autocast bf16]
    .venv/bin/python bench/heldout.py --configurations

No figure here is a time: it runs on a busy machine as well.
"""

from __future__ import annotations

import argparse
import sys
import traceback
import warnings
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from regen.errors import PlanMismatchError, WorkloadError  # noqa: E402
from regen.measure import measure_memory  # noqa: E402
from regen.workloads import Workload, training_step  # noqa: E402
from regen.zoo import SIZES  # noqa: E402

_TINY = SIZES["tiny"]

STEPS = 3
BATCH = 4
LINK_RATIO = 0.9
# the zoo's tiny size (regen.zoo.SIZES), so held-out and zoo models compare at one size
VOCAB, WIDTH, LAYERS, HEADS, KV_HEADS, SEQ = (_TINY.vocab, _TINY.width, _TINY.layers, _TINY.heads, _TINY.kv_heads,
                                              _TINY.seq_len)


def _tokens(batch_size: int, seq: int = SEQ) -> dict:
    ids = torch.randint(0, VOCAB, (batch_size, seq), generator=torch.Generator().manual_seed(0))
    return {"input_ids": ids, "labels": ids.clone()}


def _seq2seq(batch_size: int) -> dict:
    g = torch.Generator().manual_seed(0)
    return {"input_ids": torch.randint(3, VOCAB, (batch_size, SEQ), generator=g),
            "labels": torch.randint(3, VOCAB, (batch_size, SEQ // 2), generator=g)}


def _image(batch_size: int, labels: int = 10) -> dict:
    g = torch.Generator().manual_seed(0)
    return {"pixel_values": torch.randn(batch_size, 3, 32, 32, generator=g),
            "labels": torch.randint(0, labels, (batch_size,), generator=g)}


def _audio(batch_size: int) -> dict:
    g = torch.Generator().manual_seed(0)
    return {"input_values": torch.randn(batch_size, 4000, generator=g),
            "labels": torch.randint(1, 30, (batch_size, 8), generator=g)}


def _pixels(batch_size: int) -> dict:
    return {"pixel_values": torch.randn(batch_size, 3, 32, 32, generator=torch.Generator().manual_seed(0))}


def _llama_like(**more) -> dict:
    return dict(vocab_size=VOCAB, hidden_size=WIDTH, intermediate_size=2 * WIDTH, num_hidden_layers=LAYERS,
                num_attention_heads=HEADS, num_key_value_heads=KV_HEADS, max_position_embeddings=4 * SEQ, **more)


def _gpt_like(**more) -> dict:
    return dict(vocab_size=VOCAB, n_embd=WIDTH, n_layer=LAYERS, n_head=HEADS, n_positions=4 * SEQ, **more)


def _seq2seq_config(**more) -> dict:
    return dict(vocab_size=VOCAB, d_model=WIDTH, encoder_layers=LAYERS, decoder_layers=LAYERS,
                encoder_attention_heads=HEADS, decoder_attention_heads=HEADS, encoder_ffn_dim=2 * WIDTH,
                decoder_ffn_dim=2 * WIDTH, **more)


def _bert_like(**more) -> dict:
    return dict(vocab_size=VOCAB, hidden_size=WIDTH, num_hidden_layers=LAYERS, num_attention_heads=HEADS,
                intermediate_size=2 * WIDTH, max_position_embeddings=4 * SEQ, **more)


def _text_and_image(batch_size: int) -> dict:
    g = torch.Generator().manual_seed(0)
    return {"input_ids": torch.randint(0, VOCAB, (batch_size, SEQ // 4), generator=g),
            "pixel_values": torch.randn(batch_size, 3, 32, 32, generator=g), "return_loss": True}


def _classified_tokens(batch_size: int) -> dict:
    g = torch.Generator().manual_seed(0)
    return {"input_ids": torch.randint(0, VOCAB, (batch_size, SEQ), generator=g),
            "labels": torch.randint(0, 2, (batch_size,), generator=g)}


def _time_series(batch_size: int) -> dict:
    g = torch.Generator().manual_seed(0)
    return {"past_values": torch.randn(batch_size, SEQ, 3, generator=g),
            "future_values": torch.randn(batch_size, SEQ // 4, 3, generator=g)}


def _video(batch_size: int) -> dict:
    g = torch.Generator().manual_seed(0)
    return {"pixel_values": torch.randn(batch_size, 4, 3, 32, 32, generator=g),
            "labels": torch.randint(0, 10, (batch_size,), generator=g)}


# name -> (model class, config class, config keys, batch)
# multi-head latent attention (a low-rank key/value projection) and a routed mixture of experts after one dense layer
_LATENT_MOE = dict(kv_lora_rank=16, q_lora_rank=None, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=16,
                   n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=WIDTH, first_k_dense_replace=1,
                   n_group=1, topk_group=1)

# the sizes of every kind of decoder (experts, latent attention, sliding windows), for configs that read some of them
_ANY_DECODER = dict(_LATENT_MOE, head_dim=16, num_experts=4, num_local_experts=4, n_shared_experts=1, sliding_window=32,
                    pad_token_id=0, rope_theta=10000.0)

HELD_OUT = {
    "gemma3": ("Gemma3ForCausalLM", "Gemma3TextConfig", _llama_like(head_dim=16, sliding_window=32), _tokens),
    "cohere": ("CohereForCausalLM", "CohereConfig", _llama_like(), _tokens),
    "stablelm": ("StableLmForCausalLM", "StableLmConfig", _llama_like(), _tokens),
    "granite": ("GraniteForCausalLM", "GraniteConfig", _llama_like(), _tokens),
    "starcoder2": ("Starcoder2ForCausalLM", "Starcoder2Config", _llama_like(sliding_window=32), _tokens),
    "qwen3_moe": ("Qwen3MoeForCausalLM", "Qwen3MoeConfig",
                  _llama_like(head_dim=16, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=WIDTH), _tokens),
    "qwen2_moe": ("Qwen2MoeForCausalLM", "Qwen2MoeConfig",
                  _llama_like(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=WIDTH,
                              shared_expert_intermediate_size=WIDTH), _tokens),
    "olmo": ("OlmoForCausalLM", "OlmoConfig", _llama_like(), _tokens),
    "phi": ("PhiForCausalLM", "PhiConfig",
            dict(vocab_size=VOCAB, hidden_size=WIDTH, intermediate_size=2 * WIDTH, num_hidden_layers=LAYERS,
                 num_attention_heads=HEADS, max_position_embeddings=4 * SEQ), _tokens),
    "gptj": ("GPTJForCausalLM", "GPTJConfig", _gpt_like(rotary_dim=8), _tokens),
    "gpt_bigcode": ("GPTBigCodeForCausalLM", "GPTBigCodeConfig", _gpt_like(), _tokens),
    "codegen": ("CodeGenForCausalLM", "CodeGenConfig", _gpt_like(n_ctx=4 * SEQ, rotary_dim=8), _tokens),
    "mpt": ("MptForCausalLM", "MptConfig",
            dict(vocab_size=VOCAB, d_model=WIDTH, n_layers=LAYERS, n_heads=HEADS, max_seq_len=4 * SEQ), _tokens),
    "albert": ("AlbertForMaskedLM", "AlbertConfig",
               dict(vocab_size=VOCAB, embedding_size=WIDTH, hidden_size=WIDTH, num_hidden_layers=LAYERS + 1,
                    num_attention_heads=HEADS, intermediate_size=4 * WIDTH, max_position_embeddings=4 * SEQ), _tokens),
    "distilbert": ("DistilBertForMaskedLM", "DistilBertConfig",
                   dict(vocab_size=VOCAB, dim=WIDTH, n_layers=LAYERS, n_heads=HEADS, hidden_dim=4 * WIDTH,
                        max_position_embeddings=4 * SEQ), _tokens),
    "fnet": ("FNetForMaskedLM", "FNetConfig",
             dict(vocab_size=VOCAB, hidden_size=WIDTH, num_hidden_layers=LAYERS, intermediate_size=2 * WIDTH,
                  max_position_embeddings=4 * SEQ), _tokens),
    "xlnet": ("XLNetLMHeadModel", "XLNetConfig",
              dict(vocab_size=VOCAB, d_model=WIDTH, n_layer=LAYERS, n_head=HEADS, d_inner=2 * WIDTH), _tokens),
    "mbart": ("MBartForConditionalGeneration", "MBartConfig", _seq2seq_config(max_position_embeddings=4 * SEQ),
              _seq2seq),
    "pegasus": ("PegasusForConditionalGeneration", "PegasusConfig",
                _seq2seq_config(max_position_embeddings=4 * SEQ), _seq2seq),
    "led": ("LEDForConditionalGeneration", "LEDConfig",
            _seq2seq_config(max_encoder_position_embeddings=4 * SEQ, max_decoder_position_embeddings=4 * SEQ,
                            attention_window=[16] * LAYERS), _seq2seq),
    "resnet": ("ResNetForImageClassification", "ResNetConfig",
               dict(embedding_size=16, hidden_sizes=[16, 32], depths=[1, 1], num_labels=10), _image),
    "mobilenet_v2": ("MobileNetV2ForImageClassification", "MobileNetV2Config",
                     dict(image_size=32, depth_multiplier=0.35, num_labels=10), _image),
    "convnextv2": ("ConvNextV2ForImageClassification", "ConvNextV2Config",
                   dict(hidden_sizes=[16, 32, 64, 128], depths=[1, 1, 2, 1], num_labels=10, image_size=32), _image),
    "dinov2": ("Dinov2ForImageClassification", "Dinov2Config",
               dict(hidden_size=WIDTH, num_hidden_layers=LAYERS, num_attention_heads=HEADS, image_size=32,
                    patch_size=8, num_labels=10), _image),
    "beit": ("BeitForImageClassification", "BeitConfig",
             dict(hidden_size=WIDTH, num_hidden_layers=LAYERS, num_attention_heads=HEADS, intermediate_size=2 * WIDTH,
                  image_size=32, patch_size=8, num_labels=10), _image),
    "swinv2": ("Swinv2ForImageClassification", "Swinv2Config",
               dict(image_size=32, patch_size=2, embed_dim=16, depths=[1, 1], num_heads=[2, 2], window_size=4,
                    num_labels=10), _image),
    # a second set, added after the first had been fixed for: more decoders (MoE, state-space and recurrent
    # layers among them), encoders, speech, and vision models whose forward draws random numbers
    "gemma": ("GemmaForCausalLM", "GemmaConfig", _llama_like(head_dim=16), _tokens),
    "glm": ("GlmForCausalLM", "GlmConfig", _llama_like(head_dim=16, pad_token_id=0), _tokens),
    "helium": ("HeliumForCausalLM", "HeliumConfig", _llama_like(head_dim=16), _tokens),
    "nemotron": ("NemotronForCausalLM", "NemotronConfig", _llama_like(head_dim=16), _tokens),
    "olmoe": ("OlmoeForCausalLM", "OlmoeConfig", _llama_like(num_experts=4, num_experts_per_tok=2), _tokens),
    "granitemoe": ("GraniteMoeForCausalLM", "GraniteMoeConfig",
                   _llama_like(num_local_experts=4, num_experts_per_tok=2), _tokens),
    "persimmon": ("PersimmonForCausalLM", "PersimmonConfig",
                  dict(vocab_size=VOCAB, hidden_size=WIDTH, intermediate_size=2 * WIDTH, num_hidden_layers=LAYERS,
                       num_attention_heads=HEADS, max_position_embeddings=4 * SEQ), _tokens),
    "gpt_neo": ("GPTNeoForCausalLM", "GPTNeoConfig",
                dict(vocab_size=VOCAB, hidden_size=WIDTH, num_layers=LAYERS, num_heads=HEADS, window_size=16,
                     attention_types=[[["global", "local"], LAYERS // 2]], max_position_embeddings=4 * SEQ), _tokens),
    "jamba": ("JambaForCausalLM", "JambaConfig",
              dict(vocab_size=VOCAB, hidden_size=WIDTH, intermediate_size=2 * WIDTH, num_hidden_layers=4,
                   num_attention_heads=HEADS, num_key_value_heads=KV_HEADS, num_experts=4, num_experts_per_tok=2,
                   expert_layer_period=2, expert_layer_offset=1, attn_layer_period=2, attn_layer_offset=1,
                   mamba_d_state=8), _tokens),
    "falcon_mamba": ("FalconMambaForCausalLM", "FalconMambaConfig",
                     dict(vocab_size=VOCAB, hidden_size=WIDTH, num_hidden_layers=LAYERS, state_size=8), _tokens),
    "mamba2": ("Mamba2ForCausalLM", "Mamba2Config",
               dict(vocab_size=VOCAB, hidden_size=WIDTH, num_hidden_layers=LAYERS, num_heads=8, head_dim=16,
                    state_size=8, n_groups=1, chunk_size=16), _tokens),
    "recurrent_gemma": ("RecurrentGemmaForCausalLM", "RecurrentGemmaConfig",
                        dict(vocab_size=VOCAB, hidden_size=WIDTH, intermediate_size=2 * WIDTH, num_hidden_layers=3,
                             num_attention_heads=HEADS, num_key_value_heads=1, lru_width=WIDTH,
                             attention_window_size=32, block_types=["recurrent", "recurrent", "attention"]), _tokens),
    "modernbert": ("ModernBertForMaskedLM", "ModernBertConfig",
                   dict(vocab_size=VOCAB, hidden_size=WIDTH, intermediate_size=2 * WIDTH, num_hidden_layers=3,
                        num_attention_heads=HEADS, local_attention=16, global_attn_every_n_layers=2,
                        max_position_embeddings=4 * SEQ, pad_token_id=0, bos_token_id=1, eos_token_id=2,
                        cls_token_id=1, sep_token_id=2), _tokens),
    "bigbird": ("BigBirdForMaskedLM", "BigBirdConfig",
                dict(vocab_size=VOCAB, hidden_size=WIDTH, intermediate_size=2 * WIDTH, num_hidden_layers=LAYERS,
                     num_attention_heads=HEADS, max_position_embeddings=4 * SEQ), _tokens),
    "funnel": ("FunnelForMaskedLM", "FunnelConfig",
               dict(vocab_size=VOCAB, d_model=WIDTH, n_head=HEADS, d_head=16, d_inner=2 * WIDTH, block_sizes=[1, 1]),
               _tokens),
    "megatron_bert": ("MegatronBertForMaskedLM", "MegatronBertConfig",
                      dict(vocab_size=VOCAB, hidden_size=WIDTH, intermediate_size=2 * WIDTH, num_hidden_layers=LAYERS,
                           num_attention_heads=HEADS, max_position_embeddings=4 * SEQ), _tokens),
    "vit_mae": ("ViTMAEForPreTraining", "ViTMAEConfig",
                dict(hidden_size=WIDTH, intermediate_size=2 * WIDTH, num_hidden_layers=LAYERS,
                     num_attention_heads=HEADS, decoder_hidden_size=WIDTH, decoder_intermediate_size=2 * WIDTH,
                     decoder_num_hidden_layers=1, decoder_num_attention_heads=HEADS, image_size=32, patch_size=8),
                _pixels),
    "wav2vec2": ("Wav2Vec2ForCTC", "Wav2Vec2Config",
                 dict(vocab_size=32, hidden_size=WIDTH, intermediate_size=2 * WIDTH, num_hidden_layers=LAYERS,
                      num_attention_heads=HEADS, conv_dim=(32, 32), conv_stride=(5, 2), conv_kernel=(10, 3),
                      num_conv_pos_embeddings=16, num_conv_pos_embedding_groups=4, mask_time_length=2), _audio),
    "convnext": ("ConvNextForImageClassification", "ConvNextConfig",
                 dict(hidden_sizes=[16, 32, 64, 128], depths=[1, 1, 2, 1], num_labels=10), _image),
    "regnet": ("RegNetForImageClassification", "RegNetConfig",
               dict(embedding_size=16, hidden_sizes=[16, 32], depths=[1, 2], groups_width=8, num_labels=10), _image),
    "segformer": ("SegformerForImageClassification", "SegformerConfig",
                  dict(num_encoder_blocks=2, depths=[1, 1], sr_ratios=[2, 1], hidden_sizes=[16, 32],
                       num_attention_heads=[1, 2], num_labels=10, image_size=32), _image),
    "deit": ("DeiTForImageClassification", "DeiTConfig",
             dict(hidden_size=WIDTH, num_hidden_layers=LAYERS, num_attention_heads=HEADS, intermediate_size=2 * WIDTH,
                  image_size=32, patch_size=8, num_labels=10), _image),
    # a third set: architectures neither the zoo nor the sets above cover
    "reformer": ("ReformerModelWithLMHead", "ReformerConfig",
                 dict(vocab_size=VOCAB, hidden_size=WIDTH, num_attention_heads=HEADS,
                      attention_head_size=WIDTH // HEADS, feed_forward_size=2 * WIDTH, attn_layers=["local", "lsh"],
                      axial_pos_shape=[8, SEQ // 8], axial_pos_embds_dim=[WIDTH // 2, WIDTH // 2],
                      max_position_embeddings=SEQ, is_decoder=True, local_attn_chunk_length=16,
                      lsh_attn_chunk_length=16), _tokens),
    "clip": ("CLIPModel", "CLIPConfig",
             dict(text_config=dict(vocab_size=VOCAB, hidden_size=WIDTH, intermediate_size=2 * WIDTH,
                                   num_hidden_layers=LAYERS, num_attention_heads=HEADS, max_position_embeddings=SEQ),
                  vision_config=dict(hidden_size=WIDTH, intermediate_size=2 * WIDTH, num_hidden_layers=LAYERS,
                                     num_attention_heads=HEADS, image_size=32, patch_size=8),
                  projection_dim=32), _text_and_image),
    "xlm_roberta": ("XLMRobertaForMaskedLM", "XLMRobertaConfig", _bert_like(), _tokens),
    "longformer": ("LongformerForMaskedLM", "LongformerConfig", _bert_like(attention_window=16), _tokens),
    "rembert": ("RemBertForMaskedLM", "RemBertConfig", _bert_like(input_embedding_size=32, output_embedding_size=32),
                _tokens),
    "squeezebert": ("SqueezeBertForMaskedLM", "SqueezeBertConfig", _bert_like(embedding_size=WIDTH), _tokens),
    "roformer": ("RoFormerForMaskedLM", "RoFormerConfig", _bert_like(embedding_size=WIDTH), _tokens),
    "canine": ("CanineForSequenceClassification", "CanineConfig",
               dict(hidden_size=WIDTH, num_hidden_layers=LAYERS, num_attention_heads=HEADS, intermediate_size=2 * WIDTH,
                    downsampling_rate=4, max_position_embeddings=4 * SEQ), _classified_tokens),
    "jetmoe": ("JetMoeForCausalLM", "JetMoeConfig",
               dict(vocab_size=VOCAB, hidden_size=WIDTH, num_hidden_layers=LAYERS, num_key_value_heads=KV_HEADS,
                    kv_channels=16, intermediate_size=2 * WIDTH, max_position_embeddings=4 * SEQ, num_local_experts=4,
                    num_experts_per_tok=2), _tokens),
    "phimoe": ("PhimoeForCausalLM", "PhimoeConfig", _llama_like(num_local_experts=4, num_experts_per_tok=2), _tokens),
    "zamba": ("ZambaForCausalLM", "ZambaConfig",
              dict(vocab_size=VOCAB, hidden_size=WIDTH, intermediate_size=2 * WIDTH, num_hidden_layers=12,
                   num_attention_heads=HEADS, num_key_value_heads=HEADS, attention_hidden_size=2 * WIDTH,
                   mamba_d_state=8, mamba_dt_rank=8, max_position_embeddings=4 * SEQ), _tokens),
    "rwkv": ("RwkvForCausalLM", "RwkvConfig",
             dict(vocab_size=VOCAB, hidden_size=WIDTH, num_hidden_layers=LAYERS, attention_hidden_size=WIDTH,
                  intermediate_size=2 * WIDTH, context_length=4 * SEQ), _tokens),
    "biogpt": ("BioGptForCausalLM", "BioGptConfig", _bert_like(), _tokens),
    "xglm": ("XGLMForCausalLM", "XGLMConfig",
             dict(vocab_size=VOCAB, d_model=WIDTH, num_layers=LAYERS, attention_heads=HEADS, ffn_dim=2 * WIDTH,
                  max_position_embeddings=4 * SEQ), _tokens),
    "marian": ("MarianMTModel", "MarianConfig",
               _seq2seq_config(max_position_embeddings=4 * SEQ, decoder_start_token_id=0, pad_token_id=1), _seq2seq),
    "prophetnet": ("ProphetNetForConditionalGeneration", "ProphetNetConfig",
                   dict(vocab_size=VOCAB, hidden_size=WIDTH, num_encoder_layers=LAYERS, num_decoder_layers=LAYERS,
                        num_encoder_attention_heads=HEADS, num_decoder_attention_heads=HEADS,
                        encoder_ffn_dim=2 * WIDTH, decoder_ffn_dim=2 * WIDTH, max_position_embeddings=4 * SEQ,
                        ngram=2), _seq2seq),
    "mobilevit": ("MobileViTForImageClassification", "MobileViTConfig",
                  dict(image_size=32, patch_size=2, hidden_sizes=[32, 48, 64],
                       neck_hidden_sizes=[8, 16, 24, 32, 48, 64, 128], num_labels=10), _image),
    "efficientnet": ("EfficientNetForImageClassification", "EfficientNetConfig",
                     dict(image_size=32, width_coefficient=1.0, depth_coefficient=1.0, hidden_dim=1280,
                          num_labels=10), _image),
    "levit": ("LevitForImageClassification", "LevitConfig",
              dict(image_size=32, hidden_sizes=[32, 48, 64], num_attention_heads=[1, 2, 4], depths=[1, 1, 1],
                   key_dim=[8, 8, 8], num_labels=10), _image),
    "poolformer": ("PoolFormerForImageClassification", "PoolFormerConfig",
                   dict(hidden_sizes=[16, 32, 48, 64], depths=[1, 1, 1, 1], num_labels=10), _image),
    "focalnet": ("FocalNetForImageClassification", "FocalNetConfig",
                 dict(image_size=32, patch_size=4, embed_dim=16, depths=[1, 1, 1, 1], num_labels=10), _image),
    "pvt_v2": ("PvtV2ForImageClassification", "PvtV2Config",
               dict(image_size=32, hidden_sizes=[16, 32, 48, 64], num_attention_heads=[1, 2, 4, 8],
                    depths=[1, 1, 1, 1], num_labels=10), _image),
    "videomae": ("VideoMAEForVideoClassification", "VideoMAEConfig",
                 dict(image_size=32, patch_size=8, num_frames=4, tubelet_size=2, hidden_size=WIDTH,
                      num_hidden_layers=LAYERS, num_attention_heads=HEADS, intermediate_size=2 * WIDTH,
                      num_labels=10), _video),
    "hubert": ("HubertForCTC", "HubertConfig",
               dict(vocab_size=32, hidden_size=WIDTH, num_hidden_layers=LAYERS, num_attention_heads=HEADS,
                    intermediate_size=2 * WIDTH, conv_dim=(32, 32), conv_stride=(5, 2), conv_kernel=(10, 3),
                    num_conv_pos_embeddings=16, num_conv_pos_embedding_groups=4), _audio),
    "patchtst": ("PatchTSTForPrediction", "PatchTSTConfig",
                 dict(num_input_channels=3, context_length=SEQ, prediction_length=SEQ // 4, patch_length=8,
                      patch_stride=8, d_model=WIDTH, num_hidden_layers=LAYERS, num_attention_heads=HEADS,
                      ffn_dim=2 * WIDTH), _time_series),
    # a fourth set: decoders released in transformers 5.x (mixtures of experts, latent attention, hybrids of
    # attention with state-space or convolution layers)
    "deepseek_v3": ("DeepseekV3ForCausalLM", "DeepseekV3Config", _llama_like(**_LATENT_MOE), _tokens),
    "deepseek_v2": ("DeepseekV2ForCausalLM", "DeepseekV2Config", _llama_like(**_LATENT_MOE), _tokens),
    "glm4_moe": ("Glm4MoeForCausalLM", "Glm4MoeConfig",
                 _llama_like(head_dim=16, n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=WIDTH,
                             first_k_dense_replace=1, n_group=1, topk_group=1), _tokens),
    "glm4": ("Glm4ForCausalLM", "Glm4Config", _llama_like(head_dim=16, pad_token_id=0), _tokens),
    "gpt_oss": ("GptOssForCausalLM", "GptOssConfig",
                _llama_like(head_dim=16, num_local_experts=4, num_experts_per_tok=2, sliding_window=32), _tokens),
    "smollm3": ("SmolLM3ForCausalLM", "SmolLM3Config", _llama_like(pad_token_id=0), _tokens),
    "ernie4_5": ("Ernie4_5ForCausalLM", "Ernie4_5Config", _llama_like(head_dim=16), _tokens),
    "ernie4_5_moe": ("Ernie4_5_MoeForCausalLM", "Ernie4_5_MoeConfig",
                     _llama_like(moe_num_experts=4, moe_k=2, moe_intermediate_size=WIDTH), _tokens),
    "hunyuan_dense": ("HunYuanDenseV1ForCausalLM", "HunYuanDenseV1Config", _llama_like(head_dim=16), _tokens),
    "hunyuan_moe": ("HunYuanMoEV1ForCausalLM", "HunYuanMoEV1Config",
                    _llama_like(head_dim=16, num_experts=4, moe_topk=2), _tokens),
    "exaone4": ("Exaone4ForCausalLM", "Exaone4Config", _llama_like(sliding_window=32), _tokens),
    "arcee": ("ArceeForCausalLM", "ArceeConfig", _llama_like(), _tokens),
    "olmo3": ("Olmo3ForCausalLM", "Olmo3Config", _llama_like(sliding_window=32), _tokens),
    "seed_oss": ("SeedOssForCausalLM", "SeedOssConfig", _llama_like(head_dim=16), _tokens),
    "apertus": ("ApertusForCausalLM", "ApertusConfig", _llama_like(), _tokens),
    "dots1": ("Dots1ForCausalLM", "Dots1Config",
              _llama_like(n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=WIDTH,
                          first_k_dense_replace=1, n_group=1, topk_group=1, n_shared_experts=1), _tokens),
    "cohere2": ("Cohere2ForCausalLM", "Cohere2Config", _llama_like(sliding_window=32), _tokens),
    "vaultgemma": ("VaultGemmaForCausalLM", "VaultGemmaConfig", _llama_like(head_dim=16, sliding_window=32),
                   _tokens),
    "flex_olmo": ("FlexOlmoForCausalLM", "FlexOlmoConfig",
                  _llama_like(num_experts=4, num_experts_per_tok=2, pad_token_id=0), _tokens),
    "lfm2": ("Lfm2ForCausalLM", "Lfm2Config", _llama_like(), _tokens),
    "bamba": ("BambaForCausalLM", "BambaConfig",
              _llama_like(mamba_n_heads=8, mamba_d_head=16, mamba_d_state=16, attn_layer_indices=[1]), _tokens),
    "granitemoehybrid": ("GraniteMoeHybridForCausalLM", "GraniteMoeHybridConfig",
                         _llama_like(num_local_experts=4, num_experts_per_tok=2, mamba_n_heads=8, mamba_d_head=16,
                                     mamba_d_state=16, layer_types=["mamba", "attention"]), _tokens),
    "qwen3_next": ("Qwen3NextForCausalLM", "Qwen3NextConfig",
                   _llama_like(head_dim=16, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=WIDTH,
                               shared_expert_intermediate_size=WIDTH, linear_num_key_heads=4,
                               linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=16,
                               layer_types=["linear_attention", "full_attention"]), _tokens),
    "nanochat": ("NanoChatForCausalLM", "NanoChatConfig", _llama_like(), _tokens),
    "jais2": ("Jais2ForCausalLM", "Jais2Config", _llama_like(), _tokens),
    "doge": ("DogeForCausalLM", "DogeConfig", _llama_like(), _tokens),
    # a fifth set: more decoders of transformers 5.25, each config given the sizes of every kind a decoder reads
    # (_ANY_DECODER: it keeps those it knows), or only the common ones where those do not fit it
    "deepseekv4": ("DeepseekV4ForCausalLM", "DeepseekV4Config", _llama_like(), _tokens),
    "glm4moelite": ("Glm4MoeLiteForCausalLM", "Glm4MoeLiteConfig", _llama_like(), _tokens),
    "minimax": ("MiniMaxForCausalLM", "MiniMaxConfig", _llama_like(**_ANY_DECODER), _tokens),
    "minimaxm2": ("MiniMaxM2ForCausalLM", "MiniMaxM2Config", _llama_like(**_ANY_DECODER), _tokens),
    "mistral4": ("Mistral4ForCausalLM", "Mistral4Config", _llama_like(**_ANY_DECODER), _tokens),
    "mimov2flash": ("MiMoV2FlashForCausalLM", "MiMoV2FlashConfig", _llama_like(**_ANY_DECODER), _tokens),
    "minicpm3": ("MiniCPM3ForCausalLM", "MiniCPM3Config", _llama_like(**_ANY_DECODER), _tokens),
    "nemotronh": ("NemotronHForCausalLM", "NemotronHConfig", _llama_like(**_ANY_DECODER), _tokens),
    "olmohybrid": ("OlmoHybridForCausalLM", "OlmoHybridConfig", _llama_like(**_ANY_DECODER), _tokens),
    "lfm3": ("Lfm3ForCausalLM", "Lfm3Config", _llama_like(**_ANY_DECODER), _tokens),
    "hyv3": ("HYV3ForCausalLM", "HYV3Config", _llama_like(**_ANY_DECODER), _tokens),
    "bitnet": ("BitNetForCausalLM", "BitNetConfig", _llama_like(**_ANY_DECODER), _tokens),
    "afmoe": ("AfmoeForCausalLM", "AfmoeConfig", _llama_like(**_ANY_DECODER), _tokens),
    "cohere2moe": ("Cohere2MoeForCausalLM", "Cohere2MoeConfig", _llama_like(**_ANY_DECODER), _tokens),
    "exaonemoe": ("ExaoneMoeForCausalLM", "ExaoneMoeConfig", _llama_like(**_ANY_DECODER), _tokens),
    "granitemoeshared": ("GraniteMoeSharedForCausalLM", "GraniteMoeSharedConfig", _llama_like(**_ANY_DECODER), _tokens),
    "granitemoeswa": ("GraniteMoeSWAForCausalLM", "GraniteMoeSWAConfig", _llama_like(**_ANY_DECODER), _tokens),
    "graniteswa": ("GraniteSWAForCausalLM", "GraniteSWAConfig", _llama_like(**_ANY_DECODER), _tokens),
    "diffllama": ("DiffLlamaForCausalLM", "DiffLlamaConfig", _llama_like(**_ANY_DECODER), _tokens),
    "laguna": ("LagunaForCausalLM", "LagunaConfig", _llama_like(**_ANY_DECODER), _tokens),
    "laramini": ("LaraMiniForCausalLM", "LaraMiniConfig", _llama_like(**_ANY_DECODER), _tokens),
    "zaya": ("ZayaForCausalLM", "ZayaConfig", _llama_like(), _tokens),
    "solaropen": ("SolarOpenForCausalLM", "SolarOpenConfig", _llama_like(**_ANY_DECODER), _tokens),
    "ergo": ("ErgoForCausalLM", "ErgoConfig", _llama_like(**_ANY_DECODER), _tokens),
    "dory": ("DoryForCausalLM", "DoryConfig", _llama_like(**_ANY_DECODER), _tokens),
    "flint": ("FlintForCausalLM", "FlintConfig", _llama_like(**_ANY_DECODER), _tokens),
    "kolibri1": ("Kolibri1ForCausalLM", "Kolibri1Config", _llama_like(**_ANY_DECODER), _tokens),
    "hrmtext": ("HrmTextForCausalLM", "HrmTextConfig", _llama_like(**_ANY_DECODER), _tokens),
    "mellum": ("MellumForCausalLM", "MellumConfig", _llama_like(**_ANY_DECODER), _tokens),
    "minicpm5moe": ("MiniCPM5MoeForCausalLM", "MiniCPM5MoeConfig", _llama_like(**_ANY_DECODER), _tokens),
    "cwm": ("CwmForCausalLM", "CwmConfig", _llama_like(**_ANY_DECODER), _tokens),
    "ministral3": ("Ministral3ForCausalLM", "Ministral3Config", _llama_like(**_ANY_DECODER), _tokens),
}


# ---- configurations users bring: task heads, PEFT methods, training set-ups ------------------------------


def _padded(batch_size: int) -> tuple[torch.Tensor, torch.Tensor, torch.Generator]:
    """Token ids (pad id 0) whose rows end in padding of different lengths, and their attention mask."""
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(3, VOCAB, (batch_size, SEQ), generator=g)
    mask = torch.ones_like(ids)
    for i in range(batch_size):
        kept = SEQ - (i * SEQ) // (2 * batch_size)
        ids[i, kept:], mask[i, kept:] = 0, 0
    return ids, mask, g


def _sequence_labels(batch_size: int) -> dict:
    ids, mask, g = _padded(batch_size)
    return {"input_ids": ids, "attention_mask": mask, "labels": torch.randint(0, 3, (batch_size,), generator=g)}


def _token_labels(batch_size: int) -> dict:
    ids, mask, g = _padded(batch_size)
    labels = torch.randint(0, 3, ids.shape, generator=g)
    labels[mask == 0] = -100
    return {"input_ids": ids, "attention_mask": mask, "labels": labels}


def _answer_spans(batch_size: int) -> dict:
    ids, mask, g = _padded(batch_size)
    start = torch.randint(0, SEQ // 2, (batch_size,), generator=g)
    return {"input_ids": ids, "attention_mask": mask, "start_positions": start, "end_positions": start + 3}


def _choices(batch_size: int) -> dict:
    g = torch.Generator().manual_seed(0)
    return {"input_ids": torch.randint(3, VOCAB, (batch_size, 3, SEQ // 2), generator=g),
            "labels": torch.randint(0, 3, (batch_size,), generator=g)}


def _ending_in(eos: int):
    def batch(batch_size: int) -> dict:
        g = torch.Generator().manual_seed(0)
        ids = torch.randint(3, VOCAB, (batch_size, SEQ), generator=g)
        ids[:, -1] = eos  # one end-of-sequence token per row, where the head pools
        return {"input_ids": ids, "labels": torch.randint(0, 3, (batch_size,), generator=g)}
    return batch


def _mel_features(batch_size: int) -> dict:
    g = torch.Generator().manual_seed(0)
    return {"input_features": torch.randn(batch_size, 80, 128, generator=g),
            "labels": torch.randint(0, 3, (batch_size,), generator=g)}


def _masked_patches(batch_size: int) -> dict:
    g = torch.Generator().manual_seed(0)
    return {"pixel_values": torch.randn(batch_size, 3, 32, 32, generator=g),
            "bool_masked_pos": torch.rand(batch_size, 16, generator=g) < 0.4}


def _one_odd_row(batch_size: int) -> dict:
    ids = torch.randint(3, VOCAB, (1, 37), generator=torch.Generator().manual_seed(0))
    return {"input_ids": ids, "labels": ids.clone()}


def _packed(batch_size: int) -> dict:
    """Two sequences packed in each row: positions restart halfway."""
    batch = _tokens(batch_size)
    half = SEQ // 2
    batch["position_ids"] = torch.cat([torch.arange(half), torch.arange(SEQ - half)]).expand(batch_size, -1)
    return batch


def _channels_last_images(batch_size: int) -> dict:
    batch = _image(batch_size)
    batch["pixel_values"] = batch["pixel_values"].contiguous(memory_format=torch.channels_last)
    return batch


def _peft(config_class: str, **settings):
    def adapt(model):
        import peft

        return peft.get_peft_model(model, getattr(peft, config_class)(**settings))
    return adapt


def _first_layer_frozen(model):
    for p in [*model.model.embed_tokens.parameters(), *model.model.layers[0].parameters()]:
        p.requires_grad_(False)
    return model


def _channels_last(model):
    return model.to(memory_format=torch.channels_last)


def _vocabulary_grown(model):
    model.resize_token_embeddings(VOCAB + 7)
    return model


_LABELLED = dict(pad_token_id=0, num_labels=3)
_RESNET = dict(embedding_size=16, hidden_sizes=[16, 32, 64, 64], depths=[1, 1, 1, 1], num_labels=10)
_VIT = dict(hidden_size=WIDTH, num_hidden_layers=LAYERS, num_attention_heads=HEADS, intermediate_size=2 * WIDTH,
            image_size=32, patch_size=8, encoder_stride=8)

# name -> (model class, config class, config keys, batch, what is done to the model after it is built)
CONFIGURATIONS = {
    # task heads, on padded batches where the head reads the padding
    "llama_seqcls": ("LlamaForSequenceClassification", "LlamaConfig", _llama_like(**_LABELLED), _sequence_labels,
                     None),
    "qwen2_seqcls": ("Qwen2ForSequenceClassification", "Qwen2Config", _llama_like(**_LABELLED), _sequence_labels,
                     None),
    "mistral_seqcls": ("MistralForSequenceClassification", "MistralConfig",
                       _llama_like(sliding_window=32, **_LABELLED), _sequence_labels, None),
    "gemma2_seqcls": ("Gemma2ForSequenceClassification", "Gemma2Config", _llama_like(head_dim=16, **_LABELLED),
                      _sequence_labels, None),
    "gpt2_seqcls": ("GPT2ForSequenceClassification", "GPT2Config", _gpt_like(**_LABELLED), _sequence_labels, None),
    "qwen2_tokcls": ("Qwen2ForTokenClassification", "Qwen2Config", _llama_like(**_LABELLED), _token_labels, None),
    "gpt_neox_tokcls": ("GPTNeoXForTokenClassification", "GPTNeoXConfig",
                        dict(vocab_size=VOCAB, hidden_size=WIDTH, num_hidden_layers=LAYERS, num_attention_heads=HEADS,
                             intermediate_size=2 * WIDTH, num_labels=3), _token_labels, None),
    "llama_qa": ("LlamaForQuestionAnswering", "LlamaConfig", _llama_like(**_LABELLED), _answer_spans, None),
    "bert_tokcls": ("BertForTokenClassification", "BertConfig", _bert_like(num_labels=3), _token_labels, None),
    "deberta_v2_tokcls": ("DebertaV2ForTokenClassification", "DebertaV2Config", _bert_like(num_labels=3),
                          _token_labels, None),
    "modernbert_tokcls": ("ModernBertForTokenClassification", "ModernBertConfig", _bert_like(**_LABELLED),
                          _token_labels, None),
    "roberta_qa": ("RobertaForQuestionAnswering", "RobertaConfig", _bert_like(pad_token_id=1), _answer_spans, None),
    "electra_qa": ("ElectraForQuestionAnswering", "ElectraConfig", _bert_like(embedding_size=WIDTH), _answer_spans,
                   None),
    "roberta_mc": ("RobertaForMultipleChoice", "RobertaConfig", _bert_like(), _choices, None),
    "bart_seqcls": ("BartForSequenceClassification", "BartConfig",
                    _seq2seq_config(num_labels=3, max_position_embeddings=4 * SEQ), _ending_in(2), None),
    "whisper_audiocls": ("WhisperForAudioClassification", "WhisperConfig",
                         _seq2seq_config(num_labels=3, max_source_positions=64, num_mel_bins=80), _mel_features, None),
    "vit_mim": ("ViTForMaskedImageModeling", "ViTConfig", _VIT, _masked_patches, None),
    # every layer's hidden states (and attention weights) in the output, as distillation losses read them
    "llama_hidden_states": ("LlamaForCausalLM", "LlamaConfig", _llama_like(output_hidden_states=True), _tokens, None),
    "llama_attentions": ("LlamaForCausalLM", "LlamaConfig",
                         _llama_like(output_attentions=True, attn_implementation="eager"), _tokens, None),
    "bert_hidden_states": ("BertForMaskedLM", "BertConfig",
                           _bert_like(output_hidden_states=True, output_attentions=True), _tokens, None),
    "gpt2_hidden_states": ("GPT2LMHeadModel", "GPT2Config", _gpt_like(output_hidden_states=True), _tokens, None),
    # PEFT methods
    "lora_qwen2": ("Qwen2ForCausalLM", "Qwen2Config", _llama_like(), _tokens,
                   _peft("LoraConfig", r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "down_proj"])),
    "lora_mistral": ("MistralForCausalLM", "MistralConfig", _llama_like(sliding_window=32), _tokens,
                     _peft("LoraConfig", r=4, target_modules="all-linear")),
    "lora_gpt2": ("GPT2LMHeadModel", "GPT2Config", _gpt_like(), _tokens,
                  _peft("LoraConfig", r=4, target_modules=["c_attn"], fan_in_fan_out=True)),
    "lora_bert_seqcls": ("BertForSequenceClassification", "BertConfig", _bert_like(num_labels=3), _classified_tokens,
                         _peft("LoraConfig", r=4, task_type="SEQ_CLS", target_modules=["query", "value"])),
    "dora_llama": ("LlamaForCausalLM", "LlamaConfig", _llama_like(), _tokens,
                   _peft("LoraConfig", r=4, use_dora=True, target_modules=["q_proj", "v_proj"])),
    "ia3_llama": ("LlamaForCausalLM", "LlamaConfig", _llama_like(), _tokens,
                  _peft("IA3Config", target_modules=["k_proj", "v_proj", "down_proj"],
                        feedforward_modules=["down_proj"])),
    "prompt_tuning_llama": ("LlamaForCausalLM", "LlamaConfig", _llama_like(), _tokens,
                            _peft("PromptTuningConfig", task_type="CAUSAL_LM", num_virtual_tokens=8)),
    "prefix_tuning_llama": ("LlamaForCausalLM", "LlamaConfig", _llama_like(), _tokens,
                            _peft("PrefixTuningConfig", task_type="CAUSAL_LM", num_virtual_tokens=8)),
    # training set-ups
    "llama_one_odd_row": ("LlamaForCausalLM", "LlamaConfig", _llama_like(), _one_odd_row, None),
    "llama_first_layer_frozen": ("LlamaForCausalLM", "LlamaConfig", _llama_like(), _tokens, _first_layer_frozen),
    "qwen2_packed": ("Qwen2ForCausalLM", "Qwen2Config", _llama_like(), _packed, None),
    "gpt2_vocabulary_grown": ("GPT2LMHeadModel", "GPT2Config", _gpt_like(), _tokens, _vocabulary_grown),
    "resnet_channels_last": ("ResNetForImageClassification", "ResNetConfig", _RESNET, _channels_last_images,
                             _channels_last),
}


def build(name: str, batch_size: int = BATCH):
    """A held-out workload factory (`bench.heldout:build` with `name`), for build_workload and `regen profile`."""
    import transformers

    if name in CONFIGURATIONS:
        model_class, config_class, config, batch, adapt = CONFIGURATIONS[name]
    else:
        (model_class, config_class, config, batch), adapt = HELD_OUT[name], None
    torch.manual_seed(0)
    model = getattr(transformers, model_class)(getattr(transformers, config_class)(**config))
    return (model if adapt is None else adapt(model)), batch(batch_size)


def _workload(name: str, autocast: str | None) -> Workload:
    from regen.workloads import build_workload

    return build_workload("bench.heldout:build", batch_size=BATCH, args={"name": name}, autocast=autocast)


def _peak_increase(w: Workload) -> int:
    training_step(w)
    w.model.zero_grad(set_to_none=True)
    measured = measure_memory(lambda: training_step(w))
    w.model.zero_grad(set_to_none=True)
    return measured.peak_increase_bytes


def _checkpointing_increase(name: str, autocast: str | None) -> int | None:
    """The peak increase of the architecture's step under the checkpointing its users turn on (None: no
    repeated blocks to checkpoint, or the step fails under it: Hugging Face's checkpointing turns the cache
    off, which PEFT's prefix tuning needs)."""
    from regen.zoo import enable_checkpointing

    peer = _workload(name, autocast)
    try:
        enable_checkpointing(peer.model)
        return _peak_increase(peer)
    except WorkloadError as exc:
        print(f"{name}: no checkpointing to compare with ({' '.join(str(exc).split())[:160]})", file=sys.stderr)
        return None


def _row(name: str, label: str, counts: str, report, cap_bytes: int) -> str:
    if not report.differences:
        result = "exact"
    elif not report.conclusive:  # regen.check: two unplanned runs differ as well
        result = "cannot compare: the unplanned model does not reproduce itself (" + report.unreproducible[0] + ")"
    else:
        result = "DIFFERS: " + ", ".join(report.differences[:3])
    return (f"| {name} | {label} | {counts} | {report.planned_steps} | {report.planned_peak_bytes / cap_bytes:.3f} | "
            f"{result} |")


def check_dynamic_rows(name: str, autocast: str | None, why: str) -> list[str]:
    """Dynamic mode (for a model no plan covers, or with --dynamic for any) at checkpointing's peak increase (or
    half the unplanned one) over its parameters and buffers, against unplanned steps; `why` labels the row."""
    from regen.check import check_dynamic
    from regen.runtime.dynamic.cap_memory import model_storages

    w = _workload(name, autocast)
    start = sum(model_storages(w.model).values())  # dynamic mode's start: the parameters and buffers
    increase = _checkpointing_increase(name, autocast)
    at = "checkpointing's peak"
    if increase is None:
        increase, at = _peak_increase(w) // 2, "half the unplanned increase"
    cap = start + increase
    report = check_dynamic(lambda: _workload(name, autocast), cap, timed_steps=1, compared_steps=STEPS)
    return [_row(name, f"dynamic mode @ {at} ({why})", "-", report, cap)]


def check(name: str, autocast: str | None) -> list[str]:
    """One architecture's rows."""
    from regen.check import check_plan
    from regen.planner.solve import solve_within_reach
    from regen.profiler import profile_workload

    try:
        profile = profile_workload(_workload(name, autocast), device="cpu", repeats=1, warmup_steps=1, progress=None)
    except WorkloadError as exc:
        if "op sequence changed" not in str(exc):
            raise
        return check_dynamic_rows(name, autocast, "no plan: its ops change from step to step")
    increase = _checkpointing_increase(name, autocast)
    if increase is not None:
        cap, at = profile.memory_at_start_bytes + increase, "checkpointing's peak"
    else:
        cap, at = int(0.7 * profile.peak_bytes), "70% of the peak"
    rows = []
    for strategy in ("recompute", "hybrid"):
        options = {"link_ratio": LINK_RATIO} if strategy == "hybrid" else {}
        plan = solve_within_reach(profile, cap, strategy, time_limit_s=10, rel_gap=0.2, **options)
        try:
            report = check_plan(lambda: _workload(name, autocast), plan, timed_steps=1, compared_steps=STEPS)
        except WorkloadError as exc:  # the profile's steps matched by chance (a random layer drop): no plan fits
            if not isinstance(exc.__cause__, PlanMismatchError):
                raise
            return check_dynamic_rows(name, autocast, "no plan: its ops change from step to step (the check's steps "
                                                      "left the profiled one)")
        counts = plan.action_counts()
        rows.append(_row(name, f"{strategy} @ {at if plan.memory_cap_bytes == cap else 'its smallest cap'}",
                         f"{counts['keep']}/{counts['swap']}/{counts['recompute']}, {len(plan.regions)} regions",
                         report, plan.memory_cap_bytes))
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", nargs="+", choices=[*HELD_OUT, *CONFIGURATIONS], metavar="NAME",
                        help="architectures of HELD_OUT or configurations of CONFIGURATIONS (default: every "
                             "architecture)")
    parser.add_argument("--configurations", action="store_true",
                        help="every configuration of CONFIGURATIONS: task heads on padded batches, PEFT methods, "
                             "training set-ups")
    parser.add_argument("--autocast", choices=["bf16", "fp16"], help="the forward under torch.autocast")
    parser.add_argument("--dynamic", action="store_true",
                        help="dynamic mode instead of plans, at the same cap, for every architecture")
    args = parser.parse_args(argv)
    names = args.models or (list(CONFIGURATIONS) if args.configurations else list(HELD_OUT))
    warnings.simplefilter("ignore")
    torch.set_num_threads(1)
    print("| architecture | plan | keep/swap/recompute | planned steps | allocator peak / cap | result |")
    print("| --- | --- | --- | --- | --- | --- |")
    failed = 0
    for name in names:
        try:
            rows = (check_dynamic_rows(name, args.autocast, "--dynamic") if args.dynamic
                    else check(name, args.autocast))
        except Exception as exc:  # noqa: BLE001 - a row per architecture, whatever went wrong
            failed += 1
            rows = [f"| {name} | - | - | - | - | FAILED: {type(exc).__name__}: {' '.join(str(exc).split())[:200]} |"]
            traceback.print_exc(file=sys.stderr)
        failed += sum("DIFFERS" in r or "cannot compare" in r for r in rows)
        print("\n".join(rows), flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
