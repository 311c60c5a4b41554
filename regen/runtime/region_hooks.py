"""The module hooks that report region calls to the running step (region_replays.py replays them).

`RegionHooks.add(states)` puts a forward pre-hook (first of the module's pre-hooks: the replay calls the
module, which runs the user's pre-hooks again on these arguments) and a forward hook on each module a
region of the plan states replays, once per module however many plans name it. They report each call
in forward, with grad enabled and outside autograd's backward, to the step `current()` returns.
"""

from __future__ import annotations

from typing import Callable

import torch
from torch import nn

from regen.errors import PlanMismatchError


class RegionHooks:
    """The region modules' hooks of one handle."""

    def __init__(self, root: nn.Module, current: Callable[[], object]):
        self.root = root
        self.current = current  # () -> the running planned step, or None
        self.paths: set[str] = set()  # modules hooked already

    def add(self, states: list) -> list:
        """Hook the region modules of `states` not hooked yet; the new hooks' handles."""
        hooks = []
        paths = (r.region.module for s in states for r in s.index.regions.values())
        for path, module in new_submodules(self.root, paths, self.paths, "replays"):
            hooks.append(module.register_forward_pre_hook(self._pre_hook(path), with_kwargs=True, prepend=True))
            hooks.append(module.register_forward_hook(self._post_hook, always_call=True))
        return hooks

    def _pre_hook(self, path: str):
        def pre_hook(module, args, kwargs):
            step = self.current()
            if step is not None and torch.is_grad_enabled() and torch._C._current_graph_task_id() == -1:
                step.region_called(path, module, args, kwargs)

        return pre_hook

    def _post_hook(self, module, args, output):
        step = self.current()
        if step is not None and torch._C._current_graph_task_id() == -1:
            step.region_returned(module)


def new_submodules(root: nn.Module, paths, hooked: set[str], verb: str) -> list[tuple[str, nn.Module]]:
    """(path, module) for each of `paths` not in `hooked` yet (added to it), once each; a path the model
    lacks is a PlanMismatchError ("the plan <verb> module ...")."""
    found = []
    for path in dict.fromkeys(paths):
        if path in hooked:
            continue
        hooked.add(path)
        try:
            found.append((path, root.get_submodule(path)))
        except AttributeError:
            raise PlanMismatchError(f"regen.apply: the plan {verb} module {path!r}, which this model does not "
                                    f"have; profile and solve for this model") from None
    return found
