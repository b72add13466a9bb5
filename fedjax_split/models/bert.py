"""Flax BERT encoder with a classification, token-classification or masked-LM head, behind pure
functions.

transformers 5 ships no Flax models, so the encoder is ours. It reproduces Hugging Face's
`BertModel` / `BertForSequenceClassification` (post-LN, absolute positions 0..T-1, token types,
additive padding mask, tanh pooler on [CLS], dropout then dense classifier) so that HF checkpoints
load unchanged (see `hf_checkpoint`). The linen module is private: the rest of the library sees
`init_params` (a plain nested dict of fp32 arrays, one `layer_i` per encoder layer so the federated
core can cut the encoder at any layer by path) and the pure `apply` / `encode` from `make_apply` /
`make_encode`, which are jit- and vmap-able over a leading client axis of the params.

Mixed precision (`BertConfig.dtype = "bfloat16"`): every matmul (dense layers, attention scores and
the probability-value product) runs in the compute dtype on weights cast from the fp32 master
params; embeddings, the residual stream, LayerNorm, softmax and the returned outputs stay fp32.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from typing import Any, NamedTuple

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
from jax.extend.random import threefry_2x32

from fedjax_split.errors import UserError

Params = dict[str, Any]

# HF model types whose checkpoints are laid out exactly like BertModel (absolute positions from 0).
BERT_MODEL_TYPES = frozenset({"bert"})
PROBLEM_TYPES = ("single_label_classification", "regression")
# "sequence": pooler on [CLS] + classifier (BertForSequenceClassification); "token": classifier on
# every token, no pooler (BertForTokenClassification); "mlm": the masked-LM head of
# BertForMaskedLM (transform dense + activation + LayerNorm, then a decoder tied to the word
# embeddings plus its own bias), no pooler.
HEADS = ("sequence", "token", "mlm")
_ARCHITECTURES = {
    "sequence": "BertForSequenceClassification",
    "token": "BertForTokenClassification",
    "mlm": "BertForMaskedLM",
}
COMPUTE_DTYPES = ("float32", "bfloat16")
LORA_FIELDS = ("lora_rank", "lora_alpha", "lora_dropout", "lora_targets")
LORA_SUFFIX = "_lora"  # a LoRA adapter sits beside its dense layer: "query" -> "query_lora"
# "xla": our einsum attention (any dtype, dropout on the probabilities); "cudnn": jax's fused
# cuDNN attention (GPU, 16-bit) in evaluation.
ATTENTION_IMPLEMENTATIONS = ("xla", "cudnn")
_FUSED_IMPLEMENTATION = "cudnn"  # what attention="cudnn" asks jax for (tests run jax's "xla")
_ACTIVATIONS: dict[str, Callable[[jax.Array], jax.Array]] = {
    "gelu": lambda x: jax.nn.gelu(x, approximate=False),  # HF "gelu" is the exact erf form
    "gelu_new": lambda x: jax.nn.gelu(x, approximate=True),
    "gelu_pytorch_tanh": lambda x: jax.nn.gelu(x, approximate=True),
    "relu": jax.nn.relu,
    "silu": jax.nn.silu,
    "swish": jax.nn.silu,
    "tanh": jnp.tanh,
}


@dataclasses.dataclass(frozen=True)
class BertConfig:
    """Architecture and head of a BERT classifier. Field names follow HF's config.json.

    `dtype` is the compute dtype of matmuls, not a storage dtype: parameters are always fp32.
    """

    vocab_size: int = 30522
    hidden_size: int = 768
    num_hidden_layers: int = 12
    num_attention_heads: int = 12
    intermediate_size: int = 3072
    hidden_act: str = "gelu"
    hidden_dropout_prob: float = 0.1
    attention_probs_dropout_prob: float = 0.1
    max_position_embeddings: int = 512
    type_vocab_size: int = 2
    layer_norm_eps: float = 1e-12
    initializer_range: float = 0.02
    pad_token_id: int = 0
    num_labels: int = 2
    problem_type: str = "single_label_classification"
    classifier_dropout: float | None = None
    dtype: str = "float32"
    attention: str = "xla"  # ATTENTION_IMPLEMENTATIONS; a kernel choice, not part of HF's config
    head: str = "sequence"  # HEADS; HF's config says it by its `architectures`
    label_names: tuple[str, ...] = ()  # HF's id2label, when the task names its labels
    # LoRA (models.lora): the dense layers given by path ("encoder/layer_0/attention/query") get
    # a low-rank update scaled by alpha / rank; not part of HF's config (an adapter's is PEFT's)
    lora_rank: int = 0
    lora_alpha: float = 0.0
    lora_dropout: float = 0.0
    lora_targets: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if self.hidden_act not in _ACTIVATIONS:
            raise UserError(
                f"unsupported hidden_act {self.hidden_act!r}; use one of {sorted(_ACTIVATIONS)}"
            )
        if self.hidden_size % self.num_attention_heads:
            raise UserError(
                f"hidden_size {self.hidden_size} is not a multiple of num_attention_heads "
                f"{self.num_attention_heads}; fix the model config"
            )
        if self.problem_type not in PROBLEM_TYPES:
            raise UserError(
                f"unsupported problem_type {self.problem_type!r}; use one of {PROBLEM_TYPES}"
            )
        if self.problem_type == "regression" and self.num_labels != 1:
            raise UserError(
                f"regression needs num_labels=1, got {self.num_labels}; set num_labels=1"
            )
        if self.num_labels < 1:
            raise UserError(f"num_labels must be >= 1, got {self.num_labels}")
        if self.dtype not in COMPUTE_DTYPES:
            raise UserError(
                f"unsupported compute dtype {self.dtype!r}; use one of {COMPUTE_DTYPES}"
            )
        if self.head not in HEADS:
            raise UserError(f"unsupported head {self.head!r}; use one of {HEADS}")
        if self.label_names and len(self.label_names) != self.num_labels:
            raise UserError(
                f"{len(self.label_names)} label names for {self.num_labels} labels; give one each"
            )
        if self.lora_targets and self.lora_rank < 1:
            raise UserError(f"LoRA needs a rank of at least 1, got {self.lora_rank}")
        if self.attention not in ATTENTION_IMPLEMENTATIONS:
            raise UserError(
                f"unsupported attention {self.attention!r}; use one of {ATTENTION_IMPLEMENTATIONS}"
            )
        if self.attention == "cudnn" and (self.head_dim % 8 or self.head_dim > 128):
            raise UserError(
                f"--attention cudnn needs a head size that is a multiple of 8 and at most 128, "
                f"got {self.head_dim}; use --attention xla"
            )

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads

    @classmethod
    def from_hf_dict(cls, d: Mapping[str, Any], **overrides: Any) -> BertConfig:
        """Builds a config from an HF config.json dict; `overrides` win (num_labels, dtype, ...).

        Raises UserError for non-BERT model types or BERT variants we do not implement. HF's own
        `dtype`/`torch_dtype` entries describe storage and are ignored; pass `dtype=` to choose the
        compute dtype.
        """
        model_type = d.get("model_type")
        if model_type not in BERT_MODEL_TYPES:
            raise UserError(
                f"config model_type {model_type!r} is not BERT; use a BERT checkpoint "
                f"(model_type 'bert', e.g. bert-base-uncased or minilm-l6)"
            )
        pos = d.get("position_embedding_type", "absolute")
        if pos != "absolute":
            raise UserError(
                f"position_embedding_type {pos!r} is not supported; use a checkpoint with "
                "absolute position embeddings"
            )
        if d.get("is_decoder") or d.get("add_cross_attention"):
            raise UserError("decoder BERT configs are not supported; use an encoder checkpoint")
        ours = {"dtype", "attention", "num_labels", "problem_type", "head", "label_names"}
        ours |= set(LORA_FIELDS)
        names = {f.name for f in dataclasses.fields(cls)} - ours
        kwargs: dict[str, Any] = {k: d[k] for k in names if k in d and d[k] is not None}
        if "classifier_dropout" in d:
            kwargs["classifier_dropout"] = d["classifier_dropout"]
        if "num_labels" in d:
            kwargs["num_labels"] = int(d["num_labels"])
        elif d.get("id2label"):
            kwargs["num_labels"] = len(d["id2label"])
        if d.get("problem_type") in PROBLEM_TYPES:
            kwargs["problem_type"] = d["problem_type"]
        for head in ("token", "mlm"):
            if _ARCHITECTURES[head] in (d.get("architectures") or ()):
                kwargs["head"] = head
        kwargs.update({k: v for k, v in overrides.items() if v is not None})
        id2label = d.get("id2label") or {}
        names = [id2label.get(str(i), id2label.get(i)) for i in range(len(id2label))]
        generic = [f"LABEL_{i}" for i in range(len(names))]
        if (  # the checkpoint's own label names, when they fit the labels asked for
            "label_names" not in kwargs
            and names not in ([], generic)
            and None not in names
            and len(names) == kwargs.get("num_labels", len(names))
        ):
            kwargs["label_names"] = tuple(names)
        if "problem_type" not in kwargs and kwargs.get("num_labels") == 1:
            kwargs["problem_type"] = "regression"
        unknown = set(kwargs) - {f.name for f in dataclasses.fields(cls)}
        if unknown:
            raise TypeError(f"unknown BertConfig fields: {sorted(unknown)}")
        return cls(**kwargs)

    def to_hf_dict(self) -> dict[str, Any]:
        """The config.json of a `BertForSequenceClassification` (with the token head,
        `BertForTokenClassification`; with the MLM head, `BertForMaskedLM`, whose decoder is tied
        to the word embeddings) with fp32 weights."""
        d = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        for ours in ("dtype", "attention", "head", "label_names", *LORA_FIELDS):
            del d[ours]  # dtype: our compute dtype (HF's `dtype` means storage, which is fp32)
        names = self.label_names or tuple(f"LABEL_{i}" for i in range(self.num_labels))
        d.update(
            model_type="bert",
            architectures=[_ARCHITECTURES[self.head]],
            position_embedding_type="absolute",
            dtype="float32",
            id2label={str(i): name for i, name in enumerate(names)},
            label2id={name: i for i, name in enumerate(names)},
        )
        if self.head == "mlm":  # predicts the vocabulary: no labels, decoder tied to embeddings
            for key in ("id2label", "label2id", "num_labels", "problem_type", "classifier_dropout"):
                d.pop(key)
            d["tie_word_embeddings"] = True
        return d


# ----------------------------------------------------------------------------- linen (private)


def _layer_norm(config: BertConfig) -> Callable[[jax.Array], jax.Array]:
    """LayerNorm named "LayerNorm", in fp32 with the two-pass variance that torch uses."""
    ln = nn.LayerNorm(
        epsilon=config.layer_norm_eps,
        dtype=jnp.float32,
        param_dtype=jnp.float32,
        use_fast_variance=False,
        name="LayerNorm",
    )
    return lambda x: ln(x.astype(jnp.float32))


def _dense(
    config: BertConfig,
    features: int,
    name: str,
    parent: tuple[str, ...] = (),
    deterministic: bool = True,
) -> Callable[[jax.Array], jax.Array]:
    """A dense layer named `name` in the module at path `parent`; when that path is one of
    `config.lora_targets`, its output gains the LoRA update of a sibling "<name>_lora"."""
    dense = nn.Dense(
        features,
        dtype=jnp.dtype(config.dtype),
        param_dtype=jnp.float32,
        kernel_init=nn.initializers.normal(config.initializer_range),
        bias_init=nn.initializers.zeros,
        name=name,
    )
    if "/".join((*parent, name)) not in config.lora_targets:
        return dense
    lora = _Lora(config, features, name=name + LORA_SUFFIX)
    return lambda x: dense(x) + lora(x, deterministic)


def lora_a_init(key: jax.Array, shape: tuple[int, ...], dtype: Any = jnp.float32) -> jax.Array:
    """PEFT's (and torch's nn.Linear) default for A: Kaiming-uniform with a = sqrt(5), that is
    U(-1/sqrt(fan_in), 1/sqrt(fan_in)); A is [fan_in, rank] here."""
    bound = 1.0 / np.sqrt(shape[0])
    return jax.random.uniform(key, shape, dtype, -bound, bound)


class _Lora(nn.Module):
    """The low-rank update (alpha / r) * dropout(x) A B of a dense layer (PEFT's LoRA Linear):
    A [in, r], B [r, out], B zero at the start so the first forward is the base model's. Runs in
    the compute dtype like the dense layer it joins; dropout only on its own input."""

    config: BertConfig
    features: int

    @nn.compact
    def __call__(self, x: jax.Array, deterministic: bool) -> jax.Array:
        c = self.config
        a = self.param("a", lora_a_init, (x.shape[-1], c.lora_rank), jnp.float32)
        b = self.param("b", nn.initializers.zeros, (c.lora_rank, self.features), jnp.float32)
        compute = jnp.dtype(c.dtype)
        h = _Dropout(c.lora_dropout)(x, deterministic=deterministic).astype(compute)
        h = jnp.dot(jnp.dot(h, a.astype(compute)), b.astype(compute))
        return h * jnp.asarray(c.lora_alpha / c.lora_rank, compute)


_DRAW_BLOCK = 256  # dropout: hashes per block of 4 * 256 consecutive elements
DROPOUT_LEVELS = 65536  # dropout draws are 16-bit: a rate is rounded to a multiple of 1/65536


def dropout(x: jax.Array, rate: float, key: jax.Array) -> jax.Array:
    """Inverted dropout whose masks come from 16-bit draws, four per threefry hash.

    Why not flax's nn.Dropout: it draws a float32 uniform per element, one threefry hash each;
    here a hash serves four elements (docs/benchmarks.md measures the masks' cost). Each hash of a
    counter pair (j, 0) gives 64 random bits, four draws for four elements of x flattened, in
    fixed blocks of 4 * _DRAW_BLOCK elements; so an element's draw depends on the key and its
    flat index only: a leading axis grown or cut (more or fewer tokens in a packed stream, or
    attention rows) leaves the other elements' masks as they were. An element is dropped when
    its draw is below round(rate * 65536), so the rate is exact to 1/65536 (0.1 -> 0.100006),
    and kept elements are scaled by the inverse of the exact keep probability, so
    E[dropout(x)] = x. Keys of another PRNG implementation than threefry fall back to
    jax.random.bits (same layout; masks then depend on x's size).
    """
    threshold = int(round(rate * DROPOUT_LEVELS))
    if threshold <= 0:
        return x
    if threshold >= DROPOUT_LEVELS:
        return jnp.zeros_like(x)
    n = x.size
    blocks = -(-n // (4 * _DRAW_BLOCK))
    hashes = blocks * _DRAW_BLOCK
    if str(jax.random.key_impl(key)) == "threefry2x32":
        counters = jnp.concatenate([jnp.arange(hashes, dtype=jnp.uint32),
                                    jnp.zeros(hashes, jnp.uint32)])  # fmt: skip
        words = threefry_2x32(jax.random.key_data(key), counters).reshape(2, blocks, _DRAW_BLOCK)
    else:
        words = jax.random.bits(key, (2, blocks, _DRAW_BLOCK), jnp.uint32)
    # block b holds elements [4 L b, 4 L (b + 1)): low halves of word 0, high halves, then word 1
    quarters = (words[0] & 0xFFFF, words[0] >> 16, words[1] & 0xFFFF, words[1] >> 16)
    draws = jnp.stack(quarters, axis=1).reshape(-1)[:n].reshape(x.shape)
    scale = DROPOUT_LEVELS / (DROPOUT_LEVELS - threshold)
    return jnp.where(draws >= threshold, x * jnp.asarray(scale, x.dtype), jnp.zeros((), x.dtype))


class _Dropout(nn.Module):
    """`dropout` with the module's own key from the "dropout" stream (as flax's nn.Dropout)."""

    rate: float

    @nn.compact
    def __call__(self, x: jax.Array, deterministic: bool) -> jax.Array:
        if deterministic or self.rate <= 0.0:
            return x
        return dropout(x, self.rate, self.make_rng("dropout"))


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
        if position_ids is None:
            position_ids = jnp.arange(input_ids.shape[-1], dtype=jnp.int32)[None]
        x = word(input_ids) + tok(token_type_ids) + pos(position_ids)
        x = _layer_norm(c)(x)
        return _Dropout(c.hidden_dropout_prob)(x, deterministic=deterministic)


def fused_attention(q, k, v, mask, implementation: str = "cudnn") -> jax.Array:
    """softmax(q k^T / sqrt(d), masked) v through `jax.nn.dot_product_attention`.

    q, k, v [B, T, heads, d]; mask bool [B, 1 or T, T] (True: the query may attend to the key).
    Why: on a GPU, cuDNN's fused kernel never writes the [B, heads, T, T] scores to memory. The
    model calls it in evaluation only: it cannot draw our dropout masks, and in jax 0.10 its
    gradient does not batch under vmap (the vmapped round). jax's "xla" implementation computes
    what our einsum path does (fp32 scores and softmax, probabilities cast to v's dtype), which
    is how the tests check this call on a CPU. cuDNN takes the mask as a bias of the full
    [B, heads, T, T] shape (a padded [B, 1, 1, T] one fails its shape check), hence the broadcast.
    """
    b, t, heads, _ = q.shape
    mask = jnp.broadcast_to(mask[:, None], (b, heads, t, k.shape[1]))
    return jax.nn.dot_product_attention(q, k, v, mask=mask, implementation=implementation)


def check_attention(attention: str, dtype: str, backend: str) -> None:
    """UserError unless `attention` can run in compute `dtype` on `backend` ("cpu", "gpu", ...):
    cuDNN's fused attention exists on GPUs only, for 16-bit inputs."""
    if attention == "cudnn" and (backend != "gpu" or dtype != "bfloat16"):
        raise UserError(
            f"--attention cudnn needs a GPU and --dtype bfloat16 (here: {backend}, {dtype}); "
            "use --attention xla"
        )


class _SelfAttention(nn.Module):
    """Query/key/value projections, masked softmax, output projection, residual, LayerNorm."""

    config: BertConfig

    @nn.compact
    def __call__(self, x, mask, deterministic: bool, layout=None) -> jax.Array:
        c = self.config
        # Packed: the projections run on the token stream, attention on its rows (see Layout).
        b, t = mask.shape[0], mask.shape[-1]
        if layout is not None:
            flat_slots = layout.row_tokens.reshape(-1)
            rows = lambda y: _move(y[0], flat_slots, layout.token_slots, layout.stream_real)
        else:
            rows = lambda y: y
        split = lambda y: rows(y).reshape(b, t, c.num_attention_heads, c.head_dim)
        at = (self.scope.path, deterministic)
        q = split(_dense(c, c.hidden_size, "query", *at)(x))
        k = split(_dense(c, c.hidden_size, "key", *at)(x))
        v = split(_dense(c, c.hidden_size, "value", *at)(x))
        # Built on both paths: linen names it _Dropout_0 either way, so the output dropout below
        # keeps its name, hence its key, whichever kernel runs.
        probs_dropout = _Dropout(c.attention_probs_dropout_prob)
        if c.attention == "cudnn" and deterministic:  # evaluation (see fused_attention)
            ctx = fused_attention(q, k, v, mask, _FUSED_IMPLEMENTATION)
        else:
            scores = jnp.einsum("bqhd,bkhd->bhqk", q, k, preferred_element_type=jnp.float32)
            scores = scores / jnp.sqrt(jnp.float32(c.head_dim))
            scores = jnp.where(mask[:, None], scores, jnp.finfo(jnp.float32).min)
            probs = jax.nn.softmax(scores, axis=-1)
            probs = probs_dropout(probs, deterministic=deterministic)
            ctx = jnp.einsum("bhqk,bkhd->bqhd", probs.astype(v.dtype), v)
        ctx = ctx.reshape(b, t, c.hidden_size)
        if layout is not None:
            ctx = _move(ctx.reshape(b * t, -1), layout.token_slots, flat_slots, layout.slot_real)
            ctx = ctx[None]
        out = _dense(c, c.hidden_size, "output", *at)(ctx).astype(jnp.float32)
        out = _Dropout(c.hidden_dropout_prob)(out, deterministic=deterministic)
        return _layer_norm(c)(out + x)


class _Layer(nn.Module):
    config: BertConfig

    @nn.compact
    def __call__(self, x, mask, deterministic: bool, layout=None) -> jax.Array:
        c = self.config
        x = _SelfAttention(c, name="attention")(x, mask, deterministic, layout)
        at = (self.scope.path, deterministic)
        h = _ACTIVATIONS[c.hidden_act](_dense(c, c.intermediate_size, "intermediate", *at)(x))
        out = _dense(c, c.hidden_size, "output", *at)(h).astype(jnp.float32)
        out = _Dropout(c.hidden_dropout_prob)(out, deterministic=deterministic)
        return _layer_norm(c)(out + x)


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
        return jnp.tanh(_dense(c, c.hidden_size, "dense")(first).astype(jnp.float32))


class _Transform(nn.Module):
    """The MLM head's transform (HF's BertPredictionHeadTransform): dense, activation, LayerNorm."""

    config: BertConfig

    @nn.compact
    def __call__(self, x) -> jax.Array:
        c = self.config
        h = _dense(c, c.hidden_size, "dense")(x).astype(jnp.float32)
        return _layer_norm(c)(_ACTIVATIONS[c.hidden_act](h))


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
        compute = jnp.dtype(c.dtype)
        logits = jnp.einsum(
            "...h,vh->...v", h.astype(compute), table.astype(compute),
            preferred_element_type=jnp.float32,
        )  # fmt: skip
        return logits + bias


class Layout(NamedTuple):
    """Where a packed batch's tokens sit (built by `batching.client_batches`, packing).

    The token stream [N] (input ids, types, positions) holds the batch's examples end to end, so
    embeddings, projections, feed-forward and LayerNorm compute no padding. Attention runs on R rows
    of W slots: `row_tokens` [R, W] is the stream position in each slot, `token_slots` [N] the
    slot (flat index into R * W) of each stream position, `cls_index` [B] each example's first
    stream position.
    """

    row_tokens: jax.Array
    token_slots: jax.Array
    cls_index: jax.Array
    slot_real: jax.Array | None = None  # [R * W] bool, derived by `_complete`
    stream_real: jax.Array | None = None  # [N] bool, derived by `_complete`


def _complete(layout: Layout, attention_mask: jax.Array) -> Layout:
    """Adds which slots hold a token and which stream positions are real (read by a slot)."""
    slot_real = attention_mask.reshape(-1) > 0
    flat = layout.row_tokens.reshape(-1)
    n = layout.token_slots.shape[0]
    own = flat[layout.token_slots] == jnp.arange(n, dtype=flat.dtype)
    return layout._replace(slot_real=slot_real, stream_real=own & slot_real[layout.token_slots])


@jax.custom_vjp
def _move(x: jax.Array, index: jax.Array, inverse: jax.Array, valid: jax.Array) -> jax.Array:
    """x[index] for a layout change that is one-to-one on the real rows: every valid row m of x
    is read by exactly one output row, inverse[m]; invalid rows of x are read by no output row
    whose gradient is non-zero. Its gradient is then the gather g[inverse] (masked), not the
    scatter-add that autodiff of a gather produces, which XLA:CPU runs slowly."""
    return x[index]


def _move_fwd(x, index, inverse, valid):
    return x[index], (index, inverse, valid)


def _move_bwd(res, g):
    index, inverse, valid = res
    gx = jnp.where(valid[:, None], g[inverse], jnp.zeros((), g.dtype))
    zero = lambda a: np.zeros(a.shape, jax.dtypes.float0)  # noqa: E731
    return gx, zero(index), zero(inverse), zero(valid)


_move.defvjp(_move_fwd, _move_bwd)


def _attention_mask(attention_mask: jax.Array, packed: bool) -> jax.Array:
    """[rows, queries or 1, keys] bool: which keys each query may attend to.

    Unpacked, `attention_mask` [B, T] marks real keys. Packed, it is [R, W] and holds each slot's
    example number (0 for an empty slot): a token attends to its own example only, and empty slots
    to empty slots, so no softmax row is empty.
    """
    if packed:
        return attention_mask[:, :, None] == attention_mask[:, None, :]
    return attention_mask.astype(bool)[:, None, :]


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
        mask = _attention_mask(attention_mask, packed=layout is not None)
        if layout is not None:
            layout = _complete(layout, attention_mask)
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
            logits = _dense(c, c.num_labels, "classifier")(h)
            if layout is not None:  # the stream [1, N, C] -> [N, C], like its labels
                logits = logits.reshape(-1, c.num_labels)
            return logits.astype(jnp.float32)
        pooled = _Pooler(c, name="pooler")(x, None if layout is None else layout.cls_index)
        if not head:
            return x, pooled
        h = _Dropout(p)(pooled, deterministic=deterministic)
        logits = _dense(c, c.num_labels, "classifier")(h)
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
    module = _BertClassifier(dataclasses.replace(config, attention="xla"))
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
