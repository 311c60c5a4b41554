"""Fixtures for the profiler tests: small built-in workloads, each profiled once per test session."""

import pytest
import torch

from regen.measure import measure_memory
from regen.profiler import profile_workload
from regen.workloads import build_workload, training_step

SMALL_ARGS = {
    "mlp": {"in_features": 64, "hidden": 128, "depth": 3},
    "cnn": {"channels": 8, "num_blocks": 2, "image_size": 16},
    "gpt": {"vocab_size": 256, "context": 32, "d_model": 64, "n_layer": 2, "n_head": 4, "dropout": 0.1},
    "hf-gpt2": {"seq_len": 32, "n_layer": 2, "n_embd": 64, "n_head": 4, "vocab_size": 256},
}
SMALL_BATCH = {"mlp": 16, "cnn": 4, "gpt": 4, "hf-gpt2": 2}
PROFILE_REPEATS = 2


def build_small(name: str, **overrides):
    args = {**SMALL_ARGS[name], **overrides}
    return build_workload(name, batch_size=SMALL_BATCH[name], args=args)


def profile_small(name: str, repeats: int = PROFILE_REPEATS, **overrides):
    workload = build_small(name, **overrides)
    return workload, profile_workload(workload, "cpu", repeats=repeats, warmup_steps=1, progress=None)


@pytest.fixture(scope="session")
def profiled():
    """name -> (workload, profile), profiled on first use and shared by the tests."""
    cache = {}

    def get(name: str):
        if name not in cache:
            cache[name] = profile_small(name)
        return cache[name]

    return get


def zero_grads(model: torch.nn.Module) -> None:
    for p in model.parameters():
        p.grad = None


@pytest.fixture(name="build_small", scope="session")
def _build_small_fixture():
    return build_small


@pytest.fixture(name="profile_small", scope="session")
def _profile_small_fixture():
    return profile_small


def peak_increases(build) -> tuple[int, int]:
    """(the profile's recorded peak increase, the allocator's measured one after a warm-up step) of the workload
    `build()` returns, a fresh one for each."""
    profile = profile_workload(build(), device="cpu", repeats=1, warmup_steps=1, progress=None)
    w = build()
    training_step(w)
    w.model.zero_grad(set_to_none=True)
    measured = measure_memory(lambda: training_step(w)).peak_increase_bytes
    return profile.peak_bytes - profile.memory_at_start_bytes, measured


@pytest.fixture(name="peak_increases", scope="session")
def _peak_increases_fixture():
    return peak_increases
