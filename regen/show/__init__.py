"""regen.show: what `regen show FILE` prints for a profile or a plan (a readable summary or one JSON
object) and the plan's memory-timeline plot. It reads only `regen.formats`: no solver, no torch."""

from regen.show.plan import plan_summary, plan_summary_json, plot_timeline
from regen.show.profile import profile_summary, profile_summary_json

__all__ = ["plan_summary", "plan_summary_json", "plot_timeline", "profile_summary", "profile_summary_json"]
