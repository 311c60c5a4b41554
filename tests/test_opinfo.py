"""regen.opinfo's argument helpers: an op's tensor arguments in tree_flatten's order, by a plain loop."""

import torch
from torch.utils._pytree import tree_flatten

from regen import opinfo


def test_tensor_arguments_are_tree_flattens_tensors_in_its_order():
    a, b, c, d, e = (torch.zeros(i + 1) for i in range(5))
    cases = [
        ((a, 2, b), {}),
        (([a, b, c], 0), {}),  # aten.cat's Tensor[]
        ((a, (None, b)), {"accumulate": True}),  # aten.index_put's Tensor?[]
        ((a,), {"weight": b, "bias": None, "out": c}),
        ((a, [b, (c, [d])]), {"extra": {"x": e}}),  # deeper than any aten op, the order still tree_flatten's
        ((1.0, "mean", torch.float32), {}),
    ]
    for args, kwargs in cases:
        expected = [t for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)]
        got = opinfo.tensor_arguments(args, kwargs)
        assert len(got) == len(expected) and all(g is x for g, x in zip(got, expected)), (args, kwargs)


def test_input_storage_keys_are_the_storages_of_the_tensor_arguments():
    a = torch.zeros(8)
    view, other = a[2:], torch.ones(3)
    assert opinfo.input_storage_keys(([view, other], a), {"out": None}) == {opinfo.storage_key(a),
                                                                         opinfo.storage_key(other)}
