"""Facts about aten ops that the profiler and the runtime must agree on, read from the ops themselves.

Both stages number forward ops the same way and identify a saved tensor by the op that last wrote
its storage; the rules for "random", "in-place" and "view" live here once so they cannot drift. What is
known from an op's name alone, as the planner reads it from a profile, is in regen.opnames (no torch).
"""

from __future__ import annotations

import functools
from typing import Iterable

import torch

from regen.opnames import UNDECLARED_WRITES, gathers_parameters

_NONDETERMINISTIC_SEEDED = torch.Tag.nondeterministic_seeded


@functools.cache  # OpOverloads are few and hashable; these run on every op
def op_name(func) -> str:
    """`aten.addmm.default` for an OpOverload."""
    return f"{func.namespace}.{func._schema.name.split('::')[-1]}.{func._overloadname}"


# ops that compute nothing and are not numbered: record_function regions (DistributedDataParallel.forward
# opens one, so a model wrapped in DDP would otherwise count one op more than the profiled plain model)
NOT_COUNTED_NAMESPACES = frozenset({"profiler"})


@functools.cache  # OpOverloads are few and hashable; these run on every op
def is_counted(func) -> bool:
    """Whether the op gets an index (docs/internals.md "Op numbering"); profiler::* ops do not."""
    return func.namespace not in NOT_COUNTED_NAMESPACES


@functools.cache  # OpOverloads are few and hashable; these run on every op
def is_random(func) -> bool:
    """The op draws from the RNG (dropout, bernoulli, rand*, normal_...)."""
    return _NONDETERMINISTIC_SEEDED in func.tags


@functools.cache  # OpOverloads are few and hashable; these run on every op
def generator_argument(func) -> tuple[int, str] | None:
    """(position, name) of the op's `Generator?` argument, None for ops without one."""
    for pos, a in enumerate(func._schema.arguments):
        if str(a.type) in ("Optional[Generator]", "Generator"):
            return pos, a.name
    return None


def uses_private_generator(func, args, kwargs) -> bool:
    """The op was given a torch.Generator (`torch.randn(..., generator=g)`): it draws from that generator,
    not from the global RNG state."""
    arg = generator_argument(func)
    return arg is not None and argument_value(func, args, kwargs, *arg) is not None


@functools.cache  # OpOverloads are few and hashable; these run on every op
def is_inplace(func) -> bool:
    """The op writes into one of its arguments (add_, copy_, out= variants)."""
    return any(a.alias_info is not None and a.alias_info.is_write for a in func._schema.arguments)


@functools.cache  # OpOverloads are few and hashable
def written_arguments(func) -> tuple[tuple[int, str], ...]:
    """(position, name) of every argument the op writes: its schema's `(a!)` arguments and the writes
    listed in UNDECLARED_WRITES."""
    undeclared = UNDECLARED_WRITES.get(op_name(func), ())
    return tuple((pos, a.name) for pos, a in enumerate(func._schema.arguments)
                 if (a.alias_info is not None and a.alias_info.is_write) or a.name in undeclared)


def argument_value(func, args, kwargs, pos: int, name: str):
    """The value an op was given for its schema argument at `pos` named `name` (None when absent)."""
    if func._schema.arguments[pos].kwarg_only or pos >= len(args):
        return kwargs.get(name)
    return args[pos]


@functools.cache  # OpOverloads are few and hashable; these run on every op
def unreturned_written_arguments(func) -> tuple[tuple[int, str], ...]:
    """(position, name) of every argument the op's schema marks as written (`Tensor(b!) noise`) that
    none of its returns aliases: `rrelu_with_noise` writes its noise buffer and returns a new tensor,
    `_native_batch_norm_legit` writes the running statistics and returns others."""
    schema = func._schema
    returned = set()
    for r in schema.returns:
        if r.alias_info is not None:
            returned |= set(r.alias_info.before_set)
    return tuple((pos, a.name) for pos, a in enumerate(schema.arguments)
                 if a.alias_info is not None and a.alias_info.is_write
                 and not set(a.alias_info.before_set) & returned)


def op_outputs(func, args, kwargs, out) -> list:
    """An op's outputs in slot order (docs/internals.md "Naming a saved tensor"): the tensors it returns
    (`tensor_outputs`), then every argument its schema writes and does not return
    (`unreturned_written_arguments`, a list argument one slot per element). Non-tensors become None,
    so slots keep their positions."""
    outs = tensor_outputs(out)
    extra = unreturned_written_arguments(func)
    if not extra:  # nearly every op
        return outs
    outs = list(outs)
    for pos, name in extra:
        value = argument_value(func, args, kwargs, pos, name)
        if isinstance(value, (list, tuple)):
            outs.extend(v if isinstance(v, torch.Tensor) else None for v in value)
        else:
            outs.append(value if isinstance(value, torch.Tensor) else None)
    return outs


@functools.cache  # OpOverloads are few and hashable; these run on every op
def is_view(func) -> bool:
    """The op's outputs alias an input without writing it (view, t, transpose, slice...)."""
    return bool(getattr(func, "is_view", False))


def storage_key(t: torch.Tensor) -> int:
    """An identity for a tensor's storage, equal for a tensor and all its views while it lives."""
    return t.untyped_storage().data_ptr()


def storage_key_and_bytes(t: torch.Tensor) -> tuple[int, int] | None:
    """(key, nbytes) of a tensor's storage, or None for tensors without a plain storage (sparse...); a
    DTensor's (FSDP2's sharded parameters) is its local shard's."""
    local = getattr(t, "_local_tensor", None)
    if isinstance(local, torch.Tensor):
        t = local
    try:
        st = t.untyped_storage()
        return st.data_ptr(), st.nbytes()
    except (RuntimeError, NotImplementedError, TypeError):
        return None


def unique_storage_bytes(tensors: Iterable[torch.Tensor | None]) -> int:
    """Bytes of the distinct storages behind `tensors` (tied or viewed tensors counted once)."""
    seen: set[int] = set()
    total = 0
    for t in tensors:
        kb = storage_key_and_bytes(t) if isinstance(t, torch.Tensor) else None
        if kb is not None and kb[0] and kb[0] not in seen:
            seen.add(kb[0])
            total += kb[1]
    return total


_storage_use_count = torch._C._storage_Use_Count


def only_held_by_us(t: torch.Tensor) -> bool:
    """Nothing but `t` holds its storage (no other tensor on it, a view's base included; the temporary storage
    object counts one)."""
    return _storage_use_count(t.untyped_storage()._cdata) <= 2


def tensor_outputs(out) -> list:
    """Flatten an op's return value into its list of outputs (slot order); non-tensors become None."""
    if isinstance(out, torch.Tensor):
        return [out]
    if isinstance(out, (tuple, list)):
        return [o if isinstance(o, torch.Tensor) else None for o in out]
    return []


def tensor_arguments(args, kwargs) -> list[torch.Tensor]:
    """An op's tensor arguments in the order tree_flatten((args, kwargs)) gives (lists of tensors, aten.cat's say,
    included), by a plain loop: this runs at every op, where tree_flatten costs more than many of the ops."""
    out: list[torch.Tensor] = []
    _collect_tensors(args, out)
    _collect_tensors(tuple(kwargs.values()), out)
    return out


def _collect_tensors(values, out: list) -> None:
    for v in values:
        if isinstance(v, torch.Tensor):
            out.append(v)
        elif type(v) is list or type(v) is tuple:
            _collect_tensors(v, out)
        elif type(v) is dict:
            _collect_tensors(tuple(v.values()), out)


def input_storage_keys(args, kwargs) -> set[int]:
    """Storage keys of every tensor among an op's arguments."""
    return {storage_key(a) for a in tensor_arguments(args, kwargs)}


def written_outputs(func, args, kwargs, outputs: list) -> list[tuple[int, int]]:
    """(output slot, storage key) for every output (`op_outputs`) whose storage this op *wrote*.

    The rule the profiler and the runtime share to name a saved tensor by "the last forward op that
    wrote its storage": a view op writes nothing; an in-place or out= op writes the storages of all its
    outputs (the arguments its schema writes among them, returned or not); any other op writes its
    outputs' storages unless an output aliases an input (ops such as `_unsafe_view` return an alias
    without declaring it). Zero-byte storages are skipped. An op that gathers parameters
    (gathers_parameters) writes parameters, not saved tensors: none.
    """
    if is_view(func) or gathers_parameters(op_name(func)):
        return []
    inplace = is_inplace(func)
    in_keys = None if inplace else input_storage_keys(args, kwargs)
    written = []
    for slot, out in enumerate(outputs):
        if out is None:
            continue
        key = storage_key(out)
        if key == 0:
            continue
        if inplace or key not in in_keys:
            written.append((slot, key))
    return written
