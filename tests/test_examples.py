"""examples/train.py: the user-facing training loop under a plan, run as a user would."""

import subprocess
import sys
from pathlib import Path

from regen.cli import main

ROOT = Path(__file__).resolve().parents[1]


def test_train_example_under_a_real_plan(tmp_path):
    profile, plan = tmp_path / "p.yaml", tmp_path / "plan.yaml"
    assert main(["profile", "--model", "gpt", "--batch-size", "16", "--arg", "context=64", "--arg", "vocab_size=256",
                 "--repeats", "1", "-q", "-o", str(profile)]) == 0
    assert main(["solve", str(profile), "--memory-cap", "80%", "-q", "-o", str(plan)]) == 0
    proc = subprocess.run([sys.executable, str(ROOT / "examples" / "train.py"), "--plan", str(plan), "--steps", "3"],
                          capture_output=True, text=True, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert "workload gpt on cpu, 3 steps" in proc.stdout
    assert "measured peak increase" in proc.stdout and "median step time" in proc.stdout
    assert "planned_steps=" in proc.stdout  # the runtime reports that it actually planned the steps
    assert "within the cap of" in proc.stdout  # the loop drops the output before backward: under the cap


def test_train_example_reports_a_bad_plan_file_clearly(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("format: regen-plan/7\n")
    proc = subprocess.run([sys.executable, str(ROOT / "examples" / "train.py"), "--plan", str(bad)],
                          capture_output=True, text=True)
    assert proc.returncode != 0
    assert "error:" in proc.stderr and "Traceback" not in proc.stderr
