"""What autograd stores for a saved entry that regen leaves as it is: `Kept` (a step's entry the plan
keeps, or one no decision names) and `Untracked` (an entry packed outside a step's forward: in backward,
by a double backward or a checkpoint's re-run; planned and dynamic steps alike hand it back untouched).
Both check the tensor's version counter at unpack, as autograd does without saved-tensor hooks
(`check_version`)."""

from __future__ import annotations

import torch


def check_version(t: torch.Tensor, saved_version: int, shape=None) -> None:
    """Autograd's own check, which it skips under saved-tensor hooks: a saved tensor modified in place
    since it was packed is an error (raised with autograd's wording; `shape`: the saved tensor's, when `t`
    is a version probe)."""
    version = t._version
    if version != saved_version:
        raise RuntimeError(
            f"one of the variables needed for gradient computation has been modified by an inplace operation: "
            f"[{t.type()} {list(t.shape if shape is None else shape)}] is at version {version}; expected version "
            f"{saved_version} instead. Hint: enable anomaly detection to find the operation that failed to compute "
            f"its gradient, with torch.autograd.set_detect_anomaly(True).")



class Kept:
    """What autograd stores for a kept entry: the tensor (sharing the packed one's version counter) and
    that counter's value at the pack."""

    __slots__ = ("tensor", "version")

    def __init__(self, x: torch.Tensor):
        self.tensor = x.detach()
        self.version = x._version

    def unpack(self) -> torch.Tensor:
        check_version(self.tensor, self.version)
        return self.tensor



class Untracked(Kept):
    """A tensor packed outside the step's forward (e.g. in backward): kept, not counted by the step."""

    __slots__ = ()
