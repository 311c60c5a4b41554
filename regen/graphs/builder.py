"""`ProfileBuilder`: a `Profile` assembled from a list of ops, the way the profiler would record it.

Forward ops produce tensors and save some of them for backward; backward ops unpack a forward op's
saved entries. `build()` derives everything else from tensor liveness: saved entries (pack and unpack
order), saved tensors (lifetimes, backward uses) and the unplanned memory timeline. An activation
lives from its producer to its last reader, a saved one until its last backward use; backward outputs
nobody reads (parameter gradients) and the loss live to the end of the step.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from regen.formats.profile import (KIND_ACTIVATION, KIND_PARAMETER, PHASE_BACKWARD, PHASE_FORWARD, DeviceInfo,
                                   ModuleCall, OpRecord, Profile, SavedEntry, SavedTensor, StaticMemory, TensorRecord,
                                   op_fingerprint)

FLOAT32_BYTES = 4
DEFAULT_COPY_BYTES_PER_S = 20e9  # host <-> device (PCIe-class) when the caller gives none


@dataclass
class BuilderOp:
    """One op as the builder collects it (tensor ids in, tensor ids out)."""

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

    def __init__(self, name: str = "synthetic", d2h_bytes_per_s: float = DEFAULT_COPY_BYTES_PER_S,
                 h2d_bytes_per_s: float = DEFAULT_COPY_BYTES_PER_S, start_bytes: int = 0,
                 source: str = "synthetic profile (regen.graphs.synthetic)"):
        self.name = name
        self.d2h = d2h_bytes_per_s
        self.h2d = h2d_bytes_per_s
        self.start_bytes = start_bytes
        self.source = source
        self.tensors: list[TensorRecord] = []
        self.ops: list[BuilderOp] = []
        self.calls: list[tuple[str, int, int, list[int]]] = []  # (module, first op, last op, argument tensors)

    # ---- tensors and ops --------------------------------------------------------------------
    def external(self, nbytes: int, kind: str = KIND_PARAMETER, shape: list[int] | None = None) -> int:
        """A tensor no op of the step produces (parameter, buffer, batch)."""
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
        self.ops.append(BuilderOp(name, PHASE_FORWARD, time_s, list(inputs), outs, is_random=is_random,
                                  is_view=is_view, saves=saved))
        return index, outs

    def backward(self, name: str, time_s: float, of: int | list[int] | None, inputs: list[int],
                 out_bytes: list[int]) -> list[int]:
        """A backward op that unpacks the saved entries of forward op(s) `of` (and reads `inputs`)."""
        index = len(self.ops)
        outs = [self._output(nbytes, index, slot) for slot, nbytes in enumerate(out_bytes)]
        of_list = [] if of is None else ([of] if isinstance(of, int) else list(of))
        saved = [x for q in of_list for x in self.ops[q].saves]
        self.ops.append(BuilderOp(name, PHASE_BACKWARD, time_s, list(inputs) + [s for s in saved if s not in inputs],
                                  outs, unpacks_of=of_list))
        return outs

    def module_call(self, module: str, first_op: int, last_op: int, inputs: list[int]) -> None:
        """A call of submodule `module` (its path, e.g. "blocks.3") over forward ops first_op..last_op."""
        self.calls.append((module, first_op, last_op, list(inputs)))

    # ---- profile ----------------------------------------------------------------------------
    def build(self) -> Profile:
        num_fwd = sum(1 for op in self.ops if op.phase == PHASE_FORWARD)
        if any(op.phase == PHASE_FORWARD for op in self.ops[num_fwd:]):
            raise ValueError("forward ops must come before backward ops")
        entries = _saved_entries(self.ops, self.tensors, num_fwd)
        saved = _saved_tensors(self.ops, self.tensors, entries)
        op_records, peak_bytes = _memory_timeline(self.ops, self.tensors, saved, num_fwd, self.start_bytes)
        return Profile(
            workload={"name": self.name, "args": {}, "batch_size": None},
            device=DeviceInfo(type="synthetic", name="synthetic device", total_memory_bytes=0,
                              d2h_bytes_per_s=self.d2h, h2d_bytes_per_s=self.h2d,
                              bandwidth_method="synthetic (not measured)"),
            static_memory=StaticMemory(parameter_bytes=0, gradient_bytes=0, optimizer_state_bytes=0),
            versions={"regen": "synthetic"}, repeats=1, step_time_s=sum(op.time_s for op in self.ops),
            optimizer_step_time_s=0.0, memory_at_start_bytes=self.start_bytes, peak_bytes=peak_bytes,
            fingerprint=op_fingerprint(op_records, self.tensors), ops=op_records, tensors=list(self.tensors),
            saved_entries=entries, saved_tensors=sorted(saved.values(), key=lambda s: s.id),
            notes=[self.source], module_calls=_module_calls(self.calls, entries),
        )


def _module_calls(calls: list[tuple[str, int, int, list[int]]], entries: list[SavedEntry]) -> list[ModuleCall]:
    """The calls as the profiler records them: each module's n-th call, with the saved entries packed inside."""
    out, seen = [], {}
    for module, first, last, inputs in calls:
        inside = [e.index for e in entries if first <= e.pack_after_op <= last]
        out.append(ModuleCall(module=module, call=seen.get(module, 0), first_op=first, last_op=last, inputs=inputs,
                              first_entry=inside[0] if inside else len(entries), num_entries=len(inside),
                              depth=module.count(".") + 1))
        seen[module] = seen.get(module, 0) + 1
    return out


def _saved_entries(ops: list[BuilderOp], tensors: list[TensorRecord], num_fwd: int) -> list[SavedEntry]:
    """Saved entries in pack order, with their unpack order in backward."""
    entries: list[SavedEntry] = []
    entries_of_op: dict[int, list[int]] = {}
    for i, op in enumerate(ops[:num_fwd]):
        for x in op.saves:
            rec = tensors[x]
            cand = rec.storage if rec.producer_op is not None else None
            e = SavedEntry(index=len(entries), tensor=x, saved_tensor=cand,
                           excluded_reason=None if cand is not None else rec.kind, shape=list(rec.shape),
                           stride=[1], storage_offset=0, dtype=rec.dtype, pack_after_op=i)
            entries.append(e)
            entries_of_op.setdefault(i, []).append(e.index)
    order = 0
    for i, op in enumerate(ops):
        for q in op.unpacks_of:
            for ei in entries_of_op.get(q, []):
                if entries[ei].unpack_order is None:
                    entries[ei].unpack_order = order
                    entries[ei].unpack_before_op = i
                    order += 1
    return entries


def _saved_tensors(ops: list[BuilderOp], tensors: list[TensorRecord],
                   entries: list[SavedEntry]) -> dict[int, SavedTensor]:
    """One saved tensor per storage of saved activations, with its forward and backward uses."""
    storage_producer = {t.id: t for t in tensors if t.producer_op is not None and t.storage == t.id}
    saved: dict[int, SavedTensor] = {}
    for e in entries:
        st = e.saved_tensor
        if st is None:
            continue
        if st not in saved:
            rec = storage_producer[st]
            saved[st] = SavedTensor(id=st, tensor=rec.id, storage=st, producer_op=rec.producer_op,
                                    output_slot=rec.output_slot, bytes=rec.storage_bytes, shape=list(rec.shape),
                                    dtype=rec.dtype, last_forward_use=rec.producer_op, backward_uses=[],
                                    entries=[], is_random=ops[rec.producer_op].is_random)
        saved[st].entries.append(e.index)
    storage_of = {t.id: t.storage for t in tensors}
    for i, op in enumerate(ops):
        for x in op.inputs:
            s = saved.get(storage_of[x])
            if s is None:
                continue
            if op.phase == PHASE_FORWARD:
                s.last_forward_use = max(s.last_forward_use, i)
            elif i not in s.backward_uses:
                s.backward_uses.append(i)
    for s in saved.values():
        s.backward_uses.sort()
    return saved


def _last_uses(ops: list[BuilderOp], tensors: list[TensorRecord], saved: dict[int, SavedTensor],
               num_fwd: int) -> dict[int, int]:
    """Storage -> the last op that needs it (liveness from producer to last reader)."""
    readers: dict[int, list[int]] = {}
    for i, op in enumerate(ops):
        for x in op.inputs:
            readers.setdefault(x, []).append(i)
    last_use: dict[int, int] = {}
    for t in tensors:
        if t.producer_op is None:
            continue
        end = max(readers.get(t.id, [t.producer_op]))
        last_use[t.storage] = max(last_use.get(t.storage, -1), end, t.producer_op)
    for st, s in saved.items():
        last_use[st] = max(last_use[st], s.backward_uses[-1] if s.backward_uses else s.last_forward_use)
    for t in tensors:
        if t.producer_op is not None and t.storage == t.id and t.id not in readers:
            if ops[t.producer_op].phase == PHASE_BACKWARD or t.producer_op == num_fwd - 1:
                last_use[t.id] = len(ops) - 1  # gradients and the loss live to the end of the step
    return last_use


def _memory_timeline(ops: list[BuilderOp], tensors: list[TensorRecord], saved: dict[int, SavedTensor],
                     num_fwd: int, start_bytes: int) -> tuple[list[OpRecord], int]:
    """The op records with memory after and peak of every op, and the step's peak."""
    n = len(ops)
    alloc_at: dict[int, list[int]] = {}
    free_at: dict[int, list[int]] = {}
    for st, end in _last_uses(ops, tensors, saved, num_fwd).items():
        alloc_at.setdefault(tensors[st].producer_op, []).append(st)
        free_at.setdefault(end, []).append(st)
    records = []
    mem = peak_all = start_bytes
    for i, op in enumerate(ops):
        mem += sum(tensors[st].storage_bytes for st in alloc_at.get(i, []))
        peak = mem
        mem -= sum(tensors[st].storage_bytes for st in free_at.get(i, []) if i < n - 1)
        peak_all = max(peak_all, peak)
        records.append(OpRecord(index=i, name=op.name, phase=op.phase, time_s=op.time_s, inputs=op.inputs,
                                outputs=op.outputs, memory_after_bytes=mem, memory_peak_bytes=peak,
                                is_random=op.is_random, is_inplace=op.is_inplace, is_view=op.is_view))
    return records, peak_all
