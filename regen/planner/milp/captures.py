"""What the runtime holds for a plan's captures, in the MILP (docs/milp.md "Captures").

The runtime captures every recipe op in forward and keeps the capture until the step ends; on a CPU
device a random op's capture holds a copy of the RNG state, and an op that writes a buffer holds a copy
of it (regen.planner.residency.op_capture_bytes). A random region's call holds an RNG state the same way.
So for every op q with capture bytes m_q that some recipe option runs, `u_q` in [0, 1] with
`u_q >= rec_{t,k}` for each such option (one capture however many recipes run q), and the savings drop
by `m_q u_q` from step q on; a random region's `z_R` costs its RNG state from its call's first op on.
A region's argument that no backward saves (`Region.held`: an attention mask every block reads) is held
from the op after its last forward read until the latest replay of a chosen region that takes it: with
that argument's regions' replay steps b_1 < ... < b_k, `h_j` in [0, 1] is "held up to b_j", `h_j >= z_R`
for each R replayed at b_j and `h_j >= h_{j+1}`; the savings drop by `m h_1` after the last read and
rise by `m (h_j - h_{j+1})` after b_j (h_{k+1} = 0).

regen.planner.milp.model adds these to its savings changes; `worst_bytes_until` says what they could cost
at most up to a step, to decide which memory constraints may bind.
"""

from __future__ import annotations

from bisect import bisect_right
from itertools import accumulate
from typing import TYPE_CHECKING

from regen.planner.milp.highs import new_var
from regen.planner.residency import region_capture_bytes

if TYPE_CHECKING:
    from regen.planner.milp.model import Model


class CaptureTerms:
    """The capture costs of one model: savings changes (step -> [(coefficient, variable)])."""

    def __init__(self, model: "Model"):
        g, mu = model.graph, model.mem_unit
        self.changes: dict[int, list] = {}
        users: dict[int, list] = {}  # op -> rec binaries of the recipe options that run it
        for v in model.vars.values():
            for k, r in enumerate(v.rec):
                for q in v.c.recipes[k].ops:
                    if g.capture_bytes.get(q):
                        users.setdefault(q, []).append(r)
        for q, recs in sorted(users.items()):
            u = new_var(f"capture_{q}", 0, 1)
            for r in recs:
                model.prob += u - r >= 0, f"capture_{q}_{r.name}"
            self.changes.setdefault(q, []).append((-g.capture_bytes[q] / mu, u))
        for rv in model.regions.values():
            held = region_capture_bytes(g, rv.region)
            if held:
                self.changes.setdefault(rv.region.call.first_op, []).append((-held / mu, rv.z))
        self._add_held_arguments(model)
        points = sorted(self.changes)
        self._points = points
        self._worst = list(accumulate(-sum(cf for cf, _ in self.changes[p]) * mu for p in points))

    def worst_bytes_until(self, step: int) -> float:
        """The most the captures can hold at `step` (every one chosen)."""
        k = bisect_right(self._points, step)
        return self._worst[k - 1] if k else 0.0

    def _add_held_arguments(self, model: "Model") -> None:
        """The `h_j` chains of the regions' held arguments (see the module doc)."""
        takers: dict[int, list] = {}  # storage -> [(HeldArgument, replay step, z_R)]
        for rv in model.regions.values():
            for h in rv.region.held:
                takers.setdefault(h.storage, []).append((h, rv.region.replay_step, rv.z))
        n = model.graph.num_steps
        for storage, uses in sorted(takers.items()):
            h = uses[0][0]
            m = h.bytes / model.mem_unit
            steps = sorted({b for _, b, _ in uses})
            chain = [new_var(f"held_{storage}_{b}", 0, 1) for b in steps]
            for j, (b, y) in enumerate(zip(steps, chain)):
                for _, b_r, z in uses:
                    if b_r == b:
                        model.prob += y - z >= 0, f"held_{storage}_{b}_{z.name}"
                if j + 1 < len(chain):
                    model.prob += y - chain[j + 1] >= 0, f"held_{storage}_{b}_next"
            self.changes.setdefault(h.first_held_step, []).append((-m, chain[0]))
            for j, b in enumerate(steps):
                if b + 1 >= n:
                    continue
                self.changes.setdefault(b + 1, []).append((m, chain[j]))
                if j + 1 < len(chain):
                    self.changes[b + 1].append((-m, chain[j + 1]))
