"""Model-FLOP formula vs an independent count: every dot_general in the real model's jaxpr."""

import math

import jax
import jax.extend.core
import jax.numpy as jnp
import pytest

from fedjax_split.models.bert import BertConfig, init_params, make_apply
from fedjax_split.models.flops import forward_flops, train_step_flops


def _dot_flops(jaxpr) -> int:
    """2 * batch * free_lhs * free_rhs * contracted per dot_general, recursing into sub-jaxprs."""
    total = 0
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "dot_general":
            lhs, rhs = (v.aval.shape for v in eqn.invars)
            (lc, rc), (lb, rb) = eqn.params["dimension_numbers"]
            contracted = math.prod(lhs[d] for d in lc)
            batch = math.prod(lhs[d] for d in lb)
            free_l = math.prod(s for d, s in enumerate(lhs) if d not in lc and d not in lb)
            free_r = math.prod(s for d, s in enumerate(rhs) if d not in rc and d not in rb)
            total += 2 * batch * free_l * free_r * contracted
        for sub in jax.extend.core.jaxprs_in_params(eqn.params):
            total += _dot_flops(sub)
    return total


@pytest.mark.parametrize(("layers", "batch", "seq"), [(2, 3, 16), (3, 2, 40)])
def test_forward_flops_match_the_models_matmuls(layers, batch, seq):
    config = BertConfig(
        vocab_size=50,
        hidden_size=32,
        num_hidden_layers=layers,
        num_attention_heads=4,
        intermediate_size=48,
        num_labels=3,
    )
    params = init_params(config, jax.random.key(0))
    apply = make_apply(config)
    ids = jnp.ones((batch, seq), jnp.int32)
    jaxpr = jax.make_jaxpr(lambda p: apply(p, ids, ids, jnp.zeros_like(ids), train=False))(params)
    assert forward_flops(config, batch, seq) == _dot_flops(jaxpr.jaxpr)


def test_training_is_three_forward_passes():
    config = BertConfig(
        hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=256
    )
    assert train_step_flops(config, 4, 32) == 3 * forward_flops(config, 4, 32)
    # bert-base, one 128-token sequence, known published figure: ~22.4 GFLOP forward (matmuls)
    base = BertConfig()
    assert forward_flops(base, 1, 128) == pytest.approx(22.4e9, rel=0.02)


def test_packed_forward_flops_match_the_models_matmuls():
    """A packed batch (token stream + attention rows): the formula vs the jaxpr's dot_generals."""
    from fedjax_split.data.batching import Batching, make_client_batches
    from fedjax_split.data.tokenization import Tokenized
    from fedjax_split.models.flops import packed_forward_flops, segment_train_flops

    config = BertConfig(vocab_size=50, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                        intermediate_size=48, num_labels=3)  # fmt: skip
    params = init_params(config, jax.random.key(0))
    lengths = [7, 3, 12, 5, 9]
    tok = Tokenized([jnp.ones(n, jnp.int32) for n in lengths], None, lengths)
    how = Batching(5, packing=True, row_width=16)
    (seg,) = make_client_batches(tok, [range(5)], [0] * 5, how, epochs=1, seed=0)
    step = jax.tree.map(lambda v: v[0, 0], seg)
    n, (r, w) = step.input_ids.shape[0], step.attention_mask.shape
    assert n == 40 and w == 16  # 36 tokens rounded up to a multiple of 8
    jaxpr = jax.make_jaxpr(
        lambda p: make_apply(config)(p, step.input_ids, step.attention_mask,
                                     step.token_type_ids, train=False, **step.layout())
    )(params)  # fmt: skip
    assert packed_forward_flops(config, n, r, w, 5) == _dot_flops(jaxpr.jaxpr)
    assert segment_train_flops(config, seg) == 3 * packed_forward_flops(config, n, r, w, 5)


@pytest.mark.parametrize(
    ("trained", "embeddings"),
    [((0,), False), ((2,), False), ((3,), False), ((), False), ((1, 2), False),
     ((0, 1, 2, 3), True)],
)  # fmt: skip
def test_mlm_train_flops_match_the_gradients_matmuls(trained, embeddings):
    """The MLM step as autodiff runs it when only some parameters are trained (FedBFPT: one
    layer + the head; BERT-FL: all): the formula equals the dot_generals of the gradient's jaxpr,
    forward and backward, for every choice of trained layers."""
    from fedjax_split.fed import layerwise
    from fedjax_split.fed.roles import merge_params, select
    from fedjax_split.models.flops import mlm_train_flops

    config = BertConfig(vocab_size=97, hidden_size=24, num_hidden_layers=4, num_attention_heads=2,
                        intermediate_size=40, head="mlm")  # fmt: skip
    params = jax.eval_shape(lambda: init_params(config, jax.random.key(0)))
    apply = make_apply(config)
    b, t, p = 3, 16, 3
    ids = jnp.ones((b, t), jnp.int32)
    positions = jnp.zeros((b, p), jnp.int32)
    paths = layerwise.trained_paths(params, trained)
    if embeddings:
        paths = layerwise.trained_paths(params, None)
    chosen, constants = select(params, paths)

    def loss(trainable, constants):
        logits = apply(merge_params(trainable, constants), ids, train=False, positions=positions)
        return jnp.mean(jax.nn.log_softmax(logits)[..., 0])

    jaxpr = jax.make_jaxpr(jax.grad(loss))(chosen, constants).jaxpr
    want = mlm_train_flops(config, b, t, p, layers=4, trained_layers=trained,
                           embeddings_trained=embeddings)  # fmt: skip
    assert _dot_flops(jaxpr) == want
