"""Pretrain's config: defaults are the released FedBFPT setting, every setting has one flag,
one-line errors for impossible settings, the small model's depth against the schedule."""

from __future__ import annotations

import pytest

from fedjax_split import pretrain
from fedjax_split.errors import UserError
from fedjax_split.run.pretrain_config import FIELDS, PretrainConfig, check_depth, resolve


def test_defaults_are_the_released_setting() -> None:
    c = PretrainConfig()
    fed, client = c.federation, c.client
    assert (fed.method, fed.clients, fed.rounds, client.local_epochs, client.batch_size,
            client.lr) == ("fedbfpt", 6, 5, 1, 256, 5e-5)  # fmt: skip
    assert (c.data.max_length, c.data.mlm_probability, client.weight_decay, fed.schedule) == (
        128, 0.15, 0.01, "halving",
    )  # fmt: skip
    assert str(c.run_dir) == "runs/pretrain_pubmed_fedbfpt_K6_s0"
    assert check_depth(c, 12) == (6, 6)  # L/2, as the released 6 of 12


def test_help_lists_every_corpus() -> None:
    from fedjax_split.data.text.text_corpora import CORPORA

    text = " ".join(pretrain.build_parser().format_help().split())  # argparse wraps lines
    for name in CORPORA:
        assert name in text, name


def test_one_flag_per_setting() -> None:
    parser = pretrain.build_parser()
    assert {a.dest for a in parser._actions} - {"help"} == set(FIELDS)
    got = pretrain.config_from_args(["--method", "bert-fl", "--small-layers", "3", "--rounds", "2"])
    fed = got.federation
    assert (fed.method, got.model.small_layers, fed.rounds) == ("bert-fl", 3, 2)


@pytest.mark.parametrize(
    ("change", "needle"),
    [
        ({"corpus": "wiki"}, "unknown corpus"),
        ({"method": "fedsplit"}, "pass --method one of"),
        ({"clients": 0}, "--clients must be at least 1"),
        ({"mlm_probability": 1.0}, "--mlm-probability"),
        ({"heldout_fraction": 0.0}, "--heldout-fraction"),
        ({"corpus": "local"}, "needs --data-dir"),
        ({"data_dir": "/no/such/dir"}, "does not exist"),
        ({"truncated_layers": 0}, "--truncated-layers must be at least 1"),
    ],
)
def test_bad_settings(change: dict, needle: str) -> None:
    with pytest.raises(UserError, match=needle):
        resolve(overrides=change)


def test_depth_checks() -> None:
    # 5 rounds of halving reach layer 2: a 3-layer small model holds it, a 2-layer one does not
    assert check_depth(resolve(overrides={"small_layers": 3}), 6) == (3, 3)
    with pytest.raises(UserError, match="reaches layer 2"):
        check_depth(resolve(overrides={"small_layers": 2}), 6)
    with pytest.raises(UserError, match="reaches layer 4"):
        check_depth(resolve(overrides={"rounds": 20}), 6)  # 20 rounds: layers up to 4
    assert check_depth(resolve(overrides={"rounds": 20, "method": "bert-fl"}), 6) == (3, 3)
    with pytest.raises(UserError, match="--truncated-layers 7 is outside 1..6"):
        check_depth(resolve(overrides={"method": "truncated", "truncated_layers": 7}), 6)


def test_site_data_implies_local_text_and_one_client_per_site(tmp_path) -> None:
    a, b = tmp_path / "a", tmp_path / "b"
    a.mkdir(), b.mkdir()
    got = resolve(overrides={"site_data": f"{a},{b}"})
    assert (got.data.corpus, got.federation.clients, got.data.data_dir) == ("local", 2, None)
    # real sites (--write-app): each SuperNode knows its own directory, --clients is given
    assert resolve(overrides={"site_data": "node-config", "clients": 3}).federation.clients == 3


@pytest.mark.parametrize(
    ("change", "needle"),
    [
        ({"corpus": "pubmed"}, "--corpus pubmed with --site-data"),
        ({"split": "quantity"}, "--split quantity with --site-data"),
        ({"sigma": 0.9}, "--sigma 0.9 with --site-data"),
        ({"max_documents": 10}, "--max-documents 10 with --site-data"),
        ({"data_dir": "."}, "--data-dir . with --site-data"),
        ({"clients": 3}, "--clients 3 but --site-data names 2 sites"),
        ({"site_data": "{a},/no/such/site"}, "site 1's directory '/no/such/site' does not exist"),
        ({"site_data": "{a},{a}"}, "names .* twice"),
        ({"site_data": "{a},"}, "has an empty entry"),
    ],
)
def test_bad_site_settings(tmp_path, change: dict, needle: str) -> None:
    a, b = tmp_path / "a", tmp_path / "b"
    a.mkdir(), b.mkdir()
    sites = change.pop("site_data", "{a},{b}").format(a=a, b=b)
    with pytest.raises(UserError, match=needle):
        resolve(overrides={"site_data": sites, **change})
