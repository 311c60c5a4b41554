"""Dynamic mode: `regen.apply(model, memory_cap=...)` without a plan (DTR-style eviction at run time).

* handle.py: the handle (context manager / `.remove()`): step boundaries (its root hooks);
* engine.py: what runs dynamic steps (the dispatch mode, the live steps), for this handle and for a plan
  set's steps no plan fits (`on_mismatch="dynamic"`, regen.runtime.apply);
* dynamic_step.py: one step: every forward op captured as a one-op recipe, the pack and unpack hooks;
* nodes.py: the step's tensor graph: one `TensorNode` per storage an op of the step wrote;
* eviction.py: what is resident, eviction under the cap, and rebuilding dropped nodes (recursively);
* swaps.py: with a host link, copies to the host ahead, evictions as swaps, copies back ahead of backward;
* policy.py: the eviction scores (`policy="dtr"`: DTR's plain score; `"graph"`: extended with the graph);
* cap_memory.py: the memory in use that the cap is checked against (CUDA: the allocator; CPU: tracked).
"""

from regen.runtime.dynamic.engine import DynamicEngine, DynamicStats
from regen.runtime.dynamic.handle import DynamicHandle
from regen.runtime.dynamic.dynamic_step import OverCapWarning

__all__ = ["DynamicEngine", "DynamicHandle", "DynamicStats", "OverCapWarning"]
