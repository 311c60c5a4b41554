"""Shared test fixtures. Tests run on CPU; every test uses small models and finishes in seconds."""

import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(__file__))  # plan_choices.py and plans.py, shared by the packages' tests
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
torch.set_num_threads(max(1, min(2, torch.get_num_threads())))


@pytest.fixture
def tmp_cwd(tmp_path, monkeypatch):
    """Run the test from an empty temporary directory (for module:function workloads)."""
    monkeypatch.chdir(tmp_path)
    return tmp_path
