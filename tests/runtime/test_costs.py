"""The probe of what the runtime adds per event (regen.runtime.costs), as `regen profile` runs it."""

import math

import torch

from regen.runtime.costs import measure_runtime_costs


def test_the_probe_measures_the_runtime_s_own_work_on_cpu():
    costs = measure_runtime_costs(torch.device("cpu"))
    figures = [costs.dispatch_op_s, costs.capture_op_s, costs.replay_op_s, costs.recipe_s]
    assert all(math.isfinite(f) and 0.0 <= f < 0.01 for f in figures)
    # capturing and replaying an op run Python of regen's own around it: never free
    assert costs.capture_op_s > 0 and costs.replay_op_s > 0
    assert "regen.runtime.costs" in costs.method
