"""regen's MILP against STR's formulation on the same small graphs, both on HiGHS.

    .venv/bin/python bench/str_vs_regen.py [--time-limit 120]

For each graph and cap: solve time and objective of each formulation (STR's objective counts
recompute time only: swaps are assumed hidden), and both plans replayed by regen's simulator (step
time and peak against the cap). Target: regen at least 10x faster at an equal or better objective.
"""

import argparse
import time

from regen.errors import RegenError
from regen.planner import solve
from regen.planner.synthetic import chain_profile, transformer_profile


def graphs():
    yield "chain-8", chain_profile(8, seed=1, copy_bytes_per_s=5e9)
    yield "chain-12", chain_profile(12, seed=2, copy_bytes_per_s=5e9)
    yield "transformer-1", transformer_profile(n_layers=1, batch=4, seq=256, d_model=256, n_head=4)
    yield "transformer-2", transformer_profile(n_layers=2, batch=4, seq=256, d_model=256, n_head=4)
    yield "transformer-3", transformer_profile(n_layers=3, batch=4, seq=256, d_model=256, n_head=4)


def run(profile, cap, strategy, time_limit):
    t0 = time.perf_counter()
    try:
        plan = solve(profile, cap, strategy, time_limit_s=time_limit)
    except RegenError as exc:
        return time.perf_counter() - t0, None, str(exc).split(";")[0][:60]
    return time.perf_counter() - t0, plan, ""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--time-limit", type=float, default=120.0)
    parser.add_argument("--caps", type=float, nargs="+", default=[0.85, 0.75])
    args = parser.parse_args()
    print(f"{'graph':<14} {'ops':>4} {'cap':>5} | {'regen_s':>7} {'regen_ms':>8} {'sim_ms':>7} | {'str_s':>7} "
          f"{'str_obj_ms':>10} {'sim_ms':>7} {'sim_peak/cap':>12} | {'speedup':>7}  note")
    for name, profile in graphs():
        for frac in args.caps:
            cap = int(profile.peak_bytes * frac)
            rt, rp, rnote = run(profile, cap, "hybrid", args.time_limit)
            st, sp, snote = run(profile, cap, "str", args.time_limit)
            r_obj = f"{rp.predicted.step_time_s * 1e3:8.3f}" if rp else f"{'-':>8}"
            r_sim = f"{rp.simulated.step_time_s * 1e3:7.3f}" if rp else f"{'-':>7}"
            s_obj = f"{sp.predicted.step_time_s * 1e3:10.3f}" if sp else f"{'-':>10}"
            s_sim = f"{sp.simulated.step_time_s * 1e3:7.3f}" if sp else f"{'-':>7}"
            s_peak = f"{sp.simulated.peak_bytes / cap:12.3f}" if sp else f"{'-':>12}"
            note = "; ".join(x for x in (rnote, snote) if x)
            print(f"{name:<14} {len(profile.ops):>4} {frac:>5.2f} | {rt:>7.2f} {r_obj} {r_sim} | {st:>7.2f} {s_obj} "
                  f"{s_sim} {s_peak} | {st / rt:>6.1f}x  {note}", flush=True)


if __name__ == "__main__":
    main()
