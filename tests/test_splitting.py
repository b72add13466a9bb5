"""Tests for the global/local split: exact inverse, the critical-layer rule, other rules."""

from __future__ import annotations

import numpy as np
import pytest

from fedjax_split.errors import UserError
from fedjax_split.splitting import (
    critical_layer_rule,
    flatten_paths,
    head_only_rule,
    merge_params,
    num_layers,
    regex_rule,
    split_params,
)

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
    assert rule("encoder/layer_1/output/bias")
    assert not rule("encoder/layer_10/output/bias")
    assert not rule("encoder/layer_2/output/bias")
    assert rule("embeddings/LayerNorm/scale")
    assert not rule("pooler/dense/kernel") and not rule("classifier/bias")


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
    with pytest.raises(ValueError, match="both"):
        merge_params(params, {"classifier": params["classifier"]})
