"""The writer map's entries (docs/internals.md "Naming a saved tensor"): `storage_key -> Writer`, the
forward op output that last wrote a storage.

A storage key is a data pointer, which the allocator hands to a new storage once the old one is freed.
Each entry holds a weak reference to the storage it names, and `live_writer` answers only while that
storage lives: a tensor at a reused address is never taken for the freed one (a forward that took
another branch after the verified step, whose new tensor landed where a recipe's input used to be).
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch.multiprocessing.reductions import StorageWeakRef


class Writer(NamedTuple):
    """An entry of the writer map: the forward op output that last wrote a storage."""

    op: int
    slot: int
    shape: torch.Size
    dtype: torch.dtype
    storage: StorageWeakRef  # the storage written: the entry holds only while it lives

    @staticmethod
    def of(op: int, slot: int, output: torch.Tensor) -> "Writer":
        return Writer(op, slot, output.shape, output.dtype, StorageWeakRef(output.untyped_storage()))


def live_writer(writer: dict[int, Writer], key: int) -> Writer | None:
    """The writer of the storage at `key`, or None when none is known or the storage it wrote is gone."""
    w = writer.get(key) if key else None
    if w is None or w.storage.expired():
        return None
    return w
