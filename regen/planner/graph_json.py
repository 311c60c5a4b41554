"""Computation graphs in networkx node-link JSON (the form rematerialization papers publish) as profiles.

Each node is an op producing one tensor: `cost_cpu` (seconds), `cost_ram` (output bytes), `backward`
(bool); each edge (source -> target) says target reads source's output. Forward nodes run first in
topological order, then backward nodes. A forward output read by a backward node is a saved tensor
(a candidate); every tensor lives from its producer to its last reader; backward outputs nobody
reads (parameter gradients) live to the end. The copy bandwidth is `--bandwidth` (GB/s), or
DEFAULT_GRAPH_BANDWIDTH_GB_S with a note in the profile.
"""

from __future__ import annotations

import json
from pathlib import Path

import networkx as nx

from regen.errors import FormatError
from regen.units import BYTES_PER_GB
from regen.formats.profile import Profile
from regen.planner.synthetic import ProfileBuilder

DEFAULT_GRAPH_BANDWIDTH_GB_S = 16.0


def load_node_link(path, bandwidth_gb_s: float | None = None) -> Profile:
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
    try:
        graph = nx.node_link_graph(data, directed=True, multigraph=False, edges=edges_key)
    except (KeyError, TypeError, nx.NetworkXError) as exc:
        raise FormatError(f"{path}: malformed node-link graph ({exc})") from None
    return profile_from_graph(graph, bandwidth_gb_s, name=path.stem, where=str(path))


def profile_from_graph(graph: nx.DiGraph, bandwidth_gb_s: float | None = None, name: str = "graph",
                       where: str = "graph") -> Profile:
    for node, attrs in graph.nodes(data=True):
        for key in ("cost_cpu", "cost_ram", "backward"):
            if key not in attrs:
                raise FormatError(f"{where}: node {node!r} has no '{key}'")
        try:
            if float(attrs["cost_cpu"]) < 0 or int(attrs["cost_ram"]) < 0:
                raise ValueError
        except (TypeError, ValueError):
            raise FormatError(f"{where}: node {node!r} needs non-negative cost_cpu and cost_ram") from None
    if not nx.is_directed_acyclic_graph(graph):
        raise FormatError(f"{where}: the graph has a cycle")
    order = list(nx.lexicographical_topological_sort(graph, key=str))
    forward = [v for v in order if not graph.nodes[v]["backward"]]
    backward = [v for v in order if graph.nodes[v]["backward"]]
    for v in forward:
        if any(graph.nodes[u]["backward"] for u in graph.predecessors(v)):
            raise FormatError(f"{where}: forward node {v!r} reads a backward node's output")
    if not forward:
        raise FormatError(f"{where}: the graph has no forward nodes")
    bw = (bandwidth_gb_s or DEFAULT_GRAPH_BANDWIDTH_GB_S) * BYTES_PER_GB
    builder = ProfileBuilder(name, bw, bw)
    tensor_of, op_of = {}, {}
    for v in forward:
        attrs = graph.nodes[v]
        saves = "outputs" if any(graph.nodes[u]["backward"] for u in graph.successors(v)) else ()
        op, (t,) = builder.forward(str(attrs.get("name", f"node_{v}")), float(attrs["cost_cpu"]),
                                   [tensor_of[u] for u in graph.predecessors(v)], [int(attrs["cost_ram"])],
                                   saves=saves)
        tensor_of[v], op_of[v] = t, op
    for v in backward:
        attrs = graph.nodes[v]
        preds = list(graph.predecessors(v))
        fwd_preds = [op_of[u] for u in preds if not graph.nodes[u]["backward"]]
        (t,) = builder.backward(str(attrs.get("name", f"node_{v}")), float(attrs["cost_cpu"]), fwd_preds,
                                [tensor_of[u] for u in preds], [int(attrs["cost_ram"])])
        tensor_of[v] = t
    profile = builder.build()
    profile.notes.append(f"converted from a node-link graph ({len(forward)} forward, {len(backward)} backward nodes)")
    if bandwidth_gb_s is None:
        profile.notes.append(f"no --bandwidth given: copies assumed at {DEFAULT_GRAPH_BANDWIDTH_GB_S} GB/s")
    return profile
