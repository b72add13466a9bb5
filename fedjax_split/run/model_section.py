"""The run's model section: the checkpoint, its depth, the critical layer, frozen parameters,
LoRA adapters; each setting's own checks beside it (`ModelSettings.check`). The checkpoint
(`Model`) and --freeze's setting are `pretrain`'s too.

The critical layer against the model's depth and FedBT's schedule, which need the model and the
federation section, is `run.cross_checks.check_critical_layer`.
"""

from __future__ import annotations

import argparse
import dataclasses
from typing import TYPE_CHECKING, Any

from fedjax_split.errors import UserError
from fedjax_split.run.settings import MODEL, Section, as_given, optional_int, origin
from fedjax_split.run.settings import setting as _setting
from fedjax_split.run.value_checks import at_least_one, check_regex, first_set, require

if TYPE_CHECKING:  # models.lora imports JAX: the flags' modules import none
    from fedjax_split.models.lora import LoraSettings

HALF = "half"  # --critical-layer's default: half the model's layers, whatever the model


def critical_layer_value(text: str) -> int | str | None:
    """--critical-layer's values: 'half' (L/2), or what `optional_int` reads: an integer, or
    'L'/'all' (None: every layer)."""
    if text.strip().lower() == HALF:
        return HALF
    try:
        return optional_int(text.strip())
    except argparse.ArgumentTypeError:
        raise argparse.ArgumentTypeError(
            f"expected an integer, 'half' or 'L' for the critical layer, got {text!r}"
        ) from None


@dataclasses.dataclass(frozen=True)
class Model(Section):
    """The model a run starts from, `train`'s and `pretrain`'s: its checkpoint. Each command's
    section adds what the run does with it."""

    name: str = _setting(
        "bert-base-uncased",
        "Hugging Face model id, local HF-format directory, or the offline alias 'minilm-l6'.",
        group=MODEL,
        metavar="MODEL",
        key="model",
    )


def frozen_parameters(whatever: str, example: str) -> Any:
    """--freeze: parameters neither trained nor sent, whatever else (`whatever`) would train
    them; `example`: a regex, and what it freezes where that needs saying."""
    return _setting(
        None,
        "Regex over Hugging Face tensor names (re.search): matching parameters are frozen, neither "
        f"trained nor sent, whatever {whatever}; e.g. {example}.",
        metavar="REGEX",
        group=MODEL,
    )


@dataclasses.dataclass(frozen=True)
class ModelSettings(Model):
    """`train`'s model and what of it is shared: the checkpoint, its depth, the critical layer,
    frozen parameters, LoRA adapters."""

    model_layers: int | None = _setting(
        None,
        "Keep only the first LAYERS encoder layers of the pretrained model (a truncated model: the "
        "shallow baselines of FedBT's Table 3, as DistilBERT or TinyBERT's depth); unset: all.",
        metavar="LAYERS",
        group=MODEL,
    )
    critical_layer: int | str | None = _setting(
        HALF,
        "Layers 1..c (and embeddings) are global, the rest and the head local per client "
        "(FedSplitBERT); 'half' = L/2 for the model's L layers (the paper's 6 of 12), 'L' = all "
        "global (plain FedAvg), 0 = no sharing.",
        metavar="C",
        parse=critical_layer_value,
        group=MODEL,
    )
    freeze: str | None = frozen_parameters(
        "--critical-layer says", "'embeddings\\.' or 'embeddings\\.|encoder\\.layer\\.[0-2]\\.'"
    )
    lora_rank: int | None = _setting(
        None,
        "LoRA adapters of this rank on the layers --lora-targets names: the base weights are "
        "frozen and only the adapters and the head train; adapters below the critical layer are "
        "shared, those above and the head personal (docs/lora.md). Unset: no LoRA.",
        metavar="R",
        group=MODEL,
    )
    lora_alpha: float | None = _setting(
        None,
        "LoRA: the scale's numerator, updates scaled by alpha / r (unset: 2r).",
        metavar="A",
        group=MODEL,
    )
    lora_targets: str = _setting(
        "query|value",
        "LoRA: regex (re.search) over the encoder's dense layers by their PEFT module names, e.g. "
        "'bert.encoder.layer.0.attention.self.query'; the default is PEFT's for BERT, the "
        "attention's query and value ('query|key|value|dense' takes every dense layer).",
        metavar="REGEX",
        group=MODEL,
    )
    lora_dropout: float = _setting(
        0.0, "LoRA: dropout on the adapters' input (PEFT's default 0).", group=MODEL, metavar="P"
    )

    def check(self, config: Any) -> None:
        """--model-layers, the critical layer's word and sign (its bound, the model's depth:
        `run.cross_checks.check_critical_layer`), --freeze's regex, the LoRA flags."""
        at_least_one(config, "model_layers")
        c = self.critical_layer
        if isinstance(c, str) and c != HALF:
            raise UserError(
                f"--critical-layer must be an integer, 'half' or 'L', got "
                f"{c!r}{origin(config, 'critical_layer')}"
            )
        require(config, "critical_layer", not (isinstance(c, int) and c < 0),
                "in 0..L (L = the model's layers)")  # fmt: skip
        check_regex(config, "freeze", "; pass a Python regex over Hugging Face tensor names, "
                    r"e.g. 'embeddings\.'")  # fmt: skip
        self._check_lora(config)

    def _check_lora(self, config: Any) -> None:
        """The LoRA flags: the rank first, and the others only with it; their values by
        `models.lora.check_settings` (which the model's configuration runs too)."""
        if self.lora_rank is None:
            given = first_set(config, ("lora_alpha", "lora_targets", "lora_dropout"))
            if given is not None:
                raise UserError(f"{as_given(config, given)} needs --lora-rank R, the adapters' "
                                "rank (e.g. 8)")  # fmt: skip
            return
        from fedjax_split.models.lora import check_settings  # JAX: the flags' modules import none

        check_settings(self.lora_settings())

    def lora_settings(self) -> LoraSettings | None:
        """The run's `models.lora.LoraSettings`, None without --lora-rank."""
        if self.lora_rank is None:
            return None
        from fedjax_split.models.lora import LoraSettings  # JAX, as above

        return LoraSettings(self.lora_rank, self.lora_alpha, self.lora_targets, self.lora_dropout)
