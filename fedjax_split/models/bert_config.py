"""The BERT model's config (`BertConfig`) and its round trip through Hugging Face's config.json.

Field names follow HF's config.json, so a checkpoint's config reads unchanged; the choices that are
ours and never HF's (how the matmuls run, the head, the label names, the LoRA adapters) are left
out of the config.json that an export writes. No JAX here: a config is plain data.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from fedjax_split.errors import UserError

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
# "xla": our einsum attention (any dtype, dropout on the probabilities); "cudnn": jax's fused
# cuDNN attention (GPU, 16-bit) in evaluation.
ATTENTION_IMPLEMENTATIONS = ("xla", "cudnn")
# HF's hidden_act values that the model computes (`layers.ACTIVATIONS`).
HIDDEN_ACTS = ("gelu", "gelu_new", "gelu_pytorch_tanh", "relu", "silu", "swish", "tanh")
LORA_SUFFIX = "_lora"  # a LoRA adapter sits beside its dense layer: "query" -> "query_lora"


@dataclasses.dataclass(frozen=True)
class Compute:
    """How the model's matmuls run: ours to choose, not part of HF's config.

    `dtype` is the compute dtype of matmuls, not a storage dtype: parameters are always fp32.
    `attention` is the kernel (ATTENTION_IMPLEMENTATIONS).
    """

    dtype: str = "float32"
    attention: str = "xla"

    def __post_init__(self) -> None:
        if self.dtype not in COMPUTE_DTYPES:
            raise UserError(
                f"unsupported compute dtype {self.dtype!r}; use one of {COMPUTE_DTYPES}"
            )
        if self.attention not in ATTENTION_IMPLEMENTATIONS:
            raise UserError(
                f"unsupported attention {self.attention!r}; use one of {ATTENTION_IMPLEMENTATIONS}"
            )


@dataclasses.dataclass(frozen=True)
class LoraAdapters:
    """The LoRA adapters a model carries (made by `models.lora.configure` from the user's
    `LoraSettings`): the dense layers given by path ("encoder/layer_0/attention/query") get a
    low-rank update of rank `rank` scaled by alpha / rank, with dropout on its input. Not part of
    HF's config (an adapter's is PEFT's)."""

    rank: int
    alpha: float
    dropout: float
    targets: tuple[str, ...]

    def __post_init__(self) -> None:
        if self.targets and self.rank < 1:
            raise UserError(f"LoRA needs a rank of at least 1, got {self.rank}")


@dataclasses.dataclass(frozen=True)
class BertConfig:
    """Architecture and head of a BERT classifier. Field names follow HF's config.json."""

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
    compute: Compute = Compute()
    head: str = "sequence"  # HEADS; HF's config says it by its `architectures`
    label_names: tuple[str, ...] = ()  # HF's id2label, when the task names its labels
    lora: LoraAdapters | None = None  # models.lora; None: no adapters

    def __post_init__(self) -> None:
        if self.hidden_act not in HIDDEN_ACTS:
            raise UserError(
                f"unsupported hidden_act {self.hidden_act!r}; use one of {sorted(HIDDEN_ACTS)}"
            )
        if self.hidden_size % self.num_attention_heads:
            raise UserError(
                f"hidden_size {self.hidden_size} is not a multiple of num_attention_heads "
                f"{self.num_attention_heads}; fix the model config"
            )
        self._check_head()
        cudnn = self.compute.attention == "cudnn"
        if cudnn and (self.head_dim % 8 or self.head_dim > 128):
            raise UserError(
                f"--attention cudnn needs a head size that is a multiple of 8 and at most 128, "
                f"got {self.head_dim}; use --attention xla"
            )

    def _check_head(self) -> None:
        """UserError unless the head's fields (problem type, label count and names) agree."""
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
        if self.head not in HEADS:
            raise UserError(f"unsupported head {self.head!r}; use one of {HEADS}")
        if self.label_names and len(self.label_names) != self.num_labels:
            raise UserError(
                f"{len(self.label_names)} label names for {self.num_labels} labels; give one each"
            )

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads

    @classmethod
    def from_hf_dict(cls, d: Mapping[str, Any], **overrides: Any) -> BertConfig:
        """Builds a config from an HF config.json dict; `overrides` win (num_labels, compute, ...).

        Raises UserError for non-BERT model types or BERT variants we do not implement. HF's own
        `dtype`/`torch_dtype` entries describe storage and are ignored; pass `compute=` to choose
        the compute dtype.
        """
        _check_bert_encoder(d)
        ours = {"compute", "num_labels", "problem_type", "head", "label_names", "lora"}
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
        label_names = _checkpoint_label_names(d)
        if (  # the checkpoint's own label names, when they fit the labels asked for
            "label_names" not in kwargs
            and label_names
            and len(label_names) == kwargs.get("num_labels", len(label_names))
        ):
            kwargs["label_names"] = label_names
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
        for ours in ("compute", "head", "label_names", "lora"):
            del d[ours]  # compute: ours (HF's `dtype` means storage, which is fp32)
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


def _check_bert_encoder(d: Mapping[str, Any]) -> None:
    """UserError unless an HF config.json describes a BERT encoder that the model implements."""
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


def _checkpoint_label_names(d: Mapping[str, Any]) -> tuple[str, ...]:
    """An HF config.json's label names from its id2label, () when it has none of its own (no
    id2label, HF's generic LABEL_i, or a gap)."""
    id2label = d.get("id2label") or {}
    names = [id2label.get(str(i), id2label.get(i)) for i in range(len(id2label))]
    generic = [f"LABEL_{i}" for i in range(len(names))]
    if names in ([], generic) or None in names:
        return ()
    return tuple(names)


def check_attention(attention: str, dtype: str, backend: str) -> None:
    """UserError unless `attention` can run in compute `dtype` on `backend` ("cpu", "gpu", ...):
    cuDNN's fused attention exists on GPUs only, for 16-bit inputs."""
    if attention == "cudnn" and (backend != "gpu" or dtype != "bfloat16"):
        raise UserError(
            f"--attention cudnn needs a GPU and --dtype bfloat16 (here: {backend}, {dtype}); "
            "use --attention xla"
        )
