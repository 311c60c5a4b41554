"""One step's planned storages: what the runtime did with each storage its plan decides, and what it still owes.

A `PlannedStorage` is one storage of one step, named by its decision's `(producer_op, output_slot)`. When a
matched tensor is packed (`PlannedStorages.pack`) it is kept (a `Kept`; a recipe input also keeps a
tensor over its storage), swapped (the `SwapQueue` copies it out) or dropped for recompute (its recipe
ops were captured as they ran); a swapped or dropped entry is packed as a `Saved`. In backward
`materialize` makes the storage resident again: restored by the swap queue, a kept recipe input, or rebuilt
by its recipe (`recompute.replay_recipe`), which also hands over the planned storages rebuilt with it
(docs/internals.md "Rebuilt with another's recipe"), held until their own use, or by replaying its
region's module call (region_replays.py), which rebuilds all of the region's dropped members at once. A
resident storage is dropped after its last use (its first unpacks and the recipes reading it);
everything else the planned storage holds goes when autograd frees its last handle, or when the step is
released. A backward over a retained graph (`retain_graph=True`, then another backward) unpacks
again: swapped storages are restored and recipes run again, reading kept recipe inputs through the tensor
autograd still holds for them (a weak reference: it costs no memory once autograd frees it). Every
entry keeps its tensor's version counter (`Kept`, or a `version_probe` for a `Saved`) and its value at
the pack: an in-place change before the unpack raises autograd's own error (`check_version`).
"""

from __future__ import annotations

import weakref
from typing import Callable

import torch
from torch.multiprocessing.reductions import StorageWeakRef

from regen.errors import PlanMismatchError, RegenError
from regen.formats.plan import ACTION_KEEP, ACTION_RECOMPUTE, ACTION_SWAP
from regen.formats.plan_rules import replay_stop_pack
from regen.opinfo import storage_key
from regen.runtime.saved_entries import Kept, check_version
from regen.runtime.plan_index import DecisionInfo, PlanIndex
from regen.runtime.recompute import CapturedOp, replay_recipe
from regen.runtime.region_replays import RegionReplays
from regen.runtime.stats import RuntimeStats
from regen.runtime.storage_views import Geometry
from regen.runtime.swap import CopyIn, CopyOut, SwapQueue


# NOTE [ A handle that dies in forward ]
# Autograd frees a node's saved entries when nothing refers to the node any more, which can happen in forward:
# `torch.topk(x, k)[1]` drops the values, so topk's backward node and its saved indices go at once, and the gather
# that reads the indices then saves the same storage again (a DeepSeek-V3 router). So:
#   1. a planned storage whose handles all died while the step's packs are still matched is released only when
#      the matching ends (`matching_ended`): a later pack of the same storage takes it up again as it stands
#      (dropped with its recipe captured, or its copy-out under way), never a released one;
#   2. a handle that dies before its unpack counts as that unpack done (`used`): the use will never come, so a
#      rebuilt or restored storage still goes after its last real use, not at the step's release.


# NOTE [ A rebuilder that was not dropped ]
# A candidate t "rebuilt with" r (Decision.rebuilt_with) is dropped at its pack and rebuilt when r's recipe runs,
# which computes t's output on the way. A step that leaves its plan after t's pack and before r's (a batch without
# padding, regen/runtime/apply.py: Note [ A step that leaves its plan ]) keeps r, or hands it to dynamic mode, so
# r's recipe never runs in this step. Then:
#   1. t is rebuilt by the ops of r's recipe up to t's own producer (its ancestors in the chain run before it:
#      ops are numbered in forward order), all of which ran, and were captured, before t's pack;
#   2. that part reads r's recipe inputs that this step kept for them; one it did not keep is a PlanMismatchError;
#   3. where r was dropped and its recipe has not run when backward reads t, backward ran in another order than
#      profiled: a PlanMismatchError, as before.


class PlannedStorage:
    """One storage of one step: what the runtime did with it and what it still owes."""

    __slots__ = ("key", "info", "mode", "pending", "live", "storage", "copy_out", "copy_in", "recipe_ran",
                 "version", "released", "storage_key", "kept_by_autograd")

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
        self.version = 0  # kept recipe_inputs: version counter when packed
        self.released = False
        self.storage_key: int | None = None  # swapped: the storage copied out (fast-path check)
        # kept recipe_inputs: the tensor autograd holds for it, weakly: alive again in a backward over a retained graph
        self.kept_by_autograd: weakref.ref | None = None



_EMPTY: dict[tuple[torch.device, torch.dtype], torch.Tensor] = {}  # (device, dtype) -> an empty tensor


def version_probe(x: torch.Tensor) -> torch.Tensor | None:
    """A tensor that shares `x`'s version counter and none of its memory (a detached alias whose data is swapped
    for an empty tensor's: `.data =` keeps the alias's version counter and does not count as a write), or None
    for a tensor that cannot have one. One is made per dropped or swapped entry, so it is kept cheap: one
    alias and one assignment, where `set_` and putting the counter back cost about three times as much."""
    empty = _EMPTY.get((x.device, x.dtype))
    if empty is None:
        empty = _EMPTY[(x.device, x.dtype)] = torch.empty(0, dtype=x.dtype, device=x.device)
    try:
        probe = x.detach()
        probe.data = empty
    except RuntimeError:  # a tensor subclass or layout without a plain storage
        return None
    return probe



class Saved:
    """What autograd stores for a swapped or dropped entry: the planned storage, the entry's geometry, and a
    version probe of the packed tensor (its version counter, no memory) with its value at the pack, so an
    in-place change before backward is caught as autograd would."""

    __slots__ = ("table", "ps", "geometry", "unpacked", "probe", "version")

    def __init__(self, table: "PlannedStorages", ps: PlannedStorage, x: torch.Tensor):
        self.table = table
        self.ps = ps
        self.geometry = Geometry.of(x)
        self.unpacked = False
        self.version = x._version
        self.probe = version_probe(x)

    def check_version(self) -> None:
        if self.probe is not None:
            check_version(self.probe, self.version, self.geometry.size)

    def __del__(self):
        try:
            self.table.handle_died(self.ps, self.unpacked)
        except Exception:  # interpreter shutdown; never raise from a finaliser
            pass


class PlannedStorages:
    """The planned storages of one step by key, with the handles autograd holds on them."""

    def __init__(self, index: PlanIndex, captures: dict[int, CapturedOp], swaps: SwapQueue, stats: RuntimeStats,
                 mismatch: Callable[[str], None], handles_gone: Callable[[], None], regions: RegionReplays):
        """`captures`: the step's recipe captures (forward_ops.py); `mismatch(message)`: the step's
        mismatch; `handles_gone()`: called when autograd has freed every handle of the step; `regions`:
        the step's region calls (region_replays.py)."""
        self.index = index
        self.captures = captures
        self.regions = regions
        self.swaps = swaps
        self.stats = stats
        self._mismatch = mismatch
        self._handles_gone = handles_gone
        self.storages: dict[tuple[int, int], PlannedStorage] = {}
        self.live = 0  # handles autograd still holds, over all of them
        # on a checked step (`watch_drops`): storage key -> (weak reference, bytes) of each storage dropped for
        # recompute, to count those something else still holds when backward begins
        self.dropped: dict[int, tuple[StorageWeakRef, int]] | None = None
        self.matching = True  # packs are still matched to the plan's (Note [ A handle that dies in forward ])
        self._dead_while_matching: list[PlannedStorage] = []

    def watch_drops(self) -> None:
        """Count, on this step, the dropped storages still held when backward begins (`held_bytes`)."""
        self.dropped = {}

    def held_bytes(self) -> int:
        """Bytes of the storages this step dropped that something else still holds (0 when not watched)."""
        return sum(nbytes for ref, nbytes in (self.dropped or {}).values() if not ref.expired())

    # ---- forward ----------------------------------------------------------------------------------
    def pack(self, x: torch.Tensor, info: DecisionInfo, planned: bool, check_storage: bool):
        """Pack tensor `x` whose decision is `info`: keep it, or start its swap or drop and return a
        `Saved`. `planned`: the step still follows the plan (else keep); `check_storage`: the pack was
        matched by order, so check that a swapped planned storage is saved from the storage copied out."""
        key = info.key
        ps = self.storages.get(key)
        if ps is None:
            ps = self.storages[key] = PlannedStorage(key, info)
        elif check_storage and ps.storage_key is not None and storage_key(x) != ps.storage_key:
            self._mismatch(f"op {key[0]} output {key[1]} was saved from two storages (the plan's verified step "
                           f"saved one)")
            return Kept(x)
        if ps.mode is None:
            if not planned or info.action == ACTION_KEEP:
                ps.mode = ACTION_KEEP
            elif info.action == ACTION_SWAP:
                self.swaps.start(ps, x)
                ps.mode = ACTION_SWAP
                ps.storage_key = storage_key(x)
            elif self._start_drop(ps):
                ps.mode = ACTION_RECOMPUTE
                if self.dropped is not None:
                    storage = x.untyped_storage()
                    self.dropped[storage_key(x)] = (StorageWeakRef(storage), storage.nbytes())
            else:  # its recipe was not captured: keep
                ps.mode = ACTION_KEEP
        if ps.mode == ACTION_KEEP:
            kept = Kept(x)
            if key in self.index.recipe_input_keys and ps.storage is None:
                ps.storage = kept.tensor
                ps.kept_by_autograd = weakref.ref(kept.tensor)
                ps.version = kept.version
            return kept
        ps.pending += 1
        ps.live += 1
        self.live += 1
        return Saved(self, ps, x)

    def _start_drop(self, ps: PlannedStorage) -> bool:
        info = ps.info
        if info.region is not None:
            if not self.regions.captured(info.region):
                self._mismatch(f"op {ps.key[0]}'s output is rebuilt by replaying module "
                               f"{self.index.regions[info.region].region.module!r}, whose call this step did not "
                               f"capture")
                return False
            self.stats.dropped_tensors += 1
            return True
        missing = [r for r in info.decision.recipe if r not in self.captures]
        if missing:
            self._mismatch(f"the recipe of op {ps.key[0]} needs ops {missing}, which were not captured")
            return False
        for a in info.recipe_inputs:
            recipe_input = self.storages.get(a)
            if recipe_input is None:
                recipe_input = self.storages[a] = PlannedStorage(a, self.index.decisions.get(a))
            recipe_input.pending += 1
        self.stats.dropped_tensors += 1
        return True

    # ---- backward ---------------------------------------------------------------------------------
    def materialize(self, ps: PlannedStorage) -> torch.Tensor:
        """A tensor over the planned storage's storage, resident now (restored or rebuilt if needed)."""
        if ps.released:
            raise RegenError(f"regen.apply: op {ps.key[0]}'s saved tensor was released; it was unpacked "
                             f"after autograd freed it (a retained graph over an aborted step?)")
        if ps.mode == ACTION_SWAP:
            return self.swaps.restored(ps)
        if ps.storage is None and ps.kept_by_autograd is not None:  # a second backward (retain_graph)
            ps.storage = ps.kept_by_autograd()
        if ps.storage is not None:
            if ps.mode == ACTION_KEEP:  # a kept recipe input, read before its own unpack perhaps
                check_version(ps.storage, ps.version)
            return ps.storage
        if ps.mode == ACTION_RECOMPUTE and ps.info.region is not None:
            self.replay_region(ps.info.region)  # backward reached it before the planned unpack
            if ps.storage is None:
                raise PlanMismatchError(f"regen.apply: replaying module "
                                        f"{self.index.regions[ps.info.region].region.module!r} did not rebuild op "
                                        f"{ps.key[0]}'s output; the plan does not fit this run")
            return ps.storage
        if ps.mode == ACTION_RECOMPUTE:
            if ps.info.rebuilt_with is not None:
                return self._rebuild_without_its_rebuilder(ps)
            return self._recompute(ps)
        raise PlanMismatchError(f"regen.apply: a recompute recipe reads op {ps.key[0]} output {ps.key[1]}, "
                                f"which this step never saved; the plan does not fit this model")

    def _recompute(self, ps: PlannedStorage) -> torch.Tensor:
        info = ps.info
        allowed = set(info.recipe_inputs)

        def recipe_input(key):
            if key not in allowed:
                raise PlanMismatchError(
                    f"regen.apply: the recipe of op {ps.key[0]} reads op {key[0]} output {key[1]}, which is "
                    f"neither in its recipe nor among its recipe_inputs; the plan does not fit this model")
            a = self.storages.get(key)
            if a is None:
                raise PlanMismatchError(f"regen.apply: recipe input op {key[0]} output {key[1]} was never saved "
                                        f"in this step")
            return self.materialize(a)

        keep = tuple(k for k in info.rebuilds if (b := self.storages.get(k)) is not None and b.storage is None
                     and not b.released and b.mode == ACTION_RECOMPUTE)
        result, kept = replay_recipe(ps.key, info.decision.recipe, self.captures, recipe_input, info.shape, info.dtype,
                                     keep=keep)
        self.stats.recomputes += 1
        ps.storage = result
        for key, tensor in kept.items():  # rebuilt with this recipe: held until their own use
            b = self.storages[key]
            if tensor.shape != b.info.shape or tensor.dtype != b.info.dtype:
                raise PlanMismatchError(f"regen.apply: op {key[0]}'s output, rebuilt with op {ps.key[0]}'s recipe, "
                                        f"is {tuple(tensor.shape)} {tensor.dtype}; the plan expects "
                                        f"{tuple(b.info.shape)} {b.info.dtype}")
            b.storage = tensor
        if not ps.recipe_ran:
            ps.recipe_ran = True
            for a in info.recipe_inputs:
                a_cand = self.storages.get(a)
                if a_cand is not None:
                    self.used(a_cand)
        return result

    def _rebuild_without_its_rebuilder(self, ps: PlannedStorage) -> torch.Tensor:
        """A dropped tensor rebuilt with another candidate's recipe, which has not run: Note [ A rebuilder that was
        not dropped ]."""
        rebuilder = self.storages.get(ps.info.rebuilt_with)
        if rebuilder is not None and rebuilder.mode == ACTION_RECOMPUTE:
            raise PlanMismatchError(
                f"regen.apply: op {ps.key[0]}'s saved tensor is rebuilt by the recipe of op "
                f"{ps.info.rebuilt_with[0]}'s, which had not run when backward first read it: backward ran "
                f"in another order than profiled; the plan does not fit this run")
        info = self.index.decisions[ps.info.rebuilt_with]
        allowed = set(info.recipe_inputs)

        def recipe_input(key):
            a = self.storages.get(key) if key in allowed else None
            if a is None:
                raise PlanMismatchError(f"regen.apply: op {ps.key[0]}'s saved tensor, rebuilt with the recipe of op "
                                        f"{info.key[0]}'s (which this step kept), needs op {key[0]} output {key[1]}, "
                                        f"which this step did not keep for it; the plan does not fit this run")
            return self.materialize(a)

        chain = [op for op in info.decision.recipe if op <= ps.key[0]]
        result, _ = replay_recipe(ps.key, chain, self.captures, recipe_input, ps.info.shape, ps.info.dtype)
        self.stats.recomputes += 1
        ps.storage = result
        return result

    def replay_region(self, rid: int) -> None:
        """Replay region `rid` (once) and hold what it rebuilt for the members dropped in this step."""
        waiting = [k for k in self.index.regions[rid].pack_keys
                   if k is not None and (c := self.storages.get(k)) is not None and c.mode == ACTION_RECOMPUTE
                   and c.storage is None and not c.released]
        if not waiting:
            return
        # up to the first pack of the last member this step dropped (the plan's early stop, over this step's drops):
        # a step that left its plan in the call dropped only those before, and the call's later packs, replayed,
        # follow its new path (another shape than the plan's)
        dropped = [key if key in waiting else None for key in self.index.regions[rid].pack_keys]
        rebuilt = self.regions.replay(rid, stop=replay_stop_pack(dropped) + 1)
        if not rebuilt:
            return
        self.stats.region_replays += 1
        for key in waiting:
            ps = self.storages[key]
            tensor = rebuilt.get(key)
            if tensor is None or tensor.untyped_storage().nbytes() != ps.info.decision.bytes:
                raise PlanMismatchError(f"regen.apply: replaying module {self.index.regions[rid].region.module!r} "
                                        f"rebuilt op {key[0]}'s output with another size; the plan does not fit "
                                        f"this model")
            ps.storage = tensor

    def used(self, ps: PlannedStorage) -> None:
        """One use of the planned storage is done (a first unpack, a recipe that read it); after its last one
        its resident storage goes (backward has begun: the forward is closed)."""
        ps.pending -= 1
        if ps.pending <= 0:
            self._drop_device_copy(ps)

    def _drop_device_copy(self, ps: PlannedStorage) -> None:
        if ps.copy_in is not None:
            self.swaps.drop_copy_in(ps)
        ps.storage = None

    # ---- lifetime ---------------------------------------------------------------------------------
    def handle_died(self, ps: PlannedStorage, unpacked: bool) -> None:
        """Autograd freed a `Saved` of this planned storage (`unpacked`: after its unpack). Note [ A handle
        that dies in forward ]."""
        ps.live -= 1
        self.live -= 1
        if not unpacked:  # its unpack will never come: one use fewer to wait for
            self.used(ps)
        if ps.live == 0 and not ps.released:
            if self.matching:
                self._dead_while_matching.append(ps)
            else:
                self._release(ps)
        if self.live <= 0:
            self._handles_gone()

    def matching_ended(self) -> None:
        """The step's packs are matched no more (its forward is closed): the planned storages whose handles all
        died before are released now (Note [ A handle that dies in forward ])."""
        self.matching = False
        for ps in self._dead_while_matching:
            if ps.live == 0 and not ps.released:
                self._release(ps)
        self._dead_while_matching = []

    def _release(self, ps: PlannedStorage) -> None:
        ps.released = True
        self._drop_device_copy(ps)
        if ps.copy_out is not None:
            self.swaps.release(ps)

    def release_all(self) -> None:
        """The step is released: every planned storage gives back what it holds."""
        for ps in list(self.storages.values()):
            if not ps.released:
                self._release(ps)
        self.storages = {}
