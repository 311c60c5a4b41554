"""Parking: saved tensors leave the device while a profiled step runs, so a step that does not fit runs.

`regen profile --park` (`profile_workload(..., park=True)`) runs its steps with saved-tensor hooks that
copy each saved activation's whole storage to host memory when autograd packs it and back when backward
unpacks it, synchronously; the device then holds the memory at start plus what the ops in flight need.
Copies run with the dispatch modes disabled, so the capture and timing modes never see them (op times are
measured around the ops, not the copies), and `ParkStore.copy_time_s` sums them so step times can leave
them out.

A storage is parked once however many saved entries view it (`_Parked`), and each entry's handle rebuilds
its own view over the restored bytes. It is brought back at its first unpack (or, if its original storage
is still alive then, that storage is used) and held until autograd drops the last handle viewing it,
which is when the unplanned step would free it. So the bookkeeping can reproduce the unplanned timeline:
`missing_bytes()` is the bytes of storages that the unplanned step would hold now and the parked one does
not (original freed, not yet brought back, still referenced by autograd).

On a CPU device host memory is the same RAM: parked bytes are then held in Python buffers outside torch's
allocator, so the allocator's timeline shows what a device would hold.
"""

from __future__ import annotations

import time
import weakref

import torch
from torch.multiprocessing.reductions import StorageWeakRef

from regen.opinfo import storage_key

_regen_ops = torch._C._DisableTorchDispatch  # copies are regen's own: no dispatch mode sees them


def _bytes_view(storage: torch.UntypedStorage, device: torch.device) -> torch.Tensor:
    """A uint8 tensor over a whole storage."""
    return torch.empty(0, dtype=torch.uint8, device=device).set_(storage, 0, (storage.nbytes(),), (1,))


class _Parked:
    """One storage parked in host memory, shared by every saved entry that views it."""

    __slots__ = ("store", "nbytes", "host", "source", "storage_ref", "version", "handles", "resident",
                 "__weakref__")

    def __init__(self, store: "ParkStore", x: torch.Tensor):
        self.store = store
        storage = x.untyped_storage()
        self.nbytes = storage.nbytes()
        self.source = weakref.ref(x)  # to use the original storage at unpack while it is still alive
        self.storage_ref = StorageWeakRef(storage)
        self.handles = 0
        self.resident: torch.Tensor | None = None  # uint8 view of the storage once back on the device
        self.host = store.host_buffer(self.nbytes)
        self.copy_out(x)

    def copy_out(self, x: torch.Tensor) -> None:
        self.version = x._version
        self.host.copy_(_bytes_view(x.untyped_storage(), x.device))


class ParkHandle:
    """What autograd holds for one parked saved entry: its storage's record and its own view geometry."""

    __slots__ = ("parked", "size", "stride", "storage_offset", "dtype", "tag")

    def __init__(self, parked: _Parked, x: torch.Tensor, tag):
        self.parked = parked
        self.size, self.stride, self.storage_offset, self.dtype = x.shape, x.stride(), x.storage_offset(), x.dtype
        self.tag = tag  # the caller's (the recorder's StorageInfo)
        parked.handles += 1

    def __del__(self):
        parked = self.parked
        parked.handles -= 1
        if parked.handles == 0:  # autograd dropped the last entry: the unplanned step frees the storage now
            parked.resident = None
            parked.host = None
            parked.store.waiting.pop(parked, None)


class ParkStore:
    """Parks saved storages of one step in host memory and brings them back (see the module docstring)."""

    def __init__(self, device: torch.device):
        self.device = device
        self._by_key: dict[int, _Parked] = {}  # storage key -> the record of the storage living there
        self.waiting: dict[_Parked, None] = {}  # parked, not back on the device, still referenced by autograd
        self.copy_time_s = 0.0
        self.parked_bytes = 0  # bytes copied out (each storage once per step)

    def host_buffer(self, nbytes: int) -> torch.Tensor:
        if self.device.type == "cuda":
            return torch.empty(nbytes, dtype=torch.uint8)
        return torch.frombuffer(bytearray(nbytes), dtype=torch.uint8) if nbytes else torch.empty(0, dtype=torch.uint8)

    def park(self, x: torch.Tensor, tag=None) -> ParkHandle:
        """Copy `x`'s storage to host memory (once per storage, again if it was written since)."""
        t0 = time.perf_counter()
        with _regen_ops(), torch.no_grad():
            key = storage_key(x)
            parked = self._by_key.get(key)
            if parked is None or parked.handles == 0 or parked.storage_ref.expired():
                parked = _Parked(self, x)
                self._by_key[key] = parked
                self.waiting[parked] = None
                self.parked_bytes += parked.nbytes
            elif parked.version != x._version:
                parked.copy_out(x)
            handle = ParkHandle(parked, x, tag)
        self.copy_time_s += time.perf_counter() - t0
        return handle

    def unpack(self, handle: ParkHandle) -> tuple[torch.Tensor, bool]:
        """The saved entry's tensor, and whether its storage was copied back into a new one just now."""
        parked = handle.parked
        restored = False
        if parked.resident is None:
            t0 = time.perf_counter()
            with _regen_ops(), torch.no_grad():
                source = parked.source()
                if source is not None and not parked.storage_ref.expired():
                    parked.resident = _bytes_view(source.untyped_storage(), source.device)
                else:
                    parked.resident = torch.empty(parked.nbytes, dtype=torch.uint8, device=self.device)
                    parked.resident.copy_(parked.host)
                    restored = True
            self.waiting.pop(parked, None)
            self.copy_time_s += time.perf_counter() - t0
        with _regen_ops():
            view = torch.empty(0, dtype=handle.dtype, device=self.device).set_(
                parked.resident.untyped_storage(), handle.storage_offset, handle.size, handle.stride)
        return view, restored

    def missing_bytes(self) -> int:
        """Bytes the unplanned step would hold now that this one holds in host memory only."""
        return sum(p.nbytes for p in self.waiting if p.storage_ref.expired())


class ParkingHooks:
    """Saved-tensor hooks that park every saved tensor except those of `kept` storages (parameters, batch...)."""

    def __init__(self, store: ParkStore, kept: list[torch.Tensor]):
        self.store = store
        self.kept_keys = {storage_key(t) for t in kept}

    def pack(self, x: torch.Tensor):
        if (torch._C._current_graph_task_id() != -1 or x.device.type != self.store.device.type
                or storage_key(x) in self.kept_keys or x.untyped_storage().nbytes() == 0):
            return x  # saved during backward, on another device, or not an activation: held as autograd would
        return self.store.park(x)

    def unpack(self, packed):
        return self.store.unpack(packed)[0] if isinstance(packed, ParkHandle) else packed

    def hooks(self):
        return torch.autograd.graph.saved_tensors_hooks(self.pack, self.unpack)
