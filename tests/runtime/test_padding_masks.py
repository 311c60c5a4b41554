"""Batches with padding, as users train decoders: a plan profiled on a padded batch, and a batch without padding.

A Hugging Face decoder at its defaults builds an attention mask from a padding mask, and skips it when the batch
has no padding (the same call, another forward). Such a step leaves its plan where the runtime sees the difference;
it goes on in dynamic mode under the plan's cap (Note [ A step that leaves its plan ] in regen/runtime/apply.py):
its results equal the unplanned step's, bit for bit (loss, gradients, buffers), its peak as the allocator measures
it stays within the cap + 5% (run unplanned, as before: 0.98-1.29x, six of the eight over it), and the padded steps
after it keep the plan. Profiles have fixed op times (tests/plans.py), so the plans are the same on any machine.
Where a step leaves its plan later (inside a kernel's saved inputs, between a rebuilt tensor and its rebuilder,
inside a region), see test_mismatch.py, test_rebuilt_with.py and test_regions.py.
"""

import copy
import warnings

import pytest
import torch

pytest.importorskip("transformers")

import regen  # noqa: E402
from common import assert_same, buffers, grads  # noqa: E402
from regen.measure import measure_memory  # noqa: E402
from plans import profile as fixed_time_profile  # noqa: E402
from regen.planner import solve  # noqa: E402
from regen.runtime.dynamic.cap_memory import model_storages  # noqa: E402
from regen.runtime.mismatch import PlanMismatchWarning  # noqa: E402
from regen.workloads import Workload, build_workload, training_step  # noqa: E402

CAP_FRACTION = 0.6  # of the padded step's peak increase: the unpadded step, unplanned, passes it by 11%
CAP_TOLERANCE = 0.05


def _padded(ids: torch.Tensor, lengths: list[int]) -> dict:
    mask = torch.zeros_like(ids)
    for row, n in enumerate(lengths):
        mask[row, :n] = 1
    labels = ids.masked_fill(mask == 0, -100)
    return {"input_ids": ids, "attention_mask": mask, "labels": labels}


def _results(w: Workload, batch: dict) -> tuple:
    step = Workload(name=w.name, model=w.model, batch=batch, loss_fn=w.loss_fn)
    torch.manual_seed(0)
    loss = training_step(step).detach()
    out = (loss, grads(w.model), buffers(w.model))
    w.model.zero_grad(set_to_none=True)
    return out


@pytest.mark.parametrize("name", ["llama", "opt", "gpt2", "gpt_neox", "qwen3", "olmo2", "phi3", "mixtral"])
def test_a_batch_without_padding_leaves_the_plan_and_goes_on_in_dynamic_mode_within_the_cap(name):
    w = build_workload(f"regen.zoo:{name}", batch_size=4)
    seq = w.batch["input_ids"].shape[1]
    g = torch.Generator().manual_seed(1)
    padded = _padded(torch.randint(0, 200, (4, seq), generator=g), [seq, seq - 5, seq - 20, seq // 2])
    full = _padded(torch.randint(0, 200, (4, seq), generator=g), [seq] * 4)
    w.batch = padded
    profile = fixed_time_profile(w)
    start = profile.memory_at_start_bytes
    cap = int(start + CAP_FRACTION * (profile.peak_bytes - start))
    plan = solve(profile, cap, "recompute", time_limit_s=20)
    plain = copy.deepcopy(w)
    expected = [_results(plain, b) for b in (padded, full, padded)]
    model_bytes = sum(model_storages(w.model).values())
    with regen.apply(w.model, plan) as handle:
        assert_same(expected[0], _results(w, padded))
        got = []
        with pytest.warns(PlanMismatchWarning, match="rest of this step runs in dynamic mode"):
            measured = measure_memory(lambda: got.append(_results(w, full)))
        with warnings.catch_warnings():
            warnings.simplefilter("error", PlanMismatchWarning)
            assert_same(expected[2], _results(w, padded))
    assert_same(expected[1], got[0])
    assert model_bytes + measured.peak_increase_bytes <= (1 + CAP_TOLERANCE) * cap
    assert handle.stats.planned_steps == 2 and handle.stats.dynamic_steps == 1 and handle.stats.unplanned_steps == 0
