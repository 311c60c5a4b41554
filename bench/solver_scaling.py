"""Solve time and optimality gap against size: regen's MILP on synthetic transformer-shaped profiles.

    .venv/bin/python bench/solver_scaling.py [--sizes 100 300 1000 3000] [--time-limit 30] [--cap 0.5]
                                             [--rel-gap 0.01] [--module-calls]

Profiles come from regen.graphs.synthetic.transformer_profile (about 15 candidates per layer); the
cap is a fraction of the unplanned peak. With --module-calls each layer is recorded as a module call, as
`regen profile` records a model's layers: the planner then has regions (a layer replayed whole) and twin
layers (docs/milp.md "Twin layers"). The solver stops at --rel-gap (default: the planner's
DEFAULT_REL_GAP, 1%) or the time limit. Target on 2 cores: 3,000 candidates to a 1% gap within 30 s
(107 take about 15 s: small graphs get longer copy windows, docs/milp.md).
"""

import argparse
import time

from regen.errors import RegenError
from regen.planner import solve
from regen.planner.milp.model import DEFAULT_REL_GAP
from regen.graphs.synthetic import transformer_profile

CANDIDATES_PER_LAYER = 15


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", type=int, nargs="+", default=[100, 300, 1000, 3000])
    parser.add_argument("--time-limit", type=float, default=30.0)
    parser.add_argument("--cap", type=float, default=0.5, help="cap as a fraction of the unplanned peak")
    parser.add_argument("--strategy", default="hybrid")
    parser.add_argument("--rel-gap", type=float, default=DEFAULT_REL_GAP, help="stopping relative gap")
    parser.add_argument("--module-calls", action="store_true", help="record each layer as a module call")
    args = parser.parse_args()
    print(f"time limit {args.time_limit:g} s, stopping gap {100 * args.rel_gap:g}%, cap {100 * args.cap:g}% of peak")
    print(f"{'cands':>6} {'ops':>6} {'binaries':>9} {'solve_s':>8} {'status':>10} {'gap_%':>7} "
          f"{'overhead_%':>10} {'sim_peak/cap':>12}")
    for size in args.sizes:
        profile = transformer_profile(n_layers=max(1, round(size / CANDIDATES_PER_LAYER)),
                                      module_calls=args.module_calls)
        cap = int(profile.peak_bytes * args.cap)
        info = {}

        def progress(msg, info=info):
            if msg.startswith("MILP:"):
                info["binaries"] = msg.split("(")[1].split()[0]

        t0 = time.perf_counter()
        try:
            plan = solve(profile, cap, args.strategy, time_limit_s=args.time_limit, progress=progress,
                         rel_gap=args.rel_gap)
        except RegenError as exc:
            print(f"{len(profile.saved_tensors):>6} {len(profile.ops):>6} {'-':>9} {time.perf_counter() - t0:>8.1f} "
                  f"{'error':>10}  {exc}")
            continue
        gap = "n/a" if plan.solver.gap is None else f"{100 * plan.solver.gap:.2f}"
        overhead = 100 * (plan.predicted.step_time_s / plan.baseline.step_time_s - 1)
        print(f"{len(profile.saved_tensors):>6} {len(profile.ops):>6} {info.get('binaries', '-'):>9} "
              f"{time.perf_counter() - t0:>8.1f} {plan.solver.status:>10} {gap:>7} {overhead:>10.2f} "
              f"{plan.simulated.peak_bytes / cap:>12.3f}", flush=True)


if __name__ == "__main__":
    main()
