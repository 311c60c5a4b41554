"""Pack matching: which plan decision a tensor saved in a step's forward gets.

* Through the writer map (`WriterMatch`, every step until one is verified): the packed tensor's storage
  names the op output that last wrote it, whose decision `(producer_op, output_slot)` is checked against
  that output's shape and dtype. Such a step also records its packs in order (`PackRecord`: shape,
  dtype, and the decision, or None for "keep": not a candidate, or a keep decision no recipe reads).
* By order (docs/internals.md "Pack-order fast path"): once a step is verified, the k-th pack of a later
  step gets the verified step's k-th record after its shape and dtype are checked (and, for a tensor
  dropped for a recipe or kept as its input, its writer: `writer_mismatch`). That check runs in
  the step's pack hook itself (step.py: it runs for every saved tensor, so it costs no call); the
  messages of its mismatches are here.
"""

from __future__ import annotations

import torch

from regen.formats.plan import ACTION_KEEP, ACTION_RECOMPUTE
from regen.opinfo import storage_key
from regen.runtime.plan_index import DecisionInfo, PlanIndex
from regen.runtime.writers import Writer, live_writer


class PackRecord:
    """One forward pack of the verified step: what later steps must pack at the same position."""

    __slots__ = ("shape", "dtype", "info", "checked", "made")

    def __init__(self, shape, dtype, info, checked: bool, made: bool):
        self.shape: torch.Size = shape
        self.dtype: torch.dtype = dtype
        self.info: DecisionInfo | None = info  # None: keep the tensor; else swap, recompute or a kept recipe input
        # dropped for a recipe or kept as a recipe's input: a later step checks that the writer map names the
        # same op output for it (writer_mismatch), so a step with another data flow is a mismatch
        self.checked = checked
        self.made = made  # an op of the step made it (not a parameter, a buffer or the batch)

    def held_bytes(self) -> int:
        """What the step holds for this pack until backward reads it: its bytes when an op of the step made it and
        the plan does not drop it for a recompute (a swap's device copy counted: it may not have landed yet)."""
        if not self.made or (self.info is not None and self.info.action == ACTION_RECOMPUTE):
            return 0
        return self.shape.numel() * self.dtype.itemsize


class WriterMatch:
    """Matches a step's packs through its writer map and records them in order."""

    __slots__ = ("decisions", "recipe_input_keys", "writer", "recording")

    def __init__(self, index: PlanIndex, writer: dict[int, Writer]):
        self.decisions = index.decisions
        self.recipe_input_keys = index.recipe_input_keys
        self.writer = writer  # the step's (forward_ops.py), filled as its forward ops run
        self.recording: list[PackRecord] = []

    def match(self, x: torch.Tensor) -> tuple[DecisionInfo | None, str | None]:
        """The decision of packed tensor `x` (None: keep it, it is no candidate) and a mismatch message
        when its writer's output does not have the decision's shape and dtype."""
        w = live_writer(self.writer, storage_key(x))
        info = None if w is None else self.decisions.get((w.op, w.slot))
        recipe_input = info is not None and info.key in self.recipe_input_keys
        checked = recipe_input or (info is not None and info.action == ACTION_RECOMPUTE and info.region is None)
        self.recording.append(PackRecord(x.shape, x.dtype, None if info is None or (
            info.action == ACTION_KEEP and not recipe_input) else info, checked, w is not None))
        if info is None:
            return None, None
        if w.shape != info.shape or w.dtype != info.dtype:
            return None, (f"op {w.op} output {w.slot} is {tuple(w.shape)} {w.dtype}, the plan expects "
                          f"{tuple(info.shape)} {info.dtype} (another batch shape or model?)")
        return info, None


def order_mismatch(k: int, x: torch.Tensor, rec: PackRecord) -> str:
    """The k-th pack of a later step does not have the shape and dtype the verified step packed there."""
    return (f"saved tensor {k} of the forward is {tuple(x.shape)} {x.dtype}, the plan's verified step saved "
            f"{tuple(rec.shape)} {rec.dtype} there (another batch shape or model?)")


def writer_mismatch(k: int, x: torch.Tensor, rec: PackRecord, writer: dict[int, Writer]) -> str | None:
    """A later step's k-th pack, dropped for a recipe or kept as its input, is not the op output the verified
    step saved there (the writer map names another, or no live one): the forward's data flow changed."""
    w = live_writer(writer, storage_key(x))
    key = rec.info.key
    if w is not None and (w.op, w.slot) == key:
        return None
    got = "no op output of this step" if w is None else f"op {w.op} output {w.slot}"
    return (f"saved tensor {k} of the forward is {got}, the plan's verified step saved op {key[0]} output {key[1]} "
            f"there: the forward's data flow changed (data-dependent control flow?)")


def fewer_packs_mismatch(pack_count: int, sequence: tuple[PackRecord, ...]) -> str:
    """Backward began before a later step saved as many tensors as the verified step."""
    return (f"the forward saved {pack_count} tensors before backward began, the plan's verified step saved "
            f"{len(sequence)}")
