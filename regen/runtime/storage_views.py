"""Views over a saved tensor's storage: a byte view of the whole storage (what a swap copies), the
geometry of one saved entry over its storage, and the entry rebuilt over restored or recomputed bytes."""

from __future__ import annotations

from typing import NamedTuple

import torch


def storage_bytes_view(t: torch.Tensor) -> torch.Tensor:
    """A uint8 tensor over the whole storage of `t` (all its views' bytes)."""
    storage = t.untyped_storage()
    return torch.empty(0, dtype=torch.uint8, device=t.device).set_(storage, 0, (storage.nbytes(),), (1,))


def view_of(base: torch.Tensor, geometry: "Geometry") -> torch.Tensor:
    """The tensor with `geometry` over the storage of `base` (dtype may differ from base's): `base` itself when
    it already is that view and has no autograd history (a replay's packed tensor, most entries)."""
    if (base.dtype == geometry.dtype and not base.requires_grad and base.shape == geometry.size
            and base.stride() == geometry.stride and base.storage_offset() == geometry.storage_offset):
        return base
    return torch.empty(0, dtype=geometry.dtype, device=base.device).set_(
        base.untyped_storage(), geometry.storage_offset, geometry.size, geometry.stride)


class Geometry(NamedTuple):
    """How a saved entry views its storage (a named tuple: one is made per swapped or dropped entry)."""

    size: tuple[int, ...]
    stride: tuple[int, ...]
    storage_offset: int
    dtype: torch.dtype

    @staticmethod
    def of(t: torch.Tensor) -> "Geometry":
        return Geometry(tuple(t.shape), t.stride(), t.storage_offset(), t.dtype)
