"""The tensor graph of one dynamic step: one `TensorNode` per storage that a forward op wrote.

A node is named like a plan's candidate, `(op, slot)`: the forward op output that last wrote the
storage (docs/internals.md "Naming a saved tensor"). Its recipe (`chain`) is the ops that wrote the
storage, in order: the op that created it, then every in-place write up to this node's op (CPU dropout:
`empty_like`, `bernoulli_`, `div_`), so an in-place op is replayed on the recipe's own intermediate,
never on a resident tensor. Its `inputs` are the nodes the chain's ops read (rebuilt first when they are
not resident: DTR's recursion); `dependents` is the inverse. A node whose storage was then written in
place by a later op is `clobbered`: its value lives on only through its recipe.

A node is never evicted (`evictable` false) when its chain starts with an in-place write to a storage
the step did not create (a buffer, the batch, a cache): that value cannot be rebuilt; nor is a node
that reads such a node (the step sets that as it adds the node).
"""

from __future__ import annotations

import weakref

import torch


class TensorNode:
    """One storage of one step: how to rebuild it, what it reads, and what the runtime holds of it."""

    __slots__ = ("key", "chain", "inputs", "dependents", "nbytes", "shape", "dtype", "cost_s", "ref", "tensor",
                 "live", "clobbered", "evictable", "last_access", "host")

    def __init__(self, key: tuple[int, int], chain: tuple[int, ...], inputs: frozenset, out: torch.Tensor,
                 cost_s: float, evictable: bool, clock: int):
        self.key = key
        self.chain = chain
        self.inputs = inputs  # node keys the chain reads
        self.dependents: list[tuple[int, int]] = []  # nodes whose chain reads this one
        self.nbytes = out.untyped_storage().nbytes()
        self.shape = out.shape
        self.dtype = out.dtype
        self.cost_s = cost_s  # time of the chain's ops in forward (their rebuild cost)
        self.ref = weakref.ref(out)  # the op's own output while the program holds it
        self.tensor: torch.Tensor | None = None  # held by the runtime: saved (packed) or rebuilt
        self.live = 0  # handles autograd holds on it
        self.clobbered = False
        self.evictable = evictable
        self.last_access = clock
        self.host = None  # its bytes on the host (a swaps.py CopyOut) once a copy-out started

    def resident(self) -> torch.Tensor | None:
        """A tensor over the node's storage with its value, if one exists now."""
        if self.clobbered:  # the storage holds a later op's value now
            return None
        if self.tensor is not None:
            return self.tensor
        return self.ref()


def new_node(key: tuple[int, int], out: torch.Tensor, refs: tuple, previous: TensorNode | None, inplace: bool,
             op_time_s: float, clock: int) -> TensorNode:
    """The node of op output `key` (tensor `out`), whose op read the nodes `refs`; `previous` is the node
    that wrote the storage before (an in-place op continues its chain, and clobbers it)."""
    op = key[0]
    if inplace and previous is not None:
        chain = previous.chain + (op,)
        chain_ops = set(chain)
        inputs = frozenset(k for k in previous.inputs.union(refs) if k[0] not in chain_ops)
        node = TensorNode(key, chain, inputs, out, previous.cost_s + op_time_s, previous.evictable, clock)
        previous.clobbered = True
        return node
    inputs = frozenset(k for k in refs if k[0] != op)
    return TensorNode(key, (op,), inputs, out, op_time_s, not inplace, clock)
