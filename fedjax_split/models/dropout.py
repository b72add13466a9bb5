"""Dropout whose masks come from 16-bit draws, four per threefry hash (`dropout`), and the linen
module that gives it a key of its own (`_Dropout`)."""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
from jax.extend.random import threefry_2x32

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
    """`dropout` with the module's own key from the "dropout" stream (as flax's nn.Dropout).

    The other modules of models/ import it by this private name on purpose: linen names an
    unnamed instance after its class (`_Dropout_0`, ...), and that name is folded into its key, so
    another class name would change every dropout mask.
    """

    rate: float

    @nn.compact
    def __call__(self, x: jax.Array, deterministic: bool) -> jax.Array:
        if deterministic or self.rate <= 0.0:
            return x
        return dropout(x, self.rate, self.make_rng("dropout"))
