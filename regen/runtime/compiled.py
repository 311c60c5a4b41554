"""A plan on a torch.compile'd model: the plan's decisions become policies (save, recompute, offload) on the
compiled graph.

`regen.apply(torch.compile(model), plan)` (or a model compiled in place with `model.compile()`) runs no
hook per op: the compiler carries the plan out in the code it generates.

Note [ Plans under torch.compile ]
1. What places a decision. A compiled training step is one joint forward-and-backward graph per compiled
   piece of the model (one per graph break); the partitioner splits it into forward and backward and
   decides which forward values backward reads saved and which it computes again, honouring a node's
   `recompute` tag (torch.utils.checkpoint's CheckpointPolicy) over its own heuristics. regen adds a pass
   over each joint graph (Inductor's `joint_custom_pre_pass`) that tags the nodes of each decision's
   producer op: MUST_SAVE on the outputs a keep decision names, MUST_RECOMPUTE on every node of an op
   whose output the plan recomputes, PREFER_RECOMPUTE on the model's other ops, random ones included
   (eager autograd keeps nothing else, and a compiled graph would otherwise save copies and views past
   the cap; a recomputed random op replays its RNG state). The pass
   is Inductor's only while the model's own call runs (and compiles): other models compiled meanwhile
   never see it.
2. Finding the producer. A joint graph numbers its ops its own way, so a decision names its producer by
   (innermost module, op family, rank among that module's forward ops of the family) (formats.plan); the
   joint graph's forward nodes carry the module they ran in (`nn_module_stack`), the op they were
   decomposed from (`original_aten`) and which call of it they belong to (`seq_nr`). A decision whose op
   is found with another output shape or dtype is not placed.
3. Swaps. On CUDA a swap decision's tensor is saved (MUST_SAVE) and marked for the compiler's offloading pass
   (torch._functorch's activation offloading, `should_offload`), which copies it to host memory on a stream of
   its own and back ahead of its use in backward; a view or a non-contiguous tensor it would pass over is
   recomputed instead (said after the first compiled forward). Off CUDA, swaps are recomputed (said when the
   handle is made). The plan's choice of tensors is what is offloaded; the copies' timing is the pass's.
4. Nothing unplaced is silent. Decisions on ops outside the model (a loss the loop computes) cannot be
   placed: said when the handle is made. A training step that compiled no graph (torch.compile ran it
   eagerly, past its recompile limit) is said once. After the first compiled forward, the recompute
   decisions no joint graph held (ops the compiler traced differently, the step's shapes not the plan's)
   are left to the partitioner; a `CompiledPlanWarning` gives their count and bytes. `handle.placement`
   holds the figures.
5. On CUDA the allocator's peak over every tenth step (forward to the end of its backward, read as
   regen.runtime.peak_check reads a planned step's) is compared with the cap: one CapExceededWarning past
   cap + 5%. A CPU's allocator keeps no counter: there nothing checks a compiled step's peak.
6. Recompiling. Code torch.compile made before `regen.apply` has no tags, so making and removing the
   handle reset torch.compile's caches (`torch.compiler.reset()`, every compiled function of the
   process): the next step compiles again, with the pass or without it. torch.compile shares compiled code
   among instances of a module class, so the handle gives the model a forward of its own, which the
   compiled code is guarded on (a string: an integer that changed between compiles would become a dynamic
   input): another instance never runs this plan's code, nor this model another's. torch.compile keeps
   compiled code per code object, and a frame it starts after a graph break (a Hugging Face model's loss logs)
   is a function's own frame, so the forward is a copy of the root module's with code objects of its own (and
   of the functions its closure holds: a decorator's wrapper and what it wraps). A break inside a submodule's
   forward starts a frame of the submodule class's code, shared again: a second instance of the class can then
   run the first one's code there, its pass places less, and that is said (4).
7. Kernels run when the plan says. Inductor fuses kernels that only read the same buffers (horizontal
   fusion): one of them can be a recomputation whose result is then made long before backward reads it and
   held meanwhile (the built-in GPT's compiled step measured 8% over its plan's cap that way, and within it
   without such fusions, at the same step time on CPU). While the model's call runs, Inductor fuses only a
   producer with its consumers, and compiles the backward then too (not lazily at the first backward, when
   the settings are the user's again); other compiled code keeps the user's settings.
8. Compiled under a handle. A model given to `regen.apply` eager and compiled afterwards (`model.compile()`
   or `torch.compile(model)` inside the `with`) runs its plan the same way. torch.compile traces the eager
   handle's hooks: the root's call out of the compiled code (torch.compiler.disable, a graph break at the start
   and the end of the model's call) to begin and end each call as CompiledCalls does, and the other hooks
   see no step and trace to nothing. The root keeps its class's forward (6's own forward would cost a second
   compile), so code compiled for another instance of the class would serve this one, and this plan's code
   another instance compiled while the handle is applied, past a graph break in the root's forward (a
   Trainer's compiled GPT-2 ran its first Trainer's code, and placed nothing): making the eager handle
   resets torch.compile's caches too (every compiled function of the process; nothing when none is). What
   only the eager runtime does (a plan set, learn=True, emulate_link, on_mismatch) is refused at the first
   compiled call. Past torch.compile's recompile limit, a
   forward it runs eagerly is said as 4 says (a root call it runs eagerly is planned by the eager runtime).
   Removing the handle resets torch.compile's caches, as 6 says.
"""

from __future__ import annotations

import itertools
import operator
import os
import re
import types
import warnings
from dataclasses import dataclass, field

import torch
from torch import nn
from torch._inductor.custom_graph_pass import CustomGraphPass
from torch.utils._pytree import tree_flatten
from torch.utils.checkpoint import CheckpointPolicy

from regen.caches import announced_caches_off
from regen.errors import RegenError
from regen.formats.plan import ACTION_KEEP, ACTION_SWAP, Decision, Plan, op_family
from regen.runtime.model_access import compiled_module, module_device
from regen.runtime.peak_check import PeakCheck, cuda_peak_reader
from regen.units import format_bytes


def reset_compiled_code() -> None:
    """torch.compiler.reset() (every compiled function of the process: Note [ Plans under torch.compile ] 6, 8),
    when torch.compile has compiled a frame since the last reset: with nothing compiled there is nothing to
    forget, and a reset then still set a spawned DDP worker aborting at its exit ("terminate called without an
    active exception": 2 of 24 runs of tests/runtime/test_robustness.py's gloo pair, none of 24 without it)."""
    from torch._dynamo import convert_frame

    if getattr(convert_frame, "FRAME_COUNTER", 1):  # a torch without the counter: reset
        torch.compiler.reset()


class CompiledPlanWarning(UserWarning):
    """Some of a plan's decisions could not be placed in a compiled model's graphs."""


@dataclass
class Placement:
    """What the joint-graph pass placed of a plan's decisions so far (Note [ Plans under torch.compile ] 4)."""

    placed: set[int] = field(default_factory=set)  # SavedTensor ids tagged in some joint graph
    offloaded: set[int] = field(default_factory=set)  # those of swap decisions the compiler offloads
    graphs: int = 0  # joint graphs the pass has seen

    def unplaced(self, decisions: list[Decision]) -> list[Decision]:
        return [d for d in decisions if d.saved_tensor not in self.placed]


_LOCAL_PREFIX = re.compile(r"^[LG]\[[^\]]*\](?:\[[^\]]*\])*")
_INDEX = re.compile(r"\[\s*'?([\w]+)'?\s*\]")
# how torch.compile reaches the model from the frame it traces (through a wrapper's closure, a bound method,
# an OptimizedModule): the module path is what follows the last of these
_REACHING = ("__self__", "__closure__", "cell_contents", "_orig_mod", "__func__")


def module_path(stack_path: str) -> str:
    """The path from the model's root of a joint-graph node's module: "L['self'].layers[0].attn" and
    "L['self'].forward.__closure__[0].cell_contents.__self__.layers[0].attn" are both "layers.0.attn"."""
    parts = [p for p in _INDEX.sub(r".\1", _LOCAL_PREFIX.sub("", stack_path)).split(".") if p]
    last = max((i for i, p in enumerate(parts) if p in _REACHING), default=-1)
    return ".".join(parts[last + 1:])


def _node_module(node: torch.fx.Node, known_modules: set[str]) -> str:
    """The innermost of the model's modules a joint-graph node ran in ("" for the root, and for a node of the
    compiled forward itself). The stack can hold entries that are none of the model's modules (a function a
    library wraps as a module, such as a hub kernel's rotary embedding): they are passed over."""
    for path, _ in reversed(list((node.meta.get("nn_module_stack") or {}).values())):
        module = module_path(path)
        if module in known_modules:
            return module
    return ""


def _groups(graph: torch.fx.Graph, known_modules: set[str]) -> list[tuple[str, str, list[torch.fx.Node]]]:
    """The joint graph's forward op calls in order: (module path, op family, their nodes)."""
    by_call: dict[int, tuple[str, str, list[torch.fx.Node]]] = {}
    for node in graph.nodes:
        if node.op != "call_function" or node.meta.get("partitioner_tag") == "is_backward":
            continue
        seq, original = node.meta.get("seq_nr"), node.meta.get("original_aten")
        if seq is None or original is None:
            continue
        if seq not in by_call:
            by_call[seq] = (_node_module(node, known_modules), op_family(str(original)), [])
        by_call[seq][2].append(node)
    return list(by_call.values())


def _outputs_like(nodes: list[torch.fx.Node], d: Decision) -> list[torch.fx.Node]:
    """The nodes whose value has the decision's shape and dtype."""
    found = []
    for node in nodes:
        val = node.meta.get("val")
        if not isinstance(val, torch.Tensor) or str(val.dtype) != d.dtype:
            continue
        try:
            if [int(x) for x in val.shape] == list(d.shape):
                found.append(node)
        except (TypeError, RuntimeError):  # a symbolic size: not this plan's shape
            continue
    return found


class PlanGraphPass(CustomGraphPass):
    """The joint-graph pass of Note [ Plans under torch.compile ] 1-2 (chained after a pass already set)."""

    def __init__(self, plan: Plan, placement: Placement, known_modules: set[str], before=None,
                 offload_swaps: bool = False):
        """`before`: the pass Inductor had when the model's call began, run first. `offload_swaps`: a swap
        decision's tensor is saved and offloaded to host memory by the compiler (CUDA), else recomputed."""
        self.by_producer: dict[tuple[str, str, int], list[Decision]] = {}
        for d in plan.decisions:
            if d.producer_module is not None:
                self.by_producer.setdefault((d.producer_module, op_family(d.producer_name), d.producer_rank),
                                            []).append(d)
        self.placement = placement
        self.known_modules = known_modules
        self.before = before
        self.offload_swaps = offload_swaps

    def uuid(self):
        """None: Inductor's caches pass this graph by, so the pass runs at every compile and what it placed
        is known (a cached graph would skip it)."""
        return None

    def __call__(self, graph: torch.fx.Graph) -> None:
        if self.before is not None:
            self.before(graph)
        self.placement.graphs += 1
        ranks: dict[tuple[str, str], int] = {}
        for path, family, nodes in _groups(graph, self.known_modules):
            rank = ranks.get((path, family), 0)
            ranks[(path, family)] = rank + 1
            decisions = self.by_producer.get((path, family, rank), [])
            found = {d.saved_tensor: _outputs_like(nodes, d) for d in decisions}
            offloaded = {d.saved_tensor for d in decisions if d.action == ACTION_SWAP and self.offload_swaps
                         and found[d.saved_tensor] and all(map(_offloadable, found[d.saved_tensor]))}
            for d in decisions:  # recomputes first: a kept output of the same op is then saved all the same
                if d.action != ACTION_KEEP and d.saved_tensor not in offloaded and found[d.saved_tensor]:
                    for node in nodes:
                        node.meta["recompute"] = CheckpointPolicy.MUST_RECOMPUTE
            for d in decisions:
                if d.action == ACTION_KEEP or d.saved_tensor in offloaded:
                    for node in found[d.saved_tensor]:
                        node.meta["recompute"] = CheckpointPolicy.MUST_SAVE
                        node.meta["should_offload"] = d.saved_tensor in offloaded
            self.placement.placed.update(d.saved_tensor for d in decisions if found[d.saved_tensor])
            self.placement.offloaded.update(offloaded)
        _recompute_the_rest(graph)


def _offloadable(node: torch.fx.Node) -> bool:
    """What the compiler's offloading pass moves to host memory: a contiguous tensor that is not a view (it
    passes others over, which would leave them saved on the device)."""
    val = node.meta.get("val")
    view = isinstance(node.target, torch._ops.OpOverload) and node.target.is_view
    return isinstance(val, torch.Tensor) and val.is_contiguous() and not view


def _recompute_the_rest(graph: torch.fx.Graph) -> None:
    """Every other forward node of the model's graph may be recomputed (PREFER_RECOMPUTE), as eager autograd
    keeps nothing but what it saves: a compiled graph would otherwise save, say, a copy of a kept tensor made
    for the next op, or a view of a recomputed one, past the plan's cap. Random ops too: the partitioner then
    replays their RNG state (its functionalize_rng_ops), as regen's eager recipes do."""
    for node in graph.nodes:
        if (node.op == "call_function" and node.meta.get("recompute") is None
                and node.meta.get("partitioner_tag") != "is_backward"
                and node.target is not operator.getitem):  # an output of a multi-output op goes with the op
            node.meta["recompute"] = CheckpointPolicy.PREFER_RECOMPUTE


# Note [ Plans under torch.compile ] 7: the compiler's settings while the plan's model runs (and compiles)
_PLAN_SETTINGS = {
    "inductor": {"score_fusion_memory_threshold": 2 ** 62},  # no kernels fused only for sharing what they read
    "aot": {"force_non_lazy_backward_lowering": True},  # backward compiled in the model's call, under these
}
# Note [ Plans under torch.compile ] 3: a plan's swaps by the compiler's offloading pass; on CUDA the copies
# run on a stream of their own, the forward waits for each as late as it can, backward's copies back start early
_OFFLOAD_SETTINGS = {"enable_activation_offloading": True}
_OFFLOAD_STREAM_SETTINGS = {
    "activation_offload_separate_stream": True,
    "activation_offload_sink_wait": True,
    "activation_reload_prefetch": True,
}


def _offload_settings(device: torch.device) -> dict:
    """The offloading pass's settings for a model on `device`."""
    return {**_OFFLOAD_SETTINGS, **(_OFFLOAD_STREAM_SETTINGS if device.type == "cuda" else {})}


def _configs() -> dict:
    return {"inductor": torch._inductor.config, "aot": torch._functorch.config}


def _set_compiler(plan_pass: CustomGraphPass, offloading: dict) -> dict:
    """Set the compiler's settings for a planned model's call (`offloading`: the offloading pass's, {} when the
    plan offloads nothing); returns the ones they replaced."""
    settings = {**_PLAN_SETTINGS, "inductor": {**_PLAN_SETTINGS["inductor"], "joint_custom_pre_pass": plan_pass},
                "aot": {**_PLAN_SETTINGS["aot"], **offloading}}
    configs = _configs()
    before = {part: {name: getattr(configs[part], name) for name in values} for part, values in settings.items()}
    for part, values in settings.items():
        for name, value in values.items():
            setattr(configs[part], name, value)
    return before


def _restore_compiler(before: dict) -> None:
    configs = _configs()
    for part, values in before.items():
        for name, value in values.items():
            setattr(configs[part], name, value)


def _first_tensor_requiring_grad(output) -> torch.Tensor | None:
    """The first tensor of a model's output (flattened as learned.py flattens it) that requires grad: its
    gradient starts the step's backward."""
    return next((t for t in tree_flatten(output)[0] if isinstance(t, torch.Tensor) and t.requires_grad), None)


_FORWARD_TOKENS = itertools.count()
_TORCH_DIR = os.path.dirname(torch.__file__) + os.sep


def _with_code_of_its_own(fn, copies: dict):
    """`fn` (a function or bound method) as a copy with code objects of its own, and so the functions its
    closure holds (a decorator's wrapper holds the function it wraps): torch.compile keeps compiled code per
    code object, and a frame it starts after a graph break inside the model's forward would otherwise be the
    class's, shared by its instances (Note [ Plans under torch.compile ] 6)."""
    if isinstance(fn, types.MethodType):
        return types.MethodType(_with_code_of_its_own(fn.__func__, copies), fn.__self__)
    if not isinstance(fn, types.FunctionType) or fn.__code__.co_filename.startswith(_TORCH_DIR):
        return fn  # torch's own functions stay themselves: torch.compile treats some of them by identity
    if id(fn) in copies:  # copied already, or being copied (a closure that holds itself: it keeps the original)
        return copies[id(fn)]
    copies[id(fn)] = fn
    closure = None if fn.__closure__ is None else tuple(_cell_of_its_own(cell, copies) for cell in fn.__closure__)
    copy = types.FunctionType(fn.__code__.replace(), fn.__globals__, fn.__name__, fn.__defaults__, closure)
    copy.__kwdefaults__ = fn.__kwdefaults__
    copy.__dict__.update(fn.__dict__)
    copy.__qualname__ = fn.__qualname__
    copies[id(fn)] = copy
    return copy


def _cell_of_its_own(cell, copies: dict):
    try:
        value = cell.cell_contents
    except ValueError:  # an empty cell
        return cell
    return types.CellType(_with_code_of_its_own(value, copies)) if isinstance(value, types.FunctionType) else cell


def forward_of_its_own(module: nn.Module):
    """`module`'s forward, as a function torch.compile guards on: compiled code is shared by every instance
    of a module class (their parameters are the graph's inputs), so without it another instance could run
    this plan's code, or this model another's (bench/compiled.py gives each row its own code so)."""
    forward = _with_code_of_its_own(module.forward, {})
    # a string: torch.compile guards on its value (an int that changed between compiles would become a
    # dynamic input, and one compiled entry would then serve every later instance)
    token = f"regen-forward-{next(_FORWARD_TOKENS)}"

    def planned_forward(*args, **kwargs):
        if token == "":  # never true: read so that torch.compile guards on this forward's token
            raise AssertionError("unreachable")
        return forward(*args, **kwargs)

    return planned_forward


class CompiledCalls:
    """What carries a plan out in a compiled model's calls: the joint-graph pass, the compiler's settings while a
    call runs (and compiles), the peak check and what is said about placement (Note [ Plans under torch.compile ]).
    Its owner calls `begin_call()` and `end_call(output)` around each call of the model, outside compiled code."""

    def __init__(self, root: nn.Module, plan: Plan, offload_swaps: bool | None = None):
        """`offload_swaps`: carry swap decisions out by the compiler's offloading pass (None: on CUDA only,
        where the copies overlap compute; elsewhere they are recomputed)."""
        if any(d.producer_name is None for d in plan.decisions):
            raise RegenError("regen.apply: this plan does not name its decisions' ops the way a compiled graph "
                             "can find them (solved by an older regen); solve it again")
        known = {name for name, _ in root.named_modules()}
        self._check_modules(known, plan)
        self.plan = plan
        self.placement = Placement()
        self._reported = False
        self._said_uncompiled = False  # a step that compiled no graph was warned
        # on CUDA, the allocator's peak over a checked step (forward to the end of its backward) against the cap
        device = module_device(root)
        self.peak_check = PeakCheck(plan.memory_cap_bytes, cuda_peak_reader(device))
        self._steps = 0
        self._checked: object | None = None  # the step whose peak is being checked
        if offload_swaps is None:
            offload_swaps = device.type == "cuda"
        has_swaps = any(d.action == ACTION_SWAP for d in plan.decisions)
        self._offloading = _offload_settings(device) if offload_swaps and has_swaps else {}
        self._say_what_is_not_placed(plan, offload_swaps)
        self._pass = PlanGraphPass(plan, self.placement, known, offload_swaps=offload_swaps)
        self._outer_settings: list[dict] = []  # the compiler's settings when a call began (restored when it ends)

    @staticmethod
    def _check_modules(names: set[str], plan: Plan) -> None:
        """A plan for another model names modules this one (its module paths: `names`) lacks: one clear error."""
        missing = sorted({d.producer_module for d in plan.decisions if d.producer_module is not None} - names)
        if missing:
            raise RegenError(f"regen.apply: the plan names modules this model does not have ({', '.join(missing[:3])}"
                             f"{', ...' if len(missing) > 3 else ''}): a plan for another model?")

    @staticmethod
    def _say_what_is_not_placed(plan: Plan, offload_swaps: bool) -> None:
        swaps = [d for d in plan.decisions if d.action == ACTION_SWAP]
        if swaps and not offload_swaps:
            warnings.warn(f"regen.apply: a compiled model off CUDA recomputes what its plan would swap ({len(swaps)} "
                          f"tensors, {format_bytes(sum(d.bytes for d in swaps))}): compiled plans swap on CUDA only",
                          CompiledPlanWarning, stacklevel=6)
        outside = [d for d in plan.decisions if d.producer_module is None and d.action != ACTION_KEEP]
        if outside:
            warnings.warn(f"regen.apply: {len(outside)} of the plan's decisions to drop a tensor "
                          f"({format_bytes(sum(d.bytes for d in outside))}) are on ops outside the model (a loss "
                          f"computed in the loop); a compiled model keeps them, so its steps can pass the plan's cap "
                          f"by as much: compute the loss in the model's forward, or compile without a plan",
                          CompiledPlanWarning, stacklevel=6)

    def begin_call(self) -> None:
        self._pass.before = torch._inductor.config.joint_custom_pre_pass
        self._outer_settings.append(_set_compiler(self._pass, self._offloading))
        if len(self._outer_settings) == 1 and torch.is_grad_enabled():  # a training step begins
            self._steps += 1
            step = object()
            checked = self.peak_check.step_started(step, self._steps) and self.peak_check.read_peak is not None
            self._checked = step if checked else None

    def end_call(self, output) -> None:
        if self._outer_settings:
            _restore_compiler(self._outer_settings.pop())
        self._report()
        if self._outer_settings:  # a call inside the step's own: the step goes on
            return
        if not self.placement.graphs and torch.is_grad_enabled() and not self._said_uncompiled:
            self._said_uncompiled = True
            warnings.warn("regen.apply: the model's training step ran without compiling a graph of its own (torch.compile "
                          "ran it eagerly: its recompile limit, torch._dynamo.config.recompile_limit, reached?), so the "
                          "plan is not carried out", CompiledPlanWarning, stacklevel=3)
        step, self._checked = self._checked, None
        tensor = _first_tensor_requiring_grad(output) if step is not None else None
        if tensor is not None:  # read the peak again when the step's backward ends
            tensor.register_hook(lambda _grad: torch.autograd.Variable._execution_engine.queue_callback(
                lambda: self.peak_check.step_released(step, followed_plan=True)))

    def _report(self) -> None:
        if self._reported or not self.placement.graphs:
            return
        self._reported = True
        unplaced = [d for d in self.placement.unplaced(self.plan.decisions)
                    if d.producer_module is not None and d.action != ACTION_KEEP]
        if unplaced:
            warnings.warn(f"regen.apply: {len(unplaced)} of the plan's decisions to drop a tensor "
                          f"({format_bytes(sum(d.bytes for d in unplaced))}) were not found in the compiled graphs "
                          f"(the compiler traced those ops differently, or this step's shapes are not the plan's): the "
                          f"compiler decides on them, and the step's peak can differ from the plan's",
                          CompiledPlanWarning, stacklevel=3)
        recomputed = [d for d in self.plan.decisions if d.action == ACTION_SWAP and d.saved_tensor in
                      self.placement.placed and d.saved_tensor not in self.placement.offloaded]
        if self._offloading and recomputed:
            warnings.warn(f"regen.apply: {len(recomputed)} of the plan's swaps ({format_bytes(sum(d.bytes for d in recomputed))}) "
                          f"are recomputed: the compiler offloads no view and no non-contiguous tensor",
                          CompiledPlanWarning, stacklevel=3)


class CompiledPlanHandle:
    """What `regen.apply` returns for a compiled model and a plan: a context manager, or call `.remove()`."""

    def __init__(self, model: nn.Module, plan: Plan, offload_swaps: bool | None = None):
        """`offload_swaps`: as CompiledCalls takes it."""
        root = compiled_module(model)
        self.calls = CompiledCalls(root, plan, offload_swaps)
        self.model = model
        self.plan = plan
        self._removed = False
        self.caches = announced_caches_off(root)
        reset_compiled_code()
        self._hooks = self._pass_during_calls(model)
        self._root = root
        self._own_forward = root.__dict__.get("forward")
        root.forward = forward_of_its_own(root)

    @property
    def placement(self) -> Placement:
        return self.calls.placement

    @property
    def peak_check(self) -> PeakCheck:
        return self.calls.peak_check

    def _pass_during_calls(self, model: nn.Module) -> list:
        """The pass is Inductor's only while this model runs (and compiles): hooks on the compiled wrapper
        (they run outside the compiled code), or for a model compiled in place, a wrapper around its compiled
        call. Other models compiled meanwhile never see it."""
        calls = self.calls
        if compiled_module(model) is not model:
            return [model.register_forward_pre_hook(lambda *_: calls.begin_call()),
                    model.register_forward_hook(lambda _module, _args, out: calls.end_call(out), always_call=True)]
        compiled_call = model._compiled_call_impl

        def call_under_the_plan(*args, **kwargs):
            calls.begin_call()
            out = None
            try:
                out = compiled_call(*args, **kwargs)
                return out
            finally:
                calls.end_call(out)

        model._compiled_call_impl = call_under_the_plan
        return [compiled_call]

    # ---- public ---------------------------------------------------------------------------------------
    def __enter__(self) -> "CompiledPlanHandle":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        self.remove()

    def remove(self, abort: bool = False) -> None:
        """Take the pass out and reset torch.compile's caches: the next step compiles without the plan."""
        if self._removed:
            return
        self._removed = True
        if self._own_forward is None:
            del self._root.forward
        else:
            self._root.forward = self._own_forward
        for hook in self._hooks:
            if isinstance(hook, torch.utils.hooks.RemovableHandle):
                hook.remove()
            else:
                self.model._compiled_call_impl = hook
        reset_compiled_code()
        self.caches.restore()

    @property
    def hooks_installed(self) -> bool:
        return not self._removed
