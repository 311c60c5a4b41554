"""regen.graphs: profiles that are not recorded by the profiler.

* `load_node_link(path)`: a training graph in networkx node-link JSON (regen.graphs.node_link), what
  `regen solve GRAPH.json` reads;
* `ProfileBuilder` (regen.graphs.builder): a Profile assembled from ops with costs and sizes, the way
  the profiler would record it;
* regen.graphs.synthetic: transformer- and chain-shaped profiles for planner tests and benchmarks.

Like the profiler, this package only produces `regen.formats.Profile`s; the planner never imports it.
"""

from regen.graphs.builder import ProfileBuilder
from regen.graphs.node_link import is_node_link_file, load_node_link

__all__ = ["ProfileBuilder", "is_node_link_file", "load_node_link"]
