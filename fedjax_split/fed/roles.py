"""Parameter roles: every parameter is global, local or frozen, by a rule over its path.

- global: trained by every sampled client, aggregated by the server, sent both ways;
- local: trained by its own client only, never sent (FedSplitBERT's upper layers and head);
- frozen: neither trained nor sent; one copy, the same on every client (FedNLP's frozen
  embeddings and lower layers).

A rule maps a "/"-joined parameter path ("encoder/layer_3/output/kernel") to a role, so that
FedSplitBERT's critical layer, head-only personalisation (FedPer), user regexes and frozen parts
are one mechanism, and splitting, merging and byte counting never need to know which method runs.
The same path filters choose every other set of parameters: the parameters --freeze names (by
their Hugging Face tensor names, `name_filter`) and the ones a round trains (FedBFPT's one layer
and head, `layer_filter`); the rest of the global part stays exactly as the server holds it.

The functions work on any nested dict of arrays, including trees stacked on a leading client axis.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any, NamedTuple

from fedjax_split.errors import UserError

GLOBAL, LOCAL, FROZEN = "global", "local", "frozen"
ROLES = (GLOBAL, LOCAL, FROZEN)

Rule = Callable[[str], str]
"""A role rule: maps a parameter path such as "encoder/layer_3/output/kernel" to a role."""

Filter = Callable[[str], bool]
"""A path filter: whether a parameter path belongs to a set (trained this round, frozen, ...)."""

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
            "fedjax_split.models"
        )
    return len(indices)


def layer_index(path: str) -> int | None:
    """The encoder layer a path belongs to (None for embeddings, pooler and heads)."""
    match = _LAYER_RE.match(path)
    return None if match is None else int(match.group(1))


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
        return lambda path: GLOBAL
    if critical_layer == 0:
        return lambda path: LOCAL

    def rule(path: str) -> str:
        if path.startswith("embeddings/"):
            return GLOBAL
        layer = layer_index(path)
        return GLOBAL if layer is not None and layer < critical_layer else LOCAL

    return rule


def head_only_rule(include_pooler: bool = False) -> Rule:
    """FedPer-style personalisation: only the task head is local, the whole body global.

    The pooler stays global by default because it belongs to the pretrained BERT body (it is part of
    `BertModel`, not of the task head); `include_pooler=True` keeps it local as well.
    """
    local_prefixes = ("classifier/", "pooler/") if include_pooler else ("classifier/",)
    return lambda path: LOCAL if path.startswith(local_prefixes) else GLOBAL


def _compile(pattern: str, what: str) -> re.Pattern[str]:
    try:
        return re.compile(pattern)
    except re.error as err:
        raise UserError(f"invalid {what} regex {pattern!r} ({err}); pass a Python regex") from None


def regex_rule(pattern: str) -> Rule:
    """Paths in which `pattern` is found (`re.search`) are global, all others local."""
    compiled = _compile(pattern, "split")
    return lambda path: GLOBAL if compiled.search(path) is not None else LOCAL


def name_filter(
    pattern: str, names: Mapping[str, str] | None = None, what: str = "--freeze"
) -> Filter:
    """Paths whose name matches `pattern` (`re.search`): `names` maps our paths to the names users
    know (Hugging Face tensor names such as "embeddings.word_embeddings.weight"); paths without a
    name are matched as they are. A bad regex is a UserError naming `what`."""
    compiled = _compile(pattern, what)
    names = names or {}
    return lambda path: compiled.search(names.get(path, path)) is not None


def layer_filter(layers: Iterable[int] | None, always: Sequence[str] = ()) -> Filter:
    """Paths in the encoder layers `layers` (None: every path) or under a prefix in `always`
    (e.g. a head that trains with every layer)."""
    if layers is None:
        return lambda path: True
    wanted, prefixes = frozenset(layers), tuple(always)
    return lambda path: layer_index(path) in wanted or path.startswith(prefixes)


def paths_where(tree: Mapping[str, Any], keep: Filter) -> frozenset[str]:
    """The paths of `tree`'s leaves that `keep` selects."""
    return frozenset(p for p in flatten_paths(tree) if keep(p))


def freeze_rule(rule: Rule, pattern: str | None, names: Mapping[str, str] | None = None) -> Rule:
    """`rule` with every parameter whose name matches `pattern` frozen instead (`name_filter`).
    Frozen wins over the rule's role, so `--freeze` composes with any critical layer."""
    if not pattern:
        return rule
    frozen = name_filter(pattern, names)
    return lambda path: FROZEN if frozen(path) else rule(path)


def train_only(rule: Rule, trainable: Filter) -> Rule:
    """`rule` on the paths `trainable` selects, every other path frozen: LoRA's roles
    (`models.lora.trainable`: the adapters and the head train, split by the critical layer as the
    layers they sit in; every pretrained weight is frozen, one copy, never trained or sent)."""
    return lambda path: rule(path) if trainable(path) else FROZEN


def role_labels(params: Mapping[str, Any], rule: Rule) -> dict[str, str]:
    """{path: role} for every leaf of `params` (checked to be one of ROLES)."""
    labels = {}
    for path in flatten_paths(params):
        role = rule(path)
        if role not in ROLES:
            raise ValueError(f"rule gave {role!r} for {path!r}; roles are {', '.join(ROLES)}")
        labels[path] = role
    return labels


class Parts(NamedTuple):
    """A parameter tree cut by role: each part holds only its own leaves ({} when none)."""

    global_: dict[str, Any]
    local: dict[str, Any]
    frozen: dict[str, Any]


def partition(params: Mapping[str, Any], rule: Rule) -> Parts:
    """Cuts `params` into its global, local and frozen parts (the very same arrays, no copy)."""
    flat = {role: {} for role in ROLES}
    for path, leaf in flatten_paths(params).items():
        role = rule(path)
        if role not in ROLES:
            raise ValueError(f"rule gave {role!r} for {path!r}; roles are {', '.join(ROLES)}")
        flat[role][path] = leaf
    return Parts(*(unflatten_paths(flat[role]) for role in ROLES))


def split_params(
    params: Mapping[str, Any], critical_layer: int | None = None, *, rule: Rule | None = None
) -> tuple[dict[str, Any], dict[str, Any]]:
    """Splits `params` into (global, local) for a rule without frozen parameters.

    Give either `critical_layer` (FedSplitBERT; L is read from the tree) or a `rule`. A side with no
    leaves is `{}` (the global part for c = 0, the local part for c = L). Use `partition` for rules
    that freeze.
    """
    if (critical_layer is None) == (rule is None):
        raise UserError("give exactly one of critical_layer or rule to split_params")
    if rule is None:
        rule = critical_layer_rule(critical_layer, num_layers(params))
    parts = partition(params, rule)
    if parts.frozen:
        raise ValueError("the rule freezes parameters; use roles.partition for three parts")
    return parts.global_, parts.local


def merge_params(*parts: Mapping[str, Any]) -> dict:
    """Exact inverse of `partition`/`split_params`: the union of the parts (no leaf in two)."""
    merged: dict[str, Any] = {}
    for part in parts:
        flat = flatten_paths(part)
        overlap = merged.keys() & flat.keys()
        if overlap:
            raise ValueError(f"parameters in two parts at once: {sorted(overlap)}")
        merged.update(flat)
    return unflatten_paths(merged)


def select(tree: Mapping[str, Any], paths: frozenset[str] | None) -> tuple[dict, dict]:
    """(the leaves of `tree` whose paths are in `paths`, the others); `paths` None selects all."""
    if paths is None:
        return dict(tree), {}
    chosen, rest = {}, {}
    for path, leaf in flatten_paths(tree).items():
        (chosen if path in paths else rest)[path] = leaf
    return unflatten_paths(chosen), unflatten_paths(rest)
