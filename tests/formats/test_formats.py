"""Profile and plan files: round trips, and clear errors for malformed files and unknown versions."""

import pytest
import torch

import regen
from regen.errors import FormatError
from regen.formats import (DeviceInfo, Decision, OpRecord, Plan, PlanFigures, Profile, SavedTensor,
                           SolverReport, StaticMemory, TensorRecord, load_plan, load_profile, save_plan,
                           save_profile)
from regen.formats.yamlio import dump_document


def tiny_profile() -> Profile:
    ops = [OpRecord(index=0, name="aten.relu.default", phase="forward", time_s=1e-3, inputs=[0], outputs=[1],
                    memory_after_bytes=200, memory_peak_bytes=200),
           OpRecord(index=1, name="aten.threshold_backward.default", phase="backward", time_s=1e-3,
                    inputs=[2, 1], outputs=[3], memory_after_bytes=300, memory_peak_bytes=300)]
    tensors = [TensorRecord(id=i, shape=[10], dtype="torch.float32", bytes=40, storage=i, storage_bytes=40,
                            kind="input" if i == 0 else "activation", producer_op=None if i == 0 else 0,
                            output_slot=None if i == 0 else 0) for i in range(4)]
    saved = [SavedTensor(id=0, tensor=1, storage=1, producer_op=0, output_slot=0, bytes=40, shape=[10],
                         dtype="torch.float32", last_forward_use=0, backward_uses=[1], entries=[])]
    return Profile(workload={"name": "t"}, device=DeviceInfo("cpu", "cpu", 1 << 30, 1e9, 1e9, "memcpy"),
                   static_memory=StaticMemory(0, 0, 0), versions={"torch": "x"}, repeats=1, step_time_s=2e-3,
                   optimizer_step_time_s=0.0, memory_at_start_bytes=100, peak_bytes=300, fingerprint="1:ab",
                   ops=ops, tensors=tensors, saved_entries=[], saved_tensors=saved)


def tiny_plan() -> Plan:
    fig = PlanFigures(peak_bytes=300, step_time_s=2e-3)
    return Plan(fingerprint="1:ab", workload={"name": "t"}, strategy="hybrid", memory_cap_bytes=300,
                baseline=fig, predicted=fig, simulated=fig,
                solver=SolverReport("highs", "optimal", 2e-3, 2e-3, 0.0, 0.1), d2h_bytes_per_s=1e9,
                h2d_bytes_per_s=1e9, host_pool_bytes=0, num_forward_ops=1,
                decisions=[Decision(saved_tensor=0, producer_op=0, output_slot=0, shape=[10],
                                    dtype="torch.float32", bytes=40, action="keep")])


def test_profile_round_trip(tmp_path):
    p = tiny_profile()
    save_profile(p, tmp_path / "p.yaml")
    q = load_profile(tmp_path / "p.yaml")
    assert q == p
    assert q.saved_tensors[0].first_backward_use == 1


def test_a_version_1_profile_loads_without_held_until(tmp_path):
    """regen-profile/1 files have no held_until_op: it loads as None (the last forward use)."""
    p = tiny_profile()
    p.saved_tensors[0].held_until_op = 1
    document = p.to_dict()
    assert document["format"] == "regen-profile/2" and document["saved_tensors"][0]["held_until_op"] == 1
    document["format"] = "regen-profile/1"
    del document["saved_tensors"][0]["held_until_op"]
    old = tmp_path / "old.yaml"
    dump_document(document, old)  # as version 1 files were written: YAML's block style
    q = load_profile(old)
    assert q.saved_tensors[0].held_until_op is None and q.format == "regen-profile/1"


def test_held_until_outside_the_ops_is_refused(tmp_path):
    p = tiny_profile()
    p.saved_tensors[0].held_until_op = 5
    save_profile(p, tmp_path / "p.yaml")
    with pytest.raises(FormatError, match="held until an op outside"):
        load_profile(tmp_path / "p.yaml")


@pytest.mark.parametrize("made, match", [
    ([{"after_op": 5, "bytes": 8}], "gradients_made\\[0\\] refers to an op outside"),
    ([{"after_op": 0, "bytes": -8}], "must not be negative"),
    ([{"after_op": 0}], "gradients_made\\[0\\]: missing field 'bytes'"),
    ({"after_op": 0, "bytes": 8}, "gradients_made must be a list"),
])
def test_gradients_made_are_checked_on_load(tmp_path, made, match):
    p = tiny_profile()
    document = p.to_dict()
    document["gradients_made"] = made
    dump_document(document, tmp_path / "p.json", as_json=True)
    with pytest.raises(FormatError, match=match):
        load_profile(tmp_path / "p.json")


def test_gradients_made_round_trip(tmp_path):
    from regen.formats.profile import GradientMade

    p = tiny_profile()
    p.gradients_made = [GradientMade(after_op=1, bytes=16)]
    save_profile(p, tmp_path / "p.json")
    assert load_profile(tmp_path / "p.json").gradients_made == p.gradients_made
    p.gradients_made = None
    save_profile(p, tmp_path / "q.json")
    assert load_profile(tmp_path / "q.json").gradients_made is None


def test_plan_round_trip(tmp_path):
    p = tiny_plan()
    save_plan(p, tmp_path / "plan.yaml")
    assert load_plan(tmp_path / "plan.yaml") == p


@pytest.mark.parametrize("text,match", [
    ("format: regen-profile/99\n", "not supported by this regen"),
    ("format: regen-plan/1\n", "expected a regen profile"),
    ("just a string\n", "no 'format' key"),
    ("format: regen-profile/1\nops: [\n", "not valid YAML"),
    ("format: regen-profile/1\nops: []\n", "missing field 'tensors'"),
])
def test_malformed_profiles_are_clear_errors(tmp_path, text, match):
    path = tmp_path / "bad.yaml"
    path.write_text(text)
    with pytest.raises(FormatError, match=match):
        load_profile(path)


def test_plan_with_unknown_action_is_refused(tmp_path):
    plan = tiny_plan()
    plan.decisions[0].action = "teleport"
    save_plan(plan, tmp_path / "plan.yaml")
    with pytest.raises(FormatError, match="action 'teleport'"):
        load_plan(tmp_path / "plan.yaml")
    with pytest.raises(FormatError, match="no such file"):
        load_plan(tmp_path / "missing.yaml")


def test_plan_with_a_rebuilt_with_that_does_not_hold_is_refused(tmp_path):
    plan = tiny_plan()
    host = plan.decisions[0]
    host.action, host.recompute_before_op, host.recipe = "recompute", 1, [0]
    rebuilt = Decision(saved_tensor=1, producer_op=0, output_slot=1, shape=[10], dtype="torch.float32", bytes=40,
                       action="recompute", recompute_before_op=1, recipe=[0], rebuilt_with=0)
    plan.decisions.append(rebuilt)
    save_plan(plan, tmp_path / "ok.yaml")
    assert load_plan(tmp_path / "ok.yaml").decisions[1].rebuilt_with == 0  # round trip
    for breakage in ("host keeps", "recipe outside the host's", "own inputs"):
        bad = tiny_plan()
        bad.decisions = [Decision(**vars(host)), Decision(**vars(rebuilt))]
        if breakage == "host keeps":
            bad.decisions[0].action = "keep"
        elif breakage == "recipe outside the host's":
            bad.decisions[1].recipe = [0, 1]
        else:
            bad.decisions[1].recipe_inputs = [0]
        save_plan(bad, tmp_path / "bad.yaml")
        with pytest.raises(FormatError, match="rebuilt with saved tensor 0"):
            load_plan(tmp_path / "bad.yaml")


def test_runtime_costs_round_trip_and_bad_figures_are_refused(tmp_path):
    from dataclasses import replace

    from regen.formats.profile import RuntimeCosts

    p = replace(tiny_profile(), runtime_costs=RuntimeCosts(3e-6, 4e-5, 5e-5, 1e-6, method="probe", swap_s=3e-5))
    save_profile(p, tmp_path / "p.yaml")
    assert load_profile(tmp_path / "p.yaml") == p
    older = (tmp_path / "p.yaml").read_text().replace(', "swap_s": 3.0e-05', "")  # written before swap_s existed
    assert "swap_s" not in older
    (tmp_path / "older.yaml").write_text(older)
    assert load_profile(tmp_path / "older.yaml").runtime_costs.swap_s == 0.0
    text = (tmp_path / "p.yaml").read_text().replace('"replay_op_s": 5.0e-05', '"replay_op_s": -1.0')
    assert '"replay_op_s": -1.0' in text
    (tmp_path / "bad.yaml").write_text(text)
    with pytest.raises(FormatError, match="runtime_costs: replay_op_s: must not be negative, found -1.0"):
        load_profile(tmp_path / "bad.yaml")


def test_swaps_need_a_release_point_and_older_plans_with_swaps_are_refused(tmp_path):
    plan = tiny_plan()
    d = plan.decisions[0]
    d.action, d.swap_out_after_op, d.swap_in_before_op, d.swap_in_at_unpack = "swap", 0, 1, 0
    d.release_before_op, d.release_at_unpack = 1, 0
    save_plan(plan, tmp_path / "plan.yaml")
    assert load_plan(tmp_path / "plan.yaml") == plan  # round trip, release point included
    text = (tmp_path / "plan.yaml").read_text()
    old = "\n".join(line for line in text.splitlines() if not line.lstrip("- ").startswith("release_"))
    (tmp_path / "old.yaml").write_text(old.replace("regen-plan/2", "regen-plan/1"))
    with pytest.raises(FormatError, match="without a release point.*solve the profile again"):
        load_plan(tmp_path / "old.yaml")
    keep = tiny_plan()
    keep.format = "regen-plan/1"
    save_plan(keep, tmp_path / "keep.yaml")
    assert load_plan(tmp_path / "keep.yaml").decisions == keep.decisions  # nothing to release: still loads
    d.release_at_unpack = None  # in memory, without a position the runtime can act on
    with pytest.raises(FormatError, match="no release point"):
        regen.apply(torch.nn.Linear(2, 2), plan, emulate_link=True)


def _edited(tmp_path, save, original, text: str, replacement: str):
    """`original` saved, then the file with `text` replaced by `replacement` (which must occur)."""
    save(original, tmp_path / "good.yaml")
    document = (tmp_path / "good.yaml").read_text()
    assert text in document
    (tmp_path / "bad.yaml").write_text(document.replace(text, replacement, 1))
    return tmp_path / "bad.yaml"


@pytest.mark.parametrize("text,replacement,match", [
    ('"bytes": 40', '"bytes": "lots"', r"tensors\[0\]: bytes: must be an integer, found str 'lots'"),
    ('"peak_bytes": 300', '"peak_bytes": -300', "peak_bytes: must not be negative, found -300"),
    # not JSON: read as YAML, whose flow style it still is
    ('"step_time_s": 0.002', '"step_time_s": .nan', "step_time_s: must be a finite number, found nan"),
    ('"repeats": 1', '"repeats": true', "repeats: must be an integer, found bool True"),
    ('"backward_uses": [1]', '"backward_uses": ["one"]', r"backward_uses\[0\]: must be an integer, found str .one."),
    ('"name": "aten.relu.default"', '"name": ["aten", "relu"]', r"ops\[0\]: name: must be text, found list"),
])
def test_a_profile_field_of_the_wrong_type_or_range_is_one_format_error(tmp_path, text, replacement, match):
    path = _edited(tmp_path, save_profile, tiny_profile(), text, replacement)
    with pytest.raises(FormatError, match=match) as info:
        load_profile(path)
    assert "\n" not in str(info.value)


def test_a_plan_cut_short_or_with_a_decision_twice_is_refused(tmp_path):
    plan = tiny_plan()
    plan.decisions.append(Decision(saved_tensor=1, producer_op=0, output_slot=1, shape=[10], dtype="torch.float32",
                                   bytes=40, action="keep"))
    plan.num_decisions = 2
    save_plan(plan, tmp_path / "whole.yaml")
    assert len(load_plan(tmp_path / "whole.yaml").decisions) == 2
    cut = plan.decisions.pop()
    save_plan(plan, tmp_path / "cut.yaml")
    with pytest.raises(FormatError, match="holds 1 decisions where its planner wrote 2"):
        load_plan(tmp_path / "cut.yaml")
    plan.decisions += [cut, cut]
    plan.num_decisions = 3
    save_plan(plan, tmp_path / "twice.yaml")
    with pytest.raises(FormatError, match="decisions name saved tensor 1 more than once"):
        load_plan(tmp_path / "twice.yaml")


def test_a_plan_figure_of_the_wrong_type_is_one_format_error(tmp_path):
    path = _edited(tmp_path, save_plan, tiny_plan(), "host_pool_bytes: 0", "host_pool_bytes: 1.5")
    with pytest.raises(FormatError, match="host_pool_bytes: must be an integer, found float 1.5"):
        load_plan(path)
