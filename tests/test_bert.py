"""Flax BERT vs transformers' PyTorch BERT (weights copied by an independent mapping), tree layout,
dropout, padding, mixed precision, vmap over a client axis, config round trips."""

from __future__ import annotations

import dataclasses

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from fedjax_split.errors import UserError
from fedjax_split.models import layers
from fedjax_split.models.bert import init_params, make_apply, make_encode
from fedjax_split.models.bert_config import HIDDEN_ACTS, BertConfig, Compute, check_attention
from fedjax_split.models.dropout import _DRAW_BLOCK, DROPOUT_LEVELS, dropout

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

TINY = BertConfig(
    vocab_size=101,
    hidden_size=32,
    num_hidden_layers=2,
    num_attention_heads=4,
    intermediate_size=37,
    max_position_embeddings=24,
    type_vocab_size=2,
    num_labels=3,
)


def _batch(rng: np.random.Generator, config: BertConfig, lengths=(9, 5, 1, 7), t: int = 9):
    ids = np.zeros((len(lengths), t), np.int32)
    mask = np.zeros_like(ids)
    types = np.zeros_like(ids)
    for i, n in enumerate(lengths):
        ids[i, :n] = rng.integers(1, config.vocab_size, n)
        mask[i, :n] = 1
        types[i, n // 2 : n] = 1  # second segment
    return ids, mask, types


def _torch_model(config: BertConfig, seed: int):
    """A transformers BertForSequenceClassification with every tensor random (LayerNorm too)."""
    hf = transformers.BertConfig(**config.to_hf_dict(), attn_implementation="eager")
    torch.manual_seed(seed)
    model = transformers.BertForSequenceClassification(hf).eval()
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=gen, dtype=p.dtype)
            p.copy_(1.0 + 0.1 * noise if "LayerNorm.weight" in name else 0.2 * noise)
    return model


def _ours_from_torch(model, config: BertConfig) -> dict:
    """Independent torch -> tree mapping written out by hand for this test."""
    sd = {k: v.detach().numpy().astype(np.float32) for k, v in model.state_dict().items()}
    dense = lambda n: {
        "kernel": jnp.asarray(sd[n + ".weight"].T),
        "bias": jnp.asarray(sd[n + ".bias"]),
    }
    norm = lambda n: {"scale": jnp.asarray(sd[n + ".weight"]), "bias": jnp.asarray(sd[n + ".bias"])}
    emb = lambda n: {"embedding": jnp.asarray(sd[f"bert.embeddings.{n}.weight"])}
    params = {
        "embeddings": {
            "word_embeddings": emb("word_embeddings"),
            "position_embeddings": emb("position_embeddings"),
            "token_type_embeddings": emb("token_type_embeddings"),
            "LayerNorm": norm("bert.embeddings.LayerNorm"),
        },
        "encoder": {},
        "pooler": {"dense": dense("bert.pooler.dense")},
        "classifier": dense("classifier"),
    }
    for i in range(config.num_hidden_layers):
        t = f"bert.encoder.layer.{i}"
        params["encoder"][f"layer_{i}"] = {
            "attention": {
                "query": dense(f"{t}.attention.self.query"),
                "key": dense(f"{t}.attention.self.key"),
                "value": dense(f"{t}.attention.self.value"),
                "output": dense(f"{t}.attention.output.dense"),
                "LayerNorm": norm(f"{t}.attention.output.LayerNorm"),
            },
            "intermediate": dense(f"{t}.intermediate.dense"),
            "output": dense(f"{t}.output.dense"),
            "LayerNorm": norm(f"{t}.output.LayerNorm"),
        }
    return params


def _torch_run(model, ids, mask, types):
    with torch.no_grad():
        out = model(
            input_ids=torch.tensor(ids, dtype=torch.long),
            attention_mask=torch.tensor(mask, dtype=torch.long),
            token_type_ids=torch.tensor(types, dtype=torch.long),
            output_hidden_states=True,
        )
    return out.logits.numpy(), out.hidden_states[-1].numpy()


def _paths(tree, prefix=""):
    out = {}
    for k, v in tree.items():
        if isinstance(v, dict):
            out.update(_paths(v, f"{prefix}{k}/"))
        else:
            out[prefix + k] = v
    return out


def test_param_tree_layout_is_the_documented_plain_dict():
    params = init_params(TINY, jax.random.key(0))
    h, i = TINY.hidden_size, TINY.intermediate_size
    expect = {
        "embeddings/word_embeddings/embedding": (101, h),
        "embeddings/position_embeddings/embedding": (24, h),
        "embeddings/token_type_embeddings/embedding": (2, h),
        "embeddings/LayerNorm/scale": (h,),
        "embeddings/LayerNorm/bias": (h,),
        "pooler/dense/kernel": (h, h),
        "pooler/dense/bias": (h,),
        "classifier/kernel": (h, 3),
        "classifier/bias": (3,),
    }
    for layer in ("encoder/layer_0", "encoder/layer_1"):
        for d in ("query", "key", "value", "output"):
            expect[f"{layer}/attention/{d}/kernel"] = (h, h)
            expect[f"{layer}/attention/{d}/bias"] = (h,)
        expect |= {
            f"{layer}/attention/LayerNorm/scale": (h,),
            f"{layer}/attention/LayerNorm/bias": (h,),
            f"{layer}/intermediate/kernel": (h, i),
            f"{layer}/intermediate/bias": (i,),
            f"{layer}/output/kernel": (i, h),
            f"{layer}/output/bias": (h,),
            f"{layer}/LayerNorm/scale": (h,),
            f"{layer}/LayerNorm/bias": (h,),
        }
    flat = _paths(params)
    assert {k: v.shape for k, v in flat.items()} == expect
    assert all(v.dtype == jnp.float32 for v in flat.values())
    assert type(params) is dict and type(params["encoder"]["layer_1"]["attention"]) is dict


def test_init_follows_hf_initialisation():
    config = dataclasses.replace(TINY, vocab_size=2000, initializer_range=0.05)
    flat = _paths(init_params(config, jax.random.key(1)))
    word = np.asarray(flat["embeddings/word_embeddings/embedding"])
    np.testing.assert_array_equal(word[config.pad_token_id], 0.0)
    assert abs(word[1:].std() - 0.05) < 0.002 and abs(word[1:].mean()) < 0.002
    for k, v in flat.items():
        if k.endswith("bias"):
            np.testing.assert_array_equal(v, 0.0)
        if k.endswith("scale"):
            np.testing.assert_array_equal(v, 1.0)
    a = init_params(config, jax.random.key(1))["encoder"]["layer_0"]["attention"]["query"]["kernel"]
    b = init_params(config, jax.random.key(2))["encoder"]["layer_0"]["attention"]["query"]["kernel"]
    assert not np.array_equal(a, b)


@pytest.mark.parametrize("act", ["gelu", "gelu_new"])
def test_matches_transformers_pytorch_bert(act):
    config = dataclasses.replace(TINY, hidden_act=act)
    model = _torch_model(config, seed=3)
    params = _ours_from_torch(model, config)
    ids, mask, types = _batch(np.random.default_rng(0), config)
    ref_logits, ref_hidden = _torch_run(model, ids, mask, types)
    logits = make_apply(config)(params, ids, mask, types, train=False)
    hidden, _ = make_encode(config)(params, ids, mask, types)
    assert logits.dtype == jnp.float32 and logits.shape == (4, 3)
    np.testing.assert_allclose(logits, ref_logits, atol=2e-5, rtol=0)
    np.testing.assert_allclose(hidden, ref_hidden, atol=2e-5, rtol=0)
    assert np.abs(ref_logits).max() > 0.1  # a non-trivial comparison


def test_gelu_variants_differ():
    """Guards the test above: the exact and tanh GELU must give different outputs here."""
    model = _torch_model(TINY, seed=3)
    params = _ours_from_torch(model, TINY)
    ids, mask, types = _batch(np.random.default_rng(0), TINY)
    exact = make_apply(TINY)(params, ids, mask, types, train=False)
    approx = make_apply(dataclasses.replace(TINY, hidden_act="gelu_new"))(
        params, ids, mask, types, train=False
    )
    assert np.abs(np.asarray(exact) - np.asarray(approx)).max() > 1e-6


def test_padding_does_not_change_real_tokens():
    params = init_params(TINY, jax.random.key(4))
    ids, mask, types = _batch(np.random.default_rng(1), TINY, lengths=(5, 3), t=5)
    wide = [np.pad(x, ((0, 0), (0, 6))) for x in (ids, mask, types)]
    wide[0][:, 5:] = 7  # garbage ids under the padding mask must not matter either
    apply, encode = make_apply(TINY), make_encode(TINY)
    np.testing.assert_allclose(
        apply(params, *wide, train=False), apply(params, ids, mask, types, train=False), atol=1e-6
    )
    h_wide, _ = encode(params, *wide)
    h, _ = encode(params, ids, mask, types)
    np.testing.assert_allclose(h_wide[0, :5], h[0], atol=1e-6)
    np.testing.assert_allclose(h_wide[1, :3], h[1, :3], atol=1e-6)


def test_padding_past_the_position_table_does_not_change_real_tokens():
    """A batch's width rounded up (to 8, without packing) may pass max_position_embeddings (24
    here) while every real token stays inside it: the padding must not reach the real tokens
    (a lookup past the table would be NaN, and 0 x NaN under the mask is still NaN)."""
    params = init_params(TINY, jax.random.key(5))
    ids, mask, types = _batch(np.random.default_rng(2), TINY, lengths=(20, 9), t=20)
    wide = [np.pad(x, ((0, 0), (0, 12))) for x in (ids, mask, types)]  # width 32 > 24
    apply = make_apply(TINY)
    got = apply(params, *wide, train=False)
    assert np.isfinite(np.asarray(got)).all()
    np.testing.assert_allclose(got, apply(params, ids, mask, types, train=False), atol=1e-6)


def test_all_padding_rows_stay_finite_with_finite_grads():
    """Batching pads with all-masked rows; a NaN there would poison a client's update."""
    params = init_params(TINY, jax.random.key(12))
    ids, mask, types = _batch(np.random.default_rng(8), TINY, lengths=(4, 0), t=4)
    apply = make_apply(TINY)
    logits = apply(params, ids, mask, types, train=False)
    grads = jax.grad(lambda p: apply(p, ids, mask, types, train=False)[1].sum())(params)
    assert np.isfinite(np.asarray(logits)).all()
    assert all(np.isfinite(np.asarray(g)).all() for g in jax.tree_util.tree_leaves(grads))


def test_token_types_matter():
    params = init_params(TINY, jax.random.key(5))
    ids, mask, types = _batch(np.random.default_rng(2), TINY)
    apply = make_apply(TINY)
    a = apply(params, ids, mask, types, train=False)
    b = apply(params, ids, mask, np.zeros_like(types), train=False)
    assert np.abs(np.asarray(a) - np.asarray(b)).max() > 1e-6
    np.testing.assert_array_equal(apply(params, ids, mask, None, train=False), b)


def test_dropout_only_in_training_and_driven_by_rng():
    params = init_params(TINY, jax.random.key(6))
    ids, mask, types = _batch(np.random.default_rng(3), TINY)
    apply = make_apply(TINY)
    ev = apply(params, ids, mask, types, train=False)
    k1, k2 = jax.random.key(1), jax.random.key(2)
    t1 = apply(params, ids, mask, types, train=True, rng=k1)
    np.testing.assert_array_equal(t1, apply(params, ids, mask, types, train=True, rng=k1))
    assert not np.allclose(t1, ev) and not np.allclose(
        t1, apply(params, ids, mask, types, train=True, rng=k2)
    )
    np.testing.assert_array_equal(ev, apply(params, ids, mask, types, train=False, rng=k1))
    with pytest.raises(ValueError, match="rng"):
        apply(params, ids, mask, types, train=True)
    no_drop = dataclasses.replace(
        TINY, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0, classifier_dropout=0.0
    )
    np.testing.assert_array_equal(
        make_apply(no_drop)(params, ids, mask, types, train=True, rng=k1), ev
    )


def test_classifier_dropout_overrides_hidden_dropout():
    params = init_params(TINY, jax.random.key(7))
    ids, mask, types = _batch(np.random.default_rng(4), TINY)
    only_head = dataclasses.replace(
        TINY, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0, classifier_dropout=0.5
    )
    ev = make_apply(only_head)(params, ids, mask, types, train=False)
    tr = make_apply(only_head)(params, ids, mask, types, train=True, rng=jax.random.key(0))
    assert not np.allclose(ev, tr)


def test_vmap_over_client_axis_and_jit():
    ids, mask, types = _batch(np.random.default_rng(5), TINY)
    p0, p1 = init_params(TINY, jax.random.key(8)), init_params(TINY, jax.random.key(9))
    stacked = jax.tree_util.tree_map(lambda a, b: jnp.stack([a, b]), p0, p1)
    apply = make_apply(TINY)
    out = jax.jit(jax.vmap(lambda p: apply(p, ids, mask, types, train=False)))(stacked)
    np.testing.assert_allclose(out[0], apply(p0, ids, mask, types, train=False), atol=1e-6)
    np.testing.assert_allclose(out[1], apply(p1, ids, mask, types, train=False), atol=1e-6)
    assert not np.allclose(out[0], out[1])


def test_regression_head():
    config = dataclasses.replace(TINY, num_labels=1, problem_type="regression")
    params = init_params(config, jax.random.key(10))
    ids, mask, types = _batch(np.random.default_rng(6), config)
    assert make_apply(config)(params, ids, mask, types, train=False).shape == (4, 1)
    with pytest.raises(UserError):
        dataclasses.replace(TINY, problem_type="regression")  # num_labels=3


def _dot_operand_dtypes(jaxpr) -> list[list]:
    """Operand dtypes of every matmul in a jaxpr, nested calls included."""
    out = []
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "dot_general":
            out.append([v.aval.dtype for v in eqn.invars])
        for p in eqn.params.values():
            for sub in p if isinstance(p, (list, tuple)) else [p]:
                inner = getattr(sub, "jaxpr", sub)
                if hasattr(inner, "eqns"):
                    out.extend(_dot_operand_dtypes(inner))
    return out


def test_bfloat16_compute_keeps_fp32_params_and_is_close():
    model = _torch_model(TINY, seed=11)
    params = _ours_from_torch(model, TINY)
    ids, mask, types = _batch(np.random.default_rng(7), TINY)
    bf = dataclasses.replace(TINY, compute=Compute("bfloat16"))
    ref = make_apply(TINY)(params, ids, mask, types, train=False)
    out = make_apply(bf)(params, ids, mask, types, train=False)
    assert out.dtype == jnp.float32
    assert all(x.dtype == jnp.float32 for x in jax.tree_util.tree_leaves(params))
    scale = float(np.abs(np.asarray(ref)).max())
    err = float(np.abs(np.asarray(out) - np.asarray(ref)).max())
    assert 0 < err < 0.05 * scale  # it did run in bf16, and stayed close
    hidden, pooled = make_encode(bf)(params, ids, mask, types)
    assert hidden.dtype == jnp.float32 and pooled.dtype == jnp.float32
    jaxpr = jax.make_jaxpr(lambda p: make_apply(bf)(p, ids, mask, types, train=False))(params)
    dots = _dot_operand_dtypes(jaxpr.jaxpr)
    assert len(dots) == 8 * TINY.num_hidden_layers + 2 and all(
        d == [jnp.bfloat16] * 2 for d in dots
    ), dots
    # train mode under jit with grads also works and gives fp32 grads
    loss = lambda p: make_apply(bf)(p, ids, mask, types, train=True, rng=jax.random.key(0)).sum()
    grads = jax.jit(jax.grad(loss))(params)
    assert all(g.dtype == jnp.float32 for g in jax.tree_util.tree_leaves(grads))


def test_config_hf_dict_round_trip_and_transformers_accepts_it():
    config = dataclasses.replace(TINY, hidden_act="gelu_new", classifier_dropout=0.3)
    d = config.to_hf_dict()
    assert d["model_type"] == "bert" and d["architectures"] == ["BertForSequenceClassification"]
    assert BertConfig.from_hf_dict(d) == config
    assert BertConfig.from_hf_dict(d, compute=Compute("bfloat16")).compute.dtype == "bfloat16"
    hf = transformers.BertConfig(**d)
    assert (hf.num_labels, hf.hidden_size, hf.hidden_act) == (3, 32, "gelu_new")


def test_config_from_real_style_dicts():
    d = {"model_type": "bert", "hidden_size": 64, "num_attention_heads": 4,
         "id2label": {"0": "a", "1": "b", "2": "c", "3": "d"}, "torch_dtype": "float16",
         "dtype": "float16", "transformers_version": "4.8.2"}  # fmt: skip
    c = BertConfig.from_hf_dict(d)
    assert (c.hidden_size, c.num_labels, c.compute.dtype) == (64, 4, "float32")
    assert BertConfig.from_hf_dict(d, num_labels=1).problem_type == "regression"


@pytest.mark.parametrize(
    "bad",
    [
        {"model_type": "roberta"},
        {"model_type": "distilbert"},
        {},
        {"model_type": "bert", "position_embedding_type": "relative_key"},
        {"model_type": "bert", "hidden_act": "mish"},
        {"model_type": "bert", "hidden_size": 30, "num_attention_heads": 4},
    ],
)
def test_config_rejects_what_we_do_not_implement(bad):
    with pytest.raises(UserError) as e:
        BertConfig.from_hf_dict(bad)
    assert "\n" not in str(e.value)


def test_the_config_takes_the_activations_the_model_computes():
    assert sorted(layers.ACTIVATIONS) == sorted(HIDDEN_ACTS)


def test_config_rejects_bad_dtype():
    with pytest.raises(UserError, match="dtype"):
        Compute(dtype="float16")


def _packed(ids: np.ndarray, mask: np.ndarray, types: np.ndarray, width: int) -> tuple:
    """The batch as one packed step (batching's packing=True), client and step axes dropped."""
    from fedjax_split.data.batching import Batching, make_client_batches
    from fedjax_split.data.tokenization import Tokenized

    n = mask.sum(1)
    tok = Tokenized(
        [ids[i, :k] for i, k in enumerate(n)], [types[i, :k] for i, k in enumerate(n)], n
    )
    how = Batching(len(n), shuffle=False, packing=True, row_width=width)
    (seg,) = make_client_batches(
        tok, [np.arange(len(n))], np.zeros(len(n), np.int64), how, epochs=1, seed=0
    )
    step = jax.tree.map(lambda v: v[0, 0], seg)
    assert step.example_index.tolist() == list(range(len(n)))
    return step, step.layout()


@pytest.mark.parametrize("width", [16, 32])  # 16: the longest example (9) rounded up to 8
def test_packed_batch_matches_transformers_example_by_example(width):
    model = _torch_model(TINY, seed=4)
    params = _ours_from_torch(model, TINY)
    ids, mask, types = _batch(np.random.default_rng(1), TINY, lengths=(9, 5, 1, 7, 3, 2))
    ref_logits, ref_hidden = _torch_run(model, ids, mask, types)
    step, kw = _packed(ids, mask, types, width)
    n = step.input_ids.shape[-1]
    # rows are shared (fewer than the 6 examples); R follows N: one row more than N tokens fill
    assert step.attention_mask.shape == (-(-n // width) + 1, width) and -(-n // width) + 1 < 6
    args = (params, step.input_ids, step.attention_mask, step.token_type_ids)
    logits = make_apply(TINY)(*args, train=False, **kw)
    hidden, _ = make_encode(TINY)(*args, **kw)
    np.testing.assert_allclose(logits, ref_logits, atol=2e-5, rtol=0)
    for i, n in enumerate(mask.sum(1)):
        start = kw["cls_index"][i]
        np.testing.assert_allclose(hidden[0, start : start + n], ref_hidden[i, :n], atol=2e-5)


def test_packed_gradients_match_padded_gradients():
    params = init_params(TINY, jax.random.key(2))
    ids, mask, types = _batch(np.random.default_rng(3), TINY)
    step, kw = _packed(ids, mask, types, 16)
    apply = make_apply(TINY)

    def padded(p):
        return apply(p, ids, mask, types, train=False).sum()

    def packed(p):
        return apply(p, step.input_ids, step.attention_mask, step.token_type_ids,
                     train=False, **kw).sum()  # fmt: skip

    chex.assert_trees_all_close(jax.grad(padded)(params), jax.grad(packed)(params), rtol=1e-7,
                                atol=1e-5)  # numpy's default rtol  # fmt: skip


def test_packed_input_needs_its_whole_layout():
    params = init_params(TINY, jax.random.key(0))
    ids = jnp.ones((8,), jnp.int32)
    with pytest.raises(ValueError, match="row_tokens, token_slots and cls_index"):
        make_apply(TINY)(params, ids, jnp.ones((1, 8)), ids * 0, train=False,
                         position_ids=ids, cls_index=jnp.zeros((1,), jnp.int32))  # fmt: skip


@pytest.fixture
def fused_calls(monkeypatch: pytest.MonkeyPatch) -> list:
    """attention="cudnn" routed to jax's "xla" implementation of the same call (a CPU has no
    cuDNN), counting the calls: what the model passes to jax.nn.dot_product_attention is checked,
    only the kernel differs on a GPU."""
    from fedjax_split.models import attention

    calls = []
    real = attention.fused_attention

    def counted(q, k, v, mask, implementation):
        calls.append(implementation)
        return real(q, k, v, mask, "xla")

    monkeypatch.setattr(attention, "fused_attention", counted)
    return calls


@pytest.mark.parametrize("packed", [False, True])
def test_fused_attention_matches_transformers(fused_calls: list, packed: bool) -> None:
    fused = dataclasses.replace(TINY, compute=Compute(attention="cudnn"))
    model = _torch_model(TINY, seed=5)
    params = _ours_from_torch(model, TINY)
    ids, mask, types = _batch(np.random.default_rng(2), TINY, lengths=(9, 5, 1, 7, 3))
    ref_logits, ref_hidden = _torch_run(model, ids, mask, types)
    if packed:
        step, kw = _packed(ids, mask, types, 16)
        args = (params, step.input_ids, step.attention_mask, step.token_type_ids)
    else:
        args, kw = (params, ids, mask, types), {}
    logits = make_apply(fused)(*args, train=False, **kw)
    assert fused_calls == ["cudnn"] * TINY.num_hidden_layers  # every layer took the fused call
    np.testing.assert_allclose(logits, ref_logits, atol=2e-5, rtol=0)
    if not packed:
        hidden, _ = make_encode(fused)(*args)
        for i, n in enumerate(mask.sum(1)):
            np.testing.assert_allclose(hidden[i, :n], ref_hidden[i, :n], atol=2e-5)
    bf = dataclasses.replace(fused, compute=Compute("bfloat16", "cudnn"))
    einsum_bf = dataclasses.replace(bf, compute=Compute("bfloat16"))
    ref_bf = make_apply(einsum_bf)(*args, train=False, **kw)
    np.testing.assert_allclose(make_apply(bf)(*args, train=False, **kw), ref_bf, atol=2e-2)


@pytest.mark.parametrize("attention_dropout", [0.1, 0.0])
def test_fused_attention_only_in_evaluation(fused_calls: list, attention_dropout: float) -> None:
    """Training keeps the einsum path (its dropout masks come from our keys; cuDNN's gradient
    does not batch under vmap), so a cudnn run trains exactly what an xla run does."""
    params = init_params(TINY, jax.random.key(9))
    ids, mask, types = _batch(np.random.default_rng(5), TINY)
    key = jax.random.key(3)
    xla = dataclasses.replace(TINY, attention_probs_dropout_prob=attention_dropout)
    fused = dataclasses.replace(xla, compute=Compute(attention="cudnn"))
    train = make_apply(fused)(params, ids, mask, types, train=True, rng=key)
    assert fused_calls == []
    ref = make_apply(xla)(params, ids, mask, types, train=True, rng=key)
    np.testing.assert_array_equal(train, ref)
    grads = jax.grad(lambda p: make_apply(fused)(p, ids, mask, types, train=True, rng=key).sum())
    assert fused_calls == [] and grads(params)
    make_apply(fused)(params, ids, mask, types, train=False)
    assert len(fused_calls) == TINY.num_hidden_layers


@pytest.mark.parametrize("packed", [False, True])
def test_fused_attention_passes_cudnns_own_checks_vmapped(packed: bool, monkeypatch) -> None:
    """The real "cudnn" call, traced (not run: no GPU here) through jax's cuDNN shape and layout
    checks and its vmap rule, as the vmapped evaluation calls it. A padded [B, 1, 1, T] mask or
    one broadcast over heads only by the caller fails here, not only on a GPU."""
    from jax._src.cudnn import fused_attention_stablehlo as cudnn

    monkeypatch.setattr(cudnn, "check_cudnn_version", lambda: 90800)  # cuDNN 9.8 "found"
    monkeypatch.setattr(cudnn, "check_compute_capability", lambda *a, **k: True)
    config = dataclasses.replace(TINY, compute=Compute("bfloat16", "cudnn"))
    params = init_params(config, jax.random.key(0))  # anywhere: init traces the einsum
    assert jax.tree.structure(params) == jax.tree.structure(init_params(TINY, jax.random.key(0)))
    ids, mask, types = _batch(np.random.default_rng(6), TINY, lengths=(9, 5, 1, 7), t=16)
    if packed:
        step, kw = _packed(ids, mask, types, 16)
        batch = (step.input_ids, step.attention_mask, step.token_type_ids)
    else:
        batch, kw = (ids, mask, types), {}
    two = lambda x: jnp.stack([jnp.asarray(x)] * 2)  # noqa: E731  two clients
    stacked = jax.tree.map(two, params)
    apply = make_apply(config)
    out = jax.eval_shape(
        jax.vmap(lambda p, *xs: apply(p, *xs, train=False, **kw)),
        stacked, *map(two, batch),
    )  # fmt: skip
    assert out.shape == (2, 4, TINY.num_labels)


def test_attention_setting_is_ours_and_checked() -> None:
    cudnn = Compute(attention="cudnn")
    fused = dataclasses.replace(TINY, compute=cudnn)
    d = fused.to_hf_dict()  # a kernel choice, not part of HF's config
    assert "attention" not in d and "compute" not in d
    assert BertConfig.from_hf_dict(fused.to_hf_dict()) == TINY
    assert BertConfig.from_hf_dict(TINY.to_hf_dict(), compute=cudnn) == fused
    with pytest.raises(UserError, match="unsupported attention"):
        Compute(attention="flash")
    assert BertConfig(hidden_size=256, num_attention_heads=2, compute=cudnn).head_dim == 128
    for hidden, heads in [(32, 8), (512, 2), (36, 3)]:  # head sizes 4, 256, 12
        with pytest.raises(UserError, match="multiple of 8 and at most 128"):
            BertConfig(hidden_size=hidden, num_attention_heads=heads, compute=cudnn)
    check_attention("xla", "float32", "cpu")
    check_attention("cudnn", "bfloat16", "gpu")
    for dtype, backend in [("bfloat16", "cpu"), ("float32", "gpu"), ("bfloat16", "tpu")]:
        with pytest.raises(UserError, match="--attention cudnn needs a GPU") as e:
            check_attention("cudnn", dtype, backend)
        assert "\n" not in str(e.value)


@pytest.mark.parametrize("impl", ["threefry2x32", "rbg"])
def test_dropout_rate_scale_and_independent_draws(impl: str) -> None:
    n = 2_000_003  # odd: the last 32-bit word is half used
    x = jnp.full((n,), 2.0, jnp.float32)
    key = jax.random.key(11, impl=impl)
    out = np.asarray(dropout(x, 0.1, key))
    dropped = out == 0.0
    threshold = round(0.1 * DROPOUT_LEVELS)
    rate = threshold / DROPOUT_LEVELS
    assert abs(dropped.mean() - rate) < 5 * np.sqrt(rate * (1 - rate) / n)
    np.testing.assert_allclose(out[~dropped], 2.0 * DROPOUT_LEVELS / (DROPOUT_LEVELS - threshold))
    assert abs(out.mean() - 2.0) < 5 * 2.0 * np.sqrt(rate / (1 - rate) / n)  # E[dropout(x)] = x
    # Draws from one hash (elements e + q L of a block of 4 L, q = 0..3) drop independently:
    # those from one 32-bit word (q = 0, 1) and from its two words (q = 0, 2).
    block = 4 * _DRAW_BLOCK
    quarters = dropped[: n - n % block].reshape(-1, 4, _DRAW_BLOCK)
    for q in (1, 2, 3):
        both = (quarters[:, 0] & quarters[:, q]).mean()
        assert abs(both - rate**2) < 5 * np.sqrt(rate**2 / quarters[:, 0].size)
    np.testing.assert_array_equal(out, np.asarray(dropout(x, 0.1, key)))  # same key, same mask
    other = np.asarray(dropout(x, 0.1, jax.random.key(12, impl=impl))) == 0.0
    assert (other != dropped).mean() > 0.1


def test_dropout_mask_depends_on_flat_index_only() -> None:
    """A longer or shorter leading axis (a packed stream cut to a client's own tokens, fewer
    attention rows) leaves the masks of the elements both shapes hold unchanged."""
    key = jax.random.key(5)
    x = jnp.ones((3001, 7), jnp.float32)
    full = np.asarray(dropout(x, 0.1, key))
    for rows in (1, 146, 147, 2000):  # 146 * 7 < 1024 < 147 * 7: cuts inside and past a block
        np.testing.assert_array_equal(np.asarray(dropout(x[:rows], 0.1, key)), full[:rows])
    assert 0.05 < (full == 0).mean() < 0.15


def test_dropout_edge_rates_and_dtype() -> None:
    x = jnp.arange(1.0, 9.0, dtype=jnp.bfloat16).reshape(2, 4)
    key = jax.random.key(0)
    np.testing.assert_array_equal(dropout(x, 0.0, key), x)
    np.testing.assert_array_equal(dropout(x, 1.0, key), jnp.zeros_like(x))
    assert dropout(x, 0.5, key).dtype == jnp.bfloat16
    grad = jax.grad(lambda v: dropout(v, 0.5, key).sum())(jnp.ones((64,)))
    assert set(np.unique(np.asarray(grad)).tolist()) == {0.0, 2.0}  # mask times 1/keep


# ----------------------------------------------------------------------------- masked-LM head

MLM = dataclasses.replace(TINY, head="mlm", hidden_dropout_prob=0.0)


def test_mlm_decoder_is_tied_to_the_word_embeddings() -> None:
    """The head owns a transform and a bias, no decoder matrix: its logits are
    transform(h) @ E^T + b with E the input word embeddings, written out here by hand (so a
    change of E moves the output layer too; the gradient path is transformers' own, compared in
    tests/test_hf_checkpoint.py)."""
    params = init_params(MLM, jax.random.key(0))
    assert set(params) == {"embeddings", "encoder", "mlm"}
    assert jax.tree.map(jnp.shape, params["mlm"]) == {
        "transform": {"dense": {"kernel": (32, 32), "bias": (32,)},
                      "LayerNorm": {"scale": (32,), "bias": (32,)}},
        "bias": (101,),
    }  # fmt: skip
    params["mlm"]["bias"] = jax.random.normal(jax.random.key(1), (101,))
    ids, mask, types = _batch(np.random.default_rng(0), MLM)
    positions = np.array([[0, 4], [1, 1], [0, 0], [6, 2]])
    apply = make_apply(MLM)

    @jax.jit
    def outputs(p):
        hidden, _ = make_encode(MLM)(p, ids, mask, types)
        some = apply(p, ids, mask, types, train=False, positions=positions)
        return hidden, apply(p, ids, mask, types, train=False), some

    hidden, logits, some = outputs(params)
    m = params["mlm"]["transform"]
    h = np.asarray(hidden) @ np.asarray(m["dense"]["kernel"]) + np.asarray(m["dense"]["bias"])
    h = np.asarray(jax.nn.gelu(h, approximate=False))
    mu, var = h.mean(-1, keepdims=True), h.var(-1, keepdims=True)
    h = (h - mu) / np.sqrt(var + MLM.layer_norm_eps) * np.asarray(m["LayerNorm"]["scale"])
    h = h + np.asarray(m["LayerNorm"]["bias"])
    table = np.asarray(params["embeddings"]["word_embeddings"]["embedding"])
    want = h @ table.T + np.asarray(params["mlm"]["bias"])
    np.testing.assert_allclose(np.asarray(logits), want, atol=1e-4)
    # positions gather the same rows before the decoder
    np.testing.assert_allclose(
        np.asarray(some), np.take_along_axis(want, positions[..., None], axis=1), atol=1e-4
    )
    # tied: changing a word's embedding that no input uses changes its output logit only
    unseen = sorted(set(range(101)) - set(np.asarray(ids).ravel().tolist()))[0]
    params["embeddings"]["word_embeddings"]["embedding"] = jnp.asarray(table).at[unseen].add(1.0)
    _, moved, _ = outputs(params)
    changed = np.nonzero(np.abs(np.asarray(moved) - np.asarray(logits)).max(axis=(0, 1)) > 1e-6)
    assert changed[0].tolist() == [unseen]


def test_mlm_head_config_and_positions_rules() -> None:
    hf = MLM.to_hf_dict()
    assert hf["architectures"] == ["BertForMaskedLM"] and hf["tie_word_embeddings"] is True
    assert "id2label" not in hf and "num_labels" not in hf
    assert BertConfig.from_hf_dict(hf).head == "mlm"
    assert transformers.BertConfig(**hf).tie_word_embeddings is True
    params = init_params(TINY, jax.random.key(0))
    ids, mask, types = _batch(np.random.default_rng(0), TINY)
    with pytest.raises(ValueError, match="MLM head"):
        make_apply(TINY)(params, ids, mask, types, train=False, positions=np.zeros((4, 2)))
