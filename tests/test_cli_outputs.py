"""Output paths, -q, and small things a user notices: one-line errors, nothing left behind, inputs
never overwritten, quiet means quiet."""

import subprocess
import sys

import pytest

from regen.cli import main
from regen.formats import load_plan, save_profile
from regen.graphs.synthetic import chain_profile

MLP = ["--model", "mlp", "--batch-size", "4", "--arg", "hidden=16", "--arg", "depth=2", "--repeats", "1"]


@pytest.fixture
def profile_path(tmp_path):
    path = tmp_path / "chain.profile.yaml"
    save_profile(chain_profile(6, seed=3, copy_bytes_per_s=5e9), path)
    return path


def bad_outputs(tmp_path):
    """(output argument, what the error says) for outputs that cannot be written."""
    (tmp_path / "a_dir").mkdir()
    (tmp_path / "a_file").write_text("x")
    return [
        (str(tmp_path / "a_dir"), "is a directory"),
        ("", "the output path is empty"),
        (str(tmp_path / "a_file" / "x.yaml"), "is not a directory"),
        (str(tmp_path / "missing" / "x.yaml"), "does not exist"),
    ]


def leftovers(tmp_path):
    return sorted(p.name for p in tmp_path.rglob("*") if p.name.endswith(".tmp") or p.name == "x.yaml")


@pytest.mark.parametrize("case", range(4))
def test_bad_output_paths_are_one_line_errors_before_any_work(tmp_path, capsys, profile_path, case):
    output, message = bad_outputs(tmp_path)[case]
    before = profile_path.read_bytes()
    for argv in (["solve", str(profile_path), "--memory-cap", "70%", "-o", output],
                 ["profile", *MLP, "-o", output]):
        assert main(argv) == 2
        err = capsys.readouterr().err
        assert err.startswith("error:") and message in err and err.count("\n") == 1
        assert "building workload" not in err and "planning" not in err  # refused before the long work
    assert leftovers(tmp_path) == [] and not (tmp_path / "missing").exists()
    assert profile_path.read_bytes() == before


def test_the_input_is_never_overwritten(tmp_path, capsys, profile_path):
    before = profile_path.read_bytes()
    assert main(["solve", str(profile_path), "--memory-cap", "70%", "-o", str(profile_path)]) == 2
    assert "is the input file" in capsys.readouterr().err
    assert profile_path.read_bytes() == before
    plan = tmp_path / "p.yaml"
    assert main(["solve", str(profile_path), "--memory-cap", "70%", "-o", str(plan), "-q"]) == 0
    assert main(["show", str(plan), "--plot", str(plan)]) == 2
    assert "is the input file" in capsys.readouterr().err
    assert load_plan(plan).memory_cap_bytes > 0


def test_the_workloads_own_source_file_is_never_overwritten(tmp_path, capsys, monkeypatch):
    package = tmp_path / "userpkg"
    package.mkdir()
    (package / "__init__.py").write_text("")
    source = "from regen.models import mlp as build\n"
    (package / "models.py").write_text(source)
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    assert main(["profile", "--model", "userpkg.models:build", "-o", "userpkg/models.py"]) == 2
    err = capsys.readouterr().err
    assert "is the input file" in err and err.count("\n") == 1 and "building workload" not in err
    assert (package / "models.py").read_text() == source


@pytest.mark.parametrize("value", ["nan", "inf", "-1", "0"])
def test_a_time_limit_that_is_not_a_positive_finite_number_is_refused(tmp_path, capsys, profile_path, value):
    assert main(["solve", str(profile_path), "--memory-cap", "70%", "-o", str(tmp_path / "p.yaml"),
                 "--time-limit", value]) == 2
    err = capsys.readouterr().err
    assert "--time-limit" in err and err.count("\n") == 1 and "planning" not in err
    assert not (tmp_path / "p.yaml").exists()


def test_quiet_prints_nothing(tmp_path, profile_path):
    """-q: no progress, no workload message and no HiGHS banner, on either stream."""
    for argv in (["solve", str(profile_path), "--memory-cap", "70%", "-o", str(tmp_path / "p.yaml"), "-q"],
                 ["profile", *MLP, "-o", str(tmp_path / "m.yaml"), "-q"]):
        run = subprocess.run([sys.executable, "-m", "regen.cli", *argv], capture_output=True, text=True, timeout=300)
        assert run.returncode == 0, run.stderr
        assert run.stdout == "" and run.stderr == ""
    assert load_plan(tmp_path / "p.yaml").simulated.peak_bytes <= load_plan(tmp_path / "p.yaml").memory_cap_bytes


@pytest.mark.parametrize("cap", ["100%", "150%"])
def test_a_cap_at_or_above_the_unplanned_peak_keeps_everything(tmp_path, profile_path, cap):
    out = tmp_path / "p.yaml"
    assert main(["solve", str(profile_path), "--memory-cap", cap, "-o", str(out), "-q"]) == 0
    plan = load_plan(out)
    assert plan.action_counts()["keep"] == len(plan.decisions)
    assert plan.simulated.step_time_s == pytest.approx(plan.baseline.step_time_s)
    assert any("every tensor is kept" in n for n in plan.notes)


def test_batch_size_must_be_positive(tmp_path, capsys):
    assert main(["profile", "--model", "mlp", "--batch-size", "0", "-o", str(tmp_path / "m.yaml")]) == 2
    assert "--batch-size 0: must be a positive whole number" in capsys.readouterr().err
    assert not (tmp_path / "m.yaml").exists()
