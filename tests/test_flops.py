"""Model-FLOP formula vs an independent count: every dot_general in the real model's jaxpr."""

import functools
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
    how = Batching(5, packing=True, row_width=16, part_tokens=40)  # the 36 tokens in one part
    (seg,) = make_client_batches(tok, [range(5)], [0] * 5, how, epochs=1, seed=0)
    step = jax.tree.map(lambda v: v[0, 0], seg)
    n, (r, w) = step.input_ids.shape[0], step.attention_mask.shape
    assert n == 40 and w == 16 and r == 40 // 16 + 1 + 1  # R = ceil(N / W) + 1
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


_FINE_TUNING_CONFIG = dict(vocab_size=50, hidden_size=24, num_hidden_layers=4,
                           num_attention_heads=2, intermediate_size=40, num_labels=3)  # fmt: skip


@functools.cache
def _packed_segment():
    """A one-client packed segment [1, S, ...] of five examples (one step of 40 stream tokens)."""
    from fedjax_split.data.batching import Batching, make_client_batches
    from fedjax_split.data.tokenization import Tokenized

    lengths = [7, 3, 12, 5, 9]
    tok = Tokenized([jnp.ones(n, jnp.int32) for n in lengths], None, lengths)
    how = Batching(5, packing=True, row_width=16, part_tokens=40)  # the 36 tokens in one part
    (seg,) = make_client_batches(tok, [range(5)], [0] * 5, how, epochs=1, seed=0)
    return seg


@pytest.mark.parametrize("head", ["sequence", "token"])
@pytest.mark.parametrize("packed", [False, True])
@pytest.mark.parametrize(
    ("layers", "embeddings", "pooler", "classifier"),
    [((0, 1, 2, 3), True, True, True),  # BERT-FL: everything
     ((2, 3), False, True, True), ((3,), False, True, True),  # FedBT: top layers + task head
     ((), False, False, True),  # the classifier only
     ((), False, True, True),  # the task head, nothing in the encoder
     ((0, 1), True, False, False),  # the lower layers and embeddings, head frozen
     ((1, 3), False, False, True),  # mixed: gaps, classifier without pooler
     ((), True, True, False),  # embeddings and pooler, classifier frozen
     ((), False, True, False),  # the pooler only
     ((), False, False, False)],  # nothing: the forward pass only
)  # fmt: skip
def test_train_flops_match_the_gradients_matmuls(head, packed, layers, embeddings, pooler,
                                                 classifier):  # fmt: skip
    """A fine-tuning step (sequence or token head, padded or packed) as autodiff runs it when
    only some parameters are trained: the formula equals the dot_generals of the gradient's
    jaxpr, forward and backward, for each choice of trained layers, embeddings and head."""
    from fedjax_split.fed.roles import layer_filter, merge_params, paths_where, select
    from fedjax_split.models.flops import train_flops

    config = BertConfig(**_FINE_TUNING_CONFIG, head=head)
    params = jax.eval_shape(lambda: init_params(config, jax.random.key(0)))
    prefixes = [p for p, on in (("embeddings/", embeddings), ("pooler/", pooler),
                                ("classifier/", classifier)) if on]  # fmt: skip
    chosen, constants = select(params, paths_where(params, layer_filter(layers, prefixes)))
    if packed:
        step = jax.tree.map(lambda v: v[0, 0], _packed_segment())
        (rows, width), examples = step.attention_mask.shape, step.cls_index.shape[0]
        tokens = step.input_ids.shape[0]
        inputs, layout = (step.input_ids, step.attention_mask, step.token_type_ids), step.layout()
    else:
        rows = examples = 3  # padded: B rows of T positions, the head on the B rows
        width = 16
        ids = jnp.ones((rows, width), jnp.int32)
        tokens, inputs, layout = rows * width, (ids, ids, jnp.zeros_like(ids)), {}

    def loss(trainable, constants):
        logits = make_apply(config)(merge_params(trainable, constants), *inputs, train=False,
                                    **layout)  # fmt: skip
        return jnp.mean(jax.nn.log_softmax(logits)[..., 0])

    jaxpr = jax.make_jaxpr(jax.grad(loss))(chosen, constants).jaxpr
    want = train_flops(config, tokens=tokens, rows=rows, row_width=width, examples=examples,
                       trained_layers=layers, embeddings_trained=embeddings,
                       pooler_trained=pooler, classifier_trained=classifier)  # fmt: skip
    assert _dot_flops(jaxpr) == want


@pytest.mark.parametrize("packed", [False, True])
def test_segment_flops_count_only_real_steps(packed):
    """A segment's FLOPs are one step's times its real steps: a masked step (step_mask False)
    and an empty one (no example) are padding a stacked round computes, not model work."""
    import numpy as np

    from fedjax_split.data.batch import Batch
    from fedjax_split.models.flops import segment_flops, train_flops

    config = BertConfig(**_FINE_TUNING_CONFIG)
    flags = dict(trained_layers=(3,), embeddings_trained=False, pooler_trained=True,
                 classifier_trained=True)  # fmt: skip
    if packed:  # [1, 1, ...] -> [1, 4, ...]: step 1 masked, step 2 without examples
        seg = jax.tree.map(lambda v: np.repeat(np.asarray(v), 4, axis=1), _packed_segment())
        n, (r, w), b = seg.input_ids.shape[-1], seg.attention_mask.shape[-2:], 5
        one = train_flops(config, tokens=n, rows=r, row_width=w, examples=b, **flags)
    else:
        ids = np.ones((2, 4, 3, 16), np.int32)  # [K, S, B, T]
        seg = Batch(input_ids=ids, attention_mask=ids, token_type_ids=0 * ids,
                    example_mask=np.ones((2, 4, 3), np.float32),
                    step_mask=np.ones((2, 4), bool))  # fmt: skip
        one = train_flops(config, tokens=48, rows=3, row_width=16, examples=3, **flags)
    seg = seg.replace(step_mask=np.asarray(seg.step_mask).copy(),
                      example_mask=np.asarray(seg.example_mask).copy())  # fmt: skip
    real = seg.step_mask.size
    assert segment_flops(config, seg, **flags) == real * one
    seg.step_mask[0, 1] = False
    seg.example_mask[0, 2] = 0.0
    seg.example_mask[0, 1, 0] = 0.0  # a masked step that also lost an example: still one step
    assert segment_flops(config, seg, **flags) == (real - 2) * one
    assert segment_flops(config, seg.replace(step_mask=None), **flags) == (real - 1) * one
