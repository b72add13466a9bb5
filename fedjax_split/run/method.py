"""The method a run's settings make, said as a person would, on the run's first line.

Why: the same flags make FedAvg, FedSplitBERT or isolated training depending on the model's
depth, and a run that silently became another method wastes its hours; the first line says which.
"""

from __future__ import annotations

from typing import Any

from fedjax_split.fed.algorithms import get as get_algorithm
from fedjax_split.models.lora import candidates

_WIRE = {"fp16": "float16", "bf16": "bfloat16"}


def _layers(first: int, last: int) -> str:
    """'layer 3' or 'layers 1-3' (1-based, as the paper counts)."""
    return f"layer {first}" if first == last else f"layers {first}-{last}"


def describe(
    algorithm: str,
    critical_layer: int,
    num_layers: int,
    *,
    quantize: str = "none",
    num_frozen: int = 0,
    freeze: str | None = None,
    mu: float = 0.0,
    lora: Any = None,
    cycle: int | None = None,
) -> str:
    """E.g. "FedSplitBERT, c = 3 of 6: embeddings + layers 1-3 shared, layers 4-6 + head
    personal". The server algorithm is named when it is not FedAvg; the wire dtype and frozen
    parameters are added when set; with LoRA (`lora`, the model's BertConfig), what is shared
    and personal are the adapters and the head, and the base weights frozen are not listed.
    With FedBT's schedule (`cycle`: its cycle factor) the line says which layers each round
    trains."""
    algo = get_algorithm(algorithm)
    title = algo.title or algo.name
    if algo.prox:
        title = f"{title} (mu = {mu:g})"
    c, big_l = critical_layer, num_layers
    if cycle is not None:
        line = _fedbt(algo, title, cycle, big_l, quantize)
        return line + (f"; --freeze {freeze!r}: {num_frozen:,} parameters frozen in all"
                       if freeze else "")  # fmt: skip
    # what the shares are made of: whole layers, or (LoRA) the adapters in them
    whole, lower, upper = (
        ("the whole model", "embeddings + ", "") if lora is None
        else ("every adapter + head", "adapters of ", " adapters")
    )  # fmt: skip
    if c == 0:
        line = "isolated training (c = 0): nothing shared, each client trains its own model"
    elif c == big_l:
        line = f"{title}: {whole} shared (c = L = {big_l})"
    else:
        name = "FedSplitBERT" if algo.name == "fedavg" else f"FedSplitBERT with {title}"
        line = (
            f"{name}, c = {c} of {big_l}: {lower}{_layers(1, c)} shared, "
            f"{_layers(c + 1, big_l)}{upper} + head personal"
        )
    if lora is not None:
        names = candidates(lora)
        adapters = lora.lora
        where = dict.fromkeys(names[t].split(".", 4)[-1] for t in adapters.targets)
        line += (
            f"; LoRA r = {adapters.rank}, alpha = {adapters.alpha:g} on {', '.join(where)} "
            "(base weights frozen)"
        )
    if c > 0 and quantize in _WIRE:
        line += f"; sent as {_WIRE[quantize]}"
    if num_frozen and lora is None:
        regex = f" (--freeze {freeze!r})" if freeze else ""
        line += f"; {num_frozen:,} parameters frozen{regex}"
    return line


def client_words(optimizer: str, lr: float, schedule: str, warmup_ratio: float,
                 clip_norm: float | None) -> str:  # fmt: skip
    """The client optimiser, said when it is not the default AdamW at a constant rate: e.g. ";
    clients: SGD at lr 5e-05, linear warm-up (6%) and decay each round, gradients clipped to norm
    1". Empty for the default, whose rate every run's config.json holds."""
    if optimizer == "adamw" and schedule == "constant" and clip_norm is None:
        return ""
    words = [f"{'SGD' if optimizer == 'sgd' else 'AdamW'} at lr {lr:g}"]
    if schedule == "linear":
        warm = f"warm-up ({warmup_ratio:.0%}) and " if warmup_ratio else ""
        words.append(f"linear {warm}decay each round")
    if clip_norm is not None:
        words.append(f"gradients clipped to norm {clip_norm:g}")
    return "; clients: " + ", ".join(words)


def _fedbt(algo: Any, title: str, cycle: int, num_layers: int, quantize: str) -> str:
    """E.g. "FedBT fine-tuning, cycle of 3 of 6 layers: round 1 trains layer 6 + head, round 2
    layers 5-6 + head, round 3 layers 4-6 + head, then again; embeddings + layers 1-3 frozen;
    only the trained part is uploaded"."""
    name = "FedBT fine-tuning" if algo.name == "fedavg" else f"FedBT fine-tuning with {title}"
    rounds = [f"round {k} trains {_layers(num_layers - k + 1, num_layers)} + head"
              for k in range(1, cycle + 1)]  # fmt: skip
    if cycle > 3:
        rounds = [rounds[0], "...", rounds[-1]]
    below = "embeddings" + (f" + {_layers(1, num_layers - cycle)}" if cycle < num_layers else "")
    line = (f"{name}, cycle of {cycle} of {num_layers} layers: {', '.join(rounds)}, then again; "
            f"{below} frozen; only the trained part is uploaded")  # fmt: skip
    if quantize in _WIRE:
        line += f"; sent as {_WIRE[quantize]}"
    return line
