"""regen.runtime: replay a plan in an unmodified training loop (`regen.apply(model, plan)`).

The handle and its steps:
* apply.py: the handle (context manager / `.remove()`): hooks, step boundaries, what steps found;
* model_access.py: the model as the runtime sees it: DDP unwrapped, its device, the rule for a step's start;
* plan_set.py: the handle's plans (one, or one per way the loop calls the model) and each step's choice;
* plan_index.py: a plan read once into the lookup tables steps match against;
* step.py: one step: its stages, pack and unpack hooks, the end of its forward, its release;
* mismatch.py: what a step does when it does not match its plan; stats.py: the handle's counters;
* peak_check.py: the safety net comparing a planned step's measured peak with the cap.

What a step does with the forward's ops and saved tensors:
* tracker.py: the dispatch mode that numbers forward ops; stacks.py: regen's entries on the thread's
  hook and mode stacks;
* forward_ops.py: what a step does per forward op: writer map, fingerprint, recipe captures;
  writers.py: the writer map's entries; window_hooks.py: the module hooks that open tracking windows;
* packing.py: which decision a saved tensor gets (through the writer map, or by pack order);
* planned_storages.py: one step's planned storages: kept, swapped or dropped at pack, resident again at
  unpack; saved_entries.py: the entries regen leaves as they are; storage_views.py: views over storages;
* recompute.py: capture of recipe ops in forward and their replay in backward;
* region_replays.py: a region's module call captured in forward and run again in backward;
  region_hooks.py: the module hooks that report region calls;
* swap/: the host pool, the swap engines (CUDA streams, an emulated link, synchronous copies) and one
  step's swap queue.

Beyond a single plan:
* dynamic/: dynamic mode, `regen.apply(model, memory_cap=...)` without a plan: saved tensors dropped at
  run time under the cap and rebuilt from recipes recorded as forward ran (DTR-style);
* compiled.py: a plan on a torch.compile'd model, carried out by the compiler (a pass over its joint
  graphs that tags what to save and what to recompute; no hooks per op);
* fallback.py: a plan handle's calls that no plan fits, run in dynamic mode (`on_mismatch="dynamic"`);
* held_gradients_check.py: a planned step that begins with gradients its plan did not count (gradient accumulation),
  said once;
* overlapping_steps.py: a planned step that begins while the step before holds its saved tensors (two calls
  before one backward), said once;
* learned.py: plans learned for such calls (`learn=True`): what a step is observed for, the learned plans;
* self_timing.py: the runtime timing its own work per event (dispatch, capture, replay, a swap's calls),
  which `regen profile` records in the profile (`RuntimeCosts`) through the probe the CLI hands it.
"""

from regen.runtime.apply import RegenHandle, apply
from regen.runtime.held_gradients_check import HeldGradientsWarning
from regen.runtime.overlapping_steps import OverlappingStepsWarning
from regen.runtime.peak_check import CapExceededWarning
from regen.runtime.stats import RuntimeStats
from regen.runtime.mismatch import PlanMismatchWarning

__all__ = ["CapExceededWarning", "HeldGradientsWarning", "OverlappingStepsWarning", "PlanMismatchWarning",
           "RegenHandle", "RuntimeStats", "apply"]
