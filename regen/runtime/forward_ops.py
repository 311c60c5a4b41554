"""Forward ops of one step: what the runtime does at each op the `ForwardTracker` counts.

* The writer map (docs/internals.md "Naming a saved tensor"): `storage_key -> Writer`, the op output
  that last wrote the storage, with its shape and dtype, updated with `opinfo.written_outputs`. Packs
  are matched through it (packing.py) and recipe captures reference its entries.
* The gathered parameters: the storages FSDP's gathering ops (`opnames.gathers_parameters`) wrote, which
  recipe captures read as parameters FSDP gathers again before the unit's backward (`recompute.Gathered`).
* The fingerprint of the forward ops, fed until the handle has verified a step.
* Recipe captures: an op whose index is in `Plan.recipe_ops` has its name checked and is captured
  (`recompute.capture_op`) before it runs.

`ForwardOps.slow_op` does all of it on every op. `ForwardOps.fast_op` serves the steps after the
verified one of a plan with recompute decisions (docs/internals.md "Pack-order fast path"): packs then
match by order, so only the `FastOps.tracked` ops (the recipe ops, the producers of what their
captures read and of the tensors dropped for a recipe or kept as its input, taken from the verified
step) and the gathering ops do more than count and run, and the writer map only holds the producers'
outputs; and a fast step sees only the ops of its tracking windows (window_hooks.py), the count set at each
window's start to the one the verified step recorded there (`entries`). The step learns what happened
through callbacks: a mismatch, the last planned op (with whether the fingerprint matched), and, on fast
steps, the end of a tracking window.
"""

from __future__ import annotations

from typing import Callable

from torch.multiprocessing.reductions import StorageWeakRef

from regen.formats.plan import ACTION_RECOMPUTE, Plan
from regen.formats.profile import OpFingerprint
from regen.opinfo import op_name, op_outputs, storage_key, written_outputs
from regen.opnames import gathers_parameters
from regen.runtime.plan_index import PlanIndex
from regen.runtime.recompute import CapturedOp, capture_op, check_captured_name
from regen.runtime.window_hooks import Windows, tracking_windows
from regen.runtime.writers import Writer


class FastOps:
    """What a fast step of a plan with recompute decisions must still do per forward op (taken from the
    verified step): capture the recipe ops, and note the outputs of the ops those captures read and of
    the candidates whose packs are checked against the writer map (packing.writer_mismatch)."""

    __slots__ = ("tracked", "producers", "gathers", "refs", "windows")

    def __init__(self, captures: dict[int, CapturedOp], recipe_ops, checked_keys, gathers=frozenset(),
                 entries: dict[tuple[str, int], int] | None = None):
        """`checked_keys`: the (op, slot) of the decisions whose packs a fast step checks against the writer
        map (dropped for a recipe, or kept as a recipe's input); `gathers`: the verified step's ops that
        gathered parameters before a recipe op; `entries`: the op count at the start of each module call
        that may open a tracking window, (path, call) -> count, as the verified step saw them."""
        self.refs: dict[int, tuple] = {idx: cap.refs for idx, cap in captures.items()}  # verified (op, slot)s
        self.producers = frozenset({op for refs in self.refs.values() for op, _ in refs}
                                   | {op for op, _ in checked_keys})
        self.gathers = frozenset(gathers)
        self.tracked = frozenset(recipe_ops) | self.producers | self.gathers  # every other op: count and run
        self.windows: Windows = tracking_windows(self.tracked, entries or {})


class ForwardOps:
    """One step's forward ops: their count, the writer map, the fingerprint and the recipe captures."""

    __slots__ = ("index", "count", "writer", "gathered", "gather_ops", "captures", "fingerprint", "fast",
                 "entries", "calls", "window_end", "_mismatch", "_last_op_ran", "_tracking_done")

    def __init__(self, index: PlanIndex, fingerprint: bool, fast: FastOps | None,
                 mismatch: Callable[[str], None], last_op_ran: Callable[[bool], None],
                 tracking_done: Callable[[], None]):
        """`fingerprint`: hash the ops and check the plan's fingerprint; `fast`: the verified step's
        tracking (use `fast_op`); `last_op_ran(fingerprint_matched)` is called after the plan's last
        forward op, `tracking_done()` after the last tracked op of a fast step's tracking window."""
        self.index = index
        self.count = 0
        self.writer: dict[int, Writer] = {}
        self.gathered: dict[int, StorageWeakRef] = {}  # storage_key -> a parameter storage FSDP gathered
        self.gather_ops: set[int] = set()
        self.captures: dict[int, CapturedOp] = {}
        self.fingerprint: OpFingerprint | None = OpFingerprint() if fingerprint else None
        self.fast = fast
        self.entries: dict[tuple[str, int], int] = {}  # a slow step's op count at each window-start call
        self.calls: dict[str, int] = {}  # window-start module -> its calls so far in this forward
        root = fast.windows.at_step_start() if fast is not None else None
        self.window_end = root[1] if root is not None else -1  # the open window's last op (-1: none open)
        self._mismatch = mismatch
        self._last_op_ran = last_op_ran
        self._tracking_done = tracking_done

    def slow_op(self, func, args, kwargs):
        """Every forward op of a step matched through the writer map: writer map, fingerprint, captures."""
        idx = self.count
        self.count = idx + 1
        index = self.index
        if idx in index.recipe_op_names:
            problem = check_captured_name(idx, func, index.recipe_op_names[idx])
            if problem:
                self._mismatch(problem)
            else:
                self.captures[idx] = capture_op(idx, func, args, kwargs, self.writer, index.recipe_op_random[idx],
                                                self.gathered)
        out = func(*args, **kwargs)
        outs = op_outputs(func, args, kwargs, out)
        self._note_writes(idx, func, args, kwargs, outs)
        fp = self.fingerprint
        if fp is not None:
            fp.add(op_name(func), [(tuple(o.shape), str(o.dtype)) for o in outs if o is not None])
        if idx + 1 == index.num_forward_ops:
            matched = False
            if fp is not None:
                self.fingerprint = None
                problem = fingerprint_mismatch(fp, index.plan)
                if problem:
                    self._mismatch(problem)
                else:
                    matched = True
            self._last_op_ran(matched)
        return out

    def fast_op(self, func, args, kwargs):
        """A forward op of a step after the verified one (plan with recompute): packs match by order, so
        only the recipe ops and the producers of what they read do more than count and run."""
        idx = self.count
        self.count = idx + 1
        if idx in self.fast.tracked:
            out = self._tracked_op(idx, func, args, kwargs)
            if idx >= self.window_end:
                self._tracking_done()
        else:
            out = func(*args, **kwargs)
        if idx + 1 == self.index.num_forward_ops:
            self._last_op_ran(False)
        return out

    def _tracked_op(self, idx, func, args, kwargs):
        index = self.index
        fast = self.fast
        expected = index.recipe_op_names.get(idx)
        if expected is not None:
            problem = check_captured_name(idx, func, expected)
            if problem:
                self._mismatch(problem)
            else:
                cap = capture_op(idx, func, args, kwargs, self.writer, index.recipe_op_random[idx], self.gathered)
                if cap.refs != fast.refs[idx]:
                    self._mismatch(f"recipe op {idx} ({expected}) reads the outputs {list(cap.refs)} (op, slot), "
                                   f"the plan's verified step read {list(fast.refs[idx])}: the forward's data "
                                   f"flow changed (data-dependent control flow?)")
                else:
                    self.captures[idx] = cap
        out = func(*args, **kwargs)
        if idx in fast.producers or idx in fast.gathers:
            self._note_writes(idx, func, args, kwargs, op_outputs(func, args, kwargs, out))
        return out

    def _note_writes(self, idx, func, args, kwargs, outs):
        """The writer map (docs/internals.md): each storage this op wrote -> its `Writer`."""
        writer = self.writer
        for slot, key in written_outputs(func, args, kwargs, outs):
            writer[key] = Writer.of(idx, slot, outs[slot])
        if gathers_parameters(op_name(func)):
            self.gather_ops.add(idx)
            for o in outs:
                if o is not None:
                    self.gathered[storage_key(o)] = StorageWeakRef(o.untyped_storage())

    def module_entered(self, path: str) -> bool:
        """A call of window-start module `path` begins: a slow step records the op count; on a fast step,
        True when the call opens a tracking window (the count is set to where the window starts)."""
        call = self.calls.get(path, 0)
        self.calls[path] = call + 1
        if self.fast is None:
            self.entries[(path, call)] = self.count
            return False
        window = self.fast.windows.opens.get((path, call))
        if window is None:
            return False
        self.count, self.window_end = window
        return True

    @property
    def all_ran(self) -> bool:
        """Every forward op of the plan has run."""
        return self.count >= self.index.num_forward_ops

    def fast_ops_for_later_steps(self) -> FastOps | None:
        """What later steps must track, from this (verified) step's captures; None if a recipe op was not
        captured."""
        if self.captures.keys() != self.index.recipe_op_names.keys():
            return None
        index = self.index
        checked = [k for k, i in index.decisions.items() if i.action == ACTION_RECOMPUTE and i.region is None]
        return FastOps(self.captures, index.recipe_op_names, checked + list(index.recipe_input_keys),
                       {g for g in self.gather_ops if g < max(index.recipe_op_names, default=-1)}, self.entries)

    def end_forward(self) -> None:
        """No more forward ops to follow: drop the fingerprint and the writer map (captures stay)."""
        self.fingerprint = None
        self.writer.clear()
        self.gathered.clear()

    def release(self) -> None:
        self.end_forward()
        self.captures.clear()


def fingerprint_mismatch(fp: OpFingerprint, plan: Plan) -> str | None:
    """A mismatch message when the hashed forward ops are not the ones the plan was made for."""
    got = fp.hexdigest()
    if got == plan.fingerprint:
        return None
    return (f"the forward ops differ from the plan's (fingerprint {got}, the plan was made for {plan.fingerprint}, "
            f"workload {plan.workload.get('name')!r})")
