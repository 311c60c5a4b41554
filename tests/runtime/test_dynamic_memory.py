"""Dynamic mode's count of memory in use on CPU (regen.runtime.dynamic.cap_memory.TrackedMemory): exact at every
reading, following storages' lives (views and autograd's saved tensors included), each free reported as it happens
(regen.storage_frees)."""

import gc

import torch
from torch import nn

from regen.runtime.dynamic.cap_memory import TrackedMemory, model_storages


def test_the_running_total_follows_each_storage_until_it_dies():
    memory = TrackedMemory()
    a, b = torch.zeros(1000), torch.zeros(250)
    for t in (a, b, a[10:], a.view(10, 100)):  # a view counts its storage once
        memory.track(t)
    assert memory.in_use_bytes() == 5000
    view = a[5:]
    del a, t
    gc.collect()
    assert memory.in_use_bytes() == 5000  # the view keeps the storage
    del view
    assert memory.in_use_bytes() == 1000
    x = torch.randn(100, requires_grad=True)
    y = x.exp()  # saved by autograd for backward
    memory.track(y)
    loss = y.sum()
    del y
    gc.collect()
    assert memory.in_use_bytes() == 1400  # autograd holds it
    loss.backward()
    assert memory.in_use_bytes() == 1000
    del b
    assert memory.in_use_bytes() == 0


def test_a_storage_at_a_dead_ones_address_is_counted_anew():
    memory = TrackedMemory()
    for _ in range(50):  # the allocator hands the same addresses back
        t = torch.empty(4096)
        memory.track(t)
        assert memory.in_use_bytes() == 4 * 4096
        del t
        assert memory.in_use_bytes() == 0


def test_the_models_storages_are_the_start_figure_not_tracked_twice():
    model = nn.Linear(8, 8)
    model(torch.randn(2, 8)).sum().backward()
    memory = TrackedMemory()
    memory.track(model.weight.grad)  # a gradient an earlier backward made
    memory.begin_step(model)
    assert memory.in_use_bytes() == memory.start_bytes == sum(model_storages(model).values())
    grad = model.weight.grad
    model.weight.grad = None
    del grad
    assert memory.in_use_bytes() == memory.start_bytes  # no longer tracked: its death changes nothing


def test_every_read_is_exact_as_soon_as_a_storage_dies():
    memory = TrackedMemory()
    tensors = [torch.empty(1024) for _ in range(10)]
    for t in tensors:
        memory.track(t)
    assert memory.in_use_bytes() == 10 * 4096
    del t
    tensors.pop()
    assert memory.in_use_bytes() == 9 * 4096  # no purge, no figure to pass: the free was reported
    tensors.clear()
    assert memory.in_use_bytes() == 0
