"""The liveness probe: until when does something other than autograd hold each saved storage?

A plan that swaps or recomputes a saved tensor drops autograd's reference to its storage; that frees
memory only once nothing else holds it. PyTorch's GRU keeps every step's hidden state in a list until
the layer returns, a module may keep a tensor in `self.cache`, a Python local holds its tensor until the
function returns, the training loop holds the model's output until backward ends. The probe measures it:
one more forward+backward in which the pack hook hands autograd a copy of every saved storage the step made (on
the host for a CUDA device, so the probe itself needs no more device memory) and keeps only a weak
reference to the original. The original then dies exactly when its other holders let go of it; a dispatch
mode counting the ops as the recorded step did takes the frees reported since the op before (regen.storage_frees)
before every op.

`probe_step` returns, per saved entry index, the last op at whose start the original storage was still
alive (`SavedTensor.held_until_op`); a storage alive at the end of the step is held until the last op. The
same step finds the module calls that leave state behind besides their output, which a replay would write
again (regen.profiler.outside_state: the originals of saved storages are gone when nothing else holds them,
so a storage still alive after its call returned is held by something else).
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass

import torch
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._pytree import tree_flatten
from torch.utils._python_dispatch import TorchDispatchMode

from regen import opinfo
from regen.profiler.outside_state import CallWatcher
from regen.storage_frees import FreedStorages
from regen.workloads import Workload, forward_with_output

_regen_ops = torch._C._DisableTorchDispatch  # the probe's own copies are not ops of the step


class _ProbeMode(TorchDispatchMode):
    """Counts the step's ops as the capture does and takes the originals' frees before each."""

    def __init__(self, probe: "_Probe", watcher: CallWatcher):
        super().__init__()
        self.probe = probe
        self.watcher = watcher
        self.names: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if not opinfo.is_counted(func):
            return func(*args, **kwargs)
        self.probe.take_frees(len(self.names))
        self.names.append(opinfo.op_name(func))
        out = func(*args, **kwargs)
        self.watcher.op_ran(func, args, kwargs, out)
        return out


class _Probe:
    """The pack and unpack hooks of the probe step, and what they found."""

    def __init__(self, copied_entries: set[int]):
        self.copied_entries = copied_entries
        self.num_packs = 0
        self.copies: dict[int, tuple[StorageWeakRef, torch.Tensor]] = {}  # storage key -> (original, copy)
        self.watched = FreedStorages()  # by entry index: its original storage, while alive
        self.freed_before: dict[int, int] = {}  # entry index -> first op at whose start it was dead

    def take_frees(self, op: int) -> None:
        for i, _ in self.watched.pop_freed():
            self.freed_before[i] = op

    def pack(self, x: torch.Tensor):
        if torch._C._current_graph_task_id() != -1:  # saved during backward: not a forward entry
            return None, x
        index = self.num_packs
        self.num_packs += 1
        if index not in self.copied_entries:
            return None, x
        with _regen_ops():
            storage = x.untyped_storage()
            key = storage.data_ptr()
            if key == 0:  # an empty storage: nothing to free
                return None, x
            known = self.copies.get(key)
            if known is None or known[0].expired():  # two live storages never share a data pointer
                flat = torch.empty(0, dtype=torch.uint8, device=x.device).set_(storage, 0, (storage.nbytes(),))
                copy = flat.cpu() if x.device.type != "cpu" else _outside_the_allocator(flat)
                known = self.copies[key] = (StorageWeakRef(storage), copy)
            self.watched.watch(index, known[0], 0)
            return index, (known[1], x.device, x.dtype, x.shape, x.stride(), x.storage_offset())

    def unpack(self, handle):
        index, saved = handle
        if index is None:
            return saved
        copy, device, dtype, shape, stride, offset = saved
        with _regen_ops():
            data = copy.to(device) if device.type != "cpu" else copy  # read in place on a CPU
            return torch.empty(0, dtype=dtype, device=device).set_(data.untyped_storage(), offset, shape, stride)


@dataclass
class ProbeFindings:
    """What the probe step found."""

    # entry index -> the last op at whose start its storage was held by something other than autograd
    held_until_op: dict[int, int]
    # (module path, call) -> what the call leaves behind besides its output (regen.profiler.outside_state)
    left_behind: dict[tuple[str, int], str]


def probe_step(workload: Workload, copied_entries: set[int],
               recorded_names: list[str]) -> ProbeFindings | None:
    """Run the probe step, autograd holding copies of the storages of the forward packs in `copied_entries`
    (every storage it holds that the step's ops made); None when it dispatched another op sequence than the
    recorded one (its op indices would not be the profile's)."""
    probe = _Probe(copied_entries)
    watcher = CallWatcher(workload.model)
    mode = _ProbeMode(probe, watcher)
    with _gradients_set_aside(workload), torch.autograd.graph.saved_tensors_hooks(probe.pack, probe.unpack):
        with watcher, mode:
            loss, output = forward_with_output(workload)
            watcher.forward = False
            loss.backward()
            del loss, output
        probe.take_frees(len(mode.names))
    if mode.names != recorded_names:
        return None
    last = len(recorded_names) - 1
    held = {i: op - 1 for i, op in probe.freed_before.items()}
    held.update({i: last for i in probe.watched.keys()})  # still alive after the step: held throughout
    return ProbeFindings(held_until_op=held, left_behind=watcher.found)


def _outside_the_allocator(flat: torch.Tensor) -> torch.Tensor:
    """A CPU copy of `flat` in a Python buffer: on a CPU device the probe's copies, like parked bytes
    (profiler.park), are host memory, outside torch's allocator, so the probe step needs no more of the
    allocator than a parked step does."""
    copy = torch.frombuffer(bytearray(flat.numel()), dtype=torch.uint8)
    copy.copy_(flat)
    return copy


@contextmanager
def _gradients_set_aside(workload: Workload):
    """The probe step starts with no gradients (so that it dispatches the recorded step's ops, which
    allocate gradients rather than accumulate into them) and leaves the model's and the batch's gradients
    as it found them."""
    leaves = list(workload.model.parameters()) + [t for t in tree_flatten(workload.batch)[0]
                                                   if isinstance(t, torch.Tensor) and t.requires_grad]
    found = [t.grad for t in leaves]
    for t in leaves:
        t.grad = None
    try:
        yield
    finally:
        for t, grad in zip(leaves, found):
            t.grad = grad
