"""Shared test fixtures. Tests run on CPU; every test uses small models and finishes in seconds."""

import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(__file__))  # plan_choices.py and plans.py, shared by the packages' tests
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# at most 2 intra-op threads, shared among the test processes when pytest-xdist runs several
_processes = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
torch.set_num_threads(max(1, min(2, torch.get_num_threads()) // _processes))
# Inductor's CPU kernels unvectorized: what the compiled tests check is the graph regen's plan shapes, not the
# kernels' instructions, and scalar kernels are generated and built in about two thirds of the time
torch._inductor.config.cpp.simdlen = 1
if _processes > 1:  # every core runs a test file: Inductor compiles in the test's process, no pool of its own
    torch._inductor.config.compile_threads = 1


@pytest.fixture
def tmp_cwd(tmp_path, monkeypatch):
    """Run the test from an empty temporary directory (for module:function workloads)."""
    monkeypatch.chdir(tmp_path)
    return tmp_path
