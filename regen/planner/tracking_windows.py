"""Tracking windows: the forward ops the runtime's dispatch mode follows on a plan's fast steps.

A per-tensor recipe needs the runtime to see some forward ops on every step: the recipe's own ops (it
captures their arguments) and the forward producers of what they read (it notes their outputs in the
writer map): the recipe's *tracked ops* (regen.runtime.forward_ops.FastOps). The runtime has no op
counter outside its dispatch mode, so it can start following the forward only where a hook of its own
runs and the op count there is known: the step's start (the root's call) or the start of a module call.
Each tracked op t is therefore followed from its *window start*, the latest module call that starts at
or before t (`Profile.module_calls`, the root at op 0), through t and on to the first forward pack after
it (the runtime lets its dispatch mode go in a pack hook); every op in that window goes through
the dispatch mode (`RuntimeCharges.dispatch_op_s` each), and the ops outside every window run plainly.
A plan names the calls that open its windows (`Plan.tracking_starts`); the runtime hooks them and reads
their op counts on the verified step (regen.runtime.window_hooks).
"""

from __future__ import annotations

from dataclasses import dataclass

from regen.formats.plan import TrackingStart
from regen.formats.plan_rules import merged_windows
from regen.formats.profile import Profile

ROOT_START = TrackingStart(module="", call=0, first_op=0)  # the step's start: always a window start


@dataclass
class WindowStarts:
    """The module calls a tracking window can start at, by first op (the shallowest call where several
    start at the same op)."""

    first_ops: list[int]
    starts: list[TrackingStart]
    closing_ops: list[int]  # where a window can end: the ops after which the forward packs, and its last op

    @staticmethod
    def of(profile: Profile, pack_steps: list[int]) -> "WindowStarts":
        """The window starts of `profile`; `pack_steps`: the op after each forward pack
        (PlanningGraph.pack_steps), where a window can close."""
        by_op: dict[int, tuple[int, TrackingStart]] = {0: (-1, ROOT_START)}
        for c in profile.module_calls or []:
            if c.first_op > c.last_op:  # a call that ran no op
                continue
            best = by_op.get(c.first_op)
            if best is None or c.depth < best[0]:
                by_op[c.first_op] = (c.depth, TrackingStart(module=c.module, call=c.call, first_op=c.first_op))
        ops = sorted(by_op)
        closing = sorted({step - 1 for step in pack_steps if step > 0} | {profile.num_forward_ops - 1})
        return WindowStarts(first_ops=ops, starts=[by_op[op][1] for op in ops], closing_ops=closing)

    def windows(self, tracked_ops) -> list[tuple[int, int, TrackingStart]]:
        """The merged windows of `tracked_ops` (formats.plan_rules.merged_windows, as the runtime has them)."""
        return merged_windows(list(zip(self.first_ops, self.starts)), tracked_ops, self.closing_ops)

    def covered(self, tracked_ops) -> frozenset[int]:
        """Every forward op the dispatch mode sees to follow `tracked_ops`."""
        return frozenset(op for first, last, _ in self.windows(tracked_ops) for op in range(first, last + 1))

    def opening(self, tracked_ops) -> list[TrackingStart]:
        """The calls that open the windows of `tracked_ops`, in op order."""
        return [start for _, _, start in self.windows(tracked_ops)]
