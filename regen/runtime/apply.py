"""`regen.apply(model, plan)`: replay a plan inside an unmodified training loop.

A forward pre-hook on the root module starts a *step* whenever the model is called in training mode
with grad enabled (no_grad and eval forwards are left alone; under DistributedDataParallel the hooks go
on the wrapped module). A step pushes the handle's `ForwardTracker` dispatch mode, which numbers the
forward ops (the loss included) until the plan's `num_forward_ops` have run or backward begins, and a
pair of saved-tensor hooks:

* pack: the tensor's storage is looked up in the step's writer map (`opinfo.written_outputs`), its
  plan entry found by `(producer_op, output_slot)` and checked by shape and dtype; then it is kept
  (`x.detach()`), swapped (storage copied to the host pool, a handle returned) or dropped for
  recompute (a handle returned; its recipe ops were captured as they ran);
* unpack: counts the step's unpacks (the backward clock of docs/internals.md), issues the copy-ins
  scheduled at that position, and rebuilds the entry over its restored or recomputed storage.

The first planned step also hashes the forward ops and compares the result with `plan.fingerprint`.
Any mismatch raises `PlanMismatchError`, or with `on_mismatch="keep"` warns and keeps every later
tensor of that step.

Pack-order fast path: for a plan without recompute decisions (keep-all, swap-only) the dispatch mode
is only needed until a step has been verified. That step records its forward packs in order (shape,
dtype, decision or none); later steps push no dispatch mode at all and give the k-th pack the k-th
recorded decision, after checking the packed tensor's shape and dtype (and, for a swapped candidate
saved more than once, that every entry views the one storage). A different shape or dtype, or a
forward that saved fewer tensors by the time backward starts, is a mismatch as above; packs after the
recorded count are kept. Plans with recompute decisions match packs the same way but keep the dispatch
mode on later steps until their last tracked op has run, doing the minimum per op (`_FastOps`): only the
verified step's recipe ops (name checked, captured, references compared with the verified step's) and
the producers of what they read (outputs noted in a small writer map) do more than count and run.

Restored and recomputed storages are dropped after their last unpack; host ranges go back to the pool
when autograd frees the handles; an exception inside the `with` block aborts the live steps and leaves
no hook installed.
"""

from __future__ import annotations

import heapq
import itertools
import warnings
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn
from torch.utils._python_dispatch import _get_current_dispatch_mode, _get_current_dispatch_mode_stack

from regen.errors import PlanMismatchError, RegenError
from regen.formats.plan import ACTION_KEEP, ACTION_RECOMPUTE, ACTION_SWAP, Plan, load_plan
from regen.formats.profile import OpFingerprint
from regen.opinfo import op_name, storage_key, tensor_outputs, written_outputs
from regen.runtime.matching import (PHASE_CLOSED, PHASE_FORWARD, PHASE_TAIL, DecisionInfo, ForwardTracker,
                                    PlanIndex, index_plan)
from regen.runtime.recompute import CapturedOp, capture_op, check_captured_name, replay_recipe
from regen.runtime.swap import CopyIn, CopyOut, Geometry, HostPool, SwapEngine, view_of

ON_MISMATCH_CHOICES = ("raise", "keep")

# regen's own small ops (detach, set_, copies) skip every Python dispatch mode: they are never counted and
# cost no Python round trip. Recipe replays run with only the tracker paused (other modes still see them).
_regen_ops = torch._C._DisableTorchDispatch
_dispatch_stack_len = torch._C._len_torch_dispatch_stack
_PLAIN_TENSOR_TYPES = (torch.Tensor, nn.Parameter)  # no __torch_dispatch__ of their own


class PlanMismatchWarning(UserWarning):
    """A step ran unplanned because the plan did not fit it (on_mismatch="keep")."""


@dataclass
class RuntimeStats:
    """What the handle did so far (cumulative over steps)."""

    steps: int = 0  # steps started (training forwards with grad)
    planned_steps: int = 0  # steps whose every pack followed the plan
    unplanned_steps: int = 0  # steps that fell back to keep (on_mismatch="keep")
    swapped_tensors: int = 0
    swapped_bytes: int = 0
    dropped_tensors: int = 0  # dropped in forward for recompute
    recomputes: int = 0  # recipe replays
    synchronous_copy_ins: int = 0  # copy-ins issued at their consumer instead of their planned unpack


class _Candidate:
    """One storage of one step: what the runtime did with it and what it still owes."""

    __slots__ = ("key", "info", "mode", "pending", "live", "storage", "copy_out", "copy_in", "recipe_ran",
                 "version", "released", "storage_key")

    def __init__(self, key, info):
        self.key = key
        self.info: DecisionInfo | None = info
        self.mode: str | None = None  # keep | swap | recompute, as actually done this step
        self.pending = 0  # first unpacks not yet done + dependent recipes not yet run
        self.live = 0  # handles autograd still holds
        self.storage: torch.Tensor | None = None  # a tensor over the resident storage (kept/restored/rebuilt)
        self.copy_out: CopyOut | None = None
        self.copy_in: CopyIn | None = None
        self.recipe_ran = False
        self.version = 0  # kept anchors: version counter when packed
        self.released = False
        self.storage_key: int | None = None  # swapped: the storage copied out (fast-path check)


class _Saved:
    """What autograd stores for a swapped or dropped entry: the candidate and the entry's geometry."""

    __slots__ = ("step", "cand", "geometry", "unpacked")

    def __init__(self, step, cand, geometry):
        self.step = step
        self.cand = cand
        self.geometry = geometry
        self.unpacked = False

    def __del__(self):
        try:
            self.step.handle_died(self.cand)
        except Exception:  # interpreter shutdown; never raise from a finaliser
            pass


class _Untracked:
    """A tensor packed outside the step's forward (e.g. in backward): kept, not counted."""

    __slots__ = ("tensor",)

    def __init__(self, tensor):
        self.tensor = tensor


class _PackRecord:
    """One forward pack of the verified step: what later steps must pack at the same position."""

    __slots__ = ("shape", "dtype", "info")

    def __init__(self, shape, dtype, info):
        self.shape: torch.Size = shape
        self.dtype: torch.dtype = dtype
        self.info: DecisionInfo | None = info  # None: keep the tensor; else swap, recompute or a kept recipe anchor


class _FastOps:
    """What a fast step of a plan with recompute decisions must still do per forward op (taken from the
    verified step): capture the recipe ops, and note the outputs of the ops those captures read."""

    __slots__ = ("tracked", "producers", "refs", "last_tracked")

    def __init__(self, captures: dict[int, CapturedOp], recipe_ops):
        self.refs: dict[int, tuple] = {idx: cap.refs for idx, cap in captures.items()}  # verified (op, slot)s
        self.producers = frozenset(op for refs in self.refs.values() for op, _ in refs)
        self.tracked = frozenset(recipe_ops) | self.producers  # every other op: count it and run it
        # after this op the dispatch mode has nothing left to do: the next pack pops it
        self.last_tracked = max(self.tracked, default=-1)


class _Step:
    def __init__(self, runtime: "RegenHandle"):
        self.runtime = runtime
        self.index: PlanIndex = runtime.index
        self.phase = PHASE_FORWARD
        self.planned = True
        self.failed = False
        self.aborted = False
        self.released = False
        self.op_count = 0
        self.writer: dict[int, tuple] = {}
        self.fingerprint = None if runtime.verified else OpFingerprint()
        self.captures: dict[int, CapturedOp] = {}
        self.cands: dict[tuple[int, int], _Candidate] = {}
        self.unpack_count = 0
        self.copy_in_schedule: list = []  # heap of (unpack_order, seq, candidate)
        self._seq = itertools.count()
        self.pending_copy_outs: list[_Candidate] = []
        self.live = 0
        self.hooks_pushed = False
        # pack-order fast path: the verified step's packs (None: match through the dispatch mode)
        self.sequence: tuple[_PackRecord, ...] | None = runtime.pack_sequence
        self.pack_count = 0
        self.recording: list[_PackRecord] | None = [] if self.sequence is None else None
        # plans with recompute decisions keep the dispatch mode on fast steps, doing the minimum per op
        self.fast_ops: _FastOps | None = runtime.fast_ops if self.sequence is not None else None
        self.forward_op = self.slow_forward_op if self.fast_ops is None else self.fast_forward_op
        self.tracking_done = False  # fast step with recompute: every tracked op has run
        self.pack_fn = self.pack if self.sequence is None else self.fast_pack
        self.unpack_fn = self.unpack

    # ---- forward ops (called by the ForwardTracker) ------------------------------------------------
    def slow_forward_op(self, func, args, kwargs):
        """Every forward op of an unverified step: writer map, fingerprint, recipe captures."""
        idx = self.op_count
        self.op_count = idx + 1
        index = self.index
        if idx in index.recipe_op_names:
            problem = check_captured_name(idx, func, index.recipe_op_names[idx])
            if problem:
                self.mismatch(problem)
            else:
                self.captures[idx] = capture_op(idx, func, args, kwargs, self.writer,
                                                index.recipe_op_random[idx])
        out = func(*args, **kwargs)
        outs = tensor_outputs(out)
        self._note_writes(idx, func, args, kwargs, outs)
        fp = self.fingerprint
        if fp is not None:
            fp.add(op_name(func), [(tuple(o.shape), str(o.dtype)) for o in outs if o is not None])
        if idx + 1 == index.num_forward_ops:
            self.phase = PHASE_TAIL
            if fp is not None:
                self.fingerprint = None
                got = fp.hexdigest()
                if got != index.plan.fingerprint:
                    self.mismatch(f"the forward ops differ from the plan's (fingerprint {got}, the plan was made "
                                  f"for {index.plan.fingerprint}, workload {index.plan.workload.get('name')!r})")
                elif self.planned:
                    self.runtime.verified = True
        return out

    def fast_forward_op(self, func, args, kwargs):
        """A forward op of a step after the verified one (plan with recompute): packs match by order, so
        only the recipe ops and the producers of what they read do more than count and run."""
        idx = self.op_count
        self.op_count = idx + 1
        if idx in self.fast_ops.tracked:
            out = self._tracked_op(idx, func, args, kwargs)
            if idx >= self.fast_ops.last_tracked:
                self.tracking_done = True
        else:
            out = func(*args, **kwargs)
        if idx + 1 == self.index.num_forward_ops:
            self.phase = PHASE_TAIL
        return out

    def _tracked_op(self, idx, func, args, kwargs):
        index = self.index
        fast = self.fast_ops
        expected = index.recipe_op_names.get(idx)
        if expected is not None:
            problem = check_captured_name(idx, func, expected)
            if problem:
                self.mismatch(problem)
            else:
                cap = capture_op(idx, func, args, kwargs, self.writer, index.recipe_op_random[idx])
                if cap.refs != fast.refs[idx]:
                    self.mismatch(f"recipe op {idx} ({expected}) reads the outputs {list(cap.refs)} (op, slot), "
                                  f"the plan's verified step read {list(fast.refs[idx])}")
                else:
                    self.captures[idx] = cap
        out = func(*args, **kwargs)
        if idx in fast.producers:
            self._note_writes(idx, func, args, kwargs, tensor_outputs(out))
        return out

    def _note_writes(self, idx, func, args, kwargs, outs):
        """The writer map (docs/internals.md): each storage this op wrote -> (op, slot, shape, dtype)."""
        writer = self.writer
        for slot, key in written_outputs(func, args, kwargs, outs):
            o = outs[slot]
            writer[key] = (idx, slot, o.shape, o.dtype)

    def backward_began(self):
        """Backward started before the plan's forward ops had all run."""
        if self.phase == PHASE_FORWARD and self.op_count < self.index.num_forward_ops:
            count = self.op_count
            self.end_forward()
            self.mismatch(f"the forward ran {count} ops, the plan expects {self.index.num_forward_ops}")
        self.end_forward()

    def end_forward(self, pop_hooks: bool = True):
        """No more matching: later packs keep. Pending copy-outs let go of their device storage.

        The tracker (and, unless a pack hook is running, the saved-tensor hooks) are popped here when
        they are on top of their stacks and backward has not begun (inside backward the engine restores
        the thread's state afterwards); otherwise the next step or `remove()` pops them."""
        if self.phase == PHASE_CLOSED:
            return
        self.phase = PHASE_CLOSED
        self.fingerprint = None
        self.writer = {}
        recording, self.recording = self.recording, None
        runtime = self.runtime
        if (recording is not None and self.planned and not self.failed and runtime.verified
                and self.op_count >= self.index.num_forward_ops and runtime.pack_sequence is None):
            if not self.index.has_recompute:
                runtime.pack_sequence = tuple(recording)
            elif self.captures.keys() == self.index.recipe_op_names.keys():
                runtime.fast_ops = _FastOps(self.captures, self.index.recipe_op_names)
                runtime.pack_sequence = tuple(recording)
        self._flush_copy_outs(wait_all=True)
        if torch._C._current_graph_task_id() == -1:
            self.runtime._pop_tracker_for(self)
            if pop_hooks:
                self.runtime._pop_hooks_of(self, warn=False)
        self._maybe_release()

    def mismatch(self, message: str):
        runtime = self.runtime
        if runtime.on_mismatch == "raise":
            self.failed = True
            self.planned = False
            self.end_forward()
            raise PlanMismatchError(f"regen.apply: {message}. Profile and solve for this model and batch "
                                    f"shape, or pass on_mismatch='keep' to run such steps unplanned")
        if self.planned:
            self.planned = False
            runtime.stats.unplanned_steps += 1
            warnings.warn(f"regen.apply: {message}; running this step unplanned (on_mismatch='keep')",
                          PlanMismatchWarning, stacklevel=3)

    # ---- pack ---------------------------------------------------------------------------------------
    def pack(self, x: torch.Tensor):
        with _regen_ops():  # regen's own ops (detach, copies) are never counted
            return self._pack(x)

    def _pack(self, x: torch.Tensor):
        phase = self.phase
        if torch._C._current_graph_task_id() != -1:  # packed in backward (double backward, checkpoint)
            return _Untracked(x.detach())
        if phase == PHASE_CLOSED:
            return x.detach()
        if self.pending_copy_outs:
            self._flush_copy_outs(wait_all=False)
        w = self.writer.get(storage_key(x))
        if self.recording is not None:
            info = None if w is None else self.index.decisions.get((w[0], w[1]))
            self.recording.append(_PackRecord(x.shape, x.dtype, None if info is None or (
                info.action == ACTION_KEEP and info.key not in self.index.anchor_keys) else info))
        result = x.detach() if w is None else self._pack_candidate(x, w)
        if phase == PHASE_TAIL:  # the last planned op's outputs: match this one, then close
            self.end_forward(pop_hooks=False)
        return result

    def _pack_candidate(self, x, w):
        key = (w[0], w[1])
        info = self.index.decisions.get(key)
        if info is None:
            return x.detach()
        if w[2] != info.shape or w[3] != info.dtype:
            self.mismatch(f"op {key[0]} output {key[1]} is {tuple(w[2])} {w[3]}, the plan expects "
                          f"{tuple(info.shape)} {info.dtype} (another batch shape or model?)")
            return x.detach()
        return self._pack_info(x, info)

    def fast_pack(self, x: torch.Tensor):
        if _dispatch_stack_len() == 0 and type(x) in _PLAIN_TENSOR_TYPES:  # nothing Python to skip
            return self._fast_pack(x)
        with _regen_ops():
            return self._fast_pack(x)

    def _fast_pack(self, x: torch.Tensor):
        """The pack hook of a step after the verified one: the k-th pack gets the verified step's k-th record."""
        if torch._C._current_graph_task_id() != -1:  # packed in backward (double backward, checkpoint)
            return _Untracked(x.detach())
        if self.phase == PHASE_CLOSED:
            return x.detach()
        if self.tracking_done:  # the rest of the forward needs no dispatch mode: packs match by order
            self.tracking_done = False
            self.runtime._pop_tracker_for(self)
        k = self.pack_count
        sequence = self.sequence
        if k >= len(sequence):  # nothing left to match (a plan whose forward saves nothing)
            self.end_forward(pop_hooks=False)
            return x.detach()
        self.pack_count = k + 1
        if self.pending_copy_outs:
            self._flush_copy_outs(wait_all=False)
        rec = sequence[k]
        if x.dtype != rec.dtype or x.shape != rec.shape:
            self.mismatch(f"saved tensor {k} of the forward is {tuple(x.shape)} {x.dtype}, the plan's verified "
                          f"step saved {tuple(rec.shape)} {rec.dtype} there (another batch shape or model?)")
            result = x.detach()
        elif rec.info is None:
            result = x.detach()
        else:
            result = self._pack_info(x, rec.info, check_storage=True)
        if k + 1 == len(sequence):  # the verified step's last forward pack: matching is over
            self.end_forward(pop_hooks=False)
        return result

    def _pack_info(self, x: torch.Tensor, info: DecisionInfo, check_storage: bool = False):
        key = info.key
        cand = self.cands.get(key)
        if cand is None:
            cand = self.cands[key] = _Candidate(key, info)
        elif check_storage and cand.storage_key is not None and storage_key(x) != cand.storage_key:
            self.mismatch(f"op {key[0]} output {key[1]} was saved from two storages (the plan's verified step "
                          f"saved one)")
            return x.detach()
        if cand.mode is None:
            if not self.planned or info.action == ACTION_KEEP:
                cand.mode = ACTION_KEEP
            elif info.action == ACTION_SWAP:
                self._start_swap(cand, x)
                cand.storage_key = storage_key(x)
            else:
                self._start_drop(cand)
                if cand.mode is None:  # fell back to keep
                    cand.mode = ACTION_KEEP
        if cand.mode == ACTION_KEEP:
            if key in self.index.anchor_keys and cand.storage is None:
                cand.storage = x.detach()
                cand.version = x._version
            return x.detach()
        cand.pending += 1
        cand.live += 1
        self.live += 1
        return _Saved(self, cand, Geometry.of(x))

    def _start_swap(self, cand: _Candidate, x: torch.Tensor):
        runtime = self.runtime
        cand.copy_out = runtime.engine_for(x.device).copy_out(x)
        cand.mode = ACTION_SWAP
        if cand.copy_out.source is not None:
            self.pending_copy_outs.append(cand)
        order = cand.info.decision.swap_in_at_unpack
        heapq.heappush(self.copy_in_schedule, (order if order is not None else 0, next(self._seq), cand))
        runtime.stats.swapped_tensors += 1
        runtime.stats.swapped_bytes += cand.copy_out.slot.nbytes

    def _start_drop(self, cand: _Candidate):
        info = cand.info
        missing = [r for r in info.decision.recipe if r not in self.captures]
        if missing:
            self.mismatch(f"the recipe of op {cand.key[0]} needs ops {missing}, which were not captured")
            return
        cand.mode = ACTION_RECOMPUTE
        for a in info.anchors:
            anchor = self.cands.get(a)
            if anchor is None:
                anchor = self.cands[a] = _Candidate(a, self.index.decisions.get(a))
            anchor.pending += 1
        self.runtime.stats.dropped_tensors += 1

    def _flush_copy_outs(self, wait_all: bool):
        engine_of = self.runtime.engine_for
        keep = []
        for cand in self.pending_copy_outs:
            out = cand.copy_out
            if out is None or out.source is None:
                continue
            engine = engine_of(out.source.device)
            if wait_all or engine.copy_out_finished(out):
                engine.release_source(out)
            else:
                keep.append(cand)
        self.pending_copy_outs = keep

    # ---- unpack -------------------------------------------------------------------------------------
    def unpack(self, obj):
        if isinstance(obj, _Untracked):
            return obj.tensor
        if self.aborted:
            raise RegenError("regen.apply: this step was aborted by an exception; its saved tensors are gone")
        k = self.unpack_count
        self.unpack_count = k + 1
        if k == 0 and self.phase != PHASE_CLOSED:
            self.end_forward()
            if self.sequence is not None and self.pack_count < len(self.sequence):
                self.mismatch(f"the forward saved {self.pack_count} tensors before backward began, the plan's "
                              f"verified step saved {len(self.sequence)}")
        schedule = self.copy_in_schedule
        while schedule and schedule[0][0] <= k:
            cand = heapq.heappop(schedule)[2]
            if cand.copy_in is None and not cand.released:
                self._issue_copy_in(cand)
        if not isinstance(obj, _Saved):
            return obj
        cand = obj.cand
        with self.runtime.tracker.pause():
            base = self._materialize(cand, consumer=True)
        with _regen_ops():
            out = view_of(base, obj.geometry)
        del base
        if not obj.unpacked:
            obj.unpacked = True
            self._used(cand)
        return out

    def _issue_copy_in(self, cand: _Candidate):
        engine = self.runtime.engine_for(cand.copy_out.device)
        with _regen_ops():
            cand.copy_in = engine.copy_in(cand.copy_out)
        cand.storage = cand.copy_in.buffer

    def _materialize(self, cand: _Candidate, consumer: bool) -> torch.Tensor:
        """A tensor over the candidate's storage, resident now (restored or rebuilt if needed)."""
        if cand.released:
            raise RegenError(f"regen.apply: op {cand.key[0]}'s saved tensor was released; it was unpacked "
                             f"after autograd freed it (a retained graph over an aborted step?)")
        if cand.mode == ACTION_SWAP:
            if cand.copy_in is None:
                self.runtime.stats.synchronous_copy_ins += 1
                self._issue_copy_in(cand)
            self.runtime.engine_for(cand.copy_in.buffer.device).wait_copy_in(cand.copy_in)
            return cand.copy_in.buffer
        if cand.storage is not None:
            if cand.mode == ACTION_KEEP and cand.storage._version != cand.version:
                raise PlanMismatchError(f"regen.apply: op {cand.key[0]}'s output, read by a recompute recipe, was "
                                        f"modified in place after it was saved")
            return cand.storage
        if cand.mode == ACTION_RECOMPUTE:
            if cand.info.rebuilt_with is not None:
                raise PlanMismatchError(
                    f"regen.apply: op {cand.key[0]}'s saved tensor is rebuilt by the recipe of op "
                    f"{cand.info.rebuilt_with[0]}'s, which had not run when backward first read it: backward ran in "
                    f"another order than profiled; the plan does not fit this run")
            return self._recompute(cand)
        raise PlanMismatchError(f"regen.apply: a recompute recipe reads op {cand.key[0]} output {cand.key[1]}, "
                                f"which this step never saved; the plan does not fit this model")

    def _recompute(self, cand: _Candidate) -> torch.Tensor:
        info = cand.info
        allowed = set(info.anchors)
        used = []

        def anchor(key):
            if key not in allowed:
                raise PlanMismatchError(
                    f"regen.apply: the recipe of op {cand.key[0]} reads op {key[0]} output {key[1]}, which is "
                    f"neither in its recipe nor among its recipe_inputs; the plan does not fit this model")
            a = self.cands.get(key)
            if a is None:
                raise PlanMismatchError(f"regen.apply: recipe input op {key[0]} output {key[1]} was never saved "
                                        f"in this step")
            used.append(a)
            return self._materialize(a, consumer=False)

        keep = tuple(k for k in info.rebuilds if (b := self.cands.get(k)) is not None and b.storage is None
                     and not b.released and b.mode == ACTION_RECOMPUTE)
        result, kept = replay_recipe(cand.key, info.decision.recipe, self.captures, anchor, info.shape, info.dtype,
                                     keep=keep)
        self.runtime.stats.recomputes += 1
        cand.storage = result
        for key, tensor in kept.items():  # rebuilt on the way: held until their own use
            b = self.cands[key]
            if tensor.shape != b.info.shape or tensor.dtype != b.info.dtype:
                raise PlanMismatchError(f"regen.apply: op {key[0]}'s output, rebuilt with op {cand.key[0]}'s recipe, "
                                        f"is {tuple(tensor.shape)} {tensor.dtype}; the plan expects "
                                        f"{tuple(b.info.shape)} {b.info.dtype}")
            b.storage = tensor
        if not cand.recipe_ran:
            cand.recipe_ran = True
            for a in info.anchors:
                a_cand = self.cands.get(a)
                if a_cand is not None:
                    self._used(a_cand)
        return result

    def _used(self, cand: _Candidate):
        cand.pending -= 1
        if cand.pending <= 0 and self.phase == PHASE_CLOSED:
            self._drop_device_copy(cand)

    def _drop_device_copy(self, cand: _Candidate):
        if cand.copy_in is not None:
            self.runtime.engine_for(cand.copy_in.buffer.device).drop_copy_in(cand.copy_in)
            cand.copy_in = None
        cand.storage = None

    # ---- lifetime -----------------------------------------------------------------------------------
    def handle_died(self, cand: _Candidate):
        cand.live -= 1
        self.live -= 1
        if cand.live == 0 and not cand.released:
            self._release_candidate(cand)
        self._maybe_release()

    def _release_candidate(self, cand: _Candidate):
        cand.released = True
        self._drop_device_copy(cand)
        out = cand.copy_out
        if out is not None:
            cand.copy_out = None
            if out.source is not None:
                self.runtime.engine_for(out.source.device).release_source(out)
            self.runtime.pool.release(out.slot)

    def _maybe_release(self):
        if self.live <= 0 and self.phase == PHASE_CLOSED and not self.released:
            self.release()

    def release(self, aborted: bool = False):
        """Return everything the step holds: host ranges, device copies, captures, anchors."""
        self.aborted = self.aborted or aborted
        self.phase = PHASE_CLOSED
        self._flush_copy_outs(wait_all=True)
        for cand in list(self.cands.values()):
            if not cand.released:
                self._release_candidate(cand)
        self.cands = {}
        self.captures = {}
        self.writer = {}
        self.copy_in_schedule = []
        self.released = True
        self.runtime._step_released(self)


class RegenHandle:
    """The object `regen.apply` returns: a context manager, or call `.remove()` when done."""

    def __init__(self, model: nn.Module, plan: Plan, on_mismatch: str = "raise"):
        if on_mismatch not in ON_MISMATCH_CHOICES:
            raise RegenError(f"regen.apply: on_mismatch must be one of {', '.join(ON_MISMATCH_CHOICES)}, "
                             f"got {on_mismatch!r}")
        if isinstance(plan, (str, Path)):
            plan = load_plan(plan)
        if not isinstance(plan, Plan):
            raise RegenError(f"regen.apply: expected a regen Plan (regen.load_plan(path)), got {type(plan).__name__}")
        if not isinstance(model, nn.Module):
            raise RegenError(f"regen.apply: expected a torch.nn.Module, got {type(model).__name__}")
        self.model = model
        self.root = _unwrap(model)
        self.plan = plan
        self.index = index_plan(plan)
        self.on_mismatch = on_mismatch
        self.tracker = ForwardTracker()
        self.tracker_pushed = False
        self.verified = False
        self.pack_sequence: tuple[_PackRecord, ...] | None = None  # the fast path's (see the module doc)
        self.fast_ops: _FastOps | None = None  # with recompute decisions: what fast steps still track
        self.stats = RuntimeStats()
        self.current: _Step | None = None
        self.live_steps: list[_Step] = []
        self._depth = 0
        self._removed = False
        device = _model_device(self.root)
        self.pool = HostPool(plan.host_pool_bytes if self.index.swap_bytes else 0,
                             pin_memory=device is not None and device.type == "cuda")
        self.engines: dict[torch.device, SwapEngine] = {}
        self._hooks = [
            self.root.register_forward_pre_hook(self._pre_hook),
            self.root.register_forward_hook(self._post_hook, always_call=True),
        ]

    # ---- public ---------------------------------------------------------------------------------------
    def __enter__(self) -> "RegenHandle":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        self.remove(abort=exc_type is not None)

    def remove(self, abort: bool = False) -> None:
        """Remove every hook. With abort=True (an exception ended the `with` block) the live steps are
        released too; otherwise steps whose graph autograd still holds finish their backward normally."""
        if self._removed:
            return
        self._removed = True
        for h in self._hooks:
            h.remove()
        self._hooks = []
        step = self.current
        if step is not None:
            if step.phase != PHASE_CLOSED:
                step.phase = PHASE_CLOSED
                step.writer = {}
                step._flush_copy_outs(wait_all=True)
                step._maybe_release()
            self._pop_hooks_of(step)
        self._pop_tracker(force=True)
        self.current = None
        if abort:
            for s in list(self.live_steps):
                s.release(aborted=True)

    @property
    def active_steps(self) -> int:
        """Steps still holding resources (their graph is alive)."""
        return len(self.live_steps)

    @property
    def hooks_installed(self) -> bool:
        return bool(self._hooks) or self.tracker_pushed or (self.current is not None and self.current.hooks_pushed)

    # ---- step boundaries ------------------------------------------------------------------------------
    def _pre_hook(self, module, args):
        self._depth += 1
        if self._depth > 1 or not (torch.is_grad_enabled() and module.training):
            return
        if torch._C._current_graph_task_id() != -1:  # a forward run inside backward (checkpoint): leave it
            return
        prev = self.current
        if prev is not None:
            if prev.phase != PHASE_CLOSED:
                prev.end_forward()
            self._pop_hooks_of(prev)
        step = _Step(self)
        self.stats.steps += 1
        self.current = step
        self.live_steps.append(step)
        if step.sequence is None or step.fast_ops is not None:
            self.tracker.step = step
            if not self.tracker_pushed:
                self.tracker.__enter__()
                self.tracker_pushed = True
        else:  # pack-order fast path: no dispatch mode
            self.tracker.step = None
            self._pop_tracker(force=False)
        torch._C._autograd._push_saved_tensors_default_hooks(step.pack_fn, step.unpack_fn)
        step.hooks_pushed = True

    def _post_hook(self, module, args, output):
        self._depth = max(0, self._depth - 1)
        step = self.current
        if self._depth == 0 and step is not None and step.phase == PHASE_TAIL:
            step.end_forward()

    def _pop_tracker_for(self, step: _Step):
        if self.tracker.step is step:
            self._pop_tracker(force=False)

    def _pop_tracker(self, force: bool):
        if not self.tracker_pushed:
            return
        if _get_current_dispatch_mode() is self.tracker:
            self.tracker.__exit__(None, None, None)
            self.tracker_pushed = False
        elif force and self.tracker not in _get_current_dispatch_mode_stack():
            self.tracker_pushed = False
        if not self.tracker_pushed:
            self.tracker.step = None

    def _pop_hooks_of(self, step: _Step, warn: bool = True):
        if not step.hooks_pushed:
            return
        top = torch._C._autograd._top_saved_tensors_default_hooks(False)
        if top is not None and top[0] is step.pack_fn:
            torch._C._autograd._pop_saved_tensors_default_hooks()
            step.hooks_pushed = False
        elif warn:
            warnings.warn("regen.apply: other saved-tensor hooks were pushed above regen's and not popped; "
                          "leaving them in place", RuntimeWarning, stacklevel=3)

    def _step_released(self, step: _Step):
        if step in self.live_steps:
            self.live_steps.remove(step)
            if step.planned and not step.failed and not step.aborted:
                self.stats.planned_steps += 1

    # ---- devices --------------------------------------------------------------------------------------
    def engine_for(self, device: torch.device) -> SwapEngine:
        engine = self.engines.get(device)
        if engine is None:
            engine = self.engines[device] = SwapEngine(device, self.pool)
        return engine


def _unwrap(model: nn.Module) -> nn.Module:
    """The module whose forward the plan describes: DDP and DataParallel wrap it."""
    wrappers = (nn.parallel.DistributedDataParallel, nn.DataParallel)
    while isinstance(model, wrappers):
        model = model.module
    return model


def _model_device(model: nn.Module) -> torch.device | None:
    for p in model.parameters():
        return p.device
    for b in model.buffers():
        return b.device
    return None


def apply(model: nn.Module, plan: Plan | str | Path, on_mismatch: str = "raise") -> RegenHandle:
    """Replay `plan` on `model`'s training steps until the handle is removed (or the `with` ends).

    `plan` is a Plan or a path to a plan file. `on_mismatch="raise"` (default) raises PlanMismatchError
    when the model or batch shape is not the one the plan was made for; `"keep"` warns and runs that step
    unplanned.
    """
    return RegenHandle(model, plan, on_mismatch=on_mismatch)
