"""The building blocks of the BERT modules: HF's activations, LayerNorm as torch computes it, and
the dense layer, with its LoRA update when the config puts an adapter on it.

Mixed precision: a dense layer (and its adapter) runs in the config's compute dtype on weights
cast from the fp32 master params; LayerNorm runs in fp32.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from fedjax_split.models.bert_config import LORA_SUFFIX, BertConfig
from fedjax_split.models.dropout import _Dropout

# HF's hidden_act values (`bert_config.HIDDEN_ACTS`, which the config checks against).
ACTIVATIONS: dict[str, Callable[[jax.Array], jax.Array]] = {
    "gelu": lambda x: jax.nn.gelu(x, approximate=False),  # HF "gelu" is the exact erf form
    "gelu_new": lambda x: jax.nn.gelu(x, approximate=True),
    "gelu_pytorch_tanh": lambda x: jax.nn.gelu(x, approximate=True),
    "relu": jax.nn.relu,
    "silu": jax.nn.silu,
    "swish": jax.nn.silu,
    "tanh": jnp.tanh,
}


def layer_norm(config: BertConfig) -> Callable[[jax.Array], jax.Array]:
    """LayerNorm named "LayerNorm", in fp32 with the two-pass variance that torch uses."""
    ln = nn.LayerNorm(
        epsilon=config.layer_norm_eps,
        dtype=jnp.float32,
        param_dtype=jnp.float32,
        use_fast_variance=False,
        name="LayerNorm",
    )
    return lambda x: ln(x.astype(jnp.float32))


def dense(
    config: BertConfig,
    features: int,
    name: str,
    parent: tuple[str, ...] = (),
    deterministic: bool = True,
) -> Callable[[jax.Array], jax.Array]:
    """A dense layer named `name` in the module at path `parent`; when that path is one of
    `config.lora.targets`, its output gains the LoRA update of a sibling "<name>_lora"."""
    layer = nn.Dense(
        features,
        dtype=jnp.dtype(config.compute.dtype),
        param_dtype=jnp.float32,
        kernel_init=nn.initializers.normal(config.initializer_range),
        bias_init=nn.initializers.zeros,
        name=name,
    )
    if config.lora is None or "/".join((*parent, name)) not in config.lora.targets:
        return layer
    lora = _Lora(config, features, name=name + LORA_SUFFIX)
    return lambda x: layer(x) + lora(x, deterministic)


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
        lora = self.config.lora
        a = self.param("a", lora_a_init, (x.shape[-1], lora.rank), jnp.float32)
        b = self.param("b", nn.initializers.zeros, (lora.rank, self.features), jnp.float32)
        compute = jnp.dtype(self.config.compute.dtype)
        h = _Dropout(lora.dropout)(x, deterministic=deterministic).astype(compute)
        h = jnp.dot(jnp.dot(h, a.astype(compute)), b.astype(compute))
        return h * jnp.asarray(lora.alpha / lora.rank, compute)
