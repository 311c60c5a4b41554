"""regen.profiler: record one real training step of a workload and write what the planner needs.

* `profile_workload(workload, device, repeats, warmup_steps, progress, runtime_probe=None, park=False)` ->
  `Profile` (regen.profiler.record)

Modules: capture (dispatch mode + saved-tensor hooks, following docs/internals.md), modules (each op's
module path, each submodule call's extent), memory (per-op memory: CUDA allocator counters, or live
storages on CPU), park (saved tensors held in host memory while a step that does not fit is recorded),
accumulation (the recorded backward's gradient sums as the step runs them, in place where it can), liveness
(the probe step: until when something other than autograd holds each saved storage), outside_state
(in that step, the module calls that leave state behind besides their output), bandwidth (host<->device
probe), environment (device, versions, static memory), record (the phases of a profile). `regen show` is regen.show.
"""

from regen.profiler.record import profile_workload, record_step

__all__ = ["profile_workload", "record_step"]
