"""The memory in use that dynamic mode checks its cap against.

* CUDA: the allocator's "allocated bytes, current", everything PyTorch allocated on the device (the cap
  counts what a plan's cap counts: docs/concepts.md "What the cap counts"), read as regen/allocator.py
  reads it: a dynamic step reads it at every check, over a thousand times a step.
* CPU, which has no allocator statistics: the memory at the step's start, counted as the bytes of the
  model's parameters, their gradients and its buffers (the batch and optimizer state are not seen), plus
  the bytes of every storage that an op of a step created (forward, backward and rebuilds; each storage
  once, told of its free as it happens: regen.storage_frees) while it is alive. The model's own storages are
  in the start figure and never tracked again: a backward's transposed view of a weight once counted each
  weight twice (six 512-wide layers: 19.02 MiB counted where the allocator measured 14.02, an over-cap
  warning every step). Temporaries inside a single op are not seen. A step that takes over a planned step's forward
  midway also counts what that part holds (`held_bytes`, `track_running_frames`: regen/runtime/apply.py, Note [ A
  step that leaves its plan ]).
"""

from __future__ import annotations

import sys

import torch
from torch import nn
from regen.allocator import allocated_bytes_reader
from regen.opinfo import storage_key
from regen.storage_frees import FreedStorages

def new_storage_bytes(t: torch.Tensor, args) -> int:
    """The bytes of `t`'s storage unless it is the storage of a tensor among `args` (a view, an in-place write)."""
    key = storage_key(t)
    for a in args:
        if isinstance(a, torch.Tensor) and storage_key(a) == key:
            return 0
    return t.untyped_storage().nbytes()


def model_storages(model: nn.Module) -> dict[int, int]:
    """storage key -> bytes of the model's parameters, their gradients and its buffers."""
    storages: dict[int, int] = {}
    tensors = [p for p in model.parameters()] + [p.grad for p in model.parameters() if p.grad is not None]
    tensors += list(model.buffers())
    for t in tensors:
        storages[storage_key(t)] = t.untyped_storage().nbytes()
    return storages


class TrackedMemory:
    """CPU: the bytes of live storages that the steps' ops created, plus a start figure; each storage's free is
    reported as it happens (regen.storage_frees), so every reading is exact and costs the frees since the last."""

    cheap_reads = True  # a reading costs the frees since the last one

    def __init__(self):
        self.start_bytes = 0
        self._tracked_bytes = 0
        self._live = FreedStorages()  # by storage key
        self._start_keys: set = set()  # the model's storages at the step's start (a backward's view of a weight)
        self._made_in_backward: set = set()  # keys of the live storages a backward op made
        self.backward_bytes = 0  # their bytes
        # counted on top of the tracked storages: what a backward run without the dispatch mode made, as the
        # step before's backward recorded it (backward_figures.py)
        self.untracked_bytes = 0
        # a step that took over a planned step's forward midway: what that part's saved tensors hold, less each as
        # backward reads it (release_held)
        self.held_bytes = 0

    def begin_step(self, model: nn.Module, held_bytes: int = 0) -> None:
        """A step starts: its start figure is the model's memory (storages tracked already, such as
        gradients made by an earlier backward, are counted there once; a free of one not taken yet is then
        ignored: regen.storage_frees), plus `held_bytes` (a step taking over a planned step's forward midway:
        what that part holds, until backward reads it: release_held)."""
        storages = model_storages(model)
        self._start_keys = set(storages)
        for key in storages:
            nbytes = self._live.forget(key)
            self._tracked_bytes -= nbytes
            if key in self._made_in_backward:
                self._made_in_backward.discard(key)
                self.backward_bytes -= nbytes
        self.start_bytes = sum(storages.values())
        self.untracked_bytes = 0
        self.held_bytes = held_bytes

    def track(self, t: torch.Tensor, made_in_backward: bool = False) -> None:
        """Count `t`'s storage while it lives (once, however many tensors view it); `made_in_backward`: a
        backward op made it (`backward_bytes`)."""
        storage = t.untyped_storage()
        nbytes = storage.nbytes()
        key = storage.data_ptr()
        if nbytes == 0 or key == 0 or key in self._start_keys:  # the model's own: in the start figure
            return
        if key in self._live:
            self._settle()  # a freed storage at the same address, whose free is not taken yet, leaves first
            if key in self._live:
                return
        self._live.watch_storage(key, storage, nbytes)
        self._tracked_bytes += nbytes
        if made_in_backward:
            self._made_in_backward.add(key)
            self.backward_bytes += nbytes

    def in_use_bytes(self) -> int:
        """The memory in use."""
        self._settle()
        return self.start_bytes + self._tracked_bytes + self.untracked_bytes + self.held_bytes

    def release_held(self, t: torch.Tensor) -> None:
        """Backward read `t`, a tensor the planned part of a step taken over midway saved: autograd lets it go."""
        self.held_bytes = max(0, self.held_bytes - t.numel() * t.element_size())

    def track_tensors(self, values) -> None:
        """Count, while they live, the CPU tensors among `values` and in their lists, tuples and dicts (the model's
        own and those tracked already are passed over)."""
        for value in values:
            items = value.values() if isinstance(value, dict) else value if isinstance(value, (list, tuple)) \
                else (value,)
            for t in items:
                if isinstance(t, torch.Tensor) and t.device.type == "cpu" and not t.is_meta:
                    self.track(t)

    def track_running_frames(self, model: nn.Module) -> None:
        """A step taking over a planned step's forward midway: the tensors the running forward's Python frames hold,
        from the caller up to `model`'s own forward (what the training loop holds, the batch, is not the step's),
        counted while they live: what the planned part made that the rest of the forward will read (the residual
        stream, a mask)."""
        frame = sys._getframe(1)
        while frame is not None:
            self.track_tensors(frame.f_locals.values())
            if frame.f_code.co_name == "forward" and frame.f_locals.get("self") is model:
                return
            frame = frame.f_back

    def _settle(self) -> None:
        for key, nbytes in self._live.pop_freed():
            self._tracked_bytes -= nbytes
            if key in self._made_in_backward:
                self._made_in_backward.discard(key)
                self.backward_bytes -= nbytes


class DeviceMemory:
    """CUDA: the allocator's figure."""

    cheap_reads = False  # a reading costs about 19 us (regen/allocator.py)
    backward_bytes = 0  # the allocator's figure counts everything
    untracked_bytes = 0

    def __init__(self, device: torch.device):
        self.device = device
        self.start_bytes = 0
        self.read = allocated_bytes_reader(device)

    def begin_step(self, model: nn.Module, held_bytes: int = 0) -> None:
        self.start_bytes = self.read()  # everything, what a planned step's part holds included

    def release_held(self, t: torch.Tensor) -> None:
        pass

    def track_tensors(self, values) -> None:
        pass

    def track_running_frames(self, model: nn.Module) -> None:
        pass

    def track(self, t: torch.Tensor, made_in_backward: bool = False) -> None:
        pass

    def in_use_bytes(self) -> int:
        """The allocator's figure."""
        return self.read()
