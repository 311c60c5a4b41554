"""The CUDA code paths without a GPU, and what the runtime shares between devices and threads.

torch.cuda's streams and events are replaced by records (fake_cuda.py), so `CudaEngine` and the
profiler's CUDA op timing run here on CPU tensors: every stream, event and synchronize names its device;
a swapped source is let go on the stream it was allocated on, whichever stream is current at the
release; a copy-in buffer read on another stream is recorded on that stream; CUDA events are reused from
step to step; the host pool is made again, pinned, at the first CUDA copy-out, with the
plan's rounding (never growing in the first step) and under a lock; `nn.DataParallel` is refused; and a
loss computed outside the model whose last op saves nothing leaves no dispatch mode for the backward.
What only a GPU shows (real stream concurrency, the allocator's reuse) is bench/gpu_check.py's.
"""

import importlib
import random
import sys
import threading
import warnings

import pytest
import torch
from torch import nn
from torch.utils._python_dispatch import _get_current_dispatch_mode_stack

import regen
from common import assert_nothing_left, assert_same, make, run_and_grads, traced
from fake_cuda import FakeCuda
from handmade import PLANS, trace_workload
from regen.errors import RegenError, WorkloadError
from regen.formats.plan_rules import host_range_bytes
from regen.profiler.capture import TimingMode
from regen.runtime.swap import CudaEngine, HostPool
from regen.runtime.swap.host_pool import MIN_CHUNK_BYTES
from regen.runtime.tracker import ForwardTracker
from regen.workloads import Workload

host_pool_module = importlib.import_module("regen.runtime.swap.host_pool")
apply_module = importlib.import_module("regen.runtime.apply")


def _pageable_host_memory(monkeypatch) -> list[bool]:
    """No pinned memory without CUDA: chunks are pageable here; returns the pinning asked for, per chunk."""
    asked = []

    def host_memory(nbytes, pinned):
        asked.append(pinned)
        return torch.empty(nbytes, dtype=torch.uint8)

    monkeypatch.setattr(host_pool_module, "host_memory", host_memory)
    return asked


def _engine(monkeypatch):
    fake = FakeCuda().install(monkeypatch)
    _pageable_host_memory(monkeypatch)
    pool = HostPool(0)
    return fake, CudaEngine(torch.device("cpu"), pool)


# ---- devices (issue 15 item 4) ---------------------------------------------------------------------------
def test_op_timing_records_on_the_profiled_devices_stream(monkeypatch):
    fake = FakeCuda(current_device="cuda:0").install(monkeypatch)
    device = torch.device("cuda", 1)  # profiled while device 0 is current
    mode = TimingMode(device)
    x = torch.randn(8, 8)
    with mode:
        (x @ x).relu().sum()
    times = mode.times_s()
    assert len(times) == len(mode.names) >= 3
    stream = fake.current_stream(device)
    assert all(start.stream is stream and end.stream is stream for start, end in mode._events)
    assert fake.synchronized == [device]
    assert fake.unnamed_device_calls == [], "a call fell back to the current device"


# ---- streams (item 5) ------------------------------------------------------------------------------------
def test_a_swapped_source_is_let_go_on_its_allocation_stream(monkeypatch):
    fake, engine = _engine(monkeypatch)
    compute = fake.current_stream("cpu")
    side = fake.Stream("cpu")
    t = torch.randn(1000)
    out = engine.copy_out(t)
    assert out.done_event.stream is engine.d2h_stream
    with fake.stream(side):  # the release point runs while another stream is current
        engine.release_source(out)
    assert out.source is None
    assert out.done_event in compute.waited and out.done_event not in side.waited
    assert torch.equal(out.slot.tensor.view(torch.float32), t)
    assert fake.unnamed_device_calls == []


def test_a_copy_in_read_on_another_stream_is_recorded_on_it(monkeypatch):
    fake, engine = _engine(monkeypatch)
    compute = fake.current_stream("cpu")
    side = fake.Stream("cpu")
    t = torch.randn(1000)
    out = engine.copy_out(t)
    engine.release_source(out)
    cin = engine.copy_in(out)
    engine.wait_copy_in(cin)  # on its allocation stream: stream order keeps the memory
    assert fake.recorded_streams == [] and cin.done_event in compute.waited
    with fake.stream(side):
        engine.wait_copy_in(cin)
    assert cin.done_event in side.waited
    assert fake.recorded_streams == [(cin.buffer.untyped_storage().data_ptr(), side)]
    assert torch.equal(cin.buffer.view(torch.float32), t)
    unread = engine.copy_in(out)  # dropped before anything read it, while another stream is current
    with fake.stream(side):
        engine.drop_copy_in(unread)
    assert unread.done_event in compute.waited


def test_the_host_pool_hands_out_each_range_once_across_threads():
    """Engines of several devices share one pool: ranges taken and given back (out of order, so the free
    list is long) from four threads at once are never handed out twice, and all merge back."""
    pool = HostPool(0)
    live: dict[int, tuple] = {}  # id(slot) -> (chunk, start, end)
    guard, problems = threading.Lock(), []

    def work(k: int):
        rng = random.Random(k)
        try:
            for _ in range(400):
                slots = [pool.allocate(512 * rng.randint(1, 6) - 7) for _ in range(24)]
                with guard:
                    for s in slots:
                        span = (id(s.chunk), s.start, s.start + s.reserved_bytes)
                        if any(c == span[0] and a < span[2] and span[1] < b for c, a, b in live.values()):
                            problems.append(f"range {span[1:]} handed out twice")
                        live[id(s)] = span
                    for s in slots:
                        del live[id(s)]
                rng.shuffle(slots)
                for s in slots:
                    pool.release(s)
        except Exception as exc:  # noqa: BLE001 (reported below)
            problems.append(repr(exc))

    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)  # switch threads as often as possible
    try:
        threads = [threading.Thread(target=work, args=(k,)) for k in range(4)]
        for th in threads:
            th.start()
        for th in threads:
            th.join()
    finally:
        sys.setswitchinterval(interval)
    assert problems == []
    assert pool.checked_out_bytes == 0
    assert all(chunk.free == [[0, chunk.tensor.numel()]] for chunk in pool.chunks)


def test_data_parallel_is_refused_in_one_line():
    w, trace = traced("mlp")
    plan = PLANS["recompute"](trace)
    with pytest.raises(RegenError, match="DataParallel") as info:
        regen.apply(nn.DataParallel(w.model), plan)
    assert "\n" not in str(info.value)
    assert not w.model._forward_pre_hooks and not w.model._forward_hooks
    from regen.profiler import profile_workload

    wrapped = make("mlp")
    wrapped.model = nn.DataParallel(wrapped.model)
    with pytest.raises(WorkloadError, match="DataParallel"):
        profile_workload(wrapped, device="cpu", repeats=1, warmup_steps=0, progress=None)


# ---- the engine in planned steps: pinning (item 6), event reuse (item 8) --------------------------------
@pytest.mark.parametrize("strategy", ["swap", "hybrid"])
def test_planned_steps_through_the_cuda_engine(monkeypatch, strategy):
    """A model that meets CUDA after apply() gets its pool again, pinned, at the first CUDA copy-out; exact
    gradients; no new CUDA event after the first step."""
    fake = FakeCuda().install(monkeypatch)
    pinned = _pageable_host_memory(monkeypatch)
    monkeypatch.setattr(apply_module, "new_engine", lambda device, pool, link, stats=None: CudaEngine(device, pool))
    w, trace = traced("gpt")
    plan = PLANS[strategy](trace)
    reference = run_and_grads(w)
    events = []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # swaps on a CPU device: the engine is CUDA's here
        handle = regen.apply(w.model, plan)
    with handle:
        assert pinned == [False]  # apply() on a CPU model: pageable
        for _ in range(3):
            assert_same(reference, run_and_grads(w))
            events.append(fake.events_created)
    assert handle.stats.swapped_tensors == 3 * plan.action_counts()["swap"] > 0
    assert pinned == [False, True], "allocated again, pinned, at the first CUDA copy-out"
    assert handle.pool.grow_count == 2 and len(handle.pool.chunks) == 1
    assert events[0] > 0 and events[2] == events[1] == events[0], f"CUDA events created by step: {events}"
    assert fake.unnamed_device_calls == []
    assert_nothing_left(handle, w.model)


class _OddWidths(nn.Module):
    """Activations of 131 x 1001 float32 (524,524 bytes: not a multiple of 512), and few parameters."""

    def __init__(self, depth: int = 8):
        super().__init__()
        self.scales = nn.Parameter(torch.linspace(0.5, 1.5, depth))

    def forward(self, x):
        for s in self.scales:
            x = torch.tanh(x * s)
        return x


def test_the_host_pool_never_grows_in_the_first_step_of_a_swap_plan():
    from plans import profile as fixed_profile  # fixed times: the same plan on a busy machine
    from regen.planner import solve

    torch.manual_seed(0)
    model = _OddWidths(depth=24)
    x = torch.randn(131, 1001)
    w = Workload(name="odd-widths", model=model, batch=(x,), loss_fn=lambda out, batch: out.square().mean())
    profile = fixed_profile(w)
    plan = solve(profile, memory_cap_bytes=int(profile.peak_bytes * 0.9), strategy="swap", time_limit_s=20,
                 link_ratio=0.5)
    swapped = [d.bytes for d in plan.decisions if d.action == "swap"]
    # the rounding of the ranges is more than a pool sized from the raw bytes holds
    assert sum(host_range_bytes(b) for b in swapped) > host_range_bytes(max(sum(swapped), MIN_CHUNK_BYTES))
    assert plan.host_pool_bytes == sum(host_range_bytes(b) for b in swapped)  # all held at the end of forward
    with regen.apply(model, plan, emulate_link=True) as handle:
        for _ in range(2):
            w.loss_fn(model(x), w.batch).backward()
            assert handle.pool.grow_count == 1 and handle.pool.capacity_bytes == plan.host_pool_bytes
    assert handle.stats.swapped_tensors == 2 * len(swapped)


# ---- the dispatch mode in backward (item 8) --------------------------------------------------------------
@pytest.mark.parametrize("strategy", ["recompute", "swap"])
def test_a_loss_outside_the_model_leaves_no_dispatch_mode_for_backward(monkeypatch, strategy):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 64), nn.Tanh(), nn.Linear(64, 8))
    x, y = torch.randn(16, 32), torch.randn(16, 8)
    w = Workload(name="mse", model=model, batch=(x,), loss_fn=lambda out, batch: nn.functional.mse_loss(out, y))
    trace = trace_workload(w)
    assert trace.ops[-1].name == "aten.mse_loss.default"  # the last op: its inputs were packed before it
    plan = PLANS[strategy](trace)
    in_backward = []
    original = ForwardTracker.__torch_dispatch__

    def counting(self, func, types, args=(), kwargs=None):
        if torch._C._current_graph_task_id() != -1:
            in_backward.append(func)
        return original(self, func, types, args, kwargs)

    monkeypatch.setattr(ForwardTracker, "__torch_dispatch__", counting)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        handle = regen.apply(model, plan)
    with handle:
        for _ in range(3):
            loss = nn.functional.mse_loss(model(x), y)
            loss.backward()
            assert handle.tracker not in _get_current_dispatch_mode_stack()
            assert in_backward == [], f"{len(in_backward)} backward ops went through the tracker"
    assert handle.stats.planned_steps == 3
    assert not handle.tracker.closer_pushed
    assert_nothing_left(handle, model)
