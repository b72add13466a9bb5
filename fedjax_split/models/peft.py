"""A client's LoRA adapters exported as a PEFT adapter directory (adapter_config.json,
adapter_model.safetensors) that `peft.PeftModel.from_pretrained(base, dir)` loads onto the base
model: PEFT's names and layouts for the adapters of `models.lora`, the head saved whole."""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import jax
import numpy as np
from safetensors.numpy import save_file

from fedjax_split.atomic import replace_dir
from fedjax_split.errors import UserError
from fedjax_split.models import hf_checkpoint, lora
from fedjax_split.models.bert_config import BertConfig


def peft_config(
    config: BertConfig, base_model: str | None, modules_to_save: list[str]
) -> dict[str, Any]:
    """The adapter_config.json of a PEFT LoRA adapter for these adapters (the fields PEFT needs;
    it fills the rest with its defaults)."""
    names = lora.candidates(config)
    return {
        "peft_type": "LORA",
        "task_type": lora.TASK_TYPES[config.head],
        "base_model_name_or_path": base_model,
        "r": config.lora.rank,
        "lora_alpha": config.lora.alpha,
        "lora_dropout": config.lora.dropout,
        "target_modules": [names[t] for t in config.lora.targets],
        "modules_to_save": modules_to_save,
        "bias": "none",
        "fan_in_fan_out": False,
        "init_lora_weights": True,
        "inference_mode": True,
        "use_rslora": False,
    }


def peft_tensors(
    params: Mapping[str, Any], config: BertConfig, modules_to_save: list[str]
) -> dict[str, np.ndarray]:
    """The adapter_model.safetensors of a PEFT adapter: each adapter as lora_A [r, in] and lora_B
    [out, r] (torch's layout), and the saved modules' tensors whole (fp32)."""
    flat = lora.flat_params(params)
    names = lora.candidates(config)
    out = {}
    for target in config.lora.targets:
        for ours, theirs in (("a", "lora_A"), ("b", "lora_B")):
            arr = np.asarray(jax.device_get(flat[f"{target}{lora.LORA_SUFFIX}/{ours}"]), np.float32)
            out[f"{lora.PEFT_PREFIX}{names[target]}.{theirs}.weight"] = np.ascontiguousarray(arr.T)
    whole = hf_checkpoint.params_to_tensors(params, config)  # the saved modules hold no adapter
    for module in modules_to_save:
        prefix = "classifier." if module == "classifier" else f"bert.{module}."
        for name, arr in whole.items():
            if name.startswith(prefix):
                out[lora.PEFT_PREFIX + name] = arr
    return out


def save_peft(
    params: Mapping[str, Any],
    config: BertConfig,
    out_dir: str | Path,
    *,
    base_model: str | None,
    base_has_pooler: bool = True,
    tokenizer_dir: str | Path | None = None,
) -> Path:
    """Writes a PEFT adapter directory (adapter_config.json, adapter_model.safetensors) that
    `peft.PeftModel.from_pretrained(base, out_dir)` loads onto the base model, `base_model` (a hub
    id, so that it loads elsewhere, or a path). The head is saved whole; so is the pooler when
    the base checkpoint lacks one (ours was then drawn from the run's seed, which the base
    model's fresh pooler would not equal). With `tokenizer_dir`, the base's tokenizer files go
    beside the adapter (`AutoTokenizer.from_pretrained(out_dir)` loads them). Written into a
    temporary sibling and renamed into place, like `hf_checkpoint.save_pretrained`."""
    if config.lora is None:
        raise UserError("--peft exports LoRA adapters; this run has none (train with --lora-rank)")
    modules = ["classifier"] + ([] if base_has_pooler or config.head != "sequence" else ["pooler"])
    tensors = peft_tensors(params, config, modules)

    def fill(tmp: Path) -> None:
        cfg = peft_config(config, base_model, modules)
        (tmp / "adapter_config.json").write_text(json.dumps(cfg, indent=2) + "\n")
        save_file(tensors, str(tmp / "adapter_model.safetensors"), metadata={"format": "pt"})
        if tokenizer_dir is not None:
            hf_checkpoint.copy_tokenizer(tokenizer_dir, tmp, standalone=True)

    return replace_dir(out_dir, fill, "adapter_config.json", "an adapter directory")
