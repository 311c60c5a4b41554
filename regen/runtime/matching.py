"""Matching: how the runtime finds each saved tensor's plan entry.

* `PlanIndex` is the plan read once into lookup tables (decisions by `(producer_op, output_slot)`,
  recipe op names, anchors) and checked for internal consistency; a malformed plan is a FormatError.
* `ForwardTracker` is the dispatch mode that counts forward ops (docs/internals.md "Op numbering"):
  it hands every op to the current step, which updates its writer map with
  `regen.opinfo.written_outputs`, feeds the fingerprint during the first planned step and captures
  recipe ops (on steps after the verified one of a recompute plan, only the recipe ops and the
  producers of their inputs do more than count). Once the step's forward is over it passes ops
  straight through; regen's own copies and
  replays run with it paused so they are never counted.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from regen.errors import FormatError
from regen.opinfo import is_counted
from regen.formats.plan import ACTION_RECOMPUTE, ACTION_SWAP, Decision, Plan, rebuilt_with_error

PHASE_FORWARD = 0  # counting forward ops
PHASE_TAIL = 1  # all of the plan's forward ops ran; the last one's outputs may still be packed
PHASE_CLOSED = 2  # forward over: every later pack keeps


def parse_dtype(name: str, where: str) -> torch.dtype:
    dtype = getattr(torch, name.rsplit(".", 1)[-1], None)
    if not isinstance(dtype, torch.dtype):
        raise FormatError(f"{where}: unknown dtype '{name}'")
    return dtype


@dataclass
class DecisionInfo:
    """A decision with what the runtime checks and needs, precomputed."""

    decision: Decision
    key: tuple[int, int]
    shape: torch.Size
    dtype: torch.dtype
    action: str
    anchors: tuple[tuple[int, int], ...] = ()  # recipe_inputs as (producer_op, output_slot)
    rebuilt_with: tuple[int, int] | None = None  # the decision whose recipe rebuilds this one (Decision.rebuilt_with)
    rebuilds: tuple[tuple[int, int], ...] = ()  # decisions rebuilt with this one's recipe, kept for their use


@dataclass
class PlanIndex:
    plan: Plan
    decisions: dict[tuple[int, int], DecisionInfo]
    recipe_op_names: dict[int, str]
    recipe_op_random: dict[int, bool]
    anchor_keys: frozenset  # candidates some recompute decision reads
    num_forward_ops: int
    has_recompute: bool = False  # any recompute (fast steps then keep a minimal dispatch mode)
    swap_bytes: int = 0


def index_plan(plan: Plan) -> PlanIndex:
    """Read a plan into lookup tables, refusing plans that contradict themselves."""
    where = "plan"
    n_fwd = plan.num_forward_ops
    if n_fwd <= 0:
        raise FormatError(f"{where}: num_forward_ops is {n_fwd}; a plan covers at least one forward op")
    by_saved: dict[int, Decision] = {}
    decisions: dict[tuple[int, int], DecisionInfo] = {}
    for d in plan.decisions:
        key = (d.producer_op, d.output_slot)
        if key in decisions:
            raise FormatError(f"{where}: two decisions for op {d.producer_op} output {d.output_slot}")
        if not 0 <= d.producer_op < n_fwd:
            raise FormatError(f"{where}: decision for saved tensor {d.saved_tensor} names op {d.producer_op}, "
                              f"outside the forward (0..{n_fwd - 1})")
        by_saved[d.saved_tensor] = d
        decisions[key] = DecisionInfo(decision=d, key=key, shape=torch.Size(d.shape),
                                      dtype=parse_dtype(d.dtype, f"{where}: saved tensor {d.saved_tensor}"),
                                      action=d.action)
    names = {r.index: r.name for r in plan.recipe_ops}
    randoms = {r.index: bool(r.is_random) for r in plan.recipe_ops}
    anchors: set[tuple[int, int]] = set()
    for info in decisions.values():
        d = info.decision
        if info.action != ACTION_RECOMPUTE:
            continue
        if not d.recipe or info.key[0] not in d.recipe:
            raise FormatError(f"{where}: the recipe of saved tensor {d.saved_tensor} does not run its producer "
                              f"op {d.producer_op}")
        if list(d.recipe) != sorted(set(d.recipe)):
            raise FormatError(f"{where}: the recipe of saved tensor {d.saved_tensor} is not in execution order")
        for r in d.recipe:
            if r not in names:
                raise FormatError(f"{where}: recipe op {r} (saved tensor {d.saved_tensor}) is missing from recipe_ops")
            if not 0 <= r < n_fwd:
                raise FormatError(f"{where}: recipe op {r} is outside the forward (0..{n_fwd - 1})")
        keys = []
        for sid in d.recipe_inputs:
            src = by_saved.get(sid)
            if src is None:
                raise FormatError(f"{where}: saved tensor {d.saved_tensor} reads saved tensor {sid}, "
                                  f"which has no decision")
            keys.append((src.producer_op, src.output_slot))
        info.anchors = tuple(keys)
        anchors.update(keys)
    for info in decisions.values():
        d = info.decision
        if d.rebuilt_with is None:
            continue
        why = rebuilt_with_error(d, by_saved)
        if why:
            raise FormatError(f"{where}: saved tensor {d.saved_tensor} {why}")
        rebuilder = by_saved[d.rebuilt_with]
        rebuilder_info = decisions[(rebuilder.producer_op, rebuilder.output_slot)]
        info.rebuilt_with = rebuilder_info.key
        rebuilder_info.rebuilds = rebuilder_info.rebuilds + (info.key,)
    swap_bytes = sum(i.decision.bytes for i in decisions.values() if i.action == ACTION_SWAP)
    has_recompute = any(i.action == ACTION_RECOMPUTE for i in decisions.values())
    return PlanIndex(plan=plan, decisions=decisions, recipe_op_names=names, recipe_op_random=randoms,
                     anchor_keys=frozenset(anchors), num_forward_ops=n_fwd,
                     has_recompute=has_recompute, swap_bytes=swap_bytes)


class ForwardTracker(TorchDispatchMode):
    """The dispatch mode of one `regen.apply` handle; `step` is the step whose forward it counts.

    The step's `phase` says what to do: FORWARD counts the op; TAIL (all planned forward ops seen)
    closes matching at the next op; CLOSED passes ops straight through.
    """

    def __init__(self):
        super().__init__()
        self.step = None
        self.paused = 0
        self._counted: dict = {}  # func -> opinfo.is_counted(func), cached (this runs on every op)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        step = self.step
        if kwargs is None:
            kwargs = {}
        if step is None or self.paused or step.phase == PHASE_CLOSED:
            return func(*args, **kwargs)
        counted = self._counted.get(func)
        if counted is None:
            counted = self._counted[func] = is_counted(func)
        if not counted:
            return func(*args, **kwargs)
        if step.phase == PHASE_TAIL:  # an op after the planned forward: nothing more is matched
            step.end_forward()
            return func(*args, **kwargs)
        if torch._C._current_graph_task_id() != -1:
            step.backward_began()
            return func(*args, **kwargs)
        return step.forward_op(func, args, kwargs)

    def pause(self):
        return _Paused(self)


class _Paused:
    __slots__ = ("tracker",)

    def __init__(self, tracker: ForwardTracker):
        self.tracker = tracker

    def __enter__(self):
        self.tracker.paused += 1

    def __exit__(self, *exc):
        self.tracker.paused -= 1
