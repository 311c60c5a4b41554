"""`regen.apply(model, memory_cap=...)`: dynamic mode's handle (a context manager, or `.remove()`).

A forward pre-hook on the root module starts a step whenever the model is called with grad enabled; the
steps run on the handle's `DynamicEngine` (engine.py), which pushes each step's saved-tensor hooks (popped
when the next step starts or the handle is removed) and its dispatch mode at a step's start (popped at
the start of a later step of any handle, once no step of the engine is alive, or by `remove()`).

With a host link (CUDA's, or an emulated one on a CPU device) steps also swap (swaps.py).

An exception inside the `with` block releases every live step and leaves no hook, mode or step behind.
"""

from __future__ import annotations

from torch import nn

from regen.caches import announced_caches_off
from regen.call_signature import TrainableCount, call_inputs, signature_key
from regen.errors import RegenError
from regen.formats.profile import CallSignature
from regen.runtime.dynamic.engine import DynamicEngine
from regen.runtime.dynamic.policy import POLICIES
from regen.runtime.model_access import check_model, module_device, starts_a_step, unwrap_model
from regen.units import parse_memory_cap

__all__ = ["DynamicHandle", "check_policy", "cap_bytes", "link_bytes_per_s"]


class DynamicHandle:
    """The object `regen.apply(model, memory_cap=...)` returns: a context manager, or call `.remove()`."""

    def __init__(self, model: nn.Module, memory_cap: int | str, policy: str = "graph",
                 link_gb_s: float | tuple[float, float] | None = None, emulate_link: bool = False):
        check_model(model, "dynamic mode replays ops one by one, so apply it")
        check_policy(policy)
        self.cap_bytes = cap_bytes(memory_cap)
        self.policy = policy
        self.model = model
        self.root = unwrap_model(model)
        self.caches = announced_caches_off(self.root)  # regen.caches
        link = link_bytes_per_s(link_gb_s, emulate_link, module_device(self.root))
        self.engine = DynamicEngine(self.root, self.cap_bytes, policy, link, emulate_link)
        self.mode = self.engine.mode
        self.stats = self.engine.stats
        self._depth = 0
        self._removed = False
        self._trainable = TrainableCount(self.root)  # part of each step's call key
        self._hooks = self._trainable.hooks + [
            self.root.register_forward_pre_hook(self._pre_hook, with_kwargs=True),
            self.root.register_forward_hook(self._post_hook, always_call=True)]

    # ---- public -----------------------------------------------------------------------------------
    def __enter__(self) -> "DynamicHandle":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        self.remove(abort=exc_type is not None)

    def remove(self, abort: bool = False) -> None:
        """Remove every hook and the dispatch mode. With abort=True (an exception ended the `with` block)
        the live steps are released too; otherwise a step whose graph autograd still holds can finish its
        backward (rebuilding what it dropped)."""
        if self._removed:
            return
        self._removed = True
        for h in self._hooks:
            h.remove()
        self._hooks = []
        self.engine.remove(abort)
        self.caches.restore()

    @property
    def active_steps(self) -> int:
        """Steps still holding nodes (their graph is alive)."""
        return len(self.engine.live_steps)

    @property
    def hooks_installed(self) -> bool:
        return bool(self._hooks) or self.engine.hooks_installed

    # ---- step boundaries --------------------------------------------------------------------------
    def _pre_hook(self, module, args, kwargs):
        self._depth += 1
        if not starts_a_step(self._depth, "dynamic mode runs"):
            return
        signature = CallSignature(inputs=call_inputs(args, kwargs), trainable_parameters=self._trainable())
        self.engine.start_step(signature_key(signature))

    def _post_hook(self, module, args, output):
        self._depth = max(0, self._depth - 1)
        if self._depth == 0:
            self.engine.model_returned()


def check_policy(policy: str) -> None:
    if policy not in POLICIES:
        raise RegenError(f"regen.apply: policy must be one of {', '.join(POLICIES)}, got {policy!r}")


def cap_bytes(memory_cap: int | str) -> int:
    """The cap in bytes: a positive int, or text such as '6GiB' (regen.units.parse_memory_cap)."""
    if isinstance(memory_cap, bool) or not isinstance(memory_cap, (int, str)):
        raise RegenError(f"regen.apply: memory_cap must be bytes (an int) or text such as '6GiB', got {memory_cap!r}")
    if isinstance(memory_cap, int):
        if memory_cap <= 0:
            raise RegenError(f"regen.apply: memory_cap must be positive, got {memory_cap}")
        return memory_cap
    return parse_memory_cap(memory_cap, 0, flag="memory_cap",
                            percent_of="the unplanned peak (dynamic mode has no profile)")


def link_bytes_per_s(link_gb_s, emulate_link: bool, device) -> tuple[float, float] | None:
    """Dynamic mode's (d2h, h2d) link in bytes/s from `link_gb_s` (GB/s, one figure or a (d2h, h2d) pair):
    required with `emulate_link=True` (a CPU device), optional on CUDA (regen.apply measures it), refused
    on a CPU device without emulation (its "host" is the same RAM: a swap would free nothing)."""
    if link_gb_s is None:
        if emulate_link:
            raise RegenError("regen.apply: dynamic mode with emulate_link=True needs the emulated link's "
                             "bandwidth: link_gb_s=... (GB/s, e.g. 12 for PCIe 4 x16 as a GPU sees it)")
        return None
    pair = tuple(link_gb_s) if isinstance(link_gb_s, (tuple, list)) else (link_gb_s, link_gb_s)
    if len(pair) != 2 or not all(isinstance(v, (int, float)) and not isinstance(v, bool) and v > 0 for v in pair):
        raise RegenError(f"regen.apply: link_gb_s must be a positive number of GB/s (or a (d2h, h2d) pair), "
                         f"got {link_gb_s!r}")
    if not emulate_link and (device is None or device.type != "cuda"):
        raise RegenError("regen.apply: link_gb_s on a CPU device needs emulate_link=True (a CPU has no host link: "
                         "its swaps would copy into the same RAM and free nothing)")
    return pair[0] * 1e9, pair[1] * 1e9
