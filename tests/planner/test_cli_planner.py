"""`regen solve` and `regen show PLAN` through regen.cli.main: outputs, and clear errors with non-zero exits."""

import json

import pytest

from regen.cli import main
from regen.errors import InfeasibleCapError, SolverError
from regen.formats import load_plan, save_profile
from regen.graphs.synthetic import chain_profile


@pytest.fixture
def profile_path(tmp_path):
    path = tmp_path / "chain.profile.yaml"
    save_profile(chain_profile(6, seed=3, copy_bytes_per_s=5e9), path)
    return path


def test_solve_then_show_text_json_and_plot(profile_path, tmp_path, capsys):
    plan_path = tmp_path / "chain.plan.yaml"
    assert main(["solve", str(profile_path), "--memory-cap", "75%", "-o", str(plan_path)]) == 0
    err = capsys.readouterr().err
    assert "MILP:" in err and "solver highs started" in err and "wrote" in err  # progress is visible
    plan = load_plan(plan_path)
    assert plan.simulated.peak_bytes <= plan.memory_cap_bytes
    assert main(["show", str(plan_path)]) == 0
    text = capsys.readouterr().out
    assert "strategy hybrid" in text and "recompute" in text and "gap" in text
    assert main(["show", str(plan_path), "--json"]) == 0
    summary = json.loads(capsys.readouterr().out)
    for key in ("strategy", "memory_cap_bytes", "predicted_peak_bytes", "predicted_step_time_s",
                "baseline_peak_bytes", "baseline_step_time_s", "solve_time_s", "gap", "actions"):
        assert key in summary
    assert sum(summary["actions"].values()) == len(plan.decisions)
    rebuilt = plan.rebuilt_count()
    assert summary["rebuilt_with_another"] == rebuilt <= summary["actions"]["recompute"]
    assert (f"({rebuilt} rebuilt with another's recipe)" in text) == (rebuilt > 0)
    assert summary["predicted_peak_bytes"] <= summary["memory_cap_bytes"] < summary["baseline_peak_bytes"]
    png = tmp_path / "timeline.png"
    assert main(["show", str(plan_path), "--plot", str(png)]) == 0
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 5000


@pytest.mark.parametrize("content,match", [
    ("format: regen-profile/7\n", "not supported by this regen"),
    ("format: regen-profile/1\nops: [\n", "not valid YAML"),
    ("format: regen-profile/1\nops: []\n", "missing field"),
])
def test_bad_profiles_are_one_line_errors(tmp_path, capsys, content, match):
    bad = tmp_path / "bad.yaml"
    bad.write_text(content)
    code = main(["solve", str(bad), "--memory-cap", "1GiB", "-o", str(tmp_path / "p.yaml")])
    err = capsys.readouterr().err
    assert code != 0 and err.startswith("error:") and match in err and "Traceback" not in err


def test_unknown_cap_unit(profile_path, tmp_path, capsys):
    assert main(["solve", str(profile_path), "--memory-cap", "6 furlongs", "-o", str(tmp_path / "p.yaml")]) != 0
    assert "unknown unit 'furlongs'" in capsys.readouterr().err


def test_infeasible_cap_names_the_smallest_feasible_cap(profile_path, tmp_path, capsys):
    code = main(["solve", str(profile_path), "--memory-cap", "20%", "-o", str(tmp_path / "p.yaml"), "-q"])
    err = capsys.readouterr().err
    assert code == InfeasibleCapError.exit_code and "smallest feasible cap found is" in err
    assert not (tmp_path / "p.yaml").exists()


def test_time_limit_without_a_feasible_plan(profile_path, tmp_path, capsys, monkeypatch):
    """No warm start and a time limit too short for HiGHS to find any plan: a SolverError naming the time limit
    asked for (not what was left of it for the last solve), no file."""
    import importlib

    search_module = importlib.import_module("regen.planner.milp.search")
    monkeypatch.setattr(search_module, "warm_start", lambda *a, **k: None)
    monkeypatch.setattr(search_module, "MAX_REPAIR_ROUNDS", 0)
    code = main(["solve", str(profile_path), "--memory-cap", "70%", "--time-limit", "1e-4", "-q",
                 "-o", str(tmp_path / "p.yaml")])
    err = capsys.readouterr().err
    assert code == SolverError.exit_code and "without a feasible plan" in err and "--time-limit" in err
    assert "time limit of 0.0001 s" in err
    assert not (tmp_path / "p.yaml").exists()


def test_show_plot_without_matplotlib_is_a_clear_error(profile_path, tmp_path, capsys, monkeypatch):
    plan_path = tmp_path / "p.yaml"
    assert main(["solve", str(profile_path), "--memory-cap", "90%", "-o", str(plan_path), "-q"]) == 0
    import builtins

    real_import = builtins.__import__

    def no_matplotlib(name, *args, **kwargs):
        if name.startswith("matplotlib"):
            raise ImportError(name)
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_matplotlib)
    assert main(["show", str(plan_path), "--plot", str(tmp_path / "x.png")]) != 0
    assert "pip install 'regen[plot]'" in capsys.readouterr().err


def test_solve_keeps_stdout_clean_of_solver_output(profile_path, tmp_path):
    """HiGHS prints a banner from C++ on the first solver of a process: it must not reach stdout."""
    import subprocess
    import sys

    plan_path = tmp_path / "clean.plan.yaml"
    run = subprocess.run([sys.executable, "-m", "regen.cli", "solve", str(profile_path), "--memory-cap", "75%",
                          "-o", str(plan_path)], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    assert "HiGHS" not in run.stdout and "Running" not in run.stdout
    assert "solver highs started" in run.stderr and "stops at a 1% gap" in run.stderr
    assert load_plan(plan_path).simulated.peak_bytes <= load_plan(plan_path).memory_cap_bytes


def test_gradients_held_are_counted_and_a_percentage_is_of_the_peak_with_them(tmp_path, capsys):
    """`--gradients-held`: the plan records the gradient bytes it counted for the whole step, its unplanned peak
    includes them, and "80%" is of that peak."""
    import dataclasses

    from regen.formats.profile import StaticMemory
    from regen.units import parse_memory_cap

    profile = chain_profile(6, seed=3, copy_bytes_per_s=5e9)
    held = profile.peak_bytes // 10
    profile = dataclasses.replace(profile, static_memory=StaticMemory(parameter_bytes=held, gradient_bytes=held,
                                                                      optimizer_state_bytes=0))
    path, plan_path = tmp_path / "p.yaml", tmp_path / "plan.yaml"
    save_profile(profile, path)
    assert main(["solve", str(path), "--memory-cap", "80%", "--strategy", "recompute", "--gradients-held",
                 "-o", str(plan_path)]) == 0
    assert "gradients held from step to step" in capsys.readouterr().err
    plan = load_plan(plan_path)
    assert plan.gradients_held_bytes == held and plan.baseline.peak_bytes == profile.peak_bytes + held
    assert plan.memory_cap_bytes == parse_memory_cap("80%", profile.peak_bytes + held)
    assert plan.simulated.peak_bytes <= plan.memory_cap_bytes
    assert main(["show", str(plan_path)]) == 0
    assert "gradients held" in capsys.readouterr().out
    assert main(["show", str(plan_path), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["gradients_held_bytes"] == held
