"""A dynamic step's backward without the dispatch mode, run on what the step before's backward did.

NOTE [ A backward without the dispatch mode ]
Every op under a Python dispatch mode makes a round trip into Python: a mode that only calls the op costs the
built-in GPT's step (batch 4, length 256, 55 ms on CPU) 8-11 ms, half of it in backward. Backward's ops pass
dynamic mode's for two things only: their outputs counted as memory in use (CPU: cap_memory.py), and a check
before each op keeping room for what it makes (dynamic_step.py, Note [ Room for the next op ]). A step that
repeats the one before (its forward made what the step before's made, op by op: foresight exact) runs the same
backward ops with the same outputs, so both can be read off a backward that ran under the mode:
1. A step whose backward runs under the mode records (`BackwardRecord`), at each unpack k, the bytes its
   backward ops made that are still alive, and the most they rose above that before the next unpack (each
   op's outputs and, once learned, its temporaries: transients.py; what the step's checks evicted meanwhile
   not taken off); k = -1 is before the first unpack. `figures` turns that into `BackwardFigures` once the
   step is over, when its count held the cap (no check found it past the cap, no thrashing): at a cap below
   what dropping can reach, the checks before each op keep the step as near the cap as they can, and the few
   checks at unpacks of a backward without the mode did not (the zoo's Bloom at half its increase: 1.10x its
   cap under the mode, 1.32x without).
2. A step on CPU with no host link pushes a gate (`BackwardGate`, a torch function mode) when the model's root
   call returns; the program's backward call (`loss.backward()`, `torch.autograd.backward`,
   `torch.autograd.grad`) made outside any backward fires it, before that backward starts (one that creates a
   graph, `create_graph=True`, only disarms it: its ops are the step's to see). It notes the
   forward ops counted so far (the grad seed the call makes comes after), and where figures are known, the
   backward's temporaries learned, the model's memory at the step's start what the recorded step's was, every
   forward op made what the step before's made, and as many ops ran as before the recorded step's backward call,
   it pops the dispatch mode, so the backward's thread state holds no mode.
3. That step's unpack k counts the recorded live bytes as memory in use on top of what the runtime tracks, and
   keeps the recorded rise free; past the recorded unpacks (a second backward through a kept graph) it counts
   the most any unpack recorded and keeps the headroom a step without foresight keeps.
4. It records nothing itself: the figures of the last step of its call whose backward ran under the mode
   stand. Figures, foresight and temporaries are kept per call (call_signature.signature_key: each tensor
   argument's shape, dtype and requires_grad, and how many parameters require grad; the engine's
   CALLS_REMEMBERED most recent): with bucketed lengths a step of a bucket seen twice before runs its backward
   without the mode (its second step records its temporaries: engine.py, Note [ Temporaries per call ]);
   lengths that never repeat keep it.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass, field
from typing import Callable

import torch
from torch.overrides import TorchFunctionMode

BACKWARD_CALLS = (torch.Tensor.backward, torch.autograd.backward, torch.autograd.grad)


@dataclass(frozen=True)
class BackwardFigures:
    """What a backward under the mode did, per unpack (Note [ A backward without the dispatch mode ] 1)."""

    start_bytes: int  # the model's memory at the recorded step's start
    ops_at_backward: int  # its forward ops counted when the program's backward call began
    live_bytes: tuple[int, ...]  # per unpack: bytes the backward's ops made, still alive
    rise_bytes: tuple[int, ...]  # per unpack k, at k + 1 (k = -1 first): the most memory rose until the next


@dataclass
class BackwardRecord:
    """One backward under the mode, as it runs: the bytes its ops made that are alive, at each of its ops and
    unpacks."""

    unpacks: list[int] = field(default_factory=list)  # per unpack: live bytes the backward's ops made
    ops: list[tuple[int, int, int, int]] = field(default_factory=list)  # (unpack before, live, made, op index)

    def op(self, live_bytes: int, made_bytes: int, index: int) -> None:
        self.ops.append((len(self.unpacks) - 1, live_bytes, made_bytes, index))

    def unpack(self, live_bytes: int) -> None:
        self.unpacks.append(live_bytes)


def figures(record: BackwardRecord, temporaries: dict[int, int], start_bytes: int,
            ops_at_backward: int) -> BackwardFigures | None:
    """The figures of a finished backward (None: it unpacked nothing). An interval's rise counts what its ops
    made and not what they freed, nor what autograd let go meanwhile (the saved tensors of a node go after its
    ops ran): never below what it was, whatever the recorded step evicted."""
    if not record.unpacks:
        return None
    levels = [0] + record.unpacks
    rise = [0] * len(levels)
    for k, live, made, index in record.ops:
        rise[k + 1] = max(rise[k + 1], live + made + temporaries.get(index, 0) - levels[k + 1])
    return BackwardFigures(start_bytes, ops_at_backward, tuple(record.unpacks), tuple(rise))


class BackwardGate(TorchFunctionMode):
    """Pushed after a step's last forward op: at the program's backward call, made outside any backward,
    `open_backward()` runs before the backward starts (Note [ A backward without the dispatch mode ] 2).
    It fires once; `disarm()` keeps it from firing (the step closed first)."""

    def __init__(self, open_backward: Callable[[], None]):
        super().__init__()
        self.open_backward: Callable[[], None] | None = open_backward

    def disarm(self) -> None:
        self.open_backward = None

    def __torch_function__(self, func, types, args=(), kwargs=None):
        opener = self.open_backward
        if opener is not None and func in BACKWARD_CALLS and torch._C._current_graph_task_id() == -1:
            self.open_backward = None
            if not _creates_graph(func, args, kwargs or {}):  # a double backward's ops are the step's: the mode stays
                opener()
        return func(*args, **(kwargs or {}))


def _creates_graph(func, args, kwargs) -> bool:
    """The backward call records a graph of its own (`create_graph=True`: a gradient penalty)."""
    try:
        return bool(inspect.signature(func).bind_partial(*args, **kwargs).arguments.get("create_graph"))
    except (TypeError, ValueError):  # not bindable: take it as one that does
        return True
