"""Pieces of the runtime on their own: the host pool, storage-level swap with shared views, plan indexing."""

import pytest
import torch

from regen.errors import FormatError
from regen.runtime.plan_index import index_plan
from regen.runtime.storage_views import Geometry, view_of
from regen.runtime.swap import HostPool, SyncEngine
from regen.runtime.swap.host_pool import MIN_CHUNK_BYTES

from common import traced
from handmade import PLANS


def test_host_pool_first_fit_reuse_and_growth():
    pool = HostPool(MIN_CHUNK_BYTES)
    a = pool.allocate(1000)
    b = pool.allocate(5000)
    assert a.tensor.numel() == 1000 and b.start >= a.start + 1000
    pool.release(a)
    c = pool.allocate(900)  # reuses the freed range
    assert c.start == a.start
    big = pool.allocate(3 * MIN_CHUNK_BYTES)  # does not fit: a new chunk
    assert pool.grow_count == 2 and pool.capacity_bytes >= 4 * MIN_CHUNK_BYTES
    for s in (b, c, big):
        pool.release(s)
    assert pool.checked_out_bytes == 0
    assert all(chunk.free == [[0, chunk.tensor.numel()]] for chunk in pool.chunks)  # ranges merged back


def test_storage_level_swap_rebuilds_every_view():
    engine = SyncEngine(torch.device("cpu"), HostPool())
    base = torch.randn(6, 8)
    views = [base, base.t(), base[2:4, 1::2], base.view(torch.int32)[1]]
    geometries = [Geometry.of(v) for v in views]
    expected = [v.clone() for v in views]
    out = engine.copy_out(views[1])  # any view: the whole storage moves once
    assert out.slot.nbytes == base.untyped_storage().nbytes()
    base.zero_()  # the device copy is gone; only the host copy is right
    restored = engine.copy_in(out)
    for g, e in zip(geometries, expected):
        assert torch.equal(view_of(restored.buffer, g), e)


def test_plan_index_refuses_inconsistent_plans():
    _, trace = traced("mlp")
    plan = PLANS["recompute"](trace)
    index = index_plan(plan)
    assert any(i.action != "keep" for i in index.decisions.values()) and index.recipe_input_keys
    d = next(d for d in plan.decisions if d.action == "recompute" and d.recipe_inputs)
    d.recipe_inputs = [9999]
    with pytest.raises(FormatError, match="9999"):
        index_plan(plan)
    plan = PLANS["keep-all"](trace)
    plan.decisions.append(plan.decisions[0])
    with pytest.raises(FormatError, match="two decisions"):
        index_plan(plan)
