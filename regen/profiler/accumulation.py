"""Gradient accumulation as the step runs it, not as the recording dispatch mode makes it run.

When a tensor's gradient arrives from several uses, autograd's engine sums the parts in the input buffer
of the node that consumes it. Without a Python dispatch mode it does so in place when it holds the only
reference to a dense part (`old.add_(new)`: no new storage); under any dispatch mode it never does
(`old + new`: a new storage while both parts live). The recorded step runs under the capture mode, so
each such sum would show a rise the step itself never has: a new storage as large as the gradient, in
the op (a Mamba layer's scan sums one gradient per time step: Zamba's per-block checkpointing simulated
16.72 MB where it measures 16.20).
"""

from __future__ import annotations

from contextlib import contextmanager

import torch

from regen.opinfo import only_held_by_us, storage_key

# NOTE [ Sums the engine runs in place ]
# 1. The engine's sums run after a node's apply and its post-hooks, before the next node starts (its
#    pre-hooks). `EngineSums` puts a pre-hook and a post-hook on every node of the loss's graph while the
#    recorded backward runs, and `active` is true in between.
# 2. There, an `aten.add.Tensor` (`old + new`) whose output has the shape and dtype of `old`, dense,
#    non-overlapping and alone on its storage (no view's base beside it; `takeover_candidate`), with grad
#    mode off, would have run in place (`old.add_(new)`; the engine never sums into `new`) if the engine held
#    `old` alone: the recorder checks that at the next op, where a storage nothing else held is already gone,
#    and then records the op with no rise in it (its output took over `old`'s storage). The memory after it
#    is the same either way.
# 3. Everything else the engine sums under the mode as it would without: a part held elsewhere too (a grad
#    a node passes on twice, a hook's) is summed out of place in both, and stays recorded so.

_ADD = torch.ops.aten.add.Tensor


class EngineSums:
    """While `watching(loss)`: `active` is true between one node's end and the next node's start."""

    def __init__(self) -> None:
        self.active = False

    @contextmanager
    def watching(self, loss: torch.Tensor):
        handles = []
        for node in _graph_nodes(loss.grad_fn):
            handles.append(node.register_prehook(self._node_starts))
            handles.append(node.register_hook(self._node_ended))
        try:
            yield self
        finally:
            self.active = False
            for h in handles:
                h.remove()

    def _node_starts(self, grad_outputs):
        self.active = False

    def _node_ended(self, grad_inputs, grad_outputs):
        self.active = True


def _graph_nodes(root) -> list:
    """Every node reachable from `root` along next_functions."""
    if root is None:
        return []
    seen, todo = {root}, [root]
    while todo:
        node = todo.pop()
        for nxt, _ in node.next_functions:
            if nxt is not None and nxt not in seen:
                seen.add(nxt)
                todo.append(nxt)
    return list(seen)


def takeover_candidate(func, args, out) -> torch.Tensor | None:
    """The argument of an engine sum whose storage its output could have taken over (Note [ Sums the engine
    runs in place ] 2): the part already in the buffer, the sum's first argument (the engine computes
    `old + new`, and only ever sums into `old`), when it is dense over all of its storage and the only tensor
    on it and grad mode is off; None for any other op."""
    if func is not _ADD or len(args) < 2 or not isinstance(out, torch.Tensor) or torch.is_grad_enabled():
        return None
    old, new = args[0], args[1]
    if not (isinstance(old, torch.Tensor) and isinstance(new, torch.Tensor)):
        return None
    if storage_key(old) == storage_key(new) or old.shape != out.shape or old.dtype != out.dtype:
        return None
    if not (only_held_by_us(old) and _fills_its_storage(old)):
        return None
    return old


def _fills_its_storage(t: torch.Tensor) -> bool:
    """Dense and non-overlapping over all of its storage."""
    return (t.storage_offset() == 0 and t.untyped_storage().nbytes() == t.numel() * t.element_size()
            and all(stride or size <= 1 for size, stride in zip(t.shape, t.stride())))
