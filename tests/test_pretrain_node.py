"""deploy.pretrain_node's checks of what a FedBFPT message asks a node to run (the federation's
equality with the simulation is test_flower_pretrain's)."""

from types import SimpleNamespace

import pytest

from fedjax_split.deploy.pretrain_node import check_layers
from fedjax_split.fed import layerwise


def test_a_small_model_with_a_repeated_deeper_layer_is_accepted() -> None:
    """The default draw is with replacement (the journal's [7, 7, 11]), so a node runs what the
    server draws: layers in increasing order within the model, a deeper one possibly twice."""
    node = SimpleNamespace(num_layers=6)
    draws = [layerwise.client_layers(1, layerwise.sample_deeper(0, r, c, 1, 6, 4))
             for r in range(1, 6) for c in range(6)]  # fmt: skip
    assert any(len(set(d)) < len(d) for d in draws)  # the draw does repeat layers here
    for layers in [*draws, [0, 1, 4, 4], [0], [0, 1, 2, 3, 4, 5]]:
        check_layers(node, layers)
    for bad in ([], [0, 4, 1], [0, 1, 6], [-1, 0], [0, 1, 5, 4]):
        with pytest.raises(ValueError, match="asked to run layers"):
            check_layers(node, bad)
    check_layers(node, [6], depth_only=True)
    with pytest.raises(ValueError, match="evaluate a model of"):
        check_layers(node, [7], depth_only=True)
