"""regen.profiler: record one real training step (not yet implemented)."""

from regen.errors import RegenError


def profile_workload(*args, **kwargs):
    raise RegenError("regen profile: not yet implemented")


def profile_summary(profile):
    raise RegenError("regen show PROFILE: not yet implemented")


profile_summary_json = profile_summary
