"""`SolveOptions`: one object for a solve's settings, errors that name them, the CLI's flag terms, and
copy ordering that leaves the caller's choices alone."""

import dataclasses

import pytest

from regen.cli import in_flag_terms, main
from regen.errors import RegenError
from regen.formats import save_profile
from regen.formats.plan import ACTION_SWAP
from regen.planner import SolveOptions, solve
from regen.planner.copy_order import order_copy_ins
from regen.planner.graph import build_graph
from regen.planner.options import solve_options
from regen.planner.result import Choice


def test_solve_options_from_a_strategy_name_and_settings():
    assert solve_options("swap", time_limit_s=5.0) == SolveOptions(strategy="swap", time_limit_s=5.0)
    base = SolveOptions(strategy="recompute", link_ratio=0.9)
    assert solve_options(base, rel_gap=0.05) == dataclasses.replace(base, rel_gap=0.05)
    assert solve_options(None, start_plans=[("a", {})]).start_plans == (("a", {}),)
    with pytest.raises(TypeError):
        solve_options(None, time_limit=5.0)


def test_library_errors_name_parameters(chain6):
    cap = chain6.peak_bytes // 2
    for settings, name in [({"time_limit_s": 0}, "time_limit_s"), ({"link_ratio": -1.0}, "link_ratio"),
                           ({"bandwidth_gb_s": 0.0}, "bandwidth_gb_s"),
                           ({"link_ratio": 0.9, "bandwidth_gb_s": 4.0}, "link_ratio and bandwidth_gb_s"),
                           ({"host_memory_cap_bytes": -5}, "host_memory_cap_bytes")]:
        with pytest.raises(RegenError) as exc:
            solve(chain6, cap, SolveOptions(**settings))
        assert name in str(exc.value) and "--" not in str(exc.value)


def test_the_plan_is_built_with_its_options(chain6):
    plan = solve(chain6, int(chain6.peak_bytes * 0.9), SolveOptions(strategy="recompute", host_memory_cap_bytes=2**30,
                                                                    profile_path="chain6.profile.yaml"))
    assert plan.profile_path == "chain6.profile.yaml" and plan.host_memory_cap_bytes == 2**30
    assert plan.link is not None and plan.link.source == "profile"


def test_the_cli_says_flags(chain6, tmp_path, capsys):
    assert in_flag_terms("raise time_limit_s or use strategy='hybrid'") == "raise --time-limit or use --strategy hybrid"
    path = tmp_path / "c.profile.yaml"
    save_profile(chain6, path)
    base = ["solve", str(path), "--memory-cap", "50%", "-q", "-o", str(tmp_path / "c.plan.yaml")]
    assert main(base + ["--link-ratio", "0"]) == RegenError.exit_code
    assert "error: --link-ratio 0.0: must be a positive number" in capsys.readouterr().err
    assert main(base + ["--bandwidth", "-2"]) == RegenError.exit_code
    assert "error: --bandwidth -2.0: must be a positive number of GB/s" in capsys.readouterr().err


def test_copy_ordering_returns_new_choices(small_transformer):
    graph = build_graph(small_transformer)
    swaps = [c for c in graph.candidates if c.can_swap][:3]
    assert len(swaps) == 3
    choices = {c.index: Choice(ACTION_SWAP, swap_in_step=c.in_window[-1]) for c in swaps}
    before = {i: dataclasses.replace(ch) for i, ch in choices.items()}
    ordered, sim = order_copy_ins(graph, choices, small_transformer.peak_bytes)
    assert choices == before and all(ordered[i] is not choices[i] for i in choices)
    assert sim.valid and set(ordered) == set(choices)
