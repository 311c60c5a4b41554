"""The host link a plan is solved for (--link-ratio, --bandwidth), CPU devices without a link, and the host
memory cap (regen.planner.host_link, the MILP's host memory constraint)."""

import subprocess
import sys
from pathlib import Path

import pytest

from regen.errors import InfeasibleCapError, RegenError
from regen.formats import PLAN_FORMAT, load_plan, save_plan, save_profile
from regen.planner import solve

CAP_FRACTION = 0.6


def _cap(profile):
    return int(profile.peak_bytes * CAP_FRACTION)


def test_link_ratio_sets_both_bandwidths_and_is_recorded(small_transformer):
    ratio = 0.9
    plan = solve(small_transformer, _cap(small_transformer), "hybrid", time_limit_s=20, link_ratio=ratio)
    expected = small_transformer.candidate_bytes / (ratio * small_transformer.step_time_s)
    assert plan.d2h_bytes_per_s == pytest.approx(expected) and plan.h2d_bytes_per_s == pytest.approx(expected)
    assert plan.link.source == "link-ratio" and plan.link.link_ratio == pytest.approx(ratio)
    assert plan.link.candidate_bytes == sum(s.bytes for s in small_transformer.saved_tensors)


def test_a_slower_link_swaps_less_and_costs_more(small_transformer):
    fast = solve(small_transformer, _cap(small_transformer), "hybrid", time_limit_s=20, link_ratio=0.05)
    slow = solve(small_transformer, _cap(small_transformer), "hybrid", time_limit_s=20, link_ratio=5.0)
    assert fast.action_bytes()["swap"] > slow.action_bytes()["swap"]
    assert slow.action_bytes()["recompute"] > 0
    assert slow.simulated.step_time_s > fast.simulated.step_time_s


def test_bandwidth_and_profile_links_are_recorded(small_transformer):
    plan = solve(small_transformer, _cap(small_transformer), "hybrid", time_limit_s=20, bandwidth_gb_s=4.0)
    assert plan.link.source == "bandwidth" and plan.d2h_bytes_per_s == pytest.approx(4e9)
    ratio = small_transformer.candidate_bytes / (4e9 * small_transformer.step_time_s)
    assert plan.link.link_ratio == pytest.approx(ratio)
    plan = solve(small_transformer, _cap(small_transformer), "hybrid", time_limit_s=20)
    assert plan.link.source == "profile"


def test_link_ratio_and_bandwidth_are_exclusive(small_transformer):
    with pytest.raises(RegenError, match="give one of them"):
        solve(small_transformer, _cap(small_transformer), "hybrid", bandwidth_gb_s=4.0, link_ratio=0.9)
    for bad in (0.0, -1.0, float("inf")):
        with pytest.raises(RegenError, match="link_ratio"):
            solve(small_transformer, _cap(small_transformer), "hybrid", link_ratio=bad)


def test_plan_link_and_host_cap_round_trip(small_transformer, tmp_path):
    plan = solve(small_transformer, _cap(small_transformer), "hybrid", time_limit_s=20, link_ratio=0.5,
                 host_memory_cap_bytes=64 * 2**20)
    save_plan(plan, tmp_path / "p.yaml")
    back = load_plan(tmp_path / "p.yaml")
    assert back.link == plan.link and back.host_memory_cap_bytes == 64 * 2**20
    doc = (tmp_path / "p.yaml").read_text()
    stripped = "\n".join(line for line in doc.splitlines()
                         if not line.startswith(("link:", "  source:", "  link_ratio:", "  candidate_bytes:",
                                                 "host_memory_cap_bytes:")))
    (tmp_path / "old.yaml").write_text(stripped)
    old = load_plan(tmp_path / "old.yaml")  # a plan without the optional fields still loads
    assert old.link is None and old.host_memory_cap_bytes is None and old.format == PLAN_FORMAT


def test_cli_link_ratio_and_exclusive_error(small_transformer, tmp_path):
    profile_path = tmp_path / "t.profile.yaml"
    save_profile(small_transformer, profile_path)
    root = Path(__file__).resolve().parents[2]
    base = [sys.executable, "-m", "regen.cli", "solve", str(profile_path), "--memory-cap", "60%", "-q",
            "-o", str(tmp_path / "t.plan.yaml")]
    env = {"PYTHONPATH": str(root), "PATH": "/usr/bin:/bin"}
    proc = subprocess.run(base + ["--link-ratio", "0.9", "--bandwidth", "4"], capture_output=True, text=True, env=env)
    assert proc.returncode == 2 and proc.stderr.strip().count("\n") == 0
    assert "--link-ratio and --bandwidth" in proc.stderr
    proc = subprocess.run(base + ["--link-ratio", "0.9", "--time-limit", "20"], capture_output=True, text=True, env=env)
    assert proc.returncode == 0, proc.stderr
    plan = load_plan(tmp_path / "t.plan.yaml")
    assert plan.link.source == "link-ratio" and plan.link.link_ratio == pytest.approx(0.9)
    show = subprocess.run([sys.executable, "-m", "regen.cli", "show", str(tmp_path / "t.plan.yaml")],
                          capture_output=True, text=True, env=env)
    assert "link ratio 0.9 (from --link-ratio)" in show.stdout and "host memory cap" in show.stdout


def test_cpu_profile_without_a_link_plans_recompute_only(real_gpt_profile):
    profile = real_gpt_profile
    assert profile.device.type == "cpu"
    messages = []
    plan = solve(profile, int(profile.peak_bytes * 0.9), "hybrid", time_limit_s=30, progress=messages.append)
    assert plan.action_counts()["swap"] == 0 and plan.action_counts()["recompute"] > 0
    assert plan.strategy == "recompute" and plan.link.source == "profile"
    assert any("CPU" in n and "--link-ratio" in n for n in plan.notes)
    assert sum("solved as recompute only" in m for m in messages) == 1
    for strategy in ("swap", "str"):
        with pytest.raises(RegenError, match="link_ratio"):
            solve(profile, int(profile.peak_bytes * 0.9), strategy, time_limit_s=10)
    # asked for explicitly, with a link, a CPU profile swaps
    linked = solve(profile, int(profile.peak_bytes * 0.9), "hybrid", time_limit_s=30, link_ratio=0.05)
    assert linked.strategy == "hybrid" and linked.action_counts()["swap"] > 0
    assert solve(profile, int(profile.peak_bytes * 0.9), "swap", time_limit_s=30,
                 bandwidth_gb_s=10.0).action_counts()["swap"] > 0


def test_host_memory_cap_bounds_the_host_pool(small_transformer):
    cap = _cap(small_transformer)
    free = solve(small_transformer, cap, "hybrid", time_limit_s=20, link_ratio=0.05)
    assert free.host_pool_bytes > 0
    bound = free.host_pool_bytes // 3
    bounded = solve(small_transformer, cap, "hybrid", time_limit_s=20, link_ratio=0.05, host_memory_cap_bytes=bound)
    assert 0 < bounded.host_pool_bytes <= bound and bounded.host_memory_cap_bytes == bound
    assert bounded.action_bytes()["recompute"] > free.action_bytes()["recompute"]
    assert bounded.simulated.peak_bytes <= cap
    with pytest.raises(InfeasibleCapError):  # swap only cannot reach the cap through a tiny host pool
        solve(small_transformer, cap, "swap", time_limit_s=20, link_ratio=0.05, host_memory_cap_bytes=2**20)


def test_offload_all_swaps_every_large_saved_tensor(small_transformer, real_gpt_profile):
    from regen.planner.graph import build_graph
    from regen.planner.heuristics import OFFLOAD_MIN_BYTES

    plan = solve(small_transformer, small_transformer.peak_bytes, "offload-all", link_ratio=0.9)
    graph = build_graph(small_transformer)
    expected = {c.id for c in graph.candidates if c.bytes >= OFFLOAD_MIN_BYTES and c.can_swap}
    assert expected and {d.saved_tensor for d in plan.decisions if d.action == "swap"} == expected
    assert plan.action_counts()["recompute"] == 0 and plan.strategy == "offload-all"
    assert plan.simulated.peak_bytes < small_transformer.peak_bytes
    with pytest.raises(InfeasibleCapError, match="offload-all"):  # a heuristic: its peak is what it is
        solve(small_transformer, int(plan.simulated.peak_bytes * 0.9), "offload-all", link_ratio=0.9)
    with pytest.raises(RegenError, match="link_ratio"):  # a CPU device has no link to offload over
        solve(real_gpt_profile, real_gpt_profile.peak_bytes, "offload-all")


def test_cli_host_memory_cap(small_transformer, tmp_path, capsys):
    from regen.cli import main

    profile_path = tmp_path / "t.profile.yaml"
    save_profile(small_transformer, profile_path)
    out = str(tmp_path / "p.yaml")
    base = ["solve", str(profile_path), "--memory-cap", "60%", "--link-ratio", "0.05", "-q", "-o", out]
    assert main(base + ["--host-memory-cap", "12 parsecs"]) == 2
    assert "--host-memory-cap '12 parsecs'" in capsys.readouterr().err
    assert main(base + ["--strategy", "swap", "--host-memory-cap", "1MiB", "--time-limit", "20"]) == 3
    assert main(base + ["--host-memory-cap", "8MiB", "--time-limit", "20"]) == 0
    plan = load_plan(out)
    assert plan.host_memory_cap_bytes == 8 * 2**20 and plan.host_pool_bytes <= 8 * 2**20
    assert main(["show", out, "--json"]) == 0
    import json

    summary = json.loads(capsys.readouterr().out)
    assert summary["host_memory_cap_bytes"] == 8 * 2**20 and summary["link"]["source"] == "link-ratio"
