"""The two files that connect regen's stages: the profile (profiler -> planner) and the plan
(planner -> runtime). Each stage imports only these types, never another stage's internals."""

from regen.formats.profile import (
    PROFILE_FORMAT,
    DeviceInfo,
    OpRecord,
    Profile,
    SavedEntry,
    SavedTensor,
    StaticMemory,
    TensorRecord,
    load_profile,
    op_fingerprint,
    save_profile,
)
from regen.formats.plan import (
    PLAN_FORMAT,
    Decision,
    Plan,
    PlanFigures,
    RecipeOp,
    SolverReport,
    load_plan,
    save_plan,
)

__all__ = [
    "PROFILE_FORMAT", "DeviceInfo", "OpRecord", "Profile", "SavedEntry", "SavedTensor", "StaticMemory",
    "TensorRecord", "load_profile", "op_fingerprint", "save_profile",
    "PLAN_FORMAT", "Decision", "Plan", "PlanFigures", "RecipeOp", "SolverReport", "load_plan", "save_plan",
]
