"""The host link and host memory a plan is solved for.

Errors name solve's parameters (`bandwidth_gb_s`, `link_ratio`, `host_memory_cap_bytes`, `strategy`);
regen.cli says them as its flags (`--bandwidth`, ...). This is the one place the link is checked.

* The link: `bandwidth_gb_s` (GB/s, both directions), or `link_ratio` R, which sets both bandwidths from
  the profile so that copying every candidate's bytes one way takes R times the unplanned step time
  (bandwidth = candidate bytes / (R x step time)), or else the profile's own bandwidth. A GPU's link is
  slow next to its compute (R ~ 0.9 over PCIe for a 4096-wide transformer, ~0.1 over NVLink-C2C); the
  plan records which link it was solved for (`Plan.link`).
* A CPU device has no link: its "host pool" is the same RAM as its activations, so a swap saves no
  memory there. Without an explicit link, hybrid plans for a CPU-device profile are solved as
  recompute only; swap-only (and STR) plans need one (docs/limitations.md).
* Host memory: the host pool is pinned on CUDA and cannot be paged out, so its bytes are bounded by
  `host_memory_cap_bytes` (default: DEFAULT_HOST_MEMORY_FRACTION of this machine's RAM).
"""

from __future__ import annotations

import math
import os

from regen.errors import RegenError
from regen.formats.plan import LINK_FROM_BANDWIDTH, LINK_FROM_PROFILE, LINK_FROM_RATIO, PlanLink
from regen.formats.profile import Profile
from regen.units import BYTES_PER_GB, format_bytes

DEFAULT_HOST_MEMORY_FRACTION = 0.5  # of the machine's RAM: pinned pages stay resident, the rest is the OS's
CPU_DEVICE = "cpu"


def link_bandwidth(profile: Profile, bandwidth_gb_s: float | None, link_ratio: float | None
                   ) -> tuple[float | None, str]:
    """(bytes/s for both directions, or None for the profile's own; the link's source), or a RegenError
    for a link given twice or not a positive number."""
    if bandwidth_gb_s is not None and link_ratio is not None:
        raise RegenError("link_ratio and bandwidth_gb_s both set the host link: give one of them")
    if bandwidth_gb_s is not None:
        if not (bandwidth_gb_s > 0 and math.isfinite(bandwidth_gb_s)):
            raise RegenError(f"bandwidth_gb_s {bandwidth_gb_s}: must be a positive number of GB/s")
        return bandwidth_gb_s * BYTES_PER_GB, LINK_FROM_BANDWIDTH
    if link_ratio is None:
        return None, LINK_FROM_PROFILE
    if not (link_ratio > 0 and math.isfinite(link_ratio)):
        raise RegenError(f"link_ratio {link_ratio}: must be a positive number (copy time of every saved "
                         f"tensor over the unplanned step time, e.g. 0.9)")
    nbytes = profile.candidate_bytes
    if nbytes <= 0 or not profile.step_time_s > 0:
        raise RegenError("link_ratio: the profile has no saved tensors or no step time to scale a link by")
    return nbytes / (link_ratio * profile.step_time_s), LINK_FROM_RATIO


def plan_link(profile: Profile, d2h_bytes_per_s: float, h2d_bytes_per_s: float, source: str) -> PlanLink:
    """What the plan records about its link (the ratio is computed whatever the source)."""
    nbytes = profile.candidate_bytes
    slower = min(d2h_bytes_per_s, h2d_bytes_per_s)
    ratio = nbytes / (slower * profile.step_time_s) if slower > 0 and profile.step_time_s > 0 else 0.0
    return PlanLink(source=source, link_ratio=float(ratio), candidate_bytes=nbytes)


def has_no_link(profile: Profile, source: str) -> bool:
    """A CPU-device profile solved without an explicit link (bandwidth_gb_s or link_ratio)."""
    return profile.device.type == CPU_DEVICE and source == LINK_FROM_PROFILE


def no_link_note(strategy: str) -> str:
    return (f"strategy {strategy} solved as recompute only: the profile's device is a CPU, where the host pool is "
            f"the same RAM and a swap saves nothing; give a link (regen solve --link-ratio or --bandwidth; solve's "
            f"link_ratio or bandwidth_gb_s) to plan swaps for one")


def no_link_error(strategy: str) -> RegenError:
    return RegenError(f"strategy {strategy} swaps, and the profile's device is a CPU, which has no host link: give "
                      f"link_ratio (R) or bandwidth_gb_s (GB/s) to plan for one (and run with regen.apply(..., "
                      f"emulate_link=True))")


def machine_ram_bytes() -> int | None:
    try:
        return int(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))
    except (ValueError, OSError, AttributeError):
        return None


def default_host_memory_cap_bytes() -> int | None:
    """DEFAULT_HOST_MEMORY_FRACTION of this machine's RAM, or None (no bound) when it cannot be read."""
    ram = machine_ram_bytes()
    return int(ram * DEFAULT_HOST_MEMORY_FRACTION) if ram else None


def host_memory_error(host_pool_bytes: int, cap_bytes: int, strategy: str) -> RegenError:
    return RegenError(f"strategy {strategy} needs a host pool of {format_bytes(host_pool_bytes)}, over the host "
                      f"memory cap of {format_bytes(cap_bytes)}; raise host_memory_cap_bytes or use strategy='hybrid'")
