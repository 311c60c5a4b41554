"""Rules about a plan that the planner and the runtime both apply, written once: the host pool's range
size (`host_range_bytes`), the tracking windows of the dispatch mode (`merged_windows`), where a region's
replay stops (`replay_stop_pack`)."""

from __future__ import annotations

import bisect
from typing import Any

# The runtime hands out its host pool in ranges of whole HOST_RANGE_ALIGN_BYTES (DMA-friendly, and a
# multiple of every dtype's size); Plan.host_pool_bytes is sized with the same rounding.
HOST_RANGE_ALIGN_BYTES = 512


def host_range_bytes(nbytes: int) -> int:
    """The host pool bytes a swapped storage of `nbytes` takes: rounded up to HOST_RANGE_ALIGN_BYTES."""
    return (nbytes + HOST_RANGE_ALIGN_BYTES - 1) // HOST_RANGE_ALIGN_BYTES * HOST_RANGE_ALIGN_BYTES


def merged_windows(starts: list[tuple[int, Any]], tracked, closing_ops: list[int] = ()) -> list[tuple[int, int, Any]]:
    """The tracking windows that follow the ops `tracked` (docs/internals.md "Tracking windows"), one rule
    for the planner and the runtime: each op from the latest of `starts` ((op, key), sorted by op, the
    first at op 0) at or before it, through the op, or, given `closing_ops` (sorted), through the first of
    them at or after it: the runtime lets its dispatch mode go in a pack hook, so a window really ends at
    the first forward pack after its last tracked op (the op dispatched before that pack). Windows that
    overlap or touch merge, keeping the key of the start that opens them. [(first op, last op, key)] in op
    order."""
    spans: list[list] = []
    k = 0
    for t in sorted(tracked):
        while k + 1 < len(starts) and starts[k + 1][0] <= t:
            k += 1
        first, key = starts[k]
        c = bisect.bisect_left(closing_ops, t)
        last = closing_ops[c] if c < len(closing_ops) else t
        if spans and first <= spans[-1][1] + 1:  # inside or right after the window before: it grows
            spans[-1][1] = max(spans[-1][1], last)
        else:
            spans.append([first, last, key])
    return [(first, last, key) for first, last, key in spans]


def replay_stop_pack(packs: list) -> int:
    """The position of the pack where a region's replay stops (`RegionDecision.packs`, or the planner's
    list of the same shape: a member per pack, or None): the first pack of its last member, as
    torch.utils.checkpoint's early stop; -1 when it rebuilds nothing."""
    first: dict = {}
    for k, member in enumerate(packs):
        if member is not None:
            first.setdefault(member, k)
    return max(first.values(), default=-1)
