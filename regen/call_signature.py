"""How a step calls the model: the rule the profiler and the runtime share to tell the uses of one model apart.

Besides the ops it runs, what autograd saves in a forward depends on which tensors require grad: a linear
layer saves its weight only when its input requires grad, so a GAN's discriminator saves more in the
generator's step (its input is the generator's output) than in its own step (a detached batch). The
profiler records the `CallSignature` of its step (each tensor argument's name, shape, dtype and
requires_grad, and the number of parameters that require grad); `regen.apply(model, [plan_a, plan_b])`
runs each step under the plan whose signature the call has, and a single plan's mismatch says how the call
differs from the profiled one.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.utils._pytree import tree_flatten

from regen.formats.profile import CallInput, CallSignature


def call_inputs(args: tuple, kwargs: dict) -> list[CallInput]:
    """The tensor arguments of a call, named by position or keyword (keywords sorted: their order in a
    call does not matter)."""
    named = [(str(i), a) for i, a in enumerate(args)] + sorted(kwargs.items())
    inputs = []
    for name, value in named:
        if isinstance(value, torch.Tensor):
            inputs.append(_input(name, value))
            continue
        tensors = [t for t in tree_flatten(value)[0] if isinstance(t, torch.Tensor)]
        inputs.extend(_input(f"{name}.{k}", t) for k, t in enumerate(tensors))
    return inputs


def _input(name: str, t: torch.Tensor) -> CallInput:
    return CallInput(name=name, shape=list(t.shape), dtype=str(t.dtype), requires_grad=bool(t.requires_grad))


def trainable_parameters(model: nn.Module) -> int:
    return sum(1 for p in model.parameters() if p.requires_grad)


# NOTE [ A cached parameter list ]
# On the zoo's bench-size Llama, walking the module tree for its parameters took about 0.12 ms a step and
# reading a cached list's flags a few microseconds: at checkpointing's peak the walk was a visible share of
# what regen's runtime adds to a step.


class TrainableCount:
    """`trainable_parameters(model)` for a call every step: the parameters are listed again only after a module or
    parameter was registered on one of the model's modules (torch's global registration hooks, which a LoRA
    adapter added or a layer replaced sets off); their requires_grad flags are read at each call, which costs a small fraction of
    walking the module tree every step (Note [ A cached parameter list ]). A parameter deleted without a
    registration after it (`del module.weight`) is still counted until one: a plan set may then pick the plan
    of the call as it was, and the step's saved tensors, which differ from it, raise a PlanMismatchError. The
    owner removes `hooks` when it is done."""

    def __init__(self, model: nn.Module):
        self.model = model
        self._parameters: list[nn.Parameter] | None = None
        self._module_ids: set[int] = set()  # the model's modules when the list was made
        stale = self._stale
        self.hooks = [torch.nn.modules.module.register_module_parameter_registration_hook(stale),
                      torch.nn.modules.module.register_module_module_registration_hook(stale)]

    def _stale(self, module: nn.Module, *_args) -> None:
        """A registration on one of the model's modules; one on a module outside it (a container a forward
        builds and drops: `self.layers[:n]` makes a new ModuleList every step) changes nothing counted."""
        if id(module) in self._module_ids:
            self._parameters = None

    def __call__(self) -> int:
        return sum(1 for p in self.parameters() if p.requires_grad)

    def parameters(self) -> list[nn.Parameter]:
        """The model's parameters, listed again only after a registration on one of its modules."""
        if self._parameters is None:
            self._parameters = list(self.model.parameters())
            self._module_ids = {id(m) for m in self.model.modules()}
        return self._parameters


def call_signature(model: nn.Module, args: tuple, kwargs: dict) -> CallSignature:
    return CallSignature(inputs=call_inputs(args, kwargs), trainable_parameters=trainable_parameters(model))


def signature_key(sig: CallSignature) -> tuple:
    """`sig` as a hashable key: steps of one key run the same ops and save the same tensors (what requires grad
    decides what backward makes)."""
    return tuple((x.name, tuple(x.shape), x.dtype, x.requires_grad) for x in sig.inputs), sig.trainable_parameters


def describe(sig: CallSignature) -> str:
    """`x: [4, 32] float32 requiring grad; 12 parameters requiring grad`"""
    parts = [f"{x.name}: {x.shape} {x.dtype.removeprefix('torch.')}{' requiring grad' if x.requires_grad else ''}"
             for x in sig.inputs]
    return "; ".join(parts + [f"{sig.trainable_parameters} parameters requiring grad"])


def grad_difference(profiled: CallSignature, inputs: list[CallInput], trainable: int) -> str | None:
    """How a call's requires_grad flags differ from the profiled call's, or None when they do not."""
    differences = []
    for x in inputs:
        was = next((p for p in profiled.inputs if p.name == x.name), None)
        if was is not None and was.requires_grad != x.requires_grad:
            now, then = ("requires", "did not") if x.requires_grad else ("does not require", "did")
            differences.append(f"input {x.name} {now} grad here, it {then} in the profiled step")
    if trainable != profiled.trainable_parameters:
        differences.append(f"{trainable} parameters require grad here, {profiled.trainable_parameters} did in the "
                           f"profiled step")
    return ", ".join(differences) or None
