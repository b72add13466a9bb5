"""The run's method line: what a person reads first, for each kind of split."""

from __future__ import annotations

import pytest

from fedjax_split.models import lora
from fedjax_split.models.bert import BertConfig
from fedjax_split.run.method import client_words, describe

SIX = BertConfig(hidden_size=32, num_hidden_layers=6, num_attention_heads=2, intermediate_size=64)


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


@pytest.mark.parametrize(
    ("c", "targets", "want"),
    [
        (3, "query|value",
         "FedSplitBERT, c = 3 of 6: adapters of layers 1-3 shared, layers 4-6 adapters + head "
         "personal; LoRA r = 8, alpha = 16 on attention.self.query, attention.self.value (base "
         "weights frozen); sent as float16"),
        (6, "intermediate",
         "FedAvg: every adapter + head shared (c = L = 6); LoRA r = 8, alpha = 16 on "
         "intermediate.dense (base weights frozen); sent as float16"),
    ],
)  # fmt: skip
def test_describe_lora_says_adapters_are_what_is_shared(c: int, targets: str, want: str) -> None:
    config = lora.configure(SIX, lora.LoraSettings(8, None, targets))
    line = describe("fedavg", c, 6, quantize="fp16", num_frozen=10**6, lora=config)
    assert line == want


@pytest.mark.parametrize(
    ("algorithm", "cycle", "layers", "want"),
    [
        ("fedavg", 3, 6,
         "FedBT fine-tuning, cycle of 3 of 6 layers: round 1 trains layer 6 + head, round 2 "
         "trains layers 5-6 + head, round 3 trains layers 4-6 + head, then again; embeddings + "
         "layers 1-3 frozen; only the trained part is uploaded; sent as float16"),
        ("fedadam", 6, 12,
         "FedBT fine-tuning with FedAdam, cycle of 6 of 12 layers: round 1 trains layer 12 + "
         "head, ..., round 6 trains layers 7-12 + head, then again; embeddings + layers 1-6 "
         "frozen; only the trained part is uploaded; sent as float16"),
        ("fedavg", 2, 2,
         "FedBT fine-tuning, cycle of 2 of 2 layers: round 1 trains layer 2 + head, round 2 "
         "trains layers 1-2 + head, then again; embeddings frozen; only the trained part is "
         "uploaded; sent as float16"),
    ],
)  # fmt: skip
def test_describe_fedbt_says_which_layers_each_round_trains(
    algorithm: str, cycle: int, layers: int, want: str
) -> None:
    assert describe(algorithm, layers, layers, quantize="fp16", num_frozen=10**6,
                    cycle=cycle) == want  # fmt: skip


def test_describe_fedbt_names_a_freeze() -> None:
    freeze = r"embeddings\."
    line = describe("fedavg", 6, 6, num_frozen=12_345_678, freeze=freeze, cycle=3)
    assert line.endswith(f"only the trained part is uploaded; --freeze {freeze!r}: 12,345,678 "
                         "parameters frozen in all")  # fmt: skip


def test_the_client_optimiser_is_said_only_when_it_is_not_the_default() -> None:
    assert client_words("adamw", 2e-5, "constant", 0.0, None) == ""
    assert client_words("sgd", 5e-5, "linear", 0.06, 1.0) == (
        "; clients: SGD at lr 5e-05, linear warm-up (6%) and decay each round, gradients "
        "clipped to norm 1")  # fmt: skip
    assert client_words("adamw", 1e-4, "linear", 0.0, None) == (
        "; clients: AdamW at lr 0.0001, linear decay each round")  # fmt: skip
