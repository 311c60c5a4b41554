"""`regen solve`: read the input, parse the cap, run a strategy, check the result, build the Plan.

The walk from `solve` to the written Plan: validate the request, build the planning graph
(regen.planner.graph), run the strategy (regen.planner.strategies), put the copy-ins where the runtime
issues them (regen.planner.copy_order), replay the plan in the simulator (the one final check: a plan
that is inconsistent or over the cap is never returned), and export it (regen.planner.export).
"""

from __future__ import annotations

import re
import time
from pathlib import Path
from typing import Callable

from regen.errors import FormatError, InfeasibleCapError, RegenError, SolverError
from regen.formats.plan import Plan
from regen.formats.profile import Profile, load_profile
from regen.planner.copy_order import order_copy_ins
from regen.planner.export import build_plan
from regen.planner.graph import build_graph
from regen.planner.milp.highs import reset_solver_threads
from regen.planner.milp.model import DEFAULT_REL_GAP
from regen.planner.simulator import simulate
from regen.planner.strategies import STRATEGIES
from regen.units import BYTES_PER_GB, format_bytes

_UNITS = {
    "": 1, "b": 1,
    "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
    "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40,
}
_CAP_RE = re.compile(r"^\s*([0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)\s*([A-Za-z%]*)\s*$")

Progress = Callable[[str], None] | None


# ---- inputs ------------------------------------------------------------------------------------


def parse_memory_cap(text: str, baseline_peak_bytes: int) -> int:
    """'6GiB', '512MB', '1.5e9' (bytes), '60%' (of the unplanned peak) -> bytes."""
    m = _CAP_RE.match(str(text))
    if not m:
        raise RegenError(f"--memory-cap '{text}': expected a number with a unit (6GiB, 512MB, 1.5e9) "
                         f"or a percentage of the unplanned peak (60%)")
    value, unit = float(m.group(1)), m.group(2)
    if unit == "%":
        if not 0 < value:
            raise RegenError(f"--memory-cap '{text}': a percentage must be positive")
        return int(baseline_peak_bytes * value / 100.0)
    factor = _UNITS.get(unit.lower())
    if factor is None:
        known = "B, KB, MB, GB, TB, KiB, MiB, GiB, TiB or %"
        raise RegenError(f"--memory-cap '{text}': unknown unit '{unit}' (use {known})")
    cap = int(value * factor)
    if cap <= 0:
        raise RegenError(f"--memory-cap '{text}': the cap must be positive")
    return cap


def load_solver_input(path, bandwidth_gb_s: float | None = None) -> Profile:
    """A profile YAML, or a networkx node-link JSON graph turned into a synthetic profile."""
    path = Path(path)
    if bandwidth_gb_s is not None and not bandwidth_gb_s > 0:
        raise RegenError(f"--bandwidth {bandwidth_gb_s}: must be a positive number of GB/s")
    if not path.exists():
        raise FormatError(f"{path}: no such file")
    if path.suffix.lower() == ".json" or _starts_with_brace(path):
        from regen.planner.graph_json import load_node_link

        return load_node_link(path, bandwidth_gb_s)
    profile = load_profile(path)
    if bandwidth_gb_s is not None:
        profile.device.d2h_bytes_per_s = profile.device.h2d_bytes_per_s = bandwidth_gb_s * BYTES_PER_GB
    return profile


def _starts_with_brace(path: Path) -> bool:
    try:
        with open(path, encoding="utf-8") as f:
            return f.read(64).lstrip().startswith("{")
    except (UnicodeDecodeError, OSError):
        return False


# ---- solve -------------------------------------------------------------------------------------


def solve(profile: Profile, memory_cap_bytes: int, strategy: str = "hybrid", time_limit_s: float = 60.0,
          bandwidth_gb_s: float | None = None, progress: Progress = None, rel_gap: float = DEFAULT_REL_GAP) -> Plan:
    """A plan for `profile` under `memory_cap_bytes`, checked by the simulator.

    The MILP strategies stop at `rel_gap` (relative gap between the plan and the solver's bound, 1% by
    default) or at `time_limit_s`, whichever comes first."""
    if strategy not in STRATEGIES:
        raise RegenError(f"unknown strategy '{strategy}': use one of {', '.join(STRATEGIES)}")
    if not memory_cap_bytes or memory_cap_bytes <= 0:
        raise RegenError(f"the memory cap must be positive (got {memory_cap_bytes})")
    if not time_limit_s or time_limit_s <= 0:
        raise RegenError(f"--time-limit must be positive (got {time_limit_s})")
    if not 0 <= rel_gap < 1:
        raise RegenError(f"the relative gap must be in [0, 1) (got {rel_gap})")
    bw = bandwidth_gb_s * BYTES_PER_GB if bandwidth_gb_s else None
    reset_solver_threads()
    t0 = time.perf_counter()
    graph = build_graph(profile, bw, bw)
    say = progress or (lambda _m: None)
    decidable = [c for c in graph.candidates if c.can_swap or c.can_recompute]
    say(f"planning {len(graph.candidates)} saved tensors ({len(decidable)} with a choice) over "
        f"{graph.num_steps} ops; cap {format_bytes(memory_cap_bytes)} of unplanned peak "
        f"{format_bytes(profile.peak_bytes)}; "
        f"strategy {strategy}")
    result = STRATEGIES[strategy](graph, memory_cap_bytes, time_limit_s, rel_gap, say)
    order_copy_ins(graph, result.choices, memory_cap_bytes)
    sim = simulate(graph, result.choices)
    if not sim.valid:
        raise AssertionError(f"internal error: strategy {strategy} produced an inconsistent plan: {sim.errors[:3]}")
    if sim.peak_bytes > memory_cap_bytes:
        raise AssertionError(f"internal error: strategy {strategy} produced a plan whose simulated peak "
                             f"{sim.peak_bytes} is over the cap {memory_cap_bytes}; not writing it")
    result.report.solve_time_s = time.perf_counter() - t0
    plan = build_plan(graph, result, memory_cap_bytes, strategy, sim)
    say(f"simulated: peak {format_bytes(sim.peak_bytes)}, step {plan.simulated.step_time_s * 1e3:.3f} ms "
        f"(predicted {plan.predicted.step_time_s * 1e3:.3f} ms, unplanned {plan.baseline.step_time_s * 1e3:.3f} ms)")
    return plan
