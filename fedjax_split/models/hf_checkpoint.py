"""Hugging Face BERT checkpoints in and out of our parameter tree.

Import: a model directory (config.json plus weights, read by `weight_files`) found by `hf_hub`
from a local path, a hub id or an offline alias. Tensor names may carry the `bert.` prefix of
`BertFor*` models or not (`BertModel`).
Missing encoder tensors are an error; the pooler and classifier (or the MLM head,
`cls.predictions.*`) are freshly initialised from the seed when absent (or when the checkpoint's
head has another label count). The task's head alone is what a run on a pretrained body expects,
said in a plain line (`errors.Note`: "a new classifier head for 2 labels, initialised from seed
0"); anything else fresh (a pooler) is a warning naming every fresh tensor. Unexpected tensors (an
MLM head read for classification, BERT's next-sentence head) are reported in a warning.

Export: `save_pretrained` writes a `BertForSequenceClassification` directory (with the token
head, `BertForTokenClassification`; with the MLM head, `BertForMaskedLM`): config.json,
model.safetensors with `bert.`-prefixed names plus `classifier.*` (or `cls.predictions.*`, the
decoder left out since transformers ties it to the word embeddings), tokenizer files;
transformers loads it in PyTorch and `load_pretrained` reads it back bit-identically.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import shutil
import warnings
import zlib
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np

from fedjax_split.atomic import replace_dir
from fedjax_split.errors import Note, UserError
from fedjax_split.models import lora as lora_adapters
from fedjax_split.models.bert import Params, make_apply
from fedjax_split.models.bert_config import BertConfig, Compute
from fedjax_split.models.hf_hub import resolve_model
from fedjax_split.models.weight_files import read_weights

TOKENIZER_FILES = (
    "vocab.txt",
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
)
# Non-weight buffers that old checkpoints carry; neither used nor reported.
_IGNORED = re.compile(r"^(bert\.)?embeddings\.position_ids$")
# The MLM decoder's weight and bias are tied to the word embeddings and to cls.predictions.bias.
_TIED = ("cls.predictions.decoder.weight", "cls.predictions.decoder.bias")


class Pretrained:
    """What `load_pretrained` returns: unpacks as `apply, params, config = load_pretrained(...)`;
    `.model_dir` is the resolved checkpoint directory (for the tokenizer and for export)."""

    __slots__ = ("apply", "params", "config", "model_dir")

    def __init__(self, apply: Callable[..., jax.Array], params: Params, config: BertConfig,
                 model_dir: Path) -> None:  # fmt: skip
        self.apply, self.params, self.config, self.model_dir = apply, params, config, model_dir

    def __iter__(self) -> Iterator[Any]:
        return iter((self.apply, self.params, self.config))

    def __repr__(self) -> str:
        return f"Pretrained(config={self.config!r}, model_dir={str(self.model_dir)!r})"


# ----------------------------------------------------------------------------- name mapping


def hf_names(config: BertConfig) -> dict[str, tuple[str, bool]]:
    """Our parameter path -> (HF tensor name without the `bert.` prefix, transpose?).

    Dense kernels are [in, out] here and [out, in] (`weight`) in torch, hence the transpose.
    """
    names: dict[str, tuple[str, bool]] = {}

    def dense(ours: str, theirs: str) -> None:
        names[f"{ours}/kernel"] = (f"{theirs}.weight", True)
        names[f"{ours}/bias"] = (f"{theirs}.bias", False)

    def norm(ours: str, theirs: str) -> None:
        names[f"{ours}/scale"] = (f"{theirs}.weight", False)
        names[f"{ours}/bias"] = (f"{theirs}.bias", False)

    for e in ("word_embeddings", "position_embeddings", "token_type_embeddings"):
        names[f"embeddings/{e}/embedding"] = (f"embeddings.{e}.weight", False)
    norm("embeddings/LayerNorm", "embeddings.LayerNorm")
    for i in range(config.num_hidden_layers):
        o, t = f"encoder/layer_{i}", f"encoder.layer.{i}"
        for qkv in ("query", "key", "value"):
            dense(f"{o}/attention/{qkv}", f"{t}.attention.self.{qkv}")
        dense(f"{o}/attention/output", f"{t}.attention.output.dense")
        norm(f"{o}/attention/LayerNorm", f"{t}.attention.output.LayerNorm")
        dense(f"{o}/intermediate", f"{t}.intermediate.dense")
        dense(f"{o}/output", f"{t}.output.dense")
        norm(f"{o}/LayerNorm", f"{t}.output.LayerNorm")
    if config.head == "mlm":  # BertForMaskedLM: no pooler; the decoder is tied (not a tensor)
        dense("mlm/transform/dense", "cls.predictions.transform.dense")
        norm("mlm/transform/LayerNorm", "cls.predictions.transform.LayerNorm")
        names["mlm/bias"] = ("cls.predictions.bias", False)
        return names
    if config.head == "sequence":  # BertForTokenClassification has no pooler
        dense("pooler/dense", "pooler.dense")
    dense("classifier", "classifier")
    return names


def tensor_names(config: BertConfig) -> dict[str, str]:
    """Our parameter paths -> their Hugging Face tensor names, the names users choose parameters
    by (`--freeze`, `fed.roles.freeze_rule`)."""
    return {path: name for path, (name, _) in hf_names(config).items()}


def _is_head(path: str) -> bool:
    return path.startswith(("classifier/", "pooler/", "mlm/"))


def _normalise_name(name: str) -> str:
    """Strips `bert.` and maps the TF-era LayerNorm names gamma/beta to weight/bias."""
    if name.startswith("bert."):
        name = name[len("bert.") :]
    return re.sub(
        r"LayerNorm\.gamma$",
        "LayerNorm.weight",
        re.sub(r"LayerNorm\.beta$", "LayerNorm.bias", name),
    )


def _shape_of(config: BertConfig, path: str) -> tuple[int, ...]:
    h, c = config.hidden_size, config
    leaf = path.rsplit("/", 1)[-1]
    fixed = {
        "embeddings/word_embeddings/embedding": (c.vocab_size, h),
        "embeddings/position_embeddings/embedding": (c.max_position_embeddings, h),
        "embeddings/token_type_embeddings/embedding": (c.type_vocab_size, h),
        "classifier/kernel": (h, c.num_labels),
        "classifier/bias": (c.num_labels,),
        "mlm/bias": (c.vocab_size,),
    }
    if path in fixed:
        return fixed[path]
    if path.endswith("intermediate/kernel"):
        return (h, c.intermediate_size)
    if path.endswith("intermediate/bias"):
        return (c.intermediate_size,)
    if re.search(r"layer_\d+/output/kernel$", path):
        return (c.intermediate_size, h)
    return (h, h) if leaf == "kernel" else (h,)


def _set(tree: dict, path: str, value: Any) -> None:
    *parents, leaf = path.split("/")
    for p in parents:
        tree = tree.setdefault(p, {})
    tree[leaf] = value


def _get(tree: dict, path: str) -> Any:
    for p in path.split("/"):
        tree = tree[p]
    return tree


def _fresh(config: BertConfig, path: str, seed: int) -> jax.Array:
    """HF-style initialisation of one tensor; the key depends only on (seed, path)."""
    shape, leaf = _shape_of(config, path), path.rsplit("/", 1)[-1]
    if leaf == "bias":
        return jnp.zeros(shape, jnp.float32)
    if leaf == "scale":
        return jnp.ones(shape, jnp.float32)
    key = jax.random.fold_in(jax.random.key(seed), zlib.crc32(path.encode()))
    return config.initializer_range * jax.random.normal(key, shape, jnp.float32)


# ----------------------------------------------------------------------------- load / save


def load_config(model_dir: Path, **overrides: Any) -> BertConfig:
    path = model_dir / "config.json"
    if not path.is_file():
        raise UserError(f"no config.json in {model_dir}; point to a Hugging Face model directory")
    try:
        d = json.loads(path.read_text())
    except ValueError:
        raise UserError(f"{path} is not valid JSON; download or export the model again") from None
    if not isinstance(d, dict):
        raise UserError(f"{path} is not a JSON object; download or export the model again")
    return BertConfig.from_hf_dict(d, **overrides)


def params_from_tensors(
    tensors: dict[str, np.ndarray], config: BertConfig, *, seed: int = 0, source: str = "checkpoint"
) -> Params:
    """Maps HF tensors onto our tree (fp32); fills an absent pooler/classifier from `seed`."""
    by_name = {}
    for raw in tensors:
        if not _IGNORED.match(raw):
            by_name.setdefault(_normalise_name(raw), raw)
    params: Params = {}
    missing: list[str] = []
    fresh: dict[str, str] = {}  # HF name -> why ("" when absent, else its other shape)
    for path, (name, transpose) in hf_names(config).items():
        raw = by_name.get(name)
        arr = None if raw is None else (tensors[raw].T if transpose else tensors[raw])
        why = _why_fresh(config, path, raw, arr, source)
        if why is None:
            _set(params, path, _as_param(raw, arr, source))
            continue
        if why or _is_head(path):
            fresh[name] = why
        else:
            missing.append(name)
        _set(params, path, _fresh(config, path, seed))
    if missing:
        shown = ", ".join(missing[:5]) + (
            f" and {len(missing) - 5} more" if len(missing) > 5 else ""
        )
        raise UserError(
            f"{source} lacks {len(missing)} encoder tensors ({shown}); "
            "use a complete BERT checkpoint"
        )
    _warn_unexpected(config, by_name, source)
    if fresh:
        _report_fresh(config, fresh, seed, source)
    return params


def _why_fresh(
    config: BertConfig, path: str, raw: str | None, arr: np.ndarray | None, source: str
) -> str | None:
    """Why the tensor at `path` is drawn from the seed: "" when the checkpoint lacks it, its
    other shape when it is a classifier of another label count; None when it is used. Any other
    tensor of another shape is a UserError."""
    if raw is None:
        return ""
    want = _shape_of(config, path)
    if arr.shape == want:
        return None
    if path.startswith("classifier/"):
        return f" (shape {arr.shape} != {want})"
    raise UserError(
        f"tensor {raw} in {source} has shape {arr.shape}, config.json implies {want}; "
        "the weights do not match config.json"
    )


def _as_param(raw: str, arr: np.ndarray, source: str) -> jax.Array:
    """A checkpoint's float tensor as an fp32 parameter (a UserError for any other dtype)."""
    if not np.issubdtype(arr.dtype, np.floating) and arr.dtype != ml_dtypes.bfloat16:
        raise UserError(f"tensor {raw} in {source} has dtype {arr.dtype}; expected floats")
    return jnp.asarray(np.ascontiguousarray(arr, dtype=np.float32))


def _warn_unexpected(config: BertConfig, by_name: dict[str, str], source: str) -> None:
    """Warns of the checkpoint's tensors that the model does not use. Token and MLM heads have no
    pooler (transformers drops it too) and the MLM decoder is tied: those are expected."""
    leftover = set(by_name) - {name for name, _ in hf_names(config).values()}
    if config.head in ("token", "mlm"):
        leftover = {n for n in leftover if not n.startswith("pooler.")}
    if config.head == "mlm":
        leftover -= set(_TIED)
    unexpected = sorted(by_name[n] for n in leftover)
    if unexpected:
        warnings.warn(
            f"{source}: ignoring {len(unexpected)} unexpected tensors: {', '.join(unexpected)}",
            stacklevel=4,
        )


def task_head(config: BertConfig) -> set[str]:
    """The Hugging Face names of the head a run puts on the pretrained body for its task: the
    classifier (sequence or token task), or the MLM head for pre-training."""
    prefix = "cls." if config.head == "mlm" else "classifier."
    return {name for name, _ in hf_names(config).values() if name.startswith(prefix)}


def _head_words(config: BertConfig) -> str:
    if config.head == "mlm":
        return "a new masked-LM head"
    if config.problem_type == "regression":
        return "a new regression head"
    what = "tags" if config.head == "token" else "labels"
    return f"a new classifier head for {config.num_labels} {what}"


def _report_fresh(config: BertConfig, fresh: dict[str, str], seed: int, source: str) -> None:
    """Says what was drawn from the seed. Only the task's head (which a pretrained body lacks, or
    holds for another label count) is expected: a plain `Note`. Anything else (a missing pooler,
    part of a head) is a warning naming every fresh tensor."""
    if set(fresh) == task_head(config):
        was = " (the checkpoint's has another label count)" if any(fresh.values()) else ""
        warnings.warn(Note(f"{_head_words(config)}, initialised from seed {seed}{was}"),
                      stacklevel=4)  # fmt: skip
        return
    named = ", ".join(name + why for name, why in fresh.items())
    warnings.warn(f"{source}: freshly initialised from seed {seed}: {named}", stacklevel=4)


def load_pretrained(
    name_or_path: str | os.PathLike[str],
    *,
    num_labels: int,
    seed: int = 0,
    problem_type: str | None = None,
    dtype: str = "float32",
    attention: str = "xla",
    head: str = "sequence",
    label_names: tuple[str, ...] = (),
    lora: Any = None,
    num_layers: int | None = None,
) -> Pretrained:
    """Loads a BERT checkpoint for sequence classification (regression: num_labels=1), with
    `head="token"` token classification (no pooler), or with `head="mlm"` masked-language
    modelling (BertForMaskedLM's head; `num_labels` is then unused). `lora`
    (`models.lora.LoraSettings`) adds fresh LoRA adapters, seeded by `seed` like a fresh head.
    `num_layers` keeps only the first encoder layers (a truncated model, the shallow baselines of
    FedBT's and FedBFPT's tables); the checkpoint's deeper layers are dropped.

    Returns `Pretrained`, which unpacks as `apply, params, config`; `.model_dir` holds the files.
    """
    model_dir = resolve_model(name_or_path)
    if problem_type is None:
        problem_type = "regression" if num_labels == 1 else "single_label_classification"
    config = load_config(
        model_dir,
        num_labels=num_labels,
        problem_type=problem_type,
        compute=Compute(dtype, attention),
        head=head,
        label_names=tuple(label_names) or None,
    )
    tensors = read_weights(model_dir)
    if num_layers is not None:  # before the adapters are placed: only on the layers kept
        config, tensors = truncate(config, tensors, num_layers)
    config = lora_adapters.configure(config, lora)
    params = params_from_tensors(tensors, config, seed=seed, source=str(model_dir))
    if config.lora is not None:
        params = lora_adapters.with_adapters(params, config, seed)
    return Pretrained(make_apply(config), params, config, model_dir)


def rebuild_params(model_dir: Path, config: BertConfig, seed: int) -> Params:
    """The parameters `load_pretrained` gave a run whose model is `config` (as its checkpoint
    records it: layers kept, head, LoRA adapters) from the weights in `model_dir` and the run's
    seed: what an export reads instead of a copy of weights that never changed."""
    _, tensors = truncate(config, read_weights(model_dir), config.num_hidden_layers)
    params = params_from_tensors(tensors, config, seed=seed, source=str(model_dir))
    if config.lora is not None:
        params = lora_adapters.with_adapters(params, config, seed)
    return params


_LAYER_NAME = re.compile(r"(?:^|\.)encoder\.layer\.(\d+)\.")


def truncate(
    config: BertConfig, tensors: dict[str, np.ndarray], num_layers: int
) -> tuple[BertConfig, dict[str, np.ndarray]]:
    """The config and tensors of the model's first `num_layers` encoder layers."""
    if not 1 <= num_layers <= config.num_hidden_layers:
        raise UserError(
            f"--model-layers {num_layers} is outside 1..{config.num_hidden_layers} for this "
            f"{config.num_hidden_layers}-layer model; keep 1..{config.num_hidden_layers} layers"
        )
    kept = {n: t for n, t in tensors.items()
            if (m := _LAYER_NAME.search(n)) is None or int(m.group(1)) < num_layers}  # fmt: skip
    return dataclasses.replace(config, num_hidden_layers=num_layers), kept


def has_pooler(model_dir: Path) -> bool:
    """Whether a checkpoint holds a pooler (sentence-embedding fine-tunes may not)."""
    return "pooler.dense.weight" in {_normalise_name(n) for n in read_weights(model_dir)}


def params_to_tensors(params: Params, config: BertConfig) -> dict[str, np.ndarray]:
    """Our tree -> HF `BertFor{Sequence,Token}Classification` / `BertForMaskedLM` tensors (fp32,
    torch layout)."""
    out = {}
    for path, (name, transpose) in hf_names(config).items():
        arr = np.asarray(jax.device_get(_get(params, path)), dtype=np.float32)
        if arr.shape != _shape_of(config, path):
            raise ValueError(
                f"{path} has shape {arr.shape}, config implies {_shape_of(config, path)}"
            )
        arr = arr.T if transpose else arr
        full = name if path.startswith(("classifier/", "mlm/")) else f"bert.{name}"
        out[full] = np.ascontiguousarray(arr)
    return out


def save_pretrained(
    params: Params,
    config: BertConfig,
    out_dir: str | os.PathLike[str],
    *,
    tokenizer_dir: str | os.PathLike[str] | None = None,
) -> Path:
    """Writes an HF `BertForSequenceClassification` (token head: `BertForTokenClassification`;
    MLM head: `BertForMaskedLM`) directory; returns its path.

    Written into a temporary sibling and renamed into place, so `out_dir` is never half-written.
    An existing `out_dir` is replaced only if empty or holding a config.json (an earlier export).
    """
    from safetensors.numpy import save_file

    tensors = params_to_tensors(params, config)

    def fill(tmp: Path) -> None:
        (tmp / "config.json").write_text(json.dumps(config.to_hf_dict(), indent=2) + "\n")
        save_file(tensors, str(tmp / "model.safetensors"), metadata={"format": "pt"})
        if tokenizer_dir is not None:
            copy_tokenizer(tokenizer_dir, tmp)

    return replace_dir(out_dir, fill, "config.json", "a model directory")


def copy_tokenizer(
    tokenizer_dir: str | os.PathLike[str], out: Path, *, standalone: bool = False
) -> None:
    """Copies a model directory's tokenizer files into `out`. `standalone`: `out` has no
    config.json (a PEFT adapter), from which transformers would learn the tokenizer's class, so a
    tokenizer_config.json naming BertTokenizer is written where the source has none."""
    tok = Path(tokenizer_dir)
    copied = [f for f in TOKENIZER_FILES if (tok / f).is_file()]
    if not copied:
        raise UserError(f"no tokenizer files in {tok}; pass the model directory as tokenizer_dir")
    for f in copied:
        shutil.copy2(tok / f, out / f)
    if standalone and "tokenizer_config.json" not in copied:
        (out / "tokenizer_config.json").write_text('{"tokenizer_class": "BertTokenizer"}\n')
