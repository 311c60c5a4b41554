"""Shared planner fixtures: synthetic profiles (no model runs) and small real ones (profiled on CPU)."""

import pytest

from regen.graphs.synthetic import chain_profile, transformer_profile


@pytest.fixture(scope="session")
def small_transformer():
    return transformer_profile(n_layers=3, batch=4, seq=256, d_model=256, n_head=4, copy_bytes_per_s=20e9)


@pytest.fixture(scope="session")
def chain6():
    return chain_profile(6, seed=3)


@pytest.fixture(scope="session")
def real_gpt_profile():
    from regen.profiler import profile_workload
    from regen.workloads import build_workload

    workload = build_workload("gpt", batch_size=2, args=dict(vocab_size=256, context=32, d_model=64, n_layer=2,
                                                              n_head=4))
    return profile_workload(workload, device="cpu", repeats=1, warmup_steps=1, progress=None)
