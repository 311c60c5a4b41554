"""Dynamic mode held to its cap on architectures it was not tuned on, lengths changing from step to step.

    .venv/bin/python bench/dynamic_heldout.py [--source zoo|heldout] [--models NAME ...] [--cap-fractions 0.6 0.75]

Each architecture of regen.zoo (tiny size) or bench/heldout.py (the Hugging Face architectures regen was not built
around), built from a config at its defaults, batch 4. Token models train on steps of 1/2, 1, 3/4 and 1 of their
sequence length; the others (and a model that takes one length only) repeat their batch. The cap is the model's
parameters and buffers plus a fraction of the unplanned step's peak increase at full length, as torch.profiler's
allocator timeline measures it. Under `regen.apply(model, memory_cap=cap)` the first step is left unmeasured
(dynamic mode records its backward ops' temporaries in it, which no other profiler may run beside); every later
step is measured by the allocator and compared with the same step unplanned from the same state and seeds (torch's,
Python's and NumPy's; the key/value cache off in both, as regen turns it off): loss, gradients and module buffers
bit for bit ("not reproducible" where two unplanned runs of a step differ already). A row flags a step over the
cap + 5% that raised no OverCapWarning ("SILENT"); a cap below what dropping can reach is over with a warning,
which is what dynamic mode promises there. No figure here is a time.
"""

from __future__ import annotations

import argparse
import dataclasses
import random
import sys
import warnings
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import regen  # noqa: E402
from regen.caches import training_caches_off  # noqa: E402
from regen.check import compare_results  # noqa: E402
from regen.errors import WorkloadError  # noqa: E402
from regen.measure import measure_memory  # noqa: E402
from regen.runtime.dynamic import OverCapWarning  # noqa: E402
from regen.runtime.dynamic.cap_memory import model_storages  # noqa: E402
from regen.workloads import Workload, build_workload, training_step  # noqa: E402

TOLERANCE = 0.05
SEED = 1234


def _build(source: str, name: str) -> Workload:
    if source == "zoo":
        return build_workload(f"regen.zoo:{name}", batch_size=4, args={"size": "tiny"})
    return build_workload("bench.heldout:build", batch_size=4, args={"name": name})


def _names(source: str) -> list[str]:
    if source == "zoo":
        from regen.zoo import ZOO

        return list(ZOO)
    from bench.heldout import HELD_OUT

    return list(HELD_OUT)


def _steps(w: Workload) -> list[Workload]:
    """The workload cut to lengths that change from step to step, when its batch is tokens of one length."""
    b = w.batch
    tensors = [v for v in b.values() if torch.is_tensor(v)] if isinstance(b, dict) else []
    if "input_ids" not in (b if isinstance(b, dict) else {}) or any(
            v.dim() < 2 or v.shape[1] != b["input_ids"].shape[1] for v in tensors):
        return [w, w, w]
    full = b["input_ids"].shape[1]
    return [dataclasses.replace(w, batch={k: v[:, :n].contiguous() if torch.is_tensor(v) else v
                                          for k, v in b.items()})
            for n in (full // 2, full, 3 * full // 4, full)]


def _state(w: Workload) -> dict[str, torch.Tensor]:
    return {n: b.detach().clone() for n, b in w.model.named_buffers()}


def _restore(w: Workload, state: dict[str, torch.Tensor]) -> None:
    with torch.no_grad():
        for n, b in w.model.named_buffers():
            b.copy_(state[n])


def _step(w: Workload, measured: bool = False):
    """(loss, gradients, buffers after, allocator peak increase or None) of one step from the same state and
    seeds; the buffers are put back after it."""
    w.model.zero_grad(set_to_none=True)
    before = _state(w)
    torch.manual_seed(SEED)
    random.seed(SEED)
    np.random.seed(SEED)
    box = []
    if measured:
        increase = measure_memory(lambda: box.append(training_step(w))).peak_increase_bytes
    else:
        increase = None
        box.append(training_step(w))
    grads = {n: p.grad.detach().clone() for n, p in w.model.named_parameters() if p.grad is not None}
    after = _state(w)
    _restore(w, before)
    return box[0].detach(), grads, after, increase


def _same(a, b) -> bool:
    """Loss, gradients and buffers bit for bit (`regen check`'s comparison)."""
    differences: list[str] = []
    compare_results(a[:3], b[:3], differences, "")
    return not differences


def run(source: str, name: str, fractions: list[float]) -> list[str]:
    w = _build(source, name)
    steps = _steps(w)
    with training_caches_off(w.model):  # the unplanned references as regen runs the steps
        try:
            for s in steps[:2]:
                _step(s)  # lazy initialisations out of the way
        except WorkloadError:  # a model that takes one length only (Reformer's axial positions)
            steps = [w, w, w]
            _step(w)
        references = [_step(s) for s in steps]
        reproducible = _same(references[1], _step(steps[1]))
        w.model.zero_grad(set_to_none=True)  # as each step begins: parameters and buffers
        start = sum(model_storages(w.model).values())
        increase = _step(steps[1], measured=True)[3]
    rows = []
    for fraction in fractions:
        cap = int(start + fraction * increase)
        peaks, exact, silent = [], True, False
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("ignore")
            warnings.simplefilter("always", OverCapWarning)
            with regen.apply(w.model, memory_cap=cap) as handle:
                _step(steps[0])  # recorded: its own allocator figure warns past the cap
                for s, reference in zip(steps[1:], references[1:]):
                    warned_before = len(caught)
                    got = _step(s, measured=True)
                    peak = (start + got[3]) / cap
                    peaks.append(peak)
                    exact = exact and _same(reference, got)
                    silent = silent or (peak > 1 + TOLERANCE and len(caught) == warned_before)
        result = "exact" if exact else ("differs" if reproducible else "not reproducible")
        flags = (" DIFFERS" if result == "differs" else "") + (" SILENT" if silent else "")
        rows.append(f"| {name} | {fraction:g} | {' '.join(f'{p:.3f}' for p in peaks)} | {len(caught)} | "
                    f"{handle.stats.rebuilds} | {result} |{flags}")
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--source", choices=["zoo", "heldout"], default="zoo")
    parser.add_argument("--models", nargs="+", help="default: every architecture of the source")
    parser.add_argument("--cap-fractions", nargs="+", type=float, default=[0.6, 0.75],
                        help="the cap: the model's memory plus this fraction of the unplanned peak increase")
    args = parser.parse_args()
    names = args.models or _names(args.source)
    print("| architecture | cap fraction | measured steps' peak / cap | OverCapWarnings | rebuilds | result |")
    print("| --- | --- | --- | --- | --- | --- |")
    for name in names:
        try:
            for row in run(args.source, name, args.cap_fractions):
                print(row, flush=True)
        except Exception as exc:  # an architecture that does not build or train here: one line, and on
            print(f"| {name} | - | - | - | - | {type(exc).__name__}: {str(exc)[:80]} |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
