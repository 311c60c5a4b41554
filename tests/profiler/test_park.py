"""Parked profiles (`regen profile --park`): the same records as a normal profile, recorded with saved
tensors held outside the device's allocator."""

import dataclasses

import pytest
import torch

from regen.caches import training_caches_off
from regen.cli import main
from regen.formats import load_profile
from regen.measure import measure_memory
from regen.profiler.record import record_step
from regen.workloads import training_step
from tests.profiler.conftest import build_small

WORKLOADS = ["mlp", "cnn", "gpt", "hf-gpt2", "hf-bert"]
BERT_ARGS = {"seq_len": 32, "num_layers": 2, "hidden": 64, "n_head": 4, "vocab_size": 256}
PEAK_TOLERANCE = 0.01
HELD_TOLERANCE = 1.05  # the allocator against the bookkeeping's parked timeline


def _build(name):
    """The workload, its key/value cache off as `regen profile` turns it off around record_step (regen.caches)."""
    if name == "hf-bert":
        from regen.workloads import build_workload

        workload = build_workload("hf-bert", batch_size=2, args=BERT_ARGS)
    else:
        workload = build_small(name)
    training_caches_off(workload.model)
    return workload


def _recorded(name, park):
    """A fresh workload's recorded step (after one warm-up step, gradients cleared), and the workload."""
    workload = _build(name)
    training_step(workload)
    for p in workload.model.parameters():
        p.grad = None
    return record_step(workload, torch.device("cpu"), park=park), workload


def _peak(capture):
    return max(op.memory_peak_bytes for op in capture.ops)


@pytest.mark.parametrize("name", WORKLOADS)
def test_a_parked_recording_equals_a_normal_one(name):
    normal, _ = _recorded(name, park=False)
    parked, _ = _recorded(name, park=True)
    assert [op.name for op in parked.ops] == [op.name for op in normal.ops]
    assert [(op.inputs, op.outputs, op.phase, op.module) for op in parked.ops] == \
        [(op.inputs, op.outputs, op.phase, op.module) for op in normal.ops]
    assert [dataclasses.asdict(s) for s in parked.saved_tensors] == [dataclasses.asdict(s) for s in normal.saved_tensors]
    assert [dataclasses.asdict(e) for e in parked.saved_entries] == [dataclasses.asdict(e) for e in normal.saved_entries]
    assert [(t.shape, t.dtype, t.storage, t.kind) for t in parked.tensors] == \
        [(t.shape, t.dtype, t.storage, t.kind) for t in normal.tensors]
    assert parked.memory_at_start_bytes == normal.memory_at_start_bytes
    assert abs(_peak(parked) - _peak(normal)) <= PEAK_TOLERANCE * _peak(normal)


@pytest.mark.parametrize("name", ["gpt", "hf-gpt2"])
def test_a_parked_recording_holds_the_start_plus_the_transients(name):
    measured, captures = {}, {}
    for park in (False, True):
        workload = _build(name)
        training_step(workload)
        for p in workload.model.parameters():
            p.grad = None
        measured[park] = measure_memory(
            lambda: captures.setdefault(park, record_step(workload, torch.device("cpu"), park=park))).peak_increase_bytes
    normal = captures[False]
    saved_bytes = sum(s.bytes for s in normal.saved_tensors)
    # The parked step's own timeline, from the bookkeeping: the unplanned level less the saved tensors that
    # are parked at that op (from after their last forward use to their first backward use).
    parked_at = [0] * len(normal.ops)
    for s in normal.saved_tensors:
        back = min(s.backward_uses, default=len(normal.ops))
        for i in range(s.last_forward_use + 1, back):
            parked_at[i] += s.bytes
    held = max(op.memory_peak_bytes - off for op, off in zip(normal.ops, parked_at)) - normal.memory_at_start_bytes
    print(f"{name}: allocator peak increase {measured[False]} B unparked, {measured[True]} B parked; saved "
          f"{saved_bytes} B; parked timeline's peak increase {held} B")
    assert measured[True] <= measured[False] - saved_bytes // 2
    assert measured[True] <= HELD_TOLERANCE * held

def test_profile_park_on_the_command_line(tmp_path, capsys):
    normal, parked = tmp_path / "normal.profile.yaml", tmp_path / "parked.profile.yaml"
    common = ["profile", "--model", "gpt", "--batch-size", "2", "--arg", "d_model=32", "--arg", "n_layer=1",
              "--arg", "context=16", "--arg", "vocab_size=64", "--repeats", "1"]
    assert main(common + ["-o", str(normal)]) == 0
    assert main(common + ["--park", "-o", str(parked)]) == 0
    assert "saved tensors parked in host memory" in capsys.readouterr().err
    a, b = load_profile(normal), load_profile(parked)
    assert [op.name for op in a.ops] == [op.name for op in b.ops]
    assert [s.bytes for s in a.saved_tensors] == [s.bytes for s in b.saved_tensors]
    assert a.fingerprint == b.fingerprint
    assert abs(a.peak_bytes - b.peak_bytes) <= PEAK_TOLERANCE * a.peak_bytes
    assert any("recorded parked" in note for note in b.notes)
    assert all(op.time_s > 0 for op in b.ops)
