"""BERT's self-attention, its two kernels (our einsum, and cuDNN's fused one in evaluation), and
the packed layout on which it runs (`Layout`): the token stream cut into rows of slots.

Mixed precision: the projections and the probability-value product run in the compute dtype;
scores and softmax in fp32.
"""

from __future__ import annotations

from typing import NamedTuple

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from fedjax_split.models.bert_config import BertConfig
from fedjax_split.models.dropout import _Dropout
from fedjax_split.models.layers import dense, layer_norm

_FUSED_IMPLEMENTATION = "cudnn"  # what attention="cudnn" asks jax for (tests run jax's "xla")


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
    slot_real: jax.Array | None = None  # [R * W] bool, derived by `complete_layout`
    stream_real: jax.Array | None = None  # [N] bool, derived by `complete_layout`


def complete_layout(layout: Layout, attention_mask: jax.Array) -> Layout:
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


def query_key_mask(attention_mask: jax.Array, packed: bool) -> jax.Array:
    """[rows, queries or 1, keys] bool: which keys each query may attend to.

    Unpacked, `attention_mask` [B, T] marks real keys. Packed, it is [R, W] and holds each slot's
    example number (0 for an empty slot): a token attends to its own example only, and empty slots
    to empty slots, so no softmax row is empty.
    """
    if packed:
        return attention_mask[:, :, None] == attention_mask[:, None, :]
    return attention_mask.astype(bool)[:, None, :]


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


def _einsum_attention(q, k, v, mask, probs_dropout: _Dropout, deterministic: bool) -> jax.Array:
    """Our kernel: fp32 scores and softmax, dropout on the probabilities, then the product with
    v in v's (the compute) dtype; q, k, v [B, T, heads, d], mask as for `fused_attention`."""
    scores = jnp.einsum("bqhd,bkhd->bhqk", q, k, preferred_element_type=jnp.float32)
    scores = scores / jnp.sqrt(jnp.float32(q.shape[-1]))
    scores = jnp.where(mask[:, None], scores, jnp.finfo(jnp.float32).min)
    probs = jax.nn.softmax(scores, axis=-1)
    probs = probs_dropout(probs, deterministic=deterministic)
    return jnp.einsum("bhqk,bkhd->bqhd", probs.astype(v.dtype), v)


class SelfAttention(nn.Module):
    """Query/key/value projections, masked softmax, output projection, residual, LayerNorm."""

    config: BertConfig

    @nn.compact
    def __call__(self, x, mask, deterministic: bool, layout: Layout | None = None) -> jax.Array:
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
        q = split(dense(c, c.hidden_size, "query", *at)(x))
        k = split(dense(c, c.hidden_size, "key", *at)(x))
        v = split(dense(c, c.hidden_size, "value", *at)(x))
        # Built on both paths: linen names it _Dropout_0 either way, so the output dropout below
        # keeps its name, hence its key, whichever kernel runs.
        probs_dropout = _Dropout(c.attention_probs_dropout_prob)
        if c.compute.attention == "cudnn" and deterministic:  # evaluation (see fused_attention)
            ctx = fused_attention(q, k, v, mask, _FUSED_IMPLEMENTATION)
        else:
            ctx = _einsum_attention(q, k, v, mask, probs_dropout, deterministic)
        ctx = ctx.reshape(b, t, c.hidden_size)
        if layout is not None:
            ctx = _move(ctx.reshape(b * t, -1), layout.token_slots, flat_slots, layout.slot_real)
            ctx = ctx[None]
        out = dense(c, c.hidden_size, "output", *at)(ctx).astype(jnp.float32)
        out = _Dropout(c.hidden_dropout_prob)(out, deterministic=deterministic)
        return layer_norm(c)(out + x)
