"""The two files that connect regen's stages: the profile (profiler -> planner) and the plan
(planner -> runtime). Each stage imports only these types, never another stage's internals; `plan_rules` holds the few
rules about a plan that the planner and the runtime both apply (written once, used by both)."""

from pathlib import Path

from regen.formats.profile import (
    PROFILE_FORMAT,
    Calibration,
    CallInput,
    CallSignature,
    DeviceInfo,
    ModuleCall,
    OpRecord,
    Profile,
    RuntimeCosts,
    SavedEntry,
    SavedTensor,
    StaticMemory,
    TensorRecord,
    PROFILE_VERSIONS,
    load_profile,
    profile_from_document,
    op_fingerprint,
    save_profile,
)
from regen.formats.plan import (
    PLAN_FORMAT,
    Decision,
    Plan,
    PlanCharges,
    PlanFigures,
    PlanLink,
    RecipeOp,
    RegionDecision,
    SolverReport,
    TimeParts,
    PLAN_VERSIONS,
    load_plan,
    plan_from_document,
    save_plan,
)

__all__ = [
    "PROFILE_FORMAT", "Calibration", "CallInput", "CallSignature", "DeviceInfo", "ModuleCall", "OpRecord", "Profile",
    "RuntimeCosts", "SavedEntry", "SavedTensor", "StaticMemory", "TensorRecord", "load_profile", "op_fingerprint",
    "save_profile",
    "PLAN_FORMAT", "Decision", "Plan", "PlanCharges", "PlanFigures", "PlanLink", "RecipeOp", "RegionDecision", "SolverReport", "TimeParts",
    "load_plan", "save_plan",
    "load_profile_or_plan",
]


def load_profile_or_plan(path: str | Path) -> Profile | Plan:
    """A profile or a plan file, whichever `path` holds (its `format` says which), parsed once."""
    from regen.errors import FormatError
    from regen.formats.yamlio import check_format, document_kind, read_document

    document = read_document(path, "profile or plan")
    kind = document_kind(document)
    if kind == "profile":
        check_format(document, path, "profile", PROFILE_VERSIONS)
        return profile_from_document(document, str(path))
    if kind == "plan":
        check_format(document, path, "plan", PLAN_VERSIONS)
        return plan_from_document(document, str(path))
    raise FormatError(f"{path}: format is '{document['format']}': neither a regen profile nor a regen plan")
