"""The memory in use that dynamic mode checks its cap against.

* CUDA: `torch.cuda.memory_allocated(device)`, everything PyTorch allocated on the device (the cap counts
  what a plan's cap counts: docs/concepts.md "What the cap counts").
* CPU, which has no allocator statistics: the memory at the step's start, counted as the bytes of the
  model's parameters, their gradients and its buffers (the batch and optimizer state are not seen), plus
  the bytes of every storage that an op of a step created (forward, backward and rebuilds; each storage
  once) while it is alive. Temporaries inside a single op are not seen. The figure is a running total: a
  storage's Python object lives exactly as long as the storage (PyTorch preserves it), so a finalizer on
  it takes its bytes off when it dies, and reading the figure costs the same whatever the step holds.
"""

from __future__ import annotations

import threading
import weakref

import torch
from torch import nn

from regen.opinfo import storage_key

_storage_use_count = torch._C._storage_Use_Count


def only_held_by_us(t: torch.Tensor) -> bool:
    """Nothing but `t` holds its storage (the temporary storage object counts one)."""
    return _storage_use_count(t.untyped_storage()._cdata) <= 2


def model_storages(model: nn.Module) -> dict[int, int]:
    """storage key -> bytes of the model's parameters, their gradients and its buffers."""
    storages: dict[int, int] = {}
    tensors = [p for p in model.parameters()] + [p.grad for p in model.parameters() if p.grad is not None]
    tensors += list(model.buffers())
    for t in tensors:
        storages[storage_key(t)] = t.untyped_storage().nbytes()
    return storages


class TrackedMemory:
    """CPU: the bytes of live storages that the steps' ops created, plus a start figure."""

    def __init__(self):
        self.start_bytes = 0
        self._tracked_bytes = 0
        self._lock = threading.RLock()  # a storage can die on another thread, or in a collection inside track
        # storage key -> (its finalizer, bytes, the token the finalizer was given)
        self._live: dict[int, tuple[weakref.finalize, int, object]] = {}

    def begin_step(self, model: nn.Module) -> None:
        """A step starts: its start figure is the model's memory (storages tracked already, such as
        gradients made by an earlier backward, are counted there once)."""
        storages = model_storages(model)
        with self._lock:
            for key in storages:
                entry = self._live.pop(key, None)
                if entry is not None:
                    entry[0].detach()
                    self._tracked_bytes -= entry[1]
        self.start_bytes = sum(storages.values())

    def track(self, t: torch.Tensor) -> None:
        """Count `t`'s storage while it lives (once, however many tensors view it)."""
        storage = t.untyped_storage()
        nbytes = storage.nbytes()
        key = storage.data_ptr()
        if nbytes == 0 or key == 0 or key in self._live:
            return
        token = object()
        finalizer = weakref.finalize(storage, self._died, key, token)
        finalizer.atexit = False
        with self._lock:
            self._live[key] = (finalizer, nbytes, token)
            self._tracked_bytes += nbytes

    def _died(self, key: int, token: object) -> None:
        with self._lock:
            entry = self._live.get(key)
            if entry is None or entry[2] is not token:  # a later storage at the same address is tracked now
                return
            del self._live[key]
            self._tracked_bytes -= entry[1]

    def in_use_bytes(self) -> int:
        return self.start_bytes + self._tracked_bytes


class DeviceMemory:
    """CUDA: the allocator's figure."""

    def __init__(self, device: torch.device):
        self.device = device
        self.start_bytes = 0

    def begin_step(self, model: nn.Module) -> None:
        self.start_bytes = torch.cuda.memory_allocated(self.device)

    def track(self, t: torch.Tensor) -> None:
        pass

    def in_use_bytes(self) -> int:
        return torch.cuda.memory_allocated(self.device)
