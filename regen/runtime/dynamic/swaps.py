"""Dynamic mode's swaps: a saved node copied to host memory ahead of need, dropped as a swap, copied back.

A step with a host link (a CUDA device's, or an emulated one on a CPU device: `regen.apply(model,
memory_cap=..., emulate_link=True, link_gb_s=...)`) swaps as well as it drops:

1. **Copy-out ahead.** In forward, once the memory in use passes `AHEAD_FRACTION` of the cap, every
   held node of at least `MIN_SWAP_BYTES` that nothing but the runtime holds (so no op can write it
   while it copies) starts its copy to the host pool, the least recently used first, while the link's
   device-to-host queue is shorter than `MAX_QUEUED_S` of copying. Its device bytes stay until the
   node is evicted.
2. **Evicted as a swap.** A node whose host copy exists costs, to the eviction score (policy.py), the
   time to copy it back (`swap_cost_s`: bytes / host-to-device bandwidth) instead of its recipe's, and
   rebuilds nothing upstream. Evicting it lets its device storage go once the copy-out finished
   (waiting for it when it still runs). A node without a host copy is dropped, as without a link.
3. **Back in reverse pack order.** At each unpack in backward, the swapped-out nodes autograd still
   awaits are copied back ahead of need, the most recently packed first, up to `PREFETCH_DEPTH` in
   flight, each only when it fits under the cap without evicting anything; a node unpacked before its
   copy-in was issued is copied in at once. A node copied back keeps its host copy, so evicting it again
   costs no copy.
4. A node's host range goes back to the pool when autograd lets go of the node, or when the step is
   released.

The host pool is host memory (pinned on CUDA), not the device memory the cap counts; on a CPU device it
is the same RAM, counted apart, as a GPU's pinned memory would be (docs/concepts.md).
"""

from __future__ import annotations

import time

import torch

from regen.opinfo import only_held_by_us
from regen.runtime.swap import CopyIn, HostPool, new_engine
from regen.runtime.tracker import regen_ops

AHEAD_FRACTION = 0.5  # copy-outs start once the memory in use passes this fraction of the cap
MIN_SWAP_BYTES = 64 * 1024  # smaller storages are dropped, never copied (a copy's fixed cost dominates)
MAX_QUEUED_S = 0.05  # no new copy-out while the device-to-host queue holds more than this much copying
PREFETCH_DEPTH = 2  # copy-ins in flight ahead of backward


class DynamicSwaps:
    """The host link of one dynamic engine: copies out ahead, copies in ahead of backward."""

    def __init__(self, device: torch.device, link_bytes_per_s: tuple[float, float], stats, emulated: bool):
        self.d2h_bytes_per_s, self.h2d_bytes_per_s = link_bytes_per_s
        self.pool = HostPool(pin_memory=device.type == "cuda")
        self.engine = new_engine(device, self.pool, link_bytes_per_s if emulated else None, stats)
        self.stats = stats
        self._queued_until_s = 0.0  # when the device-to-host copies issued so far end (estimated)
        self.in_flight: dict = {}  # node -> CopyIn issued ahead of need (nodes of every live step: by identity)

    def swap_cost_s(self, nbytes: int) -> float:
        return nbytes / self.h2d_bytes_per_s

    # ---- forward ------------------------------------------------------------------------------------
    def copy_out_ahead(self, held) -> None:
        """Start copies to the host for `held` nodes (oldest first) that nothing but the runtime holds (so
        no op can write them while they copy), while the link keeps up."""
        now = time.perf_counter()
        if self._queued_until_s - now > MAX_QUEUED_S:
            return
        fresh = [n for n in held if n.host is None and n.nbytes >= MIN_SWAP_BYTES and n.evictable]
        for node in sorted(fresh, key=lambda n: n.last_access):
            if self._queued_until_s - now > MAX_QUEUED_S:
                return
            if node.tensor is None or not only_held_by_us(node.tensor):
                continue
            with regen_ops():
                node.host = self.engine.copy_out(node.tensor)
            self._queued_until_s = max(self._queued_until_s, now) + node.nbytes / self.d2h_bytes_per_s
            self.stats.copy_outs += 1

    def evict(self, node) -> None:
        """Let `node`'s device storage go: its bytes are on the host (waiting for the copy-out if it runs)."""
        with regen_ops():
            self.engine.release_source(node.host)
        self.stats.swap_evictions += 1

    # ---- backward -----------------------------------------------------------------------------------
    def bring_in(self, node) -> torch.Tensor:
        """`node`'s bytes on the device again: its copy-in issued ahead, or one issued now."""
        cin = self.in_flight.pop(node, None)
        if cin is None:
            cin = self._issue(node)
            self.stats.synchronous_copy_ins += 1
        with regen_ops():
            self.engine.wait_copy_in(cin)
        return cin.buffer

    def prefetch_full(self) -> bool:
        """PREFETCH_DEPTH copy-ins are in flight already."""
        return len(self.in_flight) >= PREFETCH_DEPTH

    def prefetch(self, waiting: list, room_bytes: int, track) -> None:
        """Issue copy-ins for `waiting` (swapped-out nodes, next needed first) while each fits in
        `room_bytes` and fewer than PREFETCH_DEPTH are in flight; `track(buffer)` counts a buffer."""
        for node in waiting:
            if self.prefetch_full() or node.nbytes > room_bytes:
                return
            if node in self.in_flight:
                continue
            cin = self.in_flight[node] = self._issue(node)
            track(cin.buffer)
            room_bytes -= node.nbytes

    def _issue(self, node) -> CopyIn:
        with regen_ops():
            cin = self.engine.copy_in(node.host)
        self.stats.copy_ins += 1
        return cin

    # ---- lifetime -----------------------------------------------------------------------------------
    def forget(self, node) -> None:
        """Autograd let go of `node`: its copy-in in flight and its host range go."""
        cin = self.in_flight.pop(node, None)
        if cin is not None:
            with regen_ops():
                self.engine.drop_copy_in(cin)
        out, node.host = node.host, None
        if out is not None:
            with regen_ops():
                if out.source is not None:
                    self.engine.release_source(out)
                self.pool.release(out.slot)
                self.engine.retire(out)

    def close(self) -> None:
        self.engine.close()


def new_swaps(device: torch.device | None, link_bytes_per_s: tuple[float, float] | None, emulated: bool,
              stats) -> DynamicSwaps | None:
    """The host link of a dynamic engine for a model on `device` at (d2h, h2d) `link_bytes_per_s`: CUDA's,
    an emulated one on a CPU device (`emulated`), or None (drop only: no link given, or a CPU device
    without emulation, whose "host" is the same RAM)."""
    if link_bytes_per_s is None:
        return None
    if emulated:
        return DynamicSwaps(torch.device("cpu"), link_bytes_per_s, stats, emulated=True)
    if device is not None and device.type == "cuda":
        return DynamicSwaps(device, link_bytes_per_s, stats, emulated=False)
    return None
