"""fedjax_split.export: one client's personalised model (the global part as it was sent, cast to
fp32, merged with that client's local part from the run's client store) as a Hugging Face
directory that transformers' PyTorch BERT runs to the same logits as the run's own model, and
one-line errors for what a user can get wrong (client id, run directory, checkpoint, round).

Runs are tiny in-process `run_experiment`s (3 clients, critical layer 1 of 2, fp16 wire). That the
run's reported per-client accuracy is what the exported model scores is test_experiment's."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import chex
import jax
import numpy as np
import pytest
from run_fixtures import private_cache, write_tiny_model, write_tiny_sst2  # noqa: F401 (autouse)

from fedjax_split import export
from fedjax_split.errors import UserError
from fedjax_split.run import experiment
from fedjax_split.run.checkpoint import RunCheckpointer, checkpoint_dir


@pytest.fixture(scope="module")
def files(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    base = tmp_path_factory.mktemp("export")
    return {"base": base, "model": write_tiny_model(base / "model"),
            "data": write_tiny_sst2(base / "data")}  # fmt: skip


def _config(files: dict[str, Path], name: str, **kw: object) -> dict:
    return {
        "task": "sst2", "model": str(files["model"]), "data_dir": str(files["data"]),
        "output_dir": str(files["base"] / name), "clients": 3, "rounds": 2, "local_epochs": 1,
        "batch_size": 32, "lr": 1e-3, "max_length": 16, "critical_layer": 1, "quantize": "fp16",
        **kw,
    }  # fmt: skip


@pytest.fixture(scope="module")
def run(files: dict[str, Path]) -> Path:
    """Every client trains in both rounds; checkpoints of rounds 1 and 2 are kept."""
    experiment.run_experiment(_config(files, "run"), progress=False)
    return files["base"] / "run"


def _own_model(run: Path, client: int, round_: int) -> dict:
    """The model the run evaluates for `client` after `round_`, from its files: the checkpoint's
    fp16 global part in fp32, and the client's local part as of that round."""
    from fedjax_split.fed.roles import merge_params
    from fedjax_split.sim.client_store import ClientStore

    state, _ = RunCheckpointer(checkpoint_dir(run)).restore_untyped(round_)
    sent = state["server_state"]["global_params"]
    assert {np.asarray(x).dtype for x in jax.tree.leaves(sent)} == {np.dtype("float16")}
    received = jax.tree.map(lambda x: np.asarray(x).astype(np.float32), sent)
    local = ClientStore(run / experiment.CLIENTS_DIR).load(client, at_most=round_)
    return merge_params(received, local)


def test_the_exported_model_runs_in_pytorch_to_the_runs_own_logits(
    files: dict[str, Path], run: Path
) -> None:
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    from fedjax_split.models.bert import BertConfig, make_apply

    out = export.export_client(run, 2, files["base"] / "client2")
    hf = json.loads((out / "config.json").read_text())
    # the task's label names, not LABEL_0/LABEL_1
    assert hf["id2label"] == {"0": "negative", "1": "positive"}
    assert hf["label2id"] == {"negative": 0, "positive": 1}
    assert hf["architectures"] == ["BertForSequenceClassification"]
    model = transformers.BertForSequenceClassification.from_pretrained(out).eval()
    assert model.config.id2label == {0: "negative", 1: "positive"}
    tok = transformers.BertTokenizerFast.from_pretrained(out)
    texts = ["the film was good", "a dull and boring plot", "lovely", "the story was quite weak"]
    enc = tok(texts, padding=True, truncation=True, max_length=16, return_tensors="np")
    with torch.no_grad():
        theirs = model(**{k: torch.tensor(v) for k, v in enc.items()}).logits.numpy()
    _, meta = RunCheckpointer(checkpoint_dir(run)).restore_untyped()
    apply = make_apply(BertConfig.from_hf_dict(meta["model_config"]))
    ours = np.asarray(apply(_own_model(run, 2, 2), enc["input_ids"], enc["attention_mask"],
                            enc["token_type_ids"], train=False))  # fmt: skip
    np.testing.assert_allclose(theirs, ours, atol=1e-5)
    other = export.export_client(run, 0, files["base"] / "client0")
    with torch.no_grad():
        zeros = transformers.BertForSequenceClassification.from_pretrained(other).eval()(
            **{k: torch.tensor(v) for k, v in enc.items()}).logits.numpy()  # fmt: skip
    assert not np.allclose(zeros, theirs, atol=1e-5)  # another client, another head


def test_export_writes_a_loadable_personalised_model(files: dict[str, Path], run: Path) -> None:
    from fedjax_split.models.hf_checkpoint import load_pretrained

    out = export.export_client(run, 1, files["base"] / "export1")
    params, config, _ = export.personalised_params(run, 1)
    loaded = load_pretrained(out, num_labels=2)
    chex.assert_trees_all_equal(loaded.params, params)
    # clients differ in their local part (layer_1, pooler, head), share the global part
    p0, _, _ = export.personalised_params(run, 0)
    assert not np.array_equal(p0["classifier"]["kernel"], params["classifier"]["kernel"])
    np.testing.assert_array_equal(
        p0["encoder"]["layer_0"]["output"]["kernel"],
        params["encoder"]["layer_0"]["output"]["kernel"],
    )
    assert export.main(["--run-dir", str(run), "--client", "7", "--out", "x"]) == 2
    assert (out / "vocab.txt").is_file()  # the tokenizer travels with it


def test_an_earlier_round_exports_that_rounds_model(files: dict[str, Path], run: Path) -> None:
    for round_ in (1, 2):
        params, _, _ = export.personalised_params(run, 1, round_)
        chex.assert_trees_all_equal(params, _own_model(run, 1, round_))
    first, latest = (jax.tree.leaves(export.personalised_params(run, 1, r)[0]) for r in (1, None))
    assert any(not np.array_equal(a, b) for a, b in zip(first, latest, strict=True))
    out = files["base"] / "round1"
    assert export.main(["--run-dir", str(run), "--client", "1", "--out", str(out),
                        "--round", "1"]) == 0  # fmt: skip
    assert (out / "model.safetensors").is_file()


def _one_line_error(capsys: pytest.CaptureFixture, args: list[str], needle: str) -> None:
    assert export.main(args) == 2
    captured = capsys.readouterr()
    lines = captured.err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and needle in lines[0], captured.err
    assert "Traceback" not in captured.err and captured.out == ""


@pytest.mark.parametrize("args", [["--client", "abc"], []])
def test_a_bad_or_missing_flag_is_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture, args: list[str]
) -> None:
    with pytest.raises(SystemExit) as stop:  # argparse's exit, as every command's parser
        export.main(["--run-dir", str(tmp_path), *args])
    assert stop.value.code == 2
    lines = capsys.readouterr().err.strip().splitlines()
    needle = "invalid int value: 'abc'" if args else "required: --client, --out"
    assert len(lines) == 1 and lines[0].startswith("error: ") and needle in lines[0], lines


def test_user_errors_are_one_line_and_write_nothing(
    files: dict[str, Path], run: Path, tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    out = tmp_path / "out"
    base = ["--out", str(out)]
    for client in ("3", "-1"):
        _one_line_error(capsys, ["--run-dir", str(run), "--client", client, *base],
                        f"--client {client} is outside 0..2")  # fmt: skip
    with pytest.raises(UserError, match="outside 0..2"):
        export.export_client(run, 3, out)
    _one_line_error(capsys, ["--run-dir", str(tmp_path / "nowhere"), "--client", "0", *base],
                    "is not a directory; pass --run-dir of a train run")  # fmt: skip
    no_checkpoint = tmp_path / "no_checkpoint"
    no_checkpoint.mkdir()
    _one_line_error(capsys, ["--run-dir", str(no_checkpoint), "--client", "0", *base],
                    "has no checkpoint to export from")  # fmt: skip
    _one_line_error(capsys, ["--run-dir", str(run), "--client", "0", "--round", "9", *base],
                    "no checkpoint of round 9")  # fmt: skip

    corrupt = tmp_path / "corrupt"
    shutil.copytree(run, corrupt)
    for f in (corrupt / "checkpoints" / "2").rglob("*"):
        if f.is_file() and "state" in f.parts:
            f.write_bytes(b"\x00garbage")
    _one_line_error(capsys, ["--run-dir", str(corrupt), "--client", "0", *base], "is damaged")

    no_store = tmp_path / "no_store"
    shutil.copytree(run, no_store)
    shutil.rmtree(no_store / experiment.CLIENTS_DIR)
    _one_line_error(capsys, ["--run-dir", str(no_store), "--client", "0", *base],
                    f"has no client store ({experiment.CLIENTS_DIR}/)")  # fmt: skip

    not_a_model = tmp_path / "taken"
    not_a_model.mkdir()
    (not_a_model / "notes.txt").write_text("mine")
    _one_line_error(capsys, ["--run-dir", str(run), "--client", "0", "--out", str(not_a_model)],
                    "exists and is not empty; choose another --out, or pass --overwrite to "
                    "replace an earlier export there")  # fmt: skip
    # --overwrite replaces an earlier export, never a directory of something else
    _one_line_error(capsys, ["--run-dir", str(run), "--client", "0", "--out", str(not_a_model),
                             "--overwrite"], "is not a model directory")  # fmt: skip
    assert [p.name for p in not_a_model.iterdir()] == ["notes.txt"]
    assert (not_a_model / "notes.txt").read_text() == "mine"
    _one_line_error(capsys, ["--run-dir", str(run), "--client", "0", "--base-model", "x", *base],
                    "--base-model names a PEFT adapter's base model; add --peft")  # fmt: skip
    _one_line_error(capsys, ["--run-dir", str(run), "--client", "0", "--peft", *base],
                    "--peft writes LoRA adapters and this run has none")  # fmt: skip
    assert not out.exists()


def _digest(directory: Path) -> dict[str, tuple[bytes, int]]:
    """Each file's bytes and modification time (ns): what "left as it was" means."""
    return {p.name: (p.read_bytes(), p.stat().st_mtime_ns) for p in sorted(directory.iterdir())}


def test_an_existing_export_is_refused_unless_overwrite(
    run: Path, tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    """A second export into the same --out stops with one line, exit 2, the first export's files
    untouched; with --overwrite it replaces them (client 1's model over client 0's)."""
    from safetensors.numpy import load_file

    out = tmp_path / "client"
    assert export.main(["--run-dir", str(run), "--client", "0", "--out", str(out)]) == 0
    capsys.readouterr()
    first = _digest(out)
    _one_line_error(capsys, ["--run-dir", str(run), "--client", "1", "--out", str(out)],
                    f"{out} exists and is not empty; choose another --out, or pass "
                    "--overwrite")  # fmt: skip
    assert _digest(out) == first
    args = ["--run-dir", str(run), "--client", "1", "--out", str(out), "--overwrite"]
    assert export.main(args) == 0
    assert f"wrote client 1's personalised model to {out}" in capsys.readouterr().out
    want = load_file(str(export.export_client(run, 1, tmp_path / "client1") / "model.safetensors"))
    got = load_file(str(out / "model.safetensors"))
    assert all(np.array_equal(got[k], want[k]) for k in want) and got.keys() == want.keys()
    empty = tmp_path / "empty"
    empty.mkdir()  # an empty directory is no earlier export: written without --overwrite
    assert export.export_client(run, 0, empty) == empty and (empty / "config.json").is_file()


@pytest.fixture(scope="module")
def ner_run(files: dict[str, Path]) -> Path:
    from run_fixtures import write_tiny_conll

    data = write_tiny_conll(files["base"] / "conll")
    cfg = _config(
        files, "ner", task="ner", data_dir=str(data), partition="dirichlet", alpha=1.0,
        critical_layer=1, rounds=3, local_epochs=2, batch_size=8, lr=3e-3, quantize="none",
    )  # fmt: skip
    experiment.run_experiment(cfg, progress=False)
    return files["base"] / "ner"


def test_exported_ner_client_predicts_the_same_in_pytorch(ner_run: Path, files) -> None:
    """Client 1's personalised model, exported, loads in transformers as a
    BertForTokenClassification with the tag names and gives the same predictions as ours."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    from fedjax_split.models.hf_checkpoint import load_pretrained

    out = export.export_client(ner_run, 1, files["base"] / "ner_export")
    model = transformers.AutoModelForTokenClassification.from_pretrained(out).eval()
    assert type(model).__name__ == "BertForTokenClassification"
    assert model.config.id2label[1] == "B-neg" and len(model.config.id2label) == 5
    tok = transformers.AutoTokenizer.from_pretrained(out)
    enc = tok(
        [["good", "film", "awful", "plot"], ["the", "fine", "lovely", "story"]],
        is_split_into_words=True,
        padding=True,
        return_tensors="np",
    )
    with torch.no_grad():
        theirs = model(**{k: torch.tensor(v) for k, v in enc.items()}).logits.numpy()
    apply, params, _ = load_pretrained(out, num_labels=5, head="token")
    ours = np.asarray(
        apply(params, enc["input_ids"], enc["attention_mask"], enc["token_type_ids"], train=False)
    )
    np.testing.assert_allclose(ours, theirs, atol=1e-4)
    real = enc["attention_mask"] > 0
    np.testing.assert_array_equal(ours.argmax(-1)[real], theirs.argmax(-1)[real])


def test_the_skew_note_states_the_clients_labels_and_figures(tmp_path: Path) -> None:
    """The line after an export: client 0's label mix from partition.json, its own-split figure
    and the mean over clients from metrics.jsonl's last evaluated round."""
    from fedjax_split.export import skew_note

    (tmp_path / "partition.json").write_text(json.dumps({
        "realised_shares": [[0.2, 0.8], [0.5, 0.5]], "label_names": ["rotten", "fresh"],
    }))  # fmt: skip
    records = [
        {"round": 1, "accuracy": 0.7, "clients": [{"client": 0, "accuracy": 0.6},
                                                  {"client": 1, "accuracy": 0.8}]},
        {"round": 2},  # not evaluated
    ]  # fmt: skip
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    assert skew_note(tmp_path, 0) == (
        "client 0's data are 80% fresh / 20% rotten, and its model leans the same way: accuracy "
        "0.6000 on its own test split after round 1 (its majority label alone: about 0.80; mean "
        "over clients 0.7000). Judge it on data like client 0's."
    )
    assert skew_note(tmp_path, 1).startswith("client 1's data are 50% rotten / 50% fresh: ")
    assert skew_note(tmp_path, 2) is None  # no such client: nothing to say
    (tmp_path / "metrics.jsonl").unlink()
    assert skew_note(tmp_path, 0) is None


@pytest.fixture(scope="module")
def lora_run(files: dict[str, Path]) -> Path:
    """LoRA r = 2 on query and value, c = 1 of 2, fp16 wire: client 0's model is the received
    first-layer adapters, its own second-layer adapters and head, and the frozen base."""
    experiment.run_experiment(_config(files, "lora", lora_rank=2, lora_dropout=0.1, lr=1e-2),
                              progress=False)  # fmt: skip
    return files["base"] / "lora"


def test_a_lora_clients_model_exports_merged_and_as_a_peft_adapter_with_the_same_logits(
    files: dict[str, Path], lora_run: Path, capsys: pytest.CaptureFixture
) -> None:
    """The merged export in transformers gives the run's own model's logits (its adapters
    unmerged); the PEFT adapter, loaded by peft onto the base checkpoint, gives the same."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    peft = pytest.importorskip("peft")
    from fedjax_split.models import lora
    from fedjax_split.models.bert import make_apply
    from fedjax_split.models.hf_checkpoint import load_pretrained

    merged_dir, adapter_dir = files["base"] / "lora_merged", files["base"] / "lora_peft"
    said = {}
    for extra, out in (([], merged_dir), (["--peft"], adapter_dir)):
        args = ["--run-dir", str(lora_run), "--client", "0", "--out", str(out), *extra]
        assert export.main(args) == 0
        said[out] = capsys.readouterr()
        assert f"to {out}" in said[out].out
    assert said[merged_dir].err == ""
    # the run started from a local directory of no known hub model: its path, and a note
    said = said[adapter_dir]
    assert f"(PEFT, for base model {files['model']})" in said.out
    assert said.err == (
        f"note: the adapter names its base model by the local path {files['model']}; pass "
        "--base-model ID (its hub id) so that it loads on another machine\n"
    )
    assert sorted(p.name for p in adapter_dir.iterdir()) == [
        "adapter_config.json", "adapter_model.safetensors", "tokenizer_config.json", "vocab.txt",
    ]  # fmt: skip
    vocab = (files["model"] / "vocab.txt").read_bytes()
    assert all((d / "vocab.txt").read_bytes() == vocab for d in (merged_dir, adapter_dir))
    cfg = json.loads((adapter_dir / "adapter_config.json").read_text())
    assert cfg["base_model_name_or_path"] == str(files["model"])
    # the tokenizer beside the adapter loads alone and is the base model's
    text = ["the film was good", "a dull and boring plot"]
    theirs = transformers.AutoTokenizer.from_pretrained(files["model"])(text)["input_ids"]
    assert transformers.AutoTokenizer.from_pretrained(adapter_dir)(text)["input_ids"] == theirs
    assert cfg["lora_dropout"] == 0.1 and cfg["r"] == 2 and cfg["lora_alpha"] == 4.0

    ids = np.random.default_rng(0).integers(5, _vocab(files), size=(3, 8))
    params, config, _ = export.personalised_params(lora_run, 0)
    assert config.lora.rank == 2 and any(lora.is_adapter(p) for p in _paths(params))
    ours = np.asarray(make_apply(config)(params, ids, train=False))
    base = transformers.AutoModelForSequenceClassification.from_pretrained(files["model"])
    with torch.no_grad():
        whole = transformers.AutoModelForSequenceClassification.from_pretrained(merged_dir).eval()
        want = whole(input_ids=torch.tensor(ids)).logits.numpy()
        adapted = peft.PeftModel.from_pretrained(base, adapter_dir).eval()
        got = adapted(input_ids=torch.tensor(ids)).logits.numpy()
        # the adapter directory alone: its base by the name it records, its tokenizer beside it
        auto = peft.AutoPeftModelForSequenceClassification.from_pretrained(adapter_dir)
        alone = auto.eval()(input_ids=torch.tensor(ids)).logits.numpy()
    np.testing.assert_allclose(want, ours, rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
    np.testing.assert_array_equal(alone, got)
    # and the merged export is a plain BERT for fedjax_split too
    pre = load_pretrained(merged_dir, num_labels=2)
    assert not any(lora.is_adapter(p) for p in _paths(pre.params))


HUB_ID = "sentence-transformers/all-MiniLM-L6-v2"


@pytest.fixture(scope="module")
def hub_run(files: dict[str, Path]) -> Path:
    """A LoRA run started from `--model sentence-transformers/all-MiniLM-L6-v2` through the hub:
    huggingface_hub's download (patched: the hub is unreachable here) returns the tiny model as
    a snapshot in the hub's cache layout, models--ORG--NAME/snapshots/REVISION."""
    import huggingface_hub

    snapshot = files["base"] / "hub" / "models--sentence-transformers--all-MiniLM-L6-v2"
    snapshot = snapshot / "snapshots" / ("0a" * 20)
    shutil.copytree(files["model"], snapshot)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(huggingface_hub, "snapshot_download",
                   lambda repo, **kw: str(snapshot) if repo == HUB_ID else 1 / 0)  # fmt: skip
        experiment.run_experiment(_config(files, "hub_lora", model=HUB_ID, lora_rank=2, rounds=1),
                                  progress=False)  # fmt: skip
    return files["base"] / "hub_lora"


def test_a_peft_adapter_names_the_hub_id_the_run_started_from(
    files: dict[str, Path], hub_run: Path, tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    """base_model_name_or_path is the hub id (not the cache path the run loaded), with no note;
    --base-model sets it; the tokenizer files lie beside the adapter."""
    assert json.loads((hub_run / "config.json").read_text())["model"] == HUB_ID

    def base_of(out: Path, *extra: str) -> str:
        args = ["--run-dir", str(hub_run), "--client", "0", "--out", str(out), "--peft", *extra]
        assert export.main(args) == 0
        cfg = json.loads((out / "adapter_config.json").read_text())
        return cfg["base_model_name_or_path"]

    assert base_of(tmp_path / "peft") == HUB_ID
    said = capsys.readouterr()
    assert said.err == "" and f"(PEFT, for base model {HUB_ID})" in said.out
    vocab = (files["model"] / "vocab.txt").read_bytes()
    assert (tmp_path / "peft" / "vocab.txt").read_bytes() == vocab
    assert base_of(tmp_path / "named", "--base-model", "our-org/minilm-v2") == "our-org/minilm-v2"
    # the same from the directory alone (a Flower site's export knows no config.json)
    params, _, model_dir = export.personalised_params(hub_run, 0)
    assert "models--sentence-transformers--all-MiniLM-L6-v2" in model_dir
    assert export.peft_base(None, model_dir, say=pytest.fail) == HUB_ID


def test_the_hub_id_of_a_runs_model() -> None:
    """`hf_hub.hub_id`: by what the run was given, else by where it loaded the model."""
    from fedjax_split.models.hf_hub import hub_id

    cache = "/c/hub/models--bert-base-uncased/snapshots/abc"
    assert hub_id("bert-base-uncased", cache) == "bert-base-uncased"
    assert hub_id(None, cache) == "bert-base-uncased"  # the hub's cache layout alone
    assert hub_id(None, "/c/hub/models--org--name/snapshots/abc/") == "org/name"
    assert hub_id("minilm-l6", "/c/fedjax_split/gt/model") == HUB_ID  # the offline alias
    assert hub_id("models/mine", "models/mine") is None  # a local directory, of no known model
    assert hub_id("/abs/mine", "/abs/mine") is None
    assert hub_id(None, None) is None


def test_a_known_offline_copy_is_named_by_its_hub_id(
    files: dict[str, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A model directory anywhere whose weights are a model asset's pinned file (size, sha256)
    is that asset's hub model (registered here: the tiny model, as if it were one)."""
    import hashlib

    from fedjax_split import assets
    from fedjax_split.models.hf_hub import hub_id

    weights = (files["model"] / "model.safetensors").read_bytes()
    pinned = {"m/model.safetensors": (hashlib.sha256(weights).hexdigest(), len(weights))}
    monkeypatch.setitem(assets.ASSETS, "tiny", assets.Asset(
        requirement="tiny==1", wheel_sha256="0" * 64, members=("m/",), files=pinned, root="m",
        hub_id="org/tiny"))  # fmt: skip
    copy = tmp_path / "somewhere"
    shutil.copytree(files["model"], copy)
    assert hub_id(str(copy), str(copy)) == "org/tiny"
    (copy / "model.safetensors").write_bytes(weights[:-1] + bytes([weights[-1] ^ 1]))
    assert hub_id(str(copy), str(copy)) is None  # the same size, other bytes


def _vocab(files: dict[str, Path]) -> int:
    return json.loads((files["model"] / "config.json").read_text())["vocab_size"]


def _paths(tree: dict) -> list[str]:
    from fedjax_split.fed.roles import flatten_paths

    return list(flatten_paths(tree))


def test_a_lora_ner_clients_peft_adapter_is_a_token_classifier(files: dict[str, Path]) -> None:
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    peft = pytest.importorskip("peft")
    from run_fixtures import write_tiny_conll

    data = write_tiny_conll(files["base"] / "conll_lora")
    cfg = _config(files, "ner_lora", task="ner", data_dir=str(data), partition="dirichlet",
                  alpha=1.0, rounds=2, batch_size=8, lr=1e-2, lora_rank=2,
                  lora_targets="query|value|intermediate")  # fmt: skip
    experiment.run_experiment(cfg, progress=False)
    run = files["base"] / "ner_lora"
    adapter = export.export_client(run, 1, files["base"] / "ner_lora_peft", peft=True)
    merged = export.export_client(run, 1, files["base"] / "ner_lora_merged")
    assert json.loads((adapter / "adapter_config.json").read_text())["task_type"] == "TOKEN_CLS"
    base = transformers.AutoModelForTokenClassification.from_pretrained(
        files["model"], num_labels=5, ignore_mismatched_sizes=True
    )
    ids = torch.tensor(np.random.default_rng(1).integers(5, _vocab(files), size=(2, 6)))
    with torch.no_grad():
        got = peft.PeftModel.from_pretrained(base, adapter).eval()(input_ids=ids).logits.numpy()
        whole = transformers.AutoModelForTokenClassification.from_pretrained(merged).eval()
        want = whole(input_ids=ids).logits.numpy()
    assert got.shape == (2, 6, 5)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)


def _site(run: Path, state_dir: Path, client: int, round_: int, run_id: str) -> Path:
    """A Flower node's state dir as `deploy.node` leaves it after evaluating `client` in
    `round_`, made from the simulation's files: its local parts, the global part as received."""
    from types import SimpleNamespace

    from fedjax_split.deploy import node
    from fedjax_split.sim.client_store import ClientStore

    state, meta = RunCheckpointer(checkpoint_dir(run)).restore_untyped(round_)
    sim_store = ClientStore(run / experiment.CLIENTS_DIR)
    fields = ("model_config", "model_dir", "critical_layer", "lora", "seed")
    site = SimpleNamespace(client_id=client, local0=sim_store.initial,
                           frozen=state.get("frozen", {}),
                           model_meta={k: meta[k] for k in fields})  # fmt: skip
    store = node.store(state_dir, run_id, site)
    for r in sim_store.rounds(client):
        store.save_one(r, client, sim_store.load(client, at_most=r))
    node.keep_for_export(store, site, state["server_state"]["global_params"], round_,
                         sim_store.load(client, at_most=round_))  # fmt: skip
    return state_dir


def test_a_sites_export_from_its_node_alone_equals_the_runs(
    run: Path, tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    """At a site, the model assembled from the node's state dir (the global part as received,
    its own local part) is the run's export of that client, tensor for tensor."""
    from safetensors.numpy import load_file

    site = _site(run, tmp_path / "node", client=1, round_=2, run_id="ab" * 8)
    assert export.main(["--state-dir", str(site), "--client", "1", "--out",
                        str(tmp_path / "site")]) == 0  # fmt: skip
    assert "wrote client 1's personalised model" in capsys.readouterr().out
    export.export_client(run, 1, tmp_path / "run")
    got = load_file(str(tmp_path / "site" / "model.safetensors"))
    want = load_file(str(tmp_path / "run" / "model.safetensors"))
    assert got.keys() == want.keys()
    assert all(np.array_equal(got[k], want[k]) and got[k].dtype == want[k].dtype for k in want)


def test_an_export_without_its_base_directory_says_the_tokenizer_is_missing(
    run: Path, tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    """A node whose model directory is gone (moved, a cleared cache): the model is written, with
    a note that its tokenizer files are not, rather than silently without them."""
    site = _site(run, tmp_path / "node", client=1, round_=2, run_id="ab" * 8)
    meta = site / ("ab" * 8) / "model.json"
    record = json.loads(meta.read_text())
    meta.write_text(json.dumps({**record, "model_dir": str(tmp_path / "gone")}))
    out = tmp_path / "out"
    assert export.main(["--state-dir", str(site), "--client", "1", "--out", str(out)]) == 0
    assert capsys.readouterr().err == (
        f"note: the base model's directory {tmp_path / 'gone'} is not on this machine, so no "
        "tokenizer files are written; copy them from the base model\n"
    )
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "model.safetensors"]


def test_a_lora_sites_export_rebuilds_the_base_from_its_model_and_checks_its_sha256(
    files: dict[str, Path], lora_run: Path, tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    """A node keeps no copy of the frozen base: the export at the site rebuilds it from the
    model directory and the seed, equal to the run's export tensor for tensor; a base model
    changed since is a one-line error."""
    from safetensors.numpy import load_file, save_file

    from fedjax_split.deploy import node

    site = _site(lora_run, tmp_path / "node", client=0, round_=2, run_id="ab" * 8)
    assert not (site / ("ab" * 8) / node.FROZEN_FILE).exists()
    args = ["--state-dir", str(site), "--client", "0"]
    assert export.main([*args, "--out", str(tmp_path / "site")]) == 0
    export.export_client(lora_run, 0, tmp_path / "run")
    got = load_file(str(tmp_path / "site" / "model.safetensors"))
    want = load_file(str(tmp_path / "run" / "model.safetensors"))
    assert got.keys() == want.keys()
    assert all(np.array_equal(got[k], want[k]) and got[k].dtype == want[k].dtype for k in want)
    changed = tmp_path / "changed_model"
    shutil.copytree(files["model"], changed)
    weights = load_file(str(changed / "model.safetensors"))
    key = next(k for k in weights if k.endswith("embeddings.LayerNorm.weight"))
    weights[key] = weights[key] + 1
    save_file(weights, str(changed / "model.safetensors"))
    record = site / ("ab" * 8) / node.MODEL_FILE
    record.write_text(json.dumps({**json.loads(record.read_text()), "model_dir": str(changed)}))
    capsys.readouterr()
    _one_line_error(capsys, [*args, "--out", str(tmp_path / "changed")], "sha256 differs")


def test_a_sites_export_errors_are_one_line(
    run: Path, tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    base = ["--out", str(tmp_path / "out")]
    site = tmp_path / "node"
    _one_line_error(capsys, ["--state-dir", str(site), "--client", "1", *base],
                    "is not a directory; pass the node's state-dir")  # fmt: skip
    site.mkdir()
    _one_line_error(capsys, ["--state-dir", str(site), "--client", "1", *base], "holds no run")
    _site(run, site, client=1, round_=2, run_id="ab" * 8)
    _one_line_error(capsys, ["--state-dir", str(site), "--client", "0", *base],
                    "client 0 has not been evaluated at this node")  # fmt: skip
    _one_line_error(capsys, ["--state-dir", str(site), "--client", "1", "--round", "1", *base],
                    "holds the global part after round 2 only")  # fmt: skip
    _site(run, site, client=1, round_=1, run_id="cd" * 8)
    _one_line_error(capsys, ["--state-dir", str(site), "--client", "1", *base],
                    f"runs {'ab' * 8}, {'cd' * 8}; pass --run-id")  # fmt: skip
    _one_line_error(capsys, ["--state-dir", str(site), "--run-id", "ef" * 8, "--client", "1",
                             *base], "holds no run")  # fmt: skip
    assert export.main(["--state-dir", str(site), "--run-id", "cd" * 8, "--client", "1",
                        "--round", "1", *base]) == 0  # fmt: skip
