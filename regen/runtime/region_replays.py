"""Region replays: a module call held in forward and run again in backward (Plan.regions).

In forward, the handle's hooks on each region's module tell the step about every call of it
(`RegionReplays.called` / `.returned`): the call whose number is the region's (`RegionDecision.call`)
is captured as a `RegionCall`: the module, its arguments (held until the replay: the plan keeps them),
the RNG state when the region draws from it (CPU, and the CUDA device's), Python's and NumPy's global RNG
states when the call draws from them (a forward may draw a mask from `np.random`, which no op shows: the
replay draws it again from the same state, and the ambient states are put back after it, as torch's are;
whether it draws is seen on the handle's first call of the region, `RegionInfo.draws_host_rng`: reading
both states costs about 40 us, too much for every call of every step), the autocast state and the grad
mode, and the number of tensors autograd packed during it (the plan's `packs` must match).

In backward, `replay` runs the module's forward again once, as torch.utils.checkpoint (non-reentrant)
does, with the RNG state, autocast state and grad mode of the original call, under saved-tensor hooks
that take the k-th tensor the replay packs for the plan's k-th pack of the call: a tensor over the
storage of the member rebuilt there. Like torch.utils.checkpoint's early stop, the replay ends at the
pack that gives the last member it rebuilds (`formats.plan_rules.replay_stop_pack` over the members the
step dropped: PlannedStorages.replay_region): the rest of the forward
(often a block's last matmul and its residual add) rebuilds nothing and is not run; the planner
charges the replay up to that pack (regen.planner.region_candidates). The module's buffers are swapped for
copies during the replay, so running statistics (BatchNorm's running mean and var,
num_batches_tracked) are not updated twice and the originals are not written at all. Nothing is
replayed op by op: the module's own forward runs at native speed, with the handle's dispatch mode
paused. A replay that returns before its needed packs, or rebuilds a member of another size, is a
PlanMismatchError: never an approximate rebuild (the packs after the stop are not checked in
backward; the forward's pack count is, every step).
"""

from __future__ import annotations

import random
import sys
import weakref
from dataclasses import dataclass
from typing import Callable

import torch
from torch import nn
from torch.utils._pytree import tree_map

from regen.errors import PlanMismatchError
from regen.runtime.model_access import module_device
from regen.runtime.plan_index import PlanIndex, RegionInfo
from regen.runtime.tracker import regen_ops

_AUTOCAST_DEVICES = ("cpu", "cuda")
_dispatch_stack_len = torch._C._len_torch_dispatch_stack


@dataclass
class RegionCall:
    """The captured call of one region in one step."""

    info: RegionInfo
    module: nn.Module
    args: tuple | None
    kwargs: dict | None
    grad_enabled: bool
    autocast: tuple  # (device type, enabled, dtype) per device type, as at the call
    autocast_cache: bool
    packs_at_call: int  # the step's forward packs before the call
    cpu_rng_state: torch.Tensor | None = None
    cuda_rng_state: tuple[torch.device, torch.Tensor] | None = None
    host_rng_states: tuple | None = None  # Python's and NumPy's (host_rng_states())
    packed: int | None = None  # packs during the call, once it returned
    replayed: bool = False
    weak_inputs: tuple | None = None  # after the replay: (args, kwargs) with weak references to tensors


class RegionReplays:
    """One step's region calls: captured in forward, replayed in backward."""

    def __init__(self, index: PlanIndex, pause_tracker: Callable, mismatch: Callable[[str], None],
                 forward_packs: Callable[[], int]):
        """`pause_tracker()`: a context during which the handle's dispatch mode counts nothing;
        `mismatch(message)`: the step's; `forward_packs()`: the step's forward packs so far."""
        self.index = index
        self._pause = pause_tracker
        self._mismatch = mismatch
        self._forward_packs = forward_packs
        self.call_counts: dict[str, int] = {}
        self.calls: dict[int, RegionCall] = {}  # region id -> its captured call
        self._open: list[RegionCall] = []

    # ---- forward ----------------------------------------------------------------------------------
    def called(self, path: str, module: nn.Module, args: tuple, kwargs: dict) -> None:
        """A call of a region module in the step's forward: capture it when it is the region's call."""
        call = self.call_counts.get(path, 0)
        self.call_counts[path] = call + 1
        rid = self.index.region_by_call.get((path, call))
        if rid is None:
            return
        info = self.index.regions[rid]
        rc = RegionCall(info=info, module=module, args=args, kwargs=kwargs, grad_enabled=torch.is_grad_enabled(),
                        autocast=tuple((d, torch.is_autocast_enabled(d), torch.get_autocast_dtype(d))
                                       for d in _AUTOCAST_DEVICES),
                        autocast_cache=torch.is_autocast_cache_enabled(), packs_at_call=self._forward_packs(),
                        host_rng_states=None if info.draws_host_rng is False else host_rng_states())
        if info.region.is_random:
            rc.cpu_rng_state = torch.get_rng_state()
            device = module_device(module)
            if device is not None and device.type == "cuda":
                rc.cuda_rng_state = (device, torch.cuda.get_rng_state(device))
        self.calls[rid] = rc
        self._open.append(rc)

    def returned(self, module: nn.Module) -> None:
        """A region module's call returned: check the packs of a captured call against the plan."""
        if not self._open or self._open[-1].module is not module:
            return
        rc = self._open.pop()
        if rc.info.draws_host_rng is None:
            rc.info.draws_host_rng = not same_host_rng_states(rc.host_rng_states, host_rng_states())
        if not rc.info.draws_host_rng:
            rc.host_rng_states = None  # its replay need not touch them
        rc.packed = self._forward_packs() - rc.packs_at_call
        expected = len(rc.info.pack_keys)
        if rc.packed != expected:
            self._mismatch(f"module {rc.info.region.module!r} saved {rc.packed} tensors during its call, the plan "
                           f"expects {expected}")

    def forward_packed(self, x: torch.Tensor) -> None:
        """A tensor was packed in the forward of a step that matches packs through the writer map (counted
        already): keep its geometry when it gives a member of an open region call, to check replays against
        (later steps match packs by order, shapes and dtypes checked)."""
        if not self._open:
            return
        k_step = self._forward_packs() - 1
        for rc in self._open:
            k = k_step - rc.packs_at_call
            keys = rc.info.pack_keys
            if k < len(keys) and keys[k] is not None:
                rc.info.member_geometry[k] = _geometry(x)

    def captured(self, rid: int) -> bool:
        """The region's call ran in this step's forward (its members can be dropped)."""
        return rid in self.calls

    # ---- backward ---------------------------------------------------------------------------------
    def replay(self, rid: int, stop: int) -> dict[tuple[int, int], torch.Tensor]:
        """Run the region's module again, up to its `stop`-th pack; the rebuilt storages by member key. Once per
        step."""
        rc = self.calls.get(rid)
        if rc is None:
            return {}
        if rc.packed is None:
            raise PlanMismatchError(f"regen.apply: module {rc.info.region.module!r} is replayed before its call "
                                    f"returned; the plan does not fit this run")
        if rc.replayed:  # a backward over a retained graph needs its members again
            rc.args, rc.kwargs = _inputs_again(rc)
        rc.replayed = True
        keys = rc.info.pack_keys
        packed: list[torch.Tensor | None] = []

        def pack(x):
            k = len(packed)
            if k >= stop:
                raise _ReplayDone
            if keys[k] is None:
                packed.append(None)
            elif _dispatch_stack_len() == 0:  # no mode to hide regen's own detach from
                _check_geometry(rc, k, x)
                packed.append(x.detach())
            else:
                with regen_ops():
                    _check_geometry(rc, k, x)
                    packed.append(x.detach())
            if k + 1 == stop:
                raise _ReplayDone  # every member it rebuilds is packed: the rest of the forward is not needed
            return None

        def unpack(_):
            raise PlanMismatchError("regen.apply: a region replay's graph was run backward")

        args, kwargs = rc.args, rc.kwargs
        # after the replay the call holds its arguments weakly: no memory, yet there for a second backward
        # over a retained graph as long as something else (that graph) holds them
        rc.args = rc.kwargs = None
        rc.weak_inputs = tree_map(lambda a: weakref.ref(a) if isinstance(a, torch.Tensor) else a, (args, kwargs))
        with self._pause(), _state_of(rc), _buffers_copied(rc.module), \
                torch.autograd.graph.saved_tensors_hooks(pack, unpack):
            try:
                rc.module(*args, **kwargs)
            except _ReplayDone:
                pass
            except PlanMismatchError:
                raise
            except Exception as exc:  # the forward itself failed on a second run: not a replay of the first
                raise PlanMismatchError(f"regen.apply: replaying module {rc.info.region.module!r} in backward raised "
                                        f"{type(exc).__name__}: {exc}; its forward does not run again as it ran "
                                        f"(state it keeps between calls?), so the plan does not fit this "
                                        f"model") from exc
        del args, kwargs
        if len(packed) != stop:
            raise PlanMismatchError(f"regen.apply: replaying module {rc.info.region.module!r} saved {len(packed)} "
                                    f"tensors, its call in forward saved {len(keys)}; the plan does not fit this model")
        rebuilt = {}
        for key, t in zip(keys, packed):
            if key is not None and key not in rebuilt:
                rebuilt[key] = t
        return rebuilt

    def release(self) -> None:
        """Let go of every captured call (arguments, RNG states)."""
        self.calls.clear()
        self._open.clear()


def _geometry(x: torch.Tensor) -> tuple:
    return tuple(x.shape), x.stride(), x.storage_offset(), x.dtype, x.untyped_storage().nbytes()


def _check_geometry(rc: RegionCall, k: int, x: torch.Tensor) -> None:
    """The replay's k-th pack views its member's storage as the forward's did: else a PlanMismatchError."""
    expected = rc.info.member_geometry.get(k)
    found = _geometry(x)
    if expected is None or found == expected:
        return
    what = ("shape", "stride", "storage offset", "dtype", "storage bytes")
    differs = [f"{name} {b} instead of {a}" for name, a, b in zip(what, expected, found) if a != b]
    raise PlanMismatchError(f"regen.apply: replaying module {rc.info.region.module!r} in backward rebuilt a saved "
                            f"tensor with {', '.join(differs)}; its forward does not run again as it ran (state it "
                            f"keeps between calls?), so the plan does not fit this model")


class _ReplayDone(Exception):
    """Raised from the replay's pack hook once it has every member it rebuilds (caught by `replay`)."""


def _inputs_again(rc: RegionCall) -> tuple[tuple, dict]:
    """The arguments of a replayed call, for another replay (a backward over a retained graph)."""
    def strong(a):
        if isinstance(a, weakref.ref):
            tensor = a()
            if tensor is None:
                raise PlanMismatchError(
                    f"regen.apply: a second backward needs module {rc.info.region.module!r} replayed again, and its "
                    f"inputs were freed after its first replay (a region replays again only while something "
                    f"else holds its inputs)")
            return tensor
        return a

    return tree_map(strong, rc.weak_inputs, is_leaf=lambda a: isinstance(a, weakref.ref))



def host_rng_states() -> tuple:
    """Python's global RNG state and NumPy's (None where NumPy is not loaded): draws no op shows."""
    numpy = sys.modules.get("numpy")
    return random.getstate(), None if numpy is None else numpy.random.get_state()


def same_host_rng_states(a: tuple, b: tuple) -> bool:
    """No draw from Python's or NumPy's global RNG between the two readings (NumPy loaded in between: a draw)."""
    if a[0] != b[0] or (a[1] is None) != (b[1] is None):
        return False
    if a[1] is None:
        return True
    (name_a, key_a, pos_a, *rest_a), (name_b, key_b, pos_b, *rest_b) = a[1], b[1]
    return name_a == name_b and pos_a == pos_b and rest_a == rest_b and bool((key_a == key_b).all())


def set_host_rng_states(states: tuple) -> None:
    python_state, numpy_state = states
    random.setstate(python_state)
    if numpy_state is not None:
        sys.modules["numpy"].random.set_state(numpy_state)


class _state_of:
    """Grad mode, autocast state and RNG states of the original call, for the replay; the ambient RNG
    states are restored after it."""

    def __init__(self, rc: RegionCall):
        self.rc = rc
        self.contexts = [torch.enable_grad() if rc.grad_enabled else torch.no_grad()]
        for device, enabled, dtype in rc.autocast:
            if enabled or torch.is_autocast_enabled(device):
                self.contexts.append(torch.autocast(device, dtype=dtype, enabled=enabled,
                                                    cache_enabled=rc.autocast_cache))
        self.ambient_cpu = self.ambient_cuda = self.ambient_host = None

    def __enter__(self):
        rc = self.rc
        if rc.host_rng_states is not None:
            self.ambient_host = host_rng_states()
            set_host_rng_states(rc.host_rng_states)
        if rc.cpu_rng_state is not None:
            self.ambient_cpu = torch.get_rng_state()
            torch.set_rng_state(rc.cpu_rng_state)
        if rc.cuda_rng_state is not None:
            device, state = rc.cuda_rng_state
            self.ambient_cuda = torch.cuda.get_rng_state(device)
            torch.cuda.set_rng_state(state, device)
        for c in self.contexts:
            c.__enter__()

    def __exit__(self, *exc):
        for c in reversed(self.contexts):
            c.__exit__(*exc)
        if self.ambient_cpu is not None:
            torch.set_rng_state(self.ambient_cpu)
        if self.ambient_cuda is not None:
            torch.cuda.set_rng_state(self.ambient_cuda, self.rc.cuda_rng_state[0])
        if self.ambient_host is not None:
            set_host_rng_states(self.ambient_host)


class _buffers_copied:
    """The module's buffers (all of its submodules') replaced by copies while it replays, so the replay
    neither updates running statistics a second time nor bumps the originals' version counters."""

    def __init__(self, module: nn.Module):
        self.saved = [(m, name, b) for m in module.modules() for name, b in m._buffers.items() if b is not None]

    def __enter__(self):
        with regen_ops(), torch.no_grad():
            for m, name, b in self.saved:
                m._buffers[name] = b.clone()

    def __exit__(self, *exc):
        for m, name, b in self.saved:
            m._buffers[name] = b
