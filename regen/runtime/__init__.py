"""regen.runtime: replay a plan in a training loop (not yet implemented)."""

from regen.errors import RegenError


def apply(model, plan, **kwargs):
    raise RegenError("regen.apply: not yet implemented")
