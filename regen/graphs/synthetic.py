"""Synthetic profiles for planner tests and benchmarks, built with `ProfileBuilder` without running a model.

* `transformer_profile(n_layers, ...)`: GPT-shaped (layer norm, qkv, attention scores, softmax,
  dropout, projection, residual adds, MLP with GELU), times from FLOPs and bytes of a GPU-class
  device; about 15 candidates per layer.
* `chain_profile(n, seed)`: a random chain of ops, each saving its input; small graphs for the brute
  force tests.
"""

from __future__ import annotations

import random

from regen.formats.profile import KIND_INPUT, Profile
from regen.graphs.builder import DEFAULT_COPY_BYTES_PER_S, FLOAT32_BYTES, ProfileBuilder

SYNTHETIC_DEVICE_FLOP_PER_S = 50e12  # matmul throughput of the synthetic device
SYNTHETIC_DEVICE_MEMORY_BYTES_PER_S = 1.5e12  # elementwise ops are memory bound
SYNTHETIC_OP_OVERHEAD_S = 5e-6  # launch overhead of every op
SYNTHETIC_VOCAB = 4096  # embedding rows and logits width of the synthetic transformer



def _elementwise_s(nbytes: float) -> float:
    return SYNTHETIC_OP_OVERHEAD_S + 2 * nbytes / SYNTHETIC_DEVICE_MEMORY_BYTES_PER_S


def _matmul_s(flops: float) -> float:
    return SYNTHETIC_OP_OVERHEAD_S + flops / SYNTHETIC_DEVICE_FLOP_PER_S


def transformer_profile(n_layers: int = 4, batch: int = 8, seq: int = 512, d_model: int = 1024, n_head: int = 16,
                        copy_bytes_per_s: float = DEFAULT_COPY_BYTES_PER_S, module_calls: bool = False) -> Profile:
    """A GPT-shaped training step with `n_layers` blocks (about 15 candidates each); with `module_calls`,
    each block is recorded as a call of `blocks.k`, as the profiler records a model's layers."""
    tokens = batch * seq
    act = tokens * d_model * FLOAT32_BYTES
    scores = batch * n_head * seq * seq * FLOAT32_BYTES
    small = tokens * FLOAT32_BYTES
    b = ProfileBuilder(f"synthetic-transformer-{n_layers}", copy_bytes_per_s, copy_bytes_per_s,
                       start_bytes=n_layers * 12 * d_model * d_model * FLOAT32_BYTES)
    idx = b.external(tokens * 8, kind=KIND_INPUT)
    emb = b.external(SYNTHETIC_VOCAB * d_model * FLOAT32_BYTES)
    mm = lambda k, n_out: _matmul_s(2 * tokens * k * n_out)  # noqa: E731
    _, (x,) = b.forward("aten.embedding.default", _elementwise_s(act), [emb, idx], [act], saves=[idx])
    fwd = []  # (forward op, name, backward out sizes) in order, for the mirrored backward
    for layer in range(n_layers):
        block_first_op, block_input = len(b.ops), x
        w_qkv, w_proj = b.external(3 * d_model * d_model * 4), b.external(d_model * d_model * 4)
        w_fc, w_out = b.external(4 * d_model * d_model * 4), b.external(4 * d_model * d_model * 4)
        ln1_op, (ln1, m1, r1) = b.forward("aten.native_layer_norm.default", _elementwise_s(act), [x],
                                          [act, small, small])
        b.ops[ln1_op].saves = [x, m1, r1]
        qkv_op, (qkv,) = b.forward("aten.addmm.default", mm(d_model, 3 * d_model), [ln1, w_qkv], [3 * act],
                                   saves=[ln1])
        sc_op, (sc,) = b.forward("aten.bmm.default", _matmul_s(2 * batch * n_head * seq * seq * d_model // n_head),
                                 [qkv], [scores], saves=[qkv])
        sm_op, (pr,) = b.forward("aten._softmax.default", _elementwise_s(scores), [sc], [scores], saves="outputs")
        dp_op, (dp, mask) = b.forward("aten.native_dropout.default", _elementwise_s(scores), [pr],
                                      [scores, scores // 4], is_random=True)
        b.ops[dp_op].saves = [mask]
        av_op, (av,) = b.forward("aten.bmm.default", _matmul_s(2 * batch * n_head * seq * seq * d_model // n_head),
                                 [dp, qkv], [act], saves=[dp, qkv])
        pj_op, (pj,) = b.forward("aten.addmm.default", mm(d_model, d_model), [av, w_proj], [act], saves=[av])
        _, (x2,) = b.forward("aten.add.Tensor", _elementwise_s(act), [x, pj], [act])
        ln2_op, (ln2, m2, r2) = b.forward("aten.native_layer_norm.default", _elementwise_s(act), [x2],
                                          [act, small, small])
        b.ops[ln2_op].saves = [x2, m2, r2]
        fc_op, (fc,) = b.forward("aten.addmm.default", mm(d_model, 4 * d_model), [ln2, w_fc], [4 * act],
                                 saves=[ln2])
        ge_op, (ge,) = b.forward("aten.gelu.default", _elementwise_s(4 * act), [fc], [4 * act], saves=[fc])
        fo_op, (fo,) = b.forward("aten.addmm.default", mm(4 * d_model, d_model), [ge, w_out], [act], saves=[ge])
        last_op, (x,) = b.forward("aten.add.Tensor", _elementwise_s(act), [x2, fo], [act])
        if module_calls:
            b.module_call(f"blocks.{layer}", block_first_op, last_op, [block_input])
        fwd += [(ln1_op, "aten.native_layer_norm_backward.default", [act, d_model * 8]),
                (qkv_op, "aten.mm.default", [act, 3 * d_model * d_model * 4]),
                (sc_op, "aten.bmm.default", [3 * act]),
                (sm_op, "aten._softmax_backward_data.default", [scores]),
                (dp_op, "aten.native_dropout_backward.default", [scores]),
                (av_op, "aten.bmm.default", [scores, 3 * act]),
                (pj_op, "aten.mm.default", [act, d_model * d_model * 4]),
                (ln2_op, "aten.native_layer_norm_backward.default", [act, d_model * 8]),
                (fc_op, "aten.mm.default", [act, 4 * d_model * d_model * 4]),
                (ge_op, "aten.gelu_backward.default", [4 * act]),
                (fo_op, "aten.mm.default", [4 * act, 4 * d_model * d_model * 4])]
    logits_bytes = tokens * SYNTHETIC_VOCAB * FLOAT32_BYTES
    _, (logits,) = b.forward("aten.mm.default", mm(d_model, SYNTHETIC_VOCAB), [x, emb], [logits_bytes], saves=[x])
    loss_op, (loss,) = b.forward("aten._log_softmax.default", _elementwise_s(logits_bytes), [logits],
                                 [FLOAT32_BYTES], saves=[logits])
    (g,) = b.backward("aten._log_softmax_backward_data.default", _elementwise_s(logits_bytes), loss_op, [loss],
                      [logits_bytes])
    g, _ = b.backward("aten.mm.default", mm(SYNTHETIC_VOCAB, d_model) * 2, loss_op - 1, [g],
                      [act, SYNTHETIC_VOCAB * d_model * FLOAT32_BYTES])
    for op, name, outs in reversed(fwd):
        time = 2 * b.ops[op].time_s
        res = b.backward(name, time, op, [g], outs)
        g = res[0]
    b.backward("aten.embedding_dense_backward.default", _elementwise_s(act), 0, [g], [SYNTHETIC_VOCAB * d_model * 4])
    return b.build()


def chain_profile(n: int, seed: int = 0, copy_bytes_per_s: float = 1e9) -> Profile:
    """A random chain: x0 -> op1 -> x1 -> ... -> op_n -> loss; op i saves its input.

    Tensor sizes are 1-10 MB and op times 0.2-2 ms, so with 1 GB/s copies some swaps hide behind
    compute and some do not: small graphs where keep, swap and recompute all matter.
    """
    rng = random.Random(seed)
    mb = 1 << 20
    b = ProfileBuilder(f"synthetic-chain-{n}-{seed}", copy_bytes_per_s, copy_bytes_per_s, start_bytes=8 * mb)
    x = b.external(mb, kind=KIND_INPUT)
    ops = []
    for i in range(n):
        w = b.external(mb // 4)
        nbytes = rng.randint(1, 10) * mb
        op, (x,) = b.forward("aten.relu.default" if i % 3 == 1 else "aten.mm.default",
                             rng.uniform(0.2e-3, 2e-3), [x, w], [nbytes], saves=[x], is_random=(i % 5 == 4))
        ops.append(op)
    loss_op, (loss,) = b.forward("aten.sum.default", 0.1e-3, [x], [FLOAT32_BYTES], saves=[x])
    (g,) = b.backward("aten.expand.default", 0.1e-3, loss_op, [loss], [mb])
    for op in reversed(ops):
        (g, _) = b.backward("aten.mm.default", 2 * b.ops[op].time_s, op, [g], [mb, mb // 4])
    return b.build()
