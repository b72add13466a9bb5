"""fedjax_split.run.pretraining (run_pretraining as a library, in this process) on a tiny BERT:
FedBFPT's outputs and cost accounting and the BertForMaskedLM it exports; the baselines: no
further pre-training exports the starting model, the truncated baseline trains and sends its k
layers with the embeddings and head and exports a k-layer model, centralised training is one
client with all the clients' text and sends nothing; --freeze. The command line around it
(flags, exit codes, kill -9 and --resume) is tests/test_pretrain.py's."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from run_fixtures import (  # noqa: F401 (private_cache is an autouse fixture)
    TINY_EMBEDDINGS,
    TINY_LAYER,
    TINY_MLM_HEAD,
    private_cache,
    write_text_sites,
    write_tiny_model,
    write_tiny_text,
)

from fedjax_split.errors import Note, UserError
from fedjax_split.models.hf_checkpoint import load_pretrained
from fedjax_split.run.pretraining import run_pretraining
from fedjax_split.sim import pretrain_rounds


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
    with pytest.warns(Note, match="^a new masked-LM head, initialised from seed 0$"):
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
    assert summary["layer_draw"] == "replacement"
    level = summary["unigram"]  # the held-out targets' (unigram_level is checked by hand)
    assert 0 < level["unigram_accuracy"] < 1 and level["unigram_loss"] > 0
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
    chex.assert_trees_all_equal(exported.params, start.params)


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


@pytest.mark.parametrize("diverged", [[1], [0, 1]])
def test_a_diverged_client_has_no_line_and_a_round_without_any_stops(
    base: dict, diverged: list[int], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Clients whose update is not finite (NaN loss and parameters) are left out of the server's
    mean, named in `clients_rejected`, and have no line in `clients` (nor in `train_loss`); a
    round where none is left stops with one line and writes no record of it."""
    real_update = pretrain_rounds.client_update

    def update(*args: object, **kwargs: object) -> tuple:
        new, report = real_update(*args, **kwargs)
        if report.client in diverged:
            new = jax.tree.map(lambda x: jnp.full_like(x, jnp.nan), new)
            report = report._replace(loss=float("nan"))
        return new, report

    monkeypatch.setattr(pretrain_rounds, "client_update", update)
    out = base["root"] / f"diverged_{len(diverged)}"
    if len(diverged) == 2:
        with pytest.raises(UserError, match=r"^round 1: every client's update was not finite"):
            _run(base, "truncated", truncated_layers=2, output_dir=str(out))
        assert (out / "metrics.jsonl").read_text() == ""
        return
    _run(base, "truncated", truncated_layers=2, output_dir=str(out))
    (record,) = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert record["clients_rejected"] == [1]
    assert [c["client"] for c in record["clients"]] == [0]
    assert record["train_loss"] == pytest.approx(record["clients"][0]["train_loss"])
    assert np.isfinite(record["train_loss"])


def test_centralised_is_one_client_with_all_the_text_and_sends_nothing(base: dict) -> None:
    """Checked on the run's setup and first plan (training it costs a compilation; its round
    is the same code as the truncated baseline's)."""
    from fedjax_split.run import pretrain_setup, pretraining
    from fedjax_split.run.pretrain_config import resolve

    settings = {
        "corpus": "local", "data_dir": str(base["text"]), "model": str(base["model"]),
        "clients": 2, "max_length": 24, "heldout_fraction": 0.1,
    }  # fmt: skip
    with pytest.warns(Note, match="^a new masked-LM head, initialised from seed 0$"):
        central = pretrain_setup.build(resolve(overrides={**settings, "method": "centralised"}))
    with pytest.warns(Note, match="^a new masked-LM head, initialised from seed 0$"):
        fed = pretrain_setup.build(resolve(overrides={**settings, "method": "bert-fl"}))
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
    from fedjax_split.run import pretrain_setup, pretraining
    from fedjax_split.run.pretrain_config import resolve

    settings = {
        "corpus": "local", "data_dir": str(base["text"]), "model": str(base["model"]),
        "clients": 2, "max_length": 24, "method": "centralised",
    }  # fmt: skip
    with pytest.warns(Note, match="^a new masked-LM head, initialised from seed 0$"):
        setup = pretrain_setup.build(
            resolve(overrides={**settings, "freeze": r"embeddings\.|encoder\."})
        )
    assert pretraining.plan(setup, 1).trained == {
        "mlm/transform/dense/kernel", "mlm/transform/dense/bias", "mlm/transform/LayerNorm/scale",
        "mlm/transform/LayerNorm/bias", "mlm/bias",
    }  # fmt: skip
    with pytest.warns(UserWarning), pytest.raises(UserError, match="leaves nothing to train"):
        pretrain_setup.build(resolve(overrides={**settings, "freeze": "."}))


# --- sites with their own text (--site-data) ---


def _site_setup(base: dict, dirs: list[Path], **extra: object) -> object:
    from fedjax_split.run import pretrain_setup
    from fedjax_split.run.pretrain_config import resolve

    settings = {
        "site_data": ",".join(map(str, dirs)), "model": str(base["model"]), "max_length": 24,
        "batch_size": 8, "heldout_fraction": 0.1, "method": "bert-fl", **extra,
    }  # fmt: skip
    with pytest.warns(Note, match="^a new masked-LM head, initialised from seed 0$"):
        return pretrain_setup.build(resolve(overrides=settings))


def _documents(site: Path) -> list[str]:
    """A site's documents read here, independently: blank-line blocks of its files, by name."""
    return [b.strip() for f in sorted(site.glob("*.txt"))
            for b in f.read_text().split("\n\n") if b.strip()]  # fmt: skip


def _content(rows: np.ndarray, lengths: np.ndarray, special: set[int]) -> Counter:
    return Counter(int(t) for row, n in zip(rows, lengths, strict=True)
                   for t in row[:n] if int(t) not in special)  # fmt: skip


def test_each_sites_client_trains_on_exactly_its_sites_text(base: dict) -> None:
    """Client k's training sequences hold exactly the tokens of site k's documents but its
    held-out ones (a tenth, drawn from the seed and k), nothing of the other site; split.json
    gives the sites' counts."""
    from fedjax_split.data import tokenization
    from fedjax_split.data.text.corpus_split import site_heldout

    dirs = write_text_sites(base["root"] / "sites")
    setup = _site_setup(base, dirs)
    assert setup.clients == [0, 1] and setup.config.data.corpus == "local"
    tok = tokenization.load_tokenizer(base["model"])
    special = {tok.cls_token_id, tok.sep_token_id}
    counts = []
    for k, site in enumerate(dirs):
        docs = _documents(site)
        train, held = site_heldout(len(docs), client=k, seed=0, heldout_fraction=0.1)
        assert held.size == round(0.1 * len(docs)) and np.intersect1d(train, held).size == 0
        ids = tok([docs[i] for i in train], add_special_tokens=False)["input_ids"]
        seqs = setup.sequences[k]
        assert _content(seqs.input_ids, seqs.lengths, special) == Counter(
            t for x in ids for t in x
        ), k
        assert setup.sizes[k] == seqs.input_ids.shape[0]
        counts.append({"documents": len(docs), "train": train.size, "heldout": held.size})
    assert setup.split.to_dict() == {"scheme": "sites", "seed": 0, "sites": counts}
    assert [c["documents"] for c in counts] == [60, 30]


def test_each_site_holds_out_its_own_documents(base: dict) -> None:
    """The held-out batches are site 0's own, then site 1's: another site 1 changes neither
    site 0's training text nor its held-out batches (draws and masks seeded by the seed and
    the client id); sites draw different documents of equal text."""
    from fedjax_split.data.text.corpus_split import site_heldout

    dirs = write_text_sites(base["root"] / "held")
    other = write_tiny_text(base["root"] / "held" / "other", seed=7)
    a, b = _site_setup(base, dirs), _site_setup(base, [dirs[0], other])
    one = _site_setup(base, dirs[:1])  # site 0 alone: its batches, as its node derives them
    n0 = len(one.heldout)
    assert 0 < n0 < len(a.heldout) and 0 < n0 < len(b.heldout)
    assert a.heldout[n0].input_ids.tolist() != b.heldout[n0].input_ids.tolist()  # site 1's
    chex.assert_trees_all_equal(a.heldout[:n0] + b.heldout[:n0], one.heldout * 2)
    np.testing.assert_array_equal(a.sequences[0].input_ids, b.sequences[0].input_ids)
    draws = [site_heldout(60, client=k, seed=0, heldout_fraction=0.1)[1] for k in (0, 1)]
    assert draws[0].tolist() != draws[1].tolist()
    central = _site_setup(base, dirs, method="centralised")
    assert central.clients == [0] and central.sizes == [sum(a.sizes)]


@pytest.mark.parametrize("bad", ["empty", "one document"])
def test_a_bad_site_is_one_line_exit_2_nothing_written(
    base: dict, bad: str, capsys: pytest.CaptureFixture
) -> None:
    from fedjax_split import pretrain

    good = write_text_sites(base["root"] / f"bad_{bad}")[0]
    site = base["root"] / f"bad_{bad}" / "site_x"
    site.mkdir()
    if bad == "one document":
        (site / "a.txt").write_text("the movie was good\nvery good\n")
    out = base["root"] / f"bad_{bad}_out"
    args = [f"--site-data={good},{site}", f"--model={base['model']}", f"--output-dir={out}",
            "--max-length=24", "--method=bert-fl"]  # fmt: skip
    with pytest.warns(Note, match="^a new masked-LM head, initialised from seed 0$"):
        assert pretrain.main(args) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    needle = "no *.txt files" if bad == "empty" else "has 1 document(s), 1 held out"
    assert len(lines) == 1 and lines[0].startswith(f"error: site 1 ({site}): "), lines
    assert needle in lines[0] and not out.exists()


def test_a_run_saved_before_layer_draw_resumes_with_the_draw_it_used() -> None:
    """A FedBFPT config.json written before --layer-draw existed drew without replacement: a
    --resume with today's default (with replacement) is refused, one that says distinct
    continues."""
    from fedjax_split.run import pretraining
    from fedjax_split.run.pretrain_config import resolve

    today = resolve(overrides={"method": "fedbfpt"})
    assert today.federation.layer_draw == "replacement"
    old = {k: v for k, v in today.to_dict().items() if k != "layer_draw"}
    assert pretraining.mismatch(old, today) == ["layer_draw"]
    assert pretraining.mismatch(old, resolve(overrides={"layer_draw": "distinct"})) == []
    assert pretraining.mismatch(today.to_dict(), today) == []
    # the other methods draw no layers: an old bert-fl run resumes whatever the draw says
    bert_fl = resolve(overrides={"method": "bert-fl"})
    old = {k: v for k, v in bert_fl.to_dict().items() if k != "layer_draw"}
    assert pretraining.mismatch(old, bert_fl) == []


def test_a_federation_round_without_an_upload_taken_names_the_supernodes() -> None:
    """Flower's case of the same rule (its nodes' uploads were rejected): check the SuperNodes
    and resume, since another try may be answered."""
    from fedjax_split.run.pretraining import counted

    assert counted(3, [0, 1, 2], [1], diverged=False) == [0, 2]
    with pytest.raises(UserError, match=r"^round 3: no client's upload was taken \(2 rejected\); "
                                        r"check the SuperNodes, then continue with --resume$"):
        counted(3, [0, 2], [0, 2], diverged=False)
