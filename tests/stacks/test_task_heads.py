"""Hugging Face task heads at their defaults under a plan (three of bench/heldout.py's CONFIGURATIONS): a
decoder's sequence classification on a batch whose rows end in padding (it pools at each row's last non-pad
token), a multiple-choice head (inputs of three dimensions), and PEFT's prompt tuning (virtual tokens before
every row): loss, gradients and buffers equal to the unplanned steps, every step planned, the allocator's peak
within the cap."""

import contextlib
from pathlib import Path

import pytest

pytest.importorskip("transformers")
pytest.importorskip("peft")

from regen.check import check_plan  # noqa: E402
from regen.planner.solve import solve_within_reach  # noqa: E402
from regen.profiler import profile_workload  # noqa: E402
from regen.workloads import build_workload  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]


def _workload(name: str):
    with contextlib.chdir(ROOT):  # `bench.heldout:build` is imported from the current directory, as the CLI does
        return build_workload("bench.heldout:build", args={"name": name})


@pytest.mark.parametrize("name", ["llama_seqcls", "roberta_mc", "prompt_tuning_llama"])
def test_a_task_head_trains_exactly_within_its_cap(name):
    profile = profile_workload(_workload(name), device="cpu", repeats=1, warmup_steps=1, progress=None)
    cap = profile.memory_at_start_bytes + (profile.peak_bytes - profile.memory_at_start_bytes) * 6 // 10
    plan = solve_within_reach(profile, cap, "recompute", time_limit_s=20)
    assert plan.action_counts()["recompute"] > 0
    report = check_plan(lambda: _workload(name), plan, timed_steps=1, compared_steps=1)
    assert report.differences == []
    assert report.planned_steps == 3  # the verified step, the compared one and the timed one
    assert report.within_cap, (report.planned_peak_bytes, report.cap_bytes)
