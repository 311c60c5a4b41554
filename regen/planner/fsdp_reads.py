"""Parameters FSDP gathers (`opnames.gathers_parameters`): where a recipe or a region may read them.

FSDP2 writes a unit's unsharded parameters in the unit's forward pre-hook (so the gathering op's module
is the unit) and frees them after the unit's forward; in the unit's pre-backward hook, before any of its
gradient ops, it gathers them again, and frees them after the unit's backward. A replay just before
backward op b finds them unsharded when b runs in the unit's backward: b's module is the unit or a
module inside it. FSDP2 keeps the root unit's parameters from its forward to its backward, so those of the
root (module "") are readable at every backward op. A read anywhere else would find freed storage (the
runtime refuses it): the planner does not offer it.
"""

from __future__ import annotations

from typing import Iterable

from regen.formats.profile import PHASE_FORWARD, Profile
from regen.opnames import gathers_parameters


def gathered_storages(profile: Profile, tensors: dict) -> dict[int, list[int]]:
    """Storage id -> the forward ops that gathered a parameter into it, increasing."""
    gathered: dict[int, list[int]] = {}
    for op in profile.ops:
        if op.phase == PHASE_FORWARD and gathers_parameters(op.name):
            for st in sorted({tensors[o].storage for o in op.outputs if o in tensors}):
                gathered.setdefault(st, []).append(op.index)
    return gathered


def _inside(module: str | None, unit: str | None) -> bool:
    if unit == "":
        return True
    return module is not None and unit is not None and (module == unit or module.startswith(unit + "."))


def resharded_read(profile: Profile, tensors: dict, gathered: dict[int, list[int]], read_by: Iterable[int],
                   step: int) -> str | None:
    """Why a replay of the forward ops `read_by` just before backward op `step` would read a parameter FSDP
    has freed then, or None when every gathered parameter they read is unsharded at `step`."""
    if not gathered:
        return None
    ops = profile.ops
    module = ops[step].module
    for q in read_by:
        for x in ops[q].inputs:
            rec = tensors.get(x)
            gathers = gathered.get(rec.storage) if rec is not None else None
            before = [g for g in gathers or () if g < q]
            if before and not _inside(module, ops[before[-1]].module):
                return (f"op {q} ({ops[q].name}) reads a parameter of FSDP unit '{ops[before[-1]].module}', "
                        f"resharded at op {step} (module '{module}')")
    return None
