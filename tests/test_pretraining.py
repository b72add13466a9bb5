"""fedjax_split.run.pretraining (run_pretraining as a library, in this process) on a tiny BERT:
FedBFPT's outputs and cost accounting and the BertForMaskedLM it exports; the baselines: no
further pre-training exports the starting model, the truncated baseline trains and sends its k
layers with the embeddings and head and exports a k-layer model, centralised training is one
client with all the clients' text and sends nothing; --freeze. The command line around it
(flags, exit codes, kill -9 and --resume) is tests/test_pretrain.py's."""

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


SENT = 4 * (TINY_LAYER + TINY_MLM_HEAD)  # fp32: one layer and the MLM head, per client


@pytest.fixture(scope="module")
def fedbfpt(base: dict) -> Path:
    """Three rounds of FedBFPT (test_pretrain's command line runs the same settings)."""
    _, out = _run(base, "fedbfpt", split="source", rounds=3, small_layers=2)
    return out


def test_outputs_and_their_cost_accounting(fedbfpt: Path) -> None:
    for name in ("config.json", "split.json", "metrics.jsonl", "summary.json"):
        assert (fedbfpt / name).is_file(), name
    assert sorted(p.name for p in (fedbfpt / "checkpoints").iterdir()) == ["2", "3"]
    rows = [json.loads(x) for x in (fedbfpt / "metrics.jsonl").read_text().splitlines()]
    assert [r["round"] for r in rows] == [1, 2, 3] and [r["layer"] for r in rows] == [0, 0, 1]
    sent = SENT
    for r in rows:
        assert [c["bytes_up"] for c in r["clients"]] == [sent, sent]
        assert [c["layers"][0] for c in r["clients"]] == [0, 0]
        assert all(len(c["layers"]) == 2 for c in r["clients"])
        assert np.isfinite(r["mlm_loss"]) and 0 <= r["mlm_accuracy"] <= 1
        assert r["flops"] == sum(c["flops"] for c in r["clients"]) < r["bert_fl_flops"]
    # down: nothing in round 1 (clients hold the public checkpoint), then last round's update
    assert [r["bytes_down"] for r in rows] == [0, 2 * sent, 2 * sent]
    layers_used = {c["layers"][1] for r in rows for c in r["clients"] if r["layer"] == 0}
    assert layers_used <= {1, 2, 3} and len(layers_used) > 1  # sampled per client and round
    summary = json.loads((fedbfpt / "summary.json").read_text())
    assert summary["cum_bytes_up"] == 6 * sent and summary["schedule"] == [0, 0, 1]
    # summary.json is rounded for reading (4 significant digits); metrics.jsonl is exact
    assert summary["bytes_up_share_of_bert_fl"] == pytest.approx(
        6 * sent / summary["cum_bert_fl_bytes_up"], rel=1e-3
    )
    assert summary["final"]["mlm_loss"] == pytest.approx(rows[-1]["mlm_loss"], abs=5e-5)
    assert summary["layers"] == 4 and summary["small_layers"] == 2
    split = json.loads((fedbfpt / "split.json").read_text())
    assert split["scheme"] == "source" and len(split["clients"]) == 2
    config = json.loads((fedbfpt / "config.json").read_text())
    assert config["method"] == "fedbfpt" and config["small_layers"] == 2


def test_the_model_loads_in_pytorch_and_as_trains_token_classifier(fedbfpt: Path) -> None:
    """DIR/model is a BertForMaskedLM for transformers, and what `python -m fedjax_split.train
    --model DIR/model` loads for a token task: the encoder as trained, a fresh classifier (the
    study fine-tunes it for real on nero: docs/fedbfpt.md)."""
    import warnings

    transformers = pytest.importorskip("transformers")
    model = transformers.AutoModelForMaskedLM.from_pretrained(fedbfpt / "model")
    assert type(model).__name__ == "BertForMaskedLM" and model.config.num_hidden_layers == 4
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        token = load_pretrained(fedbfpt / "model", num_labels=5, head="token")
    assert "cls.predictions" in " ".join(str(w.message) for w in caught)  # reported, unused
    mlm = load_pretrained(fedbfpt / "model", num_labels=2, head="mlm")
    np.testing.assert_array_equal(
        np.asarray(token.params["encoder"]["layer_1"]["output"]["kernel"]),
        np.asarray(mlm.params["encoder"]["layer_1"]["output"]["kernel"]),
    )
    assert set(token.params) == {"embeddings", "encoder", "classifier"}
    assert (fedbfpt / "model" / "vocab.txt").is_file()  # the tokenizer travels with it


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
