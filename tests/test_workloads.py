"""The workload protocol: built-ins, module:function factories, and the errors for broken ones."""

import textwrap

import pytest
import torch

from regen.errors import WorkloadError
from regen.workloads import build_workload, forward_loss, load_config


@pytest.mark.parametrize("name", ["mlp", "cnn", "gpt", "hf-gpt2", "hf-bert", "hf-llama"])
def test_builtin_workloads_give_a_scalar_loss_with_gradients(name):
    w = build_workload(name, batch_size=2)
    loss = forward_loss(w)
    assert loss.dim() == 0 and torch.isfinite(loss)
    loss.backward()
    grads = [p.grad for p in w.model.parameters() if p.requires_grad]
    assert grads and all(g is not None for g in grads)


def test_batch_size_reaches_the_factory():
    w = build_workload("mlp", batch_size=5)
    assert w.batch[0].shape[0] == 5


def test_user_factory_from_the_current_directory(tmp_cwd):
    (tmp_cwd / "mywork.py").write_text(textwrap.dedent("""
        import torch
        def build(batch_size=3):
            model = torch.nn.Linear(4, 1)
            return model, (torch.randn(batch_size, 4),), lambda out, batch: out.pow(2).mean()
        def no_batch():
            return torch.nn.Linear(4, 1), (torch.randn(2, 4),)
        def broken():
            return 42
        def raises():
            raise RuntimeError("boom in factory")
    """))
    w = build_workload("mywork:build", batch_size=7)
    assert w.batch[0].shape == (7, 4)
    with pytest.raises(WorkloadError, match="does not take a batch_size"):
        build_workload("mywork:no_batch", batch_size=2)
    with pytest.raises(WorkloadError, match=r"must return \(model, batch\)"):
        build_workload("mywork:broken")
    with pytest.raises(WorkloadError, match="boom in factory"):
        build_workload("mywork:raises")
    with pytest.raises(WorkloadError, match="cannot find the loss"):
        forward_loss(build_workload("mywork:no_batch"))


def test_unknown_workloads_are_clear_errors(tmp_cwd):
    with pytest.raises(WorkloadError, match="unknown workload 'resnet9000'"):
        build_workload("resnet9000")
    with pytest.raises(WorkloadError, match="cannot import module"):
        build_workload("no_such_module_xyz:build")


def test_configs_name_a_workload(tmp_path):
    import pathlib

    configs = sorted(pathlib.Path(__file__).parents[1].joinpath("configs").glob("*.yaml"))
    assert configs
    for path in configs:
        cfg = load_config(path)
        assert cfg["workload"]
    bad = tmp_path / "bad.yaml"
    bad.write_text("args: {}\n")
    with pytest.raises(WorkloadError, match="needs a 'workload' key"):
        load_config(bad)
