"""LoRA adapters (Hu et al. 2021) on BERT's dense layers, made as PEFT makes them, with their roles
(their export as a PEFT adapter directory: `models.peft`).

Why our own and not peft's: the model is ours (Flax), and an adapter must be a parameter like any
other, so that roles, aggregation, the 16-bit wire, DP, checkpoints and Flower carry it with no
special case. PEFT is the reference for every choice: A Kaiming-uniform and B zero (the first
forward is the base model's), the update (alpha / r) * dropout(x) A B, the base weights frozen,
and for a classifier (sequence or token) the head trained and saved whole with the pooler frozen.
An adapter sits beside its layer ("encoder/layer_0/attention/query_lora/{a,b}"), so the roles
place it by its encoder layer like the layer itself (`fed.roles.train_only` with `trainable`):
below the critical layer it is global (sent and aggregated), above it local; the head is local
unless c = L; every base weight is frozen.
"""

from __future__ import annotations

import dataclasses
import re
import zlib
from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax.traverse_util import flatten_dict, unflatten_dict

from fedjax_split.errors import UserError
from fedjax_split.models.bert_config import LORA_SUFFIX, BertConfig, LoraAdapters
from fedjax_split.models.layers import lora_a_init

DEFAULT_TARGETS = "query|value"  # PEFT's default for BERT: the attention's query and value
PEFT_PREFIX = "base_model.model."  # the key prefix of a PeftModel's saved tensors
TASK_TYPES = {"sequence": "SEQ_CLS", "token": "TOKEN_CLS"}


@dataclasses.dataclass(frozen=True)
class LoraSettings:
    """What the user chooses: rank r, alpha (None: 2r), a regex over PEFT's module names
    (`re.search`, e.g. "bert.encoder.layer.0.attention.self.query"), dropout on the adapters'
    input."""

    rank: int
    alpha: float | None = None
    targets: str = DEFAULT_TARGETS
    dropout: float = 0.0

    @property
    def scaled_alpha(self) -> float:
        return 2.0 * self.rank if self.alpha is None else float(self.alpha)


def candidates(config: BertConfig) -> dict[str, str]:
    """The dense layers that may carry an adapter, our path -> PEFT's module name, in model order:
    every dense layer of the encoder (the pooler stays frozen and the head is trained whole)."""
    names = {}
    for i in range(config.num_hidden_layers):
        o, t = f"encoder/layer_{i}", f"bert.encoder.layer.{i}"
        for qkv in ("query", "key", "value"):
            names[f"{o}/attention/{qkv}"] = f"{t}.attention.self.{qkv}"
        names[f"{o}/attention/output"] = f"{t}.attention.output.dense"
        names[f"{o}/intermediate"] = f"{t}.intermediate.dense"
        names[f"{o}/output"] = f"{t}.output.dense"
    return names


def check_settings(settings: LoraSettings) -> re.Pattern[str]:
    """The settings' own checks, which need no model (a config's validation runs them before
    anything is loaded): a one-line UserError for a bad rank, alpha, dropout or regex. Returns
    the compiled --lora-targets."""
    if isinstance(settings.rank, bool) or not isinstance(settings.rank, int) or settings.rank < 1:
        raise UserError(f"--lora-rank must be an integer >= 1, got {settings.rank!r}")
    alpha = settings.scaled_alpha
    if not (np.isfinite(alpha) and alpha > 0):
        raise UserError(f"--lora-alpha must be a number > 0, got {settings.alpha}")
    if not 0 <= settings.dropout < 1:
        raise UserError(f"--lora-dropout must be in [0, 1), got {settings.dropout}")
    try:
        return re.compile(settings.targets)
    except re.error as err:
        raise UserError(
            f"--lora-targets {settings.targets!r} is not a valid regex ({err}); pass a Python "
            "regex over module names such as 'query|value'"
        ) from None


def configure(config: BertConfig, settings: LoraSettings | None) -> BertConfig:
    """`config` with the adapters `settings` asks for (unchanged for None). A one-line UserError
    for bad settings (`check_settings`), a regex that chooses no layer, or the MLM head."""
    if settings is None:
        return config
    pattern = check_settings(settings)
    alpha = settings.scaled_alpha
    if config.head not in TASK_TYPES:
        raise UserError(
            f"LoRA is for classification and NER heads, not {config.head!r}; FedBFPT's "
            "pre-training trains whole layers (drop the --lora-* flags)"
        )
    chosen = tuple(p for p, name in candidates(config).items() if pattern.search(name))
    if not chosen:
        raise UserError(
            f"--lora-targets {settings.targets!r} matches no dense layer of the encoder; names "
            "look like 'bert.encoder.layer.0.attention.self.query', '...attention.output.dense', "
            "'...intermediate.dense', '...output.dense'"
        )
    adapters = LoraAdapters(settings.rank, alpha, float(settings.dropout), chosen)
    return dataclasses.replace(config, lora=adapters)


def fields(config: BertConfig) -> dict[str, Any] | None:
    """The adapters' part of a config as JSON (a checkpoint's record), None without LoRA."""
    if config.lora is None:
        return None
    return {
        "lora_rank": config.lora.rank,
        "lora_alpha": config.lora.alpha,
        "lora_dropout": config.lora.dropout,
        "lora_targets": list(config.lora.targets),
    }


def from_fields(config: BertConfig, saved: Mapping[str, Any] | None) -> BertConfig:
    """Inverse of `fields`: `config` with the adapters recorded in `saved` (None: none)."""
    if not saved:
        return config
    try:
        targets = tuple(saved["lora_targets"])
        unknown = set(targets) - set(candidates(config))
        if unknown or not all(isinstance(t, str) for t in targets):
            raise ValueError(f"unknown layers {sorted(map(str, unknown))[:3]}")
        adapters = LoraAdapters(int(saved["lora_rank"]), float(saved["lora_alpha"]),
                                float(saved["lora_dropout"]), targets)  # fmt: skip
        return dataclasses.replace(config, lora=adapters if targets else None)
    except (KeyError, TypeError, ValueError) as err:
        raise UserError(
            f"the checkpoint's LoRA record is unreadable ({err}); export a run that "
            "fedjax_split.train wrote"
        ) from None


def is_adapter(path: str) -> bool:
    """Whether a parameter path is a LoRA factor ("encoder/layer_0/attention/query_lora/a")."""
    return f"{LORA_SUFFIX}/" in path


def trainable(path: str) -> bool:
    """What trains with LoRA: the adapters and the head, trained and saved whole as PEFT's
    `modules_to_save` does for classification; every base weight (the pooler too) is frozen."""
    return is_adapter(path) or path.startswith("classifier/")


def flat_params(tree: Mapping[str, Any]) -> dict[str, Any]:
    return flatten_dict(dict(tree), sep="/")


def _tree(flat: Mapping[str, Any]) -> dict[str, Any]:
    return unflatten_dict(dict(flat), sep="/")


def _shapes(config: BertConfig, target: str) -> tuple[int, int]:
    """(fan_in, fan_out) of a target dense layer."""
    h, inner = config.hidden_size, config.intermediate_size
    if target.endswith("/intermediate"):
        return h, inner
    if re.search(r"layer_\d+/output$", target):
        return inner, h
    return h, h


def init_adapters(config: BertConfig, seed: int) -> dict[str, Any]:
    """Fresh adapters for `config.lora.targets`: A as PEFT draws it, B zero. A's key depends only
    on (seed, path), as a fresh head's does (`hf_checkpoint`), so any process derives the same."""
    flat = {}
    for target in config.lora.targets:
        fan_in, fan_out = _shapes(config, target)
        path = f"{target}{LORA_SUFFIX}"
        key = jax.random.fold_in(jax.random.key(seed), zlib.crc32(path.encode()))
        flat[f"{path}/a"] = lora_a_init(key, (fan_in, config.lora.rank), jnp.float32)
        flat[f"{path}/b"] = jnp.zeros((config.lora.rank, fan_out), jnp.float32)
    return _tree(flat)


def with_adapters(params: Mapping[str, Any], config: BertConfig, seed: int) -> dict[str, Any]:
    """`params` (a pretrained tree without adapters) with fresh ones for `config`."""
    flat, fresh = flat_params(params), flat_params(init_adapters(config, seed))
    if flat.keys() & fresh.keys():
        raise ValueError(f"the tree has adapters already: {sorted(flat.keys() & fresh.keys())[:3]}")
    return _tree({**flat, **fresh})


def _scale(config: BertConfig) -> float:
    return config.lora.alpha / config.lora.rank


def merge(params: Mapping[str, Any], config: BertConfig) -> tuple[dict[str, Any], BertConfig]:
    """(the tree with each adapter folded into its layer, W + (alpha / r) A B, in fp32, and no
    adapter left; the config without LoRA): the model as one plain BERT, for export."""
    flat = flat_params(params)
    for target in config.lora.targets if config.lora else ():
        a = np.asarray(flat.pop(f"{target}{LORA_SUFFIX}/a"), np.float32)
        b = np.asarray(flat.pop(f"{target}{LORA_SUFFIX}/b"), np.float32)
        kernel = np.asarray(flat[f"{target}/kernel"], np.float32)
        flat[f"{target}/kernel"] = jnp.asarray(kernel + np.float32(_scale(config)) * (a @ b))
    left = [p for p in flat if is_adapter(p)]
    if left:
        raise ValueError(f"adapters without a target in the config: {left[:3]}")
    return _tree(flat), dataclasses.replace(config, lora=None)
