"""Synthetic profiles for planner tests and benchmarks, built without running a model.

`ProfileBuilder` assembles a `Profile` from a list of ops the way the profiler would record it:
forward ops that produce tensors and save some of them for backward, backward ops that unpack a
forward op's saved entries. It derives everything else: saved tensors (lifetimes, backward uses),
saved entries (pack and unpack order), and the unplanned memory timeline, from tensor liveness (an
activation lives from its producer to its last reader; a saved one until its last backward use;
backward outputs nobody reads, i.e. parameter gradients, until the end of the step).

Generators:
* `transformer_profile(n_layers, ...)`: GPT-shaped (layer norm, qkv, attention scores, softmax,
  dropout, projection, residual adds, MLP with GELU), times from FLOPs and bytes of a GPU-class
  device; about 15 candidates per layer.
* `chain_profile(n, seed)`: a random chain of ops, each saving its input; small graphs for the brute
  force tests.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field

from regen.formats.profile import (KIND_ACTIVATION, KIND_INPUT, KIND_PARAMETER, PHASE_BACKWARD, PHASE_FORWARD,
                                   DeviceInfo, OpRecord, Profile, SavedEntry, SavedTensor, StaticMemory,
                                   TensorRecord, op_fingerprint)

FLOAT32_BYTES = 4
SYNTHETIC_DEVICE_FLOP_PER_S = 50e12  # matmul throughput of the synthetic device
SYNTHETIC_DEVICE_MEMORY_BYTES_PER_S = 1.5e12  # elementwise ops are memory bound
SYNTHETIC_COPY_BYTES_PER_S = 20e9  # host <-> device (PCIe-class)
SYNTHETIC_OP_OVERHEAD_S = 5e-6  # launch overhead of every op
SYNTHETIC_VOCAB = 4096  # embedding rows and logits width of the synthetic transformer


@dataclass
class _Op:
    name: str
    phase: str
    time_s: float
    inputs: list[int]
    outputs: list[int]
    is_random: bool = False
    is_inplace: bool = False
    is_view: bool = False
    saves: list[int] = field(default_factory=list)  # forward: tensors packed after this op
    unpacks_of: list[int] = field(default_factory=list)  # backward: forward ops whose saved entries it unpacks


class ProfileBuilder:
    """Collects ops and tensors, then `build()` derives a consistent Profile."""

    def __init__(self, name: str = "synthetic", d2h_bytes_per_s: float = SYNTHETIC_COPY_BYTES_PER_S,
                 h2d_bytes_per_s: float = SYNTHETIC_COPY_BYTES_PER_S, start_bytes: int = 0):
        self.name = name
        self.d2h = d2h_bytes_per_s
        self.h2d = h2d_bytes_per_s
        self.start_bytes = start_bytes
        self.tensors: list[TensorRecord] = []
        self.ops: list[_Op] = []

    # ---- tensors and ops --------------------------------------------------------------------
    def external(self, nbytes: int, kind: str = KIND_PARAMETER, shape: list[int] | None = None) -> int:
        tid = len(self.tensors)
        self.tensors.append(TensorRecord(id=tid, shape=shape or [max(1, nbytes // FLOAT32_BYTES)],
                                         dtype="torch.float32", bytes=nbytes, storage=tid, storage_bytes=nbytes,
                                         kind=kind))
        return tid

    def _output(self, nbytes: int, op_index: int, slot: int, storage: int | None = None) -> int:
        tid = len(self.tensors)
        st = tid if storage is None else storage
        sbytes = nbytes if storage is None else self.tensors[storage].storage_bytes
        self.tensors.append(TensorRecord(id=tid, shape=[max(1, nbytes // FLOAT32_BYTES)], dtype="torch.float32",
                                         bytes=nbytes, storage=st, storage_bytes=sbytes, kind=KIND_ACTIVATION,
                                         producer_op=op_index, output_slot=slot))
        return tid

    def forward(self, name: str, time_s: float, inputs: list[int], out_bytes: list[int],
                saves: list[int] | str = (), is_random: bool = False, is_view: bool = False) -> tuple[int, list[int]]:
        """A forward op; `saves` lists tensor ids packed for backward ("outputs" = its outputs)."""
        index = len(self.ops)
        outs = []
        for slot, nbytes in enumerate(out_bytes):
            storage = self.tensors[inputs[0]].storage if is_view else None
            outs.append(self._output(nbytes, index, slot, storage))
        saved = list(outs) if saves == "outputs" else list(saves)
        self.ops.append(_Op(name, PHASE_FORWARD, time_s, list(inputs), outs, is_random=is_random,
                            is_view=is_view, saves=saved))
        return index, outs

    def backward(self, name: str, time_s: float, of: int | list[int] | None, inputs: list[int],
                 out_bytes: list[int]) -> list[int]:
        """A backward op that unpacks the saved entries of forward op(s) `of` (and reads `inputs`)."""
        index = len(self.ops)
        outs = [self._output(nbytes, index, slot) for slot, nbytes in enumerate(out_bytes)]
        of_list = [] if of is None else ([of] if isinstance(of, int) else list(of))
        saved = [x for q in of_list for x in self.ops[q].saves]
        self.ops.append(_Op(name, PHASE_BACKWARD, time_s, list(inputs) + [s for s in saved if s not in inputs],
                            outs, unpacks_of=of_list))
        return outs

    # ---- profile ----------------------------------------------------------------------------
    def build(self) -> Profile:
        n = len(self.ops)
        num_fwd = sum(1 for op in self.ops if op.phase == PHASE_FORWARD)
        if any(op.phase == PHASE_FORWARD for op in self.ops[num_fwd:]):
            raise ValueError("forward ops must come before backward ops")
        readers: dict[int, list[int]] = {}
        for i, op in enumerate(self.ops):
            for x in op.inputs:
                readers.setdefault(x, []).append(i)
        # saved entries in pack order, unpacks in backward order
        entries: list[SavedEntry] = []
        entries_of_op: dict[int, list[int]] = {}
        for i, op in enumerate(self.ops[:num_fwd]):
            for x in op.saves:
                rec = self.tensors[x]
                cand = rec.storage if rec.producer_op is not None else None
                e = SavedEntry(index=len(entries), tensor=x, saved_tensor=cand,
                               excluded_reason=None if cand is not None else rec.kind, shape=list(rec.shape),
                               stride=[1], storage_offset=0, dtype=rec.dtype, pack_after_op=i)
                entries.append(e)
                entries_of_op.setdefault(i, []).append(e.index)
        order = 0
        for i, op in enumerate(self.ops):
            for q in op.unpacks_of:
                for ei in entries_of_op.get(q, []):
                    if entries[ei].unpack_order is None:
                        entries[ei].unpack_order = order
                        entries[ei].unpack_before_op = i
                        order += 1
        # candidates: one per storage of saved activations
        storage_producer: dict[int, TensorRecord] = {}
        for t in self.tensors:
            if t.producer_op is not None and t.storage == t.id:
                storage_producer[t.id] = t
        saved: dict[int, SavedTensor] = {}
        for e in entries:
            if e.saved_tensor is None:
                continue
            st = e.saved_tensor
            if st not in saved:
                rec = storage_producer[st]
                saved[st] = SavedTensor(id=st, tensor=rec.id, storage=st, producer_op=rec.producer_op,
                                        output_slot=rec.output_slot, bytes=rec.storage_bytes, shape=list(rec.shape),
                                        dtype=rec.dtype, last_forward_use=rec.producer_op, backward_uses=[],
                                        entries=[], is_random=self.ops[rec.producer_op].is_random)
            saved[st].entries.append(e.index)
        storage_of = {t.id: t.storage for t in self.tensors}
        for i, op in enumerate(self.ops):
            for x in op.inputs:
                st = storage_of[x]
                if st in saved:
                    s = saved[st]
                    if op.phase == PHASE_FORWARD:
                        s.last_forward_use = max(s.last_forward_use, i)
                    elif i not in s.backward_uses:
                        s.backward_uses.append(i)
        for s in saved.values():
            s.backward_uses.sort()
        # liveness per storage: from producer to last reader (saved: last backward use)
        last_use: dict[int, int] = {}
        for t in self.tensors:
            if t.producer_op is None:
                continue
            st = t.storage
            end = max(readers.get(t.id, [t.producer_op]))
            last_use[st] = max(last_use.get(st, -1), end, t.producer_op)
        for st, s in saved.items():
            last_use[st] = max(last_use[st], s.backward_uses[-1] if s.backward_uses else s.last_forward_use)
        for t in self.tensors:
            if t.producer_op is not None and t.storage == t.id and t.id not in readers:
                if self.ops[t.producer_op].phase == PHASE_BACKWARD or t.producer_op == num_fwd - 1:
                    last_use[t.id] = n - 1  # gradients and the loss live to the end of the step
        alloc_at: dict[int, list[int]] = {}
        free_at: dict[int, list[int]] = {}
        for st, end in last_use.items():
            rec = self.tensors[st]
            alloc_at.setdefault(rec.producer_op, []).append(st)
            free_at.setdefault(end, []).append(st)
        op_records = []
        mem = self.start_bytes
        peak_all = mem
        for i, op in enumerate(self.ops):
            mem += sum(self.tensors[st].storage_bytes for st in alloc_at.get(i, []))
            peak = mem
            mem -= sum(self.tensors[st].storage_bytes for st in free_at.get(i, []) if i < n - 1)
            peak_all = max(peak_all, peak)
            op_records.append(OpRecord(index=i, name=op.name, phase=op.phase, time_s=op.time_s, inputs=op.inputs,
                                       outputs=op.outputs, memory_after_bytes=mem, memory_peak_bytes=peak,
                                       is_random=op.is_random, is_inplace=op.is_inplace, is_view=op.is_view))
        step = sum(op.time_s for op in self.ops)
        return Profile(
            workload={"name": self.name, "args": {}, "batch_size": None},
            device=DeviceInfo(type="synthetic", name="synthetic device", total_memory_bytes=0,
                              d2h_bytes_per_s=self.d2h, h2d_bytes_per_s=self.h2d,
                              bandwidth_method="synthetic (not measured)"),
            static_memory=StaticMemory(parameter_bytes=0, gradient_bytes=0, optimizer_state_bytes=0),
            versions={"regen": "synthetic"}, repeats=1, step_time_s=step, optimizer_step_time_s=0.0,
            memory_at_start_bytes=self.start_bytes, peak_bytes=peak_all,
            fingerprint=op_fingerprint(op_records, self.tensors), ops=op_records, tensors=list(self.tensors),
            saved_entries=entries, saved_tensors=sorted(saved.values(), key=lambda s: s.id),
            notes=["synthetic profile (regen.planner.synthetic)"],
        )


# ---- generators --------------------------------------------------------------------------------


def _elementwise_s(nbytes: float) -> float:
    return SYNTHETIC_OP_OVERHEAD_S + 2 * nbytes / SYNTHETIC_DEVICE_MEMORY_BYTES_PER_S


def _matmul_s(flops: float) -> float:
    return SYNTHETIC_OP_OVERHEAD_S + flops / SYNTHETIC_DEVICE_FLOP_PER_S


def transformer_profile(n_layers: int = 4, batch: int = 8, seq: int = 512, d_model: int = 1024, n_head: int = 16,
                        copy_bytes_per_s: float = SYNTHETIC_COPY_BYTES_PER_S) -> Profile:
    """A GPT-shaped training step with `n_layers` blocks (about 15 candidates each)."""
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
    for _ in range(n_layers):
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
        _, (x,) = b.forward("aten.add.Tensor", _elementwise_s(act), [x2, fo], [act])
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
