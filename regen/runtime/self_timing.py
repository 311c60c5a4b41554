"""The runtime timing its own work per event on a machine: the probe `regen profile` runs so plans charge it.

A plan's own work is Python, and next to small or fast ops it is a large share of what a recompute
costs. The probe runs the runtime's own code (the dispatch mode, `capture_op`, `replay_recipe`) on tiny
tensors of the profiled device, each timed against the same ops run plainly, and returns
`formats.RuntimeCosts`. Its ops are a mix of the signatures recipes replay (`PROBE_MIX`: a tensor, a size list
and two outputs; two tensors; a bias, two matrices and scalars; keyword arguments),
since the runtime's work per op grows with the op's arguments and outputs:

* `dispatch_op_s`: one forward op's round trip through the `ForwardTracker` (paid by every forward op
  until the last tracked one, on steps of a plan with per-tensor recipes). Given the profiled
  workload's forward (`timed_forward`, as `regen profile` passes it), it is measured there: plain
  forwards and forwards under the tracker, interleaved, the least tracked one less the least plain one
  (the profile's plain steps' forwards among them) per counted op (a real forward's ops, with grad and
  autograd's bookkeeping, cost the mode more than tiny ones do; NOTE [ The workload's dispatch figure ]);
* `capture_op_s`: what a tracked forward op adds: its name checked, its arguments captured, the
  storages it wrote noted;
* `replay_op_s`: one recipe op replayed in backward, beyond the op itself;
* `recipe_s`: one replayed recipe, besides its ops (its tables and the checks of its result);
* `swap_s`: what one swap costs the compute thread whatever its size, through the device's swap engine
  (CUDA streams; on a CPU device the emulated link, at a bandwidth that makes the transfers instant):
  issuing the copy-out, releasing its source once the copy landed, issuing the copy-in, waiting for it
  once landed, with the host range given back. The transfers are left out (waiting for them is the
  simulator's business), and so is what grows with the bytes (the emulated link's memmove on the compute
  thread, copies contending with compute for memory): the calibration charges that per byte
  (Calibration.swap_byte_s). Not left out is what the swaps do to computing around them: the figure is
  the larger of those calls alone (on tiny tensors) and what a swap adds to passes of small matmuls
  (SWAP_PROBE_ROUNDS swaps of SWAP_PROBE_BYTES, each source released and each copy-in waited for one
  SWAP_PROBE_GAP_S of matmuls after it was issued, against the same passes without swaps, interleaved:
  the median difference per swap, less the emulated link's moving of the bytes).

Figures are medians over interleaved repeats of their batches (every figure's batch once per round, so
load that comes and goes hits a round's figures alike), floored at zero, each with its spread; an
unsteady or out-of-bounds figure is measured again and, still out of bounds, charged its default with
a warning (NOTE [ Bounds of the runtime's own costs ] in formats/profile.py). The probe takes about 0.5 s, plus,
when the workload is given, up to FORWARD_PROBE_PAIRS pairs of its forward+backward steps while the next
pair ends within FORWARD_PROBE_BUDGET_S (at least one pair: on a large model, where regen's per-op work
matters least, the probe stays short).
"""

from __future__ import annotations

import functools
import statistics
import time
import warnings
from dataclasses import dataclass
from contextlib import nullcontext
from typing import Callable, ContextManager, Sequence

import torch

from regen.formats.profile import RUNTIME_COST_BOUNDS_S, RUNTIME_COST_DEFAULTS_S, RuntimeCosts
from regen.opinfo import op_name, op_outputs, storage_key, written_outputs
from regen.runtime.recompute import capture_op, check_captured_name, replay_recipe
from regen.runtime.tracker import STAGE_COUNTING, ForwardTracker
from regen.runtime.writers import Writer

PROBE_OPS = 200  # ops per timed batch
PROBE_REPEATS = 5
METHOD = ("probe of regen.runtime's dispatch mode, capture, replay and swap calls on tiny tensors, a mix of op "
          "signatures (regen.runtime.self_timing)")
_aten = torch.ops.aten
# (op, its arguments given the previous op's output y and a square matrix x, keyword arguments): each op's
# first output is the next op's input
# (layer norm or softmax would fit too, but their kernels go parallel even on tiny inputs: too noisy)
PROBE_MIX = (
    (_aten.var_mean.correction, lambda y, x: (y, [1]), {"correction": 1, "keepdim": True}),
    (_aten.add.Tensor, lambda y, x: (y, x), {}),
    (_aten.addmm.default, lambda y, x: (x[0], y, x), {"beta": 1, "alpha": 1}),
    (_aten.gelu.default, lambda y, x: (y,), {"approximate": "tanh"}),
)
RECIPE_LENGTH = len(PROBE_MIX)  # ops per recipe in the recipe_s probe: the mix once
SWAP_PROBE_SWAPS = 20  # swaps per timed batch...
SWAP_PROBE_NUMEL = 16  # ... of tensors this small: the calls, not the bytes
SWAP_PROBE_ROUNDS = 16  # swaps per pass of the interleaved probe...
SWAP_PROBE_BYTES = 64 * 1024  # ... of this many bytes (few: what a swap costs per byte is the calibration's)...
SWAP_PROBE_MATMUL = 256  # ... between square matmuls of this size...
SWAP_PROBE_GAP_S = 0.5e-3  # ... as many as take this long, twice between swaps (ops between a step's swaps)
SWAP_PROBE_PASSES = 5  # timed pairs of passes (with and without swaps), after one untimed pair
MATMULS_PER_BATCH = 20  # matmuls per timed batch when sizing the gap
FORWARD_PROBE_PAIRS = 3  # plain and tracked forwards of the workload, interleaved, at most...
FORWARD_PROBE_BUDGET_S = 1.0  # ... while the next pair ends within this (a large model's steps: one pair)
WORKLOAD_METHOD = "; dispatch measured on the profiled workload's forward"


def measure_runtime_costs(device: torch.device,
                          timed_forward: Callable[[ContextManager], float] | None = None,
                          plain_forward_times_s: Sequence[float] = ()) -> RuntimeCosts:
    """The runtime's per-event costs on `device` (see the module doc). `timed_forward(context)`: one
    training step of the profiled workload with `context` entered around its forward; returns the
    forward's seconds; `plain_forward_times_s`: the workload's plain forwards timed before (the profile's
    plain steps'), more plain readings for the dispatch figure. Each figure is the median of interleaved
    repeats; a figure whose repeats spread more than MAX_SPREAD, or that is out of its bound
    (formats.profile.RUNTIME_COST_BOUNDS_S), is measured again, up to PROBE_ATTEMPTS times, keeping its
    steadiest reading; one still out of bounds falls back to its default with a note (NOTE [ Bounds of the
    runtime's own costs ])."""
    # the workload's steps first, right after the profile's last plain step (NOTE [ The workload's dispatch
    # figure ]); they are the costly part: timed once, and checked against the tiny tensors' figure below
    on_workload = _dispatch_on_workload(timed_forward, plain_forward_times_s) if timed_forward is not None else None
    readings: dict[str, Reading] = {}
    # the ops' figures and the swap's are measured apart, so only an unsettled group is measured again
    pending: dict[str, Callable[[], dict[str, Reading]]] = {
        "ops": lambda: _op_readings(device), "swap": lambda: {"swap_s": _swap_reading(device)}}
    for _ in range(PROBE_ATTEMPTS):
        unsettled = {}
        for group, measure in pending.items():
            fresh = measure()
            for name, r in fresh.items():
                readings[name] = _steadier(name, readings.get(name), r)
            if not all(readings[name].settled(name) for name in fresh):
                unsettled[group] = measure
        pending = unsettled
        if not pending:
            break
    method, notes = METHOD, []
    if on_workload is not None and on_workload.value_s <= _workload_dispatch_bound_s(readings["dispatch_op_s"]):
        readings["dispatch_op_s"], method = on_workload, METHOD + WORKLOAD_METHOD
    elif on_workload is not None:
        notes.append(f"dispatch_op_s: the workload's forward read {on_workload.value_s:.3g} s per op, over "
                     f"{WORKLOAD_DISPATCH_RATIO:g} x the tiny tensors' {readings['dispatch_op_s'].value_s:.3g} s (a "
                     f"burst of load?): charged the tiny tensors' figure")
    return _settled_costs(readings, method, notes)


# NOTE [ The workload's dispatch figure ]
# What the tracker adds to a forward is a few percent of it (a zoo decoder at bench size: 2.5 ms of 23 ms, about
# 6 us an op), and a forward that comes first after other work (the probes before, a phase change) runs up to 15%
# slower than the settled ones: as slow as the tracker makes it. A figure from the median of pair differences then
# read 0 (floored) in one of three profiles of a zoo Mistral, where blocks of forwards read 5-7 us an op every time.
# Load and cold caches only add time, so each side's least forward is its steadiest reading: the least tracked
# forward less the least plain one, the plain ones including the profile's plain steps (settled, spread over its
# phases), which also makes one pair enough on a large model. A tracked forward that came first after other work
# reads high, never low: a recipe is then charged more, not less, than it costs. So the probe times the workload
# first, right after the profile's last plain step (no other work between), and with the profile's plain
# forwards given its first tracked forward needs no plain one before it, and no pair starts that would end past the
# budget: a 32-layer decoder is then timed under the tracker once (0.47 s), where it took two pairs (1.83 s).

# NOTE [ The workload's dispatch figure against the tiny tensors' ]
# On the workload's own forward the dispatch mode costs more per op than on tiny tensors without grad
# (autograd's bookkeeping, larger argument lists): a few times more, not orders of magnitude. A workload
# reading above WORKLOAD_DISPATCH_RATIO x the tiny tensors' figure (plus WORKLOAD_DISPATCH_SLACK_S) is a
# burst of load on the few forwards it timed, and the tiny tensors' figure is charged instead.
WORKLOAD_DISPATCH_RATIO = 8.0
WORKLOAD_DISPATCH_SLACK_S = 20e-6


def _workload_dispatch_bound_s(tiny: "Reading") -> float:
    return WORKLOAD_DISPATCH_RATIO * tiny.value_s + WORKLOAD_DISPATCH_SLACK_S


PROBE_ATTEMPTS = 3  # measurements of the whole probe at most, while a figure is unsettled
MAX_SPREAD = 0.5  # a figure whose repeats spread more than this (relative interquartile range) is measured again


@dataclass
class Reading:
    """One figure of the probe: the median of its repeats (seconds) and their relative spread."""

    value_s: float
    spread: float

    @staticmethod
    def of(name: str, samples_s: list[float]) -> "Reading":
        """The reading of figure `name`; its spread is relative to the median, or to the figure's default when
        the median is smaller (a figure near zero, a difference of two timings, is steady enough when its
        repeats agree to within a fraction of what such a figure usually is)."""
        median = statistics.median(samples_s)
        if len(samples_s) < 3:
            return Reading(max(0.0, median), 0.0)
        q1, _, q3 = statistics.quantiles(samples_s, n=4)
        return Reading(max(0.0, median), (q3 - q1) / max(abs(median), RUNTIME_COST_DEFAULTS_S[name]))

    def in_bounds(self, name: str) -> bool:
        return self.value_s <= RUNTIME_COST_BOUNDS_S[name]

    def settled(self, name: str) -> bool:
        return self.in_bounds(name) and self.spread <= MAX_SPREAD


def _steadier(name: str, old: "Reading | None", new: Reading) -> Reading:
    """Of two readings of figure `name`, one in bounds before one out of bounds, then the lesser spread."""
    if old is None:
        return new
    return min(old, new, key=lambda r: (not r.in_bounds(name), r.spread))


def _settled_costs(readings: dict[str, Reading], method: str, notes: list[str]) -> RuntimeCosts:
    """The RuntimeCosts of the readings: a figure out of bounds is its default, with a note."""
    figures = {}
    for name, r in readings.items():
        if r.in_bounds(name):
            figures[name] = r.value_s
            continue
        figures[name] = RUNTIME_COST_DEFAULTS_S[name]
        notes.append(f"{name}: read {r.value_s:.3g} s (spread {r.spread:.0%}) over {PROBE_ATTEMPTS} probes, above "
                     f"its bound {RUNTIME_COST_BOUNDS_S[name]:.3g} s (a busy machine?): charged its default "
                     f"{RUNTIME_COST_DEFAULTS_S[name]:.3g} s")
        warnings.warn(f"regen profile: {notes[-1]}", RuntimeWarning, stacklevel=3)
    return RuntimeCosts(**figures, method=method, spreads={name: round(r.spread, 3) for name, r in readings.items()},
                        notes=notes)


def _op_readings(device: torch.device) -> dict[str, Reading]:
    """dispatch, capture, replay and recipe figures from interleaved repeats of their batches."""
    x = torch.ones(4, 4, device=device)
    sync = functools.partial(_sync, device)
    chains = PROBE_OPS // RECIPE_LENGTH
    batches = {"plain": (lambda: _plain(x, PROBE_OPS), PROBE_OPS), "tracked": (lambda: _tracked(x), PROBE_OPS),
               "captured": (lambda: _captured(x), PROBE_OPS),
               "long": (lambda: _replays(x, chains, RECIPE_LENGTH), chains),
               "short": (lambda: _replays(x, PROBE_OPS, 1), PROBE_OPS)}
    per_unit = _interleaved_per_unit(batches, sync)
    samples: dict[str, list[float]] = {"dispatch_op_s": [], "capture_op_s": [], "replay_op_s": [], "recipe_s": []}
    for t in per_unit:
        replay_s = (t["long"] - t["short"]) / (RECIPE_LENGTH - 1) - t["plain"]
        samples["dispatch_op_s"].append(t["tracked"] - t["plain"])
        samples["capture_op_s"].append(t["captured"] - t["plain"])
        samples["replay_op_s"].append(replay_s)
        samples["recipe_s"].append(t["short"] - replay_s - t["plain"])
    return {name: Reading.of(name, values) for name, values in samples.items()}


def _interleaved_per_unit(batches: dict, sync: Callable[[], None]) -> list[dict[str, float]]:
    """PROBE_REPEATS rounds of every batch in turn (after one untimed round): seconds per unit of each,
    per round, so that load that comes and goes hits every figure of a round alike."""
    rounds = []
    for k in range(PROBE_REPEATS + 1):
        times = {}
        for name, (batch, units) in batches.items():
            sync()
            t0 = time.perf_counter()
            batch()
            sync()
            times[name] = (time.perf_counter() - t0) / units
        if k:
            rounds.append(times)
    return rounds


def _swap_reading(device: torch.device) -> Reading:
    """What one swap costs the compute thread: the larger of its engine calls alone and what it adds next to
    compute (see the module doc)."""
    from regen.runtime.stats import RuntimeStats
    from regen.runtime.swap import HostPool, new_engine

    instant_link = (1e15, 1e15)  # bytes/s: every copy is due as soon as it is issued
    pool = HostPool(0)
    stats = RuntimeStats()  # an emulated link's memmoves, left out of the figure (CUDA engines count none)
    engine = new_engine(device, pool, instant_link, stats)
    tensors = [torch.ones(SWAP_PROBE_NUMEL, device=device) for _ in range(SWAP_PROBE_SWAPS)]
    try:
        per_swap_s = [_swap_batch_s(engine, pool, tensors, stats) / len(tensors)
                      for _ in range(PROBE_REPEATS + 1)][1:]
        computing_s = _swap_next_to_compute_s(engine, pool, stats)
    finally:
        engine.close()
    calls, computing = Reading.of("swap_s", per_swap_s), Reading.of("swap_s", computing_s)
    return calls if calls.value_s >= computing.value_s else computing


def _swap_next_to_compute_s(engine, pool, stats) -> list[float]:
    """Seconds one swap adds to a pass of matmuls, per pair of passes (with swaps against without, interleaved)."""
    device = engine.device
    a = torch.randn(SWAP_PROBE_MATMUL, SWAP_PROBE_MATMUL, device=device)
    sources = [torch.ones(SWAP_PROBE_BYTES // 4, device=device) for _ in range(SWAP_PROBE_ROUNDS)]
    n = _matmuls_per_gap(a)
    added_s = []
    for k in range(SWAP_PROBE_PASSES + 1):
        plain_s = _matmul_pass_s(engine, pool, a, [], n, stats)
        swapping_s = _matmul_pass_s(engine, pool, a, sources, n, stats)
        if k:
            added_s.append((swapping_s - plain_s) / len(sources))
    return added_s


def _matmuls_per_gap(a: torch.Tensor) -> int:
    """How many `a @ a` take SWAP_PROBE_GAP_S on this device (at least 1)."""
    sync = functools.partial(_sync, a.device)
    matmul_s = _per_unit(lambda: _matmuls(a, MATMULS_PER_BATCH), sync, MATMULS_PER_BATCH)
    return max(1, round(SWAP_PROBE_GAP_S / max(1e-9, matmul_s)))


def _matmul_pass_s(engine, pool, a: torch.Tensor, sources: list[torch.Tensor], n: int, stats) -> float:
    """Seconds of 4 x `n` matmuls per source (SWAP_PROBE_ROUNDS of them without sources), each source swapped
    out in the first half, its source released 2n matmuls later, and back in the second half, waited for 2n
    matmuls later, as a step's swaps are."""
    rounds = len(sources) or SWAP_PROBE_ROUNDS
    _sync(a.device)
    t0, moved0_s = time.perf_counter(), stats.link_copy_cpu_s
    outs, ins = [], []
    for k in range(rounds):
        if sources:
            outs.append(engine.copy_out(sources[k]))
        _matmuls(a, 2 * n)
        if sources:
            engine.release_source(outs[k])
    for k in range(rounds):
        if sources:
            ins.append(engine.copy_in(outs[k]))
        _matmuls(a, 2 * n)
        if sources:
            _retire(engine, pool, ins[k], outs[k])
    _sync(a.device)
    return time.perf_counter() - t0 - (stats.link_copy_cpu_s - moved0_s)


def _matmuls(a: torch.Tensor, n: int) -> None:
    for _ in range(n):
        a @ a


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _retire(engine, pool, cin, out) -> None:
    """A swap's end: its copy-in waited for and dropped, its host range given back."""
    engine.wait_copy_in(cin)
    engine.drop_copy_in(cin)
    pool.release(out.slot)
    engine.retire(out)


def _swap_batch_s(engine, pool, tensors: list[torch.Tensor], stats) -> float:
    """Compute-thread seconds of swapping `tensors` out and back in, each phase timed after the copies of
    the one before have landed (an emulated link's moving of the bytes left out)."""
    moved0_s = stats.link_copy_cpu_s
    t0 = time.perf_counter()
    outs = [engine.copy_out(t) for t in tensors]
    spent_s = time.perf_counter() - t0
    _landed(engine, [o.done_event for o in outs])
    t0 = time.perf_counter()
    for out in outs:
        engine.release_source(out)
    ins = [engine.copy_in(out) for out in outs]
    spent_s += time.perf_counter() - t0
    _landed(engine, [c.done_event for c in ins])
    t0 = time.perf_counter()
    for cin, out in zip(ins, outs):
        _retire(engine, pool, cin, out)
    return spent_s + time.perf_counter() - t0 - (stats.link_copy_cpu_s - moved0_s)


def _landed(engine, events) -> None:
    """Wait, untimed, until every copy of `events` has landed (the bytes an emulated link moves then are
    counted in its stats, so the timed phases can leave them out)."""
    if engine.device.type == "cuda":
        _sync(engine.device)
    else:
        engine.wait_landed(events)


def _dispatch_on_workload(timed_forward: Callable[[ContextManager], float],
                          plain_forward_times_s: Sequence[float] = ()) -> "Reading | None":
    """Seconds the tracker adds per counted forward op of the workload (NOTE [ The workload's dispatch
    figure ]): pairs of forwards, plain then under the tracker, up to FORWARD_PROBE_PAIRS while the next one
    ends within FORWARD_PROBE_BUDGET_S (one at least; the first pair's plain forward is the profile's last plain
    step when `plain_forward_times_s` are given); the least tracked forward less the least plain one, these
    pairs' and `plain_forward_times_s` (the profile's plain steps' forwards), per op. None if it counted none."""
    tracker = ForwardTracker()
    step = tracker.step = _ProbeStep()
    plain_s, tracked_s = list(plain_forward_times_s), []
    forwards, t0 = 0, time.perf_counter()
    while len(tracked_s) < FORWARD_PROBE_PAIRS and (not tracked_s or _another_pair_fits(t0, forwards)):
        if tracked_s or not plain_forward_times_s:  # the first pair's plain forward: the profile's last step
            plain_s.append(timed_forward(nullcontext()))
        step.count = 0
        tracked_s.append(timed_forward(tracker))
        forwards = len(tracked_s) + len(plain_s) - len(plain_forward_times_s)
        if not step.count:
            return None
    least_plain_s = min(plain_s)
    added_s = [(t - least_plain_s) / step.count for t in tracked_s]
    spread = Reading.of("dispatch_op_s", added_s).spread
    return Reading(max(0.0, min(added_s)), spread)


def _another_pair_fits(t0: float, forwards: int) -> bool:
    """Whether one more pair of forwards, each as long as the `forwards` so far took on average, ends within
    FORWARD_PROBE_BUDGET_S of `t0` (a model whose forward+backward takes a third of the budget or more is timed
    under the tracker once)."""
    spent_s = time.perf_counter() - t0
    return spent_s + 2 * spent_s / forwards <= FORWARD_PROBE_BUDGET_S


def _per_unit(batch: Callable[[], None], sync: Callable[[], None], units: int) -> float:
    """Median seconds per unit of `batch`, after one untimed run."""
    batch()
    sync()
    samples = []
    for _ in range(PROBE_REPEATS):
        t0 = time.perf_counter()
        batch()
        sync()
        samples.append((time.perf_counter() - t0) / units)
    return statistics.median(samples)


def _first_output(out) -> torch.Tensor:
    return out[0] if isinstance(out, tuple) else out


def _plain(x: torch.Tensor, n: int) -> None:
    y = x
    with torch.no_grad():
        for k in range(n):
            func, args, kwargs = PROBE_MIX[k % RECIPE_LENGTH]
            y = _first_output(func(*args(y, x), **kwargs))


class _ProbeStep:
    """The part of a step the tracker talks to: a forward that counts each op and runs it."""

    stage = STAGE_COUNTING

    def __init__(self):
        self.count = 0

    def forward_op(self, func, args, kwargs):
        self.count += 1
        return func(*args, **kwargs)


def _tracked(x: torch.Tensor) -> None:
    tracker = ForwardTracker()
    tracker.step = _ProbeStep()
    with torch.no_grad(), tracker:
        _plain(x, PROBE_OPS)


def _captured(x: torch.Tensor) -> None:
    """What `ForwardOps._tracked_op` does around a recipe op that is also a producer."""
    writer = {storage_key(x): Writer.of(-1, 0, x)}
    y = x
    with torch.no_grad():
        for idx in range(PROBE_OPS):
            func, make_args, kwargs = PROBE_MIX[idx % RECIPE_LENGTH]
            args = make_args(y, x)
            if check_captured_name(idx, func, op_name(func)):
                raise AssertionError("the probe captured another op than it ran")
            capture_op(idx, func, args, kwargs, writer, False)
            out = func(*args, **kwargs)
            outs = op_outputs(func, args, kwargs, out)
            for slot, key in written_outputs(func, args, kwargs, outs):
                writer[key] = Writer.of(idx, slot, outs[slot])
            y = outs[0]


def _replays(x: torch.Tensor, recipes: int, length: int) -> None:
    """Replay `recipes` recipes of `length` ops of the mix, each op reading the one before it (the first,
    the recipe input) and the recipe input; recipes of one op go round the mix."""
    writer = {storage_key(x): Writer.of(-1, 0, x)}
    captures, shapes = {}, []
    with torch.no_grad():
        y = x
        for idx in range(RECIPE_LENGTH):
            func, make_args, kwargs = PROBE_MIX[idx]
            args = make_args(y, x)
            captures[idx] = capture_op(idx, func, args, kwargs, writer, False)
            y = _first_output(func(*args, **kwargs))
            writer[storage_key(y)] = Writer.of(idx, 0, y)
            shapes.append(y.shape)
    for k in range(recipes):
        first = 0 if length == RECIPE_LENGTH else k % RECIPE_LENGTH
        last = first + length - 1
        replay_recipe((last, 0), list(range(first, last + 1)), captures, lambda key: x, shapes[last], x.dtype)
