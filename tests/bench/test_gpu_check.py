"""bench/gpu_check.py without a GPU, so that it does not rot before one is lent.

`--cpu-dry-run` runs the check's own code (profile, reference gradients, every row, the planned rows
through regen.apply over the emulated link, the gradient checks, the row printing) on a tiny model; and
bench/gpu_check.sh, run from another directory with no PYTHONPATH and plain python, imports regen from the
repo root and says there is no CUDA here.
"""

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _gpu_check():
    spec = importlib.util.spec_from_file_location("gpu_check", ROOT / "bench" / "gpu_check.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules["gpu_check"] = module  # its dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def test_the_cpu_dry_run_prints_every_row_and_checks_gradients(capsys):
    gpu_check = _gpu_check()
    assert gpu_check.main(["--cpu-dry-run"]) == 0
    out = capsys.readouterr().out
    lines = out.splitlines()
    assert "sum of op times" in out and "device-to-host" in out and "host-to-device" in out
    assert any(line.startswith("variant") and "stall ms" in line and "pending" in line for line in lines)
    labels = ("no plan", "checkpoint", "offload", "regen ")
    rows = {line.split("  ")[0]: line for line in lines if line.startswith(labels)}
    assert "no plan" in rows and any(r.startswith("checkpoint per block") for r in rows) and "offload-all" in rows
    region_row = next(i for i, line in enumerate(lines) if line.startswith("regen checkpoint-blocks (regions)"))
    assert "FAILED" not in lines[region_row]
    regions = lines[region_row + 1].split(" regions (")
    assert int(regions[0].split()[-1]) > 0 and int(regions[1].split()[0]) > 0  # regions, replayed every step
    for strategy in gpu_check.STRATEGIES:
        row = next(line for label, line in rows.items() if label.startswith(f"regen {strategy} @"))
        assert "FAILED" not in row
        if strategy == "swap":
            assert row.rstrip().endswith("bitwise")  # swaps over the emulated link: the unplanned gradients
    assert "gradients as checked: yes" in out
    assert "memory fraction: skipped on CPU" in out
    assert any(line.startswith("parked profile under") and ": parked," in line and "FAILED" not in line for line in lines)
    assert "the parked profile: yes" in out


def test_a_zoo_architecture_is_checked_by_name_and_an_unknown_one_refused(capsys):
    gpu_check = _gpu_check()
    assert gpu_check.main(["--zoo", "no-such-model"]) == 2
    assert "not in regen.zoo" in capsys.readouterr().out
    from regen.zoo import SIZES

    assert SIZES["gpu"].layers > SIZES["bench"].layers  # what --zoo builds on a GPU


def test_the_gradient_check_catches_a_difference():
    import torch

    gpu_check = _gpu_check()

    class _Plan:
        def __init__(self, recompute):
            self.recompute = recompute
            self.regions = []

        def action_counts(self):
            return {"keep": 1, "swap": 1, "recompute": self.recompute}

    ref = {"w": torch.ones(3)}
    off = {"w": torch.tensor([1.0, 1.0, 1.0 + 1e-6])}
    assert gpu_check.check_gradients(_Plan(0), ref, ref, 0.0) == (True, "bitwise")
    assert not gpu_check.check_gradients(_Plan(0), off, ref, 0.0)[0]  # swaps: bit for bit where runs are
    assert gpu_check.check_gradients(_Plan(0), off, ref, 1e-6)[0]  # else within the unplanned spread's bound
    assert not gpu_check.check_gradients(_Plan(0), off, ref, 1e-8)[0]
    assert gpu_check.check_gradients(_Plan(2), off, ref, 1e-6)[0]
    assert not gpu_check.check_gradients(_Plan(2), off, ref, 1e-8)[0]


def test_the_shell_script_runs_from_anywhere_with_plain_python(tmp_path):
    env = {"PATH": f"{Path(sys.executable).parent}:/usr/bin:/bin", "HOME": str(tmp_path)}
    proc = subprocess.run(["bash", str(ROOT / "bench" / "gpu_check.sh")], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert f"regen from {ROOT / 'regen'}" in proc.stdout
    assert "no CUDA device here" in proc.stdout or "gpu_check on" in proc.stdout
    assert not os.path.exists(tmp_path / ".whl")
