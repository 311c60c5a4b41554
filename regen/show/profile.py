"""`regen show PROFILE`: a readable summary of a profile, or one JSON-able object."""

from __future__ import annotations

from dataclasses import asdict
from typing import Any

from regen.formats.profile import Profile, SavedTensor
from regen.units import BYTES_PER_GB, format_bytes, format_duration

LARGEST_SHOWN = 10  # saved tensors listed in the text summary and the JSON object


def _largest(profile: Profile) -> list[SavedTensor]:
    return sorted(profile.saved_tensors, key=lambda s: (-s.bytes, s.id))[:LARGEST_SHOWN]


def _excluded_counts(profile: Profile) -> dict[str, int]:
    counts: dict[str, int] = {}
    for e in profile.saved_entries:
        if e.excluded_reason:
            counts[e.excluded_reason] = counts.get(e.excluded_reason, 0) + 1
    return counts


def profile_summary(profile: Profile) -> str:
    w = profile.workload
    num_fw = profile.num_forward_ops
    peak_op = profile.peak_op()
    sm = profile.static_memory
    dev = profile.device
    excluded = _excluded_counts(profile)
    excl = ", ".join(f"{n} {reason}" for reason, n in sorted(excluded.items())) or "none"

    def duration(seconds: float) -> str:
        return format_duration(seconds, w.get("time_unit"))

    lines = [
        f"profile {profile.format}: workload {w.get('name')} (batch size {w.get('batch_size')}, "
        f"args {w.get('args') or {}})",
        f"device: {dev.type} ({dev.name}), {format_bytes(dev.total_memory_bytes)}; "
        f"d2h {dev.d2h_bytes_per_s / BYTES_PER_GB:.2f} GB/s, h2d {dev.h2d_bytes_per_s / BYTES_PER_GB:.2f} GB/s "
        f"[{dev.bandwidth_method}]",
        f"ops: {len(profile.ops)} ({num_fw} forward, {len(profile.ops) - num_fw} backward); "
        f"fingerprint {profile.fingerprint}",
        f"step time: {duration(profile.step_time_s)} forward+backward (median of {profile.repeats}; "
        f"sum of op times {duration(sum(op.time_s for op in profile.ops))}), "
        f"optimizer step {duration(profile.optimizer_step_time_s)}",
        f"saved tensors: {len(profile.saved_tensors)} candidates, {format_bytes(profile.candidate_bytes)} "
        f"({sum(1 for s in profile.saved_tensors if s.is_random)} random, "
        f"{sum(1 for s in profile.saved_tensors if s.is_inplace)} in-place); "
        f"{len(profile.saved_entries)} saved entries, excluded: {excl}",
        f"static memory: parameters {format_bytes(sm.parameter_bytes)}, gradients {format_bytes(sm.gradient_bytes)}"
        + _gradients_made(profile) + f", optimizer state {format_bytes(sm.optimizer_state_bytes)}",
        f"memory: {format_bytes(profile.memory_at_start_bytes)} at start, unplanned peak "
        f"{format_bytes(profile.peak_bytes)} (+{format_bytes(profile.peak_bytes - profile.memory_at_start_bytes)})"
        + (f" at op {peak_op.index} {peak_op.name} ({peak_op.phase})" if peak_op else ""),
    ]
    rc = profile.runtime_costs
    if rc is not None:
        lines.append(_runtime_costs_line(rc))
    cal = profile.calibration
    if cal is not None:
        replays = "" if cal.region_scale is None else f", module replays x{cal.region_scale:.2f} theirs"
        lines.append(f"calibration: {cal.runtime_step_s * 1e3:.2f} ms a planned step, recompute "
                     f"x{cal.recompute_scale:.2f} its charge{replays}, swaps "
                     f"{cal.swap_byte_s * 2**20 * 1e3:.3f} ms per MiB "
                     f"beyond their calls, over {cal.rounds} rounds"
                     + "".join(f"; {n}" for n in cal.notes))
    largest = _largest(profile)
    if largest:
        names = {op.index: op.name for op in profile.ops}
        lines.append(f"largest saved tensors (of {len(profile.saved_tensors)}):")
        lines.append(f"  {'id':>5} {'bytes':>11} {'shape':<22} {'dtype':<15} {'producer':<36} fwd-live   bwd-uses")
        for s in largest:
            flags = "".join((" random" if s.is_random else "", " in-place" if s.is_inplace else ""))
            producer = f"{s.producer_op} {names.get(s.producer_op, '?')}"
            uses = (f"{s.first_backward_use}..{s.last_backward_use}" if s.backward_uses else "-")
            shape = "x".join(map(str, s.shape)) or "scalar"
            lines.append(f"  {s.id:>5} {format_bytes(s.bytes):>11} {shape:<22} {s.dtype:<15} {producer:<36} "
                         f"{s.producer_op}..{s.last_forward_use:<5} {uses}{flags}")
    for note in profile.notes:
        lines.append(f"note: {note}")
    return "\n".join(lines)


def profile_summary_json(profile: Profile) -> dict[str, Any]:
    peak_op = profile.peak_op()
    return {
        "format": profile.format,
        "workload": profile.workload,
        "device": {"type": profile.device.type, "name": profile.device.name,
                   "total_memory_bytes": profile.device.total_memory_bytes,
                   "d2h_bytes_per_s": profile.device.d2h_bytes_per_s,
                   "h2d_bytes_per_s": profile.device.h2d_bytes_per_s,
                   "bandwidth_method": profile.device.bandwidth_method},
        "ops": len(profile.ops),
        "forward_ops": profile.num_forward_ops,
        "backward_ops": len(profile.ops) - profile.num_forward_ops,
        "saved_tensors": len(profile.saved_tensors),
        "saved_entries": len(profile.saved_entries),
        "excluded_entries": _excluded_counts(profile),
        "candidate_bytes": profile.candidate_bytes,
        "random_candidates": sum(1 for s in profile.saved_tensors if s.is_random),
        "inplace_candidates": sum(1 for s in profile.saved_tensors if s.is_inplace),
        "memory_at_start_bytes": profile.memory_at_start_bytes,
        "peak_bytes": profile.peak_bytes,
        "peak_op": None if peak_op is None else {"index": peak_op.index, "name": peak_op.name, "phase": peak_op.phase},
        "step_time_s": profile.step_time_s,
        "optimizer_step_time_s": profile.optimizer_step_time_s,
        "static_memory": {"parameter_bytes": profile.static_memory.parameter_bytes,
                          "gradient_bytes": profile.static_memory.gradient_bytes,
                          "optimizer_state_bytes": profile.static_memory.optimizer_state_bytes},
        "runtime_costs": None if profile.runtime_costs is None else asdict(profile.runtime_costs),
        "calibration": None if profile.calibration is None else asdict(profile.calibration),
        "repeats": profile.repeats,
        "fingerprint": profile.fingerprint,
        "versions": profile.versions,
        "largest_saved_tensors": [
            {"id": s.id, "bytes": s.bytes, "shape": s.shape, "dtype": s.dtype, "producer_op": s.producer_op,
             "last_forward_use": s.last_forward_use, "first_backward_use": s.first_backward_use,
             "last_backward_use": s.last_backward_use, "is_random": s.is_random, "is_inplace": s.is_inplace}
            for s in _largest(profile)],
    }


def _runtime_costs_line(rc) -> str:
    """The probe's figures, each with the spread of its repeats (+-x%), and its fallbacks."""
    def figure(name: str, label: str, unit: str) -> str:
        spread = rc.spreads.get(name)
        return (f"{label} {getattr(rc, name) * 1e6:.1f} {unit}"
                + (f" (+-{spread:.0%})" if spread is not None else ""))

    parts = [figure("dispatch_op_s", "dispatch", "us/op"), figure("capture_op_s", "capture", "us/op"),
             figure("replay_op_s", "replay", "us/op"), figure("recipe_s", "recipe", "us"), figure("swap_s", "swap", "us")]
    return f"runtime costs: {', '.join(parts)} [{rc.method}]" + "".join(f"; {n}" for n in rc.notes)


def _gradients_made(profile: Profile) -> str:
    """When the step made its gradients (the ops after which autograd stored the first and the last)."""
    made = profile.gradients_made
    if not made:
        return ""
    return f" (made after ops {min(g.after_op for g in made)}..{max(g.after_op for g in made)})"
