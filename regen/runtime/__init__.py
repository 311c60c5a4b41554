"""regen.runtime: replay a plan in an unmodified training loop (`regen.apply(model, plan)`).

* apply.py: the handle (context manager / `.remove()`): hooks, step boundaries, what steps found;
* plan_set.py: the handle's plans (one, or one per way the loop calls the model) and each step's choice;
* step.py: one step: its phases, pack and unpack hooks, the end of its forward, its release;
* tracker.py: the dispatch mode that numbers forward ops;
* forward_ops.py: what a step does per forward op: writer map, fingerprint, recipe captures;
* packing.py: which decision a saved tensor gets (through the writer map, or by pack order);
* planned_storages.py: one step's candidates: keep, swap or drop at pack, resident again at unpack;
* swap_queue.py: one step's copy-outs, copy-in schedule and release; swap.py: the host pool and the
  SwapEngine interface, whose backends are swap_cuda.py (CUDA streams), link.py (an emulated host link on
  CPU, `emulate_link=True`) and swap.py's synchronous one;
* recompute.py: capture of recipe ops in forward and their replay in backward;
* regions.py: capture of a region's module call in forward and its replay (the module's forward) in backward;
* plan_index.py: the plan's lookup tables; stats.py: the handle's counters;
* peak_check.py: the safety net comparing a planned step's measured peak (CUDA) with the cap.
* dynamic/: dynamic mode, `regen.apply(model, memory_cap=...)` without a plan: saved tensors dropped at
  run time under the cap and rebuilt from recipes recorded as forward ran (DTR-style);
* fallback.py: a plan handle's calls that no plan fits, run in dynamic mode (`on_mismatch="dynamic"`);
* learned.py: plans learned for such calls (`learn=True`): what a step is observed for, the learned plans.
"""

from regen.runtime.apply import RegenHandle, apply
from regen.runtime.peak_check import CapExceededWarning
from regen.runtime.stats import RuntimeStats
from regen.runtime.mismatch import PlanMismatchWarning

__all__ = ["CapExceededWarning", "PlanMismatchWarning", "RegenHandle", "RuntimeStats", "apply"]
