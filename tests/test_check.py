"""`regen check`: a plan that gives the same result passes; any difference fails with exit 1, unless the model
does not reproduce its own unplanned results (inconclusive, exit 3)."""

import textwrap

import torch

from regen.cli import main

MLP = ["--model", "mlp", "--batch-size", "256", "--arg", "in_features=64", "--arg", "hidden=128", "--arg", "depth=4"]

DRIFTING = """
    import torch
    from torch import nn

    CALLS = [0]

    class Drifting(nn.Module):
        '''Each forward adds how many forwards ran before: a second run gives another loss, with or without
        regen (as a model reseeding from torch.seed() in its forward does: Hugging Face's Reformer).'''

        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(16, 16)

        def forward(self, x):
            CALLS[0] += 1
            return (self.fc(x).relu() + CALLS[0]).pow(2).mean()
    """


def plan_for(tmp_path, workload_args, strategy="recompute", cap="90%"):
    profile, plan = tmp_path / "w.profile.yaml", tmp_path / "w.plan.yaml"
    assert main(["profile", *workload_args, "--repeats", "1", "-o", str(profile), "-q"]) == 0
    assert main(["solve", str(profile), "--memory-cap", cap, "--strategy", strategy, "-o", str(plan), "-q"]) == 0
    return plan


BUILD = """
def build(batch_size=8):
    torch.manual_seed(0)
    return {model}(), torch.randn(batch_size, 16)
"""


def check_a_module(tmp_cwd, module: str, source: str, model: str) -> int:
    """`regen check`'s exit code for `module:build` (its `source`, defining the module class `model`, written to
    the working directory with a `build` of it) under a keep-all plan: regen changes nothing, so what differs
    is the model's own doing."""
    (tmp_cwd / f"{module}.py").write_text(textwrap.dedent(source) + BUILD.format(model=model))
    args = ["--model", f"{module}:build"]
    plan = plan_for(tmp_cwd, args, strategy="keep-all", cap="100%")
    return main(["check", *args, "--plan", str(plan), "--steps", "1", "-q"])


def test_a_plan_that_gives_the_same_result_passes(tmp_path, capsys):
    plan = plan_for(tmp_path, MLP)
    assert main(["check", *MLP, "--plan", str(plan), "--steps", "1", "-q"]) == 0
    out = capsys.readouterr().out
    assert "same" in out and "PASS" in out and "peak memory" in out and "within" in out
    assert "predicted by the plan" in out


def test_any_difference_fails(tmp_path, capsys, monkeypatch):
    """A recompute that rebuilds a slightly wrong value (injected here) fails the check."""
    from regen.runtime import recompute

    plan = plan_for(tmp_path, MLP)
    replay = recompute._run_with_rng

    def off_by_a_little(cap, args, kwargs):
        out = replay(cap, args, kwargs)
        return out * (1 + 1e-6) if isinstance(out, torch.Tensor) and out.is_floating_point() else out

    monkeypatch.setattr(recompute, "_run_with_rng", off_by_a_little)
    assert main(["check", *MLP, "--plan", str(plan), "--steps", "1", "-q"]) == 1
    out = capsys.readouterr().out
    assert "FAIL" in out and "DIFFER" in out and "gradient of" in out and "does not reproduce" not in out


def test_a_model_that_does_not_reproduce_itself_is_inconclusive(tmp_cwd, capsys):
    """Its unplanned steps differ from run to run: a third copy shows it, and the check says it cannot judge."""
    assert check_a_module(tmp_cwd, "drifting", DRIFTING, "Drifting") == 3
    out = capsys.readouterr().out
    assert "INCONCLUSIVE" in out and "loss (max |difference|" in out
    assert "does not reproduce itself" in out and "FAIL" not in out


def test_check_needs_a_workload_and_a_readable_plan(tmp_path, capsys):
    assert main(["check", "--plan", str(tmp_path / "none.yaml"), *MLP]) == 2
    assert "no such file" in capsys.readouterr().err


COUNTING = '''
    import torch
    from torch import nn

    class Counting(nn.Module):
        """The loss of a plain layer; a buffer counts forwards, twice when a forward hook is on the model (regen's
        handle puts its own there): only the buffers differ, and only under regen."""

        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(16, 16)
            self.register_buffer("seen", torch.zeros(()))

        def forward(self, x):
            self.seen += 2 if self._forward_pre_hooks or self._forward_hooks else 1
            return self.fc(x).relu().pow(2).mean()
    '''


BUILT_AT_FIRST_CALL = """
    import torch
    from torch import nn

    class BuiltAtFirstCall(nn.Module):
        '''Sets a buffer at its first call, midway through its forward (BigBird builds modules so).'''

        def __init__(self):
            super().__init__()
            self.a, self.b = nn.Linear(16, 32), nn.Linear(32, 1)
            self.register_buffer("scale", torch.zeros(32))
            self.built = False

        def forward(self, x):
            h = torch.tanh(self.a(x))
            if not self.built:
                self.scale.fill_(0.5)
                self.built = True
            return self.b(torch.tanh(h * self.scale)).pow(2).mean()
    """


def test_a_model_whose_first_forward_differs_is_checked_on_its_later_steps(tmp_cwd, capsys):
    """The profile records a step after its warm-up; the check compares steps after one unplanned step of each."""
    assert check_a_module(tmp_cwd, "first_call", BUILT_AT_FIRST_CALL, "BuiltAtFirstCall") == 0
    assert "PASS" in capsys.readouterr().out


def test_a_buffer_that_differs_fails(tmp_cwd, capsys):
    """Loss and gradients equal, one module buffer not: the check compares buffers too."""
    assert check_a_module(tmp_cwd, "counting", COUNTING, "Counting") == 1
    out = capsys.readouterr().out
    assert "FAIL" in out and "1 DIFFER" in out and "buffer seen" in out


NOISY = '''
    import numpy
    import torch
    from torch import nn

    class Noisy(nn.Module):
        """A mask drawn from NumPy's global RNG in the forward, as older data-noise code does."""

        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(16, 16)

        def forward(self, x):
            keep = torch.from_numpy(numpy.random.rand(*x.shape) > 0.3)
            return (self.fc(x) * keep).relu().pow(2).mean()
    '''


def test_steps_that_draw_from_numpy_compare_from_the_same_numpy_state(tmp_cwd, capsys):
    """The unplanned and the planned step draw the same mask: the check seeds NumPy (and Python) as torch."""
    assert check_a_module(tmp_cwd, "noisy", NOISY, "Noisy") == 0
    assert "PASS" in capsys.readouterr().out


def test_later_steps_are_compared_too_when_asked(tmp_path):
    """compared_steps=3: the verified step and two on the pack-order fast path, each bit for bit, all planned."""
    from regen.check import check_plan
    from regen.formats import load_plan
    from regen.workloads import build_workload

    plan = load_plan(plan_for(tmp_path, MLP))
    report = check_plan(lambda: build_workload("mlp", batch_size=256, args={"in_features": 64, "hidden": 128,
                                                                             "depth": 4}),
                        plan, timed_steps=1, compared_steps=3)
    assert report.passed and report.differences == []
    assert report.compared_tensors == 3 * (1 + 2 * 5)  # per step: the loss and 5 layers' weight and bias
    assert report.planned_steps >= 3


CACHE_NUMERICS = """
    import types

    import torch
    from torch import nn

    class CacheNumerics(nn.Module):
        '''A model whose `config.use_cache` changes its numbers a little (as Mamba2's cache path does):
        with the cache on, the scale is applied in two steps.'''

        def __init__(self):
            super().__init__()
            self.config = types.SimpleNamespace(use_cache=True)
            self.fc = nn.Linear(16, 16)

        def forward(self, x):
            h = self.fc(x)
            h = h * 0.1 * 3.0 if self.config.use_cache else h * 0.3
            return h.pow(2).mean()
    """


def test_both_steps_run_with_the_training_cache_off_as_the_plan_does(tmp_cwd, capsys):
    """regen trains with `config.use_cache` off (regen.caches): the unplanned step it compares with runs so too
    (compared with the model's own setting, a keep-all plan would differ)."""
    assert check_a_module(tmp_cwd, "cache_numerics", CACHE_NUMERICS, "CacheNumerics") == 0
    assert "PASS" in capsys.readouterr().out


def test_dynamic_mode_is_checked_like_a_plan():
    """`check_dynamic`: dynamic mode under a cap gives the unplanned step's loss, gradients and buffers, and
    its measured peak is the allocator's, on the cap's scale (parameters and buffers at the start)."""
    from regen.check import check_dynamic
    from regen.measure import measure_memory
    from regen.runtime.dynamic.cap_memory import model_storages
    from regen.workloads import build_workload, training_step

    def build():
        return build_workload("mlp", batch_size=256, args={"in_features": 64, "hidden": 128, "depth": 4})

    w = build()
    training_step(w)
    w.model.zero_grad(set_to_none=True)
    increase = measure_memory(lambda: training_step(w)).peak_increase_bytes
    cap = sum(model_storages(w.model).values()) + increase // 2
    report = check_dynamic(build, cap, timed_steps=1, compared_steps=2)
    assert not report.differences and report.compared_tensors > 2
    assert report.planned_steps == 2 + 1 + 1  # compared, timed, measured
    assert report.within_cap and report.planned_peak_bytes < report.unplanned_peak_bytes
