"""What a dynamic step holds, eviction under the cap, and rebuilding dropped nodes (DTR's recursion).

`Residency.make_room(need_bytes)` is called at every pack and unpack (and before every rebuild and forward
op): while the memory in use (cap_memory.py) plus `need_bytes`, plus a headroom (room for a temporary as large
as the largest storage an op of the step made so far, such as a CPU convolution's buffers, which
cap_memory.py does not see, and where the next op's own check does not keep room for its outputs, for an
output as large too; in backward, the largest is what it was after the forward op being unpacked:
dynamic_step.py, Notes [ Room for the next op ] and [ Headroom in backward ]),
plus a reserve learned from the steps before (CUDA: how far the allocator measured a step over its cap, the
transients no check saw; engine.py) passes the cap, the held node with the lowest score (policy.py) is
dropped (let go as swapped out when its bytes are on the host: swaps.py). Only nodes whose storage nothing
but the runtime holds are candidates (dropping another frees nothing: the program or autograd still holds
it), and never one pinned by the rebuild in progress. When dropping every candidate would not get the step
under the cap, a check drops less or nothing (Note [ Targets of a check ]), the step goes on over the cap and
its handle warns once.

`materialize(node)` returns a tensor over the node's storage with its value: resident (held, or still
held by the program), copied back from the host (swaps.py), or rebuilt by replaying its recipe
(`recompute.replay_recipe`) whose inputs are materialized first, recursively (room for the node's own
output is made after them). A rebuilt node that autograd still awaits stays held (and may be evicted
again); an intermediate rebuilt only as an input is let go once the last recipe of this rebuild that reads
it ran (`_readers`), so a chain of dropped inputs is rebuilt with about two of its tensors resident at a
time, and a node that several of them read (a residual stream) once, not once per path to it.
"""

from __future__ import annotations

from typing import Callable

import torch

from regen.errors import RegenError
from regen.opinfo import only_held_by_us
from regen.runtime.dynamic.nodes import TensorNode
from regen.runtime.dynamic.policy import lowest
from regen.runtime.dynamic.swaps import AHEAD_FRACTION
from regen.runtime.recompute import replay_recipe

# NOTE [ Targets of a check ]
# A check drops held nodes until the memory in use, plus what the next op needs, plus the headroom (a guess at
# the next op's transients) and the learned reserve (measured), fits under the cap. When even dropping every
# candidate would not get there, it aims lower: the cap with the reserve but without the headroom; and when
# not even that can be reached (what nothing can drop, such as backward's gradients, is over it), it drops
# nothing and the step goes over the cap with a warning. Dropping everything there would keep the step no
# nearer its cap at the next check, and every node dropped is rebuilt at its unpack, whose check drops the
# rest again: a Mixtral at bench size, at half its unplanned increase, rebuilt 13,400 tensors a step that way.

# NOTE [ Room for a rebuild ]
# A rebuild's check knows the bytes of the output its recipe makes, so besides them it keeps room for one
# temporary only (as large as the largest storage so far), not the output and temporary the headroom keeps
# where the next op's output is a guess. With the guess's two storages, a Jamba (its Mamba layers' scan a chain
# of 64 states, each read by the next) rebuilt 90,000 tensors in its first step at checkpointing's peak (216 s
# against 0.04 s unplanned): every rebuild in the chain evicted the states it had just rebuilt; with one, 1,027
# (1.2 s).

# NOTE [ Thrashing ]
# Below the least memory a step can run in, every check may still find victims, yet each victim is needed again
# soon: rebuilding it evicts another that is needed next, and so on (DTR's thrashing). A 4-layer Jamba (its Mamba
# scans chains of 64 states) holds 0.95 of checkpointing's peak with 775 rebuilds, but at 0.9 of it rebuilt
# 132,000 tensors in one step (84 s against 0.04 s unplanned). So a step counts the ops its rebuilds replay, and
# once they pass REPLAYS_PER_FORWARD_OP x the ops its forward ran (four forwards' worth: more recomputation than
# any checkpointing plan does; the tests' small models replay up to 2.9x at their tightest caps and stay under
# them), its checks drop nothing more: the nodes dropped already are rebuilt once more each when needed, and the
# step goes on over its cap, exact, with one OverCapWarning saying why (the Jamba at 0.9: 8,753 rebuilds, 7.1 s).
# Its overshoot teaches the learned reserve nothing (engine.py, Note [ The learned reserve ]).
REPLAYS_PER_FORWARD_OP = 4

# the headroom kept free at a check after which an op may run unchecked (CUDA's backward, dynamic_step.py Note
# [ Room for the next op ]), in multiples of the largest storage an op of the step made: the op's output and a
# temporary as large (a CPU convolution's buffers, which the runtime does not track); elsewhere one (the
# temporary: each op's check keeps room for its outputs)
HEADROOM_PER_OUTPUT = 2


class Residency:
    """The nodes a step holds, and the eviction and rebuild of them under the cap."""

    def __init__(self, nodes: dict, captures: dict, memory, cap_bytes: int, policy: str, stats,
                 over_cap: Callable[[int], None], read_largest_bytes: Callable[[], int],
                 read_forward_ops: Callable[[], int], thrashing: Callable[[int, int], None], swaps=None):
        """`read_largest_bytes()`: the largest storage an op of the step made so far (in backward, up to the
        forward op being unpacked): a rebuild keeps room for one temporary as large (Note [ Room for a rebuild ]).
        `read_forward_ops()`: the ops the step's forward ran so far; `thrashing(replayed_ops, forward_ops)`: the
        step's checks stop dropping (Note [ Thrashing ])."""
        self.nodes = nodes
        self.captures = captures
        self.memory = memory
        self.cap_bytes = cap_bytes
        self.policy = policy
        self.stats = stats
        self.over_cap = over_cap  # (bytes in use): nothing left to evict
        self.read_forward_ops = read_forward_ops
        self.thrashing = thrashing
        self.swaps = swaps  # swaps.py's DynamicSwaps, or None: drop only
        self.held: dict[tuple[int, int], TensorNode] = {}
        self.clock = 0
        # kept free at every check: room for the temporaries of the next op (and where that op runs unchecked, its
        # outputs) in multiples of the largest storage an op of the step made so far (HEADROOM_PER_OUTPUT)
        self.headroom_bytes = 0
        self.read_largest_bytes = read_largest_bytes
        self.reserve_bytes = 0  # learned from the steps before (engine.py, Note [ The learned reserve ])
        self.ran_out = False  # a check found nothing left to drop before the reserve was free
        self.replayed_ops = 0  # ops the step's rebuilds replayed
        self.thrashed = False  # its rebuilds passed the limit: its checks drop nothing (Note [ Thrashing ])

    def hold(self, node: TensorNode, tensor: torch.Tensor) -> None:
        node.tensor = tensor
        self.held[node.key] = node

    def drop(self, node: TensorNode) -> None:
        node.tensor = None
        self.held.pop(node.key, None)
        if node.live == 0 and self.swaps is not None:
            self.swaps.forget(node)  # not needed again: its host copy goes too

    def drop_all(self) -> None:
        for node in list(self.held.values()):
            self.drop(node)
        if self.swaps is not None:
            for node in self.nodes.values():
                self.swaps.forget(node)

    # ---- swaps (swaps.py) ---------------------------------------------------------------------------
    def prefetch(self, unpacked: TensorNode) -> None:
        """Backward: copy back the swapped-out nodes needed next (reverse pack order), within the cap."""
        if self.swaps is None or self.swaps.prefetch_full():
            return
        waiting = [n for n in self.nodes.values() if n.live > 0 and n.host is not None and n.resident() is None]
        waiting.sort(key=lambda n: (n.key < unpacked.key, n.key), reverse=True)
        room = self.cap_bytes - self.memory.in_use_bytes() - self.headroom_bytes - self.reserve_bytes
        self.swaps.prefetch(waiting, room, self.memory.track)

    # ---- eviction ---------------------------------------------------------------------------------
    def make_room(self, need_bytes: int, headroom_bytes: int | None = None, pins=frozenset(),
                  copy_out_ahead: bool = False) -> None:
        """Evict until `need_bytes` more fit under the cap (Note [ Targets of a check ]), with `headroom_bytes`
        kept free if it can be (default: `self.headroom_bytes`); with `copy_out_ahead` (forward ops), first start
        host copies of held nodes once memory is tight (swaps.py)."""
        kept_free = (self.headroom_bytes if headroom_bytes is None else headroom_bytes) + self.reserve_bytes
        used = self.memory.in_use_bytes()
        if used > self.stats.peak_in_use_bytes:
            self.stats.peak_in_use_bytes = used
        if copy_out_ahead and self.swaps is not None and used >= AHEAD_FRACTION * self.cap_bytes:
            self.swaps.copy_out_ahead(self.held.values())
        if used + need_bytes + kept_free <= self.cap_bytes:
            return
        if self.thrashed or self.replayed_ops > REPLAYS_PER_FORWARD_OP * self.read_forward_ops():
            self._stop_dropping(used + need_bytes)
            return
        candidates = self._candidates(pins)  # dropping one changes no other's eligibility, only scores
        floor = used - sum(node.nbytes for node, _ in candidates)  # all dropped
        target = self.cap_bytes - need_bytes - kept_free
        if floor > target:  # the headroom cannot be kept: the cap and the measured reserve alone
            target = self.cap_bytes - need_bytes - self.reserve_bytes
            if floor > target:  # nor can they: dropping anything would only be rebuilt again
                self.ran_out = True  # Note [ The learned reserve ]
                if used + need_bytes > self.cap_bytes:
                    self.over_cap(used + need_bytes)
                return
        while used > target and candidates:  # `used` is exact here (over the figure it was read above)
            victim = lowest(self.policy, candidates, self.nodes, self.clock)
            candidates = [c for c in candidates if c[0] is not victim]
            if victim.host is not None:
                self.swaps.evict(victim)
            self.drop(victim)
            self.stats.evictions += 1
            used -= victim.nbytes

    def _stop_dropping(self, in_use_bytes: int) -> None:
        """A thrashing step's check (Note [ Thrashing ]): nothing dropped, over the cap if it must be."""
        if not self.thrashed:
            self.thrashed = True
            self.ran_out = True  # its overshoot is not the reserve's to learn
            self.thrashing(self.replayed_ops, self.read_forward_ops())
        if in_use_bytes > self.cap_bytes:
            self.over_cap(in_use_bytes)

    def _candidates(self, pins) -> list[tuple[TensorNode, float | None]]:
        """The held nodes a check may drop, each with its swap cost (None: dropped, not swapped)."""
        return [(node, None if node.host is None else self.swaps.swap_cost_s(node.nbytes))
                for node in self.held.values()
                if node.evictable and node.key not in pins and self._frees_when_dropped(node)]

    @staticmethod
    def _frees_when_dropped(node: TensorNode) -> bool:
        """Dropping `node` frees its storage: nothing but the runtime holds it (a copy-out in flight holds it
        too, but it was issued only for a storage nothing else held, and nothing can take it since)."""
        return (node.host is not None and node.host.source is not None) or only_held_by_us(node.tensor)

    # ---- rebuild ----------------------------------------------------------------------------------
    def materialize(self, node: TensorNode) -> torch.Tensor:
        """A tensor over `node`'s storage with its forward value, rebuilt if it was dropped."""
        pins: set = set()
        temps: set[TensorNode] = set()
        try:
            tensor = self._materialize(node, pins, temps, self._readers(node), 0)
            self.make_room(0, pins=pins)
            return tensor
        finally:
            for t in temps:
                if t.live == 0:
                    self.drop(t)

    def _readers(self, node: TensorNode) -> dict[tuple[int, int], int]:
        """node key -> how many recipes of `node`'s rebuild read it. A node read by several stays pinned
        until the last of them ran, so a dropped node that many rebuilt ones read (a residual stream, read by
        a block's norm and by its add) is rebuilt once per rebuild, not once per path to it (exponential in
        the depth of such diamonds)."""
        readers: dict[tuple[int, int], int] = {}
        todo, seen = [node], {node.key}
        while todo:
            n = todo.pop()
            if n.resident() is not None or n.host is not None:  # returned as it is: nothing upstream read
                continue
            for key in n.inputs:
                readers[key] = readers.get(key, 0) + 1
                if key not in seen:
                    seen.add(key)
                    todo.append(self.nodes[key])
        return readers

    def _materialize(self, node: TensorNode, pins: set, temps: set, readers: dict, depth: int) -> torch.Tensor:
        node.last_access = self.clock
        tensor = node.resident()
        if tensor is not None:
            pins.add(node.key)
            return tensor
        if node.host is not None:  # its bytes are on the host: copied back, nothing rebuilt
            pins.add(node.key)
            if node not in self.swaps.in_flight:
                self.make_room(node.nbytes, pins=pins)
            tensor = self.swaps.bring_in(node)
            self.memory.track(tensor)
            self.hold(node, tensor)
            return tensor
        if not node.evictable:
            raise RegenError(f"regen.apply (dynamic): op {node.key[0]}'s output is needed again but is gone, and "
                             f"it cannot be rebuilt (its op wrote in place a tensor the step did not make)")
        pins.add(node.key)
        # the inputs first, then room for this node's output: the inputs' rebuilds would use room made before them
        inputs = {key: self._materialize(self.nodes[key], pins, temps, readers, depth + 1) for key in node.inputs}
        # its output's bytes are known: room for them and for one temporary (Note [ Room for a rebuild ])
        self.make_room(node.nbytes, headroom_bytes=self.read_largest_bytes(), pins=pins)
        result, _ = replay_recipe(node.key, list(node.chain), self.captures, inputs.__getitem__, node.shape,
                                  node.dtype)
        self.memory.track(result)
        self.hold(node, result)
        self.replayed_ops += len(node.chain)
        for key in node.inputs:  # read: an intermediate is let go once the last recipe reading it ran
            readers[key] = left = readers.get(key, 1) - 1
            if left > 0:
                continue
            pins.discard(key)
            m = self.nodes[key]
            if m.live == 0 and m in temps:
                self.drop(m)
        if depth:
            self.stats.input_rebuilds += 1  # rebuilt to rebuild another
        temps.add(node)
        self.stats.rebuilds += 1
        return result
