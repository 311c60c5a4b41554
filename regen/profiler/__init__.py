"""regen.profiler: record one real training step of a workload and write what the planner needs.

* `profile_workload(workload, device, repeats, warmup_steps, progress)` -> `Profile` (regen.profiler.record)
* `profile_summary(profile)` / `profile_summary_json(profile)` for `regen show` (regen.profiler.summary)

Modules: capture (dispatch mode + saved-tensor hooks, following docs/internals.md), memory (per-op
memory: CUDA allocator counters, or live storages on CPU), bandwidth (host<->device probe), environment
(device, versions, static memory), record (the phases of a profile), summary.
"""

from regen.profiler.record import profile_workload, record_step
from regen.profiler.summary import profile_summary, profile_summary_json

__all__ = ["profile_workload", "profile_summary", "profile_summary_json", "record_step"]
