"""What this runtime adds per event on a machine: the probe `regen profile` runs so plans charge it.

A plan's own work is Python, and next to small or fast ops it is a large share of what a recompute
costs. The probe runs the runtime's own code (the dispatch mode, `capture_op`, `replay_recipe`) on tiny
tensors of the profiled device, each timed against the same ops run plainly, and returns
`formats.RuntimeCosts`:

* `dispatch_op_s`: one forward op's round trip through the `ForwardTracker` (paid by every forward op
  until the last tracked one, on steps of a plan with per-tensor recipes);
* `capture_op_s`: what a tracked forward op adds: its name checked, its arguments captured, the
  storages it wrote noted;
* `replay_op_s`: one recipe op replayed in backward, beyond the op itself;
* `recipe_s`: one replayed recipe, besides its ops (its tables and the checks of its result).

Figures are medians over a few repeats of a batch, floored at zero. The probe takes about 0.1 s.
"""

from __future__ import annotations

import statistics
import time
from typing import Callable

import torch

from regen.formats.profile import RuntimeCosts
from regen.opinfo import op_outputs, storage_key, written_outputs
from regen.runtime.recompute import capture_op, check_captured_name, replay_recipe
from regen.runtime.tracker import PHASE_FORWARD, ForwardTracker
from regen.runtime.writers import Writer

PROBE_OPS = 200  # ops per timed batch
PROBE_REPEATS = 5
RECIPE_LENGTH = 4  # ops per recipe in the recipe_s probe
METHOD = "probe of regen.runtime's dispatch mode, capture and replay on tiny tensors (regen.runtime.costs)"
_OP = torch.ops.aten.add.Tensor
_OP_NAME = "aten.add.Tensor"


def measure_runtime_costs(device: torch.device) -> RuntimeCosts:
    """The runtime's per-event costs on `device` (see the module doc)."""
    x = torch.ones(4, device=device)
    sync = (lambda: torch.cuda.synchronize(device)) if device.type == "cuda" else (lambda: None)
    plain_s = _per_unit(lambda: _plain(x, PROBE_OPS), sync, PROBE_OPS)
    dispatch_s = _per_unit(lambda: _tracked(x), sync, PROBE_OPS) - plain_s
    capture_s = _per_unit(lambda: _captured(x), sync, PROBE_OPS) - plain_s
    chains = PROBE_OPS // RECIPE_LENGTH
    long_s = _per_unit(lambda: _replays(x, chains, RECIPE_LENGTH), sync, chains)
    short_s = _per_unit(lambda: _replays(x, PROBE_OPS, 1), sync, PROBE_OPS)
    replay_s = (long_s - short_s) / (RECIPE_LENGTH - 1) - plain_s
    recipe_s = short_s - replay_s - plain_s
    return RuntimeCosts(dispatch_op_s=max(0.0, dispatch_s), capture_op_s=max(0.0, capture_s),
                        replay_op_s=max(0.0, replay_s), recipe_s=max(0.0, recipe_s), method=METHOD)


def _per_unit(batch: Callable[[], None], sync: Callable[[], None], units: int) -> float:
    """Median seconds per unit of `batch`, after one untimed run."""
    batch()
    sync()
    samples = []
    for _ in range(PROBE_REPEATS):
        t0 = time.perf_counter()
        batch()
        sync()
        samples.append((time.perf_counter() - t0) / units)
    return statistics.median(samples)


def _plain(x: torch.Tensor, n: int) -> None:
    with torch.no_grad():
        for _ in range(n):
            _OP(x, x)


class _ProbeStep:
    """The part of a step the tracker talks to: a forward that counts each op and runs it."""

    phase = PHASE_FORWARD

    def __init__(self):
        self.count = 0

    def forward_op(self, func, args, kwargs):
        self.count += 1
        return func(*args, **kwargs)


def _tracked(x: torch.Tensor) -> None:
    tracker = ForwardTracker()
    tracker.step = _ProbeStep()
    with torch.no_grad(), tracker:
        for _ in range(PROBE_OPS):
            _OP(x, x)


def _captured(x: torch.Tensor) -> None:
    """What `ForwardOps._tracked_op` does around a recipe op that is also a producer."""
    writer = {storage_key(x): Writer.of(0, 0, x)}
    with torch.no_grad():
        for idx in range(PROBE_OPS):
            if check_captured_name(idx, _OP, _OP_NAME):
                raise AssertionError("the probe captured another op than it ran")
            capture_op(idx, _OP, (x, x), {}, writer, False)
            out = _OP(x, x)
            outs = op_outputs(_OP, (x, x), {}, out)
            for slot, key in written_outputs(_OP, (x, x), {}, outs):
                writer[key] = Writer.of(idx, slot, outs[slot])


def _replays(x: torch.Tensor, recipes: int, length: int) -> None:
    """Replay `recipes` chains of `length` ops, each op reading the one before it and the anchor."""
    writer = {storage_key(x): Writer.of(-1, 0, x)}
    captures = {}
    with torch.no_grad():
        y = x
        for idx in range(length):
            captures[idx] = capture_op(idx, _OP, (y, x), {}, writer, False)
            y = _OP(y, x)
            writer[storage_key(y)] = Writer.of(idx, 0, y)
    recipe = list(range(length))
    for _ in range(recipes):
        replay_recipe((length - 1, 0), recipe, captures, lambda key: x, x.shape, x.dtype)
