"""`regen solve GRAPH.json`: training graphs in node-link JSON, in either published vocabulary, and
general DAGs refused in one line."""

import json

import networkx as nx
import pytest

from regen.cli import main
from regen.formats import load_plan
from regen.graphs import load_node_link

N_FORWARD = 6


def training_graph(time="cost_cpu", memory="cost_ram", backward="backward", scale=1.0) -> nx.DiGraph:
    """A forward chain of N_FORWARD ops mirrored by a backward chain; backward op i reads forward output n-1-i."""
    g = nx.DiGraph()
    n = N_FORWARD
    for i in range(n):
        g.add_node(i, **{time: 1e-3 * scale, memory: (i + 1) * 10**6, backward: False})
        g.add_node(n + i, **{time: 2e-3 * scale, memory: 10**6, backward: True})
    for i in range(n - 1):
        g.add_edge(i, i + 1)
        g.add_edge(n + i, n + i + 1)
    g.add_edge(n - 1, n)
    for i in range(n):
        g.add_edge(n - 1 - i, n + i)
    return g


def write(path, data):
    path.write_text(json.dumps(data))
    return path


def solve_graph(tmp_path, graph_path, name="graph"):
    plan_path = tmp_path / f"{name}.plan.yaml"
    assert main(["solve", str(graph_path), "--memory-cap", "70%", "--bandwidth", "2", "-o", str(plan_path), "-q"]) == 0
    return load_plan(plan_path)


def test_node_link_json_graph_solves(tmp_path, capsys):
    plan = solve_graph(tmp_path, write(tmp_path / "graph.json", nx.node_link_data(training_graph(), edges="links")))
    assert plan.d2h_bytes_per_s == 2e9
    assert len(plan.decisions) == N_FORWARD and plan.action_counts()["keep"] < N_FORWARD
    assert plan.simulated.peak_bytes <= plan.memory_cap_bytes


def test_bad_graph_json_is_a_clear_error(tmp_path, capsys):
    bad = write(tmp_path / "g.json", {"directed": True, "nodes": [{"id": 0, "cost_cpu": 1}], "links": []})
    assert main(["solve", str(bad), "--memory-cap", "1GiB", "-o", str(tmp_path / "p.yaml")]) != 0
    assert "has no 'cost_ram'" in capsys.readouterr().err


def test_general_dag_in_the_other_vocabulary_is_one_clear_line(tmp_path, capsys):
    """Moccasin's random layered graphs: out_cost/duration, no backward flag, endpoints under "0" and "1"."""
    g = nx.gnp_random_graph(12, 0.3, seed=1, directed=True)
    dag = nx.DiGraph([(u, v) for u, v in g.edges() if u < v])
    for v in dag.nodes:
        dag.nodes[v].update(out_cost=10 + v, duration=1 + v % 3)
    data = nx.node_link_data(dag, edges="links", source="0", target="1")
    out = tmp_path / "p.yaml"
    assert main(["solve", str(write(tmp_path / "dag.json", data)), "--memory-cap", "50%", "-o", str(out)]) != 0
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("error:") and "Traceback" not in err
    assert "general DAG, not a training graph" in err and "duration" in err and "out_cost" in err
    assert not out.exists()


def test_names_declared_in_the_graph_attributes_are_read(tmp_path):
    """The same training graph with other attribute names and endpoint keys, declared in `graph`, gives the
    same profile and the same plan as with the default names."""
    plain = nx.node_link_data(training_graph(), edges="links")
    other = nx.node_link_data(training_graph("duration", "out_cost", "is_backward"), edges="links",
                              source="from", target="to")
    other["graph"] = {"time_key": "duration", "memory_key": "out_cost", "backward_key": "is_backward",
                      "source_key": "from", "target_key": "to"}
    a = load_node_link(write(tmp_path / "plain.json", plain))
    b = load_node_link(write(tmp_path / "other.json", other))
    assert [(op.name, op.time_s, op.inputs) for op in a.ops] == [(op.name, op.time_s, op.inputs) for op in b.ops]
    assert a.peak_bytes == b.peak_bytes and a.fingerprint == b.fingerprint
    plan_a = solve_graph(tmp_path, tmp_path / "plain.json", "plain")
    plan_b = solve_graph(tmp_path, tmp_path / "other.json", "other")
    assert [d.action for d in plan_a.decisions] == [d.action for d in plan_b.decisions]


def test_endpoints_under_0_and_1_are_read_without_a_declaration(tmp_path):
    data = nx.node_link_data(training_graph(), edges="links", source="0", target="1")
    profile = load_node_link(write(tmp_path / "g.json", data))
    assert len(profile.saved_tensors) == N_FORWARD


def test_missing_endpoint_key_names_the_key(tmp_path, capsys):
    data = nx.node_link_data(training_graph(), edges="links", source="src", target="dst")
    assert main(["solve", str(write(tmp_path / "g.json", data)), "--memory-cap", "1GiB",
                 "-o", str(tmp_path / "p.yaml")]) != 0
    err = capsys.readouterr().err
    assert "'source'" in err and "source_key" in err and "Traceback" not in err


@pytest.mark.parametrize("declared,shown,seconds_per_unit", [
    (None, "graph time units", 1.0),
    ("cycles", "cycles", 1.0),
    ("ms", "ms", 1e-3),
])
def test_step_times_are_shown_in_the_graph_unit(tmp_path, capsys, declared, shown, seconds_per_unit):
    """Times in the graph's own unit are printed with that unit, never as milliseconds; a declared SI unit
    is converted to seconds."""
    data = nx.node_link_data(training_graph(scale=1e6), edges="links")
    if declared:
        data["graph"] = {"time_unit": declared}
    profile = load_node_link(write(tmp_path / "g.json", data))
    assert profile.ops[0].time_s == pytest.approx(1e3 * seconds_per_unit)
    plan = solve_graph(tmp_path, tmp_path / "g.json")
    capsys.readouterr()
    assert main(["show", str(tmp_path / "graph.plan.yaml")]) == 0
    step_line = next(line for line in capsys.readouterr().out.splitlines() if "step time" in line)
    if shown == "ms":
        assert f"unplanned {plan.baseline.step_time_s * 1e3:.3f} ms" in step_line
    else:
        assert f"unplanned {plan.baseline.step_time_s:,.2f} {shown}" in step_line and " ms" not in step_line
        assert main(["show", str(tmp_path / "graph.plan.yaml"), "--json"]) == 0
        assert json.loads(capsys.readouterr().out)["time_unit"] == shown
