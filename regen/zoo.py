"""The architecture zoo: Hugging Face models as users build them, from tiny configs, defaults as shipped.

Each entry builds a real `transformers` model from its config class with only sizes set (layers, width,
heads, vocabulary, sequence or image size): `use_cache`, the attention implementation, dropout and every
other default stay as the library ships them. They are workloads (regen.workloads):

    regen profile --model regen.zoo:mistral --batch-size 2 -o mistral.profile.yaml
    regen profile --model regen.zoo:t5 --arg size=bench -o t5.profile.yaml

`size="tiny"` (the default: 2 layers, width 64, short sequences) is what the conformance tests run;
`size="bench"` (4 layers, width 192) is what bench/zoo.py runs, `size="gpu"` (8 layers, width 1,024, sequences of
1,024) what `bench/gpu_check.py --zoo` runs. `ZOO` maps every name to its factory,
`FAMILIES` groups them the way users train them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import torch

from regen.errors import WorkloadError

DEFAULT_SEED = 0


@dataclass(frozen=True)
class Size:
    """The sizes one zoo entry is built at."""

    layers: int
    width: int
    heads: int
    kv_heads: int
    seq_len: int
    vocab: int
    image: int  # image side in pixels (vision models)
    audio_frames: int  # mel frames (Whisper)


SIZES = {
    "tiny": Size(layers=2, width=64, heads=4, kv_heads=2, seq_len=64, vocab=256, image=32, audio_frames=64),
    "bench": Size(layers=4, width=192, heads=6, kv_heads=2, seq_len=128, vocab=2048, image=64, audio_frames=256),
    # a step of tens of milliseconds on a data-centre GPU (bench/gpu_check.py --zoo)
    "gpu": Size(layers=8, width=1024, heads=16, kv_heads=4, seq_len=1024, vocab=32000, image=224, audio_frames=3000),
}


def _transformers():
    try:
        import transformers
    except ImportError:
        raise WorkloadError("the zoo needs Hugging Face transformers: pip install 'regen[hf]'") from None
    return transformers


def _size(size: str) -> Size:
    if size not in SIZES:
        raise WorkloadError(f"zoo size {size!r}: use one of {', '.join(SIZES)}")
    return SIZES[size]


def _generator(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _tokens(s: Size, batch_size: int, seed: int, seq_len: int | None = None) -> dict:
    """A causal or masked LM's batch: random tokens, the labels the inputs."""
    ids = torch.randint(0, s.vocab, (batch_size, seq_len or s.seq_len), generator=_generator(seed))
    return {"input_ids": ids, "labels": ids.clone()}


def _build(model_class: str, config_class: str, config: dict) -> torch.nn.Module:
    tf = _transformers()
    return getattr(tf, model_class)(getattr(tf, config_class)(**config))


def _decoder(model_class: str, config_class: str, size: str, batch_size: int, seed: int,
             config: Callable[[Size], dict]):
    s = _size(size)
    torch.manual_seed(seed)
    model = _build(model_class, config_class, config(s))
    return model, _tokens(s, batch_size, seed)


def _llama_like(s: Size, **more) -> dict:
    """The config keys Llama's descendants share."""
    return dict(vocab_size=s.vocab, hidden_size=s.width, intermediate_size=2 * s.width, num_hidden_layers=s.layers,
                num_attention_heads=s.heads, num_key_value_heads=s.kv_heads, max_position_embeddings=4 * s.seq_len,
                **more)


# ---- decoders ----------------------------------------------------------------------------------


def llama(batch_size: int = 2, size: str = "tiny", seed: int = DEFAULT_SEED):
    return _decoder("LlamaForCausalLM", "LlamaConfig", size, batch_size, seed, _llama_like)


def mistral(batch_size: int = 2, size: str = "tiny", seed: int = DEFAULT_SEED):
    """A sliding window of half the sequence, so that the window masks real positions."""
    return _decoder("MistralForCausalLM", "MistralConfig", size, batch_size, seed,
                    lambda s: _llama_like(s, sliding_window=s.seq_len // 2))


def qwen2(batch_size: int = 2, size: str = "tiny", seed: int = DEFAULT_SEED):
    return _decoder("Qwen2ForCausalLM", "Qwen2Config", size, batch_size, seed, _llama_like)


def qwen3(batch_size: int = 2, size: str = "tiny", seed: int = DEFAULT_SEED):
    return _decoder("Qwen3ForCausalLM", "Qwen3Config", size, batch_size, seed,
                    lambda s: _llama_like(s, head_dim=s.width // s.heads))


def gemma2(batch_size: int = 2, size: str = "tiny", seed: int = DEFAULT_SEED):
    return _decoder("Gemma2ForCausalLM", "Gemma2Config", size, batch_size, seed,
                    lambda s: _llama_like(s, head_dim=s.width // s.heads, sliding_window=s.seq_len // 2))


def phi3(batch_size: int = 2, size: str = "tiny", seed: int = DEFAULT_SEED):
    """Its padding token (32000 by default) inside the small vocabulary."""
    return _decoder("Phi3ForCausalLM", "Phi3Config", size, batch_size, seed,
                    lambda s: _llama_like(s, pad_token_id=0))


def olmo2(batch_size: int = 2, size: str = "tiny", seed: int = DEFAULT_SEED):
    return _decoder("Olmo2ForCausalLM", "Olmo2Config", size, batch_size, seed, _llama_like)


def gpt_neox(batch_size: int = 2, size: str = "tiny", seed: int = DEFAULT_SEED):
    return _decoder("GPTNeoXForCausalLM", "GPTNeoXConfig", size, batch_size, seed,
                    lambda s: dict(vocab_size=s.vocab, hidden_size=s.width, intermediate_size=4 * s.width,
                                   num_hidden_layers=s.layers, num_attention_heads=s.heads,
                                   max_position_embeddings=4 * s.seq_len))


def opt(batch_size: int = 2, size: str = "tiny", seed: int = DEFAULT_SEED):
    return _decoder("OPTForCausalLM", "OPTConfig", size, batch_size, seed,
                    lambda s: dict(vocab_size=s.vocab, hidden_size=s.width, ffn_dim=4 * s.width,
                                   word_embed_proj_dim=s.width, num_hidden_layers=s.layers,
                                   num_attention_heads=s.heads, max_position_embeddings=4 * s.seq_len))


def falcon(batch_size: int = 2, size: str = "tiny", seed: int = DEFAULT_SEED):
    return _decoder("FalconForCausalLM", "FalconConfig", size, batch_size, seed,
                    lambda s: dict(vocab_size=s.vocab, hidden_size=s.width, num_hidden_layers=s.layers,
                                   num_attention_heads=s.heads))


def bloom(batch_size: int = 2, size: str = "tiny", seed: int = DEFAULT_SEED):
    return _decoder("BloomForCausalLM", "BloomConfig", size, batch_size, seed,
                    lambda s: dict(vocab_size=s.vocab, hidden_size=s.width, n_layer=s.layers, n_head=s.heads))


def gpt2(batch_size: int = 2, size: str = "tiny", seed: int = DEFAULT_SEED):
    return _decoder("GPT2LMHeadModel", "GPT2Config", size, batch_size, seed,
                    lambda s: dict(vocab_size=s.vocab, n_embd=s.width, n_layer=s.layers, n_head=s.heads,
                                   n_positions=4 * s.seq_len))


# ---- mixture of experts ------------------------------------------------------------------------


def mixtral(batch_size: int = 2, size: str = "tiny", seed: int = DEFAULT_SEED):
    return _decoder("MixtralForCausalLM", "MixtralConfig", size, batch_size, seed,
                    lambda s: _llama_like(s, num_local_experts=4, num_experts_per_tok=2))


# ---- encoders ----------------------------------------------------------------------------------


def _encoder_config(s: Size) -> dict:
    return dict(vocab_size=s.vocab, hidden_size=s.width, num_hidden_layers=s.layers, num_attention_heads=s.heads,
                intermediate_size=4 * s.width, max_position_embeddings=4 * s.seq_len)


def bert(batch_size: int = 2, size: str = "tiny", seed: int = DEFAULT_SEED):
    return _decoder("BertForMaskedLM", "BertConfig", size, batch_size, seed, _encoder_config)


def roberta(batch_size: int = 2, size: str = "tiny", seed: int = DEFAULT_SEED):
    return _decoder("RobertaForMaskedLM", "RobertaConfig", size, batch_size, seed, _encoder_config)


def deberta_v2(batch_size: int = 2, size: str = "tiny", seed: int = DEFAULT_SEED):
    return _decoder("DebertaV2ForMaskedLM", "DebertaV2Config", size, batch_size, seed, _encoder_config)


def electra(batch_size: int = 2, size: str = "tiny", seed: int = DEFAULT_SEED):
    return _decoder("ElectraForMaskedLM", "ElectraConfig", size, batch_size, seed,
                    lambda s: dict(_encoder_config(s), embedding_size=s.width))


# ---- encoder-decoders --------------------------------------------------------------------------


def _seq2seq_batch(s: Size, batch_size: int, seed: int) -> dict:
    g = _generator(seed)
    return {"input_ids": torch.randint(0, s.vocab, (batch_size, s.seq_len), generator=g),
            "labels": torch.randint(0, s.vocab, (batch_size, s.seq_len // 2), generator=g)}


def t5(batch_size: int = 2, size: str = "tiny", seed: int = DEFAULT_SEED):
    s = _size(size)
    torch.manual_seed(seed)
    model = _build("T5ForConditionalGeneration", "T5Config",
                   dict(vocab_size=s.vocab, d_model=s.width, d_kv=s.width // s.heads, d_ff=4 * s.width,
                        num_layers=s.layers, num_heads=s.heads, decoder_start_token_id=0))
    return model, _seq2seq_batch(s, batch_size, seed)


def bart(batch_size: int = 2, size: str = "tiny", seed: int = DEFAULT_SEED):
    s = _size(size)
    torch.manual_seed(seed)
    model = _build("BartForConditionalGeneration", "BartConfig",
                   dict(vocab_size=s.vocab, d_model=s.width, encoder_layers=s.layers, decoder_layers=s.layers,
                        encoder_attention_heads=s.heads, decoder_attention_heads=s.heads,
                        encoder_ffn_dim=4 * s.width, decoder_ffn_dim=4 * s.width,
                        max_position_embeddings=4 * s.seq_len))
    return model, _seq2seq_batch(s, batch_size, seed)


def whisper(batch_size: int = 2, size: str = "tiny", seed: int = DEFAULT_SEED):
    s = _size(size)
    torch.manual_seed(seed)
    mel_bins = 16
    model = _build("WhisperForConditionalGeneration", "WhisperConfig",
                   dict(vocab_size=s.vocab, d_model=s.width, encoder_layers=s.layers, decoder_layers=s.layers,
                        encoder_attention_heads=s.heads, decoder_attention_heads=s.heads,
                        encoder_ffn_dim=4 * s.width, decoder_ffn_dim=4 * s.width, num_mel_bins=mel_bins,
                        max_source_positions=s.audio_frames // 2, max_target_positions=4 * s.seq_len,
                        decoder_start_token_id=0, pad_token_id=0, bos_token_id=0, eos_token_id=0))
    g = _generator(seed)
    features = torch.randn(batch_size, mel_bins, s.audio_frames, generator=g)
    labels = torch.randint(1, s.vocab, (batch_size, s.seq_len // 2), generator=g)
    return model, {"input_features": features, "labels": labels}


# ---- vision ------------------------------------------------------------------------------------


def _images(s: Size, batch_size: int, seed: int, num_labels: int = 10) -> dict:
    g = _generator(seed)
    return {"pixel_values": torch.randn(batch_size, 3, s.image, s.image, generator=g),
            "labels": torch.randint(0, num_labels, (batch_size,), generator=g)}


def vit(batch_size: int = 2, size: str = "tiny", seed: int = DEFAULT_SEED):
    s = _size(size)
    torch.manual_seed(seed)
    model = _build("ViTForImageClassification", "ViTConfig",
                   dict(hidden_size=s.width, num_hidden_layers=s.layers, num_attention_heads=s.heads,
                        intermediate_size=4 * s.width, image_size=s.image, patch_size=4, num_labels=10))
    return model, _images(s, batch_size, seed)


def swin(batch_size: int = 2, size: str = "tiny", seed: int = DEFAULT_SEED):
    s = _size(size)
    torch.manual_seed(seed)
    model = _build("SwinForImageClassification", "SwinConfig",
                   dict(image_size=s.image, patch_size=2, embed_dim=s.width // 2, depths=[1] * s.layers,
                        num_heads=[2 * 2 ** i for i in range(s.layers)], window_size=4, num_labels=10))
    return model, _images(s, batch_size, seed)


def convnext(batch_size: int = 2, size: str = "tiny", seed: int = DEFAULT_SEED):
    s = _size(size)
    torch.manual_seed(seed)
    model = _build("ConvNextForImageClassification", "ConvNextConfig",
                   dict(image_size=s.image, patch_size=2, hidden_sizes=[s.width // 2 * 2 ** i for i in range(s.layers)],
                        depths=[2] * s.layers, num_stages=s.layers, num_labels=10))
    return model, _images(s, batch_size, seed)


# ---- state space -------------------------------------------------------------------------------


def mamba(batch_size: int = 2, size: str = "tiny", seed: int = DEFAULT_SEED):
    """Mamba's slow path (no CUDA kernels on a CPU) loops over the sequence, some ops per position: a
    sequence a quarter as long."""
    s = _size(size)
    torch.manual_seed(seed)
    model = _build("MambaForCausalLM", "MambaConfig",
                   dict(vocab_size=s.vocab, hidden_size=s.width, num_hidden_layers=s.layers, state_size=8))
    return model, _tokens(s, batch_size, seed, seq_len=s.seq_len // 4)


FAMILIES: dict[str, list[Callable[..., Any]]] = {
    "decoder": [llama, mistral, qwen2, qwen3, gemma2, phi3, olmo2, gpt_neox, opt, falcon, bloom, gpt2],
    "mixture of experts": [mixtral],
    "encoder": [bert, roberta, deberta_v2, electra],
    "encoder-decoder": [t5, bart, whisper],
    "vision": [vit, swin, convnext],
    "state space": [mamba],
}
ZOO: dict[str, Callable[..., Any]] = {f.__name__: f for family in FAMILIES.values() for f in family}


# ---- the peer users reach for ------------------------------------------------------------------


def enable_checkpointing(model: torch.nn.Module) -> str:
    """Turn on the activation checkpointing a user of `model` would: Hugging Face's
    `gradient_checkpointing_enable()` (non-reentrant) where the model supports it, else
    `torch.utils.checkpoint` (non-reentrant) around each repeated block (`checkpointed_blocks`). Says which."""
    if getattr(model, "supports_gradient_checkpointing", False):
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        return "Hugging Face gradient checkpointing"
    blocks = checkpointed_blocks(model)
    if not blocks:
        raise WorkloadError(f"{type(model).__name__}: no repeated blocks to checkpoint")
    for block in blocks:
        block.forward = _checkpointed(block.forward)
    return f"torch.utils.checkpoint around each of {len(blocks)} {type(blocks[0]).__name__}"


def checkpointed_blocks(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The model's repeated blocks: the children of ModuleLists and Sequentials whose class has the most
    such instances (at least 2, with parameters)."""
    by_class: dict[type, list[torch.nn.Module]] = {}
    for container in model.modules():
        if isinstance(container, (torch.nn.ModuleList, torch.nn.Sequential)):
            for child in container:
                if any(True for _ in child.parameters()):
                    by_class.setdefault(type(child), []).append(child)
    best = max(by_class.values(), key=len, default=[])
    return best if len(best) >= 2 else []


def _checkpointed(forward: Callable[..., Any]) -> Callable[..., Any]:
    from torch.utils.checkpoint import checkpoint

    def run(*args, **kwargs):
        return checkpoint(forward, *args, use_reentrant=False, **kwargs)

    return run
