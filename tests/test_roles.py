"""Tests for parameter roles: exact inverse, the critical-layer rule, other rules, --freeze over
Hugging Face names, schedules."""

from __future__ import annotations

import numpy as np
import pytest

from fedjax_split.errors import UserError
from fedjax_split.fed.roles import (
    FROZEN,
    GLOBAL,
    LOCAL,
    critical_layer_rule,
    flatten_paths,
    freeze_rule,
    head_only_rule,
    layer_filter,
    merge_params,
    name_filter,
    num_layers,
    partition,
    paths_where,
    regex_rule,
    role_labels,
    select,
    split_params,
)
from fedjax_split.models.bert import BertConfig
from fedjax_split.models.hf_checkpoint import hf_names

L = 3


def _tree(rng: np.random.Generator, lead: tuple[int, ...] = ()) -> dict:
    """A BERT-shaped parameter tree (architecture.md layout) with distinct random leaves."""

    def a(*shape: int) -> np.ndarray:
        return rng.standard_normal(lead + shape).astype(np.float32)

    def dense(i: int, o: int) -> dict:
        return {"kernel": a(i, o), "bias": a(o)}

    def ln() -> dict:
        return {"scale": a(4), "bias": a(4)}

    layer = lambda: {  # noqa: E731
        "attention": {
            "query": dense(4, 4),
            "key": dense(4, 4),
            "value": dense(4, 4),
            "output": dense(4, 4),
            "LayerNorm": ln(),
        },
        "intermediate": dense(4, 8),
        "output": dense(8, 4),
        "LayerNorm": ln(),
    }
    return {
        "embeddings": {
            "word_embeddings": {"embedding": a(10, 4)},
            "position_embeddings": {"embedding": a(6, 4)},
            "token_type_embeddings": {"embedding": a(2, 4)},
            "LayerNorm": ln(),
        },
        "encoder": {f"layer_{i}": layer() for i in range(L)},
        "pooler": {"dense": dense(4, 4)},
        "classifier": dense(4, 3),
    }


def _assert_same(a: dict, b: dict) -> None:
    fa, fb = flatten_paths(a), flatten_paths(b)
    assert sorted(fa) == sorted(fb)
    for k in fa:
        assert fa[k] is fb[k], k  # the very same arrays: split/merge never copy or cast


def _expected_global_prefixes(c: int) -> tuple[str, ...]:
    if c == L:
        return ("",)
    if c == 0:
        return ()
    return ("embeddings/",) + tuple(f"encoder/layer_{i}/" for i in range(c))


@pytest.mark.parametrize("c", range(L + 1))
def test_split_merge_inverse_and_membership(c: int) -> None:
    params = _tree(np.random.default_rng(0))
    g, loc = split_params(params, critical_layer=c)
    _assert_same(merge_params(g, loc), params)
    prefixes = _expected_global_prefixes(c)
    all_paths = flatten_paths(params)
    want_global = {p for p in all_paths if any(p.startswith(q) for q in prefixes)}
    assert set(flatten_paths(g)) == want_global
    assert set(flatten_paths(loc)) == set(all_paths) - want_global
    if c == 0:
        assert g == {}
    if c == L:
        assert loc == {}
    if 0 < c < L:
        assert set(loc) == {"encoder", "pooler", "classifier"}
        assert sorted(loc["encoder"]) == [f"layer_{i}" for i in range(c, L)]


def test_split_works_on_client_stacked_trees() -> None:
    params = _tree(np.random.default_rng(1), lead=(5,))
    g, loc = split_params(params, critical_layer=2)
    assert g["encoder"]["layer_1"]["output"]["kernel"].shape == (5, 8, 4)
    _assert_same(merge_params(g, loc), params)


def test_num_layers_and_rule_validation() -> None:
    params = _tree(np.random.default_rng(2))
    assert num_layers(params) == L
    for bad in (-1, L + 1):
        with pytest.raises(UserError, match=r"0\.\.3"):
            split_params(params, critical_layer=bad)
    with pytest.raises(UserError, match="integer"):
        critical_layer_rule(1.5, L)  # type: ignore[arg-type]
    with pytest.raises(UserError, match="exactly one"):
        split_params(params)
    with pytest.raises(UserError, match="exactly one"):
        split_params(params, critical_layer=1, rule=head_only_rule())


def test_layer_rule_does_not_confuse_layer_1_and_layer_10() -> None:
    rule = critical_layer_rule(2, 12)
    assert rule("encoder/layer_1/output/bias") == GLOBAL
    assert rule("encoder/layer_10/output/bias") == LOCAL
    assert rule("encoder/layer_2/output/bias") == LOCAL
    assert rule("embeddings/LayerNorm/scale") == GLOBAL
    assert rule("pooler/dense/kernel") == LOCAL and rule("classifier/bias") == LOCAL


def test_head_only_rule() -> None:
    params = _tree(np.random.default_rng(3))
    g, loc = split_params(params, rule=head_only_rule())
    assert set(loc) == {"classifier"} and set(g) == {"embeddings", "encoder", "pooler"}
    g, loc = split_params(params, rule=head_only_rule(include_pooler=True))
    assert set(loc) == {"classifier", "pooler"}
    _assert_same(merge_params(g, loc), params)


def test_regex_rule() -> None:
    params = _tree(np.random.default_rng(4))
    g, loc = split_params(params, rule=regex_rule(r"LayerNorm"))
    assert all("LayerNorm" in p for p in flatten_paths(g))
    assert not any("LayerNorm" in p for p in flatten_paths(loc))
    assert len(flatten_paths(g)) == 2 + 2 * 2 * L
    with pytest.raises(UserError, match="regex"):
        regex_rule("(")


def test_merge_rejects_overlap() -> None:
    params = _tree(np.random.default_rng(5))
    with pytest.raises(ValueError, match="two parts"):
        merge_params(params, {"classifier": params["classifier"]})


def _names() -> dict[str, str]:
    config = BertConfig(
        vocab_size=10,
        hidden_size=4,
        num_hidden_layers=L,
        num_attention_heads=1,
        intermediate_size=8,
        max_position_embeddings=6,
        num_labels=3,
    )
    return {path: name for path, (name, _) in hf_names(config).items()}


def test_names_cover_the_test_tree() -> None:
    # the freeze tests below match HF names, so every path of the tree must have one
    assert set(_names()) == set(flatten_paths(_tree(np.random.default_rng(0))))


@pytest.mark.parametrize("c", [0, 2, L])
def test_freeze_over_hf_names_wins_over_the_critical_layer(c: int) -> None:
    params = _tree(np.random.default_rng(6))
    rule = freeze_rule(critical_layer_rule(c, L), r"embeddings\.|encoder\.layer\.[0-1]\.", _names())
    parts = partition(params, rule)
    paths = set(flatten_paths(params))
    frozen = {
        p for p in paths if p.startswith(("embeddings/", "encoder/layer_0/", "encoder/layer_1/"))
    }
    assert set(flatten_paths(parts.frozen)) == frozen
    unfrozen_global = {p for p in paths - frozen if critical_layer_rule(c, L)(p) == GLOBAL}
    assert set(flatten_paths(parts.global_)) == unfrozen_global
    assert set(flatten_paths(parts.local)) == paths - frozen - unfrozen_global
    _assert_same(merge_params(*parts), params)  # the very same arrays: no copy, no cast


def test_freeze_matches_names_not_paths_and_composes_with_any_rule() -> None:
    names = _names()
    assert (
        names["encoder/layer_1/attention/query/kernel"]
        == "encoder.layer.1.attention.self.query.weight"
    )
    rule = freeze_rule(head_only_rule(), r"attention\.self\.query\.weight$", names)
    assert rule("encoder/layer_1/attention/query/kernel") == FROZEN
    assert rule("encoder/layer_1/attention/query/bias") == GLOBAL  # 'bias', not 'weight'
    assert rule("classifier/kernel") == LOCAL
    # our path spelling ("layer_1") does not match the HF-name regex
    assert freeze_rule(head_only_rule(), r"layer_1", names)("encoder/layer_1/output/bias") == GLOBAL
    assert freeze_rule(head_only_rule(), None) is not None
    with pytest.raises(UserError, match="--freeze"):
        freeze_rule(head_only_rule(), "(")


def test_split_params_refuses_a_freezing_rule_and_labels_are_checked() -> None:
    params = _tree(np.random.default_rng(7))
    with pytest.raises(ValueError, match="partition"):
        split_params(params, rule=lambda p: FROZEN if p.startswith("pooler/") else GLOBAL)
    with pytest.raises(ValueError, match="roles are"):
        role_labels(params, lambda p: "shared")
    labels = role_labels(params, critical_layer_rule(1, L))
    assert labels["encoder/layer_0/output/bias"] == GLOBAL
    assert labels["encoder/layer_1/output/bias"] == LOCAL


def test_select_by_layer_filters() -> None:
    """The paths a FedBFPT round trains, one layer a round and the head, chosen by a filter."""
    params = _tree(np.random.default_rng(8))
    g = partition(params, critical_layer_rule(L, L)).global_
    paths = frozenset(flatten_paths(g))
    for layer in range(L):
        trained = paths_where(g, layer_filter([layer], always=("classifier/",)))
        assert trained == {
            p for p in paths if p.startswith((f"encoder/layer_{layer}/", "classifier/"))
        }
        chosen, rest = select(g, trained)
        assert set(flatten_paths(chosen)) == trained
        _assert_same(merge_params(chosen, rest), params)
    assert paths_where(g, layer_filter(None)) == paths
    assert paths_where(g, layer_filter([])) == frozenset()
    everything, nothing = select(g, None)
    assert everything == g and nothing == {}


def test_name_filter_matches_the_names_users_know() -> None:
    path = "encoder/layer_0/attention/query/kernel"
    names = {path: "encoder.layer.0.attention.self.query.weight"}
    keep = name_filter(r"self\.query", names)
    assert keep("encoder/layer_0/attention/query/kernel")
    assert not keep("encoder/layer_0/attention/key/kernel")
    assert name_filter("pooler")("pooler/dense/bias")  # no name: the path itself
    with pytest.raises(UserError, match="invalid --freeze regex"):
        name_filter("(")


def test_train_only_freezes_every_path_it_does_not_select() -> None:
    """The rule keeps its role for the selected paths (a head-only rule here: the head local,
    the rest global) and everything else is frozen, whatever the rule said."""
    from fedjax_split.fed.roles import partition, train_only

    params = _tree(np.random.default_rng(5))
    selected = lambda p: p.startswith(("classifier/", "encoder/layer_0/"))  # noqa: E731
    parts = partition(params, train_only(head_only_rule(), selected))
    assert set(parts.local) == {"classifier"}
    assert set(flatten_paths(parts.global_)) == {
        p for p in flatten_paths(params) if p.startswith("encoder/layer_0/")
    }
    assert set(flatten_paths(parts.frozen)) == {
        p for p in flatten_paths(params) if not selected(p)
    }
    _assert_same(merge_params(*parts), params)
