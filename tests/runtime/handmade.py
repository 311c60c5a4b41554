"""Hand-made plans for runtime tests, built without the profiler and the planner.

`trace_workload` follows the rules of docs/internals.md like a minimal profiler: a dispatch mode numbers
the forward ops (model call through the loss), a per-step writer map names each saved tensor by the op
and output slot that last wrote its storage (`opinfo.written_outputs`), entries sharing a storage form
one candidate, and the backward's unpack sequence gives each entry its unpack order. The plan builders
then write real `regen.formats.Plan` objects: keep-all, swap-all, recompute (recipes walked back through
unsaved intermediates to parameters, the batch, or recipe inputs) and hybrid mixes.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from regen.caches import training_caches_off
from regen.formats import Decision, Plan, PlanFigures, RecipeOp, SolverReport
from regen.formats.profile import OpFingerprint
from regen.opinfo import is_counted, is_inplace, is_random, op_name, op_outputs, storage_key, written_outputs
from regen.workloads import forward_loss

MAX_RECIPE_OPS = 12
HOST_BYTES_PER_S = 1e10


@dataclass
class TracedOp:
    index: int
    name: str
    random: bool
    inplace: bool
    arg_keys: list[tuple[int, int]]  # writer keys of its tensor arguments (produced by this step's ops)
    writes: list[int]  # output slots it wrote


@dataclass
class Candidate:
    id: int
    key: tuple[int, int]
    shape: list[int]
    dtype: str
    bytes: int
    unpack_orders: list[int] = field(default_factory=list)
    last_pack: int = -1  # position of its last forward pack


@dataclass
class Trace:
    ops: list[TracedOp]
    candidates: dict[tuple[int, int], Candidate]
    overwritten: set  # (op, slot) whose storage a later in-place op wrote
    fingerprint: str
    num_forward_ops: int
    loss: float
    pack_steps: list[int] = field(default_factory=list)  # per forward pack: the op that follows it


class _Tracer(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.ops: list[TracedOp] = []
        self.writer: dict[int, tuple[int, int, torch.Tensor]] = {}
        self.fp = OpFingerprint()
        self.overwritten: set = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if not is_counted(func):
            return func(*args, **kwargs)
        flat, _ = tree_flatten((args, kwargs))
        keys = []
        for a in flat:
            if isinstance(a, torch.Tensor):
                w = self.writer.get(storage_key(a))
                if w is not None and (w[0], w[1]) not in keys:
                    keys.append((w[0], w[1]))
        out = func(*args, **kwargs)
        idx = len(self.ops)
        outs = op_outputs(func, args, kwargs, out)
        written = written_outputs(func, args, kwargs, outs)
        inplace = is_inplace(func)
        for slot, key in written:
            prev = self.writer.get(key)
            if prev is not None and inplace:
                self.overwritten.add((prev[0], prev[1]))
            self.writer[key] = (idx, slot, outs[slot].shape, outs[slot].dtype)
        self.fp.add(op_name(func), [(tuple(o.shape), str(o.dtype)) for o in outs if o is not None])
        self.ops.append(TracedOp(idx, op_name(func), is_random(func), inplace, keys, [s for s, _ in written]))
        return out


def trace_workload(workload, seed: int = 0) -> Trace:
    """One forward + backward of `workload` with the contract's numbering; grads are zeroed after."""
    tracer = _Tracer()
    candidates: dict[tuple[int, int], Candidate] = {}
    order = [0]
    pack_steps: list[int] = []

    def pack(x):
        with torch._C._DisableTorchDispatch():  # the tracer's own ops are not the model's
            x = x.detach()
        pack_steps.append(len(tracer.ops))
        w = tracer.writer.get(storage_key(x))
        if w is None:
            return (None, x)
        key = (w[0], w[1])
        cand = candidates.get(key)
        if cand is None:
            cand = candidates[key] = Candidate(id=len(candidates), key=key, shape=list(w[2]), dtype=str(w[3]),
                                               bytes=x.untyped_storage().nbytes())
        cand.last_pack = len(pack_steps) - 1
        return (cand, x)

    def unpack(packed):
        cand, t = packed
        k = order[0]
        order[0] += 1
        if cand is not None:
            cand.unpack_orders.append(k)
        return t

    torch.manual_seed(seed)
    with training_caches_off(workload.model):  # as `regen profile` traces and regen.apply runs a step
        with torch.autograd.graph.saved_tensors_hooks(pack, unpack):
            with tracer:
                loss = forward_loss(workload)
        loss.backward()
    workload.model.zero_grad(set_to_none=True)
    return Trace(ops=tracer.ops, candidates=candidates, overwritten=tracer.overwritten,
                 fingerprint=tracer.fp.hexdigest(), num_forward_ops=len(tracer.ops), loss=float(loss),
                 pack_steps=pack_steps)


# ---- plans -------------------------------------------------------------------------------------------


def _recipe(trace: Trace, key: tuple[int, int], actions: dict) -> tuple[list[int], list[int]] | None:
    """Ops that rebuild candidate `key` from externals and already-decided candidates, or None."""
    recipe: set[int] = set()
    recipe_inputs: set[tuple[int, int]] = set()
    stack = [key[0]]
    while stack:
        r = stack.pop()
        if r in recipe:
            continue
        op = trace.ops[r]
        if op.inplace or any((r, s) in trace.overwritten for s in op.writes):
            return None
        recipe.add(r)
        if len(recipe) > MAX_RECIPE_OPS:
            return None
        for k in op.arg_keys:
            if k in trace.candidates and k != key:
                if k not in actions:
                    return None
                recipe_inputs.add(k)
            else:
                stack.append(k[0])
    return sorted(recipe), sorted(trace.candidates[a].id for a in recipe_inputs)


def build_plan(trace: Trace, choose, strategy: str = "handmade", workload_name: str = "handmade",
               swap_lead: int = 0) -> Plan:
    """A Plan whose action for each candidate (in producer order) is `choose(i, candidate)`:
    'keep', 'swap' or 'recompute' (recompute falls back to swap when no recipe can be built)."""
    decisions: dict[tuple[int, int], Decision] = {}
    actions: dict = {}
    recipe_ops: dict[int, RecipeOp] = {}
    for i, key in enumerate(sorted(trace.candidates)):
        cand = trace.candidates[key]
        action = choose(i, cand)
        d = Decision(saved_tensor=cand.id, producer_op=key[0], output_slot=key[1], shape=list(cand.shape),
                     dtype=cand.dtype, bytes=cand.bytes, action="keep")
        if action == "recompute":
            built = _recipe(trace, key, actions)
            if built is None:
                action = "swap"
            else:
                d.action = "recompute"
                d.recipe, d.recipe_inputs = built
                d.recompute_before_op = trace.num_forward_ops
                for r in d.recipe:
                    recipe_ops[r] = RecipeOp(index=r, name=trace.ops[r].name, is_random=trace.ops[r].random)
        if action == "swap":
            if not cand.unpack_orders:
                action = "keep"
            else:
                d.action = "swap"
                d.swap_out_after_op = key[0]
                d.swap_in_before_op = trace.num_forward_ops
                d.swap_in_at_unpack = max(0, min(cand.unpack_orders) - swap_lead)
                # released at the next forward pack (every other swap) or at the first unpack
                if i % 2 == 0 and cand.last_pack + 1 < len(trace.pack_steps):
                    d.release_at_pack = cand.last_pack + 1
                    d.release_before_op = trace.pack_steps[d.release_at_pack]
                else:
                    d.release_at_unpack = 0
                    d.release_before_op = trace.num_forward_ops
        actions[key] = d.action
        decisions[key] = d
    fig = PlanFigures(peak_bytes=0, step_time_s=0.0)
    swap_bytes = sum(d.bytes for d in decisions.values() if d.action == "swap")
    return Plan(fingerprint=trace.fingerprint, workload={"name": workload_name}, strategy=strategy,
                memory_cap_bytes=0, baseline=fig, predicted=fig, simulated=fig,
                solver=SolverReport("handmade", "heuristic", None, None, None, 0.0),
                d2h_bytes_per_s=HOST_BYTES_PER_S, h2d_bytes_per_s=HOST_BYTES_PER_S, host_pool_bytes=swap_bytes,
                num_forward_ops=trace.num_forward_ops, decisions=list(decisions.values()),
                recipe_ops=[recipe_ops[k] for k in sorted(recipe_ops)])


def keep_all(trace: Trace) -> Plan:
    return build_plan(trace, lambda i, c: "keep", "keep-all")


def swap_all(trace: Trace) -> Plan:
    return build_plan(trace, lambda i, c: "swap", "swap")


def recompute_most(trace: Trace) -> Plan:
    """Recompute every candidate a recipe can rebuild, keeping every fourth as a checkpoint."""
    return build_plan(trace, lambda i, c: "keep" if i % 4 == 0 else "recompute", "recompute")


def hybrid(trace: Trace) -> Plan:
    return build_plan(trace, lambda i, c: ("keep", "swap", "recompute")[i % 3], "hybrid")


PLANS = {"keep-all": keep_all, "swap": swap_all, "recompute": recompute_most, "hybrid": hybrid}
