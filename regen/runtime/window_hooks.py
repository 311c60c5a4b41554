"""Tracking windows: on a fast step, the dispatch mode follows only the forward ops recipes need.

A fast step of a plan with per-tensor recipes must see its tracked ops (forward_ops.FastOps: the
recipe ops and the producers of what they read). Following the whole forward up to the last of them
costs every op in between a Python round trip, so the tracker follows windows instead
(docs/internals.md "Tracking windows"; the planner charges the same windows):

1. The plan names the module calls that may open a window (`Plan.tracking_starts`); `WindowHooks` puts
   a forward pre-hook, first of the module's pre-hooks, on each of those modules, and reports each call
   made in a step's forward to the step (`Step.module_entered`), numbered per module in call order.
2. The verified step follows every op (a slow step) and records the op count at each such call's start
   (`ForwardOps.entries`).
3. From those counts, `tracking_windows` gives each tracked op the latest call that started at or before
   it (the step's start, count 0, when none did) and merges the resulting ranges: a window opens at its
   call's start (the tracker is pushed, its count set to the recorded one) and closes after its last
   tracked op (the tracker is popped at the next pack).

Ops outside every window are not counted; packs still match by order. A call whose window is merged
into an earlier one opens nothing.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
from torch import nn

from regen.formats.plan_rules import merged_windows
from regen.runtime.region_hooks import new_submodules

ROOT = ("", 0)  # the step's start, where the root's call begins (count 0)


@dataclass(frozen=True)
class Windows:
    """A fast step's tracking windows: the calls that open one -> (op count at its start, its last op)."""

    opens: dict  # (module path, call) -> (start count, last tracked op)

    def at_step_start(self) -> tuple[int, int] | None:
        return self.opens.get(ROOT)


def tracking_windows(tracked: frozenset[int], entries: dict[tuple[str, int], int]) -> Windows:
    """The windows that follow every op of `tracked`, from the recorded call starts `entries` ((path,
    call) -> op count at its start; the root's at 0 is implied)."""
    starts = sorted([(0, ROOT)] + [(count, key) for key, count in entries.items() if key != ROOT])
    return Windows(opens={key: (count, last) for count, last, key in merged_windows(starts, tracked)})


class WindowHooks:
    """The pre-hooks on the modules whose calls may open a tracking window, for one handle."""

    def __init__(self, root: nn.Module, current: Callable[[], object]):
        self.root = root
        self.current = current  # () -> the running planned step, or None
        self.paths: set[str] = set()

    def add(self, states: list) -> list:
        """Hook the window-start modules of `states` not hooked yet (the root needs none); the new hooks."""
        paths = (s.module for state in states for s in state.plan.tracking_starts if s.module)
        return [module.register_forward_pre_hook(self._pre_hook(path), prepend=True)
                for path, module in new_submodules(self.root, paths, self.paths, "tracks ops from")]

    def _pre_hook(self, path: str):
        def pre_hook(module, args):
            step = self.current()
            if step is not None and torch.is_grad_enabled() and torch._C._current_graph_task_id() == -1:
                step.module_entered(path)

        return pre_hook
