"""What a module call leaves behind besides its output (regen.profiler.outside_state): found by the probe
step for any holder (a cache object it was given, a list, a module attribute, a rebound counter), never for
a call whose tensors go only to its output and to autograd; such calls are never regions."""

import pytest
import torch
from torch import nn

from regen.profiler import profile_workload
from regen.workloads import Workload


class _Cache:
    """A key/value cache as libraries write them: an object passed to every layer, which appends to it."""

    def __init__(self):
        self.keys: dict[int, torch.Tensor] = {}

    def update(self, layer: int, k: torch.Tensor) -> torch.Tensor:
        old = self.keys.get(layer)
        self.keys[layer] = k if old is None else torch.cat([old, k], dim=1)
        return self.keys[layer]


class _Layer(nn.Module):
    def __init__(self, index: int, width: int, keeps: str):
        super().__init__()
        self.index, self.keeps = index, keeps
        self.fc1, self.fc2 = nn.Linear(width, 2 * width), nn.Linear(2 * width, width)
        self.calls = 0
        self.last = None

    def forward(self, x, cache=None, seen=None):
        h = torch.tanh(self.fc1(x))
        if self.keeps == "cache":
            h = h + cache.update(self.index, h).sum()
        elif self.keeps == "list":
            seen.append(h * 2)
        elif self.keeps == "attribute":
            self.last = h.detach() * 2
        elif self.keeps == "counter":
            self.calls += 1
        return x + self.fc2(h)


class _Net(nn.Module):
    def __init__(self, keeps: str, width: int = 32, layers: int = 3):
        super().__init__()
        self.layers = nn.ModuleList(_Layer(i, width, keeps) for i in range(layers))
        self.head = nn.Linear(width, 1)

    def forward(self, x):
        cache, seen = _Cache(), []
        for layer in self.layers:
            x = layer(x, cache=cache, seen=seen)
        return self.head(x).square().mean()


def _profile(keeps: str):
    torch.manual_seed(0)
    w = Workload(name=f"keeps-{keeps}", model=_Net(keeps), batch=(torch.randn(64, 32),), loss_fn=None)
    return profile_workload(w, device="cpu", repeats=1, warmup_steps=1, progress=None)


@pytest.mark.parametrize("keeps", ["cache", "list", "attribute", "counter"])
def test_a_call_that_keeps_state_is_found_and_never_a_region(keeps):
    from regen.planner.graph import build_graph

    profile = _profile(keeps)
    layers = [c for c in profile.module_calls if c.module.startswith("layers.") and c.module.count(".") == 1]
    assert len(layers) == 3 and all(c.leaves_behind for c in layers), [c.leaves_behind for c in layers]
    assert ("rebinds _Layer." in layers[0].leaves_behind) == (keeps in ("attribute", "counter"))
    assert any("leave state behind" in n for n in profile.notes)
    graph = build_graph(profile)
    assert not any(r.call.module.startswith("layers.") for r in graph.regions)


def test_a_call_whose_tensors_go_to_its_output_and_autograd_leaves_nothing():
    from regen.planner.graph import build_graph

    profile = _profile("nothing")
    assert not any(c.leaves_behind for c in profile.module_calls)
    assert {r.call.module for r in build_graph(profile).regions} >= {"layers.0", "layers.1", "layers.2"}


def test_autocast_casts_of_parameters_are_not_state():
    """Autocast caches its casts of the weights until it exits: the cache is autocast's, a replay makes and
    drops its own."""
    torch.manual_seed(0)
    w = Workload(name="bf16", model=_Net("nothing"), batch=(torch.randn(64, 32),), loss_fn=None, autocast="bf16")
    profile = profile_workload(w, device="cpu", repeats=1, warmup_steps=1, progress=None)
    assert any(op.name == "aten._to_copy.default" for op in profile.ops)
    assert not any(c.leaves_behind for c in profile.module_calls)
