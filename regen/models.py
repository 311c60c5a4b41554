"""Built-in workloads: small real models that regen profiles, plans and trains in tests and demos.

A workload factory takes keyword arguments (sizes, `batch_size`) and returns `(model, batch)` or
`(model, batch, loss_fn)` (see regen.workloads for the protocol). The built-ins:

* `mlp`: a stack of Linear + ReLU layers with a classification loss.
* `cnn`: a small ResNet-style CNN (conv, batch norm, residual blocks) on random images.
* `gpt`: a small GPT (token + position embeddings, causal self-attention, GELU MLP, dropout, tied
  input/output embeddings) on random tokens with a next-token loss.
* `hf-gpt2`, `hf-bert`, `hf-llama`: Hugging Face GPT-2, BERT and Llama (RMSNorm, rotary positions,
  grouped-query attention, SwiGLU: every block takes the causal mask and the rotary tables the model
  computes once) built from a config (no downloads), when `transformers` is installed.

Every factory seeds its own generator, so the same arguments give the same weights and batch.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from regen.errors import WorkloadError

DEFAULT_SEED = 0


def _generator(seed: int) -> torch.Generator:
    g = torch.Generator()
    g.manual_seed(seed)
    return g


# ---- MLP ---------------------------------------------------------------------------------------


class MLP(nn.Module):
    def __init__(self, in_features: int, hidden: int, depth: int, num_classes: int):
        super().__init__()
        widths = [in_features] + [hidden] * depth
        self.layers = nn.ModuleList(
            nn.Sequential(nn.Linear(a, b), nn.ReLU()) for a, b in zip(widths[:-1], widths[1:])
        )
        self.head = nn.Linear(widths[-1], num_classes)

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return self.head(x)


def mlp(batch_size: int = 64, in_features: int = 256, hidden: int = 512, depth: int = 4,
        num_classes: int = 10, seed: int = DEFAULT_SEED):
    torch.manual_seed(seed)
    model = MLP(in_features, hidden, depth, num_classes)
    g = _generator(seed)
    x = torch.randn(batch_size, in_features, generator=g)
    y = torch.randint(0, num_classes, (batch_size,), generator=g)
    return model, (x,), lambda out, batch: F.cross_entropy(out, y)


# ---- CNN ---------------------------------------------------------------------------------------


class ResidualBlock(nn.Module):
    def __init__(self, channels: int):
        super().__init__()
        self.conv1 = nn.Conv2d(channels, channels, 3, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(channels)
        self.conv2 = nn.Conv2d(channels, channels, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(channels)

    def forward(self, x):
        h = F.relu(self.bn1(self.conv1(x)))
        h = self.bn2(self.conv2(h))
        return F.relu(h + x)


class SmallResNet(nn.Module):
    def __init__(self, channels: int, num_blocks: int, num_classes: int):
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, channels, 3, padding=1, bias=False),
                                  nn.BatchNorm2d(channels), nn.ReLU())
        self.blocks = nn.ModuleList(ResidualBlock(channels) for _ in range(num_blocks))
        self.head = nn.Linear(channels, num_classes)

    def forward(self, x):
        x = self.stem(x)
        for block in self.blocks:
            x = block(x)
        return self.head(x.mean(dim=(2, 3)))


def cnn(batch_size: int = 8, channels: int = 16, num_blocks: int = 3, image_size: int = 32,
        num_classes: int = 10, seed: int = DEFAULT_SEED):
    torch.manual_seed(seed)
    model = SmallResNet(channels, num_blocks, num_classes)
    g = _generator(seed)
    x = torch.randn(batch_size, 3, image_size, image_size, generator=g)
    y = torch.randint(0, num_classes, (batch_size,), generator=g)
    return model, (x,), lambda out, batch: F.cross_entropy(out, y)


# ---- GPT ---------------------------------------------------------------------------------------


class CausalSelfAttention(nn.Module):
    def __init__(self, d_model: int, n_head: int, dropout: float):
        super().__init__()
        self.n_head = n_head
        self.qkv = nn.Linear(d_model, 3 * d_model)
        self.proj = nn.Linear(d_model, d_model)
        self.attn_drop = nn.Dropout(dropout)
        self.resid_drop = nn.Dropout(dropout)

    def forward(self, x):
        b, t, c = x.shape
        q, k, v = self.qkv(x).split(c, dim=2)
        q, k, v = (z.view(b, t, self.n_head, c // self.n_head).transpose(1, 2) for z in (q, k, v))
        att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(k.size(-1)))
        mask = torch.ones(t, t, dtype=torch.bool, device=x.device).tril()
        att = att.masked_fill(~mask, float("-inf"))
        att = self.attn_drop(F.softmax(att, dim=-1))
        y = (att @ v).transpose(1, 2).contiguous().view(b, t, c)
        return self.resid_drop(self.proj(y))


class GPTBlock(nn.Module):
    def __init__(self, d_model: int, n_head: int, dropout: float):
        super().__init__()
        self.ln1 = nn.LayerNorm(d_model)
        self.attn = CausalSelfAttention(d_model, n_head, dropout)
        self.ln2 = nn.LayerNorm(d_model)
        self.fc = nn.Linear(d_model, 4 * d_model)
        self.fc_out = nn.Linear(4 * d_model, d_model)
        self.mlp_drop = nn.Dropout(dropout)

    def forward(self, x):
        x = x + self.attn(self.ln1(x))
        return x + self.mlp_drop(self.fc_out(F.gelu(self.fc(self.ln2(x)))))


class GPT(nn.Module):
    def __init__(self, vocab_size: int, context: int, d_model: int, n_layer: int, n_head: int,
                 dropout: float):
        super().__init__()
        self.tok_emb = nn.Embedding(vocab_size, d_model)
        self.pos_emb = nn.Embedding(context, d_model)
        self.drop = nn.Dropout(dropout)
        self.blocks = nn.ModuleList(GPTBlock(d_model, n_head, dropout) for _ in range(n_layer))
        self.ln_f = nn.LayerNorm(d_model)
        self.lm_head = nn.Linear(d_model, vocab_size, bias=False)
        self.lm_head.weight = self.tok_emb.weight  # tied embeddings
        for emb in (self.tok_emb, self.pos_emb):
            nn.init.normal_(emb.weight, std=0.02)

    def forward(self, idx):
        t = idx.size(1)
        pos = torch.arange(t, device=idx.device)
        x = self.drop(self.tok_emb(idx) + self.pos_emb(pos))
        for block in self.blocks:
            x = block(x)
        return self.lm_head(self.ln_f(x))


def gpt(batch_size: int = 4, vocab_size: int = 512, context: int = 64, d_model: int = 128,
        n_layer: int = 2, n_head: int = 4, dropout: float = 0.1, seed: int = DEFAULT_SEED):
    if d_model % n_head:
        raise WorkloadError(f"gpt: d_model ({d_model}) must be a multiple of n_head ({n_head})")
    torch.manual_seed(seed)
    model = GPT(vocab_size, context, d_model, n_layer, n_head, dropout)
    g = _generator(seed)
    tokens = torch.randint(0, vocab_size, (batch_size, context + 1), generator=g)
    idx, targets = tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()

    def loss_fn(logits, batch):
        return F.cross_entropy(logits.reshape(-1, logits.size(-1)), targets.reshape(-1))

    return model, (idx,), loss_fn


# ---- Hugging Face ------------------------------------------------------------------------------


def _transformers():
    try:
        import transformers
    except ImportError:
        raise WorkloadError(
            "this workload needs Hugging Face transformers: pip install 'regen[hf]'"
        ) from None
    return transformers


def _token_batch(vocab_size: int, batch_size: int, seq_len: int, seed: int) -> dict:
    """Random tokens as a Hugging Face causal or masked LM's batch: the labels are the inputs."""
    ids = torch.randint(0, vocab_size, (batch_size, seq_len), generator=_generator(seed))
    return {"input_ids": ids, "labels": ids.clone()}


def hf_gpt2(batch_size: int = 2, seq_len: int = 64, n_layer: int = 2, n_embd: int = 128,
            n_head: int = 4, vocab_size: int = 1024, dropout: float = 0.1, seed: int = DEFAULT_SEED):
    """GPT-2 (transformers.GPT2LMHeadModel) from a config; the loss is the model's own `.loss`."""
    tf = _transformers()
    torch.manual_seed(seed)
    config = tf.GPT2Config(vocab_size=vocab_size, n_positions=max(seq_len, 64), n_embd=n_embd,
                           n_layer=n_layer, n_head=n_head, resid_pdrop=dropout, embd_pdrop=dropout,
                           attn_pdrop=dropout, bos_token_id=0, eos_token_id=0)
    model = tf.GPT2LMHeadModel(config)
    return model, _token_batch(vocab_size, batch_size, seq_len, seed)


def hf_bert(batch_size: int = 2, seq_len: int = 64, num_layers: int = 2, hidden: int = 128,
            n_head: int = 4, vocab_size: int = 1024, dropout: float = 0.1, seed: int = DEFAULT_SEED):
    """BERT (transformers.BertForMaskedLM) from a config; the loss is the model's own `.loss`."""
    tf = _transformers()
    torch.manual_seed(seed)
    config = tf.BertConfig(vocab_size=vocab_size, hidden_size=hidden, num_hidden_layers=num_layers,
                           num_attention_heads=n_head, intermediate_size=4 * hidden,
                           max_position_embeddings=max(seq_len, 64), hidden_dropout_prob=dropout,
                           attention_probs_dropout_prob=dropout)
    model = tf.BertForMaskedLM(config)
    return model, _token_batch(vocab_size, batch_size, seq_len, seed)


def hf_llama(batch_size: int = 2, seq_len: int = 64, num_layers: int = 2, hidden: int = 128, n_head: int = 4,
             n_kv_head: int = 2, intermediate: int = 352, vocab_size: int = 1024, seed: int = DEFAULT_SEED):
    """Llama (transformers.LlamaForCausalLM) from a config, eager attention; the loss is the model's `.loss`."""
    tf = _transformers()
    torch.manual_seed(seed)
    config = tf.LlamaConfig(vocab_size=vocab_size, hidden_size=hidden, intermediate_size=intermediate,
                            num_hidden_layers=num_layers, num_attention_heads=n_head, num_key_value_heads=n_kv_head,
                            max_position_embeddings=max(seq_len, 64), attn_implementation="eager")
    model = tf.LlamaForCausalLM(config)
    return model, _token_batch(vocab_size, batch_size, seq_len, seed)


BUILTIN_WORKLOADS = {
    "mlp": mlp,
    "cnn": cnn,
    "gpt": gpt,
    "hf-gpt2": hf_gpt2,
    "hf-bert": hf_bert,
    "hf-llama": hf_llama,
}


def repeated_blocks(model: nn.Module) -> list[nn.Module]:
    """The model's repeated blocks (its longest ModuleList), for per-block checkpointing baselines."""
    best: list[nn.Module] = []
    for module in model.modules():
        if isinstance(module, nn.ModuleList) and len(module) > len(best):
            best = list(module)
    return best
