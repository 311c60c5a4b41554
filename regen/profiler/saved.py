"""The saved-tensor records of a recorded step: each pack becomes a `SavedEntry`, and the packs of one
activation storage (written by a forward op) one `SavedTensor`, named by the op and output slot that
wrote it (docs/internals.md "Naming a saved tensor")."""

from __future__ import annotations

from dataclasses import dataclass

from regen.formats.profile import (EXCLUDED_OTHER_DEVICE, KIND_ACTIVATION, KIND_INPUT, PHASE_FORWARD, OpRecord,
                                   SavedEntry, SavedTensor, TensorRecord)


@dataclass
class RawEntry:
    """One pack as the recorder saw it."""

    index: int
    tensor: int
    storage: int
    kind: str
    writer: tuple[int, int] | None
    random_contents: bool
    shape: list[int]
    stride: list[int]
    storage_offset: int
    dtype: str
    pack_after_op: int
    unpack_order: int | None = None
    unpack_before_op: int | None = None
    on_step_device: bool = True  # False: saved on another device than the step's (EXCLUDED_OTHER_DEVICE)


def saved_records(raw_entries: list[RawEntry], ops: list[OpRecord], tensors: list[TensorRecord],
                  reads: dict[int, list[int]]) -> tuple[list[SavedEntry], list[SavedTensor], list[str]]:
    """(entries, saved tensors, notes) of the step's packs; `reads`: storage id -> the ops that read it."""
    num_forward = sum(1 for op in ops if op.phase == PHASE_FORWARD)
    notes = []
    entries: list[SavedEntry] = []
    groups: dict[int, list[RawEntry]] = {}
    for raw in raw_entries:
        excluded = None
        if not raw.on_step_device:
            excluded = EXCLUDED_OTHER_DEVICE
        elif raw.kind != KIND_ACTIVATION:
            excluded = raw.kind
        elif raw.writer is None:
            excluded = KIND_INPUT  # an activation storage no forward op wrote (made in backward)
        else:
            groups.setdefault(raw.storage, []).append(raw)
        entries.append(SavedEntry(
            index=raw.index, tensor=raw.tensor, saved_tensor=None, excluded_reason=excluded,
            shape=raw.shape, stride=raw.stride, storage_offset=raw.storage_offset, dtype=raw.dtype,
            pack_after_op=raw.pack_after_op, unpack_order=raw.unpack_order,
            unpack_before_op=raw.unpack_before_op))
    saved: list[SavedTensor] = []
    for storage_id, group in groups.items():  # dicts keep insertion order: first pack first
        producer, slot = group[0].writer
        if any(e.writer != group[0].writer for e in group):
            notes.append(f"storage {storage_id} was packed with different writers "
                         f"{sorted({e.writer for e in group})}; named by the first")
        # OpRecord.outputs omits undefined (None) outputs, so find the slot by the records' output_slot
        out_tid = next(t for t in ops[producer].outputs if tensors[t].output_slot == slot)
        out = tensors[out_tid]
        readers = reads.get(storage_id, [])
        forward_reads = [r for r in readers if r < num_forward]
        sid = len(saved)
        for e in group:
            entries[e.index].saved_tensor = sid
        saved.append(SavedTensor(
            id=sid, tensor=out_tid, storage=storage_id, producer_op=producer, output_slot=slot,
            bytes=out.storage_bytes, shape=list(out.shape), dtype=out.dtype,
            last_forward_use=max([producer] + forward_reads),
            backward_uses=[r for r in readers if r >= num_forward],
            entries=[e.index for e in group], is_random=any(e.random_contents for e in group),
            is_inplace=ops[producer].is_inplace))
    return entries, saved, notes
