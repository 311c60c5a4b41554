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

from regen.formats import load_plan, load_profile
from regen.version import __version__

__all__ = ["__version__", "apply", "load_plan", "load_profile"]


def apply(model, plan=None, learn: bool = False, **kwargs):
    """Replay `plan` on `model`, or without a plan run dynamic mode under `memory_cap` (on CUDA swapping over
    the host link, measured here, as well as dropping); with `learn=True`, learn a plan for each call no
    plan fits (regen.learning; see regen.runtime.apply)."""
    from regen.errors import RegenError
    from regen.runtime import apply as _apply

    if not isinstance(learn, bool):
        raise RegenError(f"regen.apply: learn must be True or False, got {learn!r}")
    if learn:
        from regen.learning import Learner
        from regen.ranks import rank_agreement

        if rank_agreement() is not None:
            raise RegenError("regen.apply: learn=True profiles new shapes on each rank at its own time, which "
                             "torch.distributed ranks cannot agree on; learn in one process, save_learned_plans(dir), "
                             "and apply the directory")

        kwargs["learner"] = Learner(model)
    elif plan is None and kwargs.get("memory_cap") is not None and kwargs.get("link_gb_s") is None:
        kwargs["link_gb_s"] = _cuda_link_gb_s(model)
    return _apply(model, plan, **kwargs)


def _cuda_link_gb_s(model) -> tuple[float, float] | None:
    """Dynamic mode on CUDA swaps over the device's host link: its (d2h, h2d) GB/s, measured now (a probe of
    well under a second); None for a model elsewhere."""
    import torch

    from regen.runtime.model_access import module_device

    device = module_device(model) if isinstance(model, torch.nn.Module) else None
    if device is None or device.type != "cuda":
        return None
    from regen.profiler.bandwidth import measure_bandwidth

    bw = measure_bandwidth(device)
    return bw.d2h_bytes_per_s / 1e9, bw.h2d_bytes_per_s / 1e9
