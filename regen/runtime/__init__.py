"""regen.runtime: replay a plan in an unmodified training loop (`regen.apply(model, plan)`).

* apply.py: the handle (context manager / `.remove()`), step boundaries, pack and unpack hooks;
* matching.py: the plan's lookup tables and the dispatch mode that numbers forward ops;
* swap.py: the host pool and the copies (CUDA streams and events, synchronous on CPU);
* recompute.py: capture of recipe ops in forward and their replay in backward.
"""

from regen.runtime.apply import PlanMismatchWarning, RegenHandle, RuntimeStats, apply

__all__ = ["PlanMismatchWarning", "RegenHandle", "RuntimeStats", "apply"]
