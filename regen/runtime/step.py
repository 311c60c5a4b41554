"""One step of `regen.apply`: its stages, its pack and unpack hooks, the end of its forward, its release.

A step begins at a training forward (the handle's root pre-hook) in STAGE_COUNTING. Its `ForwardOps`
follow the forward ops the `ForwardTracker` counts (forward_ops.py); its pack hook finds each saved
tensor's decision (packing.py: through the writer map, or by pack order once a step was verified) and
hands the planned storages to its `PlannedStorages` (keep, swap, drop for recompute). After the plan's last
forward op (STAGE_TAIL) the next op or pack ends the forward (`end_forward`, STAGE_CLOSED): later packs
keep, and the step hands its handle `StepFindings` (what it verified and recorded for later steps). Each
forward pack (counted all the way, `forward_packs_seen`) and each unpack first releases the swapped
storages due there (their release points, swap/queue.py); copy-outs still running when the forward ends
go on into backward, as the simulator has them. In backward the unpack hook counts the unpacks (the
backward clock of docs/internals.md), issues the copy-ins and the region replays due (swap/queue.py,
region_replays.py) and rebuilds each entry over its restored or recomputed storage, after checking that the
entry's version counter is the one it had at the pack (docs/internals.md "Version checks"). The
handle's hooks on the plan's region modules report their calls (`region_called`, `region_returned`), and
those on the modules that open tracking windows theirs (`module_entered`, window_hooks.py).

A plan mismatch raises or warns and keeps every later tensor of the step (regen.runtime.mismatch; with
torch.distributed, decided with the other ranks at the first unpack). A backward with create_graph=True
(an unpack with grad mode on: the engine runs such a backward with it) is a mismatch: what it saves for a
second backward is not planned. The step is released (host ranges, device copies, captures) once its
forward has ended and autograd has freed every handle, or at once when aborted.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
from torch import nn

from regen.errors import RegenError
from regen.formats.plan import ACTION_RECOMPUTE
from regen.runtime.planned_storages import PlannedStorages, Saved
from regen.runtime.saved_entries import Kept, Untracked, check_version
from regen.runtime.forward_ops import FastOps, ForwardOps
from regen.runtime.mismatch import MismatchPolicy
from regen.runtime.packing import PackRecord, WriterMatch, fewer_packs_mismatch, order_mismatch, writer_mismatch
from regen.runtime.plan_index import PlanIndex
from regen.runtime.region_replays import RegionReplays
from regen.runtime.stats import RuntimeStats
from regen.runtime.storage_views import view_of
from regen.runtime.swap import HostPool, SwapEngine, SwapQueue
from regen.runtime.tracker import STAGE_CLOSED, STAGE_COUNTING, STAGE_TAIL, regen_ops

# Recipe replays run with only the tracker paused (other modes still see them); regen's own small ops run
# under tracker.regen_ops.
_dispatch_stack_len = torch._C._len_torch_dispatch_stack
_graph_task_id = torch._C._current_graph_task_id
_grad_enabled = torch.is_grad_enabled
_PLAIN_TENSOR_TYPES = (torch.Tensor, nn.Parameter)  # no __torch_dispatch__ of their own


DOUBLE_BACKWARD_MISMATCH = (
    "the backward runs with create_graph=True (double backward, e.g. a gradient penalty): the tensors it saves "
    "for the second backward are outside the plan, so the memory cap would not hold")


@dataclass(frozen=True)
class StepFindings:
    """What a step's forward established for the later steps of its handle."""

    verified: bool  # the forward ops matched the plan's fingerprint while the step followed the plan
    pack_sequence: tuple[PackRecord, ...] | None = None  # its packs in order: later steps match by order
    fast_ops: FastOps | None = None  # with recompute decisions: what later steps still track per op


@dataclass(frozen=True)
class StepContext:
    """What a handle gives each of its steps: the plan, shared resources, and where to report."""

    index: PlanIndex
    on_mismatch: str
    stats: RuntimeStats
    pause_tracker: Callable  # () -> a context manager during which the tracker counts nothing
    engine_for: Callable[[torch.device], SwapEngine]
    pool: HostPool
    forward_ended: Callable  # (step, StepFindings, in_pack_hook: bool): pop what the step needs no more
    tracking_done: Callable  # (step): a fast step's tracking window ended: the dispatch mode can go
    track: Callable  # (step): a fast step's tracking window opens: the dispatch mode follows its ops
    released: Callable  # (step, followed_plan: bool)
    drops_held: Callable  # (step, bytes): on a watched step, the dropped storages still held as backward began
    # (): the step left its plan mid-step; True when dynamic mode runs the rest of its forward, else it runs unplanned
    diverged: Callable = lambda: False



class Step:
    """One training step under a plan; `pack_fn` and `unpack_fn` are its saved-tensor hooks and
    `forward_op` what the tracker calls for each counted forward op."""

    def __init__(self, ctx: StepContext, verified: bool, pack_sequence: tuple[PackRecord, ...] | None,
                 fast_ops: FastOps | None, call_difference: Callable[[], str | None] = lambda: None):
        """`verified`, `pack_sequence`, `fast_ops`: what the earlier steps of its plan found (StepFindings);
        `call_difference()`: how this step's call differs from the profiled one, for a mismatch's message."""
        self.ctx = ctx
        self.mismatches = MismatchPolicy(ctx.on_mismatch, ctx.stats, call_difference)
        self.index = ctx.index
        self.stage = STAGE_COUNTING
        self.planned = True
        self.failed = False
        self.aborted = False
        self.released = False
        self.was_verified = verified  # by an earlier step
        self.verified = False  # by this one
        # pack-order fast path: the verified step's packs (None: match through the writer map)
        self.sequence = pack_sequence
        self.pack_count = 0
        fast = fast_ops if pack_sequence is not None else None
        self.ops = ForwardOps(ctx.index, fingerprint=not verified, fast=fast, mismatch=self.mismatch,
                              last_op_ran=self._last_op_ran, tracking_done=self._tracking_done)
        self.forward_op = self.ops.slow_op if fast is None else self.ops.fast_op
        # plans with recompute decisions use the dispatch mode on fast steps, in their tracking windows
        # (window_hooks.py): from the step's start only when a window opens there
        self.needs_tracker = pack_sequence is None or (fast is not None and self.ops.window_end >= 0)
        self.tracking_done = False  # fast step with recompute: its tracking window's last op has run
        self.matcher = WriterMatch(ctx.index, self.ops.writer) if pack_sequence is None else None
        self.swaps = SwapQueue(ctx.engine_for, ctx.pool, ctx.stats)
        self._due_at_pack = self.swaps.due_at_pack
        self._due_at_unpack = self.swaps.due_at_unpack
        self._copy_ins = self.swaps.copy_ins
        self.regions = RegionReplays(ctx.index, ctx.pause_tracker, self.mismatch, lambda: self.forward_packs_seen)
        self._regions_due = ctx.index.region_replay_order  # (unpack position, region id), in order
        self._next_region = 0
        self.storages = PlannedStorages(ctx.index, self.ops.captures, self.swaps, ctx.stats, self.mismatch,
                                    self._maybe_release, self.regions)
        self.unpack_count = 0
        self.forward_packs_seen = 0  # every tensor autograd packed before backward began (the saved set)
        self.pack_fn = self.pack if pack_sequence is None else self.fast_pack
        self.unpack_fn = self.unpack
        # taken over midway by dynamic mode: told of each kept tensor backward reads (its count lets it go)
        self.release_held: Callable[[torch.Tensor], None] | None = None

    # ---- forward ops (called back by ForwardOps) --------------------------------------------------
    def _last_op_ran(self, fingerprint_matched: bool):
        self.stage = STAGE_TAIL
        if fingerprint_matched and self.planned:
            self.verified = True

    def _tracking_done(self):
        self.tracking_done = True

    def backward_began(self):
        """Backward started before the plan's forward ops had all run."""
        if self.stage == STAGE_COUNTING and not self.ops.all_ran:  # before end_forward: it may release the step
            self.mismatch(f"the forward ran {self.ops.count} ops, the plan expects {self.index.num_forward_ops}")
        self.end_forward()

    def end_forward(self, in_pack_hook: bool = False):
        """No more matching: later packs keep (copy-outs still run, released at their points), and the
        handle gets this step's findings (and pops what the step needs no more; inside a pack hook, not
        the saved-tensor hooks). Also what closes a step at once (the handle's remove())."""
        if self.stage == STAGE_CLOSED:
            return
        self.stage = STAGE_CLOSED
        findings = findings_of(self)
        self.ops.end_forward()
        self.matcher = None
        self.ctx.stats.copy_outs_held_at_end_forward += self.swaps.held_copy_outs()
        self.storages.matching_ended()
        self.ctx.forward_ended(self, findings, in_pack_hook)
        self._maybe_release()

    # ---- region module calls (the handle's module hooks) --------------------------------------------
    def region_called(self, path: str, module: nn.Module, args: tuple, kwargs: dict) -> None:
        if self.stage != STAGE_CLOSED and self.planned:
            self.regions.called(path, module, args, kwargs)

    def region_returned(self, module: nn.Module) -> None:
        # whatever the stage: a call that runs the plan's last forward op (a loss module) returns after its op
        # closed the forward, and a call opened before must still close (returned() passes over any other)
        self.regions.returned(module)

    def module_entered(self, path: str) -> None:
        """A call of a module that may open a tracking window (windows.WindowHooks) begins."""
        if self.stage == STAGE_COUNTING and self.ops.module_entered(path):
            self.tracking_done = False
            self.ctx.track(self)

    def mismatch(self, message: str):
        message = self.mismatches.describe(message, self.planned)
        if self.mismatches.defer(message):  # the ranks decide together at the first unpack
            self.planned = False
            return
        self._act_on_mismatch(message)

    def _act_on_mismatch(self, message: str):
        planned = self.planned
        self.planned = False
        if self.ctx.on_mismatch == "raise":
            self.failed = True
            self.end_forward()
        taken_over = planned and self.ctx.diverged()
        self.mismatches.act(message, planned, taken_over)
        if taken_over:  # its tracker captures nothing more: a capture holds what it reads until the step's release
            self.end_forward(in_pack_hook=True)

    def held_bytes(self) -> int:
        """What the tensors packed so far that an op of the step made and the plan keeps hold until backward reads
        them (their records: the verified step's up to here on the fast path)."""
        records = self.matcher.recording if self.matcher is not None else (self.sequence or ())[:self.pack_count]
        return sum(r.held_bytes() for r in records)

    # ---- pack ---------------------------------------------------------------------------------------
    def pack(self, x: torch.Tensor):
        with regen_ops():  # regen's own ops (detach, copies) are never counted
            return self._pack(x)

    def _pack(self, x: torch.Tensor):
        """The pack hook of a step matching through the writer map."""
        stage = self.stage
        if _graph_task_id() != -1:  # packed in backward (double backward, checkpoint)
            return Untracked(x)
        self._count_forward_pack(x)
        if stage == STAGE_CLOSED:
            return Kept(x)
        info, problem = self.matcher.match(x)
        if problem is not None:
            self.mismatch(problem)
            result = Kept(x)
        elif info is None:
            result = Kept(x)
        else:
            result = self.storages.pack(x, info, self.planned, False)
        if stage == STAGE_TAIL:  # the last planned op's outputs: match this one, then close
            self.end_forward(in_pack_hook=True)
        return result

    def _count_forward_pack(self, x: torch.Tensor) -> None:
        """Count a forward pack of the slow path, note it for the open region calls and release the swaps due
        before it (`_fast_pack` does the same, less the region calls, written out)."""
        k = self.forward_packs_seen
        self.forward_packs_seen = k + 1
        self.regions.forward_packed(x)
        due = self._due_at_pack
        if due and due[0][0] <= k:
            self.swaps.release_due_at_pack(k)

    def fast_pack(self, x: torch.Tensor):
        if _dispatch_stack_len() == 0 and type(x) in _PLAIN_TENSOR_TYPES:  # nothing Python to skip
            return self._fast_pack(x)
        with regen_ops():
            return self._fast_pack(x)

    def _fast_pack(self, x: torch.Tensor):
        """The pack hook of a step after the verified one: the k-th pack gets the verified step's k-th record.
        It runs for every saved tensor of every step, so the counting is written out here (as
        `_count_forward_pack`, without its region notes: later steps check replays by shape and dtype)."""
        if _graph_task_id() != -1:  # packed in backward (double backward, checkpoint)
            return Untracked(x)
        seen = self.forward_packs_seen
        self.forward_packs_seen = seen + 1
        due = self._due_at_pack
        if due and due[0][0] <= seen:
            self.swaps.release_due_at_pack(seen)
        if self.stage == STAGE_CLOSED:
            return Kept(x)
        if self.tracking_done:  # no dispatch mode until the next window: packs match by order
            self.tracking_done = False
            self.ctx.tracking_done(self)
        k = self.pack_count
        sequence = self.sequence
        last = len(sequence) - 1
        if k > last:  # nothing left to match (a plan whose forward saves nothing)
            self.end_forward(in_pack_hook=True)
            return Kept(x)
        self.pack_count = k + 1
        rec = sequence[k]
        if rec.info is None and x.dtype == rec.dtype and x.shape == rec.shape:  # the common case: kept
            result = Kept(x)
        elif x.dtype != rec.dtype or x.shape != rec.shape:
            self.mismatch(order_mismatch(k, x, rec))
            result = Kept(x)
        elif rec.checked and (problem := writer_mismatch(k, x, rec, self.ops.writer)) is not None:
            self.mismatch(problem)
            result = Kept(x)
        else:
            result = self.storages.pack(x, rec.info, self.planned, True)
        if k == last:  # the verified step's last forward pack: matching is over
            self.end_forward(in_pack_hook=True)
        return result

    # ---- unpack -------------------------------------------------------------------------------------
    def unpack(self, obj):
        if type(obj) is Untracked:
            return obj.unpack()
        if self.aborted:
            raise RegenError("regen.apply: this step was aborted by an exception; its saved tensors are gone")
        k = self.unpack_count
        self.unpack_count = k + 1
        if k == 0:
            self._first_unpack()
        if self.planned and _grad_enabled():  # the engine runs a create_graph backward with grad on
            self.mismatch(DOUBLE_BACKWARD_MISMATCH)
        due = self._due_at_unpack
        if self._due_at_pack or (due and due[0][0] <= k):
            self.swaps.release_due_at_unpack(k)
        copy_ins = self._copy_ins
        if copy_ins and copy_ins[0][0] <= k:
            self.swaps.issue_due(k)
        due, i = self._regions_due, self._next_region
        while i < len(due) and due[i][0] <= k:  # module calls replayed at this position of the backward clock
            self.storages.replay_region(due[i][1])
            i += 1
        self._next_region = i
        if type(obj) is Kept:  # the common case (Kept.unpack written out)
            tensor = obj.tensor
            if tensor._version != obj.version:
                check_version(tensor, obj.version)
            if self.release_held is not None:
                self.release_held(tensor)
            return tensor
        if not isinstance(obj, Saved):
            return obj.unpack()
        obj.check_version()
        ps = obj.ps
        base = ps.storage
        if base is None or ps.mode != ACTION_RECOMPUTE:  # not rebuilt yet (or a swap, or a kept recipe input)
            with self.ctx.pause_tracker():
                base = self.storages.materialize(ps)
        if _dispatch_stack_len() == 0:  # no mode to hide regen's own ops from
            out = view_of(base, obj.geometry)
        else:
            with regen_ops():
                out = view_of(base, obj.geometry)
        del base
        if not obj.unpacked:
            obj.unpacked = True
            self.storages.used(ps)
        return out

    def _first_unpack(self):
        """Backward began: close the forward, and check that it ran the plan's ops and saved its set."""
        if self.stage != STAGE_CLOSED:
            if self.sequence is None:  # ops are counted: a forward shorter than the plan's is a mismatch
                self.backward_began()
            else:
                self.end_forward()
                if self.pack_count < len(self.sequence):
                    self.mismatch(fewer_packs_mismatch(self.pack_count, self.sequence))
        expected = self.index.plan.num_forward_packs
        if expected is not None and self.forward_packs_seen != expected and self.planned:
            self.mismatch(f"the forward saved {self.forward_packs_seen} tensors for backward, the plan's saved "
                          f"{expected} (parameters frozen or unfrozen since it was profiled, or another model)")
        if self.storages.dropped is not None and self.planned:
            self.ctx.drops_held(self, self.storages.held_bytes())
        if self.mismatches.any_rank is not None:  # every rank acts if any rank's step did not match
            message = self.mismatches.agree()
            if message is not None:
                self.planned = True  # the deferred mismatch is acted on (and counted) now
                self._act_on_mismatch(message)

    # ---- lifetime -----------------------------------------------------------------------------------
    def packs_no_more(self) -> bool:
        """Its saved set is final (backward began, or it was released): its hooks may be popped."""
        return self.unpack_count > 0 or self.released

    def _maybe_release(self):
        if self.storages.live <= 0 and self.stage == STAGE_CLOSED and not self.released:
            self.release()

    def release(self, aborted: bool = False):
        """Return everything the step holds: host ranges, device copies, captures, recipe inputs."""
        self.aborted = self.aborted or aborted
        self.stage = STAGE_CLOSED
        self.swaps.release_all()
        self.storages.release_all()
        self.regions.release()
        self.ops.release()
        self.swaps.clear()
        self.released = True
        self.ctx.released(self, self.planned and not self.failed and not self.aborted)


def findings_of(step: Step) -> StepFindings:
    """What later steps may use: the recorded packs once the forward ran in full, as planned and
    verified (with recompute decisions, only if every recipe op was captured)."""
    verified = step.was_verified or step.verified
    if step.matcher is None or not step.planned or step.failed or not verified or not step.ops.all_ran:
        return StepFindings(verified=step.verified)
    if not step.index.has_recipes:  # keep, swap and region decisions: packs by order, no dispatch mode
        return StepFindings(verified=step.verified, pack_sequence=tuple(step.matcher.recording))
    fast_ops = step.ops.fast_ops_for_later_steps()
    if fast_ops is None:
        return StepFindings(verified=step.verified)
    return StepFindings(verified=step.verified, pack_sequence=tuple(step.matcher.recording), fast_ops=fast_ops)
