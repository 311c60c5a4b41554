"""Key/value caches off in training steps (regen.caches): while regen profiles a step and while a handle of
regen.apply is in place, a model built at its config's defaults (`use_cache=True`) trains without the
cache, as Hugging Face's own checkpointing and Trainer run it; the user's setting comes back after."""

import warnings

import pytest
import torch

import regen
from regen.caches import TrainingCacheNotice, training_caches_off
from regen.workloads import build_workload, training_step

pytest.importorskip("transformers")


def _qwen3():
    return build_workload("regen.zoo:qwen3", batch_size=2)


def test_every_config_that_caches_is_turned_off_and_put_back():
    w = _qwen3()
    assert w.model.config.use_cache is True  # the default as shipped
    turned = training_caches_off(w.model)
    assert turned and w.model.config.use_cache is False
    out = w.model(**w.batch)
    assert out.past_key_values is None
    turned.restore()
    assert w.model.config.use_cache is True
    assert not training_caches_off(torch.nn.Linear(2, 2))  # nothing to turn off: nothing to say


def test_the_profile_is_taken_without_the_cache_and_says_so():
    from regen.profiler import profile_workload

    w = _qwen3()
    profile = profile_workload(w, device="cpu", repeats=1, warmup_steps=0, progress=None)
    assert any("key/value cache: off" in n for n in profile.notes)
    assert w.model.config.use_cache is True
    # with the cache on, every attention call appends its keys and values to it: state left behind
    assert profile.module_calls and not any(c.leaves_behind for c in profile.module_calls)


@pytest.mark.parametrize("dynamic", [False, True])
def test_a_handle_turns_the_cache_off_with_one_notice_and_restores_it(dynamic):
    """Dynamic mode's handle, and a plan's (a keep-all plan of the profile taken without the cache)."""
    from regen.planner import solve
    from regen.profiler import profile_workload

    w = _qwen3()
    if not dynamic:
        plan = solve(profile_workload(w, device="cpu", repeats=1, warmup_steps=0, progress=None),
                     memory_cap_bytes=2 ** 40, strategy="keep-all")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        handle = (regen.apply(w.model, memory_cap="1GiB") if dynamic else
                  regen.apply(w.model, plan, on_mismatch="raise"))
        with handle:
            assert w.model.config.use_cache is False
            training_step(w)
            training_step(w)
    notices = [c for c in caught if issubclass(c.category, TrainingCacheNotice)]
    assert len(notices) == 1 and "use_cache=False" in str(notices[0].message)
    assert notices[0].filename == __file__  # points at the caller's line
    assert w.model.config.use_cache is True


def _mamba2():
    """A tiny Mamba2 at its defaults (`use_cache=True`; the slow path: no CUDA kernels on a CPU), dropout-free."""
    from transformers import Mamba2Config, Mamba2ForCausalLM

    from regen.workloads import Workload

    torch.manual_seed(0)
    config = Mamba2Config(vocab_size=64, hidden_size=32, num_hidden_layers=2, num_heads=4, head_dim=16,
                          state_size=8, n_groups=1, chunk_size=8)
    ids = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(0))
    return Workload(name="mamba2", model=Mamba2ForCausalLM(config), batch={"input_ids": ids, "labels": ids.clone()},
                    loss_fn=None)


def _loss_grads_and_buffers(w) -> tuple:
    loss = training_step(w).detach()
    grads = {n: p.grad.clone() for n, p in w.model.named_parameters()}
    w.model.zero_grad(set_to_none=True)
    return loss, grads, {n: b.clone() for n, b in w.model.named_buffers()}


def test_a_model_whose_cache_changes_its_numerics_trains_as_with_the_cache_off():
    """Mamba2's scan also computes the final recurrent state when it has a cache to put it in, and that changes
    its backward's reductions: with the cache on its gradients differ from the cache-off ones in the last bits.
    regen's steps run with the cache off, so they equal the unplanned cache-off steps (what Hugging Face's
    Trainer and checkpointing run) bit for bit, under a plan that recomputes."""
    from regen.planner import solve
    from regen.profiler import profile_workload

    w = _mamba2()
    with training_caches_off(w.model):
        reference = _loss_grads_and_buffers(w)
    cache_on = _loss_grads_and_buffers(w)
    assert any(not torch.equal(reference[1][k], cache_on[1][k]) for k in reference[1])  # why this test exists
    profile = profile_workload(w, device="cpu", repeats=1, warmup_steps=1, progress=None)
    increase = profile.peak_bytes - profile.memory_at_start_bytes
    plan = solve(profile, profile.memory_at_start_bytes + increase * 3 // 4, "recompute")
    assert plan.action_counts()["recompute"] > 0
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", TrainingCacheNotice)
        with regen.apply(w.model, plan, on_mismatch="raise") as handle:
            got = [_loss_grads_and_buffers(w) for _ in range(2)]
    assert handle.stats.planned_steps == 2
    for loss, grads, buffers in got:
        assert torch.equal(loss, reference[0])
        assert all(torch.equal(grads[k], reference[1][k]) for k in reference[1])
        assert buffers.keys() == reference[2].keys()
        assert all(torch.equal(buffers[k], reference[2][k]) for k in reference[2])
