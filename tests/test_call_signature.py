"""The call signature's trainable-parameter count, read at every step of a plan set: right after the model
changes, and listed again only then."""

import torch
from torch import nn

from regen.call_signature import TrainableCount


class _Model(nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(4, 4) for _ in range(3))

    def forward(self, x):
        for layer in self.layers[:2]:  # a new ModuleList every call, as Hugging Face decoders slice theirs
            x = layer(x)
        return x


def _counting_listings(model: nn.Module) -> list[int]:
    listings = []
    plain = model.parameters

    def parameters(*args, **kwargs):
        listings.append(1)
        return plain(*args, **kwargs)

    model.parameters = parameters
    return listings


def test_the_count_follows_the_model_and_lists_it_again_only_when_it_changed():
    model = _Model()
    count = TrainableCount(model)
    listings = _counting_listings(model)
    try:
        assert count() == 6
        for _ in range(3):
            model(torch.randn(2, 4))  # the slice registers modules into a container outside the model
            assert count() == 6
        assert len(listings) == 1
        model.layers[0].weight.requires_grad_(False)  # flags are read at every call
        assert count() == 5
        model.layers[1].adapter = nn.Linear(4, 4)  # a module added inside the model: listed again
        assert count() == 7 and len(listings) == 2
        model.layers[2].register_parameter("scale", nn.Parameter(torch.ones(1)))
        assert count() == 8 and len(listings) == 3
    finally:
        for h in count.hooks:
            h.remove()
