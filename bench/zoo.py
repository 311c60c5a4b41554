"""regen on the architecture zoo at users' defaults, against the checkpointing its users turn on.

Every architecture of regen.zoo (transformers models from configs, defaults as shipped) at bench size (4
layers, width 192; `--size tiny` for a quick look), one after the other, in one run. Per architecture:

* the profile, as `regen profile` takes it (warm-up, 3 repeats, the runtime's cost probe);
* no plan, and the checkpointing users turn on (regen.zoo.enable_checkpointing: Hugging Face's
  `gradient_checkpointing_enable()`, non-reentrant, or `torch.utils.checkpoint` around each block where the
  model has none): peak memory measured by the allocator, put on regen's scale (the profile's memory at the
  start plus the measured increase), and step time;
* regen's smallest cap (recompute only): where regen goes at the least, next to checkpointing's peak;
* regen recompute and hybrid plans at checkpointing's measured peak and at 50% of the unplanned peak (or at
  the smallest cap a strategy reaches, when 50% is below it), their swaps over an emulated host link at
  R = 0.9 (`regen.apply(..., emulate_link=True)`: copies on the link's clock, real stalls), each measured (peak, step
  time) next to the plan's predicted step time.

Step times are medians of the timed steps, taken round-robin over the variants of one architecture (one
step of each in turn), with compute on one core fewer than the machine's (at most 2), as bench/compare.py
runs its link rows, and freed host memory kept in the heap (regen.heap.keep_freed_host_memory: otherwise a
step's page faults depend on the step before it). Checkpointing is timed twice, on two models, in the same
rounds: how far the two measure apart is the run's noise, and the summary counts recompute against
checkpointing both strictly and within that noise. Time only on a quiet machine.

    python bench/zoo.py                       # every architecture; writes the zoo table into docs/benchmarks.md
    python bench/zoo.py --models llama t5 --no-write
    python bench/zoo.py --heldout gemma3 mbart --batch-size 16   # architectures regen was not built around

`--heldout` takes architectures of bench/heldout.py instead (tiny configs, defaults as shipped): the same
rows, predictions against measured steps included, on models outside the zoo; it prints and writes nothing.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import re
import statistics
import sys
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from compare import (PROFILE_WARMUP_S, SOLVE_TIME_LIMIT_S, WARMUP_STEPS, ZOO_BEGIN, ZOO_END, Variant,  # noqa: E402
                     _measured, _planned, build, machine, time_round_robin)
from regen.errors import InfeasibleCapError, SolverError  # noqa: E402
from regen.heap import keep_freed_host_memory  # noqa: E402
from regen.zoo import ZOO, enable_checkpointing  # noqa: E402

LINK_RATIO = 0.9
CHECKPOINTING_AGAIN = "checkpointing, again"
LOW_CAP_FRACTION = 0.5
HELD_OUT_PREFIX = "heldout:"
TIMED_STEPS = 7
BATCH_SIZE = 4


@dataclass
class Row:
    """One variant of one architecture."""

    variant: str
    peak_bytes: int
    step_time_s: float
    cap_bytes: int | None = None
    predicted_step_time_s: float | None = None
    note: str = ""


@dataclass
class ArchResult:
    name: str
    unplanned_peak_bytes: int
    smallest_cap_bytes: int | None
    checkpointing: str  # which checkpointing the peer is
    rows: list[Row] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)  # plans the solver found none for in its time limit
    calibration: dict | None = None  # the profile's (formats.Calibration), None when not calibrated

    def row(self, variant: str) -> Row | None:
        return next((r for r in self.rows if r.variant == variant), None)


def load_result(doc: dict) -> ArchResult:
    """An ArchResult from its JSON (`--json`)."""
    rows = [Row(**r) for r in doc.pop("rows")]
    return ArchResult(**doc, rows=rows)


def spec_of(name: str, size: str, batch_size: int = BATCH_SIZE) -> dict:
    """The workload of a zoo architecture at `size`, or of a held-out one (`heldout:NAME`: bench/heldout.py's
    tiny configs, whatever the size)."""
    if name.startswith(HELD_OUT_PREFIX):
        return {"workload": "heldout:build", "batch_size": batch_size, "args": {"name": name[len(HELD_OUT_PREFIX):]}}
    return {"workload": f"regen.zoo:{name}", "batch_size": batch_size, "args": {"size": size}}


def smallest_cap(profile, time_limit_s: float) -> int | None:
    """The smallest cap a recompute plan reaches (the solver's own search from an impossible cap)."""
    from regen.planner import solve

    try:
        return solve(profile, profile.memory_at_start_bytes + 1, "recompute", time_limit_s=time_limit_s).memory_cap_bytes
    except InfeasibleCapError as exc:
        return exc.smallest_feasible_cap_bytes


def regen_plans(profile, caps: list[tuple[str, int]], time_limit_s: float,
                say) -> tuple[list[tuple[str, object, int]], list[str]]:
    """(row label, plan, cap) of recompute and hybrid plans at each (name, cap), or at the smallest cap a
    strategy reaches when the cap is below it; and what could not be solved (the solver found no plan in its
    time limit), as notes."""
    from regen.planner.solve import solve_within_reach

    plans, unsolved = [], []
    for cap_name, cap in caps:
        for strategy in ("recompute", "hybrid"):
            link = {"link_ratio": LINK_RATIO} if strategy == "hybrid" else {}
            label = f"regen {strategy} @ {cap_name}"
            try:
                plan = solve_within_reach(profile, cap, strategy, time_limit_s=time_limit_s, **link)
            except SolverError as exc:
                say(f"{label}: {exc}")
                unsolved.append(f"{label}: no plan within the {time_limit_s:g} s limit")
                continue
            if plan.memory_cap_bytes != cap:
                say(f"{label}: out of reach; at the smallest cap it reaches instead")
                label = f"{label} (reaches {plan.memory_cap_bytes / 2**20:.2f} MiB)"
            plans.append((label, plan, plan.memory_cap_bytes))
    return plans, unsolved


def _checkpointing(spec: dict, label: str) -> Variant:
    """A fresh model under the checkpointing its users turn on; the note says which."""
    workload = build(spec)
    return Variant(label, workload, note=enable_checkpointing(workload.model))


def bench_arch(name: str, size: str, time_limit_s: float, timed_steps: int, say, calibrated: bool = True,
               batch_size: int = BATCH_SIZE) -> ArchResult:
    from regen.calibration import calibrate
    from regen.profiler import profile_workload
    from regen.runtime.self_timing import measure_runtime_costs

    spec = spec_of(name, size, batch_size)
    say(f"[{name}] profiling")
    workload = build(spec)
    profile = profile_workload(workload, device="cpu", repeats=3, warmup_steps=1, warmup_s=PROFILE_WARMUP_S,
                               progress=None, runtime_probe=measure_runtime_costs)
    if calibrated:
        profile.calibration = calibrate(workload, profile, lambda m: say(f"[{name}] {m}"))
    del workload
    start = profile.memory_at_start_bytes
    unplanned = _measured(Variant("no plan", build(spec), predicted_step_time_s=profile.step_time_s), start, name, say)
    peer = _measured(_checkpointing(spec, "checkpointing"), start, name, say)
    which = peer.note
    checkpointing_peak = start + peer.increase_bytes
    say(f"[{name}] solving")
    floor = smallest_cap(profile, time_limit_s)
    caps = [("checkpointing's peak", checkpointing_peak),
            (f"{LOW_CAP_FRACTION:.0%}", int(profile.peak_bytes * LOW_CAP_FRACTION))]
    variants = [unplanned, peer]
    plans, unsolved = regen_plans(profile, caps, time_limit_s, lambda m: say(f"[{name}] {m}"))
    for label, plan, cap in plans:
        variants.append(_measured(_planned(label, spec, plan, cap), start, name, say))
    # the same checkpointing on a second model, timed in the same rounds: how far two identical steps measure apart
    variants.append(_measured(_checkpointing(spec, CHECKPOINTING_AGAIN), start, name, say))
    time_round_robin(variants, timed_steps, name, say)
    result = ArchResult(name, start + unplanned.increase_bytes, floor, which, notes=unsolved,
                        calibration=None if profile.calibration is None else dataclasses.asdict(profile.calibration))
    for v in variants:
        if v.handle is not None:
            v.handle.remove()
        result.rows.append(Row(v.name, start + v.increase_bytes, statistics.median(v.times_s), v.cap_bytes,
                               v.predicted_step_time_s, v.note))
    return result


# ---- the table ---------------------------------------------------------------------------------------------


def _cell(row: Row | None, base: ArchResult, unplanned: Row) -> str:
    if row is None:
        return "–"
    peak = row.peak_bytes / base.unplanned_peak_bytes
    time_x = row.step_time_s / unplanned.step_time_s
    predicted = (f", pred. {row.predicted_step_time_s / unplanned.predicted_step_time_s:.2f}x"
                 if row.predicted_step_time_s and unplanned.predicted_step_time_s else "")
    return f"{peak:.2f}, {time_x:.2f}x{predicted}"


def _checkpointing_cell(r: ArchResult, unplanned: Row) -> str:
    cell = _cell(r.row("checkpointing"), r, unplanned).split(", pred")[0]
    again = _find(r, CHECKPOINTING_AGAIN)
    return cell if again is None else f"{cell} (again {again.step_time_s / unplanned.step_time_s:.2f}x)"


def _noise_s(r: ArchResult) -> float:
    """How far the two checkpointing instances measured apart (0 without the second)."""
    again = _find(r, CHECKPOINTING_AGAIN)
    return 0.0 if again is None else abs(again.step_time_s - r.row("checkpointing").step_time_s)


def _find(result: ArchResult, prefix: str) -> Row | None:
    return next((r for r in result.rows if r.variant.startswith(prefix)), None)


def table(results: list[ArchResult]) -> str:
    lines = ["| architecture | checkpointing: peak, time | regen's smallest cap | recompute @ ckpt peak | "
             "hybrid @ ckpt peak | recompute @ 50% | hybrid @ 50% | calibration |",
             "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in results:
        unplanned = r.row("no plan")
        floor = f"{r.smallest_cap_bytes / r.unplanned_peak_bytes:.2f}" if r.smallest_cap_bytes else "–"
        cells = [_checkpointing_cell(r, unplanned), floor]
        for prefix in ("regen recompute @ checkpointing", "regen hybrid @ checkpointing", "regen recompute @ 50%",
                       "regen hybrid @ 50%"):
            cells.append(_cell(_find(r, prefix), r, unplanned))
        cal = r.calibration
        cells.append("–" if not cal else f"x{cal['recompute_scale']:.2f}, {cal['swap_byte_s'] * 2**20 * 1e3:.2f} ms/MiB")
        lines.append(f"| {r.name} | " + " | ".join(cells) + " |")
    notes = [f"{r.name}, {note}" for r in results for note in r.notes]
    return "\n".join(lines + ([""] + [f"Not solved: {'; '.join(notes)}."] if notes else []))


def summary(results: list[ArchResult]) -> list[str]:
    """The issue's criteria, counted over the run."""
    n = len(results)
    floor_ok = [r.name for r in results
                if r.smallest_cap_bytes is not None and r.smallest_cap_bytes <= r.row("checkpointing").peak_bytes]
    recompute_ok, recompute_within_noise, hybrid_ok, predicted, predicted_ok, drift_ok = [], [], [], 0, 0, 0
    for r in results:
        unplanned = r.row("no plan")
        drift = (unplanned.step_time_s / unplanned.predicted_step_time_s  # the machine's, profile to timing
                 if unplanned is not None and unplanned.predicted_step_time_s else 1.0)
        ckpt = r.row("checkpointing")
        rec, hyb = _find(r, "regen recompute @ checkpointing"), _find(r, "regen hybrid @ checkpointing")
        if rec is not None and rec.step_time_s <= ckpt.step_time_s:
            recompute_ok.append(r.name)
        if rec is not None and rec.step_time_s <= ckpt.step_time_s + _noise_s(r):
            recompute_within_noise.append(r.name)
        if hyb is not None and hyb.step_time_s < ckpt.step_time_s:
            hybrid_ok.append(r.name)
        for row in r.rows:
            if row.variant.startswith("regen") and row.predicted_step_time_s:
                predicted += 1
                predicted_ok += abs(row.step_time_s / row.predicted_step_time_s - 1) <= 0.10
                drift_ok += abs(row.step_time_s / (drift * row.predicted_step_time_s) - 1) <= 0.10
    missing = lambda ok: ", ".join(r.name for r in results if r.name not in ok) or "none"  # noqa: E731
    return [f"- regen's smallest cap at or below checkpointing's peak: {len(floor_ok)}/{n} (not: {missing(floor_ok)})",
            f"- recompute at checkpointing's peak no slower than checkpointing: {len(recompute_ok)}/{n} "
            f"(not: {missing(recompute_ok)}); no slower than checkpointing plus how far its two instances "
            f"measured apart: {len(recompute_within_noise)}/{n} (not: {missing(recompute_within_noise)})",
            f"- hybrid (R = {LINK_RATIO}) at checkpointing's peak faster than checkpointing: {len(hybrid_ok)}/{n} "
            f"(not: {missing(hybrid_ok)})",
            f"- plans whose measured step time is within 10% of their prediction: {predicted_ok}/{predicted}; "
            f"{drift_ok}/{predicted} with the unplanned step's measured over predicted time (the machine's drift "
            f"between profiling and the timed rounds) taken out"]


def document(body: str, lines: list[str], command: str, elapsed_s: float, timed_steps: int, threads: int,
             batch_size: int) -> str:
    return "\n".join([
        ZOO_BEGIN,
        "## The architecture zoo at users' defaults",
        "",
        f"Produced by `{command}` on {datetime.date.today().isoformat()} ({elapsed_s:.0f} s), on {machine()}.",
        "",
        "Every architecture of `regen.zoo` (Hugging Face transformers models built from configs with only their "
        "sizes set: `use_cache`, the attention implementation and dropout as shipped), batch "
        f"{batch_size}. Each cell is the measured peak (the allocator's, as a fraction of the unplanned step's) "
        f"and the step time as a multiple of the unplanned step's (median of {timed_steps} steps round-robin "
        f"over the architecture's variants, after {WARMUP_STEPS} warm-up steps), then the plan's predicted step "
        "time on the same scale. Checkpointing is Hugging Face's `gradient_checkpointing_enable()` "
        "(non-reentrant) where the model has it, else `torch.utils.checkpoint` around each repeated block. regen's "
        f"plans are solved at checkpointing's measured peak and at {LOW_CAP_FRACTION:.0%} of the unplanned one "
        f"(or at the smallest cap a strategy reaches); hybrid plans swap over an emulated link at R = "
        f"{LINK_RATIO} (copying every saved tensor one way takes {LINK_RATIO} x the unplanned step), on copy "
        f"threads, compute on {threads} thread{'s' if threads > 1 else ''}. The smallest cap is the least "
        "a recompute-only plan reaches. Profiles are calibrated as `regen profile` calibrates them "
        "(regen.calibration) unless the command says `--no-calibrate`; the calibration column is the recompute "
        "scale and the per-MiB swap charge it measured. Checkpointing is timed on a second model too (\"again\"), "
        "in the same rounds: how far two identical steps measure apart in this run. Freed host memory stays in "
        "the heap while the bench runs (regen.heap.keep_freed_host_memory), as a GPU's caching allocator keeps "
        "device memory, so that no variant pays page faults the variant before it left.",
        "",
        body,
        "",
        *lines,
        ZOO_END,
    ])


def write_section(path: Path, section: str) -> None:
    """Put the zoo section into the benchmarks page, in place of the one there (or at its end)."""
    text = path.read_text() if path.exists() else ""
    pattern = re.compile(re.escape(ZOO_BEGIN) + r".*?" + re.escape(ZOO_END), re.S)
    text = pattern.sub(lambda _m: section, text) if pattern.search(text) else text.rstrip() + "\n\n" + section
    path.write_text(text.rstrip() + "\n")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", nargs="+", default=list(ZOO), choices=list(ZOO), metavar="NAME",
                        help=f"architectures (default: all of {', '.join(ZOO)})")
    parser.add_argument("--heldout", nargs="+", metavar="NAME",
                        help="instead of the zoo: these architectures of bench/heldout.py (regen was not built around "
                             "them; their tiny configs at any --size); implies --no-write")
    parser.add_argument("--size", default="bench", choices=["tiny", "bench"])
    parser.add_argument("--batch-size", type=int, default=BATCH_SIZE)
    parser.add_argument("--time-limit", type=float, default=SOLVE_TIME_LIMIT_S, help="solver time limit per plan (s)")
    parser.add_argument("--timed-steps", type=int, default=TIMED_STEPS)
    parser.add_argument("--no-write", action="store_true", help="print only; do not write docs/benchmarks.md")
    parser.add_argument("--no-calibrate", action="store_true",
                        help="plan from the profile alone, without regen.calibration's figures")
    parser.add_argument("--json", metavar="PATH", help="also write every row as JSON to PATH (after each architecture)")
    parser.add_argument("--from-json", nargs="+", metavar="PATH",
                        help="no run: the table and the page from the JSON of earlier runs (architectures in order)")
    args = parser.parse_args(argv)
    if args.heldout:
        from heldout import HELD_OUT

        unknown = [n for n in args.heldout if n not in HELD_OUT]
        if unknown:
            parser.error(f"--heldout: not in bench/heldout.py: {', '.join(unknown)}")
        args.models, args.no_write = [HELD_OUT_PREFIX + n for n in args.heldout], True
    keep_freed_host_memory()  # every variant's step meets the heap alike (regen.heap)
    warnings.filterwarnings("ignore")
    import transformers

    transformers.logging.set_verbosity_error()
    threads = max(1, min(2, torch.get_num_threads()) - 1)
    torch.set_num_threads(threads)

    def say(message):
        print(message, file=sys.stderr, flush=True)

    t0 = time.perf_counter()
    if args.from_json:
        results = [load_result(r) for path in args.from_json for r in json.loads(Path(path).read_text())]
    else:
        results = []
        for name in args.models:
            results.append(bench_arch(name, args.size, args.time_limit, args.timed_steps, say,
                                      calibrated=not args.no_calibrate, batch_size=args.batch_size))
            say(table(results[-1:]))
            if args.json:  # after each architecture: a run cut short keeps what it measured
                Path(args.json).write_text(json.dumps([dataclasses.asdict(r) for r in results], indent=1))
    body, lines = table(results), summary(results)
    print(body)
    print("\n".join(lines))
    if not args.no_write:
        command = "python bench/zoo.py" + (f" {' '.join(argv)}" if argv else "")
        write_section(ROOT / "docs" / "benchmarks.md",
                      document(body, lines, command, time.perf_counter() - t0, args.timed_steps, threads,
                               args.batch_size))
        say("wrote docs/benchmarks.md (the zoo section)")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
