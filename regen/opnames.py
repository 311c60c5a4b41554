"""Facts about aten ops known from their names alone (`aten.addmm.default`, as opinfo.op_name writes them).

The planner reads these from a profile's op names, so this module imports no torch (`regen solve`
starts without it); the runtime and the profiler ask the same questions of the ops they see.
"""

from __future__ import annotations

# Ops that write arguments their schema does not mark as written: the legacy batch-norm kernels update
# the running statistics in place (their `_native_batch_norm_legit` successor declares it as `(a!)`).
# A recipe replays such an op on copies of those arguments (regen.runtime.recompute.Scratch), so the
# buffers are updated once.
UNDECLARED_WRITES = {
    "aten.native_batch_norm.default": ("running_mean", "running_var"),
    "aten.cudnn_batch_norm.default": ("running_mean", "running_var"),
    "aten.miopen_batch_norm.default": ("running_mean", "running_var"),
}


def writes_an_argument(name: str, is_inplace: bool) -> bool:
    """An op writes one of its arguments: its schema says so (`is_inplace`, as the profile records it from
    opinfo.is_inplace) or the op is listed in UNDECLARED_WRITES."""
    return is_inplace or name in UNDECLARED_WRITES


# Ops that read their first argument only for its metadata (shape, strides, dtype, device), never its
# values: a recipe that replays one needs no copy of that argument (CPU dropout starts with empty_like).
METADATA_ONLY_FIRST_ARG_OPS = frozenset({
    "aten.empty_like.default", "aten.zeros_like.default", "aten.ones_like.default", "aten.full_like.default",
    "aten.rand_like.default", "aten.randn_like.default", "aten.randint_like.default",
})


def reads_first_arg_metadata_only(name: str) -> bool:
    """Whether the op named `name` (see op_name) reads only the metadata of its first argument."""
    return name in METADATA_ONLY_FIRST_ARG_OPS


# Ops that copy their first argument into another dtype, device or layout. A copy of a parameter
# (autocast's low-precision weight copy, made at a layer's first use in the forward) is rebuilt from the
# parameter by this one op, while a swap would move as many bytes as the copy holds: the planner keeps
# or recomputes it, never swaps it.
COPY_OPS = frozenset({"aten._to_copy.default"})


def copies_first_arg(name: str) -> bool:
    """Whether the op named `name` (see op_name) is a copy of its first argument."""
    return name in COPY_OPS


# FSDP2 copies a unit's gathered parameters out of its all-gather buffer into the unsharded parameters
# (out= arguments) before the unit's forward and again before its backward; it frees their storages
# (resized to nothing) after each. What they write is a parameter, the same values at every gather,
# never a result of the step's computation: their writes name no saved tensor (written_outputs), a recipe
# reads a gathered parameter as it is at its replay, and only where FSDP holds it unsharded.
PARAMETER_GATHER_OPS = frozenset({"fsdp.split_with_sizes_copy.default"})
# Namespaces of ops that talk to other ranks or take part in FSDP's gathering: never replayed by one rank
# alone (a recipe or a region that contains one is not recomputable).
DISTRIBUTED_NAMESPACES = frozenset({"c10d", "_c10d_functional", "fsdp"})


def gathers_parameters(name: str) -> bool:
    """Whether the op named `name` (see op_name) writes FSDP's unsharded parameters (PARAMETER_GATHER_OPS)."""
    return name in PARAMETER_GATHER_OPS


def is_distributed(name: str) -> bool:
    """Whether the op named `name` (see op_name) is a collective or part of FSDP's gathering."""
    return name.partition(".")[0] in DISTRIBUTED_NAMESPACES
