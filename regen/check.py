"""`regen check`: trust a plan only after seeing it give the same result on your model.

Builds the workload twice from one state (weights and buffers copied), runs one step of each unplanned (a
model's first step may differ from its later ones, as the profile's warm-up step lets it: docs/limitations.md
"Plan mismatch"), then unplanned and planned training steps on the same batch from the same RNG states
(torch's, Python's and NumPy's: a forward may draw a mask from `np.random`), one of each in turn
(`compared_steps`, 1 by default: the step the handle verifies; from the second on, later steps' pack-order
fast path), and compares the loss, every gradient and every module buffer (BatchNorm running statistics,
counters) bit for bit. Both run training steps as regen runs them: with the models' key/value caches off
(regen.caches, as Hugging Face's Trainer and its gradient checkpointing run them; a model whose cache changes
its numbers, such as Mamba2's, would otherwise differ from its plan by what the cache changes, not by what the
plan does). Then it times a few more steps of each, interleaved so machine noise hits both alike, and measures
each step's peak with the allocator (regen.measure). What users of other offloading tools were burned by
(stream races that give silent NaN gradients, wrong recomputed metadata, statistics updated twice) is what
this catches: any difference, or a measured peak over the cap, is a failed check.

A difference is only the plan's when the model itself is reproducible: one that draws randomness the seeds
above do not fix (`torch.seed()`, which reseeds from the operating system: Hugging Face's Reformer does, in
every training forward; its own generator; os.urandom) differs from itself. So when the planned steps differ,
a third copy from the same starting state runs the same unplanned steps, and what it gives differently from
the first is the report's `unreproducible`: then the check is inconclusive, not failed (bit-for-bit equality
cannot judge such a model), and says so.
"""

from __future__ import annotations

import random
import statistics
import sys
import time
from dataclasses import dataclass, field
from typing import Callable

import torch

from regen.formats.plan import Plan

CHECK_SEED = 1234
CAP_TOLERANCE = 1.05  # a measured planned peak up to 5% over the cap still counts as within it
DEFAULT_TIMED_STEPS = 3


@dataclass
class CheckReport:
    """What `regen check` compared and measured."""

    differences: list[str] = field(default_factory=list)  # "loss", "gradient of fc.weight", "buffer bn.running_mean"
    # when there are differences: what a second unplanned run from the same state and seeds gave differently
    # from the first (the model is not reproducible; see the module doc); empty when it gave the same
    unreproducible: list[str] = field(default_factory=list)
    compared_tensors: int = 0
    unplanned_peak_bytes: int = 0  # on the plan's absolute scale (memory at start + measured increase)
    planned_peak_bytes: int = 0
    cap_bytes: int = 0
    unplanned_step_s: float = 0.0
    planned_step_s: float = 0.0
    planned_steps: int = 0  # steps the handle ran under the plan (a check raises on any other)
    predicted_step_s: float = 0.0  # the plan's simulated step time
    baseline_step_s: float = 0.0  # the profile's unplanned step time, on the same scale as predicted

    @property
    def within_cap(self) -> bool:
        return self.planned_peak_bytes <= self.cap_bytes * CAP_TOLERANCE

    @property
    def passed(self) -> bool:
        return not self.differences and self.within_cap

    @property
    def conclusive(self) -> bool:
        """Bit-for-bit comparison could judge the plan: the unplanned model reproduced its own results."""
        return not self.unreproducible


def check_plan(build: Callable[[], object], plan: Plan, timed_steps: int = DEFAULT_TIMED_STEPS,
               progress: Callable[[str], None] = lambda _m: None, compared_steps: int = 1) -> CheckReport:
    """`build()` returns a fresh regen Workload; the plan is applied to the second one built. Differences
    of the k-th compared step (from 0) after the first are named "step k: ..."."""
    report = CheckReport(cap_bytes=plan.memory_cap_bytes, predicted_step_s=plan.simulated.step_time_s,
                         baseline_step_s=plan.baseline.step_time_s)
    # a check of the plan: never a dynamic step
    return _check(build, {"plan": plan, "on_mismatch": "raise"}, lambda _model: plan.memory_at_start_bytes,
                  lambda stats: stats.planned_steps, "planned", report, timed_steps, progress, compared_steps)


def check_dynamic(build: Callable[[], object], memory_cap_bytes: int, timed_steps: int = DEFAULT_TIMED_STEPS,
                  progress: Callable[[str], None] = lambda _m: None, compared_steps: int = 1) -> CheckReport:
    """`check_plan` for dynamic mode (`regen.apply(model, memory_cap=...)`, no plan): the second workload built
    trains under `memory_cap_bytes`, which counts from its parameters and buffers (dynamic mode's start, as
    regen.runtime.dynamic counts it on CPU); `planned_steps` are the steps it ran in dynamic mode."""
    from regen.runtime.dynamic.cap_memory import model_storages

    return _check(build, {"memory_cap": memory_cap_bytes}, lambda model: sum(model_storages(model).values()),
                  lambda stats: stats.steps, "dynamic", CheckReport(cap_bytes=memory_cap_bytes), timed_steps, progress,
                  compared_steps)


def _check(build: Callable[[], object], apply_kwargs: dict, start_bytes: Callable, steps_run: Callable, kind: str,
           report: CheckReport, timed_steps: int, progress: Callable[[str], None], compared_steps: int) -> CheckReport:
    """Both checks: the second workload built runs under `regen.apply(model, **apply_kwargs)`, its start on the
    cap's scale `start_bytes(model)`, the steps it ran under the handle `steps_run(handle.stats)`."""
    from regen.caches import training_caches_off
    from regen.runtime import apply

    plain, under = build(), build()
    # on the host: a third copy may need it (_unreproducible), and the device holds two models already
    initial_state = {name: t.detach().to("cpu", copy=True) for name, t in plain.model.state_dict().items()}
    under.model.load_state_dict(initial_state)
    plain_steps = []
    with training_caches_off(plain.model):  # as the handle turns the other model's off
        _one_step(plain)  # the first step of each, unplanned, as the profile's warm-up ran it (module doc)
        with training_caches_off(under.model):
            _one_step(under)
        with apply(under.model, **apply_kwargs) as handle:
            progress(f"{compared_steps} unplanned and {kind} step(s) from the same state and RNG seeds")
            for k in range(compared_steps):
                plain_steps.append(_compare_one_step(plain, under, report, _step_label(k)))
            progress(f"timing {timed_steps} steps of each, interleaved, and measuring their peaks")
            _time_and_measure(plain, under, start_bytes(under.model), timed_steps, report)
            report.planned_steps = steps_run(handle.stats)
    if report.differences:
        progress("the steps differ: is the unplanned model reproducible? the same unplanned steps on a third copy")
        report.unreproducible = _unreproducible(build, initial_state, plain_steps)
    return report


def _step_label(k: int) -> str:
    """How a difference of the k-th compared step (from 0) is named."""
    return "" if k == 0 else f"step {k}: "


def _unreproducible(build: Callable[[], object], initial_state: dict, plain_steps: list) -> list[str]:
    """What a third copy of the workload, from `initial_state`, gives differently from the unplanned steps
    `plain_steps` (their (loss, gradients, buffers)) over the same steps and seeds."""
    from regen.caches import training_caches_off

    again = build()
    again.model.load_state_dict(initial_state)
    differences: list[str] = []
    with training_caches_off(again.model):
        _one_step(again)  # its first step, as the others ran it
        for k, first in enumerate(plain_steps):
            compare_results(first, _one_step(again), differences, _step_label(k))
    return differences


def _one_step(workload) -> tuple[torch.Tensor, dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    from regen.workloads import training_step

    torch.manual_seed(CHECK_SEED)
    random.seed(CHECK_SEED)
    if "numpy" in sys.modules:  # a forward drawing from NumPy imported it already
        sys.modules["numpy"].random.seed(CHECK_SEED)
    loss = training_step(workload)
    model = workload.model
    grads = {name: p.grad.detach().clone() for name, p in model.named_parameters() if p.grad is not None}
    buffers = {name: b.detach().clone() for name, b in model.named_buffers()}
    model.zero_grad(set_to_none=True)
    return loss, grads, buffers


def _compare_one_step(plain, planned, report: CheckReport, label: str = "") -> tuple:
    """One step of each from the same seeds, compared into `report`; the unplanned step's results."""
    first = _one_step(plain)
    report.compared_tensors += compare_results(first, _one_step(planned), report.differences, label)
    return first


def compare_results(first: tuple, second: tuple, differences: list[str], label: str) -> int:
    """Two steps' (loss, gradients, buffers) compared bit for bit, what differs appended to `differences`;
    the number of tensors compared."""
    (loss_a, grads_a, buffers_a), (loss_b, grads_b, buffers_b) = first, second
    pairs = [("loss", loss_a, loss_b)]
    pairs += [(f"gradient of {n}", grads_a.get(n), grads_b.get(n)) for n in sorted(grads_a.keys() | grads_b.keys())]
    pairs += [(f"buffer {n}", buffers_a.get(n), buffers_b.get(n)) for n in sorted(buffers_a.keys() | buffers_b.keys())]
    for what, a, b in pairs:
        if a is None or b is None or a.shape != b.shape or a.dtype != b.dtype or not torch.equal(a, b):
            differences.append(label + what + _how_far(a, b))
    return len(pairs)


def _how_far(a: torch.Tensor | None, b: torch.Tensor | None) -> str:
    if a is None or b is None:
        return " (present in one run only)"
    if a.shape != b.shape or a.dtype != b.dtype:
        return f" ({tuple(a.shape)} {a.dtype} vs {tuple(b.shape)} {b.dtype})"
    if not a.is_floating_point():
        return " (values differ)"
    return f" (max |difference| {float((a.double() - b.double()).abs().max()):.3g})"


def _time_and_measure(plain, planned, start_bytes: int, timed_steps: int, report: CheckReport) -> None:
    """Median step times of both, interleaved, and each one's peak measured by the allocator: on CPU
    `start_bytes` (the memory at the step's start that the cap counts) plus the measured increase."""
    from regen.measure import measure_memory
    from regen.workloads import training_step

    def step_s(workload) -> float:
        start = time.perf_counter()
        training_step(workload)
        elapsed = time.perf_counter() - start
        workload.model.zero_grad(set_to_none=True)
        return elapsed

    times = {"unplanned": [], "planned": []}
    for _ in range(max(1, timed_steps)):
        times["unplanned"].append(step_s(plain))
        times["planned"].append(step_s(planned))
    report.unplanned_step_s = statistics.median(times["unplanned"])
    report.planned_step_s = statistics.median(times["planned"])
    device = next(plain.model.parameters()).device
    start = start_bytes if device.type == "cpu" else 0  # CUDA counts everything already
    for name, workload in (("unplanned", plain), ("planned", planned)):
        measured = measure_memory(lambda w=workload: training_step(w), device)
        workload.model.zero_grad(set_to_none=True)
        peak = start + (measured.peak_increase_bytes if device.type == "cpu" else measured.peak_bytes)
        setattr(report, f"{name}_peak_bytes", peak)


def report_lines(report: CheckReport) -> list[str]:
    """The table `regen check` prints."""
    from regen.units import format_bytes

    result = "same" if not report.differences else f"{len(report.differences)} DIFFER"
    lines = [
        f"  results      loss, gradients and buffers: {report.compared_tensors} tensors compared bit for bit, "
        f"{result}",
    ]
    lines += [f"               {d}" for d in report.differences[:10]]
    if not report.conclusive:
        lines += [f"               but the unplanned model does not reproduce itself: a second unplanned run from the "
                  f"same state and seeds differs from the first in {len(report.unreproducible)} "
                  f"({', '.join(report.unreproducible[:3])}); it draws randomness the seeds do not fix (torch.seed(), "
                  f"a generator of its own), so bit-for-bit comparison cannot judge the plan"]
    verdict = "PASS" if report.passed else ("FAIL" if report.conclusive else "INCONCLUSIVE")
    lines += [
        f"  peak memory  unplanned {format_bytes(report.unplanned_peak_bytes)}, planned "
        f"{format_bytes(report.planned_peak_bytes)} (measured by the allocator); cap "
        f"{format_bytes(report.cap_bytes)}: {'within' if report.within_cap else 'OVER'}",
        f"  step time    measured: planned {report.planned_step_s / report.unplanned_step_s:.2f}x of unplanned "
        f"({report.planned_step_s * 1e3:.1f} vs {report.unplanned_step_s * 1e3:.1f} ms); predicted by the plan: "
        f"{report.predicted_step_s / report.baseline_step_s:.2f}x",
        f"  verdict      {verdict}",
    ]
    return lines
