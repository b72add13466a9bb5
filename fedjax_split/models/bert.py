"""Flax BERT encoder with a classification, token-classification or masked-LM head, behind pure
functions.

transformers 5 ships no Flax models, so the encoder is ours. It reproduces Hugging Face's
`BertModel` / `BertForSequenceClassification` (post-LN, absolute positions 0..T-1, token types,
additive padding mask, tanh pooler on [CLS], dropout then dense classifier) so that HF checkpoints
load unchanged (see `hf_checkpoint`). The linen module is private: the rest of the library sees
`init_params` (a plain nested dict of fp32 arrays, one `layer_i` per encoder layer so the federated
core can cut the encoder at any layer by path) and the pure `apply` / `encode` from `make_apply` /
`make_encode`, which are jit- and vmap-able over a leading client axis of the params. Its parts:
the config (`bert_config`), the dense layers and LayerNorm (`layers`), self-attention and the
packed layout (`attention`), dropout (`dropout`).

Mixed precision (`Compute(dtype="bfloat16")`): every matmul (dense layers, attention scores and
the probability-value product) runs in the compute dtype on weights cast from the fp32 master
params; embeddings, the residual stream, LayerNorm, softmax and the returned outputs stay fp32.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

from fedjax_split.models.attention import Layout, SelfAttention, complete_layout, query_key_mask
from fedjax_split.models.bert_config import BertConfig
from fedjax_split.models.dropout import _Dropout
from fedjax_split.models.layers import ACTIVATIONS, dense, layer_norm

Params = dict[str, Any]

# ----------------------------------------------------------------------------- linen (private)


class _Embeddings(nn.Module):
    config: BertConfig

    @nn.compact
    def __call__(self, input_ids, token_type_ids, position_ids, deterministic: bool) -> jax.Array:
        c = self.config
        init = nn.initializers.normal(c.initializer_range)
        word = nn.Embed(c.vocab_size, c.hidden_size, embedding_init=init, name="word_embeddings")
        pos = nn.Embed(
            c.max_position_embeddings,
            c.hidden_size,
            embedding_init=init,
            name="position_embeddings",
        )
        tok = nn.Embed(
            c.type_vocab_size, c.hidden_size, embedding_init=init, name="token_type_embeddings"
        )
        if position_ids is None:  # padding past the table (a width rounded up) reads its last row
            position_ids = jnp.minimum(jnp.arange(input_ids.shape[-1], dtype=jnp.int32),
                                       c.max_position_embeddings - 1)[None]  # fmt: skip
        x = word(input_ids) + tok(token_type_ids) + pos(position_ids)
        x = layer_norm(c)(x)
        return _Dropout(c.hidden_dropout_prob)(x, deterministic=deterministic)


class _Layer(nn.Module):
    config: BertConfig

    @nn.compact
    def __call__(self, x, mask, deterministic: bool, layout=None) -> jax.Array:
        c = self.config
        x = SelfAttention(c, name="attention")(x, mask, deterministic, layout)
        at = (self.scope.path, deterministic)
        h = ACTIVATIONS[c.hidden_act](dense(c, c.intermediate_size, "intermediate", *at)(x))
        out = dense(c, c.hidden_size, "output", *at)(h).astype(jnp.float32)
        out = _Dropout(c.hidden_dropout_prob)(out, deterministic=deterministic)
        return layer_norm(c)(out + x)


class _Encoder(nn.Module):
    config: BertConfig

    @nn.compact
    def __call__(self, x, mask, deterministic: bool, layout=None) -> jax.Array:
        for i in range(self.config.num_hidden_layers):
            x = _Layer(self.config, name=f"layer_{i}")(x, mask, deterministic, layout)
        return x


class _Pooler(nn.Module):
    config: BertConfig

    @nn.compact
    def __call__(self, x, cls_index) -> jax.Array:
        c = self.config
        first = x[:, 0] if cls_index is None else x.reshape(-1, x.shape[-1])[cls_index]
        return jnp.tanh(dense(c, c.hidden_size, "dense")(first).astype(jnp.float32))


class _Transform(nn.Module):
    """The MLM head's transform (HF's BertPredictionHeadTransform): dense, activation, LayerNorm."""

    config: BertConfig

    @nn.compact
    def __call__(self, x) -> jax.Array:
        c = self.config
        h = dense(c, c.hidden_size, "dense")(x).astype(jnp.float32)
        return layer_norm(c)(ACTIVATIONS[c.hidden_act](h))


class _MaskedLMHead(nn.Module):
    """BertForMaskedLM's head (`cls.predictions`): the transform, then a decoder whose weight is
    the word-embedding table (tied, so it has no parameter of its own) plus an output bias.

    Why tied: that is how BERT was pre-trained and how transformers loads it; a FedBFPT client
    trains the transform and the bias while the table, shared with the input, stays frozen.
    """

    config: BertConfig

    @nn.compact
    def __call__(self, x, table) -> jax.Array:
        c = self.config
        h = _Transform(c, name="transform")(x)
        bias = self.param("bias", nn.initializers.zeros, (c.vocab_size,), jnp.float32)
        compute = jnp.dtype(c.compute.dtype)
        logits = jnp.einsum(
            "...h,vh->...v", h.astype(compute), table.astype(compute),
            preferred_element_type=jnp.float32,
        )  # fmt: skip
        return logits + bias


class _BertClassifier(nn.Module):
    config: BertConfig

    @nn.compact
    def __call__(
        self,
        input_ids,
        attention_mask,
        token_type_ids,
        deterministic: bool,
        head: bool,
        position_ids=None,
        layout: Layout | None = None,
        positions=None,
    ):
        c = self.config
        if layout is not None:  # one stream [1, N]
            input_ids, token_type_ids, position_ids = (
                a.reshape(1, -1) for a in (input_ids, token_type_ids, position_ids)
            )
        embeddings = _Embeddings(c, name="embeddings")
        x = embeddings(input_ids, token_type_ids, position_ids, deterministic)
        mask = query_key_mask(attention_mask, packed=layout is not None)
        if layout is not None:
            layout = complete_layout(layout, attention_mask)
        x = _Encoder(c, name="encoder")(x, mask, deterministic, layout)
        if c.head == "mlm":  # no pooler, no dropout in the head (as BertForMaskedLM)
            if not head:
                return x, None
            if positions is not None:  # only the predicted positions reach the decoder
                x = jnp.take_along_axis(x, positions[..., None].astype(jnp.int32), axis=1)
            table = embeddings.variables["params"]["word_embeddings"]["embedding"]
            return _MaskedLMHead(c, name="mlm")(x, table)
        p = c.hidden_dropout_prob if c.classifier_dropout is None else c.classifier_dropout
        if c.head == "token":  # every token's own logits; no pooler, as in HF
            if not head:
                return x, None
            h = _Dropout(p)(x, deterministic=deterministic)
            logits = dense(c, c.num_labels, "classifier")(h)
            if layout is not None:  # the stream [1, N, C] -> [N, C], like its labels
                logits = logits.reshape(-1, c.num_labels)
            return logits.astype(jnp.float32)
        pooled = _Pooler(c, name="pooler")(x, None if layout is None else layout.cls_index)
        if not head:
            return x, pooled
        h = _Dropout(p)(pooled, deterministic=deterministic)
        logits = dense(c, c.num_labels, "classifier")(h)
        return logits.astype(jnp.float32)


# ----------------------------------------------------------------------------- public API


def _plain(tree: Any) -> Any:
    """FrozenDict/Mapping -> plain nested dict (pytree structure other modules rely on)."""
    if isinstance(tree, Mapping):
        return {k: _plain(v) for k, v in tree.items()}
    return tree


def init_params(config: BertConfig, rng: jax.Array) -> Params:
    """Fresh fp32 parameters: N(0, initializer_range) weights, zero biases, unit LayerNorm, like HF.

    The padding token's word embedding is zeroed, as in HF's `_init_weights`. The attention
    kernel has no parameters, so the tracing call that creates them uses the einsum (anywhere).
    """
    dummy = jnp.zeros((1, 1), jnp.int32)
    einsum = dataclasses.replace(config.compute, attention="xla")
    module = _BertClassifier(dataclasses.replace(config, compute=einsum))
    variables = module.init(rng, dummy, dummy + 1, dummy, True, True)
    params = _plain(variables["params"])
    emb = params["embeddings"]["word_embeddings"]["embedding"]
    if 0 <= config.pad_token_id < config.vocab_size:
        params["embeddings"]["word_embeddings"]["embedding"] = emb.at[config.pad_token_id].set(0.0)
    return params


def _defaults(input_ids, attention_mask, token_type_ids):
    input_ids = jnp.asarray(input_ids)
    if attention_mask is None:
        attention_mask = jnp.ones_like(input_ids)
    if token_type_ids is None:
        token_type_ids = jnp.zeros_like(input_ids)
    return input_ids, jnp.asarray(attention_mask), jnp.asarray(token_type_ids)


def _layout(position_ids, row_tokens, token_slots, cls_index) -> Layout | None:
    """The packed layout when its arrays are given (all of them, with position_ids), else None."""
    given = [a is not None for a in (row_tokens, token_slots, cls_index)]
    if not any(given):
        return None
    if not all(given) or position_ids is None:
        raise ValueError("packed input needs position_ids, row_tokens, token_slots and cls_index")
    return Layout(jnp.asarray(row_tokens), jnp.asarray(token_slots), jnp.asarray(cls_index))


def _rngs(train: bool, rng: jax.Array | None) -> dict[str, jax.Array]:
    if not train:
        return {}
    if rng is None:
        raise ValueError("train=True needs an explicit dropout rng")
    return {"dropout": rng}


def make_apply(config: BertConfig) -> Callable[..., jax.Array]:
    """Returns the pure classifier `apply(params, input_ids, attention_mask, token_type_ids, *,
    train, rng=None, **packing) -> logits [B, num_labels]` (fp32); with the token head, logits
    [B, T, num_labels] (packed: [N, num_labels], one row per stream position); with the MLM head,
    vocabulary logits [B, T, vocab], or with `positions` [B, P] (token indices) only those rows,
    [B, P, vocab]: the decoder's vocabulary matmul then runs on the P predicted tokens only.

    Dropout only when `train=True`. Packed input (`batching.Batching(packing=True)`,
    see `Layout`): input_ids, token_type_ids and `position_ids` are one stream [N],
    `attention_mask` [R, W] holds each attention slot's example number (0 = empty), and
    `row_tokens`, `token_slots`, `cls_index` place the tokens; logits are still [B, num_labels].
    """
    module = _BertClassifier(config)

    def apply(
        params: Params,
        input_ids: jax.Array,
        attention_mask: jax.Array | None = None,
        token_type_ids: jax.Array | None = None,
        *,
        train: bool,
        rng: jax.Array | None = None,
        position_ids: jax.Array | None = None,
        row_tokens: jax.Array | None = None,
        token_slots: jax.Array | None = None,
        cls_index: jax.Array | None = None,
        positions: jax.Array | None = None,
    ) -> jax.Array:
        ids, mask, types = _defaults(input_ids, attention_mask, token_type_ids)
        layout = _layout(position_ids, row_tokens, token_slots, cls_index)
        if positions is not None and (config.head != "mlm" or layout is not None):
            raise ValueError("positions are for the MLM head on padded (unpacked) input")
        return module.apply(
            {"params": params}, ids, mask, types, not train, True, position_ids, layout,
            positions, rngs=_rngs(train, rng),
        )  # fmt: skip

    return apply


def make_encode(config: BertConfig) -> Callable[..., tuple[jax.Array, jax.Array]]:
    """Returns `encode(params, input_ids, attention_mask, token_type_ids, *, train=False, rng=None,
    **packing) -> (last_hidden_state [B, T, H], pooled [B, H])`, both fp32; `params` may lack
    "classifier". Packed input (as for `make_apply`) gives the stream [1, N, H] as hidden state."""
    module = _BertClassifier(config)

    def encode(
        params: Params,
        input_ids: jax.Array,
        attention_mask: jax.Array | None = None,
        token_type_ids: jax.Array | None = None,
        *,
        train: bool = False,
        rng: jax.Array | None = None,
        position_ids: jax.Array | None = None,
        row_tokens: jax.Array | None = None,
        token_slots: jax.Array | None = None,
        cls_index: jax.Array | None = None,
    ) -> tuple[jax.Array, jax.Array]:
        ids, mask, types = _defaults(input_ids, attention_mask, token_type_ids)
        layout = _layout(position_ids, row_tokens, token_slots, cls_index)
        return module.apply(
            {"params": params}, ids, mask, types, not train, False, position_ids, layout,
            rngs=_rngs(train, rng),
        )  # fmt: skip

    return encode


def count_params(params: Params) -> int:
    """Number of scalars in a parameter tree."""
    return sum(int(x.size) for x in jax.tree_util.tree_leaves(params))
