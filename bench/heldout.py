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
other), and the planned step's allocator peak against the plan's cap.

    .venv/bin/python bench/heldout.py [--models gemma3 cohere ...] [--autocast bf16]

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

from regen.errors import WorkloadError  # noqa: E402
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


def _llama_like(**more) -> dict:
    return dict(vocab_size=VOCAB, hidden_size=WIDTH, intermediate_size=2 * WIDTH, num_hidden_layers=LAYERS,
                num_attention_heads=HEADS, num_key_value_heads=KV_HEADS, max_position_embeddings=4 * SEQ, **more)


def _gpt_like(**more) -> dict:
    return dict(vocab_size=VOCAB, n_embd=WIDTH, n_layer=LAYERS, n_head=HEADS, n_positions=4 * SEQ, **more)


def _seq2seq_config(**more) -> dict:
    return dict(vocab_size=VOCAB, d_model=WIDTH, encoder_layers=LAYERS, decoder_layers=LAYERS,
                encoder_attention_heads=HEADS, decoder_attention_heads=HEADS, encoder_ffn_dim=2 * WIDTH,
                decoder_ffn_dim=2 * WIDTH, **more)


# name -> (model class, config class, config keys, batch)
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
}


def build(name: str, batch_size: int = BATCH):
    """A held-out workload factory (`bench.heldout:build` with `name`), for build_workload and `regen profile`."""
    import transformers

    model_class, config_class, config, batch = HELD_OUT[name]
    torch.manual_seed(0)
    model = getattr(transformers, model_class)(getattr(transformers, config_class)(**config))
    return model, batch(batch_size)


def _workload(name: str, autocast: str | None) -> Workload:
    from regen.workloads import build_workload

    return build_workload("bench.heldout:build", batch_size=BATCH, args={"name": name}, autocast=autocast)


def _peak_increase(w: Workload) -> int:
    training_step(w)
    w.model.zero_grad(set_to_none=True)
    measured = measure_memory(lambda: training_step(w))
    w.model.zero_grad(set_to_none=True)
    return measured.peak_increase_bytes


def check(name: str, autocast: str | None) -> list[str]:
    """One architecture's rows."""
    from regen.check import check_plan
    from regen.planner.solve import solve_within_reach
    from regen.profiler import profile_workload
    from regen.zoo import enable_checkpointing

    profile = profile_workload(_workload(name, autocast), device="cpu", repeats=1, warmup_steps=1, progress=None)
    peer = _workload(name, autocast)
    try:
        enable_checkpointing(peer.model)
        cap, at = profile.memory_at_start_bytes + _peak_increase(peer), "checkpointing's peak"
    except WorkloadError:  # no repeated blocks to checkpoint
        cap, at = int(0.7 * profile.peak_bytes), "70% of the peak"
    rows = []
    for strategy in ("recompute", "hybrid"):
        options = {"link_ratio": LINK_RATIO} if strategy == "hybrid" else {}
        plan = solve_within_reach(profile, cap, strategy, time_limit_s=10, rel_gap=0.2, **options)
        report = check_plan(lambda: _workload(name, autocast), plan, timed_steps=1, compared_steps=STEPS)
        counts = plan.action_counts()
        rows.append(f"| {name} | {strategy} @ {at if plan.memory_cap_bytes == cap else 'its smallest cap'} | "
                    f"{counts['keep']}/{counts['swap']}/{counts['recompute']}, {len(plan.regions)} regions | "
                    f"{report.planned_steps} | {report.planned_peak_bytes / plan.memory_cap_bytes:.3f} | "
                    f"{'exact' if not report.differences else 'DIFFERS: ' + ', '.join(report.differences[:3])} |")
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", nargs="+", default=list(HELD_OUT), choices=list(HELD_OUT), metavar="NAME")
    parser.add_argument("--autocast", choices=["bf16", "fp16"], help="the forward under torch.autocast")
    args = parser.parse_args(argv)
    warnings.simplefilter("ignore")
    torch.set_num_threads(1)
    print("| architecture | plan | keep/swap/recompute | planned steps | allocator peak / cap | result |")
    print("| --- | --- | --- | --- | --- | --- |")
    failed = 0
    for name in args.models:
        try:
            rows = check(name, args.autocast)
        except Exception as exc:  # noqa: BLE001 - a row per architecture, whatever went wrong
            failed += 1
            rows = [f"| {name} | - | - | - | - | FAILED: {type(exc).__name__}: {' '.join(str(exc).split())[:200]} |"]
            traceback.print_exc(file=sys.stderr)
        failed += sum("DIFFERS" in r for r in rows)
        print("\n".join(rows), flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
