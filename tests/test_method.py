"""The run's method line: what a person reads first, for each kind of split."""

from __future__ import annotations

import pytest

from fedjax_split.run.method import describe


@pytest.mark.parametrize(
    ("args", "kw", "want"),
    [
        (("fedavg", 3, 6), {},
         "FedSplitBERT, c = 3 of 6: embeddings + layers 1-3 shared, layers 4-6 + head personal"),
        (("fedavg", 1, 2), {},
         "FedSplitBERT, c = 1 of 2: embeddings + layer 1 shared, layer 2 + head personal"),
        (("fedadam", 5, 6), {"quantize": "fp16"},
         "FedSplitBERT with FedAdam, c = 5 of 6: embeddings + layers 1-5 shared, layer 6 + head "
         "personal; sent as float16"),
        (("fedavg", 12, 12), {}, "FedAvg: the whole model shared (c = L = 12)"),
        (("fedprox", 6, 6), {"mu": 0.01},
         "FedProx (mu = 0.01): the whole model shared (c = L = 6)"),
        (("fedyogi", 0, 6), {"quantize": "bf16"},
         "isolated training (c = 0): nothing shared, each client trains its own model"),
        (("fedavg", 6, 6), {"num_frozen": 23440896, "freeze": r"embeddings\."},
         "FedAvg: the whole model shared (c = L = 6); 23,440,896 parameters frozen "
         "(--freeze 'embeddings\\\\.')"),
    ],
)  # fmt: skip
def test_describe(args: tuple, kw: dict, want: str) -> None:
    assert describe(*args, **kw) == want
