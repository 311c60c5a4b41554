"""Capture of one training step at aten-op granularity: ops, tensors, saved tensors and memory.

A `StepRecorder` is driven by two hooks that are active together for the whole step:

* `CaptureMode`, a `TorchDispatchMode` (below autograd, after CompositeImplicit decompositions), numbers
  every dispatched op that `opinfo.is_counted` admits (not `profiler::*` record_function regions), gives
  every op output a fresh tensor id, updates the writer map with `regen.opinfo.written_outputs` after
  every forward op, records which ops read each storage, and samples memory around each op;
* `saved_tensors_hooks(recorder.pack, recorder.unpack)`, which records every tensor autograd saves
  (`SavedEntry`: geometry, `pack_after_op`, `unpack_order`, `unpack_before_op`) and names its candidate
  `writer[storage_key(x)]`, exactly as docs/internals.md says the runtime will.

The op sequence depends on whether saved-tensor hooks are installed (without hooks, saving an op's output
dispatches an extra `aten.detach`), so every instrumented step of the profiler runs with hooks, as the
runtime's planned steps do.

Storages are identified per lifetime: a data pointer is reused once its storage is freed, so a storage id
is handed out whenever a pointer is seen whose previous storage has expired (`StorageWeakRef`), or that
FSDP has resized to nothing (regen.profiler.gathered: the storages its gathering ops write, counted from
the gather to the reshard).
Nothing here keeps a tensor alive except the pack handles, which hold exactly what autograd would hold.

With a `ParkStore` (regen.profiler.park), activation storages are parked in host memory as they are packed
and brought back at unpack; a storage brought back keeps its StorageInfo (its id, so reads of it in
backward are reads of the saved storage) and its tensor id, so the records equal an unparked step's.

`OpRecord.outputs` lists an op's tensor outputs; undefined (None) outputs, which only backward ops return
here, are left out, so `TensorRecord.output_slot` (the position in the op's return value) is what names a
slot, and the fingerprint is fed the defined outputs, as the runtime does.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from itertools import accumulate
from typing import Any, Callable

import torch
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.weak import WeakTensorKeyDictionary

from regen import opinfo, opnames
from regen.formats.profile import (
    KIND_ACTIVATION,
    KIND_BUFFER,
    KIND_INPUT,
    KIND_PARAMETER,
    OTHER_HOOKS_ADVICE,
    PHASE_FORWARD,
    GradientMade,
    ModuleCall,
    OpRecord,
    SavedEntry,
    SavedTensor,
    TensorRecord,
)
from regen.profiler.gathered import GatheredStorages
from regen.profiler.memory import MemoryTracker
from regen.profiler.accumulation import EngineSums, takeover_candidate
from regen.profiler.park import ParkHandle, ParkStore
from regen.profiler.saved import RawEntry, saved_records

_regen_ops = torch._C._DisableTorchDispatch  # the profiler's own ops are not ops of the step
NO_OP = -1  # pack_after_op of a pack that happened before any op of the step
DOUBLE_BACKWARD_NOTE = ("double backward: the step's backward ran with create_graph=True; what it saves for the "
                        "second backward is not planned, and regen.apply treats such a step as a plan mismatch")

# The model's own activation checkpointing or offloading (Hugging Face's gradient_checkpointing_enable(),
# torch.utils.checkpoint, save_on_cpu, torchtune's offloading) saves through hooks of its own: what it saves is
# hidden from regen, which then plans only around it. Said at profile time, with how to let regen choose.
def other_hooks_note(ops: int, total: int) -> str:
    return (f"the model saves activations through hooks of its own (activation checkpointing or offloading): "
            f"{ops} of the forward's {total} ops saved through them; {OTHER_HOOKS_ADVICE}")


def backward_forward_note(packs: int) -> str:
    return (f"the model runs forward code again in its backward ({packs} tensors saved there: reentrant "
            f"activation checkpointing); {OTHER_HOOKS_ADVICE}")


@dataclass
class StorageInfo:
    """One storage over its lifetime."""

    id: int
    key: int  # data pointer (opinfo.storage_key); 0 for empty storages
    nbytes: int
    kind: str  # activation (a new storage allocated by an op of the step) | parameter | buffer | input
    ref: StorageWeakRef | None  # None for empty storages (nothing to track)
    permanent: bool = False  # held by the model or optimizer for the whole step (never freed during it)
    at_start: bool = False  # its bytes are counted in the memory at start (the tracker's)


@dataclass
class _RawOp:
    name: str
    phase: str
    inputs: list[int]
    outputs: list[int]
    memory_peak_rel_bytes: int
    memory_before_rel_bytes: int
    new_bytes: int  # bytes of the new storages among its outputs
    memory_after_rel_bytes: int = 0
    is_random: bool = False
    is_inplace: bool = False
    is_view: bool = False
    module: str | None = None
    private_generator: bool = False
    summed_in_place: bool = False  # an engine sum the step runs in place (accumulation.py): no rise in it


@dataclass
class Capture:
    """What one recorded step produced, ready to go into a Profile (memory already absolute)."""

    ops: list[OpRecord]
    tensors: list[TensorRecord]
    saved_entries: list[SavedEntry]
    saved_tensors: list[SavedTensor]
    memory_at_start_bytes: int
    notes: list[str] = field(default_factory=list)
    module_calls: list[ModuleCall] = field(default_factory=list)
    gradients_made: list[GradientMade] = field(default_factory=list)

    @property
    def op_names(self) -> list[str]:
        return [op.name for op in self.ops]


class StepRecorder:
    """Bookkeeping of one recorded step; see the module docstring."""

    def __init__(self, tracker: MemoryTracker, parameters: list[torch.Tensor], buffers: list[torch.Tensor],
                 known_inputs: list[torch.Tensor], device_type: str, held: list[torch.Tensor] = (),
                 park: ParkStore | None = None):
        self.tracker = tracker
        self.park = park
        self.device_type = device_type  # the step's device type: a tensor saved on another is never planned
        self.phase = PHASE_FORWARD
        self._ids = WeakTensorKeyDictionary()
        self.tensors: list[TensorRecord] = []
        self._storage_by_key: dict[int, StorageInfo] = {}
        self._num_storages = 0
        self.writer: dict[int, tuple[int, int]] = {}
        # storage key -> whether a random op wrote its current contents (dropout on CPU is bernoulli_ on an
        # empty tensor then div_: the writer is div_, but the mask is random)
        self.random_contents: dict[int, bool] = {}
        self.ops: list[_RawOp] = []
        self.reads: dict[int, list[int]] = {}  # storage id -> op indices that read it (ascending)
        self.entries: list[RawEntry] = []
        self.unpack_count = 0
        self.double_backward = False  # a forward entry was unpacked with grad mode on (create_graph=True)
        self.ops_under_other_hooks = 0  # forward ops whose saved tensors go to another saved-tensor hook
        self.packs_in_backward = 0  # tensors saved while backward runs (a forward run again there)
        self._pending_unpacks: list[RawEntry] = []
        self._level_before_op = 0
        self.internal_error: BaseException | None = None  # a failure of the recorder itself, not the workload
        self.unmatched_activation_inputs = 0  # activation storages met through a tensor object never seen
        self.current_module: Callable[[], str | None] = lambda: None  # the op's module path (profiler/modules.py)
        self.engine_sums: EngineSums | None = None  # set while backward runs (accumulation.py)
        # (op index, the storage its output could have taken over) of the op just recorded, settled at the next
        # op (Note [ Sums the engine runs in place ])
        self._takeover: tuple[int, StorageInfo] | None = None
        self.gathered = GatheredStorages(tracker)
        # Storages that exist before the step: their bytes are the memory at start (CPU bookkeeping).
        for kind, tensors, permanent in ((KIND_PARAMETER, parameters, True), (KIND_BUFFER, buffers, True),
                                         (KIND_INPUT, held, True), (KIND_INPUT, known_inputs, False)):
            for t in tensors:
                self._register_external(t, kind, permanent)

    # ---- storages and ids ---------------------------------------------------------------------
    def _new_storage(self, key: int, nbytes: int, kind: str, storage) -> StorageInfo:
        info = StorageInfo(self._num_storages, key, nbytes, kind, StorageWeakRef(storage) if key else None)
        self._num_storages += 1
        if key:
            self._storage_by_key[key] = info
        return info

    def _live_storage(self, key: int) -> StorageInfo | None:
        info = self._storage_by_key.get(key)
        if info is None or info.ref is None or info.ref.expired():
            return None
        return info

    def _register_external(self, t: torch.Tensor, kind: str, permanent: bool = False) -> StorageInfo | None:
        kb = opinfo.storage_key_and_bytes(t)
        if kb is None or kb[0] == 0:
            return None
        key, nbytes = kb
        info = self._live_storage(key)
        if info is None:
            info = self._new_storage(key, nbytes, kind, t.untyped_storage())
            info.permanent = permanent
            self.tracker.add_external(info)
        return info

    def storage_of(self, t: torch.Tensor) -> StorageInfo:
        """The storage of a tensor seen as an input: known, or external (alive before the step)."""
        kb = opinfo.storage_key_and_bytes(t)
        if kb is None or kb[0] == 0:
            return self._new_storage(0, 0 if kb is None else kb[1], KIND_INPUT, None)
        info = self._live_storage(kb[0])
        if info is None:
            info = self._register_external(t, KIND_INPUT)
        return info

    def _record_tensor(self, t: torch.Tensor, info: StorageInfo, producer: int | None, slot: int | None) -> int:
        tid = len(self.tensors)
        self.tensors.append(TensorRecord(
            id=tid, shape=list(t.shape), dtype=str(t.dtype), bytes=t.numel() * t.element_size(),
            storage=info.id, storage_bytes=info.nbytes, kind=info.kind, producer_op=producer, output_slot=slot))
        self._ids[t] = tid
        return tid

    def id_of_input(self, t: torch.Tensor) -> tuple[int, StorageInfo]:
        tid = self._ids.get(t)
        if tid is not None:
            rec = self.tensors[tid]
            info = self._live_storage(opinfo.storage_key_and_bytes(t)[0]) if rec.storage_bytes else None
            if info is not None and info.id == rec.storage:
                return tid, info
        # A tensor object never seen as an op output: a parameter, buffer or batch tensor, or (rarely) an
        # activation whose Python wrapper was re-created by C++; the storage says which.
        info = self.storage_of(t)
        producer = slot = None
        if info.kind == KIND_ACTIVATION:
            self.unmatched_activation_inputs += 1
            producer, slot = self.writer.get(info.key, (None, None))
        return self._record_tensor(t, info, producer, slot), info

    # ---- the dispatch side ----------------------------------------------------------------------
    def before_op(self) -> int:
        index = len(self.ops)
        for entry in self._pending_unpacks:
            entry.unpack_before_op = index
        self._pending_unpacks.clear()
        for info in self.gathered.resharded():  # its address is free: a storage allocated there is a new one
            if self._storage_by_key.get(info.key) is info:
                del self._storage_by_key[info.key]
        level = self.tracker.before_op()
        if self.ops:
            self.ops[-1].memory_after_rel_bytes = level
        self._level_before_op = level
        self._settle_takeover()
        return index

    def _settle_takeover(self) -> None:
        """An engine sum whose first argument nothing held once it returned ran in place in the step itself: no
        rise in it (Note [ Sums the engine runs in place ] 2)."""
        if self._takeover is None:
            return
        index, info = self._takeover
        self._takeover = None
        if info.ref is not None and info.ref.expired():
            op = self.ops[index]
            op.memory_peak_rel_bytes = op.memory_before_rel_bytes
            op.new_bytes = 0
            op.summed_in_place = True

    def after_op(self, index: int, func, args, kwargs, out) -> None:
        if self.phase == PHASE_FORWARD and torch.is_grad_enabled() and not self._own_hooks_on_top():
            self.ops_under_other_hooks += 1
        inputs = opinfo.tensor_arguments(args, kwargs)
        input_ids = []
        read_storages = set()
        for t in inputs:
            tid, info = self.id_of_input(t)
            input_ids.append(tid)
            if info is not None and info.nbytes:
                read_storages.add(info.id)
        for sid in read_storages:
            self.reads.setdefault(sid, []).append(index)
        outputs = opinfo.op_outputs(func, args, kwargs, out)
        output_ids = []
        new_storages = []
        for slot, t in enumerate(outputs):
            if t is None:
                continue
            kb = opinfo.storage_key_and_bytes(t)
            if kb is None or kb[0] == 0:
                info = self._new_storage(0, 0 if kb is None else kb[1], KIND_ACTIVATION, None)
            else:
                info = self._live_storage(kb[0])
                if info is not None and info.ref.cdata != t.untyped_storage()._cdata:
                    info = None  # the storage known there was resized to nothing (FSDP2's reshard): a new one
                if info is None:
                    info = self._new_storage(kb[0], kb[1], KIND_ACTIVATION, t.untyped_storage())
                    new_storages.append(info)
                elif kb[1] != info.nbytes:  # resized in place (out= ops may resize)
                    self.tracker.resized(info, kb[1])
                    info.nbytes = kb[1]
            output_ids.append(self._record_tensor(t, info, index, slot))
        random, inplace = opinfo.is_random(func), opinfo.is_inplace(func)
        if self.phase == PHASE_FORWARD:
            for slot, key in opinfo.written_outputs(func, args, kwargs, outputs):
                self.writer[key] = (index, slot)
                self.random_contents[key] = random or (inplace and self.random_contents.get(key, False))
        if opnames.gathers_parameters(opinfo.op_name(func)):
            for t in outputs:
                kb = opinfo.storage_key_and_bytes(t) if t is not None else None
                info = self._live_storage(kb[0]) if kb is not None and kb[0] else None
                if info is not None:
                    self.gathered.gathered(info)
        peak = self.tracker.after_op(new_storages)
        if self.engine_sums is not None and self.engine_sums.active:
            old = takeover_candidate(func, args, out)
            info = self._live_storage(opinfo.storage_key(old)) if old is not None else None
            if info is not None:
                self._takeover = (index, info)
        self.ops.append(_RawOp(
            name=opinfo.op_name(func), phase=self.phase, inputs=input_ids, outputs=output_ids,
            memory_peak_rel_bytes=peak, memory_before_rel_bytes=self._level_before_op,
            new_bytes=sum(info.nbytes for info in new_storages), is_random=random, is_inplace=inplace,
            is_view=opinfo.is_view(func), module=self.current_module(),
            private_generator=random and opinfo.uses_private_generator(func, args, kwargs)))

    def _own_hooks_on_top(self) -> bool:
        """Whether a tensor autograd saved now would reach this recorder's pack hook (the innermost hooks win)."""
        top = torch._C._autograd._top_saved_tensors_default_hooks(False)
        return top is not None and top[0] == self.pack

    # ---- the autograd side ----------------------------------------------------------------------
    def pack(self, x: torch.Tensor) -> Any:
        try:
            return self._pack(x)
        except Exception as exc:
            self.internal_error = exc
            raise

    def _pack(self, x: torch.Tensor) -> Any:
        if torch._C._current_graph_task_id() != -1:
            # saved during backward (the forward that reentrant checkpointing re-runs there, double
            # backward): a phase of its own, never a saved tensor of a forward op; the runtime keeps these
            self.packs_in_backward += 1
            return None, x
        index = len(self.entries)
        tid, info = self.id_of_input(x)
        on_step_device = x.device.type == self.device_type
        writer = None
        if info is not None and info.kind == KIND_ACTIVATION and info.key:
            writer = self.writer.get(info.key)
        self.entries.append(RawEntry(
            index=index, tensor=tid, storage=info.id if info is not None else -1,
            kind=info.kind if info is not None else KIND_INPUT, writer=writer,
            random_contents=writer is not None and self.random_contents.get(info.key, False), shape=list(x.shape),
            stride=list(x.stride()), storage_offset=x.storage_offset(), dtype=str(x.dtype),
            pack_after_op=len(self.ops) - 1 if self.ops else NO_OP, on_step_device=on_step_device))
        if (self.park is not None and on_step_device and info is not None and info.kind == KIND_ACTIVATION
                and info.key and info.nbytes):
            return index, self.park.park(x, tag=(info, writer))
        held = held_by_autograd(x)
        if tid is not None:
            self._ids[held] = tid  # backward reads it through the unpacked tensor, this object
        return index, held

    def unpack(self, handle: Any) -> torch.Tensor:
        index, x = handle
        if index is None:  # saved during backward: not on the backward clock (the runtime's neither)
            return x
        entry = self.entries[index]
        if torch.is_grad_enabled():  # the engine runs a create_graph backward with grad mode on
            self.double_backward = True
        if entry.unpack_order is None:
            entry.unpack_order = self.unpack_count
            self._pending_unpacks.append(entry)
        self.unpack_count += 1
        if isinstance(x, ParkHandle):
            x = self._unpark(x, entry)
        return x

    def _unpark(self, handle: ParkHandle, entry: RawEntry) -> torch.Tensor:
        x, restored = self.park.unpack(handle)
        if restored:  # a new storage standing for the saved one: same StorageInfo, same writer
            info, writer = handle.tag
            key = opinfo.storage_key_and_bytes(x)[0]
            if self._storage_by_key.get(info.key) is info:  # its old address may hold another storage later
                del self._storage_by_key[info.key]
            info.key, info.ref = key, StorageWeakRef(x.untyped_storage())
            self._storage_by_key[key] = info
            if writer is not None:
                self.writer[key] = writer
            self.tracker.restored(info)
        self._ids[x] = entry.tensor
        return x

    # ---- the result -----------------------------------------------------------------------------
    def finish(self, in_op_peaks: dict[int, int] | None = None) -> Capture:
        """Close the step (memory after the last op) and build the profile's records.

        `in_op_peaks` (CPU): op index -> the allocator's peak during the op above its starting level, which
        includes kernel-internal temporaries the dispatch mode cannot see.
        """
        level = self.tracker.before_op()
        if self.ops:
            self.ops[-1].memory_after_rel_bytes = level
        self._settle_takeover()
        late = self.tracker.mid_step_allocations()  # (first op, bytes): counted at start, allocated later
        start = self.tracker.start_bytes() - sum(nbytes for _, nbytes in late)
        late_bytes = list(accumulate(sum(nbytes for first, nbytes in late if first == i) for i in range(len(self.ops))))
        in_op_peaks = in_op_peaks or {}
        ops = []
        for i, raw in enumerate(self.ops):
            base = start + late_bytes[i]
            after = base + raw.memory_after_rel_bytes
            peak = base + raw.memory_peak_rel_bytes
            if i in in_op_peaks and not raw.summed_in_place:  # the allocator saw the new storage it made
                peak = max(peak, base + raw.memory_before_rel_bytes + max(raw.new_bytes, in_op_peaks[i]))
            peak = max(peak, after)
            ops.append(OpRecord(index=i, name=raw.name, phase=raw.phase, time_s=0.0, inputs=raw.inputs,
                                outputs=raw.outputs, memory_after_bytes=after, memory_peak_bytes=peak,
                                is_random=raw.is_random, is_inplace=raw.is_inplace, is_view=raw.is_view,
                                module=raw.module, private_generator=raw.private_generator))
        entries, saved, notes = saved_records(self.entries, ops, self.tensors, self.reads)
        if self.double_backward:
            notes.append(DOUBLE_BACKWARD_NOTE)
        elif self.packs_in_backward:
            notes.append(backward_forward_note(self.packs_in_backward))
        if self.ops_under_other_hooks:
            forward_ops = sum(1 for op in self.ops if op.phase == PHASE_FORWARD)
            notes.append(other_hooks_note(self.ops_under_other_hooks, forward_ops))
        if self.unmatched_activation_inputs:
            notes.append(f"{self.unmatched_activation_inputs} activation tensors were met through a new Python "
                         f"object (named by their storage's writer)")
        return Capture(ops=ops, tensors=self.tensors, saved_entries=entries, saved_tensors=saved,
                       memory_at_start_bytes=start, notes=notes)


class CaptureMode(TorchDispatchMode):
    """Feeds every dispatched op to a StepRecorder (ops run unchanged)."""

    def __init__(self, recorder: StepRecorder):
        super().__init__()
        self.recorder = recorder

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if not opinfo.is_counted(func):  # profiler::* (record_function regions): not numbered
            return func(*args, **kwargs)
        recorder = self.recorder
        try:
            index = recorder.before_op()
        except Exception as exc:
            recorder.internal_error = exc
            raise
        with recorder.tracker.op_scope(index):
            out = func(*args, **kwargs)
        try:
            recorder.after_op(index, func, args, kwargs, out)
        except Exception as exc:
            recorder.internal_error = exc
            raise
        return out


class TimingMode(TorchDispatchMode):
    """Times every dispatched op: perf_counter on CPU; on CUDA, a pair of CUDA events around each op,
    recorded on `device`'s current stream (where its kernels run, whichever device is current)."""

    def __init__(self, device: torch.device):
        super().__init__()
        self.device = device
        self.cuda = device.type == "cuda"
        self.names: list[str] = []
        self._cpu_times: list[float] = []
        self._events: list[tuple[torch.cuda.Event, torch.cuda.Event]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if not opinfo.is_counted(func):
            return func(*args, **kwargs)
        self.names.append(opinfo.op_name(func))
        if self.cuda:
            stream = torch.cuda.current_stream(self.device)
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record(stream)
            out = func(*args, **kwargs)
            end.record(stream)
            self._events.append((start, end))
            return out
        t0 = time.perf_counter()
        out = func(*args, **kwargs)
        self._cpu_times.append(time.perf_counter() - t0)
        return out

    def times_s(self) -> list[float]:
        """Per-op times of the step (synchronises the device on CUDA)."""
        if not self.cuda:
            return list(self._cpu_times)
        torch.cuda.synchronize(self.device)
        return [start.elapsed_time(end) / 1e3 for start, end in self._events]  # elapsed_time is in ms


def held_by_autograd(x: torch.Tensor) -> torch.Tensor:
    """What a pack hook of the profiler gives autograd to hold for `x`: `x` detached, outside every dispatch
    mode (no op of the step). Not `x` itself: a tensor an op saves as its own output holds that op's node as
    its grad_fn, so the node would hold itself through its saved tensor, a cycle only running the node breaks;
    a node backward never runs (an output the loss does not use: Canine's final character encoder) then keeps
    what it saved to the end of the step and beyond, where the step without hooks frees it as the forward
    lets go (Canine's recorded peak 0.8 MB over its measured one). Autograd gives the unpacked tensor its
    grad_fn back itself."""
    with _regen_ops():
        return x.detach()


def pass_through_pack(x: torch.Tensor) -> torch.Tensor:
    return held_by_autograd(x)


def pass_through_unpack(x: torch.Tensor) -> torch.Tensor:
    return x
