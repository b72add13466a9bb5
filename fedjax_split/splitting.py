"""The global/local split of a parameter tree, as a rule over "/"-joined parameter paths.

FedSplitBERT's critical layer c is one rule (embeddings and encoder layers 0..c-1 global, the rest
local); head-only personalisation (FedPer) and user regexes are others. Every rule is a predicate
`path -> is_global`, so splitting, merging and byte counting never need to know which method runs.
The functions work on any nested dict of arrays, including trees stacked on a leading client axis.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from typing import Any

from fedjax_split.errors import UserError

Rule = Callable[[str], bool]
"""A split rule: maps a parameter path such as "encoder/layer_3/output/kernel" to True (global)."""

_LAYER_RE = re.compile(r"^encoder/layer_(\d+)(/|$)")


def flatten_paths(tree: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    """Flattens a nested dict into {"a/b/c": leaf}; empty sub-dicts vanish."""
    flat: dict[str, Any] = {}
    for key, value in tree.items():
        path = f"{prefix}{key}"
        if isinstance(value, Mapping):
            flat.update(flatten_paths(value, path + "/"))
        else:
            flat[path] = value
    return flat


def unflatten_paths(flat: Mapping[str, Any]) -> dict[str, Any]:
    """Inverse of `flatten_paths`."""
    tree: dict[str, Any] = {}
    for path, value in flat.items():
        node = tree
        *parents, leaf = path.split("/")
        for key in parents:
            node = node.setdefault(key, {})
        node[leaf] = value
    return tree


def num_layers(params: Mapping[str, Any]) -> int:
    """Number of encoder layers, counted from the `encoder/layer_i` keys of the tree."""
    encoder = params.get("encoder", {})
    indices = sorted(int(m.group(1)) for k in encoder if (m := re.fullmatch(r"layer_(\d+)", k)))
    if indices != list(range(len(indices))):
        raise UserError(
            f"encoder layers {indices} are not numbered 0..L-1; pass a parameter tree from "
            "fedjax_split.model or hf_checkpoint"
        )
    return len(indices)


def critical_layer_rule(critical_layer: int, num_layers: int) -> Rule:
    """FedSplitBERT's rule: global = embeddings + encoder layers 0..c-1 (the paper's 1..c).

    c = L makes everything global (pooler and head too: FedAvg); c = 0 makes everything local
    (embeddings too: isolated training, nothing communicated).
    """
    if isinstance(critical_layer, bool) or not isinstance(critical_layer, int):
        raise UserError(
            f"critical layer must be an integer, got {critical_layer!r}; use 0..{num_layers}"
        )
    if not 0 <= critical_layer <= num_layers:
        raise UserError(
            f"critical layer {critical_layer} is outside 0..{num_layers} for this "
            f"{num_layers}-layer model; choose c in 0..{num_layers}"
        )
    if critical_layer == num_layers:
        return lambda path: True
    if critical_layer == 0:
        return lambda path: False

    def rule(path: str) -> bool:
        if path.startswith("embeddings/"):
            return True
        match = _LAYER_RE.match(path)
        return match is not None and int(match.group(1)) < critical_layer

    return rule


def head_only_rule(include_pooler: bool = False) -> Rule:
    """FedPer-style personalisation: only the classifier head is local, the whole body global.

    The pooler stays global by default because it belongs to the pretrained BERT body (it is part of
    `BertModel`, not of the task head); `include_pooler=True` keeps it local as well.
    """
    local_prefixes = ("classifier/", "pooler/") if include_pooler else ("classifier/",)
    return lambda path: not path.startswith(local_prefixes)


def regex_rule(pattern: str) -> Rule:
    """Paths in which `pattern` is found (`re.search`) are global, all others local."""
    try:
        compiled = re.compile(pattern)
    except re.error as err:
        raise UserError(f"invalid split regex {pattern!r} ({err}); pass a Python regex") from None
    return lambda path: compiled.search(path) is not None


def split_params(
    params: Mapping[str, Any], critical_layer: int | None = None, *, rule: Rule | None = None
) -> tuple[dict[str, Any], dict[str, Any]]:
    """Splits `params` into (global, local) nested dicts holding only their own leaves.

    Give either `critical_layer` (FedSplitBERT; L is read from the tree) or a `rule`. A side with no
    leaves is `{}` (the global part for c = 0, the local part for c = L).
    """
    if (critical_layer is None) == (rule is None):
        raise UserError("give exactly one of critical_layer or rule to split_params")
    if rule is None:
        rule = critical_layer_rule(critical_layer, num_layers(params))
    global_flat: dict[str, Any] = {}
    local_flat: dict[str, Any] = {}
    for path, leaf in flatten_paths(params).items():
        (global_flat if rule(path) else local_flat)[path] = leaf
    return unflatten_paths(global_flat), unflatten_paths(local_flat)


def merge_params(global_params: Mapping[str, Any], local_params: Mapping[str, Any]) -> dict:
    """Exact inverse of `split_params`: the union of both trees (a leaf in both is a bug)."""
    global_flat = flatten_paths(global_params)
    local_flat = flatten_paths(local_params)
    overlap = global_flat.keys() & local_flat.keys()
    if overlap:
        raise ValueError(f"parameters in both the global and the local part: {sorted(overlap)}")
    return unflatten_paths({**global_flat, **local_flat})
