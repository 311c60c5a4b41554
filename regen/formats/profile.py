"""The profile: what one real training step of a workload did, op by op (`format: regen-profile/2`).

Written by `regen profile` (regen.profiler), read by `regen solve` (regen.planner) and `regen show`.

Indices and ids
---------------
* Ops are numbered in execution order over the whole step: forward ops (everything dispatched from
  the model's forward call through the loss) come first, then backward ops. `OpRecord.index` is the
  position in `Profile.ops`.
* Every tensor an op reads or writes has an integer id (`TensorRecord.id`). Tensors that no op of the
  step produced (parameters, buffers, the batch) have `producer_op = None` and a `kind` saying what
  they are.
* A *saved entry* is one tensor handed to autograd's pack hook, in pack order (`SavedEntry.index`).
  Several entries can share one storage (a tensor and its views): they belong to one *saved tensor*
  (`SavedTensor`), the planner's candidate, whose bytes are the storage's and are counted once.
  Entries that are parameters, views of parameters, buffers or the batch belong to no candidate.

Memory
------
`OpRecord.memory_after_bytes` is device memory allocated after the op in the unplanned step and
`memory_peak_bytes` the peak while it ran; both are absolute (they include parameters, gradients,
optimizer state and the batch, i.e. `memory_at_start_bytes`).

The call (optional)
-------------------
`Profile.call` (`CallSignature`) says how the step called the model: each tensor argument's shape,
dtype and whether it required grad, and how many parameters required grad. Besides the ops, these decide
what autograd saves (a discriminator whose input requires grad saves more), so the runtime chooses among a
set of plans for one model by it (regen.call_signature).

Gradients (optional)
--------------------
`Profile.gradients_made` lists when the step made each parameter's gradient (`GradientMade`): the last op
dispatched before autograd stored it, and its storage bytes (a storage counted once; together they are
`static_memory.gradient_bytes`). A loop that holds its gradients from step to step holds, at op t, those the
profiled step had not made before t (regen.planner.held_gradients). Profiles without it are planned as if
no gradient were made before the step's end.

Modules (optional)
------------------
`OpRecord.module` is the path from the root module (`blocks.3.mlp`; `""` is the root itself) of the
innermost module whose forward (or, for a backward op, whose backward) the op ran in, None outside
any. `Profile.module_calls` lists every call of a submodule in the forward (`ModuleCall`): its first
and last forward op, its tensor arguments, and the saved entries packed during it. Profiles without
them load; the planner then has no region candidates.

Runtime costs (optional)
------------------------
`Profile.runtime_costs` holds what regen's runtime adds per event on the profiled machine (a dispatch
round trip per tracked forward op, capturing and replaying a recipe op, a recipe's fixed cost, the
compute thread's share of a swap), which the planner adds to a plan's predicted time. Profiles without
it are planned without those costs; profiles written before `swap_s` existed load with 0 for it.

Calibration (optional)
----------------------
`Profile.calibration` (`Calibration`) holds what the workload's own steps said about those charges: a
recompute plan and a swap plan run against the unplanned step, interleaved (regen.calibration). Its
`recompute_scale` multiplies what the planner charges for a recompute (its ops, regen's own work around
them), `region_scale` what it charges for a module call replayed whole (a region; absent: `recompute_scale`
for those too), `swap_byte_s` adds a charge per swapped byte to `swap_s` (what copies take from compute beside them:
on a CPU device the emulated link's memcpy on the same cores), and `runtime_step_s` is what a planned step
costs with nothing to do (every tensor kept: regen's saved-tensor hooks on every pack and unpack, its module
hooks and step bookkeeping), added to every plan's predicted step. Profiles without it are planned with the
probe's figures alone (scale 1, no per-byte charge, no per-step charge).
"""

from __future__ import annotations

import hashlib
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Iterable

from regen.errors import FormatError
from regen.formats.yamlio import build_dataclass, dump_document, load_document, optional, require, required

PROFILE_FORMAT = "regen-profile/2"
PROFILE_VERSIONS = (1, 2)  # 1: no SavedTensor.held_until_op

PHASE_FORWARD = "forward"
PHASE_BACKWARD = "backward"

# TensorRecord.kind / SavedEntry.excluded_reason values
KIND_ACTIVATION = "activation"  # produced by an op of the step
KIND_PARAMETER = "parameter"  # a parameter or a view of one (compared by storage)
KIND_BUFFER = "buffer"  # a module buffer (e.g. batch-norm running stats)
KIND_INPUT = "input"  # the batch, or another tensor from outside the step
# SavedEntry.excluded_reason only: saved on another device than the step's (a CUDA attention's random seed
# held on the host): none of the device's memory, never planned, kept as autograd keeps it
EXCLUDED_OTHER_DEVICE = "other-device"

# The end of a profile note saying the model saves activations through saved-tensor hooks of its own (its own
# activation checkpointing or offloading: regen.profiler.capture): `regen solve` repeats such a note.
OTHER_HOOKS_ADVICE = ("what they save is not planned, and no plan goes below the memory they keep: turn them off "
                      "before profiling to let regen choose (Hugging Face: model.gradient_checkpointing_disable())")


@dataclass
class OpRecord:
    index: int
    name: str  # e.g. "aten.addmm.default"
    phase: str  # "forward" | "backward"
    time_s: float  # median over repeats
    inputs: list[int]  # tensor ids, in argument order
    outputs: list[int]  # tensor ids, in output order (slot = position)
    memory_after_bytes: int
    memory_peak_bytes: int
    is_random: bool = False  # draws from the RNG (dropout, rand*)
    is_inplace: bool = False  # writes into one of its inputs
    is_view: bool = False  # outputs alias an input's storage
    module: str | None = None  # innermost module running it (path from the root), None outside any
    private_generator: bool = False  # draws from a torch.Generator argument (generator=g), not the global RNG


@dataclass
class ModuleCall:
    """One call of a submodule during the forward: its extent in ops and saved entries."""

    module: str  # path from the root module, e.g. "blocks.3.mlp"
    call: int  # this module's n-th call in the forward (0 = first)
    first_op: int  # first forward op dispatched inside the call
    last_op: int  # last forward op dispatched inside the call
    inputs: list[int]  # tensor ids of its tensor arguments (flattened args, then kwargs)
    first_entry: int  # SavedEntry index of the first pack inside the call
    num_entries: int  # saved entries packed inside the call (from first_entry on, consecutive)
    buffer_bytes: int = 0  # bytes of the module's buffers (running stats...), snapshot around a replay
    depth: int = 0  # nesting depth (1 for a child of the root)
    # what the call leaves behind besides its output (a tensor in a cache object or a module attribute, a
    # rebound attribute), which a replay would write again: such a call is never a region. None: nothing
    # (or not probed: a profile written before the probe looked)
    leaves_behind: str | None = None


@dataclass
class TensorRecord:
    id: int
    shape: list[int]
    dtype: str  # e.g. "torch.float32"
    bytes: int  # bytes of this tensor's elements (numel * element size)
    storage: int  # storage id; tensors sharing one storage share it
    storage_bytes: int
    kind: str  # activation | parameter | buffer | input
    producer_op: int | None = None
    output_slot: int | None = None


@dataclass
class SavedEntry:
    index: int  # pack order
    tensor: int  # tensor id of what was packed
    saved_tensor: int | None  # candidate id, None when excluded
    excluded_reason: str | None  # parameter | buffer | input | other-device | None
    shape: list[int]
    stride: list[int]
    storage_offset: int
    dtype: str
    pack_after_op: int  # index of the last op dispatched before the pack
    unpack_order: int | None = None  # position in the step's unpack sequence, None if never unpacked
    unpack_before_op: int | None = None  # index of the first op dispatched after the unpack


@dataclass
class SavedTensor:
    """A planning candidate: one storage that autograd keeps for backward."""

    id: int
    tensor: int  # tensor id of the storage's producing output
    storage: int
    producer_op: int  # last op that wrote the storage before it was saved
    output_slot: int
    bytes: int  # storage bytes, counted once however many entries share it
    shape: list[int]  # of the producing output
    dtype: str
    last_forward_use: int  # last forward op that reads it (>= producer_op)
    backward_uses: list[int]  # sorted backward op indices that read it
    entries: list[int]  # SavedEntry indices
    is_random: bool = False  # producer draws from the RNG
    is_inplace: bool = False  # producer wrote into an existing storage
    # the last op at whose start something other than autograd (a list, a module attribute, a Python local,
    # the model's output) still held the storage in the unplanned step: dropping autograd's reference frees
    # nothing before then (regen.profiler.liveness). None: not measured (a regen-profile/1 file), taken as
    # its last forward use
    held_until_op: int | None = None

    @property
    def first_backward_use(self) -> int | None:
        return self.backward_uses[0] if self.backward_uses else None

    @property
    def last_backward_use(self) -> int | None:
        return self.backward_uses[-1] if self.backward_uses else None


@dataclass
class DeviceInfo:
    type: str  # "cpu" | "cuda"
    name: str
    total_memory_bytes: int
    d2h_bytes_per_s: float
    h2d_bytes_per_s: float
    bandwidth_method: str  # e.g. "pinned cudaMemcpyAsync" or "host memcpy (CPU device: no real transfer)"


@dataclass
class RuntimeCosts:
    """What regen's runtime adds per event on the profiled machine (the probe in regen.runtime.self_timing)."""

    dispatch_op_s: float  # a forward op through the runtime's dispatch mode, while it tracks the forward
    capture_op_s: float  # capturing a recipe op's arguments in forward
    replay_op_s: float  # replaying a recipe op in backward, beyond the op's own time
    recipe_s: float  # one replayed recipe, besides its ops
    method: str
    # what one swap costs the compute thread (issuing the copy-out, releasing its source, issuing the
    # copy-in, waiting for it, and what the engine's work does to compute next to it), not the transfers
    swap_s: float = 0.0
    # each figure's spread over the probe's interleaved repeats: (upper quartile - lower quartile) / median
    spreads: dict[str, float] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)  # figures that fell back to their defaults, and why

    def figures(self) -> dict[str, float]:
        """The charged figures by field name (those RUNTIME_COST_BOUNDS_S bounds)."""
        return {name: getattr(self, name) for name in RUNTIME_COST_BOUNDS_S}


# NOTE [ Bounds of the runtime's own costs ]
# The probe times regen's Python per event (regen.runtime.self_timing); a loaded machine can inflate one
# reading by orders of magnitude (a millisecond per dispatched op, tens of milliseconds per swap), and the
# planner believes what the profile says: a swap charged 24 ms is never chosen. So each figure has a
# documented default (its order on a quiet machine, CPU or GPU host) and an upper bound well above
# anything regen's own code takes there; the probe re-measures a figure whose repeats spread widely and
# falls back to the default, with a note, when it stays out of bounds, and a profile whose figure is out
# of bounds is refused on load, so none reaches a plan.
RUNTIME_COST_DEFAULTS_S = {"dispatch_op_s": 20e-6, "capture_op_s": 20e-6, "replay_op_s": 15e-6, "recipe_s": 50e-6,
                           "swap_s": 300e-6}
RUNTIME_COST_BOUNDS_S = {"dispatch_op_s": 200e-6, "capture_op_s": 300e-6, "replay_op_s": 300e-6, "recipe_s": 1e-3,
                         "swap_s": 5e-3}


CALIBRATION_SCALE_BOUNDS = (0.5, 3.0)  # a recompute_scale outside these is a measurement gone wrong
# of the step time: a planned step's own cost (Calibration.runtime_step_s) beyond it is a measurement gone wrong
CALIBRATION_MAX_RUNTIME_STEP_FRACTION = 0.5
CALIBRATION_MAX_SWAP_BYTE_S = 1e-8  # 10 ns a byte (0.1 GB/s of compute lost per swap): beyond, the same


@dataclass
class Calibration:
    """The planner's charges checked against the workload's own steps (regen.calibration)."""

    recompute_scale: float  # measured time of a plan's recomputes over what the planner charged for them
    swap_byte_s: float  # compute-thread time per swapped byte, beyond RuntimeCosts.swap_s
    rounds: int  # interleaved rounds of (unplanned, keep-everything, recompute and swap plans) steps it measured
    method: str
    notes: list[str] = field(default_factory=list)  # figures that fell back to their defaults, and why
    # a planned step's own cost with every tensor kept (regen's hooks and step bookkeeping), per step;
    # 0 in profiles calibrated before it was measured
    runtime_step_s: float = 0.0
    # measured time of module replays (regions) over their charge, from a plan that replays every repeated
    # block and nothing else; None: recompute_scale stands for them too (no such plan, or an older profile)
    region_scale: float | None = None


@dataclass
class GradientMade:
    """A parameter's gradient made by the profiled step: stored after op `after_op`, `bytes` of storage."""

    after_op: int
    bytes: int


@dataclass
class StaticMemory:
    parameter_bytes: int
    gradient_bytes: int
    optimizer_state_bytes: int


@dataclass
class CallInput:
    """A tensor argument of the model's call: `name` is its position ("0", "1"...) or its keyword, with
    ".k" for the k-th tensor inside a container argument."""

    name: str
    shape: list[int]
    dtype: str
    requires_grad: bool


@dataclass
class CallSignature:
    """How a step called the model, as far as it decides what autograd saves (regen.call_signature)."""

    inputs: list[CallInput]
    trainable_parameters: int  # the model's parameters that required grad


def call_signature_from_document(raw: Any, where: str) -> CallSignature | None:
    """The optional `call` of a profile or a plan."""
    if raw is None:
        return None
    sig = build_dataclass(CallSignature, raw, f"{where}: call")
    sig.inputs = [build_dataclass(CallInput, x, f"{where}: call.inputs[{i}]") for i, x in enumerate(sig.inputs or [])]
    sig.trainable_parameters = int(sig.trainable_parameters)
    return sig


@dataclass
class Profile:
    workload: dict[str, Any]  # {"name": ..., "args": {...}, "batch_size": ...}
    device: DeviceInfo
    static_memory: StaticMemory
    versions: dict[str, str]
    repeats: int
    step_time_s: float  # forward + backward, median over repeats
    optimizer_step_time_s: float
    memory_at_start_bytes: int
    peak_bytes: int
    fingerprint: str
    ops: list[OpRecord]
    tensors: list[TensorRecord]
    saved_entries: list[SavedEntry]
    saved_tensors: list[SavedTensor]
    format: str = PROFILE_FORMAT
    notes: list[str] = field(default_factory=list)
    module_calls: list[ModuleCall] = field(default_factory=list)  # optional: submodule calls of the forward
    runtime_costs: RuntimeCosts | None = None  # optional: without it the planner charges none
    call: CallSignature | None = None  # optional: how the step called the model
    # optional: the forward (model call through the loss) of the plain steps, median; it tells the time the
    # forward spends outside ops (module code a region replay runs again) from the backward's
    forward_time_s: float | None = None
    calibration: Calibration | None = None  # optional: without it the probe's charges stand alone
    gradients_made: list[GradientMade] | None = None  # optional: when the step made each gradient

    # ---- convenience -------------------------------------------------------------------------
    @property
    def num_forward_ops(self) -> int:
        return sum(1 for op in self.ops if op.phase == PHASE_FORWARD)

    @property
    def candidate_bytes(self) -> int:
        return sum(t.bytes for t in self.saved_tensors)

    def peak_op(self) -> OpRecord | None:
        return max(self.ops, key=lambda op: op.memory_peak_bytes, default=None)

    def tensor_by_id(self) -> dict[int, TensorRecord]:
        return {t.id: t for t in self.tensors}

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        out = {"format": d.pop("format")}
        out.update(d)
        return out


# ---- fingerprint -------------------------------------------------------------------------------


class OpFingerprint:
    """Hash of the forward op sequence: op names and output shapes/dtypes, in order.

    The profiler and the runtime feed it the same way (`add` once per forward op), so a plan made
    for one model and batch shape can be told apart from another at the first step.
    """

    def __init__(self) -> None:
        self._hash = hashlib.sha256()
        self.count = 0

    def add(self, name: str, outputs: Iterable[tuple[tuple[int, ...], str]]) -> None:
        sig = ";".join(f"{'x'.join(map(str, shape))}:{dtype}" for shape, dtype in outputs)
        self._hash.update(f"{name}({sig})\n".encode())
        self.count += 1

    def hexdigest(self) -> str:
        return f"{self.count}:{self._hash.hexdigest()[:32]}"


def op_fingerprint(ops: list[OpRecord], tensors: list[TensorRecord]) -> str:
    """The fingerprint of a profile's forward ops (see OpFingerprint)."""
    by_id = {t.id: t for t in tensors}
    fp = OpFingerprint()
    for op in ops:
        if op.phase != PHASE_FORWARD:
            continue
        fp.add(op.name, [(tuple(by_id[o].shape), by_id[o].dtype) for o in op.outputs])
    return fp.hexdigest()


# ---- io ----------------------------------------------------------------------------------------


def save_profile(profile: Profile, path: str | Path) -> None:
    dump_document(profile.to_dict(), path, as_json=True)


def load_profile(path: str | Path) -> Profile:
    """Read a profile file; malformed files and unknown versions raise FormatError."""
    return profile_from_document(load_document(path, "profile", PROFILE_VERSIONS), str(path))


def profile_from_document(doc: dict[str, Any], where: str) -> Profile:
    """The Profile of a parsed document whose format was checked (load_document)."""
    try:
        ops = [build_dataclass(OpRecord, o, f"{where}: ops[{i}]") for i, o in enumerate(require(doc, "ops", where))]
        tensors = [build_dataclass(TensorRecord, t, f"{where}: tensors[{i}]")
                   for i, t in enumerate(require(doc, "tensors", where))]
        entries = [build_dataclass(SavedEntry, e, f"{where}: saved_entries[{i}]")
                   for i, e in enumerate(require(doc, "saved_entries", where))]
        saved = [build_dataclass(SavedTensor, s, f"{where}: saved_tensors[{i}]")
                 for i, s in enumerate(require(doc, "saved_tensors", where))]
        calls = [build_dataclass(ModuleCall, c, f"{where}: module_calls[{i}]")
                 for i, c in enumerate(doc.get("module_calls") or [])]
        step_time_s = required(doc, "step_time_s", float, where)
        profile = Profile(
            workload=require(doc, "workload", where),
            device=build_dataclass(DeviceInfo, require(doc, "device", where), f"{where}: device"),
            static_memory=build_dataclass(StaticMemory, require(doc, "static_memory", where), f"{where}: static_memory"),
            versions=require(doc, "versions", where),
            repeats=required(doc, "repeats", int, where),
            step_time_s=step_time_s,
            optimizer_step_time_s=required(doc, "optimizer_step_time_s", float, where),
            memory_at_start_bytes=required(doc, "memory_at_start_bytes", int, where),
            peak_bytes=required(doc, "peak_bytes", int, where),
            fingerprint=str(require(doc, "fingerprint", where)),
            ops=ops, tensors=tensors, saved_entries=entries, saved_tensors=saved,
            format=str(doc["format"]), notes=list(doc.get("notes") or []), module_calls=calls,
            runtime_costs=_runtime_costs(doc, where),
            call=call_signature_from_document(doc.get("call"), where),
            forward_time_s=optional(doc, "forward_time_s", float, where),
            calibration=_calibration(doc, where, step_time_s),
            gradients_made=_gradients_made(doc, where),
        )
    except (TypeError, ValueError) as exc:
        raise FormatError(f"{where}: malformed profile ({exc})") from None
    _check_consistency(profile, where)
    return profile


def _gradients_made(doc: dict[str, Any], where: str) -> list[GradientMade] | None:
    raw = doc.get("gradients_made")
    if raw is None:
        return None
    if not isinstance(raw, list):
        raise FormatError(f"{where}: gradients_made must be a list, found {type(raw).__name__}")
    return [build_dataclass(GradientMade, g, f"{where}: gradients_made[{i}]") for i, g in enumerate(raw)]


def _runtime_costs(doc: dict[str, Any], where: str) -> RuntimeCosts | None:
    costs = doc.get("runtime_costs")
    if costs is None:
        return None
    built = build_dataclass(RuntimeCosts, costs, f"{where}: runtime_costs")  # seconds: never negative
    for name, value in built.figures().items():
        if value > RUNTIME_COST_BOUNDS_S[name]:
            raise FormatError(f"{where}: runtime_costs: {name} {value:.3g} s is above its bound "
                              f"{RUNTIME_COST_BOUNDS_S[name]:.3g} s (a measurement gone wrong); profile again")
    return built


def _calibration(doc: dict[str, Any], where: str, step_time_s: float) -> Calibration | None:
    built = doc.get("calibration")
    if built is None:
        return None
    c = build_dataclass(Calibration, built, f"{where}: calibration")
    scale, byte_s, rounds = float(c.recompute_scale), float(c.swap_byte_s), int(c.rounds)
    lo, hi = CALIBRATION_SCALE_BOUNDS
    if not lo <= scale <= hi:
        raise FormatError(f"{where}: calibration.recompute_scale {c.recompute_scale} is outside [{lo}, {hi}]")
    region_scale = None if c.region_scale is None else float(c.region_scale)
    if region_scale is not None and not lo <= region_scale <= hi:
        raise FormatError(f"{where}: calibration.region_scale {c.region_scale} is outside [{lo}, {hi}]")
    if not 0 <= byte_s <= CALIBRATION_MAX_SWAP_BYTE_S:
        raise FormatError(f"{where}: calibration.swap_byte_s {c.swap_byte_s} is outside "
                          f"[0, {CALIBRATION_MAX_SWAP_BYTE_S:g}] s a byte")
    if rounds < 0:
        raise FormatError(f"{where}: calibration.rounds must be non-negative")
    runtime_step_s = float(c.runtime_step_s)
    if not 0 <= runtime_step_s <= CALIBRATION_MAX_RUNTIME_STEP_FRACTION * step_time_s:
        raise FormatError(f"{where}: calibration.runtime_step_s {c.runtime_step_s} is outside [0, "
                          f"{CALIBRATION_MAX_RUNTIME_STEP_FRACTION:g} x the step time {step_time_s:g} s]")
    return Calibration(scale, byte_s, rounds, str(c.method), [str(n) for n in c.notes or []], runtime_step_s,
                       region_scale)


def _check_consistency(profile: Profile, where: str) -> None:
    """Cheap structural checks so a hand-edited or truncated file fails here, not in the solver."""
    n = len(profile.ops)
    for i, op in enumerate(profile.ops):
        if op.index != i:
            raise FormatError(f"{where}: ops[{i}] has index {op.index}; ops must be numbered 0..{n - 1} in order")
        if op.phase not in (PHASE_FORWARD, PHASE_BACKWARD):
            raise FormatError(f"{where}: ops[{i}] has phase '{op.phase}', expected forward or backward")
    for s in profile.saved_tensors:
        if not (0 <= s.producer_op < n) or not (0 <= s.last_forward_use < n):
            raise FormatError(f"{where}: saved tensor {s.id} refers to an op outside 0..{n - 1}")
        if any(not (0 <= u < n) for u in s.backward_uses):
            raise FormatError(f"{where}: saved tensor {s.id} has a backward use outside 0..{n - 1}")
        if s.held_until_op is not None and not (0 <= s.held_until_op < n):
            raise FormatError(f"{where}: saved tensor {s.id} is held until an op outside 0..{n - 1}")
        if s.bytes < 0:
            raise FormatError(f"{where}: saved tensor {s.id} has negative bytes")
    for i, g in enumerate(profile.gradients_made or []):  # (negative bytes are refused by build_dataclass)
        if not 0 <= g.after_op < n:
            raise FormatError(f"{where}: gradients_made[{i}] refers to an op outside 0..{n - 1}")
    num_entries = len(profile.saved_entries)
    for c in profile.module_calls:
        if not (0 <= c.first_op <= c.last_op < n) or c.num_entries < 0 or c.first_entry + c.num_entries > max(
                num_entries, c.first_entry):
            raise FormatError(f"{where}: module call {c.module!r} #{c.call} refers to ops or saved entries outside "
                              f"the profile")
