"""`regen demo`: the main job end to end on a built-in GPT (stages not built yet say so)."""

from __future__ import annotations


def run_demo(output_dir, config=None, progress=print) -> int:
    progress("regen demo: profile, solve and train are not yet implemented; nothing to show yet")
    return 0
