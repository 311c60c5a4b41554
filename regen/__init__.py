"""regen: train PyTorch models under a memory cap.

Profile one training step (`regen profile`), solve a MILP that decides for every saved activation
whether to keep it, swap it to host memory or recompute it (`regen solve`), and replay the plan in an
unmodified training loop:

    import regen
    with regen.apply(model, regen.load_plan("run.plan.yaml")):
        for batch in loader:
            loss = model(**batch).loss
            loss.backward()
            optimizer.step(); optimizer.zero_grad()
"""

__version__ = "0.1.0"

from regen.formats import load_plan, load_profile  # noqa: E402

__all__ = ["__version__", "apply", "load_plan", "load_profile"]


def apply(model, plan=None, **kwargs):
    """Replay `plan` on `model`, or without a plan run dynamic mode under `memory_cap`
    (see regen.runtime.apply)."""
    from regen.runtime import apply as _apply

    return _apply(model, plan, **kwargs)
