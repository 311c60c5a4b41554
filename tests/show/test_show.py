"""`regen show`: one parse of the file, and no solver or graph library imported to show a plan."""

import subprocess
import sys

import pytest

from regen.cli import main
from regen.errors import FormatError
from regen.formats import Plan, Profile, load_profile_or_plan, save_profile
from regen.graphs.synthetic import chain_profile


@pytest.fixture
def files(tmp_path):
    profile_path = tmp_path / "chain.profile.yaml"
    save_profile(chain_profile(6, seed=3, copy_bytes_per_s=5e9), profile_path)
    plan_path = tmp_path / "chain.plan.yaml"
    assert main(["solve", str(profile_path), "--memory-cap", "75%", "-o", str(plan_path), "-q"]) == 0
    return profile_path, plan_path


def test_the_summary_names_where_tracking_windows_open(files):
    from dataclasses import replace

    from regen.formats.plan import TrackingStart
    from regen.show import plan_summary, plan_summary_json

    plan = load_profile_or_plan(files[1])
    starts = [TrackingStart("", 0, 0), TrackingStart("blocks.0.mlp", 0, 40), TrackingStart("blocks.0.mlp", 2, 90)]
    summary = plan_summary(replace(plan, tracking_starts=starts))
    assert "tracking windows  3, opened at the step's start, blocks.0.mlp, blocks.0.mlp#2" in summary
    assert "tracking windows" not in plan_summary(replace(plan, tracking_starts=[]))
    assert plan_summary_json(replace(plan, tracking_starts=starts))["tracking_starts"][2] == {
        "module": "blocks.0.mlp", "call": 2, "first_op": 90}


def test_the_summary_shows_module_replays_apart_only_where_the_plan_charged_them_so(files, tmp_path):
    """A plan solved before module replays were charged apart has no replays' scale or time in its file: the
    summary then claims none (a default would say they were charged x1 or took 0 ms)."""
    from dataclasses import replace

    from regen.formats import save_plan
    from regen.formats.plan import PlanCharges, TimeParts
    from regen.show import plan_summary

    plan = load_profile_or_plan(files[1])
    assert plan.charges is not None and plan.charges.region_scale is not None
    charged = replace(plan, charges=replace(plan.charges, region_scale=0.8),
                      simulated_parts=TimeParts(recompute_s=0.003, region_s=0.002))
    assert "module replays x0.80" in plan_summary(charged) and "(module replays 2" in plan_summary(charged)
    older = replace(plan, charges=PlanCharges(), simulated_parts=TimeParts(recompute_s=0.003))
    path = tmp_path / "older.plan.yaml"
    save_plan(older, path)
    loaded = load_profile_or_plan(path)
    assert loaded.charges.region_scale is None and "module replays" not in plan_summary(loaded)


def test_profile_or_plan_by_its_format(files, tmp_path):
    profile_path, plan_path = files
    assert isinstance(load_profile_or_plan(profile_path), Profile)
    assert isinstance(load_profile_or_plan(plan_path), Plan)
    other = tmp_path / "other.yaml"
    other.write_text("format: regen-cache/1\n")
    with pytest.raises(FormatError, match="neither a regen profile nor a regen plan"):
        load_profile_or_plan(other)
    newer = tmp_path / "newer.yaml"
    newer.write_text("format: regen-plan/9\n")
    with pytest.raises(FormatError, match="not supported by this regen"):
        load_profile_or_plan(newer)


def test_show_imports_no_solver(files):
    """`regen show PLAN` reads the formats only: PuLP, HiGHS and networkx stay unimported."""
    _, plan_path = files
    code = ("import sys\nfrom regen.cli import main\n"
            f"assert main(['show', {str(plan_path)!r}]) == 0\n"
            "print(sorted(m for m in ('pulp', 'highspy', 'networkx') if m in sys.modules))")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "strategy hybrid" in proc.stdout
    assert proc.stdout.strip().splitlines()[-1] == "[]"
