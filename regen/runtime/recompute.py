"""Recompute: capture the ops of the plan's recipes in forward, replay them in backward.

In forward, every op whose index is in `Plan.recipe_ops` is captured as `(func, args, kwargs)` with
each tensor argument that an op of this step wrote replaced by a `Ref` (the op and output slot that
wrote its storage, plus the argument's own view geometry), so a capture holds no activation alive.
Tensors no op of the step wrote (parameters, buffers, the batch) are held by reference, with their
version counter so an in-place change before the replay is caught; those the op itself writes (its
schema's `(a!)` arguments, e.g. BatchNorm's running statistics) are captured as a copy of their value
before the op (`Scratch`), and the replay writes a fresh copy of that: a recompute never applies a
buffer update twice. A parameter FSDP gathered (forward_ops.py) is held by reference without its
version (`Gathered`): FSDP frees it after the unit's forward and writes the same values into it again
before the unit's backward, so the replay reads it as it is then, and refuses it while it is freed.
Random ops also save the RNG
state they ran with (CPU, and the CUDA device's when they ran there) and the state of every
`torch.Generator` they were given (`torch.randn(..., generator=g)`). Every op records the grad mode it
ran with: some kernels return other outputs without grad (`aten.mkldnn_rnn_layer`, an LSTM layer on
CPU, returns no workspace), so a replay runs each op under its own grad mode.

In backward, `replay_recipe` runs a decision's recipe in order with autocast off (the ops were
recorded below autocast, the casts it chose among them, so a backward inside an autocast block must not
cast them again), resolving each `Ref`
from the outputs of earlier recipe ops or from the recipe inputs (`recipe_inputs`) the caller provides,
dropping each intermediate right after its last use, and restoring the ambient RNG state (and each
private generator's) after each random op. An in-place recipe op (CPU dropout's `bernoulli_`, `div_`)
mutates and returns the recipe's own replayed intermediate: the tensor it writes must resolve to an
output of an earlier recipe op, never to a recipe input or an external tensor (the planner only emits such
recipes; the replay checks it).
Anything that does not resolve, or an output that does not match the plan, raises
`PlanMismatchError`: a recipe is never replayed approximately.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any, Callable

import torch
from torch.utils._pytree import tree_flatten

from regen.errors import PlanMismatchError
from regen.opinfo import (argument_value, op_name, op_outputs, storage_key, tensor_arguments, written_arguments,
                          written_outputs)
from regen.opnames import reads_first_arg_metadata_only
from regen.runtime.storage_views import Geometry, view_of
from regen.runtime.writers import live_writer


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
class Gathered:
    """A parameter FSDP gathered (opnames.gathers_parameters), held by reference: read as it is at the
    replay, which the planner puts where FSDP holds it unsharded."""

    tensor: torch.Tensor


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
    grad_enabled: bool = False  # the grad mode it ran with (the replay runs it under the same)
    cpu_rng_state: torch.Tensor | None = None
    cuda_rng_state: tuple[torch.device, torch.Tensor] | None = None
    # the torch.Generator arguments of a random op (torch.randn(..., generator=g)), with their states
    generator_states: tuple[tuple[torch.Generator, torch.Tensor], ...] = ()


def _op_device(args, kwargs) -> torch.device:
    tensors = tensor_arguments(args, kwargs)
    if tensors:
        return tensors[0].device
    dev = kwargs.get("device")
    return torch.device(dev) if dev is not None else torch.device("cpu")


def _map_arguments(fn: Callable[[Any], Any], value):
    """`fn` applied to every leaf of an op's argument `value` (a tensor, a scalar, a captured template);
    lists and tuples, the only containers in an aten op's arguments (`Tensor[]`, `int[]`), are rebuilt.
    A plain loop: this runs on every argument of every captured and replayed op (tree_map costs more
    than the op)."""
    t = type(value)
    if t is tuple or t is list:
        return t([_map_arguments(fn, v) for v in value])
    return fn(value)


def _map_call(fn: Callable[[Any], Any], args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    """`_map_arguments` over an op's positional and keyword arguments."""
    return (tuple([_map_arguments(fn, a) for a in args]),
            {name: _map_arguments(fn, v) for name, v in kwargs.items()} if kwargs else {})


def capture_op(index: int, func, args, kwargs, writer: dict, random: bool,
               gathered: dict | None = None) -> CapturedOp:
    """Record an op for later replay; call it before the op runs (the RNG state is the one it will use).
    `writer` is the step's writer map (forward_ops.py): storage_key -> Writer (op, slot, shape, dtype);
    `gathered`: storage_key -> weak reference of the parameter storages FSDP gathered in this step."""
    refs: list[tuple[int, int]] = []

    def template(a):
        if not isinstance(a, torch.Tensor):
            return a
        key = storage_key(a)
        w = live_writer(writer, key)
        if w is None:
            g = gathered.get(key) if gathered else None
            if g is not None and not g.expired():
                return Gathered(a)
            return External(a, a._version)
        refs.append((w.op, w.slot))
        return Ref(w.op, w.slot, Geometry.of(a))

    captured_args = list(args)
    if captured_args and isinstance(captured_args[0], torch.Tensor) and reads_first_arg_metadata_only(op_name(func)):
        a = captured_args[0]  # only its metadata matters: hold none of its memory
        captured_args[0] = Like(tuple(a.shape), tuple(a.stride()), a.dtype, a.device)
    captured_kwargs = dict(kwargs)
    _snapshot_written_externals(func, captured_args, captured_kwargs, writer)
    captured_args, captured_kwargs = _map_call(template, captured_args, captured_kwargs)
    cap = CapturedOp(index=index, func=func, args=captured_args, kwargs=captured_kwargs, refs=tuple(refs),
                     grad_enabled=torch.is_grad_enabled())
    if random:
        cap.cpu_rng_state = torch.get_rng_state()
        device = _op_device(args, kwargs)
        if device.type == "cuda":
            cap.cuda_rng_state = (device, torch.cuda.get_rng_state(device))
        cap.generator_states = tuple((g, g.get_state()) for g in _generators(args, kwargs))
    return cap


def _generators(args, kwargs) -> list[torch.Generator]:
    """An op's torch.Generator arguments (an aten schema's `Generator?` is a plain argument, never in a list)."""
    return [a for a in (*args, *kwargs.values()) if isinstance(a, torch.Generator)]


def _snapshot_written_externals(func, args: list, kwargs: dict, writer: dict) -> None:
    """Replace, in place, each tensor the op's schema says it writes and no op of the step produced by a
    Scratch copy of its current value (the op has not run yet)."""
    written = written_arguments(func)
    if not written:  # nearly every op: no schema read on the capture path
        return
    schema_args = func._schema.arguments
    for pos, name in written:
        in_kwargs = schema_args[pos].kwarg_only or pos >= len(args)
        value = argument_value(func, args, kwargs, pos, name)
        if not isinstance(value, torch.Tensor):
            continue
        if live_writer(writer, storage_key(value)) is not None:  # the step's own: a Ref, replayed as the recipe says
            continue
        snapshot = Scratch(value.detach().clone())
        if in_kwargs:
            kwargs[name] = snapshot
        else:
            args[pos] = snapshot


def _run_with_rng(cap: CapturedOp, args, kwargs):
    """Run a captured op; a random one with the RNG states it ran with (the global ones and those of the
    generators it was given), each put back as it was after."""
    if cap.cpu_rng_state is None:
        return cap.func(*args, **kwargs)
    ambient_cpu = torch.get_rng_state()
    ambient_cuda = None
    if cap.cuda_rng_state is not None:
        device, state = cap.cuda_rng_state
        ambient_cuda = torch.cuda.get_rng_state(device)
        torch.cuda.set_rng_state(state, device)
    ambient_generators = [(g, g.get_state()) for g, _ in cap.generator_states]
    torch.set_rng_state(cap.cpu_rng_state)
    for g, state in cap.generator_states:
        g.set_state(state)
    try:
        return cap.func(*args, **kwargs)
    finally:
        torch.set_rng_state(ambient_cpu)
        if ambient_cuda is not None:
            torch.cuda.set_rng_state(ambient_cuda, cap.cuda_rng_state[0])
        for g, state in ambient_generators:
            g.set_state(state)


def _written_args(cap: CapturedOp) -> list:
    """The arguments the op writes (opinfo.written_arguments), as captured (Ref / External / Scratch / value)."""
    written = []
    for pos, name in written_arguments(cap.func):
        flat, _ = tree_flatten(argument_value(cap.func, cap.args, cap.kwargs, pos, name))
        written.extend(flat)
    return written


def replay_recipe(candidate: tuple[int, int], recipe: list[int], captures: dict[int, CapturedOp],
                  recipe_input: Callable[[tuple[int, int]], torch.Tensor],
                  expect_shape: torch.Size, expect_dtype: torch.dtype,
                  keep: tuple[tuple[int, int], ...] = ()) -> tuple[torch.Tensor, dict[tuple[int, int], torch.Tensor]]:
    """Run `recipe`; return a tensor over the rebuilt storage of `candidate` (op, slot), and those of the
    intermediates named in `keep` (other candidates rebuilt on the way, held for their own use).

    `recipe_input(key)` returns a tensor over the storage of a resident candidate the recipe may read
    (the decision's recipe_inputs), or raises PlanMismatchError when `key` is not one of them.
    """
    caps = _recipe_captures(candidate, recipe, captures)
    last_use: dict[tuple[int, int], int] = {}
    for pos, cap in enumerate(caps):
        for key in cap.refs:
            last_use[key] = pos
    table: dict[tuple[int, int], torch.Tensor] = {}  # storages the recipe wrote so far, by (op, slot)
    held = set(keep)
    held.add(candidate)

    def resolve_detached(a):
        return _resolve(a, candidate, table, recipe_input, detach_externals=True)

    def resolve_plain(a):
        return _resolve(a, candidate, table, recipe_input, detach_externals=False)

    with torch.no_grad(), _autocast_off():
        for pos, cap in enumerate(caps):
            _refuse_foreign_writes(cap, candidate, table)
            grad = cap.grad_enabled
            args, kwargs = _map_call(resolve_detached if grad else resolve_plain, cap.args, cap.kwargs)
            with torch.set_grad_enabled(grad):  # no input requires grad: nothing is recorded
                out = _run_with_rng(cap, args, kwargs)
            outs = op_outputs(cap.func, args, kwargs, out)
            for slot, _ in written_outputs(cap.func, args, kwargs, outs):
                table[(cap.index, slot)] = outs[slot]
            del args, kwargs, out, outs
            for key in [k for k in table if k not in held and last_use.get(k, -1) <= pos]:
                del table[key]  # free intermediates right after their last use
    return _rebuilt(candidate, recipe, table, keep, expect_shape, expect_dtype)


def _recipe_captures(candidate: tuple[int, int], recipe: list[int], captures: dict[int, CapturedOp]
                     ) -> list[CapturedOp]:
    caps = []
    for r in recipe:
        cap = captures.get(r)
        if cap is None:
            raise PlanMismatchError(f"recipe of op {candidate[0]} needs op {r}, which this step's forward "
                                    f"did not run; the plan does not fit this model")
        caps.append(cap)
    return caps


def _resolve(a, candidate: tuple[int, int], table: dict, recipe_input: Callable, detach_externals: bool):
    """A captured argument as the replay passes it: a storage the recipe wrote or a recipe input's (Ref), a
    tensor read as it is now (External, Gathered: checked), a fresh buffer (Like, Scratch), or itself."""
    if isinstance(a, Ref):
        key = (a.op, a.slot)
        base = table.get(key)
        if base is None:
            base = recipe_input(key)
        return view_of(base, a.geometry)
    if isinstance(a, (External, Gathered)):
        if a.tensor.numel() and not a.tensor.untyped_storage().nbytes():
            raise PlanMismatchError(
                f"a tensor read by the recipe of op {candidate[0]} has no storage now (shape "
                f"{tuple(a.tensor.shape)}): a parameter FSDP resharded, which the plan reads before FSDP "
                f"gathers it again; solve with that recompute refused or reshard_after_forward=False")
        if isinstance(a, External) and a.tensor._version != a.version:
            raise PlanMismatchError(
                f"a tensor read by recipe op of op {candidate[0]} was modified in place after forward "
                f"(shape {tuple(a.tensor.shape)}); its recompute would be wrong")
        # under grad, a parameter would put the replay in autograd's graph (and its saved tensors)
        return a.tensor.detach() if detach_externals else a.tensor
    if isinstance(a, (Like, Scratch)):
        return a.materialize()
    return a


def _refuse_foreign_writes(cap: CapturedOp, candidate: tuple[int, int], table: dict) -> None:
    """A recipe op may write in place only storages its recipe created."""
    if not written_arguments(cap.func):
        return
    for a in _written_args(cap):
        if isinstance(a, (torch.Tensor, External, Gathered)) or (isinstance(a, Ref) and (a.op, a.slot) not in table):
            raise PlanMismatchError(
                f"recipe op {cap.index} ({op_name(cap.func)}) of op {candidate[0]} writes in place a "
                f"tensor its recipe did not create; the plan does not fit this model")


def _rebuilt(candidate: tuple[int, int], recipe: list[int], table: dict, keep: tuple,
             expect_shape: torch.Size, expect_dtype: torch.dtype) -> tuple[torch.Tensor, dict]:
    """The candidate's rebuilt storage and the kept intermediates', checked against what the plan expects."""
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


_AUTOCAST_DEVICES = ("cpu", "cuda")


def _autocast_off() -> contextlib.ExitStack:
    """Autocast disabled on every device where it is on: recipe ops replay exactly as they were dispatched."""
    stack = contextlib.ExitStack()
    for device in _AUTOCAST_DEVICES:
        if torch.is_autocast_enabled(device):
            stack.enter_context(torch.autocast(device, enabled=False))
    return stack


def check_captured_name(index: int, func, expected_name: str) -> str | None:
    """A mismatch message when the op run at a recipe index is not the one the plan names."""
    name = op_name(func)
    if name != expected_name:
        return f"forward op {index} is {name}, the plan's recipe expects {expected_name}"
    return None
