"""LoRA adapters (models/lora.py): the forward against the merged model and the base model, PEFT's
initialisation, the roles by the critical layer, the settings' errors, and the PEFT export against
peft's own PeftModel in PyTorch."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from run_fixtures import write_tiny_model

from fedjax_split.errors import UserError
from fedjax_split.fed import roles
from fedjax_split.models import hf_checkpoint, lora
from fedjax_split.models import peft as peft_export
from fedjax_split.models.bert import init_params, make_apply
from fedjax_split.models.bert_config import BertConfig, Compute

BASE = BertConfig(
    vocab_size=40, hidden_size=16, num_hidden_layers=3, num_attention_heads=2,
    intermediate_size=24, max_position_embeddings=32, num_labels=3,
)  # fmt: skip


def _config(rank: int = 2, targets: str = lora.DEFAULT_TARGETS, dropout: float = 0.0,
            **kw) -> BertConfig:  # fmt: skip
    settings = lora.LoraSettings(rank, None, targets, dropout)
    return lora.configure(dataclasses.replace(BASE, **kw), settings)


def _batch(seed: int = 0, b: int = 3, t: int = 7):
    rng = np.random.default_rng(seed)
    ids = rng.integers(5, BASE.vocab_size, size=(b, t)).astype(np.int32)
    mask = np.ones((b, t), np.int32)
    mask[0, 5:] = 0
    return jnp.asarray(ids), jnp.asarray(mask), jnp.zeros_like(jnp.asarray(ids))


def _with_random_b(params: dict, seed: int = 1) -> dict:
    """The adapters with B drawn at random (a trained adapter), everything else as it was."""
    flat = roles.flatten_paths(params)
    for i, path in enumerate(sorted(p for p in flat if p.endswith("_lora/b"))):
        key = jax.random.fold_in(jax.random.key(seed), i)
        flat[path] = jax.random.normal(key, flat[path].shape)
    return roles.unflatten_paths(flat)


def _base_only(params: dict) -> dict:
    return {p: v for p, v in roles.flatten_paths(params).items() if not lora.is_adapter(p)}


def test_default_targets_are_every_layers_query_and_value() -> None:
    config = _config()
    want = tuple(f"encoder/layer_{i}/attention/{m}" for i in range(3) for m in ("query", "value"))
    assert config.lora.targets == want
    assert config.lora.alpha == 4.0  # 2r
    every = _config(targets="query|key|value|dense")
    assert len(every.lora.targets) == 6 * 3
    one = _config(targets=r"layer\.1\.intermediate")
    assert one.lora.targets == ("encoder/layer_1/intermediate",)


def test_the_adapters_sit_beside_their_layers_with_peft_shapes_and_init() -> None:
    config = _config(rank=3, targets="intermediate|output.dense")
    params = init_params(config, jax.random.key(0))
    flat = roles.flatten_paths(params)
    adapters = {p: v for p, v in flat.items() if lora.is_adapter(p)}
    assert len(adapters) == 2 * 3 * 3  # a and b for 3 layers x 3 dense layers
    layer = "encoder/layer_0"
    assert flat[f"{layer}/intermediate_lora/a"].shape == (16, 3)
    assert flat[f"{layer}/intermediate_lora/b"].shape == (3, 24)
    assert flat[f"{layer}/output_lora/a"].shape == (24, 3)  # the FFN's output: in = 24
    assert flat[f"{layer}/attention/output_lora/a"].shape == (16, 3)
    for path, value in adapters.items():
        if path.endswith("/b"):
            assert not np.any(np.asarray(value))  # B starts at zero
        else:  # A ~ U(-1/sqrt(fan_in), 1/sqrt(fan_in)), as torch's nn.Linear and PEFT draw it
            bound = 1 / np.sqrt(value.shape[0])
            assert np.abs(np.asarray(value)).max() <= bound
            assert np.abs(np.asarray(value)).max() > 0.5 * bound


def test_fresh_adapters_depend_on_seed_and_path_only() -> None:
    config = _config()
    one, again, other = (roles.flatten_paths(lora.init_adapters(config, s)) for s in (0, 0, 1))
    a_paths = [p for p in one if p.endswith("/a")]
    for p in a_paths:
        np.testing.assert_array_equal(one[p], again[p])
        assert not np.array_equal(one[p], other[p])
    firsts = {np.asarray(one[p]).ravel()[0].item() for p in a_paths}
    assert len(firsts) == len(a_paths)  # no two layers drew from the same key


def test_with_b_zero_the_model_is_the_base_model_bit_for_bit() -> None:
    """In evaluation and in training (dropout on): the adapters add exact zeros, and no dropout
    mask of the base model moves (each adapter's dropout has its own key)."""
    config = _config(dropout=0.3, hidden_dropout_prob=0.2)
    params = init_params(config, jax.random.key(0))
    plain = dataclasses.replace(config, lora=None)
    base = roles.unflatten_paths(_base_only(params))
    ids, mask, types = _batch()
    for train in (False, True):
        kw = {"train": train, "rng": jax.random.key(5) if train else None}
        got = make_apply(config)(params, ids, mask, types, **kw)
        want = make_apply(plain)(base, ids, mask, types, **kw)
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


def test_the_lora_forward_equals_the_merged_forward() -> None:
    for dtype in ("float32", "bfloat16"):
        config = _config(rank=2, targets="query|value|intermediate", compute=Compute(dtype))
        params = _with_random_b(init_params(config, jax.random.key(0)))
        merged, plain = lora.merge(params, config)
        assert not any(lora.is_adapter(p) for p in roles.flatten_paths(merged))
        assert plain.lora is None
        ids, mask, types = _batch()
        got = make_apply(config)(params, ids, mask, types, train=False)
        want = make_apply(plain)(merged, ids, mask, types, train=False)
        base = make_apply(plain)(roles.unflatten_paths(_base_only(params)), ids, mask, types,
                                 train=False)  # fmt: skip
        effect = np.abs(np.asarray(want) - np.asarray(base)).max()  # what B moved
        error = np.abs(np.asarray(got) - np.asarray(want)).max()
        assert effect > 1e-3
        assert error < (1e-4 if dtype == "float32" else 0.2) * effect, (dtype, error, effect)


def test_merge_is_w_plus_alpha_over_r_times_a_b() -> None:
    config = _config(rank=2, targets=r"layer\.0\.attention\.self\.query")
    config = dataclasses.replace(config, lora=dataclasses.replace(config.lora, alpha=3.0))
    params = _with_random_b(init_params(config, jax.random.key(0)))
    flat = roles.flatten_paths(params)
    merged = roles.flatten_paths(lora.merge(params, config)[0])
    t = "encoder/layer_0/attention/query"
    a, b = np.asarray(flat[f"{t}_lora/a"], np.float64), np.asarray(flat[f"{t}_lora/b"], np.float64)
    want = np.asarray(flat[f"{t}/kernel"], np.float64) + 1.5 * a @ b  # alpha / r = 3 / 2
    np.testing.assert_allclose(np.asarray(merged[f"{t}/kernel"]), want, rtol=1e-6, atol=1e-7)
    other = "encoder/layer_1/attention/query/kernel"
    np.testing.assert_array_equal(merged[other], flat[other])


def test_the_roles_split_the_adapters_at_the_critical_layer_and_freeze_the_base() -> None:
    config = _config(targets="query")
    params = init_params(config, jax.random.key(0))
    for c in range(4):
        rule = roles.train_only(roles.critical_layer_rule(c, 3), lora.trainable)
        labels = roles.role_labels(params, rule)
        for path, role in labels.items():
            layer = roles.layer_index(path)
            if lora.is_adapter(path):
                assert role == ("global" if layer < c else "local"), (c, path)
            elif path.startswith("classifier/"):
                assert role == ("global" if c == 3 else "local"), (c, path)
            else:  # embeddings, kernels, LayerNorms, the pooler
                assert role == "frozen", (c, path)


@pytest.mark.parametrize(
    ("settings", "match"),
    [
        (lora.LoraSettings(0), "--lora-rank must be an integer >= 1"),
        (lora.LoraSettings(2, alpha=-1.0), "--lora-alpha must be a number > 0"),
        (lora.LoraSettings(2, dropout=1.0), r"--lora-dropout must be in \[0, 1\)"),
        (lora.LoraSettings(2, targets="(query"), "is not a valid regex"),
        (lora.LoraSettings(2, targets="pooler|classifier"), "matches no dense layer"),
    ],
)
def test_bad_settings_are_one_line_errors(settings: lora.LoraSettings, match: str) -> None:
    with pytest.raises(UserError, match=match) as err:
        lora.configure(BASE, settings)
    assert "\n" not in str(err.value)


def test_the_mlm_head_is_refused() -> None:
    with pytest.raises(UserError, match="FedBFPT"):
        lora.configure(dataclasses.replace(BASE, head="mlm"), lora.LoraSettings(2))


def test_fields_round_trip_through_json() -> None:
    config = _config(rank=4, targets="value")
    saved = json.loads(json.dumps(lora.fields(config)))
    plain = dataclasses.replace(config, lora=None)
    assert lora.from_fields(plain, saved) == config
    assert lora.fields(plain) is None and lora.from_fields(plain, None) == plain
    assert "lora_rank" not in config.to_hf_dict()  # HF's config never sees the adapters
    for bad in ({"lora_rank": 4}, {**saved, "lora_rank": "four"},
                {**saved, "lora_targets": ["encoder/layer_9/attention/query"]}):  # fmt: skip
        with pytest.raises(UserError, match="LoRA record is unreadable"):
            lora.from_fields(plain, bad)


def test_load_pretrained_adds_fresh_adapters_to_the_checkpoint(tmp_path: Path) -> None:
    model = write_tiny_model(tmp_path / "m")
    plain = hf_checkpoint.load_pretrained(model, num_labels=2, seed=3)
    pre = hf_checkpoint.load_pretrained(model, num_labels=2, seed=3,
                                        lora=lora.LoraSettings(2, targets="key"))  # fmt: skip
    base = _base_only(pre.params)
    for path, value in roles.flatten_paths(plain.params).items():
        np.testing.assert_array_equal(base[path], value)
    adapters = {p for p in roles.flatten_paths(pre.params) if lora.is_adapter(p)}
    assert adapters == {f"encoder/layer_{i}/attention/key_lora/{x}" for i in (0, 1) for x in "ab"}


@pytest.mark.parametrize("head", ["sequence", "token"])
def test_the_peft_adapter_loads_onto_the_base_model_with_the_merged_models_logits(
    tmp_path: Path, head: str
) -> None:
    """The independent reference: peft's own PeftModel on transformers' BERT, against the merged
    model exported as a plain Hugging Face directory."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    peft = pytest.importorskip("peft")

    model = write_tiny_model(tmp_path / "m")
    pre = hf_checkpoint.load_pretrained(
        model, num_labels=3, seed=1, head=head, lora=lora.LoraSettings(2, 6.0, "query|dense"),
    )  # fmt: skip
    params = _with_random_b(pre.params)
    flat = roles.flatten_paths(params)
    flat["classifier/kernel"] = flat["classifier/kernel"] + 0.5  # a trained head
    params = roles.unflatten_paths(flat)
    out = peft_export.save_peft(params, pre.config, tmp_path / "adapter", base_model=str(model))
    cfg = json.loads((out / "adapter_config.json").read_text())
    assert cfg["task_type"] == ("SEQ_CLS" if head == "sequence" else "TOKEN_CLS")
    assert cfg["modules_to_save"] == ["classifier"] and cfg["r"] == 2 and cfg["lora_alpha"] == 6.0
    merged, plain = lora.merge(params, pre.config)
    hf_checkpoint.save_pretrained(merged, plain, tmp_path / "merged")

    auto = (transformers.AutoModelForSequenceClassification if head == "sequence"
            else transformers.AutoModelForTokenClassification)  # fmt: skip
    base = auto.from_pretrained(model, num_labels=3, ignore_mismatched_sizes=True)
    theirs = peft.PeftModel.from_pretrained(base, out).eval()
    whole = auto.from_pretrained(tmp_path / "merged").eval()
    ids = torch.tensor(np.random.default_rng(0).integers(5, 20, size=(2, 6)))
    with torch.no_grad():
        got = theirs(input_ids=ids).logits.numpy()
        want = whole(input_ids=ids).logits.numpy()
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
    ours = make_apply(pre.config)(params, ids.numpy(), train=False)
    np.testing.assert_allclose(np.asarray(ours), want, rtol=1e-4, atol=1e-5)


def test_a_base_without_a_pooler_gets_ours_saved_whole(tmp_path: Path) -> None:
    config = _config()
    params = init_params(config, jax.random.key(0))
    out = peft_export.save_peft(params, config, tmp_path / "a", base_model=None,
                                base_has_pooler=False)
    cfg = json.loads((out / "adapter_config.json").read_text())
    assert cfg["modules_to_save"] == ["classifier", "pooler"]
    from safetensors.numpy import load_file

    names = set(load_file(out / "adapter_model.safetensors"))
    assert "base_model.model.bert.pooler.dense.weight" in names
    assert "base_model.model.classifier.weight" in names
    with pytest.raises(UserError, match="has none"):
        plain = dataclasses.replace(config, lora=None)
        peft_export.save_peft(params, plain, tmp_path / "b", base_model=None)
    (tmp_path / "c").mkdir()
    (tmp_path / "c" / "keep.txt").write_text("mine")
    with pytest.raises(UserError, match="is not an adapter directory"):
        peft_export.save_peft(params, config, tmp_path / "c", base_model=None)
    assert (tmp_path / "c" / "keep.txt").read_text() == "mine"
