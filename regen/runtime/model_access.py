"""The model as the runtime sees it: the module a plan describes (DDP unwrapped), its device, the checks
`regen.apply` makes on it, and the one rule for which root forward call starts a training step (the
planned handle and dynamic mode's handle both follow it)."""

from __future__ import annotations

import torch
from torch import nn

from regen.errors import DATA_PARALLEL_REFUSED, RegenError


def unwrap_model(model: nn.Module) -> nn.Module:
    """The module whose forward the plan describes: DistributedDataParallel wraps it (DataParallel is
    refused)."""
    while isinstance(model, (nn.parallel.DistributedDataParallel, nn.DataParallel)):
        if isinstance(model, nn.DataParallel):
            raise RegenError(f"regen.apply: {DATA_PARALLEL_REFUSED}")
        model = model.module
    return model


def module_device(module: nn.Module) -> torch.device | None:
    """The device of the module's first parameter (or buffer), None for a module without either."""
    for p in module.parameters():
        return p.device
    for b in module.buffers():
        return b.device
    return None


def compiled_module(model: nn.Module) -> nn.Module | None:
    """The eager module behind a torch.compile'd `model` (`torch.compile(m)` or `m.compile()`), None when
    `model` is not compiled."""
    if type(model).__name__ == "OptimizedModule" and isinstance(getattr(model, "_orig_mod", None), nn.Module):
        return model._orig_mod
    if getattr(model, "_compiled_call_impl", None) is not None:
        return model
    return None


def check_model(model: nn.Module, why: str) -> None:
    """`model` is an eager nn.Module; `why`: the reason a torch.compile'd one is refused, and what to apply."""
    if not isinstance(model, nn.Module):
        raise RegenError(f"regen.apply: expected a torch.nn.Module, got {type(model).__name__}")
    if compiled_module(model) is not None:
        raise RegenError(f"regen.apply: this module is torch.compile'd; {why} to the module without "
                         f"torch.compile (model._orig_mod of torch.compile(model)) and train that")


def starts_a_step(depth: int, what_runs: str) -> bool:
    """Whether a call of the root module, `depth` calls deep (1: not nested in another call of it), starts
    a training step: the outermost call, with grad enabled (an eval() forward with grad is a step too: its
    ops decide), not a forward run inside backward (a checkpoint's re-run). A call under torch.compile
    raises: `what_runs` says what runs eager ops one by one ("regen plans", "dynamic mode runs")."""
    if depth > 1 or not torch.is_grad_enabled():
        return False
    if torch.compiler.is_compiling():  # first: torch.compile traces no further than what it can put in a graph
        _refuse_compile(what_runs)
    return torch._C._current_graph_task_id() == -1


@torch.compiler.disable
def _refuse_compile(what_runs: str) -> None:
    """Raised where torch.compile runs it: eagerly, in the compiled call, not inside its trace."""
    raise RegenError(f"regen.apply: the model is being run by torch.compile; {what_runs} eager "
                     f"execution, so train the module under regen.apply without torch.compile")
