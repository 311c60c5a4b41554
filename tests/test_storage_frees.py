"""Storages watched for their frees (regen.storage_frees): each free reported once, as it happens, whoever drops
the last reference (a view, autograd's saved tensors in backward)."""

import torch
from torch.multiprocessing.reductions import StorageWeakRef

from regen.storage_frees import FreedStorages


def test_a_free_is_reported_once_when_the_last_reference_goes():
    watched = FreedStorages()
    a = torch.zeros(1000)
    watched.watch("a", StorageWeakRef(a.untyped_storage()), 4000)
    view = a[10:]
    del a
    assert watched.pop_freed() == []  # the view keeps it
    assert "a" in watched
    del view
    assert watched.pop_freed() == [("a", 4000)]
    assert watched.pop_freed() == [] and "a" not in watched


def test_a_saved_tensor_freed_by_backward_is_reported():
    watched = FreedStorages()
    x = torch.randn(100, requires_grad=True)
    y = x.exp()  # autograd saves its output
    watched.watch_storage("y", y.untyped_storage(), 400)
    loss = y.sum()
    del y
    assert watched.pop_freed() == []
    loss.backward()
    assert watched.pop_freed() == [("y", 400)]


def test_a_key_watched_again_reports_only_its_latest_storage():
    watched = FreedStorages()
    a, b = torch.zeros(10), torch.zeros(20)
    watched.watch_storage(1, a.untyped_storage(), 40)
    watched.watch_storage(1, b.untyped_storage(), 80)
    del a
    assert watched.pop_freed() == []  # the first watch was replaced
    watched.resize(1, 100)
    assert watched.nbytes(1) == 100
    del b
    assert watched.pop_freed() == [(1, 100)]


def test_forgotten_and_already_freed_storages():
    watched = FreedStorages()
    a = torch.zeros(10)
    watched.watch_storage("a", a.untyped_storage(), 40)
    assert watched.forget("a") == 40 and watched.forget("a") == 0
    del a
    assert watched.pop_freed() == []
    b = torch.zeros(10)
    ref = StorageWeakRef(b.untyped_storage())
    del b
    watched.watch("b", ref, 40)  # freed before it was watched: reported at once
    assert watched.pop_freed() == [("b", 40)]
