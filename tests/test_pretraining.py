"""run_pretraining's baselines on a tiny BERT (FedBFPT itself: tests/test_pretrain.py): no
further pre-training exports the starting model; the truncated baseline trains and sends its k
layers with the embeddings and head and exports a k-layer model; centralised training is one
client with all the clients' text and sends nothing."""

from __future__ import annotations

import json
from pathlib import Path

import jax
import numpy as np
import pytest
from run_fixtures import (  # noqa: F401 (private_cache is an autouse fixture)
    TINY_EMBEDDINGS,
    TINY_LAYER,
    TINY_MLM_HEAD,
    private_cache,
    write_tiny_model,
    write_tiny_text,
)

from fedjax_split.models.hf_checkpoint import load_pretrained
from fedjax_split.run.pretraining import run_pretraining


@pytest.fixture(scope="module")
def base(tmp_path_factory: pytest.TempPathFactory) -> dict:
    root = tmp_path_factory.mktemp("baselines")
    return {
        "root": root,
        "model": write_tiny_model(root / "model", num_layers=4),
        "text": write_tiny_text(root / "text"),
    }


def _run(base: dict, method: str, **extra: object) -> tuple[dict, Path]:
    out = base["root"] / method
    settings = {
        "corpus": "local", "data_dir": str(base["text"]), "model": str(base["model"]),
        "method": method, "clients": 2, "rounds": 1, "batch_size": 8, "max_length": 24,
        "lr": 1e-3, "heldout_fraction": 0.1, "output_dir": str(out), **extra,
    }  # fmt: skip
    with pytest.warns(UserWarning, match="freshly initialised"):
        summary = run_pretraining(settings, progress=False)
    return summary, out


def test_none_exports_the_starting_model(base: dict) -> None:
    summary, out = _run(base, "none")
    assert summary["rounds"] == 0 and summary["final"] == summary["initial"]
    assert summary["cum_bytes"] == 0 and summary["cum_flops"] == 0
    assert (out / "metrics.jsonl").read_text() == ""
    exported = load_pretrained(out / "model", num_labels=2, head="mlm")
    with pytest.warns(UserWarning):
        start = load_pretrained(base["model"], num_labels=2, head="mlm", seed=0)
    for a, b in zip(jax.tree.leaves(exported.params), jax.tree.leaves(start.params), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_truncated_trains_and_exports_its_first_k_layers(base: dict) -> None:
    summary, out = _run(base, "truncated", truncated_layers=2)
    (record,) = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    sent = 4 * (TINY_EMBEDDINGS + 2 * TINY_LAYER + TINY_MLM_HEAD)
    assert [c["bytes_up"] for c in record["clients"]] == [sent, sent]
    assert [c["layers"] for c in record["clients"]] == [[0, 1], [0, 1]]
    assert summary["layers"] == 2 and summary["model_config"]["num_hidden_layers"] == 2
    exported = load_pretrained(out / "model", num_labels=2, head="mlm")
    assert sorted(exported.params["encoder"]) == ["layer_0", "layer_1"]
    assert 0 < summary["flops_share_of_bert_fl"] < 1


def test_centralised_is_one_client_with_all_the_text_and_sends_nothing(base: dict) -> None:
    """Checked on the run's setup and first plan (training it costs a compilation; its round
    is the same code as the truncated baseline's)."""
    from fedjax_split.run import pretraining
    from fedjax_split.run.pretrain_config import resolve

    settings = {
        "corpus": "local", "data_dir": str(base["text"]), "model": str(base["model"]),
        "clients": 2, "max_length": 24, "heldout_fraction": 0.1,
    }  # fmt: skip
    with pytest.warns(UserWarning, match="freshly initialised"):
        central = pretraining.build(resolve(overrides={**settings, "method": "centralised"}))
    with pytest.warns(UserWarning, match="freshly initialised"):
        fed = pretraining.build(resolve(overrides={**settings, "method": "bert-fl"}))
    assert central.clients == [0] and fed.clients == [0, 1]
    assert central.split.to_dict() == fed.split.to_dict()  # the same documents, held out too
    # one stream of all the clients' documents: the same tokens, a piece fewer at most
    n_central = central.sequences[0].input_ids.shape[0]
    assert sum(s.input_ids.shape[0] for s in fed.sequences) - 1 <= n_central
    assert int(central.sequences[0].lengths.sum()) >= sum(int(s.lengths.sum()) - 2 * s.lengths.size
                                                          for s in fed.sequences)  # fmt: skip
    plan = pretraining.plan(central, 1)
    assert plan.layers == ((0, 1, 2, 3),) and len(plan.trained) == len(
        pretraining.plan(fed, 1).trained
    )


def test_freeze_leaves_parameters_out_of_every_plan(base: dict) -> None:
    """--freeze over Hugging Face names: 'embeddings\\.|encoder\\.' trains the MLM head alone
    (the study's warm-up); a pattern that leaves nothing to train is a one-line error."""
    from fedjax_split.errors import UserError
    from fedjax_split.run import pretraining
    from fedjax_split.run.pretrain_config import resolve

    settings = {
        "corpus": "local", "data_dir": str(base["text"]), "model": str(base["model"]),
        "clients": 2, "max_length": 24, "method": "centralised",
    }  # fmt: skip
    with pytest.warns(UserWarning, match="freshly initialised"):
        setup = pretraining.build(
            resolve(overrides={**settings, "freeze": r"embeddings\.|encoder\."})
        )
    assert pretraining.plan(setup, 1).trained == {
        "mlm/transform/dense/kernel", "mlm/transform/dense/bias", "mlm/transform/LayerNorm/scale",
        "mlm/transform/LayerNorm/bias", "mlm/bias",
    }  # fmt: skip
    with pytest.warns(UserWarning), pytest.raises(UserError, match="leaves nothing to train"):
        pretraining.build(resolve(overrides={**settings, "freeze": "."}))
