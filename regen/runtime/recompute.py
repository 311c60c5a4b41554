"""Recompute: capture the ops of the plan's recipes in forward, replay them in backward.

In forward, every op whose index is in `Plan.recipe_ops` is captured as `(func, args, kwargs)` with
each tensor argument that an op of this step wrote replaced by a `Ref` (the op and output slot that
wrote its storage, plus the argument's own view geometry), so a capture holds no activation alive.
Tensors no op of the step wrote (parameters, buffers, the batch) are held by reference, with their
version counter so an in-place change before the replay is caught; those the op itself writes (its
schema's `(a!)` arguments, e.g. BatchNorm's running statistics) are captured as a copy of their value
before the op (`Scratch`), and the replay writes a fresh copy of that: a recompute never applies a
buffer update twice. Random ops also save the RNG
state they ran with (CPU, and the CUDA device's when they ran there).

In backward, `replay_recipe` runs a decision's recipe in order with grad off, resolving each `Ref`
from the outputs of earlier recipe ops or from the anchors (`recipe_inputs`) the caller provides,
dropping each intermediate right after its last use, and restoring the ambient RNG state after each
random op. An in-place recipe op (CPU dropout's `bernoulli_`, `div_`) mutates and returns the recipe's
own replayed intermediate: the tensor it writes must resolve to an output of an earlier recipe op, never
to an anchor or an external tensor (the planner only emits such recipes; the replay checks it).
Anything that does not resolve, or an output that does not match the plan, raises
`PlanMismatchError`: a recipe is never replayed approximately.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import torch
from torch.utils._pytree import tree_flatten, tree_map

from regen.errors import PlanMismatchError
from regen.opinfo import (op_name, reads_first_arg_metadata_only, storage_key, tensor_outputs, written_arguments,
                           written_outputs)
from regen.runtime.swap import Geometry, view_of


@dataclass(frozen=True)
class Ref:
    """A tensor argument that an op of the step produced: its storage's writer and its own view."""

    op: int
    slot: int
    geometry: Geometry


@dataclass(frozen=True)
class External:
    """A tensor argument no op of the step wrote (parameter, buffer, batch), held by reference."""

    tensor: torch.Tensor
    version: int


@dataclass(frozen=True)
class Like:
    """The first argument of an op that reads only its metadata (empty_like...): rebuilt empty at replay."""

    size: tuple[int, ...]
    stride: tuple[int, ...]
    dtype: torch.dtype
    device: torch.device

    def materialize(self) -> torch.Tensor:
        return torch.empty_strided(self.size, self.stride, dtype=self.dtype, device=self.device)


@dataclass(frozen=True)
class Scratch:
    """A tensor no op of the step wrote that the op writes (its schema's `(a!)` arguments: BatchNorm's
    running statistics, a user's cache), as it was before the op ran. The replay writes a copy of it,
    so a recompute never applies the op's update a second time."""

    before: torch.Tensor

    def materialize(self) -> torch.Tensor:
        return self.before.clone()


@dataclass
class CapturedOp:
    """A recipe op as it ran in forward, with its tensor arguments templated (Ref / External / Like)."""

    index: int
    func: Any  # an OpOverload
    args: tuple
    kwargs: dict
    refs: tuple[tuple[int, int], ...]  # (op, slot) of every Ref, for early freeing
    cpu_rng_state: torch.Tensor | None = None
    cuda_rng_state: tuple[torch.device, torch.Tensor] | None = None


def _op_device(args, kwargs) -> torch.device:
    flat, _ = tree_flatten((args, kwargs))
    for a in flat:
        if isinstance(a, torch.Tensor):
            return a.device
    dev = kwargs.get("device")
    return torch.device(dev) if dev is not None else torch.device("cpu")


def capture_op(index: int, func, args, kwargs, writer: dict, random: bool) -> CapturedOp:
    """Record an op for later replay; call it before the op runs (the RNG state is the one it will use).
    `writer` is the step's writer map (forward_ops.py): storage_key -> Writer (op, slot, shape, dtype)."""
    refs: list[tuple[int, int]] = []

    def template(a):
        if not isinstance(a, torch.Tensor):
            return a
        key = storage_key(a)
        w = writer.get(key) if key else None
        if w is None:
            return External(a, a._version)
        refs.append((w.op, w.slot))
        return Ref(w.op, w.slot, Geometry.of(a))

    captured_args = list(args)
    if captured_args and isinstance(captured_args[0], torch.Tensor) and reads_first_arg_metadata_only(op_name(func)):
        a = captured_args[0]  # only its metadata matters: hold none of its memory
        captured_args[0] = Like(tuple(a.shape), tuple(a.stride()), a.dtype, a.device)
    captured_kwargs = dict(kwargs)
    _snapshot_written_externals(func, captured_args, captured_kwargs, writer)
    cap = CapturedOp(index=index, func=func, args=tree_map(template, tuple(captured_args)),
                     kwargs=tree_map(template, captured_kwargs), refs=tuple(refs))
    if random:
        cap.cpu_rng_state = torch.get_rng_state()
        device = _op_device(args, kwargs)
        if device.type == "cuda":
            cap.cuda_rng_state = (device, torch.cuda.get_rng_state(device))
    return cap


def _snapshot_written_externals(func, args: list, kwargs: dict, writer: dict) -> None:
    """Replace, in place, each tensor the op's schema says it writes and no op of the step produced by a
    Scratch copy of its current value (the op has not run yet)."""
    written = written_arguments(func)
    if not written:  # nearly every op: no schema read on the capture path
        return
    schema_args = func._schema.arguments
    for pos, name in written:
        in_kwargs = schema_args[pos].kwarg_only or pos >= len(args)
        value = kwargs.get(name) if in_kwargs else args[pos]
        if not isinstance(value, torch.Tensor):
            continue
        key = storage_key(value)
        if key and writer.get(key) is not None:  # the step's own tensor: a Ref, replayed as the recipe says
            continue
        snapshot = Scratch(value.detach().clone())
        if in_kwargs:
            kwargs[name] = snapshot
        else:
            args[pos] = snapshot


def _run_with_rng(cap: CapturedOp, args, kwargs):
    if cap.cpu_rng_state is None:
        return cap.func(*args, **kwargs)
    ambient_cpu = torch.get_rng_state()
    ambient_cuda = None
    if cap.cuda_rng_state is not None:
        device, state = cap.cuda_rng_state
        ambient_cuda = torch.cuda.get_rng_state(device)
        torch.cuda.set_rng_state(state, device)
    torch.set_rng_state(cap.cpu_rng_state)
    try:
        return cap.func(*args, **kwargs)
    finally:
        torch.set_rng_state(ambient_cpu)
        if ambient_cuda is not None:
            torch.cuda.set_rng_state(ambient_cuda, cap.cuda_rng_state[0])


def _written_args(cap: CapturedOp) -> list:
    """The arguments the op writes (opinfo.written_arguments), as captured (Ref / External / Scratch / value)."""
    schema_args = cap.func._schema.arguments
    written = []
    for pos, name in written_arguments(cap.func):
        if schema_args[pos].kwarg_only or pos >= len(cap.args):
            value = cap.kwargs.get(name)
        else:
            value = cap.args[pos]
        flat, _ = tree_flatten(value)
        written.extend(flat)
    return written


def replay_recipe(candidate: tuple[int, int], recipe: list[int], captures: dict[int, CapturedOp],
                  anchor: Callable[[tuple[int, int]], torch.Tensor],
                  expect_shape: torch.Size, expect_dtype: torch.dtype,
                  keep: tuple[tuple[int, int], ...] = ()) -> tuple[torch.Tensor, dict[tuple[int, int], torch.Tensor]]:
    """Run `recipe`; return a tensor over the rebuilt storage of `candidate` (op, slot), and those of the
    intermediates named in `keep` (other candidates rebuilt on the way, held for their own use).

    `anchor(key)` returns a tensor over the storage of a resident candidate the recipe may read
    (the decision's recipe_inputs), or raises PlanMismatchError when `key` is not one of them.
    """
    caps = []
    for r in recipe:
        cap = captures.get(r)
        if cap is None:
            raise PlanMismatchError(f"recipe of op {candidate[0]} needs op {r}, which this step's forward "
                                    f"did not run; the plan does not fit this model")
        caps.append(cap)
    last_use: dict[tuple[int, int], int] = {}
    for pos, cap in enumerate(caps):
        for key in cap.refs:
            last_use[key] = pos
    table: dict[tuple[int, int], torch.Tensor] = {}

    def resolve(a):
        if isinstance(a, Ref):
            key = (a.op, a.slot)
            base = table.get(key)
            if base is None:
                base = anchor(key)
            return view_of(base, a.geometry)
        if isinstance(a, External):
            if a.tensor.numel() and not a.tensor.untyped_storage().nbytes():
                raise PlanMismatchError(
                    f"a tensor read by the recipe of op {candidate[0]} has no storage now (shape "
                    f"{tuple(a.tensor.shape)}): a parameter FSDP resharded, which the plan reads before FSDP "
                    f"gathers it again; solve with that recompute refused or reshard_after_forward=False")
            if a.tensor._version != a.version:
                raise PlanMismatchError(
                    f"a tensor read by recipe op of op {candidate[0]} was modified in place after forward "
                    f"(shape {tuple(a.tensor.shape)}); its recompute would be wrong")
            return a.tensor
        if isinstance(a, (Like, Scratch)):
            return a.materialize()
        return a

    with torch.no_grad():
        for pos, cap in enumerate(caps):
            if written_arguments(cap.func):
                for a in _written_args(cap):
                    if isinstance(a, (torch.Tensor, External)) or (
                            isinstance(a, Ref) and (a.op, a.slot) not in table):
                        raise PlanMismatchError(
                            f"recipe op {cap.index} ({op_name(cap.func)}) of op {candidate[0]} writes in place a "
                            f"tensor its recipe did not create; the plan does not fit this model")
            args = tree_map(resolve, cap.args)
            kwargs = tree_map(resolve, cap.kwargs)
            out = _run_with_rng(cap, args, kwargs)
            outs = tensor_outputs(out)
            for slot, _ in written_outputs(cap.func, args, kwargs, outs):
                table[(cap.index, slot)] = outs[slot]
            del args, kwargs, out, outs
            for key in [k for k in table if k != candidate and k not in keep and last_use.get(k, -1) <= pos]:
                del table[key]  # free intermediates right after their last use
    result = table.get(candidate)
    if result is None:
        raise PlanMismatchError(f"the recipe {recipe} did not rebuild op {candidate[0]} output {candidate[1]}; "
                                f"the plan does not fit this model")
    if result.shape != expect_shape or result.dtype != expect_dtype:
        raise PlanMismatchError(
            f"recomputing op {candidate[0]} gave {tuple(result.shape)} {result.dtype}, the plan expects "
            f"{tuple(expect_shape)} {expect_dtype}")
    kept = {}
    for key in keep:
        if key not in table:
            raise PlanMismatchError(f"the recipe {recipe} of op {candidate[0]} did not rebuild op {key[0]} output "
                                    f"{key[1]}, which the plan rebuilds with it; the plan does not fit this model")
        kept[key] = table[key]
    return result, kept


def check_captured_name(index: int, func, expected_name: str) -> str | None:
    """A mismatch message when the op run at a recipe index is not the one the plan names."""
    name = op_name(func)
    if name != expected_name:
        return f"forward op {index} is {name}, the plan's recipe expects {expected_name}"
    return None
