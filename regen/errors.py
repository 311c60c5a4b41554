"""Errors that regen reports to users as a clear message and a non-zero exit.

Every failure caused by input (a malformed file, a plan for another model, an impossible cap, a
missing device, a workload that breaks the protocol) is raised as a subclass of `RegenError`. The CLI
prints `error: <message>` for these and exits with `exit_code`; anything else is a bug and keeps its
traceback.
"""


class RegenError(Exception):
    """Base class of errors with a message meant for the user."""

    exit_code = 2


class FormatError(RegenError):
    """A profile or plan file that cannot be read: malformed, wrong kind, or unknown version."""


class WorkloadError(RegenError):
    """A workload that cannot be built or run (unknown name, broken protocol, forward that raised)."""


class DeviceError(RegenError):
    """A device that was asked for and is not there (e.g. `--device cuda` without CUDA)."""


class InfeasibleCapError(RegenError):
    """No plan meets the memory cap. `smallest_feasible_cap_bytes` is the lowest cap found feasible."""

    exit_code = 3

    def __init__(self, message: str, smallest_feasible_cap_bytes: int | None = None, plan_at_smallest=None):
        super().__init__(message)
        self.smallest_feasible_cap_bytes = smallest_feasible_cap_bytes
        self.plan_at_smallest = plan_at_smallest  # the planner's choices at that cap, when it has them

    @property
    def start_plans(self) -> tuple:
        """The plan at the smallest cap as `solve(..., start_plans=...)` takes it, to solve again at that cap
        (where the MILP alone may find no plan in its time), or () when there is none."""
        return (("least-peak plan", self.plan_at_smallest),) if self.plan_at_smallest is not None else ()


class SolverError(RegenError):
    """The solver stopped without any feasible plan (time limit with no incumbent, solver missing)."""

    exit_code = 4


class PlanMismatchError(RegenError):
    """A plan applied to a model or batch shape it was not made for."""


# nn.DataParallel runs one replica per device in threads, all through the one module's hooks: refused by
# the profiler and by regen.apply
DATA_PARALLEL_REFUSED = ("nn.DataParallel runs its replicas in threads through one set of hooks, which regen does "
                         "not follow; use DistributedDataParallel (one process per GPU) or the bare module")
