"""The workload protocol: how regen builds a model and a batch and computes the loss.

A workload is a callable named `module:function` (the module importable from the current directory
or the Python path) or a built-in name (see regen.models). It returns `(model, batch)` or
`(model, batch, loss_fn)`:

* `batch` is a dict of keyword arguments (`model(**batch)`) or a tuple of positional ones
  (`model(*batch)`); a single tensor is treated as a one-element tuple.
* the loss is `loss_fn(output, batch)` when a loss_fn is given, else `output.loss` (Hugging Face
  models given labels), else the output itself when it is a scalar tensor.

`batch_size` is passed to the factory when its signature accepts it (or `**kwargs`). With `autocast`
("bf16" or "fp16") the forward and the loss run under `torch.autocast` on the model's device, as a
mixed-precision training loop runs them; backward runs outside it.
Every way of breaking the protocol raises WorkloadError with a message that says what was expected.
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.util
import inspect
import os
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import torch
from torch import nn

from regen.errors import WorkloadError

Batch = dict[str, Any] | tuple
AUTOCAST_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


@dataclass
class Workload:
    name: str  # the spec it was built from: a built-in name or "module:function"
    model: nn.Module
    batch: Batch
    loss_fn: Callable[[Any, Batch], torch.Tensor] | None
    args: dict[str, Any] = field(default_factory=dict)
    batch_size: int | None = None
    autocast: str | None = None  # a key of AUTOCAST_DTYPES: the forward runs under torch.autocast

    def describe(self) -> dict[str, Any]:
        described = {"name": self.name, "args": dict(self.args), "batch_size": self.batch_size}
        if self.autocast is not None:
            described["autocast"] = self.autocast
        return described


def workload_source(spec: str) -> Path | None:
    """The source file of a `module:function` workload's module (found, not run: only its parent
    packages are imported), so that no output overwrites it; None for a built-in or a module not found
    (resolve_factory then says why)."""
    module_name = spec.partition(":")[0] if ":" in spec else ""
    if not module_name:
        return None
    if os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())
    try:
        found = importlib.util.find_spec(module_name)
    except (ImportError, ValueError):
        return None
    origin = getattr(found, "origin", None)
    return Path(origin) if origin and os.path.isfile(origin) else None


def resolve_factory(spec: str) -> Callable[..., Any]:
    """The factory callable for a built-in name or `module:function`."""
    from regen.models import BUILTIN_WORKLOADS

    if spec in BUILTIN_WORKLOADS:
        return BUILTIN_WORKLOADS[spec]
    if ":" not in spec:
        names = ", ".join(sorted(BUILTIN_WORKLOADS))
        raise WorkloadError(f"unknown workload '{spec}': use a built-in name ({names}) or module:function")
    module_name, _, func_name = spec.partition(":")
    if not module_name or not func_name:
        raise WorkloadError(f"workload '{spec}': expected module:function, e.g. mypkg.train:build")
    cwd = os.getcwd()
    if cwd not in sys.path:
        sys.path.insert(0, cwd)
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        raise WorkloadError(f"workload '{spec}': cannot import module '{module_name}' ({exc})") from None
    except Exception as exc:  # the user's module raised while importing
        raise WorkloadError(f"workload '{spec}': importing '{module_name}' raised "
                            f"{type(exc).__name__}: {exc}") from exc
    factory = getattr(module, func_name, None)
    if factory is None:
        raise WorkloadError(f"workload '{spec}': module '{module_name}' has no attribute '{func_name}'")
    if not callable(factory):
        raise WorkloadError(f"workload '{spec}': '{func_name}' is not callable")
    return factory


def _accepts(factory: Callable[..., Any], name: str) -> bool:
    try:
        params = inspect.signature(factory).parameters
    except (TypeError, ValueError):
        return False
    return name in params or any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())


def build_workload(spec: str, batch_size: int | None = None, args: dict[str, Any] | None = None,
                   device: str | torch.device = "cpu", autocast: str | None = None) -> Workload:
    """Call the factory and check what it returned; model and batch are moved to `device`."""
    if autocast is not None and autocast not in AUTOCAST_DTYPES:
        raise WorkloadError(f"autocast {autocast!r}: use one of {', '.join(AUTOCAST_DTYPES)}")
    factory = resolve_factory(spec)
    kwargs = dict(args or {})
    if batch_size is not None:
        if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
            raise WorkloadError(f"--batch-size {batch_size}: must be a positive whole number")
        if _accepts(factory, "batch_size"):
            kwargs["batch_size"] = batch_size
        else:
            raise WorkloadError(f"workload '{spec}' does not take a batch_size argument; drop --batch-size")
    try:
        result = factory(**kwargs)
    except WorkloadError:
        raise
    except TypeError as exc:
        raise WorkloadError(f"workload '{spec}': calling it with {kwargs} failed: {exc}") from exc
    except Exception as exc:
        raise WorkloadError(f"workload '{spec}' raised {type(exc).__name__}: {exc}") from exc
    if not isinstance(result, tuple) or len(result) not in (2, 3):
        raise WorkloadError(f"workload '{spec}' must return (model, batch) or (model, batch, loss_fn), "
                            f"got {type(result).__name__}")
    model, batch = result[0], result[1]
    loss_fn = result[2] if len(result) == 3 else None
    if not isinstance(model, nn.Module):
        raise WorkloadError(f"workload '{spec}': the model must be a torch.nn.Module, got {type(model).__name__}")
    if isinstance(batch, torch.Tensor):
        batch = (batch,)
    elif isinstance(batch, list):
        batch = tuple(batch)
    if not isinstance(batch, (dict, tuple)):
        raise WorkloadError(f"workload '{spec}': the batch must be a dict of keyword arguments or a tuple "
                            f"of positional ones, got {type(batch).__name__}")
    if loss_fn is not None and not callable(loss_fn):
        raise WorkloadError(f"workload '{spec}': loss_fn must be callable, got {type(loss_fn).__name__}")
    model = model.to(device)
    model.train()
    return Workload(name=spec, model=model, batch=move_batch(batch, device), loss_fn=loss_fn,
                    args=dict(args or {}), batch_size=batch_size, autocast=autocast)


def move_batch(batch: Batch, device: str | torch.device) -> Batch:
    def move(x):
        if not isinstance(x, torch.Tensor):
            return x
        moved = x.to(device)
        if x.requires_grad and moved is not x:  # a leaf on the device, not a copy of one left behind
            moved = moved.detach().requires_grad_()
        return moved

    if isinstance(batch, dict):
        return {k: move(v) for k, v in batch.items()}
    return tuple(move(x) for x in batch)


def call_model(model: nn.Module, batch: Batch):
    return model(**batch) if isinstance(batch, dict) else model(*batch)


def call_arguments(batch: Batch) -> tuple[tuple, dict]:
    """(args, kwargs) of the model call that call_model makes."""
    return ((), dict(batch)) if isinstance(batch, dict) else (tuple(batch), {})


def compute_loss(workload_name: str, output: Any, batch: Batch,
                 loss_fn: Callable[[Any, Batch], torch.Tensor] | None) -> torch.Tensor:
    """The protocol's loss: loss_fn(output, batch), else output.loss, else a scalar output."""
    if loss_fn is not None:
        loss = loss_fn(output, batch)
    elif getattr(output, "loss", None) is not None:
        loss = output.loss
    elif isinstance(output, dict) and output.get("loss") is not None:  # {"loss": ..., "logits": ...}
        loss = output["loss"]
    elif isinstance(output, torch.Tensor) and output.dim() == 0:
        loss = output
    else:
        raise WorkloadError(
            f"workload '{workload_name}': cannot find the loss; return (model, batch, loss_fn), or make "
            f"the model return an object with .loss, a dict with a 'loss' key, or a scalar tensor")
    if not isinstance(loss, torch.Tensor) or loss.dim() != 0:
        raise WorkloadError(f"workload '{workload_name}': the loss must be a scalar tensor")
    if not loss.requires_grad:
        raise WorkloadError(f"workload '{workload_name}': the loss does not require grad "
                            f"(is the model in no_grad, or are all parameters frozen?)")
    return loss


def forward_with_output(workload: Workload) -> tuple[torch.Tensor, Any]:
    """One forward pass: (loss, model output), with the user's exceptions wrapped in a WorkloadError.

    A typical loop (`out = model(x); loss = crit(out, y); loss.backward()`, or `outputs.loss` of a
    Hugging Face model) keeps the model's output alive until backward ends. regen profiles and
    measures steps that way, so a plan's cap also holds for such loops; a loop that drops the output
    earlier only has more room.
    """
    with autocast_context(workload):
        try:
            output = call_model(workload.model, workload.batch)
        except WorkloadError:
            raise
        except Exception as exc:
            raise WorkloadError(f"workload '{workload.name}': the forward raised {type(exc).__name__}: {exc}") from exc
        return compute_loss(workload.name, output, workload.batch, workload.loss_fn), output


def autocast_context(workload: Workload):
    """`torch.autocast` on the model's device at the workload's dtype, or nothing without autocast."""
    if workload.autocast is None:
        return contextlib.nullcontext()
    parameter = next(workload.model.parameters(), None)
    device_type = parameter.device.type if parameter is not None else "cpu"
    return torch.autocast(device_type, dtype=AUTOCAST_DTYPES[workload.autocast])


def forward_loss(workload: Workload) -> torch.Tensor:
    """One forward pass and its loss (the model output is not held; see forward_with_output)."""
    return forward_with_output(workload)[0]


def training_step(workload: Workload, after_forward: Callable[[], None] | None = None) -> torch.Tensor:
    """Forward and backward as regen profiles them: the model output held until backward ends;
    `after_forward()` runs between the two (the profiler's forward timing).

    Returns the detached loss. Exceptions from the user's code become WorkloadErrors."""
    loss, output = forward_with_output(workload)
    if after_forward is not None:
        after_forward()
    try:
        loss.backward()
    except WorkloadError:
        raise
    except Exception as exc:
        if type(exc).__module__.startswith("regen"):
            raise
        raise WorkloadError(f"workload '{workload.name}': the backward raised {type(exc).__name__}: {exc}") from exc
    del output
    return loss.detach()


def load_config(path: str | Path) -> dict[str, Any]:
    """A workload config: {workload: NAME, args: {...}, batch_size: N, autocast: bf16} (configs/*.yaml;
    autocast optional)."""
    import yaml

    path = Path(path)
    if not path.exists():
        raise WorkloadError(f"{path}: no such config file")
    try:
        data = yaml.safe_load(path.read_text())
    except yaml.YAMLError as exc:
        raise WorkloadError(f"{path}: not valid YAML ({' '.join(str(exc).split())})") from None
    if not isinstance(data, dict) or "workload" not in data:
        raise WorkloadError(f"{path}: a config needs a 'workload' key (a built-in name or module:function)")
    args = data.get("args") or {}
    if not isinstance(args, dict):
        raise WorkloadError(f"{path}: 'args' must be a mapping of keyword arguments")
    return {"workload": str(data["workload"]), "args": args, "batch_size": data.get("batch_size"),
            **{k: v for k, v in data.items() if k not in ("workload", "args", "batch_size")}}


@contextlib.contextmanager
def training_state_kept(model: nn.Module):
    """Gradients, module buffers (BatchNorm statistics) and RNG states as they were before the block: steps
    regen runs for itself (a learned profile, a calibration) leave the user's model as they found it."""
    parameters = list(model.parameters())
    grads = [p.grad for p in parameters]
    for p in parameters:
        p.grad = None
    buffers = [(b, b.detach().clone()) for b in model.buffers()]
    cpu_rng = torch.get_rng_state()
    cuda_rng = torch.cuda.get_rng_state_all() if torch.cuda.is_initialized() else None
    try:
        yield
    finally:
        for p, g in zip(parameters, grads):
            p.grad = g
        with torch.no_grad():
            for b, value in buffers:
                b.copy_(value)
        torch.set_rng_state(cpu_rng)
        if cuda_rng is not None:
            torch.cuda.set_rng_state_all(cuda_rng)
