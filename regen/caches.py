"""Key/value caches off in training steps, as Hugging Face's own gradient checkpointing turns them off.

A decoder built at its config's defaults (`use_cache=True`) builds a cache object in every training forward,
and every layer appends its keys and values to it. Training never reads that cache, and it costs twice:

1. it holds every layer's keys and values until the step's output is dropped, so dropping the tensors that
   share their storages frees nothing;
2. a module call replayed in backward (a region, like a checkpointed layer) appends to it again: the keys
   and values it then reads are twice as long as in forward (a crash, or with some attention masks a
   silently different result).

transformers' own checkpointing passes `use_cache=False` to every checkpointed layer for this reason
(`GradientCheckpointingLayer`: "Caching is incompatible with gradient checkpointing"), and its Trainer sets
`model.config.use_cache = args.use_cache` (False by default). regen does the same while it profiles a
step and while a handle of `regen.apply` is in place: every module's `config.use_cache` that is True is set
to False, with one notice, and put back as it was when the profile is done or the handle removed. Profile
and plan agree on it, so the op sequence the runtime sees is the profiled one.

This is the rule for a library convention, not for one architecture: any module whose `config` carries
`use_cache` (every Hugging Face model, a PEFT model wrapping one). A forward that passes `use_cache=True`
itself still builds its cache; for such calls, and for any other state a forward writes outside its
tensors, the profiler's replay probe keeps them out of regions (regen.profiler.liveness).
"""

from __future__ import annotations

import os
import sys
import warnings
from dataclasses import dataclass, field

from torch import nn

class TrainingCacheNotice(UserWarning):
    """regen turned a model's key/value cache off for its training steps (said once per profile or handle)."""


CACHE_NOTICE = ("the model's key/value cache is off for training steps (config.use_cache=False, as Hugging Face's "
                "gradient checkpointing and Trainer set it); your setting comes back when regen is done")


@dataclass
class CachesOff:
    """The configs whose `use_cache` was turned off, to be put back by `restore()` (or at the end of a `with`
    block: `with training_caches_off(model): ...`)."""

    configs: list = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.configs)

    def restore(self) -> None:
        """Put every `use_cache` back as it was (once)."""
        for config in self.configs:
            config.use_cache = True
        self.configs = []

    def __enter__(self) -> "CachesOff":
        return self

    def __exit__(self, *exc) -> None:
        self.restore()


def training_caches_off(model: nn.Module) -> CachesOff:
    """Turn off `config.use_cache` on every module of `model` that has it on; what to restore."""
    turned = CachesOff()
    seen: set[int] = set()
    for module in model.modules():
        config = getattr(module, "config", None)
        if config is None or id(config) in seen:
            continue
        seen.add(id(config))
        if getattr(config, "use_cache", None) is True:
            config.use_cache = False
            turned.configs.append(config)
    return turned


def announced_caches_off(model: nn.Module) -> CachesOff:
    """`training_caches_off` for a handle of `regen.apply`, with the notice when it turned any off."""
    turned = training_caches_off(model)
    if turned:
        warnings.warn(f"regen.apply: {CACHE_NOTICE}", TrainingCacheNotice, stacklevel=_first_caller_outside_regen())
    return turned


def _first_caller_outside_regen() -> int:
    """The stack level of the nearest frame outside the regen package (the user's `regen.apply` line)."""
    package = os.path.dirname(os.path.abspath(__file__))
    frame, level = sys._getframe(1), 1
    while frame is not None and os.path.abspath(frame.f_code.co_filename).startswith(package + os.sep):
        frame, level = frame.f_back, level + 1
    return level
