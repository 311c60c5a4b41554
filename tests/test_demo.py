"""`regen demo` end to end on a tiny GPT: it profiles, solves, trains and reports honestly."""

from regen.demo import run_demo


def test_demo_runs_end_to_end_and_writes_its_files(tmp_path, capsys):
    config = tmp_path / "tiny.yaml"
    config.write_text("workload: gpt\nbatch_size: 8\n"
                      "args: {vocab_size: 256, context: 64, d_model: 64, n_layer: 2, n_head: 2, dropout: 0.1}\n")
    messages = []
    code = run_demo(output_dir=tmp_path / "out", config=str(config), progress=messages.append)
    out = capsys.readouterr().out
    assert code == 0, out
    for name in ("demo.profile.yaml", "demo.plan.yaml", "demo.timeline.png"):
        assert (tmp_path / "out" / name).stat().st_size > 0
    assert "gradients match unplanned" in out and "yes (bitwise)" in out
    assert "within the cap" in out
    # measured and predicted step times on one scale (ratios to unplanned), the CPU caveat in the table
    rows = {line.split("  ")[1].strip(): line for line in out.splitlines() if line.startswith("  ")}
    assert "x of unplanned" in rows["step time, planned (measured)"]
    assert "x of unplanned" in rows["step time, planned (predicted)"]
    assert ("not what a GPU's host link costs" in rows["swaps on this CPU"]
            or "recompute only" in rows["swaps on this CPU"])
    assert any(m.startswith("[4/4]") for m in messages)


def test_demo_config_file_matches_the_built_in_demo():
    from pathlib import Path

    from regen.demo import DEMO_WORKLOAD
    from regen.workloads import load_config

    cfg = load_config(Path(__file__).resolve().parents[1] / "configs" / "gpt-demo.yaml")
    assert (cfg["workload"], cfg["batch_size"], cfg["args"]) == (
        DEMO_WORKLOAD["workload"], DEMO_WORKLOAD["batch_size"], DEMO_WORKLOAD["args"])
