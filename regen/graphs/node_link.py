"""Training graphs in networkx node-link JSON (the form rematerialization papers publish) as profiles.

A training graph's nodes are ops that each produce one tensor, with a time cost, an output size and a
flag saying whether the op belongs to backward; a link says its target reads its source's output.
Forward nodes run first in topological order, then backward nodes. A forward output read by a
backward node is a saved tensor (a candidate); every tensor lives from its producer to its last
reader; backward outputs nobody reads (parameter gradients) live to the end.

The names a file uses are read from its top-level `graph` attributes where it declares them:

* `time_key`, `memory_key`, `backward_key`: the node attributes holding the op's time, its output
  bytes and its backward flag (default `cost_cpu`, `cost_ram`, `backward`);
* `source_key`, `target_key`: the link endpoint keys (default `source` and `target`; links whose
  endpoints are under `"0"` and `"1"` are read that way without a declaration);
* `time_unit`: `s`, `ms`, `us` or `ns` (times are converted to seconds), or any other word: times are
  then in the graph's own unit, kept as they are (copy times at `--bandwidth` are computed as if they
  were seconds, which the profile notes) and printed with that word. Without a declaration the unit is
  the graph's own (`graph time units`).

A graph without any backward flag is a general DAG, not a training step: regen says so in one line.
The copy bandwidth is `--bandwidth` (GB/s), or DEFAULT_GRAPH_BANDWIDTH_GB_S with a note in the profile.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import networkx as nx

from regen.errors import FormatError
from regen.formats.profile import Profile
from regen.formats.yamlio import opens_a_regen_json_document
from regen.graphs.builder import ProfileBuilder
from regen.units import BYTES_PER_GB

DEFAULT_GRAPH_BANDWIDTH_GB_S = 16.0
SECONDS_PER_UNIT = {"s": 1.0, "ms": 1e-3, "us": 1e-6, "ns": 1e-9}
UNDECLARED_TIME_UNIT = "graph time units"


@dataclass
class GraphKeys:
    """The attribute names a node-link file uses (declared in its `graph` attributes, or the defaults)."""

    time: str = "cost_cpu"
    memory: str = "cost_ram"
    backward: str = "backward"
    source: str = "source"
    target: str = "target"
    time_unit: str = UNDECLARED_TIME_UNIT


def is_node_link_file(path: Path) -> bool:
    """A `.json` file, or any file whose first non-blank character opens a JSON object other than a regen
    document's (profiles are written as JSON text that opens with their `format`: regen.formats.yamlio)."""
    if path.suffix.lower() == ".json":
        return True
    try:
        with open(path, encoding="utf-8") as f:
            head = f.read(64).lstrip()
    except (UnicodeDecodeError, OSError):
        return False
    return head.startswith("{") and not opens_a_regen_json_document(head)


def load_node_link(path, bandwidth_gb_s: float | None = None) -> Profile:
    """The profile of the training graph in node-link JSON file `path`."""
    path = Path(path)
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise FormatError(f"{path}: not valid JSON ({exc})") from None
    if not isinstance(data, dict) or "nodes" not in data:
        raise FormatError(f"{path}: not a node-link graph (expected an object with 'nodes' and 'links' or 'edges')")
    edges_key = "links" if "links" in data else "edges"
    if edges_key not in data:
        raise FormatError(f"{path}: node-link graph without 'links' or 'edges'")
    keys = graph_keys(data, edges_key)
    try:
        graph = nx.node_link_graph(data, directed=True, multigraph=False, edges=edges_key,
                                   source=keys.source, target=keys.target)
    except (KeyError, TypeError, nx.NetworkXError) as exc:
        raise FormatError(f"{path}: malformed node-link graph (link endpoint {exc} missing; declare the endpoint "
                          "keys as 'source_key' and 'target_key' in the graph attributes)") from None
    return profile_from_graph(graph, bandwidth_gb_s, name=path.stem, where=str(path), keys=keys)


def graph_keys(data: dict, edges_key: str) -> GraphKeys:
    """The names declared in the file's `graph` attributes, the defaults for the rest."""
    attrs = data.get("graph")
    attrs = attrs if isinstance(attrs, dict) else {}
    keys = GraphKeys()
    for field_name, attr in (("time", "time_key"), ("memory", "memory_key"), ("backward", "backward_key"),
                             ("source", "source_key"), ("target", "target_key"), ("time_unit", "time_unit")):
        if isinstance(attrs.get(attr), str) and attrs[attr]:
            setattr(keys, field_name, attrs[attr])
    links = data.get(edges_key)
    first = links[0] if isinstance(links, list) and links and isinstance(links[0], dict) else {}
    if "source_key" not in attrs and keys.source not in first and "0" in first and "1" in first:
        keys.source, keys.target = "0", "1"
    return keys


def _check_nodes(graph: nx.DiGraph, keys: GraphKeys, where: str) -> None:
    nodes = list(graph.nodes(data=True))
    if nodes and not any(keys.backward in attrs for _, attrs in nodes) and not all(keys.time in a for _, a in nodes):
        _raise_general_dag(nodes, keys, where)  # another vocabulary and no phases: not a training graph
    for node, attrs in nodes:
        for key in (keys.time, keys.memory):
            if key not in attrs:
                raise FormatError(f"{where}: node {node!r} has no '{key}'")
        try:
            if float(attrs[keys.time]) < 0 or int(attrs[keys.memory]) < 0:
                raise ValueError
        except (TypeError, ValueError):
            raise FormatError(f"{where}: node {node!r} needs non-negative {keys.time} and {keys.memory}") from None
    if nodes and not any(keys.backward in attrs for _, attrs in nodes):
        _raise_general_dag(nodes, keys, where)
    for node, attrs in nodes:
        if keys.backward not in attrs:
            raise FormatError(f"{where}: node {node!r} has no '{keys.backward}'")
    if not nx.is_directed_acyclic_graph(graph):
        raise FormatError(f"{where}: the graph has a cycle")


def _raise_general_dag(nodes: list, keys: GraphKeys, where: str) -> None:
    found = sorted({k for _, attrs in nodes for k in attrs})
    raise FormatError(
        f"{where}: a general DAG, not a training graph (no node has a '{keys.backward}' flag; node attributes: "
        f"{', '.join(found) or 'none'}): regen plans forward/backward training steps; a training graph marks "
        f"backward ops with \"{keys.backward}\": true and may name its attributes in the graph attributes "
        "time_key, memory_key and backward_key")


def _split_phases(graph: nx.DiGraph, keys: GraphKeys, where: str) -> tuple[list, list]:
    order = list(nx.lexicographical_topological_sort(graph, key=str))
    forward = [v for v in order if not graph.nodes[v][keys.backward]]
    backward = [v for v in order if graph.nodes[v][keys.backward]]
    for v in forward:
        if any(graph.nodes[u][keys.backward] for u in graph.predecessors(v)):
            raise FormatError(f"{where}: forward node {v!r} reads a backward node's output")
    if not forward:
        raise FormatError(f"{where}: the graph has no forward nodes")
    return forward, backward


def profile_from_graph(graph: nx.DiGraph, bandwidth_gb_s: float | None = None, name: str = "graph",
                       where: str = "graph", keys: GraphKeys | None = None) -> Profile:
    """The profile of a training graph whose nodes carry `keys`' attributes."""
    keys = keys or GraphKeys()
    _check_nodes(graph, keys, where)
    forward, backward = _split_phases(graph, keys, where)
    seconds = SECONDS_PER_UNIT.get(keys.time_unit, 1.0)
    bw = (bandwidth_gb_s or DEFAULT_GRAPH_BANDWIDTH_GB_S) * BYTES_PER_GB
    builder = ProfileBuilder(name, bw, bw, source=f"converted from a node-link graph ({len(forward)} forward, "
                                                  f"{len(backward)} backward nodes)")
    tensor_of, op_of = {}, {}
    for v in forward:
        attrs = graph.nodes[v]
        saves = "outputs" if any(graph.nodes[u][keys.backward] for u in graph.successors(v)) else ()
        op, (t,) = builder.forward(str(attrs.get("name", f"node_{v}")), seconds * float(attrs[keys.time]),
                                   [tensor_of[u] for u in graph.predecessors(v)], [int(attrs[keys.memory])],
                                   saves=saves)
        tensor_of[v], op_of[v] = t, op
    for v in backward:
        attrs = graph.nodes[v]
        preds = list(graph.predecessors(v))
        fwd_preds = [op_of[u] for u in preds if not graph.nodes[u][keys.backward]]
        (t,) = builder.backward(str(attrs.get("name", f"node_{v}")), seconds * float(attrs[keys.time]), fwd_preds,
                                [tensor_of[u] for u in preds], [int(attrs[keys.memory])])
        tensor_of[v] = t
    profile = builder.build()
    if keys.time_unit not in SECONDS_PER_UNIT:
        profile.workload["time_unit"] = keys.time_unit
        profile.notes.append(f"op times are in {keys.time_unit}; copy times at the bandwidth are computed as if "
                             "they were seconds")
    if bandwidth_gb_s is None:
        profile.notes.append(f"no --bandwidth given: copies assumed at {DEFAULT_GRAPH_BANDWIDTH_GB_S} GB/s")
    return profile
