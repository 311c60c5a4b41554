"""Storages watched for their frees: each free reported as it happens, instead of every live storage polled.

The CPU allocator keeps no counter, so the profiler's memory timeline (regen.profiler.memory) counts live
storages itself, and needs to know which were freed before each op. Polling every live storage's weak
reference before every op costs ops x live storages: quadratic in a model's depth (3.2 million checks for a
32-layer Llama's 7,701 ops, a second of its recorded step). torch keeps a storage's Python object alive for
exactly as long as the storage (PyObject preservation), so a weak reference to that object, with a
callback, is told when the storage is freed, whichever thread or engine drops its last reference; the
callback only queues the entry, and `pop_freed` hands the queue over before the next op.
"""

from __future__ import annotations

import weakref
from collections import deque

import torch


class _Watched:
    __slots__ = ("key", "nbytes", "ref")  # ref: the weak reference with the callback, kept alive here

    def __init__(self, key, nbytes: int):
        self.key, self.nbytes, self.ref = key, nbytes, None


class FreedStorages:
    """Live storages by key, each with its bytes; the ones freed since the last `pop_freed`."""

    def __init__(self) -> None:
        self._live: dict[object, _Watched] = {}
        self._freed: deque[_Watched] = deque()  # appended by the callbacks, from any thread

    def watch(self, key, storage_ref, nbytes: int) -> None:
        """Watch the storage behind `storage_ref` (a torch.multiprocessing StorageWeakRef) under `key`, replacing
        whatever was watched under it; a storage already freed is reported freed at once."""
        expired = storage_ref.expired()
        self.watch_storage(key, None if expired else torch.UntypedStorage._new_with_weak_ptr(storage_ref.cdata),
                           nbytes)

    def watch_storage(self, key, storage: torch.UntypedStorage | None, nbytes: int) -> None:
        """Watch `storage` under `key` (None: one already freed, reported freed at once)."""
        entry = _Watched(key, nbytes)
        self._live[key] = entry
        if storage is None:
            self._freed.append(entry)
            return
        entry.ref = weakref.ref(storage, lambda _ref, entry=entry, freed=self._freed: freed.append(entry))

    def forget(self, key) -> int:
        """Stop watching `key`; the bytes it was watched with (0 when it was not)."""
        entry = self._live.pop(key, None)
        return 0 if entry is None else entry.nbytes

    def __contains__(self, key) -> bool:
        return key in self._live

    def keys(self) -> list:
        """The keys watched now (their storages' frees not yet taken by `pop_freed` included)."""
        return list(self._live)

    def nbytes(self, key) -> int:
        return self._live[key].nbytes

    def resize(self, key, nbytes: int) -> None:
        self._live[key].nbytes = nbytes

    def pop_freed(self) -> list[tuple[object, int]]:
        """(key, bytes) of the watched storages freed since the last call, no longer watched."""
        out = []
        while self._freed:
            entry = self._freed.popleft()
            if self._live.get(entry.key) is entry:  # not replaced by a later watch under the same key
                del self._live[entry.key]
                out.append((entry.key, entry.nbytes))
        return out
