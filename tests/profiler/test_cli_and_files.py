"""`regen profile` and `regen show` on profiles: errors as one line and a non-zero exit, summaries, file io."""

import json
import subprocess
import sys
import textwrap
import time

import pytest

from regen.cli import main
from regen.formats import PROFILE_FORMAT, load_profile, save_profile
from regen.show import profile_summary, profile_summary_json

JSON_KEYS = {"ops", "saved_tensors", "candidate_bytes", "peak_bytes", "step_time_s", "device"}
LOAD_BOUND_S = 3.0  # about a second measured (C loader); the pure-Python loader is ~3x slower and fails this


def write_module(directory, name, body):
    (directory / f"{name}.py").write_text(textwrap.dedent(body))


def test_profile_then_show(tmp_path, capsys):
    out = tmp_path / "mlp.profile.yaml"
    assert main(["profile", "--model", "mlp", "--batch-size", "8", "--arg", "hidden=32", "--arg", "depth=2",
                 "--repeats", "1", "-o", str(out)]) == 0
    err = capsys.readouterr().err
    assert "recording one step" in err and "wrote" in err and "calibration: round 2 (at most 3)" in err
    profile = load_profile(out)
    assert profile.workload == {"name": "mlp", "args": {"hidden": 32, "depth": 2}, "batch_size": 8}
    assert profile.calibration is not None

    assert main(["show", str(out)]) == 0
    text = capsys.readouterr().out
    assert "calibration: " in text and " ms a planned step, recompute x" in text
    peak_op = profile.peak_op()
    assert f"ops: {len(profile.ops)}" in text
    assert f"{len(profile.saved_tensors)} candidates" in text
    assert f"at op {peak_op.index} {peak_op.name}" in text
    made = [g.after_op for g in profile.gradients_made]
    assert f"(made after ops {min(made)}..{max(made)})" in text
    assert "largest saved tensors" in text

    assert main(["show", str(out), "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert JSON_KEYS <= set(data)
    assert data["ops"] == len(profile.ops) and data["saved_tensors"] == len(profile.saved_tensors)
    assert data["candidate_bytes"] == profile.candidate_bytes and data["peak_bytes"] == profile.peak_bytes
    assert data["device"]["type"] == "cpu"
    assert data["peak_op"]["index"] == peak_op.index


def test_quiet_profile_prints_no_progress(tmp_path, capsys):
    out = tmp_path / "p.yaml"
    assert main(["profile", "--model", "mlp", "--arg", "hidden=32", "--repeats", "1", "-q", "--no-calibrate",
                 "-o", str(out)]) == 0
    assert "recording" not in capsys.readouterr().err
    assert load_profile(out).calibration is None


# A model whose forward raises: ValueError from the user's own code, IndexError from an aten op.
BROKEN_FORWARD_MODULE = """
    import torch
    from torch import nn

    class Net(nn.Module):
        def __init__(self, fail):
            super().__init__()
            self.lin = nn.Linear(4, 4)
            self.fail = fail

        def forward(self, x):
            if self.fail == "python":
                raise ValueError("shapes do not line up")
            return self.lin(x)[:, 99].sum()

    def raises_in_python():
        return Net("python"), (torch.randn(2, 4),)

    def raises_in_an_op():
        return Net("op"), (torch.randn(2, 4),)
    """


def test_a_forward_that_raises_is_one_clear_error(tmp_cwd, capsys):
    write_module(tmp_cwd, "broken_fwd", BROKEN_FORWARD_MODULE)
    code = main(["profile", "--model", "broken_fwd:raises_in_python", "-o", str(tmp_cwd / "p.yaml")])
    err = capsys.readouterr().err
    assert code != 0
    assert ("error: workload 'broken_fwd:raises_in_python': the forward raised ValueError: shapes do not line up"
            in err)
    assert not (tmp_cwd / "p.yaml").exists()


def test_a_forward_that_raises_exits_non_zero_without_traceback(tmp_cwd):
    write_module(tmp_cwd, "broken_fwd", BROKEN_FORWARD_MODULE)
    proc = subprocess.run([sys.executable, "-m", "regen.cli", "profile", "--model", "broken_fwd:raises_in_an_op",
                           "-o", "p.yaml"], capture_output=True, text=True, cwd=tmp_cwd)
    assert proc.returncode != 0
    assert "error: workload 'broken_fwd:raises_in_an_op': the forward raised IndexError" in proc.stderr
    assert "Traceback" not in proc.stderr


def test_a_factory_that_breaks_the_protocol(tmp_cwd, capsys):
    write_module(tmp_cwd, "bad_factory", """
        from torch import nn

        def build():
            return nn.Linear(4, 4)  # no batch
        """)
    code = main(["profile", "--model", "bad_factory:build", "-o", str(tmp_cwd / "p.yaml")])
    assert code != 0
    assert "must return (model, batch) or (model, batch, loss_fn)" in capsys.readouterr().err


def test_a_loss_that_cannot_be_found(tmp_cwd, capsys):
    write_module(tmp_cwd, "no_loss", """
        import torch
        from torch import nn

        def build():
            return nn.Linear(4, 4), (torch.randn(2, 4),)  # output is not a scalar, no loss_fn
        """)
    code = main(["profile", "--model", "no_loss:build", "-o", str(tmp_cwd / "p.yaml")])
    assert code != 0
    assert "cannot find the loss" in capsys.readouterr().err


def test_an_unknown_workload_name(tmp_path, capsys):
    code = main(["profile", "--model", "resnet9000", "-o", str(tmp_path / "p.yaml")])
    assert code != 0
    err = capsys.readouterr().err
    assert "error: unknown workload 'resnet9000'" in err and "mlp" in err


@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="checks the refusal where there is no CUDA")
def test_cuda_where_there_is_none(tmp_path, capsys):
    code = main(["profile", "--model", "mlp", "--device", "cuda", "-o", str(tmp_path / "p.yaml")])
    assert code != 0
    assert "no CUDA device" in capsys.readouterr().err


@pytest.fixture(scope="module")
def saved_profile(tmp_path_factory, profiled):
    _, profile = profiled("mlp")
    path = tmp_path_factory.mktemp("profiles") / "mlp.profile.yaml"
    save_profile(profile, path)
    return profile, path


def test_round_trip(saved_profile):
    profile, path = saved_profile
    loaded = load_profile(path)
    assert loaded == profile
    assert profile_summary(loaded) == profile_summary(profile)
    assert json.dumps(profile_summary_json(loaded)) == json.dumps(profile_summary_json(profile))


@pytest.mark.parametrize("edit, message", [
    (lambda text: text.replace(f'"format": "{PROFILE_FORMAT}"', '"format": "regen-profile/7"'),
     "format 'regen-profile/7' is not supported"),
    (lambda text: text.replace('"peak_bytes":', '"peak_bytez":', 1), "missing field 'peak_bytes'"),
    (lambda text: text[: len(text) // 2] + "\n  - [unclosed\n", "not valid YAML"),
])
def test_bad_profiles_through_show(saved_profile, tmp_path, capsys, edit, message):
    _, path = saved_profile
    bad = tmp_path / "bad.profile.yaml"
    bad.write_text(edit(path.read_text()))
    code = main(["show", str(bad)])
    err = capsys.readouterr().err
    assert code != 0
    assert err.startswith("error: ") and message in err and "Traceback" not in err


@pytest.mark.slow
def test_a_profile_of_thousands_of_ops_loads_quickly(profile_small, tmp_path):
    # op count depends on the depth, not the widths: a deep, narrow GPT keeps the profiling itself cheap
    _, profile = profile_small("gpt", repeats=1, n_layer=12, d_model=32, n_head=2, context=16, vocab_size=64)
    assert len(profile.ops) >= 2000
    path = tmp_path / "big.profile.yaml"
    save_profile(profile, path)
    t0 = time.perf_counter()
    loaded = load_profile(path)
    load_s = time.perf_counter() - t0
    print(f"loaded {len(loaded.ops)} ops, {len(loaded.tensors)} tensors, "
          f"{path.stat().st_size / 1e6:.1f} MB in {load_s:.2f} s")
    assert len(loaded.ops) == len(profile.ops)
    assert load_s < LOAD_BOUND_S


def test_a_forward_returning_a_dict_with_a_loss(tmp_cwd, capsys):
    write_module(tmp_cwd, "dict_loss", """
        import torch
        from torch import nn

        class Model(nn.Module):
            def __init__(self):
                super().__init__()
                self.fc = nn.Linear(8, 8)

            def forward(self, x):
                logits = self.fc(x).relu()
                return {"loss": logits.pow(2).mean(), "logits": logits}

        def build():
            return Model(), torch.randn(4, 8)
        """)
    assert main(["profile", "--model", "dict_loss:build", "--repeats", "1", "-o", str(tmp_cwd / "p.yaml"), "-q"]) == 0
    from regen.formats import load_profile

    profile = load_profile(tmp_cwd / "p.yaml")
    assert profile.saved_tensors and any(op.phase == "backward" for op in profile.ops)


@pytest.mark.parametrize("reentrant", [True, False])
def test_activation_checkpointing_inside_the_model(tmp_cwd, capsys, reentrant):
    """Reentrant checkpointing saves tensors during backward, when it re-runs the forward: those saves are
    a phase of their own, never attributed to forward ops. Profile, solve and a planned step work, with
    the unplanned gradients; the profile notes that the model checkpoints itself, and `regen solve` says so."""
    import torch

    import regen
    from regen.formats import load_plan, load_profile
    from regen.formats.profile import OTHER_HOOKS_ADVICE
    from regen.workloads import build_workload, training_step

    write_module(tmp_cwd, "ckpt", f"""
        import torch
        from torch import nn
        from torch.utils.checkpoint import checkpoint

        class Model(nn.Module):
            def __init__(self):
                super().__init__()
                torch.manual_seed(0)
                self.a, self.b, self.c = nn.Linear(64, 64), nn.Linear(64, 64), nn.Linear(64, 64)

            def forward(self, x):
                x = self.a(x).tanh()
                x = checkpoint(lambda y: self.b(y).relu(), x, use_reentrant={reentrant})
                return self.c(x).tanh().pow(2).mean()

        def build():
            torch.manual_seed(1)
            return Model(), torch.randn(256, 64)
        """)
    profile_path, plan_path = tmp_cwd / "p.yaml", tmp_cwd / "plan.yaml"
    assert main(["profile", "--model", "ckpt:build", "--repeats", "1", "-o", str(profile_path), "-q"]) == 0
    assert sum(OTHER_HOOKS_ADVICE in note for note in load_profile(profile_path).notes) == 1
    capsys.readouterr()
    assert main(["solve", str(profile_path), "--memory-cap", "95%", "--strategy", "recompute", "-o",
                 str(plan_path)]) == 0
    assert capsys.readouterr().err.count(f"{OTHER_HOOKS_ADVICE}\n") == 1
    plan = load_plan(plan_path)
    assert plan.action_counts()["recompute"] > 0
    plain, planned = build_workload("ckpt:build"), build_workload("ckpt:build")
    torch.manual_seed(2)
    loss = training_step(plain)
    with regen.apply(planned.model, plan) as handle:
        torch.manual_seed(2)
        assert torch.equal(training_step(planned), loss)
    assert handle.stats.planned_steps == 1 and handle.stats.dropped_tensors > 0
    for p, q in zip(plain.model.parameters(), planned.model.parameters()):
        assert torch.equal(p.grad, q.grad)
