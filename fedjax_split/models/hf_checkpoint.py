"""Hugging Face BERT checkpoints in and out of our parameter tree.

Import: a local directory (config.json plus model.safetensors, sharded safetensors with an index,
or pytorch_model.bin read by a restricted unpickler that never executes pickled code), a hub id
(`huggingface_hub.snapshot_download`, when the hub is reachable), or the offline alias `minilm-l6`
(`assets.fetch`). Tensor names may carry the `bert.` prefix of `BertFor*` models or not
(`BertModel`).
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

import collections
import dataclasses
import json
import os
import pickle
import re
import shutil
import warnings
import zipfile
import zlib
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np

from fedjax_split import assets
from fedjax_split.atomic import replace_dir
from fedjax_split.errors import Note, UserError
from fedjax_split.models import lora as lora_adapters
from fedjax_split.models.bert import Params, make_apply
from fedjax_split.models.bert_config import BertConfig, Compute

WEIGHT_FILES = ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin")
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
_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*(/[\w.-]+)?$")
# a model in the hub's cache: .../models--ORG--NAME/snapshots/REVISION (huggingface_hub's layout)
_HUB_SNAPSHOT = re.compile(r"(?:^|/)models--([^/]+)/snapshots/[^/]+/?$")


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


# ----------------------------------------------------------------------------- reading weights


def _read_safetensors(path: Path) -> dict[str, np.ndarray]:
    from safetensors.numpy import load_file

    try:
        return load_file(str(path))
    except Exception as e:  # the library raises several types for truncated/garbled files
        raise UserError(
            f"cannot read {path} ({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}); "
            "the file is corrupt or truncated: download or export it again"
        ) from None


_TORCH_DTYPES = {
    "DoubleStorage": np.float64, "FloatStorage": np.float32, "HalfStorage": np.float16,
    "BFloat16Storage": ml_dtypes.bfloat16, "LongStorage": np.int64, "IntStorage": np.int32,
    "ShortStorage": np.int16, "CharStorage": np.int8, "ByteStorage": np.uint8,
    "BoolStorage": np.bool_,
}  # fmt: skip


class _StorageType:
    def __init__(self, dtype: Any) -> None:
        self.dtype = np.dtype(dtype)


def _rebuild_tensor(storage, offset, size, stride, *_args) -> np.ndarray:
    item = storage.dtype.itemsize
    if not size:
        return storage[offset : offset + 1].reshape(()).copy()
    return np.lib.stride_tricks.as_strided(
        storage[offset:], shape=tuple(size), strides=tuple(s * item for s in stride)
    ).copy()


def _rebuild_parameter(data, *_args) -> np.ndarray:
    return data


class _SafeUnpickler(pickle.Unpickler):
    """Unpickles a torch state dict allowing only tensors, storages and OrderedDict: a checkpoint
    cannot run code here (unlike `torch.load(weights_only=False)`)."""

    def __init__(self, file, load_storage: Callable[[str, np.dtype, int], np.ndarray]) -> None:
        super().__init__(file)
        self._load_storage = load_storage

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) == ("collections", "OrderedDict"):
            return collections.OrderedDict
        if (module, name) == ("torch._utils", "_rebuild_tensor_v2"):
            return _rebuild_tensor
        if (module, name) == ("torch._utils", "_rebuild_parameter"):
            return _rebuild_parameter
        if module == "torch" and name in _TORCH_DTYPES:
            return _StorageType(_TORCH_DTYPES[name])
        raise pickle.UnpicklingError(f"refusing to load {module}.{name}")

    def persistent_load(self, pid: Any) -> np.ndarray:
        if not (isinstance(pid, tuple) and pid and pid[0] == "storage"):
            raise pickle.UnpicklingError(f"unsupported persistent id {pid!r}")
        _, storage_type, key, _location, numel = pid[:5]
        if not isinstance(storage_type, _StorageType):
            raise pickle.UnpicklingError(f"unsupported storage type {storage_type!r}")
        return self._load_storage(str(key), storage_type.dtype, int(numel))


def _read_torch_bin(path: Path) -> dict[str, np.ndarray]:
    """Reads a torch.save zip checkpoint (torch >= 1.6) of tensors without importing torch."""
    bad = (
        f"cannot read {path} safely; convert it to model.safetensors (e.g. with transformers' "
        "save_pretrained(safe_serialization=True))"
    )
    try:
        with zipfile.ZipFile(path) as zf:
            pkl = [n for n in zf.namelist() if n.endswith("/data.pkl") or n == "data.pkl"]
            if len(pkl) != 1:
                raise UserError(f"{bad}: no data.pkl in the archive")
            prefix = pkl[0][: -len("data.pkl")]
            order = (
                zf.read(prefix + "byteorder").decode()
                if prefix + "byteorder" in zf.namelist()
                else "little"
            )
            if order != "little":
                raise UserError(f"{bad}: big-endian checkpoints are not supported")
            cache: dict[str, np.ndarray] = {}

            def load_storage(key: str, dtype: np.dtype, numel: int) -> np.ndarray:
                if key not in cache:
                    raw = zf.read(f"{prefix}data/{key}")
                    cache[key] = np.frombuffer(raw, dtype=dtype, count=numel)
                return cache[key]

            with zf.open(pkl[0]) as f:
                obj = _SafeUnpickler(f, load_storage).load()
    except zipfile.BadZipFile:
        raise UserError(f"{bad}: not a zip checkpoint (legacy torch format or corrupt)") from None
    except (pickle.UnpicklingError, EOFError, KeyError, ValueError, TypeError) as e:
        raise UserError(f"{bad}: {e}") from None
    if not isinstance(obj, dict) or not all(isinstance(v, np.ndarray) for v in obj.values()):
        raise UserError(f"{bad}: it does not hold a plain state dict of tensors")
    return dict(obj)


def read_weights(model_dir: Path) -> dict[str, np.ndarray]:
    """All tensors of a checkpoint directory as numpy arrays, names as stored."""
    st, index, pt = (model_dir / f for f in WEIGHT_FILES)
    if st.is_file():
        return _read_safetensors(st)
    if index.is_file():
        try:
            shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        except (ValueError, KeyError, TypeError):
            raise UserError(
                f"{index} is not a valid safetensors index; download it again"
            ) from None
        out: dict[str, np.ndarray] = {}
        for s in shards:
            out.update(_read_safetensors(model_dir / s))
        return out
    if pt.is_file():
        return _read_torch_bin(pt)
    raise UserError(
        f"no weights in {model_dir} (looked for {', '.join(WEIGHT_FILES)}); point to a directory "
        "with model.safetensors or pytorch_model.bin"
    )


# ----------------------------------------------------------------------------- resolving names


def resolve_model(name_or_path: str | os.PathLike[str]) -> Path:
    """Model directory for an offline alias (`minilm-l6`), a local directory, or a hub id."""
    name = str(name_or_path)
    model_aliases = sorted(k for k, a in assets.ASSETS.items() if a.root)
    if name in model_aliases:
        return assets.fetch(name)
    path = Path(name).expanduser()
    if path.exists():
        if not path.is_dir():
            raise UserError(f"{path} is a file; pass the checkpoint directory that contains it")
        return path
    if not _HUB_ID.match(name) or name.startswith((".", "/", "~")):
        raise UserError(
            f"model {name!r} not found: not a local directory, an offline alias {model_aliases} "
            "or a hub id; check the path"
        )
    return _snapshot(name, model_aliases)


def _snapshot(repo_id: str, aliases: list[str]) -> Path:
    try:
        from huggingface_hub import snapshot_download

        d = Path(snapshot_download(repo_id, allow_patterns=["*.json", "*.txt", "*.safetensors"]))
        if not any((d / f).is_file() for f in WEIGHT_FILES[:2]):
            d = Path(
                snapshot_download(repo_id, allow_patterns=["*.json", "*.txt", "pytorch_model.bin"])
            )
    except Exception as e:  # hub errors come in many types (HTTP, offline, not found, timeouts)
        why = str(e).strip().splitlines()[0][:200] if str(e).strip() else type(e).__name__
        raise UserError(
            f"could not get {repo_id!r} from the Hugging Face hub ({why}); check the id and "
            "network,"
            f" or pass a local checkpoint directory or an offline alias {aliases}"
        ) from None
    return d


def hub_id(model: str | None, model_dir: str | os.PathLike[str] | None) -> str | None:
    """The Hugging Face hub id of the model a run started from, or None (a model of its own):
    what a PEFT adapter names as its base so that it loads elsewhere. From `model` as the run was
    given it (config.json's `model`): an offline alias of a hub model (`minilm-l6`), or a hub id
    that the hub resolved (it named no local directory: `model_dir`, where the run loaded it, is
    elsewhere). Else from `model_dir`: a snapshot in the hub's cache (`models--ORG--NAME/...`),
    or a known offline copy (a model asset's weights, by size and sha256)."""
    if model:
        if model in assets.ASSETS and assets.ASSETS[model].hub_id:
            return assets.ASSETS[model].hub_id
        local = model_dir is not None and Path(model).expanduser() == Path(model_dir)
        if _HUB_ID.match(model) and not local and model not in assets.ASSETS:
            return model
    if model_dir is None:
        return None
    if m := _HUB_SNAPSHOT.search(Path(model_dir).as_posix()):
        return m.group(1).replace("--", "/")  # the hub allows no "--" within an id's parts
    weights = Path(model_dir) / "model.safetensors"
    for asset in assets.ASSETS.values():
        pinned = asset.files.get(f"{asset.root}/model.safetensors")
        if asset.hub_id and pinned and weights.is_file() and weights.stat().st_size == pinned[1]:
            if assets.sha256_file(weights) == pinned[0]:
                return asset.hub_id
    return None


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
    used = set()
    for path, (name, transpose) in hf_names(config).items():
        raw = by_name.get(name)
        want = _shape_of(config, path)
        if raw is None:
            if _is_head(path):
                fresh[name] = ""
            else:
                missing.append(name)
            _set(params, path, _fresh(config, path, seed))
            continue
        used.add(name)
        arr = tensors[raw]
        arr = arr.T if transpose else arr
        if arr.shape != want:
            if path.startswith("classifier/"):
                fresh[name] = f" (shape {arr.shape} != {want})"
                _set(params, path, _fresh(config, path, seed))
                continue
            raise UserError(
                f"tensor {raw} in {source} has shape {arr.shape}, config.json implies {want}; "
                "the weights do not match config.json"
            )
        if not np.issubdtype(arr.dtype, np.floating) and arr.dtype != ml_dtypes.bfloat16:
            raise UserError(f"tensor {raw} in {source} has dtype {arr.dtype}; expected floats")
        _set(params, path, jnp.asarray(np.ascontiguousarray(arr, dtype=np.float32)))
    if missing:
        shown = ", ".join(missing[:5]) + (
            f" and {len(missing) - 5} more" if len(missing) > 5 else ""
        )
        raise UserError(
            f"{source} lacks {len(missing)} encoder tensors ({shown}); "
            "use a complete BERT checkpoint"
        )
    # token and MLM heads have no pooler (transformers drops it too), the MLM decoder is tied;
    # other leftovers are worth a warning
    leftover = set(by_name) - used
    if config.head in ("token", "mlm"):
        leftover = {n for n in leftover if not n.startswith("pooler.")}
    if config.head == "mlm":
        leftover -= set(_TIED)
    unexpected = sorted(by_name[n] for n in leftover)
    if unexpected:
        warnings.warn(
            f"{source}: ignoring {len(unexpected)} unexpected tensors: {', '.join(unexpected)}",
            stacklevel=3,
        )
    if fresh:
        _report_fresh(config, fresh, seed, source)
    return params


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
